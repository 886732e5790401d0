"""plan.estimate_memory against measured peaks, activation offload's cost in step time, and
the CPU AdamW step that CPU offload runs. One GPU, one process (a group of one).

    python bench/memory.py                 # both parts
    python bench/memory.py --part memory   # or adamw

Each configuration: 3 training steps (fwd, bwd, clip, fused AdamW step); the third is
measured (peak torch.cuda.max_memory_allocated, step time), so AdamW's states exist. The
step times of the same shape with and without activation offload give its cost.
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import REFERENCE_OPS, Llama, ModelArgs, triton_ops  # noqa: E402
from offload import activation_offload, apply_ac  # noqa: E402
from optim import clip_grad_norm_  # noqa: E402
from plan import Plan, estimate_memory  # noqa: E402
from shard import apply_fsdp, build_mesh, init_distributed, materialize  # noqa: E402

GiB = 2**30


def kernel_ops():
    """The Triton kernels when kernels/ has them, else the references (and say so)."""
    try:
        return triton_ops(), True
    except (ImportError, AttributeError) as e:
        print(f"Triton kernels unavailable ({e}); using the references")
        return REFERENCE_OPS, False


def run(dist, preset, seq, ac, act_offload, cpu_offload=False, batch=1, steps=3):
    args = ModelArgs.from_name(preset)
    ops, kernels = kernel_ops()
    with torch.device("meta"):
        model = Llama(args, ops)
    apply_ac(model, ac)
    apply_fsdp(model, build_mesh("FULL_SHARD", dist), "FULL_SHARD", cpu_offload=cpu_offload)
    materialize(model, dist, seed=0, cpu_offload=cpu_offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), device=dist.device)
    for step in range(steps):
        if step == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        with activation_offload(model, enabled=act_offload):
            loss = model(tokens, tokens)
        loss.backward()
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / GiB
    reserved = torch.cuda.max_memory_reserved() / GiB
    plan = Plan(seq, batch, ac=ac, activation_offload=act_offload, cpu_offload=cpu_offload,
                kernels=kernels)  # fmt: skip
    est = estimate_memory(args, plan)
    del model, optimizer, loss
    gc.collect()
    torch.cuda.empty_cache()
    return est, peak, reserved, step_s, kernels


def part_memory(dist):
    print(
        "| preset | seq | AC | act. offload | CPU offload | kernels | estimate (tensors) GiB "
        "| measured peak allocated GiB | est/measured | peak reserved GiB | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    configs = [
        ("tiny", 2048, "none", False, False),
        ("llama3.2-1b", 4096, "none", False, False),
        ("llama3.2-1b", 4096, "full", False, False),
        ("llama3.2-1b", 16384, "full", False, False),
        ("llama3.2-1b", 16384, "selective", False, False),
        ("llama3.2-1b", 16384, "none", False, False),
        ("llama3.2-1b", 16384, "full", True, False),
        ("llama3.2-1b", 16384, "none", True, False),
        ("llama3.2-1b", 16384, "full", False, True),
        ("llama3.2-1b", 32768, "full", False, False),
        ("llama3.2-1b", 32768, "full", True, False),
        ("llama3.2-1b", 32768, "none", False, False),
    ]
    for preset, seq, ac, act_off, cpu_off in configs:
        try:
            est, peak, reserved, step_s, kernels = run(dist, preset, seq, ac, act_off, cpu_off)
        except torch.OutOfMemoryError:
            est = None
        if est is None:
            print(f"| {preset} | {seq} | {ac} | {act_off} | {cpu_off} | | OOM |")
            gc.collect()
            torch.cuda.empty_cache()
            continue
        print(f"| {preset} | {seq} | {ac} | {act_off} | {cpu_off} | {kernels} | "
              f"{est.gpu_tensors:.2f} | {peak:.2f} | {est.gpu_tensors / peak:.2f} | "
              f"{reserved:.2f} | {step_s:.3f} |", flush=True)  # fmt: skip
        if preset == "llama3.2-1b" and seq == 16384 and ac == "full" and not act_off:
            print(est.format().replace("\n", "\n    "))


def part_adamw():
    """Fused vs foreach AdamW on fp32 CPU tensors the size of llama3.2-1b's parameters."""
    args = ModelArgs.from_name("llama3.2-1b")
    with torch.device("meta"):
        shapes = [p.shape for p in Llama(args).parameters()]
    params = [torch.nn.Parameter(torch.full(s, 0.01)) for s in shapes]
    for p in params:
        p.grad = torch.full(p.shape, 1e-3)
    print(f"CPU AdamW, {sum(p.numel() for p in params) / 1e9:.2f}B fp32 params, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for fused in (True, False):
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=not fused)
        optimizer.step()
        start = time.perf_counter()
        for _ in range(3):
            optimizer.step()
        print(
            f"  {'fused' if fused else 'foreach'}: {(time.perf_counter() - start) / 3:.3f} s/step"
        )
        del optimizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["memory", "adamw", "all"], default="all")
    opts = parser.parse_args()
    dist = init_distributed()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if opts.part in ("memory", "all"):
        part_memory(dist)
    if opts.part in ("adamw", "all"):
        part_adamw()


if __name__ == "__main__":
    main()

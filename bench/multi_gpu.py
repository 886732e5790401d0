"""Every sharding strategy on several GPUs (NCCL), CPU offload and activation offload
included: the same 3 steps from the same init and data must give the same losses.

    torchrun --nproc-per-node=2 bench/multi_gpu.py

fp32 (param and reduce dtype) so the strategies differ only by summation order; then bf16
timings of FULL_SHARD for llama3.2-1b.
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import Llama, ModelArgs  # noqa: E402
from offload import activation_offload, apply_ac  # noqa: E402
from optim import clip_grad_norm_  # noqa: E402
from shard import apply_fsdp, build_mesh, init_distributed, materialize  # noqa: E402


def losses(world, args, strategy, cpu_offload=False, ac="none", act_offload=False,
           dtype=torch.float32, seq=1024, nproc_per_node=None, steps=3):  # fmt: skip
    if nproc_per_node is not None:
        world = dataclasses.replace(world, nproc_per_node=nproc_per_node)
    with torch.device("meta"):
        model = Llama(args)
    apply_ac(model, ac)
    apply_fsdp(model, build_mesh(strategy, world), strategy, cpu_offload, param_dtype=dtype)
    materialize(model, world, seed=0, cpu_offload=cpu_offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(world.rank)
    tokens = torch.randint(0, args.vocab_size, (steps, 2, 2, seq), generator=g)
    out = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        total = torch.zeros((), device=world.device)
        for mb in range(2):
            model.set_requires_gradient_sync(mb == 1)
            batch = tokens[step, mb].to(world.device)
            with activation_offload(model, enabled=act_offload):
                loss = model(batch, batch, reduction="sum")
            n = batch.numel() * world.world_size * 2
            (loss / n).backward()
            total += loss.detach() / n
        dist.all_reduce(total)
        norm = clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((total.item(), norm.item()))
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return out, seconds, torch.cuda.max_memory_allocated() / 2**30


def main():
    world = init_distributed()
    say = print if world.is_main else (lambda *a, **k: None)
    say(f"{world.world_size} x {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for preset in ("tiny", "llama3.2-1b"):
        args = ModelArgs.from_name(preset)
        base, _, _ = losses(world, args, "FULL_SHARD")
        say(f"{preset} FULL_SHARD fp32 (loss, grad norm) per step: {base}")
        for name, kw in [
            ("SHARD_GRAD_OP", dict(strategy="SHARD_GRAD_OP")),
            ("NO_SHARD", dict(strategy="NO_SHARD")),
            ("HYBRID_SHARD 1x2", dict(strategy="HYBRID_SHARD")),
            ("HYBRID_SHARD 2x1", dict(strategy="HYBRID_SHARD", nproc_per_node=1)),
            ("FULL_SHARD cpu_offload", dict(strategy="FULL_SHARD", cpu_offload=True)),
            ("FULL_SHARD full AC + act. offload",
             dict(strategy="FULL_SHARD", ac="full", act_offload=True)),
            ("FULL_SHARD selective AC", dict(strategy="FULL_SHARD", ac="selective")),
        ]:  # fmt: skip
            got, _, _ = losses(world, args, **kw)
            err = max(
                abs(a - b) / abs(b)
                for g, r in zip(got, base, strict=True)
                for a, b in zip(g, r, strict=True)
            )
            say(f"  {name}: max relative difference to FULL_SHARD {err:.1e}")
    args = ModelArgs.from_name("llama3.2-1b")
    for name, kw in [
        ("FULL_SHARD", dict(strategy="FULL_SHARD")),
        ("FULL_SHARD full AC", dict(strategy="FULL_SHARD", ac="full")),
        ("FULL_SHARD cpu_offload full AC",
         dict(strategy="FULL_SHARD", ac="full", cpu_offload=True)),
    ]:  # fmt: skip
        torch.cuda.reset_peak_memory_stats()
        got, seconds, peak = losses(world, args, dtype=torch.bfloat16, seq=4096, **kw)
        say(f"llama3.2-1b bf16 {name}, 2 x 2 x 4096 tokens per rank and step: "
            f"{seconds:.3f} s/step, peak {peak:.2f} GiB, last loss {got[-1][0]:.4f}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

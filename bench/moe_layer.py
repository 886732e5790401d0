"""A mixture-of-experts layer at Qwen3-30B-A3B's widths, forward and backward, bf16: moe.py's
MoE (the router, softmax, top k, then the experts) with kernels/moe.py's path (sort, dispatch,
grouped products, combine) against the same layer with the plain-PyTorch reference (a loop over
experts), and the share of the bf16 matmul ceiling the experts' matmuls reach over the whole
layer's time. Random weights: each expert gets about T * k / E rows. --profile adds the GPU
time by kernel of the kernels/moe.py path.

    python bench/moe_layer.py --tokens 16384 65536 131072
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.moe import moe_experts, moe_experts_reference  # noqa: E402
from model import REFERENCE_OPS  # noqa: E402
from moe import MoE  # noqa: E402

BF16_CEILING = 790e12  # H100/H200 dense bf16 matmuls, the brief's measured ceiling


def timed(fn, repeats: int) -> float:
    fn()  # compiles, warms the allocator
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    a = parser.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    for n in a.tokens:
        one_size(n, a, g)


def one_size(n: int, a: argparse.Namespace, g: torch.Generator) -> None:
    x = torch.randn(n, a.dim, device="cuda", dtype=torch.bfloat16, generator=g)
    x.requires_grad_()
    # Forward 2 and backward 4 FLOPs per expert weight element per (token, choice) pair.
    flops = 6 * n * a.top_k * 3 * a.dim * a.ffn
    row = {}
    for name, experts in (("triton", moe_experts), ("reference", moe_experts_reference)):
        ops = dataclasses.replace(REFERENCE_OPS, moe_experts=experts)
        with torch.device("cuda"):
            layer = MoE(a.dim, a.ffn, a.experts, a.top_k, True, True, ops)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02, generator=g)
        layer.bfloat16()

        def step(layer=layer):  # as a training step's first micro-batch: no gradients yet
            x.grad, layer.routed = None, []
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()

        seconds = timed(step, a.repeats)
        row[name] = seconds
        print(f"tokens {n:,} {name}: {seconds * 1e3:.1f} ms forward+backward, "
              f"{flops / seconds / 1e12:.0f} TFLOP/s, {flops / seconds / BF16_CEILING:.1%} "
              f"of the bf16 ceiling", flush=True)  # fmt: skip
        if a.profile and name == "triton":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    print(f"tokens {n:,}: triton {row['reference'] / row['triton']:.2f}x the reference")


if __name__ == "__main__":
    main()

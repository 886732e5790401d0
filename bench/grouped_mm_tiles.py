"""kernels/moe.py's grouped matrix products alone, at Qwen3-30B-A3B's shapes, for a list of tile
configurations (BLOCK_M, BLOCK_N, BLOCK_K, warps, pipeline stages), beside torch._grouped_mm:
which tiles the kernels should launch with, and whether the Triton kernel or torch's is faster;
then dispatch's and combine's row kernels by their column block and warps.
The three products of a layer's experts: gate/up (K = dim, N = ffn), down (K = ffn, N = dim),
each forward (a grouped GEMM; backward's input gradient is the same product, transposed) and
weight gradient. A random router: each expert gets about T * k / E rows.

    python bench/grouped_mm_tiles.py --tokens 131072
"""

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_layer import BF16_CEILING, timed  # noqa: E402
from kernels.moe import (  # noqa: E402
    _gather_sum_kernel,
    _grouped_mm_kernel,
    _grouped_mm_weight_grad_kernel,
    _scatter_rows_kernel,
    sort_by_expert,
)

CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
    (64, 64, 32, 4, 3),
    (64, 128, 64, 4, 3),
    (128, 64, 64, 4, 3),
    (128, 128, 32, 4, 3),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
]


def forward(a, w, offsets, config):
    bm, bn, bk, warps, stages = config
    n_experts, n, k = w.shape
    out = a.new_empty(a.shape[0], n)
    tiles_m = triton.cdiv(a.shape[0], bm) + n_experts - 1
    _grouped_mm_kernel[(tiles_m * triton.cdiv(n, bn),)](
        a, w, offsets, out, n_experts, n, k, *w.stride(),
        E_PAD=triton.next_power_of_2(n_experts), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def weight_grad(dout, a, offsets, n_experts, config):
    bm, bn, bk, warps, stages = config
    n, k = dout.shape[1], a.shape[1]
    dw = a.new_empty(n_experts, n, k)
    grid = (n_experts * triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    _grouped_mm_weight_grad_kernel[grid](
        dout, a, offsets, dw, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=False,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    experts = torch.rand(a.tokens, a.experts, device="cuda", generator=g).topk(a.top_k, -1)[1]
    _, offsets = sort_by_expert(experts, a.experts)
    print(f"{a.tokens * a.top_k:,} rows over {a.experts} experts; TFLOP/s, share of the ceiling")
    one_product("gate/up", a.dim, a.ffn, offsets, a.repeats, g)
    one_product("down", a.ffn, a.dim, offsets, a.repeats, g)
    row_kernels(experts, a.dim, a.repeats, g)


def row_kernels(experts, dim: int, repeats: int, g) -> None:
    """dispatch's scatter and combine's gather-sum (a token a program, its k rows BLOCK_D
    columns at a time) by (BLOCK_D, warps): GB/s of the rows moved, against the copy ceiling."""
    position, _ = sort_by_expert(experts, experts.amax().item() + 1)
    (n_tokens, k), k_pad = position.shape, triton.next_power_of_2(position.shape[1])
    x = torch.randn(n_tokens, dim, device="cuda", generator=g).bfloat16()
    rows = torch.randn(n_tokens * k, dim, device="cuda", generator=g).bfloat16()
    moved = (rows.numel() + x.numel()) * 2
    for block_d in (256, 512, 1024, 2048):
        for warps in (4, 8, 16):
            tiles = dict(K_PAD=k_pad, BLOCK_D=block_d, num_warps=warps)
            scatter = lambda t=tiles: _scatter_rows_kernel[(n_tokens,)](  # noqa: E731
                x, position, None, None, rows, None, dim, k, **t
            )
            gather = lambda t=tiles: _gather_sum_kernel[(n_tokens,)](  # noqa: E731
                rows, position, None, x, dim, k, **t
            )
            for name, fn in (("scatter", scatter), ("gather-sum", gather)):
                seconds = timed(fn, repeats)
                print(f"rows {name:10} BLOCK_D {block_d:5} warps {warps:2} {seconds * 1e3:6.2f} ms "
                      f"{moved / seconds / 1e9:6.0f} GB/s", flush=True)  # fmt: skip


def one_product(name: str, k: int, n: int, offsets, repeats: int, g) -> None:
    rows, n_experts = offsets[-1].item(), offsets.numel() - 1
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n_experts, n, k, device="cuda", generator=g) * 0.02).bfloat16()
    dout = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    bounds = offsets.tolist()
    want = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:])
    want_dw = torch.stack(
        [
            dout[bounds[e] : bounds[e + 1]].t() @ x[bounds[e] : bounds[e + 1]]
            for e in range(n_experts)
        ]
    )
    results = {}
    results["torch._grouped_mm forward"] = timed(
        lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:]), repeats
    )
    try:  # dw[e] = dout[rows of e]^T @ x[rows of e]: the offsets split the inner dimension
        results["torch._grouped_mm weight grad"] = timed(
            lambda: torch._grouped_mm(dout.t(), x, offs=offsets[1:]), repeats
        )
    except RuntimeError as e:
        print(f"{name} torch._grouped_mm weight grad: {str(e)[:100]}")
    for config in CONFIGS:
        try:
            err = (forward(x, w, offsets, config).float() - want.float()).abs().max().item()
            results[f"forward {config} (err {err:.1e})"] = timed(
                lambda c=config: forward(x, w, offsets, c), repeats
            )
            got = weight_grad(dout, x, offsets, n_experts, config)
            err = (got.float() - want_dw.float()).abs().max().item()
            results[f"weight grad {config} (err {err:.1e})"] = timed(
                lambda c=config: weight_grad(dout, x, offsets, n_experts, c), repeats
            )
        except Exception as e:  # a tile too large for shared memory: say so, go on
            print(f"{name} {config}: {type(e).__name__}: {str(e)[:80]}")
    flops = 2 * rows * n * k
    for what, seconds in results.items():
        tflops = flops / seconds / 1e12
        print(f"{name:8} {what:52} {seconds * 1e3:7.2f} ms {tflops:5.0f} "
              f"{tflops * 1e12 / BF16_CEILING:6.1%}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

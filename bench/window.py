"""A windowed layer's attention against its attended pairs at FlexAttention's causal rate
(issue #50's target: at 131072 tokens, window 4096, head dim 128, at most 1.5x).

    python bench/window.py [--seq-len 131072] [--window 4096] [--preset llama3.1-8b]
    python bench/window.py --device cpu --seq-len 512 --window 64    # a dry run of the plumbing

One row of `--seq-len` tokens, bf16, the preset's heads (llama3.1-8b: 32 query heads, 8 kv,
head dim 128; gemma-3-12b's head dim is 256, not the issue's 128), forward+backward of:
  windowed      attention.attention_kernel with attention.window_mask (FlexAttention's block
                mask, skipping the tiles outside the window), the model's own call;
  flex causal   FlexAttention (the same compiled call and tiles) with a plain causal block mask
                over the whole row: the per-pair rate the target is measured against.
Query i attends min(i + 1, window) keys. "ratio" is windowed ms / (its pairs x flex causal's ms
per pair): 1 would be the window costing exactly its share of the causal work. On the CPU,
FlexAttention has no backward: SDPA's causal kernel stands in for flex causal and the window is
window_mask's dense mask, so only the plumbing and the pair counts mean anything there.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import SDPA_BACKENDS, attention_kernel, compiled_flex_attention, window_mask  # noqa: E402
from bench.document_mask import fwd_bwd_ms  # noqa: E402
from model import PRESETS  # noqa: E402


def windowed_pairs(seq_len: int, window: int) -> int:
    """sum over queries i of min(i + 1, window)."""
    w = min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def qkv(preset: str, seq_len: int, device: str):
    args = PRESETS[preset]
    shapes = [(1, seq_len, h, args.head_dim) for h in (args.n_heads, args.n_kv_heads)]
    # [B, H, S, Dh] views of [B, S, H, Dh] tensors, the layout the projections give.
    make = lambda s: torch.randn(s, device=device, dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    return tuple(make(s).requires_grad_() for s in (shapes[0], shapes[1], shapes[1]))


def kernels(seq_len: int, window: int, device: str) -> dict:
    """name -> attend(q, k, v)."""
    positions = torch.arange(seq_len, device=device)[None]
    windowed = window_mask(positions, window)
    backends = SDPA_BACKENDS["auto"]
    if device == "cpu":  # no FlexAttention backward on the CPU: SDPA's causal kernel
        causal = lambda q, k, v: attention_kernel(q, k, v, None, backends)  # noqa: E731
    else:
        # compiled: built per tile, not as S x S booleans first
        plain = torch.compile(create_block_mask)(
            lambda b, h, q, k: q >= k, None, None, seq_len, seq_len, device
        )
        causal = lambda q, k, v: compiled_flex_attention()(q, k, v, plain, True)  # noqa: E731
    return {
        "windowed": lambda q, k, v: attention_kernel(q, k, v, windowed, backends),
        "flex causal": causal,
    }


def step_ms(attend, q, k, v) -> float:
    """Forward+backward: CUDA events over 3 runs after a warm-up (which compiles), or one
    timed run on the CPU."""
    if q.is_cuda:
        return fwd_bwd_ms(attend, q, k, v, iters=3)
    start = time.perf_counter()
    out = attend(q, k, v)
    out.backward(torch.ones_like(out))
    return (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--preset", default="llama3.1-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/window.py: no CUDA device; --device cpu runs a dry run at small sizes")
    device = torch.cuda.get_device_name() if opts.device == "cuda" else "CPU"
    args = PRESETS[opts.preset]
    print(f"torch {torch.__version__}, {device}; {opts.preset}: {args.n_heads} q heads, "
          f"{args.n_kv_heads} kv, head dim {args.head_dim}; seq {opts.seq_len}, "
          f"window {opts.window}", flush=True)  # fmt: skip
    q, k, v = qkv(opts.preset, opts.seq_len, opts.device)
    pairs = {
        "windowed": windowed_pairs(opts.seq_len, opts.window),
        "flex causal": windowed_pairs(opts.seq_len, opts.seq_len),
    }
    ms = {name: step_ms(attend, q, k, v) for name, attend in kernels(
        opts.seq_len, opts.window, opts.device).items()}  # fmt: skip
    table = ["| kernel | ms | attended pairs | ms per 1e9 pairs |", "|---|---|---|---|"]
    for name in ms:
        table.append(f"| {name} | {ms[name]:.1f} | {pairs[name]:,} | "
                     f"{ms[name] / pairs[name] * 1e9:.1f} |")  # fmt: skip
    causal_rate = ms["flex causal"] / pairs["flex causal"]
    ratio = ms["windowed"] / (pairs["windowed"] * causal_rate)
    print("\n".join(table))
    share = pairs["windowed"] / pairs["flex causal"]
    print(f"ratio: windowed / (its pairs at flex causal's ms per pair) = {ratio:.2f} "
          f"(target <= 1.5); the window attends {share:.1%} of the causal pairs")  # fmt: skip


if __name__ == "__main__":
    main()

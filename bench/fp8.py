"""FP8 linear layers against bf16 at a model's projection shapes, forward and backward.

    python bench/fp8.py [--model llama3.1-8b] [--tokens 8192 32768]

Per projection shape: the time of a bf16 nn.functional.linear forward + backward, of
kernels.fp8_linears', their ratio, and what its quantization kernels take alone
(the rest of its time is cuBLAS's e4m3 matmuls). Results: bench/RESULTS.md, "FP8 matmuls".
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402
from bench.attention import time_ms  # noqa: E402
from kernels import fp8  # noqa: E402
from model import ModelArgs  # noqa: E402


def projection_shapes(args: ModelArgs) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of a block's projections, one of each shape."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return [
        ("wq", q, args.dim),
        ("wk/wv", kv, args.dim),
        ("wo", args.dim, q),
        ("w1/w3", args.ffn_dim, args.dim),
        ("w2", args.dim, args.ffn_dim),
    ]


def shape_milliseconds(tokens: int, n: int, k: int) -> tuple[float, float, float]:
    """bf16's and fp8_linears' forward + backward, and their quantizations alone."""
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    bf16 = time_ms(lambda: torch.autograd.backward(torch.nn.functional.linear(x, w), dy), 20)
    ours = time_ms(lambda: torch.autograd.backward(kernels.fp8_linears(x, [w], [None])[0], dy), 20)

    def quantize():  # what fp8_linears quantizes in one forward and backward
        for t in (x, w):
            fp8.quantize_rows(t)
        for t in (w, x):
            fp8.quantize_columns(t)
        fp8.quantize_both(dy)

    return bf16, ours, time_ms(quantize, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b", help="a model preset")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    cli = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {cli.model}")
    shape_milliseconds(cli.tokens[0], 1024, 1024)  # cuBLAS's and Triton's first calls, untimed
    print("tokens shape          bf16 ms  fp8 ms  speedup  quantize ms  TFLOP/s (bf16, fp8)")
    for tokens in cli.tokens:
        for name, n, k in projection_shapes(ModelArgs.from_name(cli.model)):
            bf16, ours, quantize = shape_milliseconds(tokens, n, k)
            flops = 6 * tokens * n * k
            print(
                f"{tokens:6} {name:5} {n:5}x{k:<5} {bf16:6.3f} {ours:7.3f} {bf16 / ours:7.2f}x"
                f" {quantize:9.3f}     {flops / bf16 / 1e9:5.0f},"
                f" {flops / (ours - quantize) / 1e9:5.0f}"
            )


if __name__ == "__main__":
    main()

"""FP8 linear layers against bf16 at Llama 3 8B's projection shapes, forward and backward.

    python bench/fp8.py [--tokens 8192]

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

# (name, out_features, in_features) of llama3.1-8b's projections.
SHAPES = [("wq/wo", 4096, 4096), ("wk/wv", 1024, 4096), ("w1/w3", 14336, 4096), ("w2", 4096, 14336)]


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
    parser.add_argument("--tokens", type=int, default=8192)
    tokens = parser.parse_args().tokens
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {tokens} tokens")
    print("shape         bf16 ms  fp8 ms  speedup  quantize ms  matmul TFLOP/s (bf16, fp8)")
    for name, n, k in SHAPES:
        bf16, ours, quantize = shape_milliseconds(tokens, n, k)
        flops = 6 * tokens * n * k
        print(
            f"{name:8} {n:5}x{k:<5} {bf16:6.3f} {ours:7.3f} {bf16 / ours:7.2f}x {quantize:9.3f}"
            f"     {flops / bf16 / 1e9:5.0f}, {flops / (ours - quantize) / 1e9:5.0f}"
        )


if __name__ == "__main__":
    main()

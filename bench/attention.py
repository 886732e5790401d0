"""Causal SDPA backends at Llama shapes: forward+backward time and TFLOP/s for each backend,
with grouped-query attention passed natively (enable_gqa) or by repeating k/v heads.

    python bench/attention.py [--seq 8192 32768 131072]

Also checks that the backend chosen in `model.Attention` stays in force when a checkpointed
block is recomputed in backward (a cuDNN forward recomputed by flash raises CheckpointError).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import SDPA_BACKENDS  # noqa: E402
from model import PRESETS, REFERENCE_OPS, TransformerBlock, rope_frequencies  # noqa: E402

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_case(preset: str, seq_len: int, backend: str, gqa: str) -> tuple[float, float]:
    args = PRESETS[preset]
    h, hkv, dh = args.n_heads, args.n_kv_heads, args.head_dim
    q = torch.randn(1, h, seq_len, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hkv, seq_len, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def step():
        with sdpa_kernel([BACKENDS[backend]]):
            if gqa == "native":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                kk, vv = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        out.backward(torch.ones_like(out))

    ms = time_ms(step, iters=3 if seq_len > 32768 else 10)
    flops = 3.5 * 2 * 2 * seq_len * seq_len * dh * h / 2  # fwd 2 matmuls, bwd 2.5x; causal
    return ms, flops / ms / 1e9


def checkpointed_block_recomputes_with_same_backend(backend: str) -> str:
    args = PRESETS["llama3.2-1b"]
    block = TransformerBlock(args, REFERENCE_OPS, SDPA_BACKENDS[backend]).cuda().bfloat16()
    x = torch.randn(1, 4096, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(4096, device="cuda")[None]
    inv_freq = rope_frequencies(args, torch.device("cuda"))
    try:
        out = checkpoint(block, x, positions, inv_freq, use_reentrant=False)
        out.sum().backward()
        return "ok"
    except Exception as e:  # report, don't stop the benchmark
        return f"{type(e).__name__}: {str(e)[:120]}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.1-8b"])
    opts = parser.parse_args()
    print(f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    for backend in ("auto", "cudnn", "flash"):
        print(f"checkpointed block, backend {backend}: "
              f"{checkpointed_block_recomputes_with_same_backend(backend)}")  # fmt: skip
    rows = []
    for preset in opts.presets:
        for seq_len in opts.seq:
            for backend in ("cudnn", "flash", "efficient"):
                for gqa in ("native", "repeat"):
                    try:
                        ms, tflops = bench_case(preset, seq_len, backend, gqa)
                        rows.append((preset, seq_len, backend, gqa, f"{ms:9.2f}", f"{tflops:6.0f}"))
                    except RuntimeError as e:
                        rows.append((preset, seq_len, backend, gqa, "fails", str(e)[:60]))
                    torch.cuda.empty_cache()
    print(f"{'preset':12} {'seq':>7} {'backend':9} {'gqa':7} {'fwd+bwd ms':>10} {'TFLOP/s':>7}")
    for row in rows:
        print(f"{row[0]:12} {row[1]:7d} {row[2]:9} {row[3]:7} {row[4]:>10} {row[5]:>7}")


if __name__ == "__main__":
    main()

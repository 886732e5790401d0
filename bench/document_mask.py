"""Document masking at long sequences: what building the block mask costs per micro-batch,
and attention forward+backward with it against SDPA's dense causal kernel (cuDNN).

    python bench/document_mask.py [--seq 131072 1048576]

Documents: lengths drawn from a log-normal with a median of 3,000 tokens and sigma 1.0,
capped at 32,768 (bench/sft_corpus.py's distribution), packed into one row.
"Mask ms" is `model.document_block_mask` (from the positions, no S x S tensor), against
`create_block_mask(..., _compile=True)` where it is given; "extra GiB" the peak allocated
while building it over what was allocated before.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.attention import time_ms  # noqa: E402
from model import PRESETS, compiled_flex_attention, document_block_mask, document_ids  # noqa: E402


def packed_positions(seq_len: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    parts, total = [], 0
    while total < seq_len:
        n = int(min(32768, max(16, rng.lognormal(np.log(3000), 1.0))))
        parts.append(np.arange(min(n, seq_len - total)))
        total += len(parts[-1])
    return torch.from_numpy(np.concatenate(parts))[None].cuda()


def mask_cost(positions: torch.Tensor) -> tuple[float, float]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(lambda: document_block_mask(positions), iters=5)
    return ms, (torch.cuda.max_memory_allocated() - before) / 2**30


def compiled_create_block_mask_ms(positions: torch.Tensor) -> float:
    document = document_ids(positions)
    seq_len = positions.shape[1]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document[b, q_idx] == document[b, kv_idx])

    return time_ms(
        lambda: create_block_mask(
            same_document_causal, 1, None, seq_len, seq_len, device="cuda", _compile=True
        ),
        iters=5,
    )


def attention_ms(preset: str, positions: torch.Tensor, kernel: str) -> float:
    args = PRESETS[preset]
    seq_len = positions.shape[1]
    shape = (1, args.n_heads, seq_len, args.head_dim)
    kv_shape = (1, args.n_kv_heads, seq_len, args.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    mask = document_block_mask(positions)
    flex = compiled_flex_attention()

    def step():
        if kernel == "flex":
            out = flex(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    return time_ms(step, iters=3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.1-8b"])
    opts = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    rows = []
    for seq_len in opts.seq:
        positions = packed_positions(seq_len)
        n_docs = int((positions == 0).sum())
        ms, gib = mask_cost(positions)
        try:
            compiled = f"{compiled_create_block_mask_ms(positions):.1f}"
        except Exception as e:  # report, don't stop the benchmark
            compiled = f"fails: {type(e).__name__}"
        rows.append(f"{seq_len:8d} {n_docs:5d} docs  mask {ms:7.1f} ms, +{gib:.2f} GiB  "
                    f"(create_block_mask compiled: {compiled} ms)")  # fmt: skip
        for preset in opts.presets:
            # cuDNN's dense causal attention grows as S^2: past 128k it takes minutes.
            for kernel in ("flex", "cudnn") if seq_len <= 131072 else ("flex",):
                try:
                    result = f"{attention_ms(preset, positions, kernel):9.1f} ms"
                except Exception as e:  # out of memory, say
                    result = f"fails: {type(e).__name__} {str(e)[:60]}"
                rows.append(f"{seq_len:8d} {preset:12} {kernel:6} fwd+bwd {result}")
                torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    main()

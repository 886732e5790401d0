"""Attention over packed documents, forward+backward, per attended (query, key) pair, against
cuDNN's causal kernel on one dense row: longtune's route (attention.packed_attention: each
document of attention.LONG_DOCUMENT tokens or more through cuDNN on its own slice, the others
through FlexAttention with a block mask that leaves those out), FlexAttention alone over every
document (the route before issue #23), and cuDNN called on each document alone (what
per-document dense attention costs at these lengths).

    python bench/document_mask.py [--seq 131072 1048576] [--corpus sft long-tail]
    python bench/document_mask.py --sweep     # rows of equal documents; --long-document values

Rows are packed with bench/sft_corpus.py's document lengths (one row per corpus and length,
seed 0). A document of l tokens attends l(l+1)/2 pairs; "x dense" is a kernel's pairs per
second over cuDNN's on one dense causal 131072-token row, of the same shape (the rate per
pair is flat past that length). "Mask ms" is what building the masks costs per micro-batch
(`attention.packed_rows`, from the positions and the host's document starts), "extra GiB" the peak
allocated while building them over what was allocated before.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import (  # noqa: E402
    LONG_DOCUMENT,
    attention_kernel,
    compiled_flex_attention,
    document_block_mask,
    document_starts,
    packed_rows,
)
from bench.attention import time_ms  # noqa: E402
from bench.sft_corpus import document_lengths  # noqa: E402
from model import PRESETS  # noqa: E402

CUDNN = [SDPBackend.CUDNN_ATTENTION]
DENSE_ROW = 131072


def positions_of(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None].cuda()


def corpus_lengths(seq_len: int, corpus: str) -> list[int]:
    return document_lengths(seq_len, np.random.default_rng(0), corpus).tolist()


def pairs(lengths) -> float:
    return sum(n * (n + 1) / 2 for n in lengths)


def qkv(preset: str, seq_len: int):
    args = PRESETS[preset]
    shape = (1, seq_len, args.n_heads, args.head_dim)
    kv_shape = (1, seq_len, args.n_kv_heads, args.head_dim)
    # [B, H, S, Dh] views of [B, S, H, Dh] tensors, the layout the projections give.
    make = lambda s: torch.randn(s, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    return tuple(make(s).requires_grad_() for s in (shape, kv_shape, kv_shape))


def fwd_bwd_ms(attend, q, k, v, iters: int = 3) -> float:
    def step():
        out = attend(q, k, v)
        out.backward(torch.ones_like(out))

    return time_ms(step, iters)


def cudnn_causal(q, k, v):
    with sdpa_kernel(CUDNN):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def kernels(lengths: list[int], long_document: int) -> dict:
    """name -> attend(q, k, v) for a row of documents of these lengths."""
    positions = positions_of(lengths)
    starts = document_starts(positions)
    flex_mask = document_block_mask(positions)
    rows = packed_rows(positions, starts, long_document)
    flex = compiled_flex_attention()

    def per_document(q, k, v):
        outs = [cudnn_causal(*(t[:, :, a:b] for t in (q, k, v))) for a, b in spans]
        return torch.cat(outs, dim=2)

    bounds = np.cumsum([0, *lengths]).tolist()
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    return {
        "longtune": lambda q, k, v: attention_kernel(q, k, v, rows, CUDNN),
        "flex alone": lambda q, k, v: flex(q, k, v, block_mask=flex_mask, enable_gqa=True),
        "cuDNN per document": per_document,
    }


def mask_cost(lengths: list[int], long_document: int) -> tuple[float, float]:
    positions = positions_of(lengths)
    host = positions.cpu()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(lambda: packed_rows(positions, document_starts(host), long_document), iters=5)
    return ms, (torch.cuda.max_memory_allocated() - before) / 2**30


def new_shape_ms(preset: str, length: int) -> tuple[float, float]:
    """cuDNN's first forward+backward at a length it has not seen (it builds its execution
    plans then), and the next at that length."""
    q, k, v = qkv(preset, length)
    torch.cuda.synchronize()
    start = time.perf_counter()
    cudnn_causal(q, k, v).sum().backward()
    torch.cuda.synchronize()
    first = (time.perf_counter() - start) * 1e3
    return first, fwd_bwd_ms(cudnn_causal, q, k, v, iters=3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--corpus", nargs="+", default=["sft", "long-tail"])
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.1-8b"])
    parser.add_argument("--long-document", type=int, nargs="+", default=[LONG_DOCUMENT])
    parser.add_argument("--sweep", action="store_true", help="rows of equal documents instead")
    opts = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    dense_rate = {}
    for preset in opts.presets:
        q, k, v = qkv(preset, DENSE_ROW)
        ms = fwd_bwd_ms(cudnn_causal, q, k, v)
        dense_rate[preset] = pairs([DENSE_ROW]) / ms
        rows.append(f"{preset:12} dense causal row {DENSE_ROW}: {ms:8.1f} ms (cuDNN)")
        del q, k, v
        for length in (5000, 20000, 80001):
            first, then = new_shape_ms(preset, length)
            rows.append(f"{preset:12} cuDNN at a new length {length}: first call {first:7.1f} "
                        f"ms, then {then:6.2f} ms")  # fmt: skip
    print("\n".join(rows), flush=True)
    if opts.sweep:
        cases = [(f"{n} x {131072 // n}", [n] * (131072 // n)) for n in
                 (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)]  # fmt: skip
    else:
        cases = [(f"{c} {s}", corpus_lengths(s, c)) for c in opts.corpus for s in opts.seq]
    table = ["| row | docs | longest | long_document | mask ms | preset | kernel | ms | x dense |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, lengths in cases:
        for long_document in opts.long_document:
            ms, gib = mask_cost(lengths, long_document)
            mask = f"{ms:.1f} (+{gib:.2f} GiB)"
            for preset in opts.presets:
                seq_len = sum(lengths)
                q, k, v = qkv(preset, seq_len)
                for kernel, attend in kernels(lengths, long_document).items():
                    if kernel != "longtune" and long_document != opts.long_document[0]:
                        continue
                    try:
                        t = fwd_bwd_ms(attend, q, k, v)
                        result = f"{t:.1f} | {pairs(lengths) / t / dense_rate[preset]:.2f}"
                    except Exception as e:  # out of memory, say: report, go on
                        result = f"fails: {type(e).__name__} {str(e)[:60]} |"
                    line = (f"| {name} | {len(lengths)} | {max(lengths)} | {long_document} | "
                            f"{mask} | {preset} | {kernel} | {result} |")  # fmt: skip
                    table.append(line)
                    print(line, flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    print("\n".join(table))


if __name__ == "__main__":
    main()

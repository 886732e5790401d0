"""Times longtune's Triton kernels against the plain-PyTorch reference (eager), torch.compile
of the reference, and Liger-Kernel, at Llama 3 8B shapes in bf16, on one CUDA GPU:

    PYTHONUNBUFFERED=1 python bench/kernels.py       (Liger's rows are skipped without it)
    PYTHONUNBUFFERED=1 python bench/kernels.py --only nf4      (the copy and NF4 only)
    PYTHONUNBUFFERED=1 python bench/kernels.py --only clamped_swiglu      (gpt-oss's only)

Each kernel is timed forward and forward + backward: median ms of triton.testing.do_bench
(which flushes the L2 cache between calls), and for the memory-bound kernels also of
do_bench_cudagraph, replaying the calls from a CUDA graph. The two differ where launching
from Python (autograd, the Triton launcher) takes longer than the GPU work: the graph column
is the GPU's time, the one that counts inside a training step whose GPU queue is full. Rates
use these counts, each tensor read or written once:
    RMSNorm   fwd: x, y                       bwd: x, dy, dx (+ weight, rstd: negligible)
    SwiGLU    fwd: gate, up, out              bwd: gate, up, dout, dgate, dup (gpt-oss's
              clamped SwiGLU too, at gpt-oss-20b's experts' rows for 16384 tokens)
    RoPE      fwd: q, k read and written      bwd: the same for their gradients
    linear + cross-entropy: 2 N V D flops per matmul, 3 matmuls (logits, dhidden, dweight)
    NF4 dequantize: the packed rows read (K/2 + K/64 bytes a row, padded to 4), W written;
        its rate beside the copy's measured in the same run, after a check on the GPU that
        the Triton kernel gives the reference's bits (PASS/FAIL, repeated at the end)
    NF4 linear: x @ W^T from the NF4 weight (dequantize, then cuBLAS) against F.linear on the
        bf16 weight, forward and + backward (dx only: the weight is frozen), at each of 8B's
        weight shapes and 512, 2048, 8192 tokens; TFLOP/s counted as 2 N K M per matmul, so
        the difference is what dequantizing costs
"Extra" is torch.cuda.max_memory_allocated during one call minus what was allocated before
it (inputs and upstream gradients), so it counts outputs, saved tensors and input gradients.
The copy line gives the device's reachable bandwidth: a device-to-device copy, read + write.
"""

import argparse
import gc
import importlib.metadata
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (  # noqa: E402
    IGNORE_INDEX,
    apply_rope,
    apply_rope_reference,
    clamped_swiglu,
    clamped_swiglu_reference,
    dequantize_nf4,
    dequantize_nf4_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    nf4_linear,
    quantize_nf4,
    rms_norm,
    rms_norm_reference,
    swiglu,
    swiglu_reference,
)

try:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    LIGER = importlib.metadata.version("liger-kernel")
except ImportError:
    LIGER = None

BF16 = torch.bfloat16
GIB = 2**30
ROWS: list[str] = []  # the summary tables, printed last
MEMORY_ROWS: list[str] = []


def measure(fn: Callable[[], None], leaves: list[torch.Tensor]) -> tuple[float, int]:
    """(median ms, extra peak bytes) of fn, after one warm-up call (compilation, autotuning)."""
    fn()
    for t in leaves:
        t.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    ms = triton.testing.do_bench(fn, grad_to_none=leaves, return_mode="median")
    return ms, extra


def forward_only(op: Callable, inputs: list) -> Callable[[], None]:
    return lambda: op(*inputs)


def forward_backward(op: Callable, inputs: list, grads: list | None) -> Callable[[], None]:
    """grads: the outputs' gradients, or None for a scalar loss."""

    def step():
        out = op(*inputs)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)

    return step


def graph_ms(fn: Callable[[], None], leaves: list[torch.Tensor]) -> float | None:
    """Median ms of fn replayed from a CUDA graph, or None where fn cannot be captured."""
    try:
        return triton.testing.do_bench_cudagraph(fn, grad_to_none=leaves, return_mode="median")
    except Exception as error:  # e.g. an op that synchronizes with the host
        print(f"  (no CUDA graph: {type(error).__name__}: {str(error)[:80]})")
        return None


def report(kernel, mode, variant, ms, rate, extra, graph="- | -") -> None:
    line = f"| {kernel} | {mode} | {variant} | {ms:.3f} | {rate} | {graph} | {extra / GIB:.2f} |"
    print(line, flush=True)
    ROWS.append(line)


def bench_bandwidth_op(kernel, variants, inputs, grads, fwd_bytes, bwd_bytes):
    """Times each (name, op) in variants forward and forward + backward; rates in TB/s."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for name, op in variants:
        for mode, fn, nbytes in [
            ("fwd", forward_only(op, inputs), fwd_bytes),
            ("fwd+bwd", forward_backward(op, inputs, grads), fwd_bytes + bwd_bytes),
        ]:
            ms, extra = measure(fn, leaves)
            graph = graph_ms(fn, leaves)
            graph = "n/a | n/a" if graph is None else f"{graph:.3f} | {nbytes / graph / 1e9:.2f}"
            report(kernel, mode, name, ms, f"{nbytes / ms / 1e9:.2f} TB/s", extra, graph)


def leaf(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(shape, device="cuda", dtype=dtype) * scale).requires_grad_()


def bench_copy() -> float:
    """The device-to-device copy rate in TB/s (read + write), printed and returned."""
    src = torch.randn(GIB // 2, device="cuda", dtype=BF16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    report("copy 1 GiB", "-", "torch", ms, f"{2 * GIB / ms / 1e9:.2f} TB/s", 0)
    return 2 * GIB / ms / 1e9


def bench_rms_norm(tokens=16384, dim=4096, eps=1e-5):
    x, weight = leaf(tokens, dim), leaf(dim)
    variants = [
        ("torch eager", rms_norm_reference),
        ("torch.compile", torch.compile(rms_norm_reference)),
        ("longtune", rms_norm),
    ]
    if LIGER:
        liger = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        variants.append(("Liger", liger))
    size = tokens * dim * 2
    kernel = f"RMSNorm T={tokens} d={dim}"
    grads = [torch.randn_like(x)]
    bench_bandwidth_op(kernel, variants, [x, weight, eps], grads, 2 * size, 3 * size)


def bench_swiglu(tokens=16384, ffn_dim=14336, clamped=False):
    """clamped: gpt-oss's activation (its experts' rows as the tokens), which Liger has not."""
    gate, up = leaf(tokens, ffn_dim), leaf(tokens, ffn_dim)
    reference, fused = swiglu_reference, swiglu
    if clamped:
        reference, fused = clamped_swiglu_reference, clamped_swiglu
    variants = [
        ("torch eager", reference),
        ("torch.compile", torch.compile(reference)),
        ("longtune", fused),
    ]
    if LIGER and not clamped:
        variants.append(("Liger", LigerSiLUMulFunction.apply))
    size = tokens * ffn_dim * 2
    kernel = f"{'clamped SwiGLU' if clamped else 'SwiGLU'} T={tokens} f={ffn_dim}"
    bench_bandwidth_op(kernel, variants, [gate, up], [torch.randn_like(gate)], 3 * size, 5 * size)


def bench_rope(tokens=16384, n_heads=32, n_kv_heads=8, head_dim=128):
    q, k = leaf(1, tokens, n_heads, head_dim), leaf(1, tokens, n_kv_heads, head_dim)
    positions = torch.arange(tokens, device="cuda")[None]
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    variants = [
        ("torch eager", apply_rope_reference),
        ("torch.compile", torch.compile(apply_rope_reference)),
        ("longtune", apply_rope),
    ]
    if LIGER:
        # Liger takes [B, H, S, Dh] views and cos/sin tables built beforehand (not timed).
        angles = torch.cat([positions[0, :, None] * inv_freq] * 2, dim=-1)[None]
        cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)

        def liger(q, k, positions, inv_freq):
            q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        variants.append(("Liger (cos/sin given)", liger))
    size = (q.numel() + k.numel()) * 2
    kernel = f"RoPE T={tokens} H={n_heads} Hkv={n_kv_heads} Dh={head_dim}"
    grads = [torch.randn_like(q), torch.randn_like(k)]
    bench_bandwidth_op(kernel, variants, [q, k, positions, inv_freq], grads, 2 * size, 2 * size)


def cross_entropy_inputs(tokens, dim, vocab):
    hidden = leaf(tokens, dim)
    weight = leaf(vocab, dim, scale=1 / math.sqrt(dim))
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::10] = IGNORE_INDEX
    return hidden, weight, labels


def cross_entropy_variants():
    variants = [("torch eager", linear_cross_entropy_reference), ("longtune", linear_cross_entropy)]
    if LIGER:
        liger = lambda h, w, y: LigerFusedLinearCrossEntropyFunction.apply(h, w, y)[0]
        variants.append(("Liger", liger))
    return variants


def bench_linear_cross_entropy(tokens=8192, dim=4096, vocab=128256):
    hidden, weight, labels = cross_entropy_inputs(tokens, dim, vocab)
    kernel = f"linear+CE T={tokens} d={dim} V={vocab}"
    flops = 2 * tokens * dim * vocab
    for name, op in cross_entropy_variants():
        ms, extra = measure(forward_backward(op, [hidden, weight, labels], None), [hidden, weight])
        report(kernel, "fwd+bwd", name, ms, f"{3 * flops / ms / 1e9:.0f} TFLOP/s", extra)


def bench_cross_entropy_memory(dim=4096, vocab=128256):
    """Extra memory of one forward + backward as the tokens grow; the scratch column takes away
    the two gradients (weight-sized and hidden-sized), which every implementation returns."""
    for tokens in (8192, 32768, 131072):
        hidden, weight, labels = cross_entropy_inputs(tokens, dim, vocab)
        gradients = (hidden.numel() + weight.numel()) * 2
        for name, op in cross_entropy_variants()[1:]:
            step = forward_backward(op, [hidden, weight, labels], None)
            step()
            hidden.grad = weight.grad = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
            line = (
                f"| T={tokens} | {name} | {start.elapsed_time(end):.1f} | {extra / GIB:.2f} | "
                f"{(extra - gradients) / GIB:.3f} |"
            )
            print(line, flush=True)
            MEMORY_ROWS.append(line)
            hidden.grad = weight.grad = None
        del hidden, weight, labels
        gc.collect()


# llama3.1-8b's NF4 weights [N, K]: the attention's q and o, k and v, the MLP's w1 and w3, w2.
NF4_SHAPES = {"wq/wo": (4096, 4096), "wk/wv": (1024, 4096), "w1/w3": (14336, 4096),
              "w2": (4096, 14336)}  # fmt: skip
NF4_TOKENS = (512, 2048, 8192)


def bench_nf4_dequantize(copy_rate: float) -> str:
    """llama3.1-8b's w1: the Triton dequantization checked bit for bit against the reference,
    then timed with the eager and compiled reference and bitsandbytes where installed; TB/s
    beside the copy's. Returns the check's PASS/FAIL line."""
    rows, cols = NF4_SHAPES["w1/w3"]
    q = quantize_nf4(torch.randn(rows, cols, device="cuda") * 0.02)
    packed = q.rows.view(BF16)
    ref = dequantize_nf4_reference(q.rows, q.absmax2, q.offset, cols, BF16)
    out = dequantize_nf4(packed, q.absmax2, q.offset, cols, BF16)
    differ = (out.view(torch.int16) != ref.view(torch.int16)).sum().item()
    check = f"{'PASS' if differ == 0 else 'FAIL'} NF4 dequantize bit for bit: {differ} differ"
    print(f"  {check}", flush=True)
    nbytes = q.rows.numel() + rows * cols * 2
    compiled = torch.compile(dequantize_nf4_reference)
    variants = [("triton", dequantize_nf4), ("eager", dequantize_nf4_reference),
                ("torch.compile", compiled)]  # fmt: skip
    for name, fn in variants:
        call = lambda fn=fn: fn(packed, q.absmax2, q.offset, cols, BF16)  # noqa: E731
        ms, extra = measure(call, [])
        graph = graph_ms(call, [])
        graph = "n/a | n/a" if graph is None else f"{graph:.3f} | {nbytes / graph / 1e9:.2f}"
        rate = nbytes / ms / 1e9
        share = f"{rate:.2f} TB/s = {100 * rate / copy_rate:.0f}% of copy"
        report("NF4 dequantize", "fwd", name, ms, share, extra, graph)
    try:
        import bitsandbytes.functional as bnb

        weight = torch.randn(rows, cols, device="cuda", dtype=BF16) * 0.02
        bnb_packed, state = bnb.quantize_4bit(
            weight, blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        call = lambda: bnb.dequantize_4bit(bnb_packed, state)  # noqa: E731
        ms, extra = measure(call, [])
        report("NF4 dequantize", "fwd", "bitsandbytes", ms, f"{nbytes / ms / 1e9:.2f} TB/s", extra)
    except ImportError:
        print("  (bitsandbytes absent: no row)")
    return check


def bench_nf4_linear() -> None:
    """nf4_linear against F.linear on the bf16 weight at each 8B shape and token count."""
    for name, (rows, cols) in NF4_SHAPES.items():
        q = quantize_nf4(torch.randn(rows, cols, device="cuda") * 0.02)
        packed = q.rows.view(BF16)
        dense = dequantize_nf4(packed, q.absmax2, q.offset, cols, BF16)
        variants = [
            ("nf4_linear", partial(nf4_linear, rows=packed, absmax2=q.absmax2, offset=q.offset,
                                   in_features=cols)),
            ("F.linear bf16", partial(torch.nn.functional.linear, weight=dense)),
        ]  # fmt: skip
        for tokens in NF4_TOKENS:
            x = leaf(tokens, cols)
            dy = torch.randn(tokens, rows, device="cuda", dtype=BF16)
            flops = 2 * tokens * rows * cols
            kernel = f"NF4 linear {name} [{rows}, {cols}], {tokens} tokens"
            for variant, op in variants:
                for mode, fn, n_flops in [
                    ("fwd", forward_only(op, [x]), flops),
                    ("fwd+bwd", forward_backward(op, [x], [dy]), 2 * flops),
                ]:
                    ms, extra = measure(fn, [x])
                    report(kernel, mode, variant, ms, f"{n_flops / ms / 1e9:.0f} TFLOP/s", extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", choices=["nf4", "clamped_swiglu"], help="run only this part (and the copy)"
    )
    only = parser.parse_args().only
    props = torch.cuda.get_device_properties(0)
    versions = f"torch {torch.__version__}, triton {triton.__version__}, liger {LIGER or 'absent'}"
    print(f"{props.name}, {versions}")
    copy_rate = bench_copy()
    nf4_check = ""
    if only is None:
        bench_rms_norm()
        bench_swiglu()
        bench_rope()
        bench_linear_cross_entropy()
        bench_cross_entropy_memory()
    if only in (None, "clamped_swiglu"):  # gpt-oss-20b's experts at 16384 tokens, k = 4
        bench_swiglu(16384 * 4, 2880, clamped=True)
    if only in (None, "nf4"):
        nf4_check = bench_nf4_dequantize(copy_rate)
        bench_nf4_linear()
    print(f"\n{props.name}, {versions}")
    print("| kernel | mode | variant | ms | rate | graph ms | graph TB/s | extra GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(ROWS))
    if only is None:
        print("\n| linear+CE fwd+bwd | variant | ms (one call) | extra GiB | scratch GiB |")
        print("| --- | --- | --- | --- | --- |\n" + "\n".join(MEMORY_ROWS))
    print(f"\n{nf4_check}")


if __name__ == "__main__":
    main()

"""The Triton kernels against their references, forward and every gradient.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so the shapes are small and odd: non-power-of-two rows and row counts, masks on every edge.
The `gpu` tests run the kernels compiled, at Llama 3 8B shapes, in bf16, against the fp32
reference: norm-wise error ||out - ref|| / ||ref|| <= 1e-2, printed under `pytest -s`.

On the CPU references run in float64 on upcast inputs, and the error is
max |out - ref| / max |ref| per tensor. Tolerances, by the dtype of the inputs:
    fp32: 1e-5 (fp32 arithmetic in a different order than the reference's)
    bf16: 1e-2 (the output itself is rounded to bf16, an error of up to 2^-8 = 3.9e-3)
The gradients of the fused linear + cross-entropy in bf16 get 2e-2: they pass through two
bf16 roundings (the logits' gradient, then each chunk's product) before the sum.
"""

import pytest
import torch
from transformers.activations import ACT2FN

import kernels
import kernels.fp8
from kernels import (
    IGNORE_INDEX,
    apply_rope,
    apply_rope_reference,
    clamped_swiglu,
    clamped_swiglu_reference,
    dequantize_nf4,
    dequantize_nf4_reference,
    geglu,
    geglu_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    nf4_linear,
    quantize_nf4,
    rms_norm,
    rms_norm_reference,
    swiglu,
    swiglu_reference,
)
from kernels.fp8 import scaled_mm
from kernels.nf4 import DYNAMIC_CODE, NF4_CODE
from kernels.swiglu import SWIGLU_LIMIT

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CE_GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GPU_BF16_TOLERANCE = 1e-2  # norm-wise, against fp32: bf16 rounding of inputs and outputs


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel's output"
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tolerance: float, name: str) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    error = relative_error(out, ref)
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_()


def forward_and_grads(fn, inputs: list[torch.Tensor], grad_out: list[torch.Tensor]):
    """Runs fn on fresh leaves of inputs, backpropagates grad_out; (outputs, input grads)."""
    leaves = [leaf(t) for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grad_out)
    return [o.detach() for o in outputs], [t.grad for t in leaves]


def against_reference(kernel, reference, inputs, grad_out, names, reference_dtype):
    """[(name, kernel's tensor, reference's tensor)] for each output, then each input's
    gradient; the reference runs on the inputs and output gradients cast to reference_dtype."""
    outputs, grads = forward_and_grads(kernel, inputs, grad_out)
    ref_outputs, ref_grads = forward_and_grads(
        reference,
        [t.to(reference_dtype) for t in inputs],
        [g.to(reference_dtype) for g in grad_out],
    )
    return list(zip(names, outputs + grads, ref_outputs + ref_grads, strict=True))


# ----------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 48), (7, 100), (33, 72)])
def test_rms_norm_matches_reference_forward_and_grads(rows, dim, dtype):
    x = torch.randn(rows, dim, dtype=dtype) * 3
    weight = torch.randn(dim, dtype=dtype)
    dy = torch.randn(rows, dim, dtype=dtype)
    pairs = against_reference(
        lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: rms_norm_reference(a, b, 1e-6),
        [x, weight], [dy], ["y", "dx", "dweight"], torch.float64,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert out.dtype == dtype
        assert_close(out, ref, TOLERANCE[dtype], name)


def test_rms_norm_keeps_each_inputs_dtype_for_fp32_weight_and_bf16_x():
    x = torch.randn(2, 5, 72, dtype=torch.bfloat16)
    weight = torch.randn(72, dtype=torch.float32)
    dy = torch.randn(2, 5, 72, dtype=torch.bfloat16)
    pairs = against_reference(
        lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5),
        [x, weight], [dy], ["y", "dx", "dweight"], torch.float64,
    )  # fmt: skip
    assert [out.dtype for _, out, _ in pairs] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, out, ref in pairs:
        assert_close(out, ref, TOLERANCE[torch.bfloat16], name)


# ----------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------


def rope_inputs(bsz, seq_len, n_heads, n_kv_heads, head_dim, dtype, max_position=None):
    q = torch.randn(bsz, seq_len, n_heads, head_dim, dtype=dtype)
    k = torch.randn(bsz, seq_len, n_kv_heads, head_dim, dtype=dtype)
    if max_position is None:  # packed documents: positions restart at 0 mid-row
        positions = torch.cat([torch.arange(seq_len // 2), torch.arange(seq_len - seq_len // 2)])
        positions = positions.expand(bsz, seq_len)
    else:
        positions = torch.randint(0, max_position, (bsz, seq_len))
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return q, k, positions, inv_freq


def rope_against_reference(
    q, k, dq_out, dk_out, positions, inv_freq, reference_dtype, scale: float = 1.0
):
    return against_reference(
        lambda a, b: apply_rope(a, b, positions, inv_freq, scale),
        lambda a, b: apply_rope_reference(a, b, positions, inv_freq, scale),
        [q, k], [dq_out, dk_out], ["q", "k", "dq", "dk"], reference_dtype,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bsz, seq_len, n_heads, n_kv_heads, head_dim",
    [(1, 1, 1, 1, 8), (2, 7, 3, 1, 24), (1, 9, 5, 5, 20)],
)
def test_rope_matches_reference_forward_and_grads(
    bsz, seq_len, n_heads, n_kv_heads, head_dim, dtype
):
    q, k, positions, inv_freq = rope_inputs(bsz, seq_len, n_heads, n_kv_heads, head_dim, dtype)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    pairs = rope_against_reference(q, k, dq_out, dk_out, positions, inv_freq, torch.float64)
    for name, out, ref in pairs:
        assert out.dtype == dtype
        assert_close(out, ref, TOLERANCE[dtype], name)


def test_rope_scales_cos_and_sin_by_yarns_attention_factor():
    """scale c: the rotation times c, in forward (q, k) and backward (dq, dk)."""
    q, k, positions, inv_freq = rope_inputs(2, 7, 3, 1, 24, torch.float32)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    scaled = rope_against_reference(q, k, dq_out, dk_out, positions, inv_freq, torch.float64, 1.3)
    plain = rope_against_reference(q, k, dq_out, dk_out, positions, inv_freq, torch.float64)
    for (name, out, ref), (_, plain_out, _) in zip(scaled, plain, strict=True):
        assert_close(out, ref, TOLERANCE[torch.float32], name)
        assert_close(out, 1.3 * plain_out, TOLERANCE[torch.float32], name)


def test_rope_reads_strided_inputs_and_grads_and_leaves_them_untouched():
    # q and k as slices of one fused projection, the way a fused qkv linear would give them;
    # their gradients as SDPA's come back, [B, H, S, Dh] tensors seen through a transpose.
    bsz, seq_len, n_heads, n_kv_heads, head_dim = 2, 5, 4, 2, 12
    qkv = torch.randn(bsz, seq_len, (n_heads + n_kv_heads) * head_dim)
    q = qkv[..., : n_heads * head_dim].view(bsz, seq_len, n_heads, head_dim)
    k = qkv[..., n_heads * head_dim :].view(bsz, seq_len, n_kv_heads, head_dim)
    dq_out = torch.randn(bsz, n_heads, seq_len, head_dim).transpose(1, 2)
    dk_out = torch.randn(bsz, n_kv_heads, seq_len, head_dim).transpose(1, 2)
    _, _, positions, inv_freq = rope_inputs(bsz, seq_len, n_heads, n_kv_heads, head_dim, None, 64)
    before = qkv.clone()
    pairs = rope_against_reference(q, k, dq_out, dk_out, positions, inv_freq, torch.float64)
    assert torch.equal(qkv, before)
    for name, out, ref in pairs:
        assert_close(out, ref, TOLERANCE[torch.float32], name)


# ----------------------------------------------------------------------------------------
# SwiGLU
# ----------------------------------------------------------------------------------------


def test_swiglu_overwrites_only_intermediates_when_asked():
    """overwrite=True: backward writes dgate and dup over the gate and up it saved when they
    are distinct intermediates of the graph (the MLP's linears' outputs), and the gradients
    stay right; by default, for leaves, and for aliased inputs nothing is overwritten; and
    where autograd checks versions another op that saved the same gate refuses to go
    backward rather than read a gradient."""
    gate0, up0 = leaf(torch.randn(7, 100)), leaf(torch.randn(7, 100))
    dout = torch.randn(7, 100)
    reference = forward_and_grads(swiglu_reference, [gate0, up0], [dout])[1]
    for overwrite in (False, True):
        gate0.grad = up0.grad = None
        gate, up = gate0 * 1, up0 * 1  # intermediates
        before = gate.detach().clone()
        swiglu(gate, up, overwrite=overwrite).backward(dout)
        assert_close(gate0.grad, reference[0], TOLERANCE[torch.float32], "dgate")
        assert_close(up0.grad, reference[1], TOLERANCE[torch.float32], "dup")
        assert torch.equal(gate.detach(), before) != overwrite
    leaf_gate = leaf(torch.randn(7, 100))
    before = leaf_gate.detach().clone()
    swiglu(leaf_gate, leaf(torch.randn(7, 100)), overwrite=True).backward(dout)
    assert torch.equal(leaf_gate.detach(), before)
    gate0.grad = None
    both = gate0 * 1  # one tensor as gate and up
    swiglu(both, both, overwrite=True).backward(dout)
    want = forward_and_grads(lambda g: swiglu_reference(g, g), [gate0], [dout])[1][0]
    assert_close(gate0.grad, want, TOLERANCE[torch.float32], "aliased")
    gate = leaf(torch.randn(7, 100)) * 1
    loss = gate.square().sum() + (swiglu(gate, up0 * 1, overwrite=True) * dout).sum()
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (7, 100), (3, 11, 72)])
@pytest.mark.parametrize(
    "kernel, reference",
    [(swiglu, swiglu_reference), (geglu, lambda g, u: ACT2FN["gelu_pytorch_tanh"](g) * u)],
    ids=["swiglu", "geglu"],
)
def test_gated_activation_matches_reference_forward_and_grads(kernel, reference, shape, dtype):
    """SwiGLU, and GeGLU (the same kernel with the tanh-GELU gate) against transformers'
    gelu_pytorch_tanh, Gemma 3's; gates of scale 4 reach both tails of either gate."""
    gate, up = torch.randn(shape, dtype=dtype) * 4, torch.randn(shape, dtype=dtype)
    dout = torch.randn(shape, dtype=dtype)
    pairs = against_reference(
        kernel, reference, [gate, up], [dout], ["out", "dgate", "dup"], torch.float64
    )
    for name, got, ref in pairs:
        assert got.dtype == dtype
        assert_close(got, ref, TOLERANCE[dtype], name)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (7, 100), (3, 11, 72)])
def test_clamped_swiglu_matches_reference_forward_and_grads(shape, dtype, overwrite):
    """gpt-oss's clamped SwiGLU (the same kernel) against clamped_swiglu_reference, on gates
    and ups up to 12 in size, past both clamps, and some exactly at them: the gradients are zero
    where, and only where, the reference's are (torch.clamp's pass at the bound itself). Gate
    and up are intermediates, so that overwrite=True writes the gradients over them."""
    torch.manual_seed(0)
    gate, up = (torch.empty(shape).uniform_(-12, 12).to(dtype) for _ in range(2))
    gate.view(-1)[:2] = torch.tensor([SWIGLU_LIMIT, -SWIGLU_LIMIT])
    up.view(-1)[:2] = torch.tensor([-SWIGLU_LIMIT, SWIGLU_LIMIT])
    intermediates = []

    def kernel(g, u):
        intermediates.extend((g * 1, u * 1))
        return clamped_swiglu(*intermediates, overwrite=overwrite)

    pairs = against_reference(
        kernel, clamped_swiglu_reference, [gate, up], [torch.randn(shape, dtype=dtype)],
        ["out", "dgate", "dup"], torch.float64,
    )  # fmt: skip
    for name, got, ref in pairs:
        assert got.dtype == dtype
        assert_close(got, ref, TOLERANCE[dtype], name)
        assert torch.equal(got == 0, ref == 0), name
    (_, dgate, _), (_, dup, _) = pairs[1:]
    assert dgate.view(-1)[0] != 0 and (dup.view(-1)[:2] != 0).all()  # at the bounds
    assert torch.equal(intermediates[0].detach(), gate) != overwrite


def test_clamped_swiglu_gradient_is_zero_where_clamped_even_for_a_nan_dout():
    """Where gate or up was clamped (or is NaN) its gradient is 0 whatever dout, a NaN too, as
    torch.clamp's in the reference; elsewhere, at the bounds too, a NaN dout gives NaN."""
    nan = float("nan")
    gate = torch.tensor([9.0, 1.0, SWIGLU_LIMIT, 1.0, nan, 1.0])
    up = torch.tensor([1.0, -9.0, 1.0, SWIGLU_LIMIT, 1.0, nan])
    dout = torch.full_like(gate, nan)
    (_, got), (_, ref) = (
        forward_and_grads(fn, [gate, up], [dout])
        for fn in (clamped_swiglu, clamped_swiglu_reference)
    )
    zero = {"dgate": [0, 4], "dup": [1, 5]}
    for name, grad, ref_grad in zip(["dgate", "dup"], got, ref, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0, equal_nan=True, msg=name)
        assert (grad == 0).nonzero().flatten().tolist() == zero[name], name


# ----------------------------------------------------------------------------------------
# Linear + cross-entropy
# ----------------------------------------------------------------------------------------


def ce_inputs(n_tokens, dim, vocab, dtype, ignored=()):
    hidden = torch.randn(n_tokens, dim, dtype=dtype)
    weight = torch.randn(vocab, dim, dtype=dtype) / dim**0.5
    labels = torch.randint(0, vocab, (n_tokens,))
    labels[list(ignored)] = IGNORE_INDEX
    return hidden, weight, labels


def linear_cross_entropy_against_reference(
    hidden, weight, labels, reduction, grad_out, reference_dtype
):
    return against_reference(
        lambda h, w: linear_cross_entropy(h, w, labels, IGNORE_INDEX, reduction),
        lambda h, w: linear_cross_entropy_reference(h, w, labels, IGNORE_INDEX, reduction),
        [hidden, weight], [grad_out], ["loss", "dhidden", "dweight"], reference_dtype,
    )  # fmt: skip


def check_linear_cross_entropy(hidden, weight, labels, reduction):
    dtype = hidden.dtype
    grad_out = torch.tensor(1.7)  # not 1, so that the backward's scaling is exercised
    (_, loss, loss_ref), (_, dh, dh_ref), (_, dw, dw_ref) = linear_cross_entropy_against_reference(
        hidden, weight, labels, reduction, grad_out, torch.float64
    )
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
    assert_close(loss, loss_ref, TOLERANCE[dtype], "loss")
    assert_close(dh, dh_ref, CE_GRAD_TOLERANCE[dtype], "dhidden")
    assert_close(dw, dw_ref, CE_GRAD_TOLERANCE[dtype], "dweight")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 tokens (fp32) or 16 (bf16) for a vocab of 100, 1 for a vocab of 1000, so
    that the small test shapes span several chunks and a partial last one."""
    monkeypatch.setattr(kernels.cross_entropy, "CHUNK_LOGITS_BYTES", 8 * 100 * 4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens, dim, vocab", [(1, 48, 100), (33, 72, 100), (19, 40, 1000)])
def test_linear_cross_entropy_matches_reference_with_some_labels_ignored(
    n_tokens, dim, vocab, dtype, reduction, small_chunks
):
    hidden, weight, labels = ce_inputs(n_tokens, dim, vocab, dtype, ignored=range(1, n_tokens, 3))
    check_linear_cross_entropy(hidden, weight, labels, reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_with_a_chunk_whose_labels_are_all_ignored(reduction, small_chunks):
    hidden, weight, labels = ce_inputs(20, 48, 100, torch.float32, ignored=range(8, 16))
    check_linear_cross_entropy(hidden, weight, labels, reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_is_zero_not_nan_when_every_label_is_ignored(reduction, small_chunks):
    hidden, weight, labels = ce_inputs(13, 48, 100, torch.float32, ignored=range(13))
    hidden, weight = leaf(hidden), leaf(weight)
    loss = linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, reduction)
    loss.backward()
    assert loss.item() == 0.0
    assert not hidden.grad.any() and not weight.grad.any()


def test_linear_cross_entropy_keeps_a_long_inputs_bf16_weight_gradient_accurate(small_chunks):
    """128 chunks of 16 tokens: summed in bf16 throughout, dweight's norm-wise error
    against fp64 measured 1.3%; in groups of BF16_SUM_CHUNKS added in fp32, 0.5%."""
    hidden, weight, labels = ce_inputs(16 * 128, 40, 100, torch.bfloat16)
    weight = leaf(weight)
    linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, "sum").backward()
    reference = leaf(weight.detach().double())
    linear_cross_entropy_reference(
        hidden.double(), reference, labels, IGNORE_INDEX, "sum"
    ).backward()
    error = (weight.grad.double() - reference.grad).norm() / reference.grad.norm()
    assert error <= 8e-3


def test_linear_cross_entropy_refuses_a_second_backward_through_the_same_graph():
    hidden, weight, labels = ce_inputs(5, 48, 100, torch.float32)
    loss = linear_cross_entropy(leaf(hidden), leaf(weight), labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_linear_cross_entropy_computes_no_gradients_under_no_grad(small_chunks):
    """An evaluation's forward (torch.no_grad) on inputs that require gradients: the same
    loss, and none of the gradient matmuls (one logits matmul a chunk, no more)."""
    hidden, weight, labels = ce_inputs(33, 72, 100, torch.float32, ignored=[3, 4])
    hidden, weight = leaf(hidden), leaf(weight)

    def matmuls(grad: bool) -> tuple[torch.Tensor, dict[str, int]]:
        with torch.set_grad_enabled(grad), torch.profiler.profile() as prof:
            loss = linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, "sum")
        ops = [e.name for e in prof.events()]
        return loss, {op: ops.count(op) for op in ("aten::mm", "aten::addmm_")}

    loss, counted = matmuls(grad=False)
    chunks = -(-33 // kernels.cross_entropy.chunk_rows(100, 4))
    assert counted == {"aten::mm": chunks, "aten::addmm_": 0}
    assert loss.grad_fn is None
    trained, counted = matmuls(grad=True)
    assert counted == {"aten::mm": 2 * chunks, "aten::addmm_": chunks}
    assert loss.item() == trained.item()


def test_linear_cross_entropy_chunk_is_sized_from_the_vocab_not_the_tokens():
    bf16_llama3 = kernels.cross_entropy.chunk_rows(128256, 2)
    assert bf16_llama3 == 2048
    assert bf16_llama3 * 128256 * 2 <= kernels.cross_entropy.CHUNK_LOGITS_BYTES


# ----------------------------------------------------------------------------------------
# GPU: Llama 3 8B shapes, bf16 kernels against the fp32 reference
# ----------------------------------------------------------------------------------------


def gpu_inputs(*shapes, dtype=torch.bfloat16):
    return [torch.randn(shape, device="cuda", dtype=dtype) for shape in shapes]


def assert_close_on_gpu(out: torch.Tensor, ref: torch.Tensor, tolerance: float, name: str):
    """Norm-wise relative error, ||out - ref|| / ||ref||, against an fp32 reference."""
    assert out.shape == ref.shape and not out.isnan().any(), name
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{name}: {error:.1e}")
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [2048, 4096])
def test_rms_norm_bf16_matches_fp32_reference_at_llama_shapes(dim):
    x, dy = gpu_inputs((8192, dim), (8192, dim))
    weight = torch.rand(dim, device="cuda") + 0.5  # fp32, as the model's parameter
    pairs = against_reference(
        lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5),
        [x, weight], [dy], ["y", "dx", "dweight"], torch.float32,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert_close_on_gpu(out, ref, GPU_BF16_TOLERANCE, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_bf16_matches_fp32_reference_at_llama3_8b_shape_and_long_positions():
    bsz, seq_len, n_heads, n_kv_heads, head_dim = 1, 8192, 32, 8, 128
    q, k, dq_out, dk_out = gpu_inputs(
        *[(bsz, seq_len, h, head_dim) for h in (n_heads, n_kv_heads, n_heads, n_kv_heads)]
    )
    positions = torch.randint(0, 131072, (bsz, seq_len), device="cuda")  # Llama 3.1's 128k
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    pairs = rope_against_reference(q, k, dq_out, dk_out, positions, inv_freq, torch.float32)
    for name, out, ref in pairs:
        assert_close_on_gpu(out, ref, GPU_BF16_TOLERANCE, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ffn_dim", [8192, 14336])
@pytest.mark.parametrize(
    "kernel, reference",
    [
        (swiglu, swiglu_reference),
        (geglu, geglu_reference),
        (clamped_swiglu, clamped_swiglu_reference),
    ],
    ids=["swiglu", "geglu", "clamped_swiglu"],
)
def test_gated_activation_bf16_matches_fp32_reference_at_llama_shapes(kernel, reference, ffn_dim):
    """clamped_swiglu's gate and up scaled by 4 put ~4% of gates past their clamp and ~8% of
    ups past theirs (7 is 1.75 sigma), where its gradients are zero as, and only where, the
    reference's are."""
    gate, up, dout = gpu_inputs(*[(8192, ffn_dim)] * 3)
    clamped = kernel is clamped_swiglu
    if clamped:
        gate, up = gate * 4, up * 4
        assert (gate > SWIGLU_LIMIT).any() and (up.abs() > SWIGLU_LIMIT).any()
    pairs = against_reference(
        kernel, reference, [gate, up], [dout], ["out", "dgate", "dup"], torch.float32
    )
    for name, got, ref in pairs:
        assert_close_on_gpu(got, ref, GPU_BF16_TOLERANCE, name)
        assert not clamped or torch.equal(got == 0, ref == 0), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_bf16_matches_fp32_reference_at_llama3_8b_shape(reduction):
    n_tokens, dim, vocab = 8192, 4096, 128256
    hidden = torch.randn(n_tokens, dim, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    labels = torch.randint(0, vocab, (n_tokens,), device="cuda")
    labels[::7] = IGNORE_INDEX
    grad_out = torch.tensor(1.0, device="cuda")
    pairs = linear_cross_entropy_against_reference(
        hidden, weight, labels, reduction, grad_out, torch.float32
    )
    for name, out, ref in pairs:
        assert_close_on_gpu(out, ref, GPU_BF16_TOLERANCE, name)


# ----------------------------------------------------------------------------------------
# NF4 (kernels/nf4.py): quantization as bitsandbytes does it, dequantization bit for bit
# ----------------------------------------------------------------------------------------


def test_nf4_code_is_qlora_s_and_the_scale_code_is_bitsandbytes_dynamic_map():
    # QLoRA's NF4: 16 values, -1 and 1 at the ends, an exact 0 at index 7, 8 positive ones.
    assert NF4_CODE.dtype == torch.float32 and NF4_CODE.numel() == 16
    assert NF4_CODE[0] == -1 and NF4_CODE[7] == 0 and NF4_CODE[15] == 1
    assert NF4_CODE[8].item() == 0.07958029955625534 and NF4_CODE[1].item() == -0.6961928009986877
    assert (NF4_CODE.diff() > 0).all()
    # create_dynamic_map(signed=True): 256 sorted values, 0 and 1 included, smallest 1e-6 scale
    assert DYNAMIC_CODE.numel() == 256 and (DYNAMIC_CODE.diff() >= 0).all()
    assert DYNAMIC_CODE[-1] == 1 and (DYNAMIC_CODE == 0).sum() == 1
    assert DYNAMIC_CODE[0].item() == pytest.approx(-0.99296875, abs=1e-7)


def golden_weight() -> torch.Tensor:
    return torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.02


def test_nf4_quantization_equals_bitsandbytes_pinned():
    """The packed codes and quantized scales of bitsandbytes 0.50.2 (`quantize_4bit(w,
    blocksize=64, compress_statistics=True, quant_type="nf4")`) for this weight, pinned as a
    hash of its bytes, and its second-level scale and offset."""
    import hashlib

    quantized = quantize_nf4(golden_weight())
    packed = quantized.rows[:, :64].reshape(-1)
    qabsmax = quantized.rows[:, 64:66].reshape(-1)
    digest = hashlib.sha256(packed.numpy().tobytes() + qabsmax.numpy().tobytes()).hexdigest()
    assert digest == "97e448b14b16beec7a7fb315013aa5b7c66fbc61ffe86e777801278717cb6c90"
    assert quantized.absmax2.tolist() == [0.029020901769399643]
    assert quantized.offset.item() == 0.05300896242260933


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_equals_bitsandbytes(dtype):
    """Where bitsandbytes is installed (it is not a test dependency): its quantization and
    dequantization against ours, bit for bit, on rows that do not fill the last scale block."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    weight = (torch.randn(37, 192, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype)
    packed, state = bnb.quantize_4bit(
        weight, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    ours = quantize_nf4(weight)
    assert torch.equal(DYNAMIC_CODE, bnb.create_dynamic_map())
    assert torch.equal(ours.rows[:, :96].reshape(-1), packed.reshape(-1))
    assert torch.equal(ours.absmax2, state.state2.absmax) and torch.equal(ours.offset, state.offset)
    # (bitsandbytes' CPU build finds the scales' 8-bit codes by a table, not the CUDA search
    # that quantize_nf4 repeats; dequantizing our codes with its code tests the rest.)
    state.absmax = ours.rows[:, 96:99].reshape(-1).clone()
    ref = dequantize_nf4_reference(ours.rows, ours.absmax2, ours.offset, 192, dtype)
    assert torch.equal(bnb.dequantize_4bit(packed, state), ref)


def test_nf4_dequantized_weight_is_within_half_a_code_step_of_the_weight():
    weight = golden_weight()
    quantized = quantize_nf4(weight)
    dequantized = dequantize_nf4_reference(
        quantized.rows, quantized.absmax2, quantized.offset, 128, torch.float32
    )
    absmax = weight.reshape(-1, 64).abs().amax(1, keepdim=True)
    error = ((dequantized - weight).reshape(-1, 64).abs() / absmax).max()
    assert error <= NF4_CODE.diff().max() / 2 + 0.01  # plus the 8-bit scale's rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(3, 64), (37, 192), (70, 320)])
def test_nf4_dequantize_kernel_equals_reference(rows, cols, dtype):
    """fp32: bit for bit. bf16: the interpreter rounds fp32 -> bf16 toward zero where the
    compiled kernel rounds to nearest even (bit for bit on CUDA: the gpu test below), so
    here one bf16 step (up to 2^-7 relative) is allowed."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 0.03
    q = quantize_nf4(weight)
    out = dequantize_nf4(q.rows.view(torch.float32), q.absmax2, q.offset, cols, dtype)
    ref = dequantize_nf4_reference(q.rows, q.absmax2, q.offset, cols, dtype)
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()


def test_nf4_linear_gradient_is_through_the_dequantized_weight():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.03
    q = quantize_nf4(weight)
    dense = dequantize_nf4_reference(q.rows, q.absmax2, q.offset, 128, torch.float32)
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6))
    (out,), (dx,) = forward_and_grads(
        lambda t: nf4_linear(t, q.rows, q.absmax2, q.offset, 128), [x], [dy]
    )
    (ref,), (ref_dx,) = forward_and_grads(lambda t: t @ dense.t(), [x], [dy])
    assert_close(out, ref, TOLERANCE[torch.float32], "out")
    assert_close(dx, ref_dx, TOLERANCE[torch.float32], "dx")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nf4_dequantize_kernel_on_cuda_is_bitwise_and_its_bandwidth():
    """llama3.1-8b's w1 (14336 x 4096) in bf16: bit for bit the reference; and the bytes read
    and written per second beside a copy's, printed under -s, not asserted (a rate depends on
    the GPU and what else runs on it; bench/RESULTS.md records them)."""
    weight = torch.randn(14336, 4096, device="cuda") * 0.02
    q = quantize_nf4(weight)
    rows = q.rows.view(torch.bfloat16)
    out = dequantize_nf4(rows, q.absmax2, q.offset, 4096, torch.bfloat16)
    ref = dequantize_nf4_reference(q.rows, q.absmax2, q.offset, 4096, torch.bfloat16)
    assert torch.equal(out, ref)
    copy_src = torch.empty(out.numel() * 5 // 4, dtype=torch.bfloat16, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    timings = {}
    for name, fn, nbytes in [
        ("nf4 dequantize", lambda: dequantize_nf4(rows, q.absmax2, q.offset, 4096,
                                                   torch.bfloat16), q.rows.numel() + out.nbytes),
        ("copy", lambda: copy_dst.copy_(copy_src), 2 * copy_src.nbytes),
    ]:  # fmt: skip
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        timings[name] = nbytes * 20 / (start.elapsed_time(end) / 1e3) / 1e12
    ratio = timings["nf4 dequantize"] / timings["copy"]
    print(f"\nNF4 dequantize {timings['nf4 dequantize']:.2f} TB/s, copy {timings['copy']:.2f} "
          f"TB/s: {100 * ratio:.0f}% of the copy rate")  # fmt: skip


# ----------------------------------------------------------------------------------------
# FP8 linear (e4m3, rowwise scales)
# ----------------------------------------------------------------------------------------
# The quantization kernels equal their references bit for bit (the e4m3 bytes and the fp32
# scales). The linear computes with e4m3 inputs, whose rounding is up to 2^-4 of each value:
# against the unquantized linear, norm-wise error <= 6e-2 on random inputs (the errors of the
# two factors add, and average down over the summed dimension).
FP8_TOLERANCE = 6e-2


def fp8_inputs(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over many binades (e4m3's subnormals included after scaling), a zero row, a
    row with one outlier, and negative zeros (rows >= 3 for all three)."""
    x = torch.randn(rows, cols) * torch.logspace(-6, 2, cols)[torch.randperm(cols)]
    x[rows // 2] = 0.0
    x[-1, cols // 3] = 1e4
    x[0, :3] = -0.0
    return x.to(dtype)


def assert_quantized_equal(out, ref, name: str) -> None:
    (q, scale), (q_ref, scale_ref) = out, ref
    assert q.dtype == q_ref.dtype == kernels.fp8.FP8 and q.shape == q_ref.shape, name
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"{name}: e4m3 bytes differ"
    # Row by row, both: cuBLAS's e4m3 matmul takes no other layout (the GPU runs references
    # too, under --no-kernels).
    assert q.is_contiguous() and q_ref.is_contiguous(), f"{name}: not row by row"
    assert torch.equal(scale, scale_ref), f"{name}: scales differ"
    assert torch.isfinite(scale).all() and (scale > 0).all(), f"{name}: a scale is 0 or not finite"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 16), (7, 100), (70, 33), (130, 5), (3, 1)])
def test_fp8_quantization_kernels_equal_their_references(rows, cols, dtype):
    x = fp8_inputs(rows, cols, dtype)
    rows_out = kernels.fp8.quantize_rows(x)
    assert_quantized_equal(rows_out, kernels.fp8.quantize_rows_reference(x), "rows")
    columns = kernels.fp8.quantize_columns(x)
    assert_quantized_equal(columns, kernels.fp8.quantize_columns_reference(x), "columns")
    both = kernels.fp8.quantize_both(x)
    assert_quantized_equal(both[:2], columns, "both's columns")
    assert_quantized_equal(both[2:], rows_out, "both's rows")
    # Dequantized, within half an e4m3 step (2^-4 relative) of x, or of e4m3's smallest
    # subnormal step (2^-9 of the scale) for the row's small values.
    q, scale = rows_out
    step = torch.maximum(x.float().abs() * 2**-4, scale[:, None] * 2**-9)
    assert ((q.float() * scale[:, None] - x.float()).abs() <= step).all()
    if rows >= 3:
        assert (q[rows // 2].float() == 0).all()


def test_fp8_rounding_is_to_nearest_even_at_every_binade_edge():
    """Each e4m3 value and each midpoint between neighbours (ties to the even one), as the
    kernel sees them after scaling: a row whose amax is 448 keeps its scale at 1."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(kernels.fp8.FP8).float()  # 0 .. 448
    midpoints = (codes[1:] + codes[:-1]) / 2
    x = torch.cat([codes, midpoints, -midpoints, midpoints.nextafter(torch.tensor(0.0))])
    x = torch.cat([x, torch.tensor([448.0])])[None, :]
    assert_quantized_equal(
        kernels.fp8.quantize_rows(x), kernels.fp8.quantize_rows_reference(x), "edges"
    )


def fp8_linears_case(dtype: torch.dtype):
    """x [3, 11, 48] read by two projections, of 40 outputs with a bias and of 16 without."""
    torch.manual_seed(0)
    x = torch.randn(3, 11, 48, dtype=dtype)
    weights = [torch.randn(40, 48, dtype=dtype) / 7, torch.randn(16, 48, dtype=dtype) / 7]
    bias = torch.randn(40, dtype=dtype)
    grad_out = [torch.randn(3, 11, 40, dtype=dtype), torch.randn(3, 11, 16, dtype=dtype)]
    return [x, *weights, bias], grad_out


def two_projections(linear):
    return lambda x, w1, w2, b1: tuple(linear(x, [w1, w2], [b1, None]))


FP8_NAMES = ["y1", "y2", "dx", "dW1", "dW2", "db1"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linears_kernels_equal_the_reference_quantization(dtype):
    inputs, grad_out = fp8_linears_case(dtype)
    triton = forward_and_grads(two_projections(kernels.fp8_linears), inputs, grad_out)
    reference = two_projections(lambda *a: kernels.fp8_linears(*a, kernels=False))
    ref = forward_and_grads(reference, inputs, grad_out)
    for name, a, b in zip(FP8_NAMES, triton[0] + triton[1], ref[0] + ref[1], strict=True):
        assert torch.equal(a, b), name


def test_fp8_linears_output_and_gradients_are_near_the_unquantized_linear():
    """The CPU's dequantize-then-multiply path: checks the autograd wiring, which of the
    three products each gradient is, and that they differ from F.linear's only by the
    e4m3 rounding."""
    inputs, grad_out = fp8_linears_case(torch.float32)
    fp8 = forward_and_grads(two_projections(kernels.fp8_linears), inputs, grad_out)

    def unquantized(x, weights, biases):
        return [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]

    ref = forward_and_grads(two_projections(unquantized), inputs, grad_out)
    for name, a, b in zip(FP8_NAMES, fp8[0] + fp8[1], ref[0] + ref[1], strict=True):
        error = ((a - b).norm() / b.norm()).item()
        assert error <= FP8_TOLERANCE, f"{name}: norm-wise error {error:.2e}"
        assert error > 0 or name == "db1", f"{name} was not computed in e4m3"


def test_fp8_linears_of_a_frozen_weight_give_only_the_input_gradient(monkeypatch):
    """A frozen weight (LoRA's base) costs its backward one matmul, dx's, not dW's too."""
    products = []
    monkeypatch.setattr(
        kernels.fp8, "scaled_mm", lambda *a, **k: products.append(1) or scaled_mm(*a, **k)
    )
    inputs, grad_out = fp8_linears_case(torch.float32)
    x, w1, w2, b1 = (leaf(t) for t in inputs)
    w2.requires_grad_(False)
    y1, y2 = kernels.fp8_linears(x, [w1, w2], [b1, None])
    torch.autograd.backward([y1, y2], grad_out)
    assert w2.grad is None and x.grad is not None and w1.grad is not None
    assert len(products) == 2 + 3  # forward: y1, y2; backward: dx's two parts, dW1


def test_fp8_quantizers_of_tensors_together_equal_their_references_one_by_one():
    """A projection group's input and weights share a row length and are quantized in one
    launch: each tensor as alone, whatever its rows and dtype."""
    tensors = [fp8_inputs(70, 33, torch.bfloat16), fp8_inputs(1, 33, torch.float32)]
    tensors.append(fp8_inputs(130, 33, torch.bfloat16))
    for name, together, reference in [
        ("rows", kernels.fp8.quantize_rows_together, kernels.fp8.quantize_rows_reference),
        ("columns", kernels.fp8.quantize_columns_together, kernels.fp8.quantize_columns_reference),
    ]:
        for i, (out, x) in enumerate(zip(together(tensors), tensors, strict=True)):
            assert_quantized_equal(out, reference(x), f"{name} of tensor {i}")


def test_fp8_linears_of_three_weights_launch_nine_quantization_kernels(monkeypatch):
    """The host's cost of a projection group is its launches: forward quantizes x and the
    weights in one, backward x's and the weights' columns in two (amax, copy) and each output
    gradient in two; 18 when each tensor took its own."""
    launches = []
    for name in ("_quantize_rows_kernel", "_amax_kernel", "_quantize_tiles_kernel"):
        kernel = getattr(kernels.fp8, name)
        counted = lambda *a, run=kernel.run, **k: launches.append(1) or run(*a, **k)  # noqa: E731
        monkeypatch.setattr(kernel, "run", counted)
    inputs, grad_out = fp8_linears_case(torch.float32)
    x, w1, w2, _ = (leaf(t) for t in inputs)
    w3 = leaf(inputs[2][:8])
    ys = kernels.fp8_linears(x, [w1, w2, w3], [None] * 3)
    torch.autograd.backward(ys, [*grad_out, grad_out[1][..., :8]])
    assert len(launches) == 1 + 2 + 2 * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, cols", [(4096, 4096), (4099, 14336), (1000, 1024)])
def test_fp8_quantization_kernels_equal_their_references_on_cuda(rows, cols):
    """The GPU's own e4m3 conversion (not the interpreter's bit arithmetic) rounds as torch."""
    x = fp8_inputs(rows, cols, torch.bfloat16).cuda()
    rows_out = kernels.fp8.quantize_rows(x)
    assert_quantized_equal(rows_out, kernels.fp8.quantize_rows_reference(x), "rows")
    both = kernels.fp8.quantize_both(x)
    assert_quantized_equal(both[:2], kernels.fp8.quantize_columns_reference(x), "columns")
    assert_quantized_equal(both[2:], rows_out, "both's rows")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_features, in_features", [(4096, 4096), (14336, 4096), (4096, 14336)])
def test_fp8_linear_bf16_is_near_the_bf16_linear_at_llama3_8b_shapes(out_features, in_features):
    """cuBLAS's e4m3 matmul: output and the three gradients against the fp32 linear of the
    same bf16 inputs, norm-wise; bf16's own error printed beside it."""
    torch.manual_seed(0)
    x = torch.randn(4096, in_features, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / 64
    bias = torch.randn(out_features, device="cuda", dtype=torch.bfloat16)
    grad_out = [torch.randn(4096, out_features, device="cuda", dtype=torch.bfloat16)]
    inputs = [x, weight, bias]
    fp8 = forward_and_grads(lambda x, w, b: kernels.fp8_linears(x, [w], [b]), inputs, grad_out)
    bf16 = forward_and_grads(torch.nn.functional.linear, inputs, grad_out)
    ref = forward_and_grads(
        torch.nn.functional.linear, [t.float() for t in inputs], [g.float() for g in grad_out]
    )
    for i, name in enumerate(["out", "dx", "dW", "db"]):
        got, want, bf = ((o + g)[i].float() for o, g in (fp8, ref, bf16))
        error = ((got - want).norm() / want.norm()).item()
        bf16_error = ((bf - want).norm() / want.norm()).item()
        print(f"{name} {tuple(got.shape)}: fp8 {error:.2e}, bf16 {bf16_error:.2e}")
        assert not got.isnan().any() and error <= FP8_TOLERANCE, f"{name}: {error:.2e}"

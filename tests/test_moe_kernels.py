"""The mixture-of-experts kernels (kernels/moe.py) against their references: the sort by expert
(exactly), dispatch and combine, the grouped products and the whole path, forward and every
gradient, on odd shapes (row counts that fill no tile, widths over several tiles) and odd
routings (an expert that gets no token, every token on one expert, one expert, one choice).

Errors are test_kernels' max |out - ref| / max |ref| against a float64 reference run on the
same inputs, with these tolerances:
    fp32: 1e-5 (the same sums in another order)
    bf16, one kernel: 1e-2 (test_kernels' TOLERANCE: the output rounded once to bf16)
    bf16, the whole path: 4e-2. It stores four tensors in bf16 one after the other (gate and
        up, swiglu's output, the experts' rows, y), each rounding carried through the products
        after it; and Triton's CPU interpreter truncates fp32 to bf16 (an error of up to
        2^-7 = 7.8e-3, always toward zero, so the errors add up rather than cancel) where the
        GPU rounds to nearest (2^-8).
The `gpu` tests run the path compiled: at Qwen3-30B-A3B's widths, in bf16, against the fp32
reference (norm-wise error <= 1e-2, printed under `pytest -s`), and under torch's check that
nothing waits for the GPU.
"""

import pytest
import torch
from test_kernels import (
    GPU_BF16_TOLERANCE,
    TOLERANCE,
    against_reference,
    assert_close,
    assert_close_on_gpu,
)

import kernels.moe
from kernels.moe import (
    ExpertLoRA,
    add_expert_bias_,
    combine,
    combine_reference,
    dispatch_gate_up,
    dispatch_reference,
    grouped_mm,
    grouped_mm_reference,
    moe_experts,
    moe_experts_reference,
    sort_by_expert,
    sort_by_expert_reference,
)
from kernels.swiglu import SWIGLU_LIMIT

PATH_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def routing(n_tokens, n_experts, k, empty=(), every_token=None, device="cpu"):
    """experts [T, k] as a router picks them (k distinct experts a token, the top k of random
    scores), none in `empty`, and `every_token`, if given, the first choice of every token."""
    scores = torch.rand(n_tokens, n_experts, device=device)
    scores[:, list(empty)] = -1.0
    if every_token is not None:
        scores[:, every_token] = 2.0
    return scores.topk(k).indices


def router_weights(n_tokens, k, dtype, device="cpu"):
    return torch.randn(n_tokens, k, device=device).softmax(-1).to(dtype)


# ----------------------------------------------------------------------------------------
# sort_by_expert
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_tokens, n_experts, k, empty, every_token",
    [
        (37, 5, 2, [1, 4], None),  # two experts without a token, the last one among them
        (37, 5, 1, [], 3),  # every pair on one expert
        (37, 1, 1, [], None),
        (37, 128, 2, [], None),  # most experts empty; 74 pairs in blocks of 32
        (700, 5, 3, [], None),  # 2100 pairs in blocks of 512: the order kept across blocks
    ],
)
def test_sort_by_expert_equals_the_stable_argsort(n_tokens, n_experts, k, empty, every_token):
    torch.manual_seed(0)
    experts = routing(n_tokens, n_experts, k, empty, every_token)
    position, offsets = sort_by_expert(experts, n_experts)
    want_position, want_offsets = sort_by_expert_reference(experts, n_experts)
    assert position.dtype == offsets.dtype == torch.int32
    assert torch.equal(position, want_position)
    assert torch.equal(offsets, want_offsets)


# ----------------------------------------------------------------------------------------
# combine
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights_dtype", ["x's", torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens, dim, k", [(37, 48, 2), (19, 2200, 3)])  # 2200: two steps
def test_combine_matches_reference(n_tokens, dim, k, dtype, weights_dtype):
    torch.manual_seed(0)
    weights_dtype = dtype if weights_dtype == "x's" else weights_dtype
    position, _ = sort_by_expert_reference(routing(n_tokens, 5, k), 5)
    rows, weights = torch.randn(n_tokens * k, dim, dtype=dtype), router_weights(n_tokens, k, dtype)
    dy = torch.randn(n_tokens, dim, dtype=dtype)
    pairs = against_reference(
        lambda r, w: combine(r, position, w), lambda r, w: combine_reference(r, position, w),
        [rows, weights.to(weights_dtype)], [dy], ["y", "drows", "dweights"], torch.float64,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert out.dtype == (weights_dtype if name == "dweights" else dtype), name
        assert_close(out, ref, TOLERANCE[dtype], name)


# ----------------------------------------------------------------------------------------
# grouped_mm
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "counts, inner, outer",
    [
        ([20, 0, 33, 21, 0], 48, 40),  # 74 rows; two experts without rows, the last one among them
        ([0, 150, 0], 80, 72),  # every row on one expert: 3 row tiles, 2 output tiles, 3 steps
        ([1, 1, 1, 1, 1], 48, 40),
    ],
)
def test_grouped_mm_matches_reference(counts, inner, outer, dtype):
    torch.manual_seed(0)
    offsets = torch.tensor([0, *counts]).cumsum(0).int()
    a = torch.randn(sum(counts), inner, dtype=dtype)
    w = torch.randn(len(counts), outer, inner, dtype=dtype) / inner**0.5
    dout = torch.randn(sum(counts), outer, dtype=dtype)
    pairs = against_reference(
        lambda a, w: grouped_mm(a, w, offsets), lambda a, w: grouped_mm_reference(a, w, offsets),
        [a, w], [dout], ["out", "da", "dw"], torch.float64,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert out.dtype == dtype
        assert_close(out, ref, TOLERANCE[dtype], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens, dim, k, empty", [(37, 48, 2, [1]), (19, 2200, 3, [])])
def test_dispatch_gate_up_matches_reference(n_tokens, dim, k, empty, dtype):
    """dispatch, then w1's and w3's products of the same rows (2200 columns: two steps of
    the row kernels); x's gradient is the sum of the two products' through dispatch."""
    torch.manual_seed(0)
    position, offsets = sort_by_expert_reference(routing(n_tokens, 5, k, empty=empty), 5)
    x = torch.randn(n_tokens, dim, dtype=dtype)
    w1, w3 = (torch.randn(5, 24, dim, dtype=dtype) / dim**0.5 for _ in range(2))
    dgate, dup = (torch.randn(n_tokens * k, 24, dtype=dtype) for _ in range(2))

    def reference(x, w1, w3):
        rows = dispatch_reference(x, position)
        return grouped_mm_reference(rows, w1, offsets), grouped_mm_reference(rows, w3, offsets)

    pairs = against_reference(
        lambda x, w1, w3: dispatch_gate_up(x, position, w1, w3, offsets), reference,
        [x, w1, w3], [dgate, dup], ["gate", "up", "dx", "dw1", "dw3"], torch.float64,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert out.dtype == dtype, name
        assert_close(out, ref, TOLERANCE[dtype], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "counts, width",
    [([20, 0, 33, 21, 0], 40), ([0, 75, 0], 130), ([1] * 130, 3)],  # 130 experts: E_PAD 256
)
def test_add_expert_bias_equals_the_gathered_bias(counts, width, dtype):
    """rows + bias[expert], each row's expert read from the offsets, in place; the bias's
    gradient the sum of its expert's rows (none for an expert without rows)."""
    torch.manual_seed(0)
    offsets = torch.tensor([0, *counts]).cumsum(0).int()
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    rows = torch.randn(sum(counts), width, dtype=dtype)
    bias = torch.randn(len(counts), width, dtype=dtype)
    if dtype == torch.float32:  # bit for bit (in bf16 the interpreter truncates, the GPU rounds)
        assert torch.equal(add_expert_bias_(rows.clone(), bias, offsets), rows + bias[expert])
    pairs = against_reference(
        lambda r, b: add_expert_bias_(r.clone(), b, offsets), lambda r, b: r + b[expert],
        [rows, bias], [torch.randn(sum(counts), width, dtype=dtype)], ["out", "drows", "dbias"],
        torch.float64,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert out.dtype == dtype, name
        assert_close(out, ref, TOLERANCE[dtype], name)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_mm_equals_torch_grouped_mm_given_the_offsets_ends():
    """The call kernels/moe.py makes instead of the Triton kernel on Hopper, in bf16."""
    torch.manual_seed(0)
    offsets = torch.tensor([0, 20, 20, 53, 74, 74], dtype=torch.int32)
    a, w = torch.randn(74, 48), torch.randn(5, 40, 48)
    theirs = torch._grouped_mm(a, w.transpose(1, 2), offs=offsets[1:])
    assert_close(grouped_mm(a, w, offsets), theirs, TOLERANCE[torch.float32], "out")


# ----------------------------------------------------------------------------------------
# The whole path
# ----------------------------------------------------------------------------------------


def path_against_reference(experts, inputs, dy, reference_dtype):
    """against_reference of moe_experts, inputs [x, weights, w1, w3, w2], for y and every
    input's gradient."""
    return against_reference(
        lambda x, w, *ws: moe_experts(x, experts, w, *ws),
        lambda x, w, *ws: moe_experts_reference(x, experts, w, *ws),
        inputs, [dy], ["y", "dx", "dweights", "dw1", "dw3", "dw2"], reference_dtype,
    )  # fmt: skip


def layer_inputs(n_tokens, dim, ffn_dim, n_experts, dtype, device="cpu"):
    """x [T, D], w1, w3 [E, F, D], w2 [E, D, F], scaled so that every product is of order 1."""
    x = torch.randn(n_tokens, dim, dtype=dtype, device=device)
    w1, w3 = (torch.randn(n_experts, ffn_dim, dim, device=device) / dim**0.5 for _ in range(2))
    w2 = torch.randn(n_experts, dim, ffn_dim, device=device) / ffn_dim**0.5
    return x, w1.to(dtype), w3.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n_experts, k, empty, every_token",
    [(5, 2, [1], None), (5, 2, [], 3), (5, 1, [], 3), (1, 1, [], None)],
    ids=["an-expert-gets-no-token", "every-token-on-expert-3", "k=1-all-on-expert-3", "E=1"],
)
def test_moe_experts_matches_reference(n_experts, k, empty, every_token, dtype):
    """T = 37 tokens, D = 48, F = 40: T*k rows fill no tile, and no expert's rows do either."""
    torch.manual_seed(0)
    x, w1, w3, w2 = layer_inputs(37, 48, 40, n_experts, dtype)
    experts = routing(37, n_experts, k, empty, every_token)
    weights, dy = router_weights(37, k, dtype), torch.randn(37, 48, dtype=dtype)
    pairs = path_against_reference(experts, [x, weights, w1, w3, w2], dy, torch.float64)
    for name, out, ref in pairs:
        assert out.dtype == dtype
        assert_close(out, ref, PATH_TOLERANCE[dtype], name)


def test_gpt_oss_experts_match_reference():
    """gpt-oss's experts: biases on the three products and the clamped SwiGLU (the fused
    kernel against its reference), with gate and up products of scale 5, so that both clamps
    cut; y and every gradient, the biases' too. In fp32: in bf16 a product within a rounding of
    a bound lands on either side of it, a gradient of 0 against one of order 1 (at this scale
    the bf16 reference's dw1 is 8e-2 off the float64 one)."""
    torch.manual_seed(0)
    x, w1, w3, w2 = layer_inputs(37, 48, 40, 5, torch.float32)
    w1, w3 = w1 * 5, w3 * 5
    gates, ups = (torch.einsum("td,efd->tef", x, w) for w in (w1, w3))
    assert (gates > SWIGLU_LIMIT).any() and (ups.abs() > SWIGLU_LIMIT).any()
    biases = [torch.randn(5, n) for n in (40, 40, 48)]
    experts = routing(37, 5, 2, empty=[1])
    weights, dy = router_weights(37, 2, torch.float32), torch.randn(37, 48)
    pairs = against_reference(
        lambda x, w, w1, w3, w2, *b: moe_experts(x, experts, w, w1, w3, w2, b, "clamped_swiglu"),
        lambda x, w, w1, w3, w2, *b: moe_experts_reference(
            x, experts, w, w1, w3, w2, b, "clamped_swiglu"
        ),
        [x, weights, w1, w3, w2, *biases], [dy],
        ["y", "dx", "dweights", "dw1", "dw3", "dw2", "db1", "db3", "db2"], torch.float64,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert_close(out, ref, PATH_TOLERANCE[torch.float32], name)


def test_moe_experts_takes_fp32_router_weights_with_bf16_activations():
    """The router's softmax is in fp32; its weights need no cast, and their gradient comes
    back in fp32."""
    torch.manual_seed(0)
    x, w1, w3, w2 = layer_inputs(37, 48, 40, 5, torch.bfloat16)
    experts, weights = routing(37, 5, 2), router_weights(37, 2, torch.float32)
    dy = torch.randn(37, 48, dtype=torch.bfloat16)
    pairs = against_reference(
        lambda w: moe_experts(x, experts, w, w1, w3, w2),
        lambda w: moe_experts_reference(x.double(), experts, w, w1.double(), w3.double(),
                                        w2.double()),
        [weights], [dy], ["y", "dweights"], torch.float64,
    )  # fmt: skip
    (_, y, y_ref), (_, dweights, dweights_ref) = pairs
    assert y.dtype == torch.bfloat16 and dweights.dtype == torch.float32
    assert_close(y, y_ref, PATH_TOLERANCE[torch.bfloat16], "y")
    assert_close(dweights, dweights_ref, PATH_TOLERANCE[torch.bfloat16], "dweights")


def test_moe_experts_and_grouped_mm_name_every_mismatch_at_once():
    x, w1, w3, w2 = layer_inputs(37, 48, 40, 5, torch.float32)
    experts, weights = routing(37, 5, 2), router_weights(37, 2, torch.float32)
    with pytest.raises(ValueError, match=r"w2 \(5, 40, 48\), expected \(5, 48, 40\); w3 torch"):
        moe_experts(x, experts, weights, w1, w3.bfloat16(), w2.transpose(1, 2))
    with pytest.raises(ValueError, match="experts torch.float32, expected integers"):
        moe_experts(x, experts.float(), weights, w1, w3, w2)
    for fn in (moe_experts, moe_experts_reference):
        with pytest.raises(
            ValueError, match=f"{fn.__name__}: activation 'gelu', expected one of swiglu, clamped_"
        ):
            fn(x, experts, weights, w1, w3, w2, activation="gelu")
    with pytest.raises(ValueError, match="clamped_swiglu; w3 torch.bfloat16, expected x's"):
        moe_experts(x, experts, weights, w1, w3.bfloat16(), w2, activation="gelu")
    with pytest.raises(ValueError, match=r"offsets \(6,\) torch.int64, expected int32"):
        grouped_mm(x, w1, torch.zeros(6, dtype=torch.int64))
    # The adapters' shapes too: B's rank is A's; a B without its A is refused.
    a13, b = torch.zeros(5, 4, 48), torch.zeros(5, 40, 3)
    lora = ExpertLoRA(2.0, a13, b, torch.zeros(5, 40, 4), None, None)
    with pytest.raises(ValueError, match=r"b1 \(5, 40, 3\), expected \(5, 40, 4\)"):
        moe_experts(x, experts, weights, w1, w3, w2, lora=lora)
    with pytest.raises(ValueError, match="lora's b2 is given exactly when its a2 is"):
        moe_experts(x, experts, weights, w1, w3, w2, lora=ExpertLoRA(2.0, *[None] * 4, b))


# ----------------------------------------------------------------------------------------
# GPU: Qwen3-30B-A3B's widths, bf16 against the fp32 reference
# ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("products", ["torch._grouped_mm", "triton"])
def test_moe_experts_bf16_matches_fp32_reference_at_qwen3_30b_a3b_widths(products, monkeypatch):
    """D = 2048, F = 768, E = 128, k = 8, 4096 tokens (32768 rows), expert 0 never chosen (its
    weights' gradients zeros), the grouped products by torch._grouped_mm where the GPU has it
    (Hopper) and by the Triton kernel."""
    if products == "triton":
        monkeypatch.setattr(kernels.moe, "_on_cutlass", lambda a, n: False)
    elif not kernels.moe._on_cutlass(torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"), 8):
        pytest.skip("torch._grouped_mm's bf16 kernels need sm90")
    torch.manual_seed(0)
    x, w1, w3, w2 = layer_inputs(4096, 2048, 768, 128, torch.bfloat16, device="cuda")
    experts = routing(4096, 128, 8, empty=[0], device="cuda")
    weights = router_weights(4096, 8, torch.float32, device="cuda")
    dy = torch.randn_like(x)
    pairs = path_against_reference(experts, [x, weights, w1, w3, w2], dy, torch.float32)
    for name, out, ref in pairs:
        assert_close_on_gpu(out, ref, GPU_BF16_TOLERANCE, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("products", ["torch._grouped_mm", "triton"])
def test_expert_adapters_bf16_match_fp32_reference_at_qwen3_30b_a3b_widths(products, monkeypatch):
    """LoRA of rank 16 on every expert (ExpertLoRA) over the frozen experts above: y, dx, the
    router's and every adapter's gradient (expert 0's zeros), the low-rank products by
    torch._grouped_mm (rank 16: rows of 32 bytes) and by the Triton kernel."""
    if products == "triton":
        monkeypatch.setattr(kernels.moe, "_on_cutlass", lambda a, n: False)
    elif not kernels.moe._on_cutlass(torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"), 8):
        pytest.skip("torch._grouped_mm's bf16 kernels need sm90")
    torch.manual_seed(0)
    dim, ffn, n_experts, r = 2048, 768, 128, 16
    x, w1, w3, w2 = layer_inputs(4096, dim, ffn, n_experts, torch.bfloat16, device="cuda")
    experts = routing(4096, n_experts, 8, empty=[0], device="cuda")
    weights = router_weights(4096, 8, torch.float32, device="cuda")
    shapes = [(r, dim), (ffn, r), (ffn, r), (r, ffn), (dim, r)]
    factors = [torch.randn(n_experts, *s, device="cuda") / s[1] ** 0.5 for s in shapes]

    def path(run):
        def experts_with(x, w, *factors):
            base = [t.to(x.dtype) for t in (w1, w3, w2)]
            return run(x, experts, w, *base, lora=ExpertLoRA(2.0, *factors))

        return experts_with

    pairs = against_reference(
        path(moe_experts), path(moe_experts_reference),
        [x, weights, *(f.to(torch.bfloat16) for f in factors)], [torch.randn_like(x)],
        ["y", "dx", "dweights", "da13", "db1", "db3", "da2", "db2"], torch.float32,
    )  # fmt: skip
    for name, out, ref in pairs:
        assert_close_on_gpu(out, ref, GPU_BF16_TOLERANCE, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_experts_never_waits_for_the_gpu():
    """Forward and backward under torch's sync check, which raises at a read of a value on the
    host (.item(), .tolist(), nonzero, bincount): the reference's nonzero does."""
    torch.manual_seed(0)
    x, w1, w3, w2 = layer_inputs(512, 256, 96, 16, torch.bfloat16, device="cuda")
    weights = router_weights(512, 4, torch.float32, device="cuda")
    inputs = [t.requires_grad_() for t in (x, weights, w1, w3, w2)]
    experts = routing(512, 16, 4, device="cuda")

    def step(experts_fn):
        x, weights, *ws = inputs
        experts_fn(x, experts, weights, *ws).backward(torch.ones_like(x))

    step(moe_experts)  # compiles the kernels
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(moe_experts)
        with pytest.raises(RuntimeError, match="synchronizing"):
            step(moe_experts_reference)
    finally:
        torch.cuda.set_sync_debug_mode("default")

"""Activation checkpointing and activation offload against plain autograd, one process.

Tolerances, fp32:
  gradients: max |a - b| <= 1e-5 * max |b| per tensor (recomputation repeats the same ops
  on the same inputs, so on the CPU the results are in fact bitwise equal).
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import offload as offload_module
from model import (
    REFERENCE_OPS,
    Attention,
    FeedForward,
    Llama,
    ModelArgs,
    fp8_ops,
    triton_ops,
)
from offload import (
    AC_MODES,
    ATTENTION_OPS,
    activation_offload,
    apply_ac,
    apply_mlp_tiling,
    host_pieces,
)

FP32_RTOL = 1e-5
# --fp8's gradients against the unquantized model's, norm-wise per tensor: each projection's
# e4m3 rounding is within 6e-2 (tests/test_kernels.py), and the errors compound through the
# tiny model's 4 blocks (measured up to 8.7e-2).
FP8_TOLERANCE = 0.15
ARGS = ModelArgs.from_name("tiny")
# 2 x 40 tokens: no activation shares a shape with a weight (checked below).
BATCH, SEQ = 2, 40


def batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g)
    return tokens.to(device), labels.to(device)


def build(
    ac: str = "none",
    every: int = 1,
    device="cpu",
    document_mask=False,
    long_document=None,
    ops=REFERENCE_OPS,
) -> Llama:
    with torch.device("meta"):
        model = Llama(ARGS, ops=ops, document_mask=document_mask)
    model.long_document = long_document or model.long_document
    apply_ac(model, ac, every)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


# Two documents in each row, the second from position 0 at token 15.
PACKED = torch.cat([torch.arange(15), torch.arange(SEQ - 15)]).expand(BATCH, SEQ)


def gradients(model: Llama, offload: bool = False, min_bytes: int = 0, positions=None):
    device = next(model.parameters()).device
    tokens, labels = batch(device)
    if positions is not None:
        positions = positions.to(device)
    with activation_offload(model, enabled=offload, min_bytes=min_bytes) as offloader:
        loss = model(tokens, labels, positions)
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    return grads, offloader


def saved_bytes(model: Llama) -> int:
    """Bytes autograd is asked to keep outside checkpointed regions (the checkpoint's own
    hooks take what is saved inside them)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    tokens, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels)
    return total


def assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = (got[name] - ref).abs().max()
        assert err <= FP32_RTOL * ref.abs().max(), f"{name}: max error {err:.2e}"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The model is tiny: with CI's 2 shared cores, OpenMP threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    return gradients(build())[0]


@pytest.mark.parametrize(
    "ac, every, offload",
    [("full", 1, False), ("full", 2, False), ("attention", 1, False), ("selective", 1, False),
     ("none", 1, True), ("full", 1, True), ("selective", 2, True)],
)  # fmt: skip
def test_checkpointing_and_offload_keep_gradients(reference, ac, every, offload):
    grads, offloader = gradients(build(ac, every), offload=offload)
    assert_grads_close(grads, reference)
    if offload:
        assert offloader.offloaded_tensors > 0


@pytest.mark.parametrize("ac", ["none", "full", "attention", "selective"])
def test_mlp_tiles_keep_gradients(reference, ac):
    model = build(ac)
    apply_mlp_tiling(model, tile_tokens=16)  # SEQ 40: tiles of 16, 16 and 8 positions
    grads, _ = gradients(model)
    assert_grads_close(grads, reference)


@pytest.mark.parametrize("ac", AC_MODES)
def test_mlp_tiles_run_in_forward_and_once_in_their_backward(monkeypatch, ac):
    """A checkpointed block's recomputation does not run its MLP tiles: each tile's own
    checkpoint runs it in the tile's backward (the one forward more that tiling costs)."""
    runs = 0
    forward = FeedForward.forward

    def counted(self, x):
        nonlocal runs
        runs += 1
        return forward(self, x)

    monkeypatch.setattr(FeedForward, "forward", counted)
    model = build(ac)
    apply_mlp_tiling(model, tile_tokens=16)  # 3 tiles
    gradients(model)
    assert runs == 2 * 3 * ARGS.n_layers


@pytest.fixture(scope="module")
def triton_gradients():
    """The plain model's gradients on the Triton kernels (interpreted: computed once)."""
    return gradients(build(ops=triton_ops()))[0]


@pytest.fixture(scope="module")
def fp8_gradients():
    """The plain FP8 model's (model.fp8_ops; on the CPU the e4m3 values dequantized, then
    multiplied), scaled by the quantizers' references: what is tested here is what
    checkpointing does with them (tests/test_kernels.py tests the Triton ones)."""
    return gradients(build(ops=fp8_ops(triton_ops(), kernels=False)))[0]


@pytest.mark.parametrize(
    "ac, tile", [("none", 0), ("full", 0), ("selective", 0), ("attention", 0), ("full", 16)]
)
def test_triton_kernels_keep_gradients_under_checkpointing_and_offload(triton_gradients, ac, tile):
    """The SwiGLU kernel's backward writes its gradients over the gate and up it saved;
    under each way of keeping or rebuilding them, the gradients stay those of the plain
    model on the same kernels."""
    model = build(ac, ops=triton_ops())
    apply_mlp_tiling(model, tile_tokens=tile)
    grads, _ = gradients(model, offload=True)
    assert_grads_close(grads, triton_gradients)


@pytest.mark.parametrize("ac", ["none", "full", "attention", "selective"])
def test_fp8_projections_keep_gradients_under_checkpointing_and_offload(fp8_gradients, ac):
    """--fp8's projections: recomputation quantizes the same inputs again, and selective
    checkpointing keeps the e4m3 matmuls' outputs, so each mode gives the gradients of the
    plain FP8 model."""
    ops = fp8_ops(triton_ops(), kernels=False)
    grads, _ = gradients(build(ac, ops=ops), offload=True)
    assert_grads_close(grads, fp8_gradients)


def test_fp8_gradients_are_within_fp8s_error_of_the_unquantized_ones(
    fp8_gradients, triton_gradients
):
    for name, ref in triton_gradients.items():
        error = ((fp8_gradients[name] - ref).norm() / ref.norm()).item()
        assert error <= FP8_TOLERANCE, f"{name}: norm-wise error {error:.2e}"
        if name.endswith(("wq.weight", "w2.weight")):
            assert error > 0, f"{name}: not computed in e4m3"


def test_no_checkpointing_mode_keeps_a_grouped_product():
    """kernels/moe.py adds biases and adapters to torch._grouped_mm's outputs in place (on
    Hopper): a kept output would be the recompute's too and take them twice. The CPU runs the
    Triton kernel, no aten op, so only this can see the rule broken."""
    kept = set().union(*offload_module.SAVED_OPS.values())
    assert torch.ops.aten._grouped_mm.default not in kept
    assert torch.ops.aten.mm.default in kept  # the set this reads is the policy's


def test_selective_checkpointing_keeps_the_fp8_matmuls_outputs():
    """The recompute of a selectively checkpointed FP8 block runs no matmul: its backward
    runs as many as the unchekpointed model's, and full checkpointing's more."""

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            matmuls = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
            Count.calls += func in matmuls
            return func(*args, **(kwargs or {}))

    def backward_matmuls(ac: str) -> int:
        model = build(ac, ops=fp8_ops(triton_ops(), kernels=True))
        loss = model(*batch())
        Count.calls = 0
        with Count():
            loss.backward()
        return Count.calls

    assert backward_matmuls("selective") == backward_matmuls("none") < backward_matmuls("full")


@pytest.fixture(scope="module")
def packed_reference():
    return gradients(build(document_mask=True), positions=PACKED)[0]


@pytest.mark.parametrize(
    "ac, offload, tile",
    [("full", False, 0), ("attention", False, 0), ("selective", False, 0),
     ("attention", True, 16), ("selective", True, 0)],
)  # fmt: skip
@pytest.mark.parametrize("long_document", [None, 20], ids=["masked", "second-alone"])
def test_document_masked_attention_keeps_gradients(
    packed_reference, ac, offload, tile, long_document
):
    model = build(ac, document_mask=True, long_document=long_document)
    apply_mlp_tiling(model, tile)
    grads, _ = gradients(model, offload=offload, min_bytes=0, positions=PACKED)
    assert_grads_close(grads, packed_reference)


@pytest.mark.parametrize("ac", ["attention", "selective"])
@pytest.mark.parametrize("positions", [None, PACKED], ids=["causal", "documents"])
def test_offload_leaves_what_the_checkpoint_keeps_on_the_device(ac, positions):
    """Activation offload moves a checkpointed block's input, not the op outputs the policy
    keeps (the planner counts those on the GPU: plan.block_bytes), so it moves as much as
    under full checkpointing; and torch (2.14 on) is told so, so it does not warn that a
    later release would route them through offload's hooks."""
    offloaded = {}
    for mode in ("full", ac):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model = build(mode, document_mask=positions is not None)
            _, offloader = gradients(model, offload=True, min_bytes=0, positions=positions)
        offloaded[mode] = offloader.offloaded_bytes
    assert offloaded[ac] == offloaded["full"] > 0


class CountSDPA(TorchDispatchMode):
    """Counts the SDPA kernels that actually run: a kept output handed back by the selective
    checkpoint's recompute never reaches a mode below it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ac, per_block", [("none", 1), ("full", 2), ("attention", 1),
                                           ("selective", 1)])  # fmt: skip
@pytest.mark.parametrize("positions", [None, PACKED], ids=["causal", "documents"])
def test_attention_runs_once_per_block_unless_fully_recomputed(
    monkeypatch, ac, per_block, positions
):
    """The kernel behind each block's attention, counted over a forward and backward: SDPA's
    causal kernel at the dispatcher, the document-masked one (dense SDPA on the CPU, compiled
    FlexAttention on a GPU, both through Attention.attend) where it is called."""
    calls = 0
    attend = Attention.attend

    def counted(self, q, k, v, mask, sinks=None):
        nonlocal calls
        calls += mask is not None
        return attend(self, q, k, v, mask, sinks)

    monkeypatch.setattr(Attention, "attend", counted)
    model = build(ac, document_mask=True)
    with CountSDPA() as sdpa:
        gradients(model, positions=positions)
    if positions is None:
        assert (calls, sdpa.calls) == (0, per_block * ARGS.n_layers)
    else:
        assert calls == per_block * ARGS.n_layers


def test_mlp_tiles_hold_less_than_the_whole_sequence():
    tiled = build("none")
    apply_mlp_tiling(tiled, tile_tokens=8)
    assert saved_bytes(tiled) < saved_bytes(build("none"))


def test_checkpointing_keeps_parameter_names():
    with torch.device("meta"):
        plain = Llama(ARGS)
    for mode in AC_MODES:
        assert [n for n, _ in build(mode).named_parameters()] == [
            n for n, _ in plain.named_parameters()
        ]


def test_full_checkpointing_keeps_only_block_inputs():
    none, every2, full = (saved_bytes(build(*c)) for c in [("none", 1), ("full", 2), ("full", 1)])
    assert full < every2 < none
    # Per block, full AC keeps its input [B, S, D] fp32 (plus positions and inv_freq).
    block_input = BATCH * SEQ * ARGS.dim * 4
    outside_blocks = saved_bytes(build("full")) - ARGS.n_layers * block_input
    assert 0 < outside_blocks < none - ARGS.n_layers * 4 * block_input


def test_unknown_checkpointing_mode_is_refused():
    with torch.device("meta"):
        model = Llama(ARGS)
    with pytest.raises(
        ValueError, match=r"expected one of \('none', 'full', 'attention', 'selective'\)"
    ):
        apply_ac(model, "layers")


def test_offload_skips_weights_and_small_tensors_and_frees_its_copies():
    model = build()
    tokens, labels = batch()
    with activation_offload(model, min_bytes=0) as offloader:
        loss = model(tokens, labels)
    copies = [ref() for refs in offloader.blocks.values() for ref in refs]
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    assert copies and not any(tuple(c.shape) in weight_shapes for c in copies)
    assert sorted(offloader.blocks) == list(range(ARGS.n_layers - 1))  # not the last
    del copies
    loss.backward()
    # Autograd dropped its saved tensors, so the host copies are gone.
    assert all(ref() is None for refs in offloader.blocks.values() for ref in refs)
    # The default threshold (1 MiB) is above every activation of this tiny model.
    with activation_offload(model) as offloader:
        model(tokens, labels)
    assert offloader.offloaded_tensors == 0


def test_offload_of_a_view_into_a_larger_tensor_keeps_its_values():
    """A saved tensor that is part of a larger one, at an offset (a row range: contiguous,
    and a column range: not), comes back as its own values, not the larger one's first
    bytes."""

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1.5
            # sin and cos save their inputs: the rows after the first, the columns after it
            return torch.cat([x[:1], y[1:].sin()]) + torch.cat([x[:, :1], y[:, 1:].cos()], 1)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])  # the last one is not offloaded
    # On the device offload copies from: pinned host memory and a side stream under CUDA.
    x = torch.randn(5, 7, device="cuda" if torch.cuda.is_available() else "cpu")
    x.requires_grad_()
    grads = []
    for offload in (False, True):
        with activation_offload(model, enabled=offload, min_bytes=0) as offloader:
            out = model.layers[1](model.layers[0](x))
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        grads.append(grad)
    assert offloader.offloaded_tensors == 2
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_host_pieces_hold_exactly_the_bytes_in_powers_of_two():
    mib = offload_module.SMALLEST_PIECE
    for nbytes in (1, mib, 3 * mib + 512 * 1024 + 10, 2**31 // 4 * 3 // mib * mib):
        sizes = [p.numel() for p in host_pieces(nbytes, pin_memory=False)]
        assert sum(sizes) == nbytes and sizes == sorted(sizes, reverse=True)
        assert all(n & (n - 1) == 0 for n in sizes if n >= mib)  # what pinning will not round
        assert sum(n < mib for n in sizes) <= 1


def test_offload_in_many_pieces_keeps_gradients(reference, monkeypatch):
    # Pieces down to 64 bytes: every saved tensor of the tiny model goes out and back in
    # several, laid end to end.
    monkeypatch.setattr(offload_module, "SMALLEST_PIECE", 64)
    grads, offloader = gradients(build("none"), offload=True, min_bytes=0)
    assert_grads_close(grads, reference)
    assert offloader.offloaded_tensors > 0


def test_offload_of_the_first_blocks_only(reference):
    model = build()
    with activation_offload(model, min_bytes=0, blocks=2) as offloader:
        loss = model(*batch())
    assert sorted(offloader.blocks) == [0, 1]
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    assert_grads_close(grads, reference)


def test_disabled_offload_is_a_plain_forward(reference):
    grads, offloader = gradients(build(), offload=False)
    assert offloader is None
    assert_grads_close(grads, reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ac", ["none", "full"])
def test_offload_on_cuda_keeps_gradients(ac):
    """Side-stream copies to pinned memory and back give the on-GPU gradients."""
    want = gradients(build(ac, device="cuda"))[0]
    got, offloader = gradients(build(ac, device="cuda"), offload=True)
    assert offloader.offloaded_tensors > 0
    assert_grads_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ac, per_block", [("full", 2), ("attention", 1), ("selective", 1)])
@pytest.mark.parametrize("long_document", [None, 20], ids=["flex", "flex-and-cudnn"])
def test_flex_attention_on_cuda_is_kept_and_keeps_gradients(
    monkeypatch, ac, per_block, long_document
):
    """Compiled FlexAttention (the document mask on CUDA), with the second document of each
    row through SDPA on its own or not, fp32: the gradients of each checkpointing mode equal
    no checkpointing (and the dense mask), and only "full" runs the kernel twice."""
    import attention as attention_module

    on_cpu = build(document_mask=True)  # the dense mask

    def on_cuda(ac: str, long_document: int | None = None) -> Llama:
        model = build(ac, device="cuda", document_mask=True, long_document=long_document)
        model.load_state_dict(on_cpu.state_dict())  # CUDA's generator draws other weights
        return model

    want = gradients(on_cuda("none"), positions=PACKED)[0]
    calls = 0
    flex = attention_module.compiled_flex_attention()

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return flex(*args, **kwargs)

    monkeypatch.setattr(attention_module, "compiled_flex_attention", lambda: counted)
    got, _ = gradients(on_cuda(ac, long_document), positions=PACKED)
    assert calls == per_block * ARGS.n_layers
    assert_grads_close(got, want)
    assert_grads_close(got, gradients(on_cpu, positions=PACKED)[0])

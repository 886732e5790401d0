"""Activation checkpointing and activation offload against plain autograd, one process.

Tolerance: fp32, max |a - b| <= 1e-5 * max |b| per gradient (recomputation repeats the
same ops on the same inputs, so on the CPU the results are in fact bitwise equal).
"""

import pytest
import torch

from model import Llama, ModelArgs
from offload import AC_MODES, activation_offload, apply_ac, apply_mlp_tiling

FP32_RTOL = 1e-5
ARGS = ModelArgs.from_name("tiny")
# 2 x 40 tokens: no activation shares a shape with a weight (checked below).
BATCH, SEQ = 2, 40


def batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g)
    return tokens.to(device), labels.to(device)


def build(ac: str = "none", every: int = 1, device="cpu") -> Llama:
    with torch.device("meta"):
        model = Llama(ARGS)
    apply_ac(model, ac, every)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


def gradients(model: Llama, offload: bool = False, min_bytes: int = 0):
    tokens, labels = batch(next(model.parameters()).device)
    with activation_offload(model, enabled=offload, min_bytes=min_bytes) as offloader:
        loss = model(tokens, labels)
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


@pytest.mark.parametrize("ac", ["none", "full", "attention"])
def test_mlp_tiles_keep_gradients(reference, ac):
    model = build(ac)
    apply_mlp_tiling(model, tile_tokens=16)  # SEQ 40: tiles of 16, 16 and 8 positions
    grads, _ = gradients(model)
    assert_grads_close(grads, reference)


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
    with pytest.raises(ValueError, match="every"):
        apply_ac(model, "full", every=0)


def test_offload_skips_weights_and_small_tensors_and_frees_its_copies():
    model = build()
    tokens, labels = batch()
    with activation_offload(model, min_bytes=0) as offloader:
        loss = model(tokens, labels)
    copies = [ref() for refs in offloader.blocks.values() for ref in refs]
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    assert copies and not any(tuple(c.host.shape) in weight_shapes for c in copies)
    assert sorted(offloader.blocks) == list(range(ARGS.n_layers - 1))  # not the last
    del copies
    loss.backward()
    # Autograd dropped its saved tensors, so the host copies are gone.
    assert all(ref() is None for refs in offloader.blocks.values() for ref in refs)
    # The default threshold (1 MiB) is above every activation of this tiny model.
    with activation_offload(model) as offloader:
        model(tokens, labels)
    assert offloader.offloaded_tensors == 0


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

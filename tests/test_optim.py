"""The optimizer in backward against torch.optim.AdamW, one process.

Tolerances, fp32: weights after 4 AdamW steps, optimizer in backward against
torch.optim.AdamW's default (for-loop) implementation: max |a - b| <= 1e-5 * max |b| per tensor
(the two round the update differently: measured 1e-6; a wrong lr, beta or weight decay shows
as 1e-4 or more); the global gradient norm: relative 1e-6 (a sum of squares in another order,
measured 2e-7).
"""

import dataclasses
import threading
import time

import pytest
import torch

import optim
from model import PRESETS, Llama, ModelArgs
from optim import OptimizerInBackward
from shard import fill_weights

ARGS = ModelArgs.from_name("tiny")
FP32_RTOL = 1e-5
BATCH, SEQ = 2, 40
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1


def adamw_steps(args: ModelArgs, in_backward: bool, device="cpu", steps: int = 4):
    """`steps` steps of warming-up lr on random batches; returns the model, its optimizer
    and the global gradient norm of each step."""
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")  # fp32 on the host: the optimizer in backward's masters
    fill_weights(model, 0, torch.device(device))
    if in_backward:
        optimizer = OptimizerInBackward(
            model, torch.device(device), torch.float32, LR, BETAS, WEIGHT_DECAY
        )
    else:
        model.to(device)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=LR,
            betas=BETAS,
        )
    g = torch.Generator().manual_seed(0)
    norms = []
    for step in range(steps):
        tokens, labels = torch.randint(0, args.vocab_size, (2, BATCH, SEQ), generator=g)
        lr = LR * (step + 1) / steps
        if in_backward:
            optimizer.set_lr(lr)
        else:
            for group in optimizer.param_groups:
                group["lr"] = lr
        model(tokens.to(device), labels.to(device)).backward()
        if in_backward:
            norms.append(optimizer.step().item())
        else:
            grads = [p.grad for p in model.parameters()]
            norms.append(torch.nn.utils.get_total_norm(grads).item())
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer, norms


def assert_weights_close(got: Llama, want: Llama) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        a, b = a.detach().cpu(), b.detach().cpu()
        err = (a - b).abs().max()
        assert err <= FP32_RTOL * b.abs().max(), f"{name}: max error {err:.2e}"


@pytest.mark.parametrize("tied", [False, True])
def test_optimizer_in_backward_takes_adamws_steps(tied):
    """Tied: the embedding, used twice, is updated once a step with the summed gradient."""
    args = dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied)
    got, optimizer, norms = adamw_steps(args, in_backward=True)
    want, _, want_norms = adamw_steps(args, in_backward=False)
    assert_weights_close(got, want)
    assert norms == pytest.approx(want_norms, rel=1e-6)
    assert all(p.grad is None for p in got.parameters())  # no gradient kept
    assert {s["step"].item() for s in optimizer.state.values()} == {4.0}
    assert ("output.weight" in optimizer.master) == (not tied)


def test_optimizer_in_backward_state_dict_restores_weights_and_moments():
    trained, optimizer, _ = adamw_steps(ModelArgs.from_name("tiny"), True, steps=2)
    with torch.device("meta"):
        fresh = Llama(ARGS)
    fresh.to_empty(device="cpu")
    fill_weights(fresh, 1, torch.device("cpu"))
    restored = OptimizerInBackward(
        fresh, torch.device("cpu"), torch.float32, LR, BETAS, WEIGHT_DECAY
    )
    restored.load_state_dict(optimizer.state_dict())
    for a, b in zip(fresh.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)  # the working weights, copied from the loaded masters
    state = restored.state_dict()
    for name, moments in optimizer.state.items():
        for key, tensor in moments.items():
            assert torch.equal(state["optim"][name][key], tensor)


@pytest.mark.parametrize("vocab_size", [320, 1024])  # the head smaller / larger than a block
def test_optimizer_in_backward_copies_a_blocks_gradients_during_a_long_update(
    monkeypatch, vocab_size
):
    """While the worker runs the output head's update (the first, and on Llama the largest:
    over the bound, it goes alone), backward goes on: the head's gradient stops counting
    once copied, and the hooks hand over a block's bytes of gradients; the one that would go
    beyond waits for a copy. A hook that waited for each copy, or for the head's whole
    update, ran the GPU dry."""
    held, release = threading.Event(), threading.Event()
    adamw = optim.adamw_

    def adamw_held(master, *rest):
        if master.ndim >= 2 and not held.is_set():  # the first matrix: output.weight
            held.set()
            release.wait(timeout=60)
        adamw(master, *rest)

    monkeypatch.setattr(optim, "adamw_", adamw_held)
    args = dataclasses.replace(ARGS, tie_embeddings=False, vocab_size=vocab_size)
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    fill_weights(model, 0, torch.device("cpu"))
    optimizer = OptimizerInBackward(
        model, torch.device("cpu"), torch.float32, LR, BETAS, WEIGHT_DECAY
    )
    tokens, labels = torch.randint(0, vocab_size, (2, BATCH, SEQ), generator=torch.manual_seed(0))
    backward = threading.Thread(target=lambda: model(tokens, labels).backward())
    backward.start()
    try:
        assert held.wait(timeout=60)
        block_bytes = 4 * sum(p.numel() for p in model.layers[-1].parameters())
        deadline = time.monotonic() + 10
        while optimizer.on_gpu_bytes < block_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # had the hooks not waited, more would have come by now
        waiting_bytes, backward_ran = optimizer.on_gpu_bytes, backward.is_alive()
    finally:
        release.set()
    backward.join(timeout=60)
    assert not backward.is_alive()
    assert torch.isfinite(optimizer.step())
    # Exactly a block's: the final norm, handed over first, is as large as the last
    # gradient of a block (attention_norm), so a block's worth fits the bound to the byte.
    assert backward_ran and waiting_bytes == block_bytes == optimizer.max_on_gpu_bytes


def test_optimizer_in_backward_wants_a_host_fp32_model():
    model = Llama(ARGS).to(torch.bfloat16)
    with pytest.raises(ValueError, match="on the host in fp32.*tok_embeddings.weight is"):
        OptimizerInBackward(model, torch.device("cpu"), torch.bfloat16, LR, BETAS, WEIGHT_DECAY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tied", [False, True])
def test_optimizer_in_backward_on_cuda_takes_adamws_steps(tied):
    """Side-stream copies through the pinned staging buffers, the CPU worker and the copies
    back give AdamW's weights (fp32 working weights, so both sides compute alike)."""
    args = dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied)
    got, _, norms = adamw_steps(args, in_backward=True, device="cuda")
    want, _, want_norms = adamw_steps(args, in_backward=False, device="cuda")
    assert_weights_close(got, want)
    assert norms == pytest.approx(want_norms, rel=1e-5)


@pytest.mark.parametrize("in_backward", [False, True])
def test_weight_decay_spares_norms_biases_and_sinks(in_backward):
    """A step on zero gradients moves only what AdamW decays: gpt-oss's expert biases are
    [E, out] matrices, its sinks vectors; transformers' Trainer decays neither."""
    args = dataclasses.replace(
        PRESETS["gpt-oss-20b"], dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        vocab_size=64, ffn_dim=16, expert_ffn_dim=16, n_experts=3, experts_per_token=2,
        window_layers=(0,), moe_layers=(0, 1),
    )  # fmt: skip
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():  # biases start at 0, which decay would not move
            param.uniform_(0.5, 1.5)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if in_backward:
        optimizer = OptimizerInBackward(model, torch.device("cpu"), torch.float32, LR, BETAS, 0.5)
    else:
        optimizer = optim.ShardedAdamW(model, BETAS, 0.5, grad_clip=0.0, fused=False)
    optimizer.set_lr(LR)
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    (0 * model(tokens, tokens)).backward()
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    spared = {n for n, p in model.named_parameters() if n.endswith("bias") or p.ndim < 2}
    assert {"layers.0.feed_forward.w1_bias", "layers.0.attention.sinks"} <= spared
    assert moved == set(before) - spared

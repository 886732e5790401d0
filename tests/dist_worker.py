"""The distributed half of tests/test_shard.py, run by it as
`torchrun --nproc-per-node=2 tests/dist_worker.py OUT_DIR` (gloo, CPU).

Every scenario runs on both ranks; rank 0 writes what the test compares (losses, global
gradient norms, full weights gathered from the shards) to OUT_DIR/<scenario>.pt. Errors a
scenario is meant to raise are written per rank to OUT_DIR/<scenario>.rank<r>.txt.
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import Llama, LoRAConfig, ModelArgs, apply_lora  # noqa: E402
from offload import activation_offload, apply_ac  # noqa: E402
from shard import apply_fsdp, build_mesh, clip_grad_norm_, init_distributed, materialize  # noqa: E402

TINY = ModelArgs.from_name("tiny")
# Dims that 2 ranks do not divide evenly (w1: 201 rows = 101 + 100; vocab 321).
ODD = dataclasses.replace(TINY, vocab_size=321, ffn_dim=201)

# QLoRA: rows that are multiples of 64 (NF4 blocks), w1/w3's 192 rows split 96 + 96; a
# large alpha so that the adapters' gradient norm exceeds MAX_NORM from the first step.
QLORA_ARGS = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_dim=192)
QLORA = LoRAConfig(rank=4, alpha=64.0, quantize_base="nf4")
LORA_SCENARIOS = {name: QLORA for name in ("qlora_full_shard", "qlora_full_shard_ac_offload")}

STEPS, MICRO_BATCHES, BATCH, SEQ = 3, 2, 2, 32
LR, WEIGHT_DECAY, MAX_NORM, SEED = 1e-3, 0.1, 1.0, 1

# name -> (strategy, ranks per node, cpu offload, model args, ac mode, activation offload)
TRAIN_SCENARIOS = {
    "full_shard": ("FULL_SHARD", 2, False, TINY, "none", False),
    "full_shard_cpu_offload": ("FULL_SHARD", 2, True, TINY, "none", False),
    "shard_grad_op": ("SHARD_GRAD_OP", 2, False, TINY, "none", False),
    "shard_grad_op_cpu_offload": ("SHARD_GRAD_OP", 2, True, TINY, "none", False),
    "no_shard": ("NO_SHARD", 2, False, TINY, "none", False),
    "no_shard_cpu_offload": ("NO_SHARD", 2, True, TINY, "none", False),
    "hybrid_1x2": ("HYBRID_SHARD", 2, False, TINY, "none", False),
    "hybrid_2x1_cpu_offload": ("HYBRID_SHARD", 1, True, TINY, "none", False),
    "tied_full_shard": (
        "FULL_SHARD",
        2,
        False,
        dataclasses.replace(TINY, tie_embeddings=True),
        "none",
        False,
    ),  # fmt: skip
    "full_shard_ac_offload": ("FULL_SHARD", 2, False, TINY, "full", True),
    "full_shard_selective_ac": ("FULL_SHARD", 2, False, ODD, "selective", False),
    "qlora_full_shard": ("FULL_SHARD", 2, False, QLORA_ARGS, "none", False),
    "qlora_full_shard_ac_offload": ("FULL_SHARD", 2, False, QLORA_ARGS, "full", True),
}


def batches(args: ModelArgs, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, labels [STEPS, MICRO_BATCHES, world_size * BATCH, SEQ]: the global batches,
    some labels ignored (-100) so the token count differs between micro-batches."""
    g = torch.Generator().manual_seed(1234)
    shape = (STEPS, MICRO_BATCHES, world_size * BATCH, SEQ)
    tokens = torch.randint(0, args.vocab_size, shape, generator=g)
    labels = torch.randint(0, args.vocab_size, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.2] = -100
    return tokens, labels


def full_weights(model: torch.nn.Module, trainable: bool = False) -> dict[str, torch.Tensor]:
    return {
        n: p.full_tensor().detach().cpu().clone()
        for n, p in model.named_parameters()
        if p.requires_grad or not trainable
    }


def sharded_model(
    dist, args, strategy, local_world_size, cpu_offload, ac="none", seed=SEED, lora=None
):
    dist = dataclasses.replace(dist, local_world_size=local_world_size)
    with torch.device("meta"):
        model = Llama(args)
    if lora is not None:
        apply_lora(model, lora, torch.float32)
    apply_ac(model, ac)
    apply_fsdp(model, build_mesh(strategy, dist), strategy, cpu_offload, param_dtype=torch.float32)
    materialize(model, dist, seed=seed, cpu_offload=cpu_offload)
    return model


def train(dist, out: Path, name: str) -> None:
    strategy, local_world_size, cpu_offload, args, ac, act_offload = TRAIN_SCENARIOS[name]
    lora = LORA_SCENARIOS.get(name)
    model = sharded_model(dist, args, strategy, local_world_size, cpu_offload, ac, lora=lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    tokens, labels = batches(args, dist.world_size)
    mine = slice(dist.rank * BATCH, (dist.rank + 1) * BATCH)
    losses, norms = [], []
    for step in range(STEPS):
        n_targets = (labels[step] != -100).sum()  # the global count, known to every rank
        step_loss = torch.zeros(())
        for mb in range(MICRO_BATCHES):
            model.set_requires_gradient_sync(mb == MICRO_BATCHES - 1)
            with activation_offload(model, enabled=act_offload, min_bytes=0):
                loss = model(tokens[step, mb, mine], labels[step, mb, mine], reduction="sum")
            (loss / n_targets).backward()
            step_loss += loss.detach().cpu()
        torch_dist.all_reduce(step_loss)
        losses.append(step_loss.item() / n_targets.item())
        norms.append(clip_grad_norm_(model, MAX_NORM).item())
        if step == 0:
            grads = {
                n: p.grad.full_tensor().cpu()
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        optimizer.step()
        optimizer.zero_grad()
    weights = full_weights(model, trainable=True)
    # The frozen ones (a 4-bit base's packed bytes among them), compared bit for bit.
    frozen = {n: t.view(torch.uint8) for n, t in full_weights(model).items() if n not in weights}
    if dist.is_main:
        result = {"losses": losses, "norms": norms, "grads": grads, "weights": weights,
                  "frozen": frozen}  # fmt: skip
        torch.save(result, out / f"{name}.pt")


def init(dist, out: Path) -> None:
    for cpu_offload in (False, True):
        model = sharded_model(dist, ODD, "FULL_SHARD", 2, cpu_offload, seed=7)
        weights = full_weights(model)
        if dist.is_main:
            torch.save(weights, out / f"init_cpu_offload_{cpu_offload}.pt")


def hf_load(dist, out: Path) -> None:
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        with torch.device("meta"):
            model = Llama(ODD)
        apply_fsdp(model, build_mesh(strategy, dist), strategy, param_dtype=torch.float32)
        materialize(model, dist, hf_path=out / "hf_odd")
        weights = full_weights(model)
        if dist.is_main:
            torch.save(weights, out / f"hf_{strategy}.pt")
    # A checkpoint of another shape: every rank must raise, none may wait for the others.
    with torch.device("meta"):
        model = Llama(ODD)
    apply_fsdp(model, build_mesh("FULL_SHARD", dist), "FULL_SHARD", param_dtype=torch.float32)
    try:
        materialize(model, dist, hf_path=out / "hf_mismatch")
        message = "no error"
    except ValueError as e:
        message = str(e)
    (out / f"hf_mismatch.rank{dist.rank}.txt").write_text(message)
    torch_dist.barrier()  # both ranks got here: neither is stuck in a collective


def main() -> None:
    out = Path(sys.argv[1])
    dist = init_distributed()
    torch.use_deterministic_algorithms(True)
    init(dist, out)
    hf_load(dist, out)
    for name in TRAIN_SCENARIOS:
        train(dist, out, name)
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The distributed half of tests/test_shard.py, run by it as
`torchrun --nproc-per-node=2 tests/dist_worker.py OUT_DIR` (gloo, CPU), and as two torchrun
agents of 2 processes each (`--nnodes 2`, one per "node", told apart by LONGTUNE_TEST_NODE)
with `tests/dist_worker.py OUT_DIR nodes`: the groups each rank is in, and a training run.

Every scenario runs on both ranks; rank 0 writes what the test compares (losses, global
gradient norms, full weights gathered from the shards) to OUT_DIR/<scenario>.pt. Errors a
scenario is meant to raise are written per rank to OUT_DIR/<scenario>.rank<r>.txt.
"""

import dataclasses
import errno
import functools
import json
import os
import sys
import unittest.mock
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import document_starts  # noqa: E402
from data import Batch  # noqa: E402
from files import UsageError  # noqa: E402
from kernels import IGNORE_INDEX  # noqa: E402
from lora import LoRAConfig, apply_lora
from model import REFERENCE_OPS, Llama, ModelArgs, fp8_ops  # noqa: E402
from offload import activation_offload, apply_ac  # noqa: E402
from optim import ShardedAdamW, ShardedOptimizerInBackward  # noqa: E402
from shard import (  # noqa: E402
    Checkpointer,
    apply_context_parallel,
    apply_fsdp,
    build_mesh,
    context_parallel_group,
    init_distributed,
    materialize,
)
from train import leave, train_step  # noqa: E402

TINY = ModelArgs.from_name("tiny")
# Dims that 2 ranks do not divide evenly (w1: 201 rows = 101 + 100; vocab 321).
ODD = dataclasses.replace(TINY, vocab_size=321, ffn_dim=201)
TIED_ODD = dataclasses.replace(ODD, tie_embeddings=True)

# QLoRA: rows that are multiples of 64 (NF4 blocks), w1/w3's 192 rows split 96 + 96; a
# large alpha so that the adapters' gradient norm exceeds MAX_NORM from the first step.
# Sliding windows shorter than a context-parallel rank's half of a row (SEQ / 2), past which
# DOCUMENT_STARTS' 14-token document and a row of one document run: Mistral v0.1's on every
# layer, Qwen2's on some.
MISTRAL_WINDOW = dataclasses.replace(
    TINY, family="mistral", sliding_window=6, window_layers=(0, 1, 2, 3)
)
QWEN2_WINDOW = dataclasses.replace(
    TINY, family="qwen2", qkv_bias=True, sliding_window=5, window_layers=(1, 3)
)

QLORA_ARGS = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_dim=192)
QLORA = LoRAConfig(rank=4, alpha=64.0, quantize_base="nf4")

# Qwen3-MoE's blocks on layers 0 and 2 (1 and 3 dense), 5 experts (2 ranks split them 3 + 2),
# the load-balancing loss on at a weight that makes it show in the gradients.
MOE = dataclasses.replace(
    TINY, family="qwen3_moe", qk_norm=True, n_experts=5, experts_per_token=2, expert_ffn_dim=24,
    moe_layers=(0, 2), router_aux_loss=True, router_aux_loss_coef=0.5,
)  # fmt: skip

# LoRA on MOE's experts too: each rank holds its experts' adapters (3 + 2), scaled by 16 so
# that the gradients exceed MAX_NORM, as QLORA's.
MOE_LORA = LoRAConfig(rank=4, alpha=64.0, targets=("wq", "wo", "experts_w13", "experts_w2"))

# gpt-oss's: attention sinks (each rank takes its heads'), biases, a window on layers 0 and 2,
# experts with biases and the clamped SwiGLU on every layer.
GPT_OSS = dataclasses.replace(
    MOE, family="gpt_oss", qk_norm=False, qkv_bias=True, sliding_window=6, window_layers=(0, 2),
    moe_layers=(0, 1, 2, 3), norm_topk_prob=True,
)  # fmt: skip

STEPS, MICRO_BATCHES, BATCH, SEQ = 3, 2, 2, 32
LR, WEIGHT_DECAY, MAX_NORM, SEED = 1e-3, 0.1, 1.0, 1


@dataclass(frozen=True)
class Scenario:
    strategy: str = "FULL_SHARD"
    nproc_per_node: int = 2  # ranks per node, as torchrun would say
    cpu_offload: bool = False
    args: ModelArgs = TINY
    ac: str = "none"
    activation_offload: bool = False
    context_parallel: int = 1  # ranks sharing each row (shard.apply_context_parallel)
    document_mask: bool = False  # packed documents, one crossing the ranks' row halves
    lora: LoRAConfig | None = None  # adapters on a frozen base (lora.apply_lora)
    fp8: bool = False  # the projections in e4m3 (model.fp8_ops; the CPU dequantizes them)

    def ops(self):
        return fp8_ops(REFERENCE_OPS, kernels=False) if self.fp8 else REFERENCE_OPS


TRAIN_SCENARIOS = {
    "full_shard": Scenario(),
    "full_shard_cpu_offload": Scenario(cpu_offload=True),
    "shard_grad_op": Scenario("SHARD_GRAD_OP"),
    "shard_grad_op_cpu_offload": Scenario("SHARD_GRAD_OP", cpu_offload=True),
    "no_shard": Scenario("NO_SHARD"),
    "no_shard_cpu_offload": Scenario("NO_SHARD", cpu_offload=True),
    "hybrid_1x2": Scenario("HYBRID_SHARD"),
    "hybrid_2x1_cpu_offload": Scenario("HYBRID_SHARD", nproc_per_node=1, cpu_offload=True),
    "tied_full_shard": Scenario(args=dataclasses.replace(TINY, tie_embeddings=True)),
    "full_shard_ac_offload": Scenario(ac="full", activation_offload=True),
    "full_shard_selective_ac": Scenario(args=ODD, ac="selective"),
    # Both ranks on the same rows, each with half of every row.
    "context_parallel_causal": Scenario(context_parallel=2),
    "context_parallel_documents_ac_attention": Scenario(
        context_parallel=2, document_mask=True, ac="attention"
    ),
    # Context parallel within each node, sharded over the node's ranks, replicated across
    # nodes (the 2-node run; on one node of 2 ranks it is 1 x 2).
    "hybrid_context_parallel": Scenario("HYBRID_SHARD", context_parallel=2),
    "context_parallel_no_shard_both_offloads": Scenario(
        "NO_SHARD",
        cpu_offload=True,
        ac="full",
        activation_offload=True,
        context_parallel=2,
        document_mask=True,
    ),  # fmt: skip
    "qlora_full_shard": Scenario(args=QLORA_ARGS, lora=QLORA),
    # A rank's tokens are scaled per column over that rank's rows (the weight gradient's
    # e4m3 copies), so the reference takes each rank's rows apart, as the ranks do.
    "full_shard_fp8_selective_ac": Scenario(ac="selective", fp8=True),
    # Likewise over each context-parallel rank's half of every row (the reference splits the
    # columns' scales by position), with packed documents and the recompute quantizing again.
    "context_parallel_fp8_documents_full_ac": Scenario(
        context_parallel=2, document_mask=True, ac="full", fp8=True
    ),
    "qlora_full_shard_ac_offload": Scenario(
        args=QLORA_ARGS, ac="full", activation_offload=True, lora=QLORA
    ),
    # Each rank's rows routed and balanced on their own, as a process of its own would; under
    # context parallelism the halves of the rows pooled: one process's loss (shard.py).
    "moe_full_shard_selective_ac": Scenario(args=MOE, ac="selective"),
    "moe_lora_on_the_experts_full_shard_ac_offload": Scenario(
        args=MOE, ac="full", activation_offload=True, lora=MOE_LORA
    ),
    "moe_context_parallel_documents_full_ac": Scenario(
        args=MOE, context_parallel=2, document_mask=True, ac="full"
    ),
    "moe_shard_grad_op_both_offloads": Scenario(
        "SHARD_GRAD_OP", cpu_offload=True, args=MOE, ac="full", activation_offload=True
    ),
    "gpt_oss_context_parallel_documents_ac_attention": Scenario(
        args=GPT_OSS, context_parallel=2, document_mask=True, ac="attention"
    ),
    # Each rank attends its heads over whole rows: a window needs nothing from the others.
    "context_parallel_window_some_layers": Scenario(args=QWEN2_WINDOW, context_parallel=2),
    "context_parallel_window_documents_ac_attention": Scenario(
        args=MISTRAL_WINDOW, context_parallel=2, document_mask=True, ac="attention"
    ),
    "context_parallel_window_documents_selective_ac": Scenario(
        args=QWEN2_WINDOW, context_parallel=2, document_mask=True, ac="selective"
    ),
    "context_parallel_window_documents_both_offloads": Scenario(
        "NO_SHARD",
        cpu_offload=True,
        args=MISTRAL_WINDOW,
        ac="full",
        activation_offload=True,
        context_parallel=2,
        document_mask=True,
    ),  # fmt: skip
    # One key/value head for 2 ranks: each rank gets a copy of it.
    "context_parallel_repeated_kv_head_full_ac": Scenario(
        args=dataclasses.replace(TINY, n_kv_heads=1), context_parallel=2, ac="full"
    ),
}
# Where the packed documents of the document-mask scenarios start: the one at 13 runs past
# the middle of the row (16), where the second context-parallel rank's half begins.
DOCUMENT_STARTS = [0, 5, 13, 27]


def batches(
    args: ModelArgs, world_size: int, documents: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, labels, positions [STEPS, MICRO_BATCHES, world_size * BATCH, SEQ]: the
    global batches, some labels ignored (-100) so the token count differs between
    micro-batches; positions restart at DOCUMENT_STARTS with `documents`."""
    g = torch.Generator().manual_seed(1234)
    shape = (STEPS, MICRO_BATCHES, world_size * BATCH, SEQ)
    tokens = torch.randint(0, args.vocab_size, shape, generator=g)
    labels = torch.randint(0, args.vocab_size, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.2] = -100
    index = torch.arange(SEQ)
    starts = DOCUMENT_STARTS if documents else [0]
    start_of = torch.tensor(starts)[torch.searchsorted(torch.tensor(starts), index, right=True) - 1]
    return tokens, labels, (index - start_of).expand(shape)


def full_weights(model: torch.nn.Module, trainable: bool = False) -> dict[str, torch.Tensor]:
    return {
        n: p.full_tensor().detach().cpu().clone()
        for n, p in model.named_parameters()
        if p.requires_grad or not trainable
    }


def sharded_model(
    world,
    args,
    strategy,
    nproc_per_node,
    cpu_offload,
    ac="none",
    seed=SEED,
    lora=None,
    cp=1,
    mask=False,
    ops=REFERENCE_OPS,
):
    world = dataclasses.replace(world, nproc_per_node=nproc_per_node)
    with torch.device("meta"):
        model = Llama(args, ops, document_mask=mask)
    # The documents of 8 and 14 tokens (DOCUMENT_STARTS) go through the causal kernel on their
    # slices, the others through the mask; the reference masks them all.
    model.long_document = 8
    if lora is not None:
        apply_lora(model, lora, torch.float32)
    apply_ac(model, ac)
    apply_context_parallel(model, context_parallel_group(world, cp))
    apply_fsdp(model, build_mesh(strategy, world), strategy, cpu_offload, param_dtype=torch.float32)
    materialize(model, world, seed=seed, cpu_offload=cpu_offload)
    return model


class RecordingAdamW(ShardedAdamW):
    """optim.ShardedAdamW keeping the first step's clipped gradients, which the test compares."""

    def __init__(self, model):
        super().__init__(model, (0.9, 0.999), WEIGHT_DECAY, MAX_NORM, fused=True)
        self.set_lr(LR)
        self.first_grads = None
        adamw_step = self.adamw.step

        def record_then_step():
            if self.first_grads is None:
                self.first_grads = {
                    n: p.grad.full_tensor().cpu()
                    for n, p in model.named_parameters()
                    if p.requires_grad
                }
            adamw_step()

        self.adamw.step = record_then_step


def train(world, out: Path, name: str) -> None:
    """train.train_step, step after step, on each rank's part of the global batches."""
    s = TRAIN_SCENARIOS[name]
    model = sharded_model(
        world, s.args, s.strategy, s.nproc_per_node, s.cpu_offload, s.ac, lora=s.lora,
        cp=s.context_parallel, mask=s.document_mask, ops=s.ops(),
    )  # fmt: skip
    optimizer = RecordingAdamW(model)
    # The global batch of 2 * BATCH rows: a data-parallel rank takes its rows, and a
    # context-parallel rank its columns of them.
    tokens, labels, positions = batches(s.args, 2, s.document_mask)
    data_ranks = world.world_size // s.context_parallel
    rows = torch.arange(2 * BATCH).chunk(data_ranks)[world.rank // s.context_parallel]
    columns = torch.arange(SEQ).chunk(s.context_parallel)[world.rank % s.context_parallel]
    mine = (rows[:, None], columns)
    offloaded = functools.partial(activation_offload, model, s.activation_offload, min_bytes=0)
    losses, norms = [], []
    for step in range(STEPS):
        micro_batches = [
            Batch(
                *(t[step, mb][mine] for t in (tokens, labels, positions)),
                document_starts(positions[step, mb][rows]),  # of the whole rows
            )
            for mb in range(MICRO_BATCHES)
        ]
        n_labels = sum((b.labels != IGNORE_INDEX).sum() for b in micro_batches)
        result = train_step(model, optimizer, micro_batches, MICRO_BATCHES, n_labels, offloaded)
        dist.all_reduce(result.loss_sum)
        losses.append((result.loss_sum / result.n_labels).item())
        norms.append(result.grad_norm.item())
    weights = full_weights(model, trainable=True)
    # The frozen ones (a 4-bit base's packed bytes among them), compared bit for bit.
    frozen = {n: t.view(torch.uint8) for n, t in full_weights(model).items() if n not in weights}
    if world.is_main:
        result = {"losses": losses, "norms": norms, "grads": optimizer.first_grads,
                  "weights": weights, "frozen": frozen}  # fmt: skip
        torch.save(result, out / f"{name}.pt")


def in_backward(world, out: Path) -> None:
    """The optimizer in backward on FSDP's host shards (optim.ShardedOptimizerInBackward):
    STEPS steps of one micro-batch (it cannot accumulate), each rank its rows of it, no
    clipping. Also run in one process by tests/test_shard.py."""
    model = sharded_model(world, TINY, "FULL_SHARD", world.world_size, cpu_offload=True)
    optimizer = ShardedOptimizerInBackward(model, LR, (0.9, 0.999), WEIGHT_DECAY)  # AdamW's
    tokens, labels, positions = batches(TINY, 2)
    rows = torch.arange(2 * BATCH).chunk(world.world_size)[world.rank]
    losses, norms = [], []
    for step in range(STEPS):
        mine = [t[step, 0][rows] for t in (tokens, labels, positions)]
        n_labels = (mine[1] != IGNORE_INDEX).sum()
        result = train_step(model, optimizer, [Batch(*mine, document_starts(mine[2]))], 1, n_labels)
        dist.all_reduce(result.loss_sum)
        losses.append((result.loss_sum / result.n_labels).item())
        norms.append(result.grad_norm.item())
    weights = full_weights(model)
    if world.is_main:
        result = {"losses": losses, "norms": norms, "weights": weights}
        torch.save(result, out / f"in_backward.{world.world_size}.pt")


def init(world, out: Path) -> None:
    for cpu_offload in (False, True):
        model = sharded_model(world, ODD, "FULL_SHARD", 2, cpu_offload, seed=7)
        weights = full_weights(model)
        if world.is_main:
            torch.save(weights, out / f"init_cpu_offload_{cpu_offload}.pt")


def hf_load(world, out: Path) -> None:
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        with torch.device("meta"):
            model = Llama(ODD)
        apply_fsdp(model, build_mesh(strategy, world), strategy, param_dtype=torch.float32)
        materialize(model, world, hf_path=out / "hf_odd")
        weights = full_weights(model)
        if world.is_main:
            torch.save(weights, out / f"hf_{strategy}.pt")
    # A checkpoint of another shape, and one whose config ties the output but whose lm_head
    # differs in the last rank's rows alone: every rank must raise, none may wait for the others.
    for name, args in (("hf_mismatch", ODD), ("hf_untied_head", TIED_ODD)):
        with torch.device("meta"):
            model = Llama(args)
        apply_fsdp(model, build_mesh("FULL_SHARD", world), "FULL_SHARD", param_dtype=torch.float32)
        try:
            materialize(model, world, hf_path=out / name)
            message = "no error"
        except ValueError as e:
            message = str(e)
        (out / f"{name}.rank{world.rank}.txt").write_text(message)
    dist.barrier()  # both ranks got here: neither is stuck in a collective


def context_parallel_whole_rows(world, out: Path) -> None:
    """A context-parallel model called with whole rows of an odd length and no positions
    (generate's call): the logits of the whole rows on every rank; with labels but no
    positions, every rank refuses alike."""
    model = sharded_model(world, TINY, "FULL_SHARD", 2, False, cp=2)
    tokens = torch.arange(2 * 13).reshape(2, 13) % TINY.vocab_size
    with torch.no_grad():
        torch.save(model(tokens), out / f"cp_whole_rows.rank{world.rank}.pt")
    try:
        model(tokens[:, :8], tokens[:, :8])
        message = "no error"
    except ValueError as e:
        message = str(e)
    (out / f"cp_without_positions.rank{world.rank}.txt").write_text(message)


def full_disk_on_main(world, out: Path) -> None:
    """A checkpoint whose train_state.json finds the main rank's disk full: every rank says
    it in one line, none waits for the main one in a collective."""
    checkpointer = Checkpointer(out / "full_disk", 10, 2, world, record={})
    model = sharded_model(world, TINY, "FULL_SHARD", 2, False)
    optimizer = ShardedAdamW(model, (0.9, 0.95), 0.0, None, fused=False)
    loader = SimpleNamespace(state_dict=dict)
    write_text = Path.write_text

    def full(path, *args, **kwargs):
        if path.name == "train_state.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(path, *args, **kwargs)

    full_on_main = unittest.mock.patch.object(Path, "write_text", full)
    try:
        with full_on_main if world.is_main else nullcontext():
            checkpointer.save(10, 160, optimizer, loader)
        message = "no error"
    except UsageError as e:
        message = str(e)
    (out / f"full_disk.rank{world.rank}.txt").write_text(message)
    dist.barrier()  # both ranks got here


def nodes(world, out: Path) -> None:
    """Each rank's node and the ranks of its groups: HYBRID_SHARD's shard and replicate
    groups, and the context-parallel group (2 ranks)."""
    mesh = build_mesh("HYBRID_SHARD", world)
    groups = {dim: mesh.get_group(dim) for dim in ("shard", "replicate")}
    groups["context"] = context_parallel_group(world, 2)
    record = {
        "node": os.environ["LONGTUNE_TEST_NODE"],
        **{name: dist.get_process_group_ranks(g) for name, g in groups.items()},
    }
    (out / f"nodes.rank{world.rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    world = init_distributed()
    torch.use_deterministic_algorithms(True)
    if sys.argv[2:] == ["nodes"]:
        nodes(world, out)
        train(world, out, "hybrid_context_parallel")
        dist.destroy_process_group()
        return
    init(world, out)
    hf_load(world, out)
    context_parallel_whole_rows(world, out)
    in_backward(world, out)
    full_disk_on_main(world, out)
    for name in TRAIN_SCENARIOS:
        train(world, out, name)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # as train.py does

"""Spreads the model and its training state over processes and memory with FSDP2
(`torch.distributed.fsdp.fully_shard`), as plan.py's plan says. In order: the processes and
devices (the process group, the machine's memory); FSDP (the mesh, a
meta-built model filled shard by shard); context parallelism; last, the run directory, its DCP
checkpoints and the exports gathered from the shards.
train.apply_techniques applies the techniques in the one order in which they compose.

Multi-node runs need no code here: torchrun's rendezvous flags (`--nnodes`, `--node-rank`,
`--rdzv-backend c10d --rdzv-endpoint host:port`) set the variables `init_distributed` reads.
"""

import dataclasses
import fcntl
import functools
import json
import math
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from data import PackedLoader
from files import (
    NO_SPACE,
    UsageError,
    check_directory_path,
    first_names,
    no_follow,
    no_space,
    plural,
    read_json,
)
from hf import (
    FLOAT_DTYPES,
    HF_EXPORT,
    PEFT_ADAPTER,
    load_hf_checkpoint,
    load_peft_adapter,
    save_hf_checkpoint,
    save_peft_adapter,
)
from lora import LoRAConfig, copy_whole_tensor, merged_named_tensors
from model import Llama, ModelArgs, RopeScaling
from moe import Routed
from plan import PLAN_KEYS, GiB, Machine, host_memory_gib, shard_group_size, strategy_of

# ----------------------------------------------------------------------------------------
# Processes and devices: the process group and the memory a plan may fill
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    nproc_per_node: int  # processes per node: the shard group of HYBRID_SHARD
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_processes() -> tuple[int, int]:
    """WORLD_SIZE and LOCAL_WORLD_SIZE: 1 and 1 for a plain `python train.py`."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    return world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def check_gpus() -> None:
    """torchrun starts --nproc-per-node processes, each taking the GPU of its local rank."""
    nproc = torchrun_processes()[1]
    if torch.cuda.is_available() and nproc > (gpus := torch.cuda.device_count()):
        raise UsageError(
            f"{nproc} processes per node were asked (torchrun --nproc-per-node={nproc}), "
            f"and this machine has {plural(gpus, 'GPU')}: one process per GPU"
        )


def init_distributed() -> World:
    """Joins torchrun's process group, or makes one of one process so that the rest runs the
    same either way. gloo also serves CUDA runs: the norm of CPU offload's host gradients."""
    check_gpus()
    env = os.environ
    rank = int(env.get("RANK", 0))
    local_rank = int(env.get("LOCAL_RANK", 0))
    world_size, nproc_per_node = torchrun_processes()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if "RANK" in env:
            # device_id binds NCCL's communicator to this GPU up front (no guessing later).
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            # One process: an in-memory store, no port to find or collide on.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return World(rank, world_size, nproc_per_node, device)


def this_machine(gpu_memory: float | None, host_memory: float | None, world: World) -> Machine:
    """The machine the run is on (`gpu_memory`, `host_memory` GiB where given). A collective:
    every rank plans with the smallest memory over all ranks, so that all choose one plan."""
    gpu = gpu_memory
    if gpu is None and world.device.type == "cuda":
        gpu = torch.cuda.mem_get_info(world.device)[0] / GiB
    memory = torch.tensor([gpu or 0.0, host_memory or host_memory_gib()], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    gpu_gib = memory[0].item() if gpu is not None else None
    return Machine(world.world_size, world.nproc_per_node, gpu_gib, memory[1].item())


# ----------------------------------------------------------------------------------------
# FSDP: the mesh of the plan's strategy, the sharded model, materialized and filled
# ----------------------------------------------------------------------------------------


def build_mesh(strategy: str, world: World) -> DeviceMesh:
    """("shard",) for FULL_SHARD / SHARD_GRAD_OP; ("replicate", "shard") for HYBRID_SHARD
    (nodes x ranks per node) and NO_SHARD (world x 1): fully_shard replicates over the first
    dim, so a shard dim of 1 is plain data parallelism with gradients all-reduced."""
    shard = shard_group_size(strategy, world.world_size, world.nproc_per_node)
    if world.world_size % shard:
        raise UsageError(
            f"{strategy} needs the world size {world.world_size} to be a multiple of the "
            f"ranks per node {world.nproc_per_node}"
        )
    if strategy_of(strategy).shard_over == "world":
        return init_device_mesh(world.device.type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(
        world.device.type, (world.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
    )


def apply_fsdp(
    model: Llama,
    mesh: DeviceMesh,
    strategy: str,
    cpu_offload: bool = False,
    param_dtype: torch.dtype = torch.bfloat16,
    pin_memory: bool = True,
) -> None:
    """Shards `model` in place, an FSDP unit (one all-gather, one reduce-scatter) for each
    block, [norm, output] and the root (tok_embeddings, a tied model's output too). Master
    weights, gradients and optimizer state stay fp32 and sharded (on the host with
    `cpu_offload`, where the optimizer steps); forward and backward run on `param_dtype`
    copies gathered per unit. Prefetching is FSDP2's default (the next block's all-gather
    during this one): explicit lists help only when host syncs stall the CPU, which the loop
    avoids."""
    policy = strategy_of(strategy)
    # cast_forward_inputs=False: the blocks get RoPE's inv_freq (fp32) as an input, and
    # rounding it to bf16 would shift the angles of long positions; the activations are
    # already param_dtype (the embedding's output), so nothing else needs the cast.
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    pin = pin_memory and torch.cuda.is_available()
    offload_policy = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=policy.reshard_after_forward, **common)
    if model.output is not None:
        # Not resharded after forward: backward needs them first.
        fully_shard([model.norm, model.output], reshard_after_forward=False, **common)
    # The root is needed again right at the start of backward: keep it gathered.
    fully_shard(model, reshard_after_forward=False, **common)
    # Gradients SUMMED over ranks (train.py divides the loss by the global target count), by
    # a plain SUM that gloo supports too (a divide factor alone would use NCCL's PREMUL_SUM).
    # One rank already sums, and a factor would cost a gradient-sized temporary.
    if mesh.size() > 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def materialize(
    model: Llama,
    world: World,
    seed: int = 0,
    hf_path: str | os.PathLike | None = None,
    cpu_offload: bool = False,
    progress: Callable[[int, int], None] | None = None,
    lora: LoRAConfig | None = None,
    lora_adapter: str | os.PathLike | None = None,
) -> None:
    """Allocates a meta-built, `apply_fsdp`-ed model's shards (on the host when `cpu_offload`,
    as for apply_fsdp) and fills them (fill_weights, below), each rank its own rows. A
    checkpoint that does not fit raises on every rank (from config and headers) before
    anything is read, so no rank is left waiting in a collective."""
    model.to_empty(device="cpu" if cpu_offload else world.device)

    def copy_rows(param: DTensor, tensor_slice) -> None:
        # FSDP2 shards dim 0 like torch.chunk: ceil(n / shards) rows each, so the last ranks
        # may hold fewer rows or none.
        shape, start = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        param.to_local().copy_(tensor_slice[start[0] : start[0] + shape[0]])

    def agree(nonfinite: list[str]) -> list[str]:  # each rank checked the rows it read
        found = [None] * world.world_size
        dist.all_gather_object(found, nonfinite)
        return [name for names in found for name in names]

    fill_weights(model, seed, world.device, hf_path, copy_rows, progress, lora, lora_adapter, agree)


@torch.no_grad()
def fill_weights(
    model: Llama,
    seed: int,
    device: torch.device,
    hf_path: str | os.PathLike | None = None,
    copy: Callable[[torch.Tensor, object], None] = copy_whole_tensor,
    progress: Callable[[int, int], None] | None = None,
    lora: LoRAConfig | None = None,
    lora_adapter: str | os.PathLike | None = None,
    agree: Callable[[list[str]], list[str]] = lambda nonfinite: nonfinite,
) -> None:
    """Fills a materialized model through `copy`, each step over the last: initial values drawn
    on `device`, so any layout gets the same weights (all of them, or over a checkpoint only
    LoRA's adapters'); a HF checkpoint (as load_hf_checkpoint); a PEFT adapter directory."""
    if hf_path is None:
        model.init_weights(seed, device, copy)
    elif lora is not None and lora_adapter is None:  # a checkpoint holds no adapters
        model.init_weights(seed, device, copy, trainable_only=True)
    if hf_path is not None:
        load_hf_checkpoint(model, hf_path, copy, progress, agree)
    if lora_adapter is not None:
        load_peft_adapter(model, lora, lora_adapter, hf_path, copy, agree)


# ----------------------------------------------------------------------------------------
# Context parallelism: the ranks of a group share one sequence
# ----------------------------------------------------------------------------------------
# Ulysses-style sequence parallelism. Each of the N ranks of a group holds S/N consecutive
# tokens of every row through everything but attention (RoPE goes by the row's positions, so a
# packed document crossing a shard boundary just works). Around the attention kernel an
# all-to-all trades sequence shards for head shards (the whole sequence for H/N query heads and
# their key/value heads), the kernel runs unchanged, and a second all-to-all trades back. Ring
# attention would keep the heads but needs its own kernel loop, and a document mask or a sliding
# window split into blocks across ranks; here both are the whole row's, built on every rank.
# The cost: 4 all-to-alls of S/N x d per block and forward, inside a node.
#
# FSDP is unaffected: it shards over all the ranks, and summing the gradients over them sums
# each token's contribution once, as each token lives on one rank.


def context_parallel_group(world: World, n: int) -> dist.ProcessGroup | None:
    """The N consecutive ranks sharing this rank's sequences: torchrun numbers a node's ranks
    consecutively, so a group never spans nodes, and build_mesh shards over the same ranks."""
    if n == 1:
        return None
    mesh = init_device_mesh(
        world.device.type, (world.world_size // n, n), mesh_dim_names=("data", "context")
    )
    return mesh.get_group("context")


class _AllToAll(torch.autograd.Function):
    """Chunk j of x along scatter_dim goes to rank j, arriving as chunk i (the sender's rank)
    along gather_dim; the gradient goes back. Runs on gloo too: the tests run GPUs' code."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        send = torch.stack(x.chunk(group.size(), dim=scatter_dim))  # [N, ...], contiguous
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        # A view, not a copy, where the layout allows (q, k, v on their way to the kernel).
        return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)

    @staticmethod
    def backward(ctx, grad):
        # The same exchange the other way: each chunk goes back to the rank it came from.
        return _AllToAll.apply(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _attend_whole_sequence(attend, group, q, k, v, mask, sinks=None):
    """Attention.attend over this rank's slice of a row, q [B, H, S/N, Dh], as head shards
    [B, H/N, S, Dh] (and their attention sinks). The all-to-alls run on the [B, S, H, Dh]
    views, so that the kernel's inputs and output keep the strides they have without context
    parallelism."""
    n = group.size()
    if sinks is not None:  # rank r gets heads r H/N to (r + 1) H/N - 1
        sinks = sinks.chunk(n)[group.rank()]
    if k.shape[1] < n:  # fewer key/value heads than ranks: each rank gets one, repeated
        k, v = (t.repeat_interleave(n // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (_AllToAll.apply(t.transpose(1, 2), group, 2, 1).transpose(1, 2) for t in (q, k, v))
    out = attend(q, k, v, mask, sinks)
    return _AllToAll.apply(out.transpose(1, 2), group, 1, 2).transpose(1, 2)


def _whole_row_mask(attention_mask, group, positions: torch.Tensor, document_starts=None):
    """The mask of the whole row, from the positions [B, S/N] of every rank of the group
    (`document_starts`, when given, must be the whole rows', as data.PackedLoader's are)."""
    pieces = [torch.empty_like(positions) for _ in range(group.size())]
    dist.all_gather(pieces, positions.contiguous(), group=group)
    return attention_mask(torch.cat(pieces, dim=1), document_starts)


def _forward_rows(forward, group, tokens, labels=None, positions=None, *rest, **kwargs):
    """The model's forward under context parallelism. Training passes its slice's positions
    [B, S/N] (data.PackedLoader's) and gets its part of the loss. Whole rows [B, T] without
    positions (train.generate's): each rank runs its slice, padded at the end (the causal mask
    hides it), and every rank gets the whole rows' logits, as one process would."""
    if positions is not None:
        return forward(tokens, labels, positions, *rest, **kwargs)
    if labels is not None:
        raise UsageError(
            "a context-parallel model computes a loss on its slice of each row: pass the "
            "positions of the slice (its default 0..S/N-1 would be wrong on every rank but "
            "the first)"
        )
    n, length = group.size(), tokens.shape[1]
    per_rank = -(-length // n)
    start = group.rank() * per_rank
    piece = F.pad(tokens, (0, per_rank * n - length))[:, start : start + per_rank]
    positions = torch.arange(start, start + per_rank, device=tokens.device)
    logits = forward(piece, None, positions.expand_as(piece), *rest, **kwargs)
    pieces = [torch.empty_like(logits) for _ in range(n)]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, dim=1)[:, :length]


class _SumOverGroup(torch.autograd.Function):
    """all_reduce's sum, whose gradient is the sum of the ranks' gradients: every rank's loss
    reads the sum."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return _SumOverGroup.apply(grad, ctx.group), None


def _pooled_routing(routed, group) -> list[Routed]:
    """The MoE layers' routing of the whole rows, summed over the ranks that share them: the
    load-balancing loss and the experts' load one process would compute."""
    layers = routed()
    chosen = torch.stack([r.chosen for r in layers])
    dist.all_reduce(chosen, group=group)
    probs = _SumOverGroup.apply(torch.stack([r.probs for r in layers]), group)
    tokens = [r.tokens * group.size() for r in layers]  # each rank holds S/N of every row
    return [Routed(*routing) for routing in zip(chosen, probs, tokens, strict=True)]


def apply_context_parallel(model: Llama, group: dist.ProcessGroup | None) -> None:
    """Makes `model` take this rank's slice of each row, [B, S/N], wrapping methods on the
    instances (as offload.apply_mlp_tiling does): parameter names and checkpoints unchanged,
    and model.py holds no collective."""
    if group is None:
        return
    for block in model.layers:
        block.attention.attend = functools.partial(
            _attend_whole_sequence, block.attention.attend, group
        )
    # The masks from the whole rows' positions, wherever attention may take one.
    if model.args.attention_masked(model.document_mask):
        model.attention_mask = functools.partial(_whole_row_mask, model.attention_mask, group)
    model.forward = functools.partial(_forward_rows, model.forward, group)
    if model.args.moe_layers:
        model.routed = functools.partial(_pooled_routing, model.routed, group)


# ----------------------------------------------------------------------------------------
# The run directory (--run-dir), its checkpoints (run_dir/checkpoints/step-XXXXXX) and the
# exports (--export-hf, --export-adapter)
# ----------------------------------------------------------------------------------------

# The files a run writes at the top of its directory (plan.json and config.toml through
# files.write_whole's temporaries), each opened with files.no_follow.
RUN_FILES = (".lock", "plan.json", ".tmp-plan.json", "config.toml", ".tmp-config.toml",
             "metrics.jsonl", "wandb_run_id")  # fmt: skip


def check_run_dir(run_dir: Path) -> None:
    """A run writes into a new or empty directory, or one a run made, never among other
    files, where its plan.json could replace the user's. Exports into it count as its own."""
    check_directory_path(run_dir, "--run-dir")
    held = sorted(run_dir.iterdir()) if run_dir.is_dir() else []
    if links := [p.name for p in held if p.name in RUN_FILES and p.is_symlink()]:
        raise UsageError(
            f"--run-dir {run_dir} holds {', '.join(links)} as symbolic links, which the run would "
            f"write through into files elsewhere: remove them"
        )
    if _made_by_a_run(run_dir):
        return  # the user's files beside its own (a plot, a log) stay
    foreign = [p.name for p in held if not _left_by_a_run(p)]
    if foreign:
        raise UsageError(
            f"--run-dir {run_dir} holds {first_names(foreign)}, and no plan.json or checkpoint of "
            f"a run: a run would write over them; give a new or empty directory, or the run "
            f"directory of an earlier run"
        )


def _made_by_a_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds what only a run writes: its plan.json, or a checkpoint."""
    try:
        if read_json(run_dir / "plan.json").keys() >= PLAN_KEYS:
            return True
    except UsageError:  # none, or not a run's
        pass
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    return any((c / "train_state.json").is_file() for c in checkpoints)


def _left_by_a_run(path: Path) -> bool:
    """An export, an empty directory, or the lock of a run stopped before it wrote its plan."""
    if path.name == ".lock" and path.is_file() and not path.is_symlink():
        with open(path, "rb") as f:
            return re.fullmatch(rb"(pid \d+ on \S+\n)?", f.read(300)) is not None
    markers = (HF_EXPORT.marker, PEFT_ADAPTER.marker)
    return path.is_dir() and (not any(path.iterdir()) or any((path / m).is_file() for m in markers))


def lock_run_dir(run_dir: Path, is_main: bool):
    """One live run per run directory: rank 0 holds an exclusive flock on run_dir/.lock (hold
    on to the returned file), which the kernel drops however the process ends, so a killed
    run leaves nothing stuck. Every rank raises alike if it was not taken. (A filesystem
    shared by nodes needs flock support: NFSv4 has it, Lustre with -o flock.)"""
    lock, holder = None, ""
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = open(run_dir / ".lock", "a+", opener=no_follow)  # noqa: SIM115 (held open for the run)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            file.truncate(0)
            file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            file.flush()
            lock = file
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip()
            file.close()
    taken = torch.tensor([lock is not None or not is_main], dtype=torch.int32)
    dist.all_reduce(taken, op=dist.ReduceOp.MIN)  # a CPU integer: through gloo
    if not taken:
        raise UsageError(
            f"run directory {run_dir} is in use by a live run ({holder or 'see rank 0'}): "
            f"wait for it to end, or choose another --run-dir"
        )
    return lock


TRAIN_STATE_KEYS = ["step", "loader", "rng", "run", "options", "files", "tensors"]


def _count(value: object, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is(kind: type | tuple) -> Callable:
    return lambda value: isinstance(value, kind)


def _list_of(test: Callable, length: int | None = None) -> Callable:
    return lambda v: isinstance(v, list) and length in (None, len(v)) and all(map(test, v))


def _dict_of(test: Callable) -> Callable:
    return lambda v: isinstance(v, dict) and all(map(test, v.values()))


_byte = lambda v: _count(v) and v < 256  # noqa: E731
_positive = functools.partial(_count, least=1)
CPU_RNG_BYTES = len(torch.get_rng_state())
# What each field of a train_state.json must be where it is read, since a hand edit may break
# any: the field (dotted: within an object; absent: None) -> what is expected, and its test.
TRAIN_STATE_FIELDS = {
    "step": ("a count", _count),
    "tokens": ("a count, or none", lambda v: v is None or _count(v)),
    **{f"loader.{k}": ("a count", _count) for k in PackedLoader.STATE_KEYS},
    "rng.cpu": (f"a list of {CPU_RNG_BYTES} bytes", _list_of(_byte, CPU_RNG_BYTES)),
    "rng.cuda": ("a list of bytes, or none", lambda v: v is None or _list_of(_byte)(v)),
    "run.model": ("an object", _is(dict)),
    "run.seq_len": ("a count above 0", _positive),
    "run.tokens_per_step": ("a count above 0", _positive),
    "run.max_steps": ("a count", _count),
    "run.world_size": ("a count above 0", _positive),
    "run.tokenizer": ("a string", _is(str)),
    "run.strategy": ("a string", _is(str)),
    "run.lora": ("an object, or none", _is((dict, type(None)))),
    "options": ("an object", _is(dict)),
    "files": ("an object of each shard's size in bytes", _dict_of(_count)),
    "tensors": ("an object of each tensor's shape", _dict_of(_list_of(_count))),
}


def _train_state_problems(train_state: dict) -> list[str]:
    problems = []
    for field, (expected, test) in TRAIN_STATE_FIELDS.items():
        value = train_state
        for key in field.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not test(value):
            found = "none" if value is None else json.dumps(value)
            found = found if len(found) <= 40 else found[:40] + "..."
            problems.append(f"{field} is {found}, expected {expected}")
    return problems


def tokens_trained(train_state: dict) -> int:
    """The tokens trained on up to a checkpoint. One saved before they were counted (no
    "tokens"): its steps at its run record's tokens_per_step, exact unless an earlier resume
    changed the batch."""
    tokens = train_state.get("tokens")
    return train_state["step"] * train_state["run"]["tokens_per_step"] if tokens is None else tokens


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))


def list_checkpoints(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step-*") if p.name[5:].isdigit()), key=step_of)


def find_checkpoint(
    resume: str | None, root: Path, log: Callable
) -> tuple[Path, dict, list[Path]] | None:
    """The checkpoint to resume from (--resume: "latest", the newest intact one in `root`,
    saying which it passed over, or a path), its train_state, checked, and the damaged
    checkpoints after it in `root`, for `set_aside`."""
    found = list_checkpoints(root)
    if resume is None and found:
        raise UsageError(
            f"{root} holds checkpoints of an earlier run: pass --resume to continue it, "
            f"or choose another --run-dir"
        )
    if resume not in (None, "latest"):
        resume = Path(resume)
        if list_checkpoints(resume / "checkpoints"):
            raise UsageError(
                f"{resume} is a run directory, not a checkpoint: --resume --run-dir {resume} "
                f"continues from its latest checkpoint"
            )
        theirs = [c for c in found if c.resolve() != resume.resolve()]
        if theirs and root.resolve() != resume.resolve().parent:
            # Saving here would rotate this directory's own checkpoints away (--keep-checkpoints).
            raise UsageError(
                f"{root} holds checkpoints of another run ({theirs[-1].name}), and {resume} is "
                f"not one of them: give a new --run-dir to continue {resume} in"
            )
        train_state = check_checkpoint(resume)
        return resume, train_state, check_no_newer_checkpoints(root, train_state["step"], resume)
    damaged = []
    for checkpoint in reversed(found):  # none without --resume
        try:
            train_state = check_checkpoint(checkpoint)
        except UsageError as e:
            log(f"passing over a damaged checkpoint: {e}")
            damaged.append(checkpoint)
            continue
        if checkpoint != found[-1]:
            log(f"resuming from {checkpoint}, the newest intact checkpoint")
        return checkpoint, train_state, damaged
    if found:
        raise UsageError(f"no intact checkpoint in {root}: each one above is damaged")
    return None


def check_checkpoint(path: Path) -> dict:
    """The train_state at `path`, its files checked from sizes and headers alone: one
    UsageError naming every problem, so a damaged checkpoint is refused before loading."""
    state_path = path / "train_state.json"
    if not path.is_dir():
        raise UsageError(f"checkpoint {path} does not exist")
    if not state_path.is_file():
        raise UsageError(f"checkpoint {path} is incomplete: it has no train_state.json")
    train_state = read_json(state_path)
    missing = [key for key in TRAIN_STATE_KEYS if key not in train_state]
    if missing:
        raise UsageError(f"{state_path}: no {', '.join(missing)}: not a longtune checkpoint")
    if problems := _train_state_problems(train_state):
        raise UsageError(f"{state_path}: " + "; ".join(problems))
    problems = []
    shards = {f.name: f for f in sorted(path.glob("*.safetensors"))}
    for name, size in train_state["files"].items():
        if name not in shards:
            problems.append(f"shard {name} is missing")
        elif (found := shards[name].stat().st_size) != size:
            problems.append(f"shard {name} is {found:,} bytes, it was {size:,} when saved")
    problems += [f"{name} was not saved with it" for name in shards.keys() - train_state["files"]]
    expected = {key: math.prod(shape) for key, shape in train_state["tensors"].items()}
    elements = dict.fromkeys(expected, 0)
    for name, file in shards.items():
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    if key not in expected:
                        problems.append(f"{name} holds {key}, not a tensor of this checkpoint")
                    elif piece.get_dtype() not in FLOAT_DTYPES:
                        problems.append(f"{name}: {key} has dtype {piece.get_dtype()}")
                    else:
                        elements[key] += math.prod(piece.get_shape())
        except SafetensorError as e:
            problems.append(f"shard {name} is damaged ({e})")
    if not problems:  # the pieces of tensors in damaged shards are not counted
        problems += [
            f"{key} has {elements[key]:,} elements in the shards, it had {n:,}"
            for key, n in expected.items()
            if elements[key] != n
        ][:5]
    if problems:
        raise UsageError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    return train_state


def check_resumable(saved: dict, run: dict) -> None:
    """Refuses a checkpoint of another run, naming every field that differs. The world size
    may change: DCP reshards on load."""
    saved_model = dict(saved["model"])
    if saved_model.get("rope_scaling"):  # with the defaults of fields added since it was saved
        rope = RopeScaling(**saved_model["rope_scaling"])
        saved_model["rope_scaling"] = json.loads(json.dumps(dataclasses.asdict(rope)))
    problems = [
        f"model {k}: checkpoint {v!r}, this run {run['model'][k]!r}"
        for k, v in saved_model.items()
        if run["model"].get(k) != v
    ]
    problems += [
        f"{k}: checkpoint {saved[k]!r}, this run {run[k]!r}"
        for k in ["seq_len", "tokenizer", "strategy"]
        if saved[k] != run[k]
    ]
    # The adapters' tensors and what they compute; dropout and a 4-bit base may change.
    adapters = lambda lora: lora and {k: lora[k] for k in ("rank", "alpha", "targets")}  # noqa: E731
    if adapters(saved.get("lora")) != adapters(run["lora"]):
        problems.append(f"lora: checkpoint {saved.get('lora')!r}, this run {run['lora']!r}")
    if problems:
        raise UsageError(
            "cannot resume from a different run (--resume takes the model, data, sequence "
            "length, strategy and adapters from the checkpoint unless given: these differ "
            "from it):\n  " + "\n  ".join(problems)
        )
    # The adapters were trained on the base's weights, which the checkpoint does not hold.
    # (Checkpoints saved before the record had the base's fingerprint resume as they did.)
    if saved.get("base") and saved["base"] != run.get("base"):
        raise UsageError(
            f"cannot resume: the weights of the base checkpoint (--hf-checkpoint) changed or were "
            f"re-saved in other files since this checkpoint was saved (fingerprint "
            f"{saved['base']}, now {run.get('base')}): give --hf-checkpoint the base its "
            f"adapters were trained on"
        )
    # The loader would go on with the checkpoint's order and cursor over other samples.
    # (Checkpoints saved before the record had the dataset's identity resume as they did.)
    if "dataset" in saved and saved["dataset"] != run["dataset"]:
        raise UsageError(
            f"cannot resume on another dataset (its identity, of its tokenizer and counts, "
            f"{run['dataset']}; the checkpoint's {saved['dataset']}): to train on from the "
            f"checkpoint with this data, export it (--resume CHECKPOINT --max-steps ITS_STEP "
            f"--export-hf DIR, with its own data), then start a new run with --hf-checkpoint DIR"
        )


def check_no_newer_checkpoints(root: Path, step: int, resume_from: Path) -> list[Path]:
    """Refuses to resume from `step` here, where saving would replace the later checkpoints,
    unless they are damaged: returns those, for `set_aside`."""
    newer = [c for c in list_checkpoints(root) if step_of(c) > step]
    intact, damaged = [], []
    for checkpoint in newer:
        try:
            check_checkpoint(checkpoint)
            intact.append(checkpoint)
        except UsageError:
            damaged.append(checkpoint)
    if intact:
        raise UsageError(
            f"resuming from {resume_from} here would save over the later checkpoints "
            f"{[c.name for c in intact]} of {root}: branch off into a new run directory "
            f"(--resume {resume_from} --run-dir NEW_DIR), or resume from the latest"
        )
    return damaged


def set_aside(damaged: list[Path], log: Callable) -> None:
    for checkpoint in damaged:
        aside = checkpoint.with_name(f"damaged-{checkpoint.name}")
        os.replace(checkpoint, aside)
        log(f"set the damaged {checkpoint.name} aside as {aside}")


# Set while this process writes a checkpoint: a stop that must come within some time waits
# for it (train.stop_when_launcher_dies), rather than leave the step's checkpoint half written.
SAVING = threading.Event()


@dataclass
class Checkpointer:
    """Saves the run when `due`, keeping the last `keep`; `last` is the newest saved or
    resumed from. A checkpoint holds the optimizer's state (the weights with it); its
    train_state.json also `record` ("run", which check_resumable compares, and "options")."""

    root: Path
    interval: int
    keep: int
    world: World
    record: dict
    last: Path | None = None

    def due(self, step: int, max_steps: int, stopping: bool) -> bool:
        return bool(self.interval) and (step % self.interval == 0 or step == max_steps or stopping)

    def restore(self, path: Path, saved: dict, optimizer, loader) -> int:
        """Loads the checkpoint at `path` (`saved`: its train_state) into the optimizer, the
        loader and the random state; returns its step."""
        state = optimizer.state_dict()
        # Fills the tensors in place, resharding if the world size changed.
        try:
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
        except CheckpointException as e:  # a BaseException: `except Exception` lets it through
            failures = "; ".join(f"rank {r}: {error}" for r, (error, _) in e.failures.items())
            raise UsageError(f"checkpoint {path} could not be read: {failures}") from None
        optimizer.load_state_dict(state)
        loader.load_state_dict(saved["loader"])
        set_rng_state(saved["rng"], self.world.device)
        self.last = path
        return saved["step"]

    def save(self, step: int, tokens: int, optimizer, loader) -> Path:
        """Saves the run after `step`, `tokens` trained on by then (tokens_trained)."""
        SAVING.set()
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".tmp-{final.name}"

        def make_tmp() -> None:
            # Left by a run killed while it saved: its own names only, never a user's.
            for stale in self.root.glob(".tmp-step-*"):
                if stale.name.removeprefix(".tmp-step-").isdigit() and stale.is_dir():
                    shutil.rmtree(stale)
            tmp.mkdir(parents=True)

        def write_train_state() -> None:
            # dcp.save returns once every rank's shards are written. Their sizes and each
            # tensor's shape go in, so check_checkpoint catches a truncated or lost shard.
            train_state = {
                "step": step,
                "tokens": tokens,
                "loader": loader.state_dict(),
                "rng": rng_state(self.world.device),
                **self.record,
                "files": {f.name: f.stat().st_size for f in sorted(tmp.glob("*.safetensors"))},
                "tensors": tensor_shapes(state),
            }
            (tmp / "train_state.json").write_text(json.dumps(train_state))

        def rename() -> None:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in list_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old)

        try:
            self._on_main(make_tmp)
            # Safetensors (each rank its own shards, the layout as JSON in their headers), so
            # resuming unpickles nothing: DCP's default format keeps its metadata as a pickle.
            state = optimizer.state_dict()
            writer = dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True)
            dcp.save(state, storage_writer=writer)
            self._on_main(write_train_state)  # after every rank's shards: then the rename
            self._on_main(rename)
            self.last = final
            return final
        except (OSError, CheckpointException) as e:  # DCP's (a BaseException) holds each rank's
            errors = [e] if isinstance(e, OSError) else [error for error, _ in e.failures.values()]
            if not any(isinstance(error, OSError) and error.errno in NO_SPACE for error in errors):
                raise
            if self.world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise no_space(f"checkpoint {final}", self.root) from None
        finally:
            SAVING.clear()

    def _on_main(self, work: Callable[[], None]) -> None:
        """Runs `work` on the main rank, every rank waiting for it; an OSError there is raised
        on every rank, which would otherwise wait for the main one in their next collective."""
        failed_with = [None]  # the main rank's OSError number, broadcast
        if self.world.is_main:
            try:
                work()
            except OSError as e:
                failed_with[0] = e.errno
                raise
            finally:
                dist.broadcast_object_list(failed_with, src=0)
        else:
            dist.broadcast_object_list(failed_with, src=0)
            if failed_with[0] is not None:
                raise OSError(failed_with[0], f"{os.strerror(failed_with[0])} (on the main rank)")


def tensor_shapes(state: dict, prefix: str = "") -> dict[str, list[int]]:
    """Each tensor of a nested state dict by its name in a checkpoint's shards (the keys on
    its path joined with dots, as DCP names them), and its full shape."""
    shapes = {}
    for key, value in state.items():
        if isinstance(value, dict):
            shapes |= tensor_shapes(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            shapes[f"{prefix}{key}"] = list(value.shape)
    return shapes


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    # Rank 0's state restores every rank: all are seeded alike and draw alike.
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


def write_gathered(
    write: Callable, named: Iterator[tuple[str, torch.Tensor]], is_main: bool
) -> None:
    """Rank 0 writes the full tensors of `named`, a generator gathering each parameter, which
    every rank must therefore drain."""
    if is_main:
        write(named)
    else:
        for _ in named:
            pass
    dist.barrier()


def full_tensor(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(param, DTensor):  # with --cpu-offload the shard is on the CPU
        return param.detach().to(device).full_tensor()
    return param.detach()


def export_hf(
    model: Llama, args: ModelArgs, out_dir: str, dtype: torch.dtype, tokenizer, world: World
) -> None:
    """The weights as a HF checkpoint, LoRA adapters merged, each parameter gathered in turn."""
    gather = functools.partial(full_tensor, device=world.device)
    write_gathered(
        lambda named: save_hf_checkpoint(args, named, out_dir, dtype, tokenizer=tokenizer),
        merged_named_tensors(model, gather),
        world.is_main,
    )


def export_adapter(
    model: Llama,
    args: ModelArgs,
    lora: LoRAConfig,
    out_dir: str,
    base_model: str | None,
    prefix: str,
    world: World,
) -> None:
    """The LoRA adapters in PEFT's format (PEFT's names under `prefix`, hf.peft_prefix's),
    gathered like export_hf's weights."""
    trained = model.named_parameters()
    adapters = ((name, full_tensor(p, world.device)) for name, p in trained if p.requires_grad)
    write_gathered(
        lambda named: save_peft_adapter(args, lora, named, out_dir, base_model, prefix),
        adapters,
        world.is_main,
    )

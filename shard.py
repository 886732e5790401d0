"""Data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`), and what it needs:
the process group, the device mesh, materializing a meta-built model shard by shard, a
global gradient norm, context parallelism (the ranks of a group share each sequence), an
estimate of the memory a run's plan takes per rank, and the planner that picks the fastest
plan whose estimate fits the machine.

The order of application (torchtitan's): build the model on the meta device, `apply_ac`
(offload.py), `apply_context_parallel` (when ranks share sequences), then `apply_fsdp`,
then `materialize`:

    dist = init_distributed()
    with torch.device("meta"):
        model = Llama(args, ops)
    apply_ac(model, "full")
    apply_context_parallel(model, context_parallel_group(dist, 2))   # optional
    apply_fsdp(model, build_mesh("FULL_SHARD", dist), "FULL_SHARD")
    materialize(model, dist, seed=0)            # or hf_path=...

Multi-node runs need no code here: torchrun's rendezvous flags (`--nnodes`, `--node-rank`,
`--rdzv-backend c10d --rdzv-endpoint host:port`) set RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE on every process, and `init_distributed` reads them.

Gradient accumulation: train.py calls `model.set_requires_gradient_sync(is_last_microbatch)`
before each micro-batch's backward, so gradients are reduce-scattered once per step rather
than once per micro-batch. The price: between micro-batches each rank keeps its UNSHARDED
gradients in fp32 (4 bytes per parameter, not divided by the world size), which
`estimate_memory` counts for a plan with grad_accum > 1.

Gradients are SUMMED over the data-parallel ranks (divide factor 1): train.py divides each
rank's summed loss by the global number of target tokens, which makes the step exactly the
one a single process would take on the whole batch.
"""

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn as nn
import torch.nn.functional as F
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

from kernels.cross_entropy import BF16_SUM_CHUNKS, CHUNK_LOGITS_BYTES, _chunk_rows
from kernels.nf4 import row_bytes
from model import (
    Llama,
    LoRAConfig,
    ModelArgs,
    UsageError,
    load_hf_checkpoint,
    load_peft_adapter,
)
from offload import AC_MODES, STAGING_SLOTS

GiB = 2**30

# ----------------------------------------------------------------------------------------
# Processes and devices
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes per node: the shard group of HYBRID_SHARD
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Joins the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE), or makes a group of one for a plain `python train.py`, so that
    `fully_shard` and the rest of this file run the same way with one process or many.

    With CUDA each process takes GPU `local_rank`; the backend is NCCL for CUDA tensors
    and gloo for CPU tensors (the norm of gradients that CPU offload keeps on the host)."""
    env = os.environ
    rank = int(env.get("RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not torch_dist.is_initialized():
        if "RANK" in env:
            # device_id binds NCCL's communicator to this GPU up front (no guessing later).
            device_id = device if device.type == "cuda" else None
            torch_dist.init_process_group(backend, device_id=device_id)
        else:
            # One process: an in-memory store, no port to find or collide on.
            torch_dist.init_process_group(
                backend, store=torch_dist.HashStore(), rank=0, world_size=1
            )
    return Dist(rank, world_size, local_rank, local_world_size, device)


# ----------------------------------------------------------------------------------------
# Strategies: how parameters, gradients and optimizer state are laid out over the ranks
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    shard_over: str  # "world", "node" (replicate across nodes) or "none" (replicate all)
    reshard_after_forward: bool  # free each block's gathered weights after its forward
    doc: str


STRATEGIES: dict[str, Strategy] = {
    "FULL_SHARD": Strategy(
        "world", True, "shard everything over all ranks; blocks re-gathered in backward"
    ),
    "SHARD_GRAD_OP": Strategy(
        "world", False, "shard over all ranks; gathered blocks kept from forward to backward"
    ),
    "HYBRID_SHARD": Strategy(
        "node", True, "FULL_SHARD within a node, replicated across nodes (mesh replicate x shard)"
    ),
    # Resharding with a shard dim of 1 is a local copy in backward, cheaper than keeping
    # every block's param_dtype copy (2 bytes per parameter) from forward to backward.
    "NO_SHARD": Strategy(
        "none", True, "plain data parallelism: a shard dim of size 1, every rank holds all"
    ),
}


def _strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise UsageError(f"unknown sharding strategy {name!r}; expected one of {list(STRATEGIES)}")
    return STRATEGIES[name]


def shard_group_size(strategy: str, world_size: int, local_world_size: int) -> int:
    """How many ranks share one copy of the parameters (the mesh's "shard" dim)."""
    match _strategy(strategy).shard_over:
        case "world":
            return world_size
        case "node":
            return local_world_size
        case _:
            return 1


def build_mesh(strategy: str, dist: Dist) -> DeviceMesh:
    """A 1-D mesh ("shard",) for FULL_SHARD / SHARD_GRAD_OP; a 2-D ("replicate", "shard")
    mesh for HYBRID_SHARD (nodes x ranks per node) and NO_SHARD (world x 1): fully_shard
    replicates over the first dim and shards over the second, so a shard dim of 1 is
    plain data parallelism with gradients all-reduced."""
    shard = shard_group_size(strategy, dist.world_size, dist.local_world_size)
    if dist.world_size % shard:
        raise UsageError(
            f"{strategy} needs the world size {dist.world_size} to be a multiple of the "
            f"ranks per node {dist.local_world_size}"
        )
    if _strategy(strategy).shard_over == "world":
        return init_device_mesh(dist.device.type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(
        dist.device.type, (dist.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
    )


# ----------------------------------------------------------------------------------------
# FSDP
# ----------------------------------------------------------------------------------------


def apply_fsdp(
    model: Llama,
    mesh: DeviceMesh,
    strategy: str,
    cpu_offload: bool = False,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """Shards `model` in place: each TransformerBlock is one FSDP unit (one all-gather and
    one reduce-scatter), then [norm, output] when the embeddings are untied, then the root,
    which keeps the rest (tok_embeddings, which a tied model also uses as its output).

    Master weights, gradients and optimizer state stay fp32 (sharded); forward and backward
    run on `param_dtype` copies gathered per unit, and gradients are reduced in
    `reduce_dtype`. With `cpu_offload` the sharded fp32 state lives in (pinned) host memory
    and the optimizer steps on the CPU.

    Prefetching is left to FSDP2's defaults: in forward the CPU runs ahead of the GPU, so
    the next block's all-gather is issued while the current block computes, and backward
    prefetches one block ahead. Explicit prefetch lists only help when the CPU cannot run
    ahead (host syncs inside the step), which longtune's loop avoids."""
    policy = _strategy(strategy)
    # cast_forward_inputs=False: the blocks get RoPE's inv_freq (fp32) as an input, and
    # rounding it to bf16 would shift the angles of long positions; the activations are
    # already param_dtype (the embedding's output), so nothing else needs the cast.
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    offload_policy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=policy.reshard_after_forward, **common)
    if model.output is not None:
        # Not resharded after forward: backward needs them first. model.forward reads
        # output.weight for the fused loss without calling `output`: FSDP (torch >= 2.12)
        # completes such a partly-run group at the root's post-forward; torch 2.11 warns
        # that `output` "did not run forward" and computes the same (bench/RESULTS.md).
        fully_shard([model.norm, model.output], reshard_after_forward=False, **common)
    # The root is needed again right at the start of backward: keep it gathered.
    fully_shard(model, reshard_after_forward=False, **common)
    # Gradients summed over ranks (see the file docstring) by a plain SUM collective, which
    # gloo supports too (a divide factor alone would use NCCL's PREMUL_SUM). With one rank
    # the default already sums, and a factor would cost a gradient-sized temporary.
    if mesh.size() > 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)


def local_rows(param: DTensor) -> tuple[int, int]:
    """[start, stop) of dim 0 that this rank holds of a sharded parameter. FSDP2 shards
    dim 0 like torch.chunk: ceil(n / shards) rows each, so the last ranks may hold fewer
    rows or none (their local tensor is then padded by FSDP, not by us)."""
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return offset[0], offset[0] + shape[0]


@torch.no_grad()
def materialize(
    model: Llama,
    dist: Dist,
    seed: int = 0,
    hf_path: str | os.PathLike | None = None,
    cpu_offload: bool = False,
    progress: Callable[[int, int], None] | None = None,
    lora: LoRAConfig | None = None,
    lora_adapter: str | os.PathLike | None = None,
) -> None:
    """Allocates the sharded parameters of a meta-built, `apply_fsdp`-ed model (on the host
    when `cpu_offload`, which must match apply_fsdp's) and fills them: from a Hugging Face
    checkpoint, each rank reading only its own rows, or from `model.initial_value`.

    Init computes each parameter's full initial tensor on the rank's device and keeps this
    rank's rows, so the weights equal an unsharded `init_weights(seed)` on that device for
    any number of ranks, with or without CPU offload. A checkpoint that does not fit the
    model raises the same ValueError on every rank (it is checked from config and headers,
    the same files on every rank) before anything is read, and nothing here communicates,
    so no rank is left waiting in a collective.

    With LoRA (model.apply_lora) the adapters come from `lora_adapter` (a PEFT adapter
    directory, with `lora` its config) or from their initial values; a 4-bit base is
    quantized tensor by tensor as it is read or initialized, each rank keeping its rows."""
    model.to_empty(device="cpu" if cpu_offload else dist.device)

    def copy_rows(param: DTensor, tensor_slice) -> None:
        start, stop = local_rows(param)
        param.to_local().copy_(tensor_slice[start:stop])

    if hf_path is not None:
        load_hf_checkpoint(model, hf_path, copy=copy_rows, progress=progress)
        if lora is not None and lora_adapter is None:  # adapters from their initial values
            for name, param in model.named_parameters():
                if param.requires_grad:
                    copy_rows(param, model.initial_value(name, seed, dist.device))
    else:
        model.init_weights(seed, device=dist.device, copy=copy_rows)
    if lora_adapter is not None:
        load_peft_adapter(model, lora, lora_adapter, copy=copy_rows)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scales all gradients so that their global L2 norm is at most `max_norm` (only
    computes it when max_norm <= 0) and returns that norm as a plain 0-dim tensor.
    Each rank sums the squares of its shards; DTensor's full_tensor() reduces the partial
    sums over the mesh, so every rank sees (and clips by) the same global norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# ----------------------------------------------------------------------------------------
# Context parallelism: the ranks of a group share one sequence
# ----------------------------------------------------------------------------------------
# Ulysses-style sequence parallelism. Each of the N ranks of a context-parallel group holds
# S/N consecutive tokens of every row through the embedding, the norms, the projections,
# RoPE (by the row's positions, so a packed document crossing a shard boundary just works),
# the MLP and the loss. Around the attention kernel an all-to-all trades the sequence
# shards for head shards: each rank then holds the whole sequence for H/N query heads (and
# their key/value heads), runs the unchanged kernel (SDPA's cuDNN backend for causal rows,
# the document mask for packed rows), and a second all-to-all trades back. Ring attention
# would keep the heads and pass key/value blocks around the ring, but it needs its own
# kernel loop, and a document mask would have to be split into blocks across ranks; here
# both kernels stay as they are. The cost: 4 all-to-alls of S/N x d per block and forward
# (q, k, v, out), inside a node (NVLink). The limit: N must divide the query heads, and
# the key/value heads too, or be a multiple of them (each is then repeated, so every rank
# gets one).
#
# FSDP is unaffected: it shards over all the ranks as before (a context-parallel rank holds
# a parameter shard like any other), and summing the gradients over all ranks sums each
# token's contribution once, because each token lives on one rank. train.py divides the
# summed loss by the labelled tokens of all ranks, each counted once too.


def context_parallel_group(dist: Dist, n: int) -> torch_dist.ProcessGroup | None:
    """The group of ranks that share this rank's sequences: N consecutive ranks, so with
    torchrun's numbering (a node's ranks are consecutive) a group never spans nodes. The
    mesh is ("data", "context"); together with build_mesh's (replicate, shard) over the same
    ranks, the layout is (replicate across nodes) x (shard) x (context). None when n is 1."""
    check_context_parallel_ranks(n, dist.world_size, dist.local_world_size)
    if n == 1:
        return None
    mesh = init_device_mesh(
        dist.device.type, (dist.world_size // n, n), mesh_dim_names=("data", "context")
    )
    return mesh.get_group("context")


def check_context_parallel_ranks(n: int, world_size: int, ranks_per_node: int) -> None:
    if n < 1 or world_size % n or ranks_per_node % n:
        raise UsageError(
            f"--context-parallel {n} must divide the ranks per node ({ranks_per_node}) "
            f"and the world size ({world_size}): a context-parallel group stays in a node"
        )


def check_context_parallel(args: ModelArgs, n: int) -> None:
    """Refuses what the head split cannot do, naming the heads and what N must be."""
    kv_ok = args.n_kv_heads % n == 0 or n % args.n_kv_heads == 0
    if args.n_heads % n or not kv_ok:
        raise UsageError(
            f"--context-parallel {n} splits attention by heads: it must divide the "
            f"{args.n_heads} query heads, and divide the {args.n_kv_heads} key/value heads or "
            f"be a multiple of them"
        )


def _all_to_all(
    x: torch.Tensor, group: torch_dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Chunk j of x along scatter_dim goes to rank j; what rank i sent is chunk i of the
    result along gather_dim. all_to_all_single runs on NCCL for CUDA tensors and on gloo
    for CPU ones (gloo has it too), so the tests run the same code as the GPUs."""
    send = torch.stack(x.chunk(group.size(), dim=scatter_dim))  # [N, ...], contiguous
    received = torch.empty_like(send)
    torch_dist.all_to_all_single(received, send, group=group)
    # The pieces joined along gather_dim: a view, not a copy, where the layout allows (the
    # sequence of one row: q, k, v on their way to the kernel).
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """The all-to-all as an autograd op: its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _attend_whole_sequence(attend, group, q, k, v, mask):
    """Attention.attend over this rank's slice of a row, q [B, H, S/N, Dh]: the sequence
    shards become head shards [B, H/N, S, Dh] for the kernel, and back. The all-to-alls
    run on the [B, S, H, Dh] views, so the kernel gets the strides it gets without
    context parallelism (the projections' layout) and its output goes back in that layout."""
    n = group.size()
    if k.shape[1] < n:  # fewer key/value heads than ranks: each rank gets one, repeated
        k, v = (t.repeat_interleave(n // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (_AllToAll.apply(t.transpose(1, 2), group, 2, 1).transpose(1, 2) for t in (q, k, v))
    out = attend(q, k, v, mask)
    return _AllToAll.apply(out.transpose(1, 2), group, 1, 2).transpose(1, 2)


def _whole_row_mask(attention_mask, group, positions: torch.Tensor, several_documents=None):
    """The mask of the whole row, from the positions [B, S/N] of every rank of the group
    (`several_documents`, when given, must be the whole rows', as data.PackedLoader's is)."""
    pieces = [torch.empty_like(positions) for _ in range(group.size())]
    torch_dist.all_gather(pieces, positions.contiguous(), group=group)
    return attention_mask(torch.cat(pieces, dim=1), several_documents)


def _forward_rows(forward, group, tokens, labels=None, positions=None, *rest, **kwargs):
    """The model's forward under context parallelism. Training passes positions with its
    slice of each row [B, S/N] (data.PackedLoader's) and gets its part of the loss. A call
    without positions brings whole rows [B, T] for their logits (model.generate's sample at
    the end of a run): each rank runs its slice of them, the rows padded at the end to N
    equal slices (the causal mask hides the padding from the tokens before it), and the
    logits are gathered back whole on every rank, as one process would return them."""
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
    torch_dist.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, dim=1)[:, :length]


def apply_context_parallel(model: Llama, group: torch_dist.ProcessGroup | None) -> None:
    """Makes `model` take this rank's slice of each row (tokens, labels and positions
    [B, S/N]) and attend over the whole row, as the section's comment describes. The model
    code stays as it is: Attention.attend, Llama.attention_mask and Llama.forward (for calls
    with whole rows) are wrapped on the instances (like offload.apply_mlp_tiling), so
    parameter names and checkpoints do not change, and model.py holds no process group or
    collective (a group attribute on Attention would put both there, for a seam three
    methods already give). Apply after offload.apply_ac, whose kept attention then sits
    inside the all-to-alls (it keeps the kernel's output). The wrappers run inside the
    blocks' forward, so a checkpointed block redoes its all-to-alls when it is recomputed."""
    if group is None:
        return
    check_context_parallel(model.args, group.size())
    for block in model.layers:
        block.attention.attend = functools.partial(
            _attend_whole_sequence, block.attention.attend, group
        )
    if model.mask_documents:  # else the mask is None, whatever the positions
        model.attention_mask = functools.partial(_whole_row_mask, model.attention_mask, group)
    model.forward = functools.partial(_forward_rows, model.forward, group)


# ----------------------------------------------------------------------------------------
# Memory per rank
# ----------------------------------------------------------------------------------------

# CUDA context (~0.5 GiB with PyTorch on an H100), cuBLAS/cuDNN workspaces, NCCL's buffers
# and the caching allocator's rounding and fragmentation: what nvidia-smi shows beyond the
# tensors that torch.cuda.max_memory_allocated counts.
OVERHEAD_GIB = 1.0


@dataclass(frozen=True)
class MemoryEstimate:
    """GiB per rank at the step's peak; the GPU parts add up to gpu_total."""

    num_params: int
    phase: str  # the moment of the peak: loss forward, head/block backward, backward end
    parameters: float  # fp32 master shards + gathered param_dtype copies
    gradients: float  # fp32 gradient shards + the reduction in flight
    optimizer: float  # AdamW's two fp32 moments (on the host with CPU offload)
    activations: float  # tensors saved for backward + one block's backward working set
    loss: float  # the output layer + cross-entropy buffers
    overhead: float  # OVERHEAD_GIB
    gpu_total: float
    host_total: float  # host memory: offloaded state (pinned and not) and activations

    @property
    def gpu_tensors(self) -> float:
        """What torch.cuda.max_memory_allocated should read."""
        return self.gpu_total - self.overhead

    def format(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer),
            ("activations", self.activations),
            ("loss / logits", self.loss),
            ("context + allocator", self.overhead),
            ("GPU total", self.gpu_total),
            ("host total", self.host_total),
        ]
        lines = [f"memory per rank ({self.num_params / 1e9:.2f}B params, peak at {self.phase})"]
        lines += [f"  {name:<22}{gib:9.2f} GiB" for name, gib in rows]
        return "\n".join(lines)


def block_params(args: ModelArgs) -> int:
    kv_dim = args.n_kv_heads * args.head_dim
    return (
        2 * args.dim * args.dim + 2 * args.dim * kv_dim + 3 * args.dim * args.ffn_dim + 2 * args.dim
    )


def lora_block(args: ModelArgs, lora: LoRAConfig, param_bytes: int) -> tuple[int, int, int]:
    """(adapter parameters, bytes of the frozen base, the largest target's numel) of one
    block under `lora`: a target's base in NF4 is row_bytes(in) per row, otherwise every
    frozen weight is param_bytes per value."""
    kv = args.n_kv_heads * args.head_dim
    shapes = {"wq": (args.dim, args.dim), "wk": (kv, args.dim), "wv": (kv, args.dim),
              "wo": (args.dim, args.dim), "w1": (args.ffn_dim, args.dim),
              "w3": (args.ffn_dim, args.dim), "w2": (args.dim, args.ffn_dim)}  # fmt: skip
    adapters = sum(lora.rank * (n + k) for t, (n, k) in shapes.items() if t in lora.targets)
    base = 2 * args.dim * param_bytes  # the norms
    for target, (n, k) in shapes.items():
        quantized = lora.quantize_base and target in lora.targets
        base += n * row_bytes(k) if quantized else n * k * param_bytes
    largest = max(n * k for t, (n, k) in shapes.items() if t in lora.targets)
    return adapters, base, largest


@functools.cache  # the planner asks for it once per plan it tries
def pinned_shard_bytes(args: ModelArgs, shard_size: int) -> int:
    """Pinned host bytes of one rank's fp32 parameter shards: each tensor's shard (dim 0
    split over the shard group) rounded up to a power of two, as the caching host allocator
    allocates it."""
    with torch.device("meta"):
        params = list(Llama(args).parameters())
    total = 0
    for p in params:
        shard_bytes = -(-p.shape[0] // shard_size) * (p.numel() // p.shape[0]) * 4
        total += 1 << (shard_bytes - 1).bit_length()
    return total


def block_saved_bytes(
    args: ModelArgs, n_tokens: int, act_bytes: int, kernels: bool, mlp_tokens: int | None = None
) -> int:
    """Bytes one TransformerBlock saves for backward without checkpointing, for n_tokens
    = B * S, counted op by op (weights excluded: they are parameters). Assumes the flash
    or cuDNN attention backend, which keeps q, k, v, out and a fp32 logsumexp; the math
    backend would keep the [B, H, S, S] scores. With MLP tiling (offload.apply_mlp_tiling)
    the [tokens, ffn_dim] tensors exist for `mlp_tokens` = B * tile positions at a time."""
    n, d, f = n_tokens, args.dim, args.ffn_dim
    kv = args.n_kv_heads * args.head_dim
    a = act_bytes
    m = n if mlp_tokens is None else min(n, mlp_tokens)
    linear_inputs = 2 * n * d * a + m * f * a  # normed x (wq/wk/wv), normed h (w1/w3), w2's
    attention = (n * d + 2 * n * kv + n * d) * a + n * args.n_heads * 4  # q k v out, lse
    if kernels:
        norms = 2 * (n * d * a + n * 4)  # each RMSNorm kernel: its input and fp32 rstd [N]
        rope = 0  # the kernel keeps positions and inv_freq only
        swiglu = 2 * m * f * a  # gate and up
    else:
        norms = 2 * (2 * n * d * 4 + n * 4)  # fp32 upcast input, normalized x, rstd
        rope = n * args.head_dim * 4  # cos and sin [B, S, 1, Dh/2] fp32
        swiglu = 3 * m * f * a  # gate, silu(gate), up
    return linear_inputs + attention + norms + rope + swiglu


def block_selective_bytes(args: ModelArgs, n_tokens: int, act_bytes: int) -> int:
    """Bytes one block keeps under selective checkpointing (offload.SAVED_OPS): its input,
    every matmul output (wq, wk, wv, wo, w1, w3, w2) and attention's output and lse."""
    n, d, f = n_tokens, args.dim, args.ffn_dim
    kv = args.n_kv_heads * args.head_dim
    matmuls = (3 * n * d + 2 * n * kv + 2 * n * f) * act_bytes
    return n * d * act_bytes + matmuls + n * d * act_bytes + n * args.n_heads * 4


@dataclass(frozen=True)
class Plan:
    """How a run takes its steps: everything besides the model that the memory per rank
    depends on. train.py makes one from the options (its planner fills in what they leave
    open), applies it and saves it in the run directory; `estimate_memory` counts it. Each
    field is the train.py flag of the same name."""

    seq_len: int
    micro_batch: int = 1  # sequences per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    world_size: int = 1
    nproc_per_node: int | None = None  # HYBRID_SHARD's shard group; None: world_size
    strategy: str = "FULL_SHARD"
    ac: str = "none"  # offload.AC_MODES
    ac_every: int = 1
    mlp_tile: int = 0
    activation_offload: bool = False
    offload_blocks: int | None = None  # of activation offload; None: all blocks but the last
    cpu_offload: bool = False
    optimizer_in_backward: bool = False  # one GPU, no FSDP (offload.OptimizerInBackward)
    param_dtype: str = "bf16"  # of the gathered weights and the activations: bf16 or fp32
    kernels: bool = True  # the Triton kernels' saved tensors, or the PyTorch references'
    # LoRA adapters on a frozen base (model.apply_lora): only the adapters have fp32 master
    # weights, gradients and optimizer state; the base is stored in param_dtype, its
    # adapted projections in NF4 with lora.quantize_base.
    lora: LoRAConfig | None = None
    context_parallel: int = 1  # ranks sharing each sequence, seq_len / N tokens each
    document_mask: bool = False  # attention masked between packed documents (FlexAttention)

    @property
    def tokens_per_step(self) -> int:
        rows_per_micro_batch = self.micro_batch * self.world_size // self.context_parallel
        return self.seq_len * rows_per_micro_batch * self.grad_accum


def offloaded_blocks(args: ModelArgs, plan: Plan) -> int:
    """The blocks whose saved activations activation offload keeps on the host: the first
    `offload_blocks`, by default all but the last (whose backward comes first)."""
    return args.n_layers - 1 if plan.offload_blocks is None else plan.offload_blocks


def estimate_memory(args: ModelArgs, plan: Plan) -> MemoryEstimate:
    """Memory per rank of one training step of `plan`, counted from the shapes (see the
    comments on each term). The peak is the largest of four moments:
      loss forward: every saved activation and the fused loss's buffers, fp32 ones included;
      head backward: every saved activation, the loss's buffers, the gathered weights in
          use, and the head's (untied output's) gradient being reduced;
      block backward: the last block's backward, its working set and its reduction, with
          every other saved activation still there (the head's reduction is done by then);
      backward end: activations freed, all gradient shards written, and the root's
          (embedding's) gradient being reduced.
    The AdamW step itself (fused, no temporaries) needs less than backward end.
    Activations assume the flash/cuDNN attention backend; `plan.kernels` picks the Triton
    kernels' saved tensors or the PyTorch references'. With activation offload they
    assume the host copies keep up with compute, true with full checkpointing; without
    it the link falls behind and the GPU holds much more (bench/RESULTS.md).
    With the optimizer in backward (one GPU, no FSDP, the fp32 state on the host) the
    strategy is unused. With context parallelism each rank holds seq_len / N tokens of each
    row, so every activation term divides by N (attention's q, k, v and output hold the
    whole sequence for H/N heads: as many bytes); parameters, gradients and optimizer state
    are sharded over all world_size ranks as before."""
    strategy, cpu_offload = plan.strategy, plan.cpu_offload
    seq_len, micro_batch = plan.seq_len, plan.micro_batch
    s = shard_group_size(strategy, plan.world_size, plan.nproc_per_node or plan.world_size)
    p = 2 if plan.param_dtype == "bf16" else 4  # bytes of a gathered weight and of activations
    n = micro_batch * seq_len // plan.context_parallel  # the tokens this rank holds
    d, v, layers = args.dim, args.vocab_size, args.n_layers
    total = args.num_params()
    block = block_params(args)
    embedding = v * d
    head = embedding + d if not args.tie_embeddings else 0  # the [norm, output] unit

    # Sharded fp32 state, 4 bytes per parameter per copy, divided over the shard group.
    master = 4 * total / s
    optimizer = 2 * 4 * total / s  # exp_avg, exp_avg_sq
    lora = plan.lora
    if lora is not None:
        adapter_block, base_block, largest_target = lora_block(args, lora, p)
        trainable = layers * adapter_block
        frozen = layers * base_block + p * (embedding + head)
        master = (4 * trainable + frozen) / s
        optimizer = 2 * 4 * trainable / s
    gpu_master = 0.0 if cpu_offload else master
    gpu_optimizer = 0.0 if cpu_offload else optimizer

    # Gathered param_dtype weights: the root (kept from forward through backward), the
    # head unit (kept from the end of forward into backward), and the blocks: the one in
    # backward plus the one prefetched when resharded after forward, all of them otherwise.
    # (With CPU offload each fp32 shard is copied to the GPU before its cast: in backward,
    # a block's largest, w1/w2/w3.)
    gathered_blocks = 2 if _strategy(strategy).reshard_after_forward else layers
    gathered = p * (embedding + head + gathered_blocks * block)
    if lora is not None:
        # A 4-bit weight is dequantized for its matmul and freed: one at a time.
        dequantized = p * largest_target if lora.quantize_base else 0
        gathered = p * (embedding + head) + gathered_blocks * (base_block + p * adapter_block)
        gathered += dequantized
    staging = 4 * args.ffn_dim * d / s if cpu_offload else 0.0

    # Gradients. A unit's reduction: its param_dtype gradient is copied into an fp32
    # buffer (both live), then freed while that buffer is reduce-scattered into the fp32
    # shard (both live).
    def reduction(numel: int) -> float:
        return numel * max(p + 4, 4 + 4 / s)

    # Earlier micro-batches' gradients, kept unsharded in fp32 while
    # set_requires_gradient_sync(False); reduced unit by unit in the last backward. With
    # LoRA, only the adapters have gradients.
    trained = total if lora is None else trainable
    accumulated = 4 * trained if plan.grad_accum > 1 else 0.0
    # The shards every unit but the root has written when backward ends.
    grad_shards = 0.0 if cpu_offload else 4 * (total - embedding) / s
    # What each unit reduces: with LoRA only a block's adapters (the head and root are frozen).
    head_grad, block_grad, root_grad = head, block, embedding
    if lora is not None:
        grad_shards = 0.0 if cpu_offload else 4 * trainable / s
        head_grad, block_grad, root_grad = 0, adapter_block, 0

    # Activations. Saved per block by mode; the block in backward rebuilds (recompute) or
    # still has its full saved set, plus its backward's working set: the incoming and
    # outgoing residual gradients and one [N, F] gradient (SwiGLU's others reuse the
    # memory its saved tensors free as backward goes).
    mlp_tokens = micro_batch * plan.mlp_tile if plan.mlp_tile else None
    full_block = block_saved_bytes(args, n, p, plan.kernels, mlp_tokens)
    block_input = n * d * p
    # Per block: what autograd saves through its hooks (`per_block`, which activation
    # offload can move to the host) and what selective checkpointing keeps in its own cache
    # (`cached`: attention's output and logsumexp, the matmuls' outputs), which stays on the
    # GPU. Blocks that `ac_every` skips keep everything.
    match plan.ac:
        case "none":
            cached_by_mode = None
        case "full":
            cached_by_mode = 0
        case "attention":
            cached_by_mode = n * d * p + n * args.n_heads * 4
        case "selective":
            cached_by_mode = block_selective_bytes(args, n, p) - block_input
        case _:
            raise UsageError(
                f"unknown activation checkpointing mode {plan.ac!r}; expected one of {AC_MODES}"
            )
    if plan.document_mask and plan.ac in ("attention", "selective"):
        # The document-masked attention's kept output comes with its q, k and v, which its
        # backward needs (offload._KeptAttention).
        cached_by_mode += (n * d + 2 * n * args.n_kv_heads * args.head_dim) * p
    checkpointed = [cached_by_mode is not None and i % plan.ac_every == 0 for i in range(layers)]
    per_block = [block_input if c else full_block for c in checkpointed]
    cached = sum(cached_by_mode for c in checkpointed if c)
    working_set = full_block + 2 * n * d * p + (mlp_tokens or n) * args.ffn_dim * p
    if plan.activation_offload:
        # All blocks but the last (or the first `offload_blocks`) go to the host; on the
        # GPU: the others, the block in backward and the one prefetched. (Assumes the
        # copies keep up; see offload.activation_offload.)
        offloaded = offloaded_blocks(args, plan)
        host_activations = sum(per_block[:offloaded])
        saved = sum(per_block[offloaded:]) + max(per_block) + cached
    else:
        host_activations = 0
        saved = sum(per_block) + cached
    final_norm = n * d * p + n * 4 if plan.kernels else 2 * n * d * 4 + n * 4

    # Loss. Fused kernel: the logits chunk, and the gradients it computes in forward and
    # keeps for backward (hidden-sized and output-weight-sized, param_dtype). Reference:
    # [N, V] fp32 log-probabilities saved, then their gradient and the fp32 logits' one
    # (12 bytes per logit), and the bf16 logits' gradient.
    output_grad = 0 if lora is not None else v * d * p  # a frozen output: no gradient
    fused_loss = min(CHUNK_LOGITS_BYTES, n * v * p) + n * d * p + output_grad
    loss = fused_loss if plan.kernels else n * v * (12 + p)
    # Over more than BF16_SUM_CHUNKS chunks the fused loss's forward also sums the output
    # weight's gradient in an fp32 buffer, freed before backward.
    wide_sum = plan.kernels and p < 4 and n > BF16_SUM_CHUNKS * _chunk_rows(v, p)
    loss_forward_extra = 4 * v * d if wide_sum else 0.0

    # Backward starts with the head (final norm, output, loss): its gradient (the loss's
    # weight-sized buffer) is reduced while every saved activation is still there. Then the
    # last block's backward: the head's reduction is done, the block's working set and its
    # own reduction are live; a tied model's output gradient (the loss's buffer) waits for
    # the root, at the end.
    head_backward = {
        "parameters": gpu_master + gathered + staging,
        "gradients": accumulated + (4 + 4 / s) * head_grad,
        "optimizer": gpu_optimizer,
        "activations": saved + final_norm,
        "loss": loss,
    }
    block_backward = {
        **head_backward,
        "gradients": accumulated + reduction(block_grad),
        "activations": saved + working_set,
        "loss": v * d * p if args.tie_embeddings and plan.kernels else 0.0,
    }
    loss_forward = {**head_backward, "gradients": accumulated, "loss": loss + loss_forward_extra}
    # Backward end: the root's gradient (the embedding backward's dense [V, D], into which
    # a tied model's output gradient accumulates) and its reduction.
    end = {
        "parameters": gpu_master + p * embedding + staging,
        "gradients": grad_shards + reduction(root_grad),
        "optimizer": gpu_optimizer,
        "activations": 0.0,
        "loss": 0.0,
    }
    # With CPU offload the fp32 shards of parameters and gradients live in pinned memory,
    # which PyTorch's caching host allocator hands out in powers of two per tensor (8-40%
    # more here); AdamW's moments are plain host memory.
    offloaded = 2 * pinned_shard_bytes(args, s) + optimizer if cpu_offload else 0.0

    if plan.optimizer_in_backward:
        # Every param_dtype weight stays on the GPU, and no gradient buffer: a gradient
        # lives from its computation until its copy to the host is done, with up to
        # STAGING_SLOTS copies in flight behind the one being computed. The host holds
        # the fp32 master weights and moments (plain memory, 12 bytes per parameter), the
        # pinned staging buffers of the largest parameter (rounded up to a power of two)
        # for each direction, and the worker's fp32 copy of one gradient.
        largest = max(embedding, args.ffn_dim * d, d * d)
        in_flight = (1 + STAGING_SLOTS) * largest * p
        weights = {"parameters": p * total, "gradients": in_flight, "optimizer": 0.0}
        loss_forward = {**loss_forward, **weights, "gradients": 0.0}
        head_backward = {**head_backward, **weights}
        block_backward = {**block_backward, **weights}
        end = {**weights, "activations": 0.0, "loss": 0.0}
        pinned_slot = 1 << (largest * p - 1).bit_length()
        offloaded = 12 * total + 2 * STAGING_SLOTS * pinned_slot + 4 * largest
    moments = {"loss forward": loss_forward, "head backward": head_backward,
               "block backward": block_backward, "backward end": end}  # fmt: skip
    phase, parts = max(moments.items(), key=lambda x: sum(x[1].values()))
    gib = {k: val / GiB for k, val in parts.items()}
    host = offloaded + host_activations
    return MemoryEstimate(
        num_params=total,
        phase=phase,
        overhead=OVERHEAD_GIB,
        gpu_total=sum(gib.values()) + OVERHEAD_GIB,
        host_total=host / GiB,
        **gib,
    )


# ----------------------------------------------------------------------------------------
# The plan: the fastest way to take the steps whose estimate fits the machine
# ----------------------------------------------------------------------------------------

# The share of each memory a plan may fill by its estimate. GPU: the estimate has been within
# -12% and +7% of every measured peak (bench/RESULTS.md; the misses low are activation
# offload's copies lagging), and the caching allocator needs room to place what it frees:
# with 15%, a plan at the limit whose estimate is 12% low still peaks at 0.85 / 0.88 = 97%.
# Host: the estimate was within 3% of the measured RSS, to which each process adds its own
# (torch, the CUDA context, the loader: 1.5-1.7 GiB measured).
GPU_MARGIN = 0.15
HOST_MARGIN = 0.05
HOST_PROCESS_GIB = 2.0

# Plans are ranked by a model of the step's time fitted to bench/RESULTS.md: its FLOPs,
# recomputation included, at the GPU_FLOPS those runs sustained, plus the host time that
# offload leaves uncovered. It only orders plans; its seconds are not a prediction. What it
# reproduces (llama3.2-1b on one H100 unless said): no checkpointing before selective (+1%
# at 16k) before attention (+16% at 8k, +5% at 128k: the forward again, without attention)
# before full (+14% over attention at 32k, +21% at 128k: attention's forward again); an MLP
# tiling +3% (one more MLP forward); activation offload with checkpointing +0.5%; CPU
# offload +0.9 s a step for 1.24B parameters (the CPU AdamW, the fp32 shards' copies; 8B on
# 2 GPUs sharing a host: +11 s), so at 128k it beats full recomputation and at 8k it does
# not; the optimizer in backward leaves the GPU idle 1.1 s a step for 8B.
GPU_FLOPS = 4e14  # bf16, MFU 0.35-0.49 of an H100's 989 TFLOP/s in those runs
SELECTIVE_RECOMPUTE = 0.013  # of the step's FLOPs: norms, RoPE, SwiGLU again (16k: 0.393/0.388 s)
ACTIVATION_OFFLOAD_COST = 0.01  # of the step (measured 0.4-0.6% with checkpointing)
CPU_OFFLOAD_S_PER_PARAM = 0.75e-9  # per parameter of a rank's shard, per rank on the host
IN_BACKWARD_S_PER_PARAM = 0.15e-9
AC_ORDER = ("none", "selective", "attention", "full")  # fastest first
MLP_TILES = (16384, 8192, 4096)  # positions; the larger tile first at equal cost
# The fields the planner chooses when the user leaves them open (None).
PLANNED = ("ac", "mlp_tile", "activation_offload", "offload_blocks", "cpu_offload",
           "optimizer_in_backward", "micro_batch", "grad_accum")  # fmt: skip


@dataclass(frozen=True)
class Machine:
    """What a plan must fit in."""

    world_size: int
    nproc_per_node: int
    gpu_gib: float | None  # free memory of each GPU; None: a CPU run, all of it on the host
    host_gib: float  # available memory of each node's host


def step_seconds(args: ModelArgs, plan: Plan) -> float:
    """The modelled time of one step of `plan` on one rank (see GPU_FLOPS above)."""
    layers, d, s = args.n_layers, args.dim, plan.seq_len
    checkpointed = -(-layers // plan.ac_every) / layers
    blocks_forward = 2 * layers * block_params(args)  # FLOPs per token
    attention_forward = 2 * layers * s * d  # causal: a third of flops_per_token's 6LSd
    per_token = args.flops_per_token(s)
    per_token += (
        checkpointed
        * {
            "none": 0.0,
            "selective": SELECTIVE_RECOMPUTE * per_token,
            "attention": blocks_forward,
            "full": blocks_forward + attention_forward,
        }[plan.ac]
    )
    if 0 < plan.mlp_tile < s:
        per_token += 2 * layers * 3 * d * args.ffn_dim  # the MLP's forward once more
    gpu_s = plan.seq_len * plan.micro_batch * plan.grad_accum * per_token / GPU_FLOPS
    if plan.activation_offload:
        gpu_s *= 1 + ACTIVATION_OFFLOAD_COST
    shard_params = args.num_params() / shard_group_size(
        plan.strategy, plan.world_size, plan.nproc_per_node or plan.world_size
    )
    host_s = 0.0
    if plan.cpu_offload:
        per_node = plan.nproc_per_node or plan.world_size
        host_s = shard_params * CPU_OFFLOAD_S_PER_PARAM * per_node
    if plan.optimizer_in_backward:
        host_s = args.num_params() * IN_BACKWARD_S_PER_PARAM
    return gpu_s + host_s


def memory_needed(est: MemoryEstimate, machine: Machine) -> tuple[float, float]:
    """(GPU GiB per GPU, host GiB per node) a plan needs, margins excluded. A CPU run keeps
    the estimate's GPU part on the host too (the context constant aside)."""
    on_host = est.host_total + HOST_PROCESS_GIB
    if machine.gpu_gib is None:
        on_host += est.gpu_tensors
    return est.gpu_total, on_host * machine.nproc_per_node


def fits(est: MemoryEstimate, machine: Machine) -> bool:
    gpu, host = memory_needed(est, machine)
    gpu_ok = machine.gpu_gib is None or gpu <= (1 - GPU_MARGIN) * machine.gpu_gib
    return gpu_ok and host <= (1 - HOST_MARGIN) * machine.host_gib


def candidate_plans(
    args: ModelArgs, base: Plan, wanted: dict, sequences: int, on_gpu: bool
) -> list[Plan]:
    """Every plan of `sequences` per rank per step that keeps the `wanted` fields (those
    the user set), fastest first by step_seconds; at equal time, the larger micro-batch,
    then the larger MLP tile; partial activation offload after the others, and the
    optimizer in backward after all those. On the CPU only the micro-batch is planned: no
    checkpointing, tiling or offload unless asked (there is no GPU memory to save)."""

    def options(name: str, planned: tuple) -> tuple:
        if wanted.get(name) is not None:
            return (wanted[name],)
        return planned if on_gpu else planned[:1]

    mb, accum = wanted.get("micro_batch"), wanted.get("grad_accum")
    if mb and accum:
        batches = [(mb, accum)]
    elif mb:
        batches = [(mb, max(1, round(sequences / mb)))]
    elif accum:
        batches = [(max(1, round(sequences / accum)), accum)]
    else:
        batches = [(m, sequences // m) for m in range(sequences, 0, -1) if sequences % m == 0]
    tiles = (0, *(t for t in MLP_TILES if t < base.seq_len))
    # Activation offload of all blocks but the last (None), else of the first N, N falling
    # in about 8 steps: fewer blocks on the host where it cannot hold them all. Ranked after
    # the plans without it (no partial offload has been measured against them), the most
    # blocks first.
    step = max(1, (args.n_layers - 1) // 8)
    some_blocks = (None, *range(args.n_layers - 1 - step, 0, -step))
    plans = []
    for ac in options("ac", AC_ORDER):
        for tile in options("mlp_tile", tiles):
            for act_offload in options("activation_offload", (False, True)):
                blocks = options("offload_blocks", some_blocks) if act_offload else (None,)
                for offload_blocks in blocks:
                    for cpu in options("cpu_offload", (False, True)):
                        for in_backward in options("optimizer_in_backward", (False, True)):
                            for micro_batch, grad_accum in batches:
                                plans.append(dataclasses.replace(
                                    base, ac=ac, mlp_tile=tile, activation_offload=act_offload,
                                    offload_blocks=offload_blocks, cpu_offload=cpu,
                                    optimizer_in_backward=in_backward,
                                    micro_batch=micro_batch, grad_accum=grad_accum,
                                ))  # fmt: skip

    def valid(p: Plan) -> bool:
        # Activation offload without checkpointing measured 1.95x slower (the host link
        # cannot move every saved tensor in time); the optimizer in backward runs on one
        # GPU, without accumulation or CPU offload.
        offload_ok = p.ac != "none" or not p.activation_offload or wanted.get("ac") == "none"
        in_backward_ok = not p.optimizer_in_backward or (
            p.world_size == 1 and p.grad_accum == 1 and not p.cpu_offload
        )
        return offload_ok and in_backward_ok

    plans = [p for p in plans if valid(p)]
    # The optimizer in backward last, whatever its speed: it rules out gradient clipping.
    return sorted(
        plans,
        key=lambda p: (p.optimizer_in_backward, p.offload_blocks is not None,
                       step_seconds(args, p), -p.micro_batch, -p.mlp_tile),
    )  # fmt: skip


def choose_plan(
    args: ModelArgs,
    machine: Machine,
    base: Plan,
    wanted: dict,
    sequences: int,
    batch_is_fixed: bool,
) -> Plan:
    """The fastest plan (candidate_plans' order) whose estimate fits `machine` with the
    margins above, for `sequences` per rank per step. `base` holds what is not planned
    (seq_len, strategy, dtype, kernels...), `wanted` the planned fields the user set,
    which are kept. When the batch was not set (`batch_is_fixed` False) and nothing fits,
    one sequence per rank per step is tried: without accumulation, whose gradients take
    memory, and where the optimizer in backward can run. Raises ValueError naming the
    largest terms of the smallest plan, and what would make a plan fit."""
    base = dataclasses.replace(
        base, world_size=machine.world_size, nproc_per_node=machine.nproc_per_node
    )
    on_gpu = machine.gpu_gib is not None
    tries = [sequences] if batch_is_fixed or sequences == 1 else [sequences, 1]
    for n in tries:
        plans = candidate_plans(args, base, wanted, n, on_gpu)
        for plan in plans:
            if fits(estimate_memory(args, plan), machine):
                return plan
    raise UsageError(no_fit_message(args, machine, base, wanted, plans))


def no_fit_message(
    args: ModelArgs, machine: Machine, base: Plan, wanted: dict, plans: list[Plan]
) -> str:
    gpu_usable = (1 - GPU_MARGIN) * machine.gpu_gib if machine.gpu_gib else None
    host_usable = (1 - HOST_MARGIN) * machine.host_gib

    def overshoot(plan: Plan) -> tuple[float, float]:
        """How many times what is usable the plan needs: the worse memory, then both."""
        gpu, host = memory_needed(estimate_memory(args, plan), machine)
        ratios = (gpu / gpu_usable if gpu_usable else 0.0, host / host_usable)
        return max(ratios), sum(ratios)

    closest = min(plans, key=overshoot)
    est = estimate_memory(args, closest)
    gpu, host = memory_needed(est, machine)
    terms = {"activations": est.activations, "parameters": est.parameters,
             "gradients": est.gradients, "optimizer states": est.optimizer,
             "loss": est.loss}  # fmt: skip
    largest = ", ".join(f"{k} {v:.1f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3])
    nproc = machine.nproc_per_node
    where = f"{machine.world_size} x {machine.gpu_gib:.1f} GiB GPU" if gpu_usable else "the CPU"
    lines = [
        f"no plan fits {base.seq_len}-token sequences on {where} with {machine.host_gib:.1f} "
        f"GiB of host memory per node ({nproc} process{'es' if nproc > 1 else ''} on it).",
        f"The closest, {plan_flags(closest)}, needs "
        + (f"{gpu:.1f} GiB per GPU of {gpu_usable:.1f} usable ({largest} GiB) and " if gpu_usable
           else f"on the host {largest} GiB, and in all ")
        + f"{host:.1f} GiB of host memory per node of {host_usable:.1f} usable (margins: "
        f"{GPU_MARGIN:.0%} of a GPU, {HOST_MARGIN:.0%} of a host kept free).",
    ]  # fmt: skip
    ways = []
    if wanted and fits_any(args, machine, base, {}):
        ways.append(f"the planner's choice instead of {flags_of(wanted, negated=True)}")
    for k in (2, 4, 8, 16, 32, 64):
        world = machine.world_size * k
        more = dataclasses.replace(
            machine, world_size=world, nproc_per_node=min(world, max(nproc, 8))
        )
        if gpu_usable and fits_any(args, more, base, wanted):
            ways.append(f"{world} GPUs ({more.nproc_per_node} per node)")
            break
    seq = base.seq_len // 2
    while seq >= 1024:
        if fits_any(args, machine, dataclasses.replace(base, seq_len=seq), wanted):
            ways.append(f"--seq-len {seq}")
            break
        seq //= 2
    if ways:
        lines.append("It would fit with: " + "; or ".join(ways))
    else:
        lines.append("Neither more GPUs (up to 64x) nor a shorter sequence would make it fit.")
    return "\n".join(lines)


def fits_any(args: ModelArgs, machine: Machine, base: Plan, wanted: dict) -> bool:
    """Whether some plan fits `machine` with one sequence per rank per step."""
    base = dataclasses.replace(
        base, world_size=machine.world_size, nproc_per_node=machine.nproc_per_node
    )
    plans = candidate_plans(args, base, wanted, 1, machine.gpu_gib is not None)
    return any(fits(estimate_memory(args, p), machine) for p in plans)


def flags_of(fields: dict, negated: bool = False) -> str:
    """The train.py flags that set these planned fields; False as --no-x when `negated`."""
    out = []
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out += [f"--no-{flag[2:]}"] if negated else []
        else:
            out.append(f"{flag} {value}")
    return " ".join(out)


def plan_flags(plan: Plan) -> str:
    return flags_of({name: getattr(plan, name) for name in PLANNED})


# ---- TEMPORARY SHIM (replaced by the planner branch) ----
BATCH_TOKENS = 2**19
SMALL_MODEL_BATCH_TOKENS = 4096


def technique_problems(opts, args, world_size, per_node):
    problems = []
    if opts.context_parallel > 1 and opts.seq_len % opts.context_parallel:
        problems.append(
            f"--context-parallel {opts.context_parallel} must divide --seq-len {opts.seq_len}"
        )
    if opts.optimizer_in_backward:
        refused = {
            "--cpu-offload (it offloads the optimizer with FSDP)": opts.cpu_offload,
            f"--strategy {opts.strategy} (no FSDP)": opts.strategy != "FULL_SHARD",
            f"--grad-clip {opts.grad_clip} (the global norm is known only after the "
            f"updates; pass --grad-clip 0)": bool(opts.grad_clip),
            f"--grad-accum {opts.grad_accum} (the updates happen in every backward)": (
                (opts.grad_accum or 1) > 1
            ),
            f"{world_size} processes (it runs on one GPU)": world_size > 1,
        }
        problems += [
            f"--optimizer-in-backward cannot be used with {k}" for k, v in refused.items() if v
        ]
        if opts.lora_rank:
            problems.append("--optimizer-in-backward is for full fine-tuning, not --lora-rank")
    blocks = opts.offload_blocks
    if blocks is not None and not (opts.activation_offload and 0 <= blocks < args.n_layers):
        problems.append(
            f"--offload-blocks {blocks} needs --activation-offload and a value from 0 to "
            f"{args.n_layers - 1} (the model's blocks but the last)"
        )
    try:
        check_context_parallel(args, opts.context_parallel)
    except ValueError as e:
        problems.append(str(e))
    return problems


def this_machine(gpu, host, world):
    import train as _t
    o = type("O", (), {"gpu_memory": gpu, "host_memory": host})
    gpu = o.gpu_memory
    if gpu is None and world.device.type == "cuda":
        gpu = torch.cuda.mem_get_info(world.device)[0] / 2**30
    memory = torch.tensor([gpu or 0.0, host or _host_gib()], dtype=torch.float64)
    torch_dist.all_reduce(memory, op=torch_dist.ReduceOp.MIN)
    gpu_gib = memory[0].item() if gpu is not None else None
    return Machine(world.world_size, world.local_world_size, gpu_gib, memory[1].item())


def _host_gib():
    from pathlib import Path
    meminfo = Path("/proc/meminfo").read_text()
    available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    return available / 2**30


def machine_to_estimate(world_size, nproc_per_node, gpu, host):
    import os
    env = os.environ
    world_size = world_size or nproc_per_node or int(env.get("WORLD_SIZE", "1"))
    nproc = nproc_per_node or int(env.get("LOCAL_WORLD_SIZE", min(world_size, 8)))
    if world_size % nproc:
        raise UsageError(
            f"--nproc-per-node {nproc} must divide --world-size {world_size} (whole nodes)"
        )
    if gpu is None:
        gpu = torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else 80.0
    return Machine(world_size, nproc, gpu, host or _host_gib())


def make_plan(opts, args, machine, mask_documents, lora=None):
    import types
    on_gpu = machine.gpu_gib is not None
    base = Plan(
        seq_len=opts.seq_len, strategy=opts.strategy, ac_every=opts.ac_every,
        param_dtype=opts.param_dtype or ("bf16" if on_gpu else "fp32"),
        kernels=on_gpu if opts.kernels is None else opts.kernels, lora=lora,
        document_mask=mask_documents, offload_blocks=opts.offload_blocks,
        context_parallel=opts.context_parallel,
    )
    wanted = {k: getattr(opts, k) for k in PLANNED if getattr(opts, k) is not None}
    if (opts.grad_clip or opts.lora_rank) and opts.optimizer_in_backward is None:
        wanted["optimizer_in_backward"] = False
    cp = opts.context_parallel
    check_context_parallel_ranks(cp, machine.world_size, machine.nproc_per_node)
    per_sequence = opts.seq_len * machine.world_size // cp
    if opts.micro_batch and opts.grad_accum:
        sequences = opts.micro_batch * opts.grad_accum
        if opts.batch_tokens and opts.batch_tokens != sequences * per_sequence:
            raise UsageError(
                f"--batch-tokens {opts.batch_tokens} is not --micro-batch {opts.micro_batch} x "
                f"--grad-accum {opts.grad_accum} x {machine.world_size // cp} processes x "
                f"--seq-len {opts.seq_len} = {sequences * per_sequence}; give two of the three"
            )
    else:
        small = args.num_params() < 100e6
        batch = opts.batch_tokens or (SMALL_MODEL_BATCH_TOKENS if small else BATCH_TOKENS)
        sequences = max(1, round(batch / per_sequence))
    batch_is_fixed = opts.batch_tokens is not None or opts.grad_accum is not None
    plan = choose_plan(args, machine, base, wanted, sequences, batch_is_fixed)
    import train as _t
    user_set = [k for k in PLANNED if getattr(opts, k) is not None]
    asked = opts.batch_tokens if (opts.micro_batch and opts.grad_accum) else (opts.batch_tokens or (SMALL_MODEL_BATCH_TOKENS if args.num_params() < 100e6 else BATCH_TOKENS))
    est = estimate_memory(args, plan)
    described = _t._old_describe(plan, est, machine, user_set, asked)
    object.__setattr__(plan, "_described", described)
    return plan


def _fmt(self):
    import train as _t
    return _t._old_format(self._described)


def _json(self):
    return dict(self._described)


def _fmt_measured(self, measured):
    import train as _t
    return _t._old_format_measured({**self._described, "measured": measured})


def measured_memory(steps, device):
    import train as _t
    return _t._old_measured(steps, device)


Plan.format = _fmt
Plan.to_json = _json
Plan.format_measured = _fmt_measured

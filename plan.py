"""The plan of a run and the planner, from plain values (the model's numbers, the machine, the
fields the options fix): options.py turns the command line into them. In order: the machine a
plan must fit in, and the peaks measured on it; the plan (`Plan`: each field a train.py flag,
the rules of the techniques' combinations, its printouts and plan.json); the memory estimate;
last, the planner (the step time, the choice of the fastest plan that fits, the no-fit message).
"""

import bisect
import dataclasses
import functools
import itertools
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from files import UsageError, params_text, plural
from kernels.cross_entropy import BF16_SUM_CHUNKS, CHUNK_LOGITS_BYTES, chunk_rows
from kernels.nf4 import BLOCK as NF4_BLOCK
from kernels.nf4 import stored_bytes as nf4_stored_bytes
from lora import LoRAConfig, expert_lora_shapes
from model import FAMILIES, Llama, ModelArgs
from offload import (
    ATTENTION_OPS,
    MATMUL_OPS,
    check_ac_mode,
    checkpointed,
    keeps,
    offloaded_blocks,
)
from optim import STAGING_SLOTS

GiB = 2**30


# ----------------------------------------------------------------------------------------
# The machine, the peaks a run reached on it, and the sharding strategies (shard.py applies)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What a plan must fit in."""

    world_size: int
    nproc_per_node: int
    gpu_gib: float | None  # free memory of each GPU; None: a CPU run, all of it on the host
    host_gib: float  # available memory of each node's host


def host_memory_gib() -> float:
    """Memory this host can give a run: MemAvailable, within the cgroup's limit if one is
    set (a container or a SLURM job sees the whole machine's /proc/meminfo)."""
    meminfo = Path("/proc/meminfo").read_text()
    available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    limit, usage = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.exists() and usage.exists() and limit.read_text().strip() != "max":
        available = min(available, int(limit.read_text()) - int(usage.read_text()))
    return available / GiB


def host_peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak; KiB on Linux


def measured_memory(steps: int, device: torch.device) -> dict:
    """The peaks reached after `steps` steps, for Plan.format_measured and plan.json."""
    on_gpu = device.type == "cuda"
    return {
        "steps": steps,
        "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GiB if on_gpu else None,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if on_gpu else None,
        "host_peak_rss_gib": host_peak_rss_gib(),
    }


def machine_to_estimate(
    world_size: int | None,
    nproc_per_node: int | None,
    gpu_memory: float | None,
    host_memory: float | None,
) -> Machine:
    """The machine --estimate-memory plans for: the flags', else torchrun's and this one's."""
    env = os.environ
    # --nproc-per-node alone reads as torchrun's: one node of that many processes.
    world_size = world_size or nproc_per_node or int(env.get("WORLD_SIZE", "1"))
    nproc = nproc_per_node or int(env.get("LOCAL_WORLD_SIZE", min(world_size, 8)))
    if world_size % nproc:
        raise UsageError(
            f"--nproc-per-node {nproc} must divide --world-size {world_size} (whole nodes)"
        )
    if gpu_memory is None:
        gpu_memory = torch.cuda.mem_get_info()[0] / GiB if torch.cuda.is_available() else 80.0
    return Machine(world_size, nproc, gpu_memory, host_memory or host_memory_gib())


@dataclass(frozen=True)
class Strategy:
    shard_over: str  # "world", "node" (replicate across nodes) or "none" (replicate all)
    reshard_after_forward: bool  # free each block's gathered weights after its forward


STRATEGIES: dict[str, Strategy] = {
    "FULL_SHARD": Strategy("world", reshard_after_forward=True),
    "SHARD_GRAD_OP": Strategy("world", reshard_after_forward=False),
    "HYBRID_SHARD": Strategy("node", reshard_after_forward=True),
    # Plain data parallelism. Resharding with a shard dim of 1 is a local copy in backward,
    # cheaper than keeping every block's param_dtype copy from forward to backward.
    "NO_SHARD": Strategy("none", reshard_after_forward=True),
}


def strategy_of(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise UsageError(f"unknown sharding strategy {name!r}; expected one of {list(STRATEGIES)}")
    return STRATEGIES[name]


def shard_group_size(strategy: str, world_size: int, nproc_per_node: int) -> int:
    """How many ranks share one copy of the parameters (the mesh's "shard" dim)."""
    shard_over = strategy_of(strategy).shard_over
    return {"world": world_size, "node": nproc_per_node, "none": 1}[shard_over]


# ----------------------------------------------------------------------------------------
# The plan: what a run applies (each field a train.py flag), the rules of the techniques'
# combinations, and what a run prints and saves of it (plan.json)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How a run takes its steps: all but the model that the memory per rank depends on, each
    field the train.py flag of its name or what its comment says, then what make_plan made it
    for (MADE_FOR)."""

    seq_len: int
    micro_batch: int = 1  # sequences per rank per forward
    grad_accum: int = 1
    world_size: int = 1
    nproc_per_node: int | None = None  # None: world_size
    strategy: str = "FULL_SHARD"
    ac: str = "none"
    ac_every: int = 1
    mlp_tile: int = 0
    activation_offload: bool = False
    offload_blocks: int | None = None  # None: all blocks but the last
    cpu_offload: bool = False
    optimizer_in_backward: bool = False
    param_dtype: str = "bf16"  # of the gathered weights and the activations
    kernels: bool = True  # the Triton kernels' saved tensors, or the PyTorch references'
    fp8: bool = False  # asked: large enough blocks' projections in e4m3 (kernels/fp8.py)
    fp8_projections: tuple[str, ...] = ()  # make_plan's fp8_projections: those in e4m3
    lora: LoRAConfig | None = None  # the --lora-* flags
    context_parallel: int = 1
    document_mask: bool = False
    # Whether some packed document may reach attention.LONG_DOCUMENT tokens, so that the causal
    # kernel keeps its heads' outputs (the data's longest document says; unknown: yes).
    long_documents: bool = True
    # The pairs a token attends on average with documents masked apart (the data's
    # data.mean_document_pairs, averaged over the layers as windows cut them), for the step
    # time; None: a causal row's (ModelArgs.attended_per_token).
    attended_per_token: float | None = None
    machine: Machine | None = None
    estimate: "MemoryEstimate | None" = None  # the planner's (below)
    planned: tuple[str, ...] = ()  # the fields the planner chose
    tokens_per_step_asked: int | None = None  # None: --micro-batch x --grad-accum
    seconds_per_step: float | None = None  # step_seconds on the machine's kind of device

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len // self.context_parallel

    @property
    def processes_per_node(self) -> int:
        """nproc_per_node, or where not given the world size (one node)."""
        return self.nproc_per_node or self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.tokens * self.world_size * self.grad_accum

    def flags(self) -> str:
        return " ".join(flags_of({name: getattr(self, name) for name in PLANNED}))

    def to_json(self) -> dict:
        """plan.json: the plan, what it was made for, and its estimate (PLAN_KEYS among
        its keys)."""
        fields = dataclasses.asdict(self)
        gpu, host = memory_needed(self.estimate, self.machine)
        return {
            "flags": self.flags(),
            "planned": list(self.planned),
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_step_asked": self.tokens_per_step_asked,
            "plan": {k: v for k, v in fields.items() if k not in MADE_FOR},
            "machine": fields["machine"],
            "estimate": fields["estimate"],
            "gpu_needed_gib": gpu,
            "host_needed_gib_per_node": host,
            "margins": {"gpu": GPU_MARGIN, "host": HOST_MARGIN},
            "host_per_process_gib": HOST_PROCESS_GIB,
        }

    def format(self) -> str:
        """Three lines and the estimate's table, printed at the start of a run."""
        m, cp, asked = self.machine, self.context_parallel, self.tokens_per_step_asked
        batch = ""
        if asked and asked != self.tokens_per_step:  # whole sequences, or one (choose_plan)
            holders = "process" if cp == 1 else f"group of {cp} context-parallel processes"
            batch = f" ({asked:,} asked: rounded to whole sequences per {holders})"
            if self.tokens_per_step < asked and asked >= 2 * self.seq_len * self.world_size // cp:
                why = "the optimizer in backward cannot accumulate"
                if not self.optimizer_in_backward:
                    why = "accumulating micro-batches keeps a whole fp32 copy of the gradients "
                    why += "on each GPU, which does not fit"
                batch = f" (of the {asked:,} asked: {why})"
        if self.grad_accum > 64:  # a step of hundreds of passes reads as a hang
            batch += f" ({self.grad_accum} forward and backward passes a step: --batch-tokens "
            batch += f"{self.tokens * self.world_size:,} takes one)"
        ranks = plural(self.world_size, "process")
        if cp > 1:
            ranks = f"{plural(self.world_size // cp, 'group')} of {cp} context-parallel ranks"
        planned = ", ".join(self.planned) or "nothing: every option was given"
        if self.seconds_per_step and self.seconds_per_step > 60:
            device = "an H100" if m.gpu_gib is not None else "a 2-core CPU"
            planned += f" | a step takes about {self.seconds_per_step / 60:.0f} min (a rough "
            planned += f"guess from a FLOP rate of {device})"
        return "\n".join([
            f"plan: {self.flags()} | {self.tokens_per_step:,} tokens/step{batch} = "
            f"{self.seq_len} x {self.micro_batch} sequences x {self.grad_accum} micro-batches x "
            f"{ranks} | planned: {planned}",
            self.estimate.format(on_gpu=m.gpu_gib is not None),
            f"{plural(m.world_size, 'process')}: {memory_line(self.estimate, m)}",
        ] + ([self.fp8_line()] if self.fp8 else []))  # fmt: skip

    def fp8_line(self) -> str:
        if self.fp8_projections:
            return f"--fp8: {', '.join(self.fp8_projections)} in e4m3"
        return (
            f"--fp8: every projection stays in bf16: at {self.tokens:,} tokens a matmul the "
            f'blocks are too small for e4m3 to gain (docs/techniques.md, "FP8 matmuls")'
        )

    def format_measured(self, measured: dict) -> str:
        """The peaks reached (measured_memory) beside the estimates."""
        est = self.estimate
        per_process = memory_needed(est, self.machine)[1] / self.machine.nproc_per_node
        line = f"memory after {measured['steps']} steps: "
        if measured["gpu_peak_gib"] is not None:
            line += (
                f"GPU peak {measured['gpu_peak_gib']:.2f} GiB allocated, "
                f"{measured['gpu_reserved_gib']:.2f} reserved (estimate {est.gpu_tensors:.2f} "
                f"allocated, {est.gpu_total:.2f} with the context); "
            )
        return line + (
            f"host peak RSS {measured['host_peak_rss_gib']:.2f} GiB (estimate {per_process:.2f})"
        )


# The keys of a run's plan.json (to_json) by which a directory holding it is a run's
# (shard.check_run_dir). A .lock, metrics.jsonl or plan.json alone is not: the run would write
# over someone's.
PLAN_KEYS = {"flags", "plan", "machine", "estimate"}
MADE_FOR = ("machine", "estimate", "planned", "tokens_per_step_asked", "seconds_per_step")
# Plan.param_dtype's names (--param-dtype's choices) and the dtypes they stand for.
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def flags_of(fields: dict, negated: bool = False) -> list[str]:
    """The words of the train.py flags that set these fields; False as --no-x when `negated`."""
    words = []
    for name, value in fields.items():
        if value is True:
            words.append(flag_name(name))
        elif value is False:
            words += [flag_name(f"no_{name}")] if negated else []
        elif value is not None:  # a value like "-odd" as its own word would read as a flag
            text = str(value)
            words += [f"{flag_name(name)}={text}"] if text[:1] == "-" else [flag_name(name), text]
    return words


def plan_problems(args: ModelArgs, plan: Plan, grad_clip: float | None = None) -> list[str]:
    """Every rule of the techniques and their combinations, stated once: for the options
    (technique_problems) and the planner's plans. `grad_clip`: the user's (None: the
    default, which follows the plan)."""
    problems, cp, blocks = [], plan.context_parallel, plan.offload_blocks
    if cp >= 1:  # options.check_options refuses the rest
        if plan.seq_len % cp:
            problems.append(f"--context-parallel {cp} must divide --seq-len {plan.seq_len}")
        nproc = plan.processes_per_node
        if plan.world_size % cp or nproc % cp:
            problems.append(
                f"--context-parallel {cp} must divide the ranks per node ({nproc}) "
                f"and the world size ({plan.world_size}): a context-parallel group stays in a node"
            )
        kv_ok = args.n_kv_heads % cp == 0 or cp % args.n_kv_heads == 0
        if args.n_heads % cp or not kv_ok:
            problems.append(
                f"--context-parallel {cp} splits attention by heads: it must divide the "
                f"{args.n_heads} query heads, and divide the {args.n_kv_heads} key/value heads or "
                f"be a multiple of them"
            )
    # cuBLAS's e4m3 matmul multiplies dimensions of multiples of 16 only: a rule of --fp8
    # itself, whatever fp8_projections keeps in bf16 at this plan's tokens.
    if plan.fp8:
        sizes = {"dim": args.dim, "ffn_dim": args.ffn_dim,
                 "heads x head_dim": args.n_heads * args.head_dim,
                 "kv heads x head_dim": args.n_kv_heads * args.head_dim,
                 "--seq-len / --context-parallel": plan.seq_len // max(cp, 1),
                 "--mlp-tile": plan.mlp_tile}  # fmt: skip
        if odd := [f"{k} {v}" for k, v in sizes.items() if v % 16]:
            problems.append(f"--fp8 needs multiples of 16: {', '.join(odd)}")
    if blocks is not None and not (plan.activation_offload and 0 <= blocks < args.n_layers):
        problems.append(
            f"--offload-blocks {blocks} needs --activation-offload and a value from 0 to "
            f"{args.n_layers - 1} (the model's blocks but the last)"
        )
    if not plan.optimizer_in_backward:
        return problems
    # Each parameter is updated during backward, before the step's last gradient exists.
    # Without CPU offload it runs without FSDP, on one GPU; with it, on FULL_SHARD's shards
    # (optim.ShardedOptimizerInBackward), whose norm sums over all ranks.
    refused = {
        f"--strategy {plan.strategy} (FULL_SHARD only)": plan.strategy != "FULL_SHARD",
        f"--grad-clip {grad_clip} (the global norm is known only after the updates; pass "
        "--grad-clip 0)": bool(grad_clip),
        f"--grad-accum {plan.grad_accum} (the updates happen in every backward)": (
            plan.grad_accum > 1
        ),
        f"{plural(plan.world_size, 'process')} without --cpu-offload (it runs on one GPU)": (
            plan.world_size > 1 and not plan.cpu_offload
        ),
    }
    problems += [
        f"--optimizer-in-backward cannot be used with {k}" for k, v in refused.items() if v
    ]
    if plan.lora is not None:
        problems.append("--optimizer-in-backward is for full fine-tuning, not --lora-rank")
    return problems


# ----------------------------------------------------------------------------------------
# The planner's memory estimate: per rank, its terms at each moment of a step
# ----------------------------------------------------------------------------------------

# CUDA context, cuBLAS/cuDNN workspaces, NCCL's buffers, the allocator's rounding: what nvidia-smi
# shows beyond torch.cuda.max_memory_allocated (bench/RESULTS.md, "Memory estimator, revised").
OVERHEAD_GIB = 1.0


@dataclass(frozen=True)
class MemoryEstimate:
    """GiB per rank at the step's peak; the GPU parts add up to gpu_total."""

    num_params: int
    phase: str  # the moment of the peak, a row of estimate_memory's table
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

    def terms(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer states": self.optimizer, "activations": self.activations,
                "loss / logits": self.loss}  # fmt: skip

    def format(self, on_gpu: bool = True) -> str:
        """The table of the plan's printout; on the CPU the parts all live on the host."""
        rows = self.terms()
        if on_gpu:
            rows |= {"context + allocator": self.overhead, "GPU total": self.gpu_total,
                     "host total": self.host_total}  # fmt: skip
        else:
            rows["host total"] = self.host_total + self.gpu_tensors
        lines = [f"memory per rank ({params_text(self.num_params)} params, peak at {self.phase})"]
        return "\n".join(lines + [f"  {name:<22}{gib:9.2f} GiB" for name, gib in rows.items()])


@functools.cache  # the planner asks once per plan it tries
def block_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """A block's parameter shapes by "module.leaf", from the meta model, not a formula."""
    with torch.device("meta"):
        # One block: which layers skip RoPE or slide a window changes none of its parameters
        # (the window goes with its layers: ModelArgs refuses one without the other). Of an
        # MoE model, an MoE block: Qwen3-MoE's dense layers, where it has any, count as one.
        one = dataclasses.replace(
            args, n_layers=1, nope_layers=(), window_layers=(), sliding_window=None,
            moe_layers=(0,) if args.moe_layers else (),
        )  # fmt: skip
        block = Llama(one).layers[0]
    return {".".join(name.split(".")[-2:]): p.shape for name, p in block.named_parameters()}


def block_params(args: ModelArgs) -> int:
    return sum(shape.numel() for shape in block_shapes(args).values())


def largest_block_param(args: ModelArgs) -> int:
    return max(shape.numel() for shape in block_shapes(args).values())


@functools.cache
def pinned_shard_bytes(args: ModelArgs, shard_size: int) -> int:
    """Pinned host bytes of one rank's fp32 parameter shards, each rounded up to a power of
    two by the caching host allocator (bench/RESULTS.md, "CPU offload at scale")."""
    with torch.device("meta"):
        shapes = [p.shape for p in Llama(args).parameters()]
    shards = (-(-s[0] // shard_size) * (s.numel() // s[0]) * 4 for s in shapes)
    return sum(1 << (shard - 1).bit_length() for shard in shards)


@dataclass(frozen=True)
class Weights:
    """The weights by FSDP unit (root: embedding; head: [norm, output], none when tied; blocks).
    Trained: fp32 masters, gradients, AdamW's moments; frozen (LoRA's base, ends too): as used."""

    embedding: int  # numel of the root
    head: int  # numel of the head
    trained: int  # numel, all units
    frozen_bytes: int  # all units, stored in param_dtype or (quantized targets) NF4
    block_trained: int
    block_frozen_bytes: int
    dequantized: int  # numel of the largest NF4 weight, dequantized for its matmul, freed after


def count_weights(args: ModelArgs, lora: LoRAConfig | None, param_bytes: int) -> Weights:
    embedding = args.vocab_size * args.dim
    head = embedding + args.dim if not args.tie_embeddings else 0
    if lora is None:
        return Weights(embedding, head, args.num_params(), 0, block_params(args), 0, 0)
    # A target's NF4 base is its packed rows and scales (whole on every rank, but 1/16384 of
    # the rows: divided over the shard group here); biases are not adapted.
    shapes = block_shapes(args)
    targets = {k: s for k, s in shapes.items() if k.removesuffix(".weight") in lora.targets}
    # An MoE block's experts, [E, out, in]: NF4 under QLoRA too (lora.NF4MoE), dequantized a
    # whole layer's at once.
    experts = {k: s for k, s in shapes.items() if len(s) == 3}
    quantized = targets | experts if lora.quantize_base else {}
    base = sum(
        nf4_stored_bytes(s[:-1].numel(), s[-1]) if k in quantized else s.numel() * param_bytes
        for k, s in shapes.items()
    )
    dequantized = 0
    if lora.quantize_base:  # the largest target, or a layer's experts together
        largest = max((s.numel() for s in targets.values()), default=0)
        dequantized = max(largest, sum(s.numel() for s in experts.values()))
    adapters = sum(lora.rank * (n + k) for n, k in targets.values())
    adapters += sum(torch.Size(s).numel() for s in expert_lora_shapes(args, lora).values())
    return Weights(
        embedding, head, trained=args.n_layers * adapters,
        frozen_bytes=args.n_layers * base + param_bytes * (embedding + head),
        block_trained=adapters, block_frozen_bytes=base,
        dequantized=dequantized,
    )  # fmt: skip


def sharded_state(args: ModelArgs, plan: Plan, w: Weights, p: int) -> tuple[dict, float, float]:
    """Under FSDP: the GPU's (parameters, gradients) at estimate_memory's moments (a block's
    backward: with the shard each later block wrote), AdamW's GPU moments, the host's bytes.
    Gathered in param_dtype (`p` bytes): the root through the step, the head from forward's
    end through its backward, two blocks (running, prefetched) if resharded after forward."""
    s = shard_group_size(plan.strategy, plan.world_size, plan.processes_per_node)
    root, head = (w.embedding, w.head) if plan.lora is None else (0, 0)  # trained numel
    master = 0.0 if plan.cpu_offload else (4 * w.trained + w.frozen_bytes) / s
    optimizer = 2 * 4 * w.trained / s  # exp_avg, exp_avg_sq
    blocks = 2 if strategy_of(plan.strategy).reshard_after_forward else args.n_layers
    gathered = p * (w.embedding + w.head) + p * w.dequantized
    gathered += blocks * (p * w.block_trained + w.block_frozen_bytes)
    # With CPU offload, the fp32 copy of a block's largest shard before its cast.
    staging = 4 * largest_block_param(args) / s if plan.cpu_offload else 0.0
    in_use = master + gathered + staging
    # Earlier micro-batches' gradients stay unsharded in fp32 until the last backward.
    accumulated = 4 * w.trained if plan.grad_accum > 1 else 0.0
    shard = 0.0 if plan.cpu_offload else 4 / s  # GPU bytes a trained parameter's shard holds
    # The same in its unit's reduction: an fp32 copy of the gradient, reduce-scattered.
    reduced = max(p + 4, 4 + 4 / s)
    # CPU offload pins the fp32 shards of parameters and gradients; with the optimizer in
    # backward (train.apply_techniques says why) in plain memory, gradients only while their
    # updates wait: a block's and the embedding's or output's.
    host = 0.0
    if plan.cpu_offload and plan.optimizer_in_backward:
        host = 4 * (w.trained + w.block_trained + max(root, head)) / s + optimizer
    elif plan.cpu_offload:
        host = 2 * pinned_shard_bytes(args, s) + optimizer
    # CPU offload's recorded peaks hold a head-sized tensor in the blocks' backward (unanalysed).
    in_blocks = in_use - (0.0 if plan.cpu_offload else p * w.head)
    moments = {
        "loss forward": (in_use, accumulated),
        "head backward": (in_use, accumulated + (4 + 4 / s) * head),
        "block backward": (in_blocks, accumulated + w.block_trained * reduced + shard * head,
                           shard * w.block_trained),
        "backward end": (master + p * w.embedding + staging,
                         shard * (w.trained - root) + root * reduced),
    }  # fmt: skip
    return moments, (0.0 if plan.cpu_offload else optimizer), host


def in_backward_state(args: ModelArgs, w: Weights, p: int) -> tuple[dict, float, float]:
    """sharded_state's terms for the optimizer in backward on one GPU without FSDP: every
    param_dtype weight on the GPU; a gradient until the worker copies it to the host: a block's
    worth, or the larger head's alone (a tied embedding's waits for its own). The host: fp32
    weights and moments, the largest parameter's pinned staging slots, the worker's fp32 copy."""
    total, block = args.num_params(), block_params(args)
    largest_in_block = largest_block_param(args)
    largest = max(w.embedding, largest_in_block)
    pinned_slot = 1 << (largest * p - 1).bit_length()
    tied = w.embedding if args.tie_embeddings else 0
    moments = {
        "loss forward": (p * total, 0),
        "head backward": (p * total, largest * p),
        "block backward": (p * total, (block + largest_in_block) * p, 0),
        "backward end": (p * total, (block + largest + tied) * p),
    }
    return moments, 0.0, 12 * total + (1 + STAGING_SLOTS) * pinned_slot + 4 * largest


def block_bytes(args: ModelArgs, plan: Plan, p: int) -> tuple[int, int | None, int, int]:
    """One block's activations for a rank's tokens, `p` bytes each: what autograd's hooks save
    when not checkpointed; what a checkpointed one keeps in the checkpoint's cache
    (offload.SAVED_OPS' outputs, left on the GPU by activation offload; None without
    checkpointing); what its backward holds beyond those, not checkpointed and checkpointed:
    the larger of the MLP's and attention's (bench/RESULTS.md, "The block in backward,
    measured"), the latter's inputs counted in the uncheckpointed block's saved tensors."""
    check_ac_mode(plan.ac)
    n, d, f, h = plan.tokens, args.dim, args.ffn_dim, args.n_heads
    # MLP tiling (offload.apply_mlp_tiling): [tokens, ffn_dim] tensors exist m tokens at a time.
    m = min(n, plan.micro_batch * plan.mlp_tile) if plan.mlp_tile else n
    # An MoE block's (the larger, where a model has both): each token's k rows through its
    # experts, expert_ffn_dim wide, in place of one ffn_dim wide; beside them its k rows of
    # dim going in and coming out (`expert_rows` each: kernels/moe.py's dispatch and combine
    # keep both) and the router's fp32 probabilities, `moe_kept` in all.
    expert_rows = moe_kept = 0
    if args.moe_layers:
        k = args.experts_per_token
        f, expert_rows = k * args.expert_ffn_dim, m * k * d * p
        moe_kept = 2 * expert_rows + m * args.n_experts * 4
    q, kv = h * args.head_dim, args.n_kv_heads * args.head_dim
    x, qkv, tile = n * d * p, (n * q + 2 * n * kv) * p, m * f * p
    # The flash or cuDNN backend keeps attention's output and fp32 logsumexp (math: the scores).
    out = n * q * p + n * h * 4
    # gpt-oss's sinks rescale it (attention.attention_with_sinks): the product and the fp32
    # sigmoid are kept beside it (counted on the CPU).
    gpt_oss = FAMILIES[args.family].gpt_oss
    rescaled = out if gpt_oss else 0

    if plan.kernels:  # the gated activation's kernel (SwiGLU, GeGLU, gpt-oss's): gate, up
        saved = norms_saved(args, plan, p) + 2 * tile
    else:  # RoPE: fp32 cos and sin; SwiGLU or GeGLU: gate, its activation, up
        saved = norms_saved(args, plan, p) + n * args.head_dim * 4 + 3 * tile
    # gpt-oss's clamped SwiGLU in PyTorch: the clamps, sigmoid and products keep six, three
    # more (kernels.swiglu.clamped_swiglu_reference, counted), recomputed in a checkpointed
    # block's backward too.
    activation = 3 * tile if gpt_oss and not plan.kernels else 0
    # The linears' inputs (normed x, normed h, w2's) and attention's q, k, v and output.
    saved += activation + 2 * x + tile + qkv + out + rescaled + moe_kept

    cached = checkpoint_cache(args, plan, p, out, qkv, selective_matmuls(args, plan, p, m, f))

    # The MLP's backward: h, normed h, a tile's gate, up and w2 input, three residual-sized
    # gradients, one [tile, ffn_dim] (SwiGLU's kernel writes the others over gate and up).
    # Attention's: two residual-sized gradients, dq, dk, dv and cuDNN's fp32 workspace, 8
    # bytes a query element (FlexAttention's, under a document mask, less).
    mlp, attention = 3 * x + tile, 2 * x + qkv + 8 * n * q
    if args.moe_layers:
        # The experts' backward beside what they keep peaks in combine's, the rows' gradients,
        # or in w2's, a tile's once the output rows are freed; with the block's output
        # gradient (and a tile's copy of it under MLP tiling). gpt-oss's activation in PyTorch
        # makes two tiles anew only once w2's input and the rows' gradients are freed: no
        # more where expert_ffn_dim <= dim (bench/RESULTS.md, "The planner's MoE block in
        # backward, counted on the CPU").
        mlp = x + (m * d * p if m < n else 0) + max(expert_rows, tile)
    # --fp8 adds e4m3 copies (a byte an element) where its projections multiply in e4m3: two
    # of an output gradient and its input's columns, at most w2's; q's beside the block's
    # input (bench/RESULTS.md, "FP8 matmuls").
    in_e4m3 = fp8_projections(args, plan)
    if "w2" in in_e4m3:
        mlp += m * f + 2 * m * d
    if in_e4m3:
        attention += n * d + 2 * n * q
    # A checkpointed block's recomputed forward: attention's inputs (and q and k before
    # qk_norm), and its output unless the cache kept it; the MLP's tile again (selective keeps
    # gate and up, not the experts' grouped products: offload.MATMUL_OPS), what the experts keep.
    recomputed = x + qkv + (0 if keeps(plan.ac, ATTENTION_OPS) else out + rescaled)
    if args.qk_norm:
        recomputed += n * (q + kv) * (p if plan.kernels else 8)
    kept_tiles = 1 if keeps(plan.ac, MATMUL_OPS) and not (args.moe_layers and plan.kernels) else 3
    mlp_recomputed = mlp + 2 * x + kept_tiles * tile + activation + moe_kept
    if not plan.kernels:  # the references keep an fp32 input and output in each norm
        norm = 2 * n * d * 4 - x
        recomputed += norm + n * args.head_dim * 4  # and RoPE its cos and sin
        mlp_recomputed += norm + tile  # and SwiGLU silu(gate)
    return saved, cached, max(mlp, attention), recomputed + max(mlp_recomputed, attention)


def checkpoint_cache(args: ModelArgs, plan: Plan, p: int, out: int, qkv: int, matmuls: int):
    """What a checkpointed block keeps in the checkpoint's cache (None without checkpointing):
    the outputs of the ops its mode keeps (offload.SAVED_OPS), attention's `out`, `matmuls`."""
    if plan.ac == "none":
        return None
    kept_attention = keeps(plan.ac, ATTENTION_OPS)
    cached = (out if kept_attention else 0) + (matmuls if keeps(plan.ac, MATMUL_OPS) else 0)
    if args.attention_masked(plan.document_mask, plan.seq_len) and kept_attention:
        # A masked attention's kept output (documents, a window, sinks) comes with the q, k, v its
        # backward needs (offload._KeptAttention) and, up to a row's worth, long documents'
        # causal prefixes' outputs, kept for the causal kernel's backward
        # (attention.packed_attention). A window counts on every block: at most all are windowed.
        long_documents = plan.document_mask and plan.long_documents
        cached += qkv + (plan.tokens * args.n_heads * args.head_dim * p if long_documents else 0)
    return cached


def norms_saved(args: ModelArgs, plan: Plan, p: int) -> int:
    """What a block's RMSNorms save for backward: two over rows of dim (Gemma's four, each over
    an fp32 copy of its input), and qk_norm's (Qwen3) two over q's and k's heads. A kernel keeps
    its input and fp32 rstd; the reference its fp32 upcast input, normalized x and rstd."""
    n, gemma = plan.tokens, FAMILIES[args.family].gemma
    normed, rows = (4 if gemma else 2) * n * args.dim, (4 if gemma else 2) * n
    if args.qk_norm:
        normed += n * (args.n_heads + args.n_kv_heads) * args.head_dim
        rows += n * (args.n_heads + args.n_kv_heads)
    if plan.kernels:
        return normed * (4 if gemma else p) + rows * 4
    return 2 * normed * 4 + rows * 4


def selective_matmuls(args: ModelArgs, plan: Plan, p: int, m: int, f: int) -> int:
    """The matmul outputs selective checkpointing keeps of a block of the plan's tokens (the
    policy keeps every aten matmul's; MLP tiling's m tokens at a time, f wide, as
    block_bytes counts them): wq, wk, wv; wo and w2, dim wide; w1 and w3; LoRA's B products
    beside their bases'. An MoE block: wo's and the router's logits; its experts' products
    only without the kernels (the reference's loop of matmuls), their adapters' B products
    too."""
    n, d = plan.tokens, args.dim
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    widths = {"wq": q, "wk": kv, "wv": kv, "wo": d}
    kept = n * (q + 2 * kv + d) * p
    if args.moe_layers:
        kept += n * args.n_experts * p
        if not plan.kernels:
            gate_up, down = 2 * m * f * p, m * args.experts_per_token * d * p
            kept += gate_up + down
            if plan.lora is not None:
                targets = plan.lora.targets
                kept += gate_up * ("experts_w13" in targets) + down * ("experts_w2" in targets)
    else:
        widths |= {"w1": f, "w3": f, "w2": d}
        kept += n * (d + 2 * f) * p
    if plan.lora is not None:
        kept += n * p * sum(widths.get(target, 0) for target in plan.lora.targets)
    return kept


def activation_bytes(args: ModelArgs, plan: Plan, p: int) -> tuple[int, dict[int, int], int]:
    """The activations on the GPU until the head's backward, in the backward of the blocks
    that are moments of estimate_memory's table (by index), and on the host. In backward the
    blocks kept on the GPU come first, each freeing its own; then each offloaded one is
    fetched with the one before it."""
    n, d, layers = plan.tokens, args.dim, args.n_layers
    full_block, cache, working, working_checkpointed = block_bytes(args, plan, p)
    is_checkpointed = [checkpointed(plan.ac, i, plan.ac_every) for i in range(layers)]
    saved = [n * d * p if c else full_block for c in is_checkpointed]
    cached = [cache if c else 0 for c in is_checkpointed]
    offloaded = offloaded_blocks(layers, plan.offload_blocks) if plan.activation_offload else 0
    final_norm = n * d * p + n * 4 if plan.kernels else 2 * n * d * 4 + n * 4

    def in_backward(i: int) -> int:
        on_gpu = saved[offloaded : i + 1] if i >= offloaded else saved[max(i - 1, 0) : i + 1]
        held = working_checkpointed if is_checkpointed[i] else working
        return sum(on_gpu) + sum(cached[: i + 1]) + held

    # The last block; each offloaded one but the first (later ones keep more of the
    # checkpoint's cache, earlier ones see more gradient shards written); the first.
    moments = [layers - 1, *range(1, offloaded), 0]
    kept = sum(saved[offloaded:]) + sum(cached) + final_norm
    return kept, {i: in_backward(i) for i in moments}, sum(saved[:offloaded])


def loss_bytes(args: ModelArgs, plan: Plan, p: int) -> tuple[float, float, float]:
    """The loss's buffers in its forward, the head's backward and the blocks'. Fused: the
    logits chunk, the hidden and output gradients computed in forward. Reference: [N, V] fp32
    log-probabilities, their and the fp32 logits' gradients, the param_dtype logits'."""
    n, v, d = plan.tokens, args.vocab_size, args.dim
    output_grad = 0 if plan.lora is not None else v * d * p  # a frozen output: no gradient
    fused_loss = min(CHUNK_LOGITS_BYTES, n * v * p) + n * d * p + output_grad
    loss = fused_loss if plan.kernels else n * v * (12 + p)
    # Over more than BF16_SUM_CHUNKS chunks the fused loss's forward also sums the output
    # weight's gradient in an fp32 buffer, freed before backward.
    wide_sum = plan.kernels and p < 4 and n > BF16_SUM_CHUNKS * chunk_rows(v, p)
    # A tied model's output gradient (the loss's buffer) waits for the root's, at the end.
    tied = v * d * p if args.tie_embeddings and plan.kernels else 0.0
    return loss + (4 * v * d if wide_sum else 0.0), loss, tied


def estimate_memory(args: ModelArgs, plan: Plan) -> MemoryEstimate:
    """Memory per rank of a step of `plan`, counted from the shapes at each moment of the
    table below; the peak is the largest (the fused AdamW step needs less than backward's
    end). Activations assume cuDNN attention and, with activation offload, host copies that
    keep up (Planner.candidates says when). Under context parallelism N, a rank holds
    seq_len / N tokens of each row (attention: the whole row for H/N heads): activations / N."""
    p = PARAM_DTYPES[plan.param_dtype].itemsize  # bytes of a gathered weight, of activations
    w = count_weights(args, plan.lora, p)
    if plan.optimizer_in_backward and not plan.cpu_offload:
        state, optimizer, host = in_backward_state(args, w, p)
    else:  # with CPU offload FSDP's state is counted, less its set of gradient shards
        state, optimizer, host = sharded_state(args, plan, w, p)
    kept, in_backward, host_activations = activation_bytes(args, plan, p)
    loss_forward, loss_backward, loss_in_blocks = loss_bytes(args, plan, p)
    weights, gradients, written = state["block backward"]
    last = args.n_layers - 1
    names = {0: "first block backward", last: "last block backward"}  # one block: the last
    # moment: parameters, gradients, activations, loss (and AdamW's moments throughout)
    moments = [
        ("loss forward", *state["loss forward"], kept, loss_forward),
        ("head backward", *state["head backward"], kept, loss_backward),
    ]
    for i, held in in_backward.items():  # the head's gradient shard, the later blocks' written
        moment = names.get(i, "offloaded block backward")
        moments.append((moment, weights, gradients + (last - i) * written, held, loss_in_blocks))
    # activations freed, every shard written, the root's (embedding's) gradient reduced
    moments.append(("backward end", *state["backward end"], 0, 0.0))
    phase, *terms = max(moments, key=lambda moment: sum(moment[1:]))
    parameters, gradients, activations, loss = (term / GiB for term in terms)
    optimizer /= GiB
    return MemoryEstimate(
        args.num_params(), phase, parameters, gradients, optimizer, activations, loss,
        overhead=OVERHEAD_GIB,
        gpu_total=parameters + gradients + optimizer + activations + loss + OVERHEAD_GIB,
        host_total=(host + host_activations) / GiB,
    )  # fmt: skip


def memory_needed(est: MemoryEstimate, machine: Machine) -> tuple[float, float]:
    """(GPU GiB per GPU, host GiB per node), margins excluded; a CPU run's tensors on the host."""
    on_host = est.host_total + HOST_PROCESS_GIB
    if machine.gpu_gib is None:
        on_host += est.gpu_tensors
    return est.gpu_total, on_host * machine.nproc_per_node


def overshoot(est: MemoryEstimate, machine: Machine) -> tuple[float, float]:
    """(GPU, host): need over what the margins leave usable (GPU 0 on the CPU); fits if <= 1."""
    gpu, host = memory_needed(est, machine)
    gpu_share = 0.0 if machine.gpu_gib is None else gpu / ((1 - GPU_MARGIN) * machine.gpu_gib)
    return gpu_share, host / ((1 - HOST_MARGIN) * machine.host_gib)


def fits(est: MemoryEstimate, machine: Machine) -> bool:
    return max(overshoot(est, machine)) <= 1


def memory_line(est: MemoryEstimate, machine: Machine) -> str:
    gpu, host = memory_needed(est, machine)
    where = "on the CPU, all of it on the host"
    if machine.gpu_gib is not None:
        where = f"needs {gpu:.1f} of {machine.gpu_gib:.1f} GiB per GPU ({GPU_MARGIN:.0%} kept free)"
    return (
        f"{where}; host {host:.1f} of {machine.host_gib:.1f} GiB per node ({HOST_MARGIN:.0%} "
        f"kept free; {plural(machine.nproc_per_node, 'process')}, {HOST_PROCESS_GIB:.0f} GiB "
        "each besides the estimate)"
    )


# ----------------------------------------------------------------------------------------
# The planner: the fastest way to take the steps whose estimate fits the machine
# ----------------------------------------------------------------------------------------

# The share of each memory kept free. GPU: twice the estimate's worst miss against measured
# peaks (bench/RESULTS.md, "The block in backward, measured"); expandable segments (train.main's
# default) let the allocator give back what it holds beyond its tensors. Host: the estimate is
# close to the measured RSS; each process adds torch, the CUDA context and the loader.
GPU_MARGIN = 0.10
HOST_MARGIN = 0.05
HOST_PROCESS_GIB = 2.0

# Plans are ranked by step_seconds: the step's FLOPs, recomputation included, at the rate
# measured runs sustained, plus the host time offload leaves uncovered; it orders the recorded
# runs as measured, within 2x of each (bench/RESULTS.md, "Planner: the step time's guess
# against the recorded steps"; tests/test_plan.py checks both).
GPU_FLOPS = 4e14  # bf16 on an H100, at the MFU of those runs
CPU_FLOPS = 1e11  # fp32 on 2 cores, counted as ModelArgs.training_flops ("Planner: CPU rate")
SELECTIVE_RECOMPUTE = 0.013  # of the step's FLOPs: norms, RoPE, SwiGLU again
ACTIVATION_OFFLOAD_COST = 0.01  # of the step, with checkpointing
CPU_OFFLOAD_S_PER_PARAM = 0.75e-9  # per parameter of a rank's shard, per rank on the host
IN_BACKWARD_S_PER_PARAM = 0.15e-9
# The planner's options for each field left open, fastest first at equal cost
# (Planner.partial_offload adds offloading only the first N blocks).
CHOICES = {
    "ac": ("none", "selective", "attention", "full"),
    "mlp_tile": (0, 16384, 8192, 4096),
    "activation_offload": (False, True),
    "offload_blocks": (None,),
    "cpu_offload": (False, True),
    "optimizer_in_backward": (False, True),
}
# The fields the planner chooses, in the order of the plan's flags.
PLANNED = (*CHOICES, "micro_batch", "grad_accum")
# The default --batch-tokens: fine-tuning's usual half-million; under 100M parameters, 16 x 256.
BATCH_TOKENS = 2**19
SMALL_MODEL_BATCH_TOKENS = 4096


def step_seconds(args: ModelArgs, plan: Plan, flops: float = GPU_FLOPS) -> float:
    """The modelled seconds of a step of `plan` on one rank. Under context parallelism N a rank
    computes seq_len / N tokens through the blocks and the whole row's attention for H/N heads."""
    layers, s = args.n_layers, plan.seq_len
    share = sum(checkpointed(plan.ac, i, plan.ac_every) for i in range(layers)) / layers
    blocks_forward = 2 * args.matmul_params(active=True)  # FLOPs per token
    attended = plan.attended_per_token or args.attended_per_token(s)
    per_token = args.training_flops(1, attended, frozen=plan.lora is not None)
    attention_forward = args.training_flops(0, attended) / 3
    recomputed = {
        "none": 0.0,
        "selective": SELECTIVE_RECOMPUTE * per_token,
        "attention": blocks_forward,
        "full": blocks_forward + attention_forward,
    }
    per_token += share * recomputed[plan.ac]
    if 0 < plan.mlp_tile < s:  # the MLP's forward once more, where no block recompute was
        recomputing_mlp = 0.0 if keeps(plan.ac, MATMUL_OPS) else share
        mlp = sum(args.feed_forward_params(i, active=True) for i in range(layers))
        per_token += (1 - recomputing_mlp) * 2 * mlp
    compute_s = plan.tokens * plan.grad_accum * per_token / flops
    if plan.activation_offload:
        compute_s *= 1 + ACTIVATION_OFFLOAD_COST
    if plan.cpu_offload:  # with the optimizer in backward too: its updates overlap backward
        nproc = plan.processes_per_node
        shard = shard_group_size(plan.strategy, plan.world_size, nproc)
        return compute_s + args.num_params() / shard * CPU_OFFLOAD_S_PER_PARAM * nproc
    if plan.optimizer_in_backward:  # the host's updates that backward leaves uncovered
        return compute_s + args.num_params() * IN_BACKWARD_S_PER_PARAM
    return compute_s


def make_plan(
    args: ModelArgs,
    machine: Machine,
    base: Plan,
    wanted: dict,
    batch_tokens: int | None,
    grad_clip: float | None,
) -> Plan:
    """`base` (what the options fix) with `wanted` (the planned fields they set), the fastest
    fitting choice for the rest (choose_plan) and what it was made for. Sequences per rank
    (per context-parallel group) and step: `batch_tokens` (or its default) in whole sequences,
    or --micro-batch x --grad-accum."""
    cp, seq_len, asked = base.context_parallel, base.seq_len, batch_tokens
    micro_batch, grad_accum = wanted.get("micro_batch"), wanted.get("grad_accum")
    per_sequence = seq_len * machine.world_size // cp  # a group of cp ranks shares one
    if micro_batch and grad_accum:
        sequences, batch_is_fixed = micro_batch * grad_accum, True
        if asked and asked != sequences * per_sequence:
            raise UsageError(
                f"--batch-tokens {asked} is not --micro-batch {micro_batch} x --grad-accum "
                f"{grad_accum} x {plural(machine.world_size // cp, 'process')} x --seq-len "
                f"{seq_len} = {sequences * per_sequence}; give two of the three"
            )
    else:
        asked = asked or (SMALL_MODEL_BATCH_TOKENS if args.num_params() < 100e6 else BATCH_TOKENS)
        sequences = max(1, round(asked / per_sequence))
        if batch_tokens and grad_accum and sequences % grad_accum:
            raise UsageError(
                f"--grad-accum {grad_accum} does not split --batch-tokens {asked} "
                f"({plural(sequences, 'sequence')} of --seq-len {seq_len} a rank) into "
                f"micro-batches: give a --grad-accum that divides {sequences}, or --micro-batch"
            )
        batch_is_fixed = batch_tokens is not None or grad_accum is not None
    plan = choose_plan(args, machine, base, wanted, sequences, batch_is_fixed, grad_clip)
    return dataclasses.replace(
        plan,
        machine=machine,
        estimate=estimate_memory(args, plan),
        planned=tuple(name for name in PLANNED if name not in wanted),
        tokens_per_step_asked=asked,
        seconds_per_step=step_seconds(args, plan, GPU_FLOPS if machine.gpu_gib else CPU_FLOPS),
        fp8_projections=fp8_projections(args, plan),
    )


# A block's projections, in the order of its forward.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
# The fewest multiply-adds of a block's projections in a forward (each matmul's tokens x its
# weight's elements) at which --fp8 multiplies them in e4m3. Each e4m3 projection costs the
# host several times bf16's launches, a fixed cost: in a smaller block the step waits on the
# host longer than e4m3 saves on the GPU. Between the largest block measured slower in e4m3
# and the smallest measured faster: bench/RESULTS.md, "--fp8 keeps small blocks in bf16".
FP8_SMALLEST_BLOCK = 700e9


def fp8_candidates(args: ModelArgs, lora: LoRAConfig | None) -> tuple[str, ...]:
    """The projections --fp8 may multiply in e4m3: a block's seven, of an all-MoE model
    attention's four (the experts multiply in bf16, kernels/moe.py), but QLoRA's 4-bit ones
    (model.fp8_ops leaves them in bf16)."""
    projections = PROJECTIONS if len(args.moe_layers) < args.n_layers else PROJECTIONS[:4]
    quantized = lora.targets if lora and lora.quantize_base else ()
    return tuple(p for p in projections if p not in quantized)


def fp8_projections(args: ModelArgs, plan: Plan) -> tuple[str, ...]:
    """The projections --fp8 multiplies in e4m3: the fp8_candidates where the block's are large
    enough at the plan's tokens a matmul (FP8_SMALLEST_BLOCK), else (or without --fp8) none
    (model.fp8_ops is not applied). Under --mlp-tile the MLP's matmuls are a tile's."""
    if not plan.fp8:
        return ()
    rows = plan.seq_len // plan.context_parallel
    mlp_tokens = plan.micro_batch * min(plan.mlp_tile or rows, rows)
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = (2 * q + 2 * kv) * args.dim  # wq, wk, wv, wo
    # An MoE block's experts multiply in bf16 (kernels/moe.py): of an all-MoE model, attention's.
    dense_mlp = 3 * args.dim * args.ffn_dim if len(args.moe_layers) < args.n_layers else 0
    multiply_adds = plan.tokens * attention + mlp_tokens * dense_mlp
    return fp8_candidates(args, plan.lora) if multiply_adds >= FP8_SMALLEST_BLOCK else ()


def choose_plan(
    args: ModelArgs,
    machine: Machine,
    base: Plan,
    wanted: dict,
    sequences: int,
    batch_is_fixed: bool,
    grad_clip: float | None = None,
) -> Plan:
    """The first plan of `sequences` per rank per step that fits; if none and the batch is not
    set, of one sequence (no accumulated gradients; the optimizer in backward can run); else
    raises UsageError(Planner.no_fit_message)."""
    base = dataclasses.replace(
        base, world_size=machine.world_size, nproc_per_node=machine.nproc_per_node
    )
    planner = Planner(args, machine, base, wanted, grad_clip)
    if problems := plan_problems(args, dataclasses.replace(base, **wanted), grad_clip):
        raise UsageError("; ".join(problems))
    for n in [sequences] if batch_is_fixed or sequences == 1 else [sequences, 1]:
        if plan := planner.first_fit(n):
            return plan
    raise UsageError(planner.no_fit_message(n))


@dataclass
class Planner:
    """choose_plan's search: `base` has the machine's processes, `wanted` is kept."""

    args: ModelArgs
    machine: Machine
    base: Plan
    wanted: dict
    grad_clip: float | None = None

    def overshoot(self, plan: Plan) -> tuple[float, float]:
        return overshoot(estimate_memory(self.args, plan), self.machine)

    def candidates(self, sequences: int) -> list[Plan]:
        """The plans to try, in order. On the CPU only the micro-batch: no GPU memory to save."""
        wanted, on_gpu = self.wanted, self.machine.gpu_gib is not None
        choices = {k: (wanted[k],) if k in wanted else v if on_gpu else v[:1]
                   for k, v in CHOICES.items()}  # fmt: skip
        if "mlp_tile" not in wanted:
            choices["mlp_tile"] = tuple(t for t in choices["mlp_tile"] if t < self.base.seq_len)
        given, accum = wanted.get("micro_batch"), wanted.get("grad_accum")
        if given or accum:
            choices["micro_batch"] = (given or max(1, round(sequences / accum)),)
        else:
            choices["micro_batch"] = [m for m in range(sequences, 0, -1) if sequences % m == 0]
        plans = []
        for values in itertools.product(*choices.values()):
            fields = dict(zip(choices, values, strict=True))
            accumulated = accum or max(1, round(sequences / fields["micro_batch"]))
            plans.append(dataclasses.replace(self.base, **fields, grad_accum=accumulated))
            if fields["activation_offload"] and "offload_blocks" not in wanted:
                plans += self.partial_offload(plans[-1])
        # Activation offload without checkpointing measured much slower: the host link
        # cannot move every saved tensor in time (bench/RESULTS.md, "Sharding and offload").
        plans = [
            p for p in plans
            if (p.ac != "none" or not p.activation_offload or wanted.get("ac") == "none")
            and not plan_problems(self.args, p, self.grad_clip)
        ]  # fmt: skip
        # The optimizer in backward after all others, whatever its speed (it rules out
        # clipping); partial offload after the plans without it (unmeasured).
        return sorted(
            plans,
            key=lambda p: (p.optimizer_in_backward, p.offload_blocks is not None,
                           step_seconds(self.args, p), -p.micro_batch, p.mlp_tile > 0,
                           -p.mlp_tile),
        )  # fmt: skip

    def partial_offload(self, plan: Plan) -> list[Plan]:
        """`plan` offloading the most first blocks the host holds, if some but not all."""

        def host_overflows(n: int) -> bool:
            return self.overshoot(dataclasses.replace(plan, offload_blocks=n))[1] > 1

        # The host's bytes grow with N: bisect for the first N that overflows it.
        overflows_from = bisect.bisect(range(self.args.n_layers), False, key=host_overflows)
        if 0 < overflows_from < self.args.n_layers:
            return [dataclasses.replace(plan, offload_blocks=overflows_from - 1)]
        return []

    def first_fit(self, sequences: int = 1) -> Plan | None:
        return next((p for p in self.candidates(sequences) if max(self.overshoot(p)) <= 1), None)

    def no_fit_message(self, sequences: int) -> str:
        """The closest plan (worse memory first), its needs and largest terms, and as flags the
        first change of each kind fitting one sequence per rank (or context parallelism + LoRA)."""
        m, base, wanted = self.machine, self.base, self.wanted
        closest = min(
            self.candidates(sequences), key=lambda p: sorted(self.overshoot(p), reverse=True)
        )
        est = estimate_memory(self.args, closest)
        largest = sorted(est.terms().items(), key=lambda term: -term[1])[:3]
        largest = ", ".join(f"{name} {gib:.1f}" for name, gib in largest)
        where = "the CPU" if m.gpu_gib is None else f"{m.world_size} x {m.gpu_gib:.1f} GiB GPU"
        lines = [
            f"no plan fits {self.base.seq_len}-token sequences on {where} with {m.host_gib:.1f} "
            f"GiB of host memory per node ({plural(m.nproc_per_node, 'process')} on it).",
            f"The closest, {closest.flags()}, {memory_line(est, m)}; most: {largest} GiB.",
        ]

        def fits_with(fields: dict, **change) -> bool:
            changed = dataclasses.replace(self, base=dataclasses.replace(base, **fields), **change)
            return changed.first_fit() is not None

        def first(changes: dict[str, dict]) -> list[str]:
            return next(([flags] for flags, fields in changes.items() if fits_with(fields)), [])

        on_gpu, cp = m.gpu_gib is not None, base.context_parallel
        ways, tried = [], []
        if wanted:
            tried.append("the planner's choice")
            if fits_with({}, wanted={}):
                instead = " ".join(flags_of(wanted, negated=True))
                ways.append(f"the planner's choice instead of {instead}")
        sharing = {f"--context-parallel {n}": {"context_parallel": n}
                   for n in range(2 * cp, m.nproc_per_node + 1, cp) if on_gpu}  # fmt: skip
        rank16 = LoRAConfig(rank=16, alpha=16.0)
        adapters = {"--lora-rank 16": rank16, "--lora-rank 16 --quantize-base nf4": (
            dataclasses.replace(rank16, quantize_base="nf4"))}  # fmt: skip
        if base.lora is not None:
            adapters = {"--quantize-base nf4": dataclasses.replace(base.lora, quantize_base="nf4")}
        if any(len(s) == 2 and s[-1] % NF4_BLOCK for s in block_shapes(self.args).values()):
            adapters = {flags: lora for flags, lora in adapters.items() if not lora.quantize_base}
        adapters = {flags: {"lora": lora} for flags, lora in adapters.items() if lora != base.lora}
        tried += ["context parallelism"] if sharing else []
        tried += ["LoRA or QLoRA"] if adapters else []
        both = {f"{a} {b}": {**sharing[a], **adapters[b]} for a in sharing for b in adapters}
        ways += first(sharing) + first(adapters) or first(both)
        if on_gpu:
            tried.append("more GPUs (up to 64x)")
            for world in (m.world_size * 2**k for k in range(1, 7)):
                nproc = min(world, max(m.nproc_per_node, 8))
                machine = Machine(world, nproc, m.gpu_gib, m.host_gib)
                if fits_with({"world_size": world, "nproc_per_node": nproc}, machine=machine):
                    ways.append(f"{world} GPUs ({nproc} per node)")
                    break
        tried.append("a shorter sequence")
        halves = (base.seq_len // 2**k for k in range(1, base.seq_len.bit_length()))
        ways += first({f"--seq-len {seq}": {"seq_len": seq} for seq in halves if seq >= 1024})
        if ways:
            return "\n".join([*lines, "It would fit with: " + "; or ".join(ways)])
        tried = ", ".join(tried[:-1]) + " nor " + tried[-1]
        where = "" if on_gpu else " in this host's memory"
        return "\n".join([*lines, f"Neither {tried} would make it fit{where}."])

"""Train a Llama: options, setup, then the loop, read top to bottom.

    python train.py           # "tiny" from scratch on Python's stdlib, as bytes; CPU or one GPU
    python train.py --help    # the options; README.md: fine-tuning, many GPUs, the memory plan

The options; `setup` (the checkpoint to resume from and what it fixes, the checks, the data,
the plan, the model built by `apply_techniques`, the loader, and the checkpoint's state
restored); the step and what the loop asks after it;
then `train`, a loop of `train_step` calls whose logging, evaluation, saving and stopping are
each decided by the object that owns it (`MetricsLog`, `shard.Checkpointer`, `StopSignals`).
What was given is checked before the first step: one UsageError says what is wrong and expected.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

import offload
import optim
import shard
from data import (
    IGNORE_INDEX,
    Batch,
    HFTokenizer,
    PackedLoader,
    RunData,
    TokenDataset,
    Tokenizer,
    attended_per_token,
    open_data,
    open_eval_data,
)
from files import UsageError, no_follow, params_text, plural, write_json
from hf import (
    HF_EXPORT,
    PEFT_ADAPTER,
    args_from_hf_config,
    check_hf_checkpoint,
    check_peft_adapter,
    fill_weights,
)
from model import (
    LONG_DOCUMENT,
    LORA_TARGETS,
    PRESETS,
    REFERENCE_OPS,
    SDPA_BACKENDS,
    Llama,
    LoRAConfig,
    ModelArgs,
    apply_lora,
    attended_pairs,
    fp8_ops,
    generate,
    parse_lora_targets,
    peak_flops,
    triton_ops,
)

REPO = Path(__file__).resolve().parent
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The exit status of a run stopped by SIGTERM or Ctrl-C after saving a checkpoint (EX_TEMPFAIL:
# "try again"), so `train.py && export` stops there and a requeue script can tell it apart.
EXIT_STOPPED = 75


# ----------------------------------------------------------------------------------------
# Options: one dataclass; each field is the flag of the same name with dashes
# ----------------------------------------------------------------------------------------


def option(default, help: str, **argparse_kwargs):
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class Options:
    """`group`: the --help group that starts at the field."""

    model: str | None = option(
        None,
        "model preset (default: tiny, unless --hf-checkpoint)",
        choices=sorted(PRESETS),
        group="model and data",
    )
    hf_checkpoint: str | None = option(
        None, "start from this HF Llama directory (config + weights)", metavar="DIR"
    )
    data: str | None = option(
        None,
        "prepared dataset directory (python data.py prepare) (default: the Python stdlib "
        "sources, byte-tokenized, prepared once into .cache/)",
        metavar="DIR",
    )
    tokenizer: str | None = option(
        None, "tokenizer file the data must have been prepared with", metavar="FILE"
    )
    eval_data: str | None = option(
        None,
        "a held-out prepared dataset (the same tokenizer as --data), never trained on, whose "
        "mean loss is logged",
        metavar="DIR",
    )
    eval_interval: int = option(100, "evaluate --eval-data every n steps (and at the end)")
    eval_tokens: int | None = option(
        None, "evaluate the first n tokens of --eval-data (default: all of it)", metavar="N"
    )
    seq_len: int = option(256, "tokens per sequence")
    max_seq_len: int | None = option(
        None, "raise a HF checkpoint's maximum sequence length (context extension)", metavar="N"
    )
    document_mask: bool | None = option(
        None, "no attention across the documents packed in a sequence (default: on for SFT data)"
    )
    batch_tokens: int | None = option(
        None,
        "tokens per optimizer step over all processes, rounded to whole sequences, at least "
        f"one per process or context-parallel group (default: {shard.BATCH_TOKENS:,}; "
        f"{shard.SMALL_MODEL_BATCH_TOKENS:,} for models under 100M parameters); --micro-batch "
        "and --grad-accum follow from it",
        group="batch and schedule",
    )
    micro_batch: int | None = option(
        None,
        "sequences per process (per context-parallel group) per micro-batch (default: planned)",
    )
    grad_accum: int | None = option(
        None, "micro-batches per optimizer step (default: --batch-tokens / the micro-batches)"
    )
    max_steps: int = option(1000, "optimizer steps to train for")
    max_tokens: int | None = option(None, "train for this many tokens instead (sets max steps)")
    lr: float | None = option(
        None,
        "peak learning rate, after the warmup (default, from scratch: 3e-3 under 100M "
        "parameters, 3e-4 up to 10B, 1.5e-4 above; required with --hf-checkpoint, unless "
        "resuming from a checkpoint)",
    )
    min_lr: float | None = option(None, "learning rate at the last step (default: --lr / 10)")
    warmup_steps: int = option(20, "steps of linear warmup from 0")
    decay: str = option(
        "cosine", "decay from lr to min-lr after the warmup", choices=["cosine", "linear"]
    )
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices (not norms)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float | None = option(
        None,
        "clip the gradient's global norm to this, 0: no clipping (default: 1.0; 0 with the "
        "optimizer in backward, which cannot clip)",
    )
    seed: int = option(0, "seed of the initialization and the data order")
    ac: str | None = option(
        None,
        "activation checkpointing: recompute in backward each whole block (full), all of it "
        "but attention (attention), all but the matmuls and attention (selective), or not "
        "(none) (default: planned)",
        choices=list(offload.AC_MODES),
        group="memory plan (planned to fit when not given)",
    )
    ac_every: int = option(1, "checkpoint every n-th block")
    mlp_tile: int | None = option(
        None,
        "run each feed-forward over tiles of this many positions, to bound its memory at "
        "long sequences (0: the whole sequence at once) (default: planned)",
    )
    activation_offload: bool | None = option(
        None, "keep saved activations in host memory (default: planned)"
    )
    offload_blocks: int | None = option(
        None,
        "with --activation-offload, offload only the first N blocks, for when host memory "
        "holds less than all (default: all but the last)",
    )
    cpu_offload: bool | None = option(
        None, "keep parameters, gradients, optimizer state on the CPU (default: planned)"
    )
    optimizer_in_backward: bool | None = option(
        None,
        "AdamW runs on the CPU for each parameter as soon as its gradient is complete in "
        "backward; fp32 weights and AdamW's state stay on the host. Alone: one GPU; with "
        "--cpu-offload: FSDP's host shards, any number of GPUs (default: planned, only where "
        "nothing else fits, since it cannot clip gradients)",
    )
    param_dtype: str | None = option(
        None,
        "compute dtype of parameters (default: bf16 on GPU, fp32 on CPU); master "
        "weights and gradient reduction stay fp32",
        choices=["bf16", "fp32"],
    )
    attention_backend: str = option("auto", "SDPA backend", choices=sorted(SDPA_BACKENDS))
    kernels: bool | None = option(None, "the Triton kernels (default: on with CUDA, off on CPU)")
    fp8: bool = option(
        False,
        "the blocks' projections multiply in FP8 (e4m3, rowwise scales; kernels/fp8.py), "
        "where the blocks are large enough to gain (the plan says); needs a GPU of compute "
        "capability 8.9+ (Ada, Hopper). MFU stays against bf16's peak",
    )
    strategy: str = option(
        "FULL_SHARD", "how FSDP shards", choices=list(shard.STRATEGIES), group="parallelism"
    )
    context_parallel: int = option(
        1,
        "ranks that share each sequence, each holding seq-len / N of its tokens (attention "
        "by an all-to-all over heads; N divides the ranks per node and the heads)",
    )
    lora_rank: int = option(
        0,
        "train LoRA adapters of this rank on a frozen base (0: full fine-tuning)",
        group="LoRA and QLoRA",
    )
    lora_alpha: float = option(16.0, "LoRA's alpha: the adapters' output is scaled by alpha / rank")
    lora_dropout: float = option(0.0, "dropout on the adapters' input")
    lora_targets: str = option(
        "all",
        "the projections that get adapters: all, or a comma list of wq,wk,wv,wo,w1,w2,w3 or "
        "their HF names q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj,up_proj",
    )
    quantize_base: str | None = option(
        None, "store the frozen base's adapted projections in 4 bits (QLoRA)", choices=["nf4"]
    )
    lora_adapter: str | None = option(
        None, "start the adapters from this PEFT adapter directory", metavar="DIR"
    )
    run_dir: str = option(
        "runs/default",
        "metrics.jsonl, checkpoints/, traces",
        metavar="DIR",
        group="checkpoints and export",
    )
    checkpoint_interval: int = option(
        100, "save a checkpoint every n steps and at the end (0: never, e.g. for benchmarks)"
    )
    keep_checkpoints: int = option(2, "keep the last k checkpoints")
    resume: str | None = option(
        None,
        "continue from the latest checkpoint in --run-dir (a fresh start if none), or "
        "from the checkpoint directory given",
        nargs="?",
        const="latest",
        metavar="PATH",
    )
    export_hf: str | None = option(
        None, "at the end, write the model as HF safetensors here", metavar="DIR"
    )
    export_adapter: str | None = option(
        None, "at the end, write the LoRA adapters in PEFT's format here", metavar="DIR"
    )
    log_interval: int = option(10, "log every n steps", group="logging")
    sample_tokens: int = option(
        200, "at the end, print this many tokens generated by the trained model (0: none)"
    )
    profile: int = option(
        0,
        "trace this many steps (after 2 warm ones) with torch.profiler; their logged tokens/s "
        "include the tracing and the writing of the trace (bench/profile_summary.py reads it)",
    )
    memory_snapshot: bool = option(False, "dump a CUDA memory snapshot of the first 3 steps")
    estimate_memory: bool = option(
        False,
        "print the plan for the machine below and its memory estimate, and exit",
        group="the machine to plan for",
    )
    gpu_memory: float | None = option(
        None,
        "GiB of each GPU to plan within (default: its free memory; for --estimate-memory "
        "without a GPU here, 80)",
        metavar="GIB",
    )
    host_memory: float | None = option(
        None,
        "GiB of each node's host memory to plan within (default: its available memory)",
        metavar="GIB",
    )
    world_size: int | None = option(
        None, "processes (GPUs) in all, for --estimate-memory (a run takes torchrun's)"
    )
    nproc_per_node: int | None = option(
        None, "processes per node, for --estimate-memory (default: up to 8 of --world-size)"
    )


class Parser(argparse.ArgumentParser):
    """argparse that suggests a flag for a mistyped one, and takes no abbreviation (--max-step)."""

    def parse_args(self, argv=None, namespace=None):
        argv = sys.argv[1:] if argv is None else argv
        known = [s for action in self._actions for s in action.option_strings]
        for word in argv:
            name = word.split("=")[0]
            if name.startswith("--") and name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                self.error(
                    f"unknown option {name}" + (f": did you mean {close[0]}?" if close else "")
                )
        return super().parse_args(argv, namespace)

    def error(self, message):
        # Under torchrun every process parses the same command line: rank 0 says it once.
        if other_rank():
            exit_after_rank_0(2)
        # One line, as every other error here (argparse would print its usage block first).
        self.exit(2, f"train.py error: {message} (--help lists the options)\n")


def other_rank() -> bool:
    """A torchrun process other than rank 0 (not a single process with a stray RANK)."""
    return shard.torchrun_processes()[0] > 1 and os.environ.get("RANK", "0") != "0"


def exit_after_rank_0(status: int) -> NoReturn:
    """Exits silently after a moment, for rank 0 to say why before torchrun stops every process."""
    time.sleep(2)
    sys.exit(status)


def parse_options(argv: list[str] | None = None) -> tuple[Options, frozenset[str]]:
    """The options, and the names of those on the command line, which resuming keeps."""
    parser = Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    types = {"int": int, "float": float, "str": str}
    group = parser
    for f in dataclasses.fields(Options):
        kwargs = dict(f.metadata, default=f.default)
        if "group" in kwargs:
            group = parser.add_argument_group(kwargs.pop("group"))
        if "default:" not in kwargs["help"]:
            shown = f.default  # 0 and 1 are equal to False and True: not looked up
            if f.default is None or isinstance(f.default, bool):
                shown = {None: "none", False: "off", True: "on"}[f.default]
            kwargs["help"] += f" (default: {shown})"
        base = f.type.removesuffix(" | None")  # a string: this module has postponed annotations
        if base == "bool":  # --x, and --no-x where the default (None) depends on the device
            action = argparse.BooleanOptionalAction if f.default is None else "store_true"
            group.add_argument(shard.flag_name(f.name), action=action, **kwargs)
        else:
            kwargs.setdefault("metavar", "N" if base == "int" else None)
            group.add_argument(shard.flag_name(f.name), type=types[base], **kwargs)
    opts = Options(**vars(parser.parse_args(argv)))
    # Parsed again with every default a marker: what remains unmarked was on the command line.
    not_given = object()
    parser.set_defaults(**{f.name: not_given for f in dataclasses.fields(Options)})
    given = {name for name, v in vars(parser.parse_args(argv)).items() if v is not not_given}
    if {"max_steps", "max_tokens"} <= given:
        parser.error("--max-tokens sets the number of steps: give it or --max-steps, not both")
    return opts, frozenset(given)


def check_options(opts: Options, args: ModelArgs, world_size: int, per_node: int) -> None:
    """The options against each other and the model's shape, before anything is read or joined,
    every problem in one error. `world_size`, `per_node`: torchrun's, or the machine estimated."""
    problems = []
    if opts.model and opts.hf_checkpoint:
        problems.append("give --model or --hf-checkpoint, not both")
    at_least = {
        1: "seq_len max_steps ac_every log_interval keep_checkpoints max_tokens batch_tokens "
        "micro_batch grad_accum world_size nproc_per_node context_parallel eval_interval "
        "eval_tokens max_seq_len",
        0: "warmup_steps profile checkpoint_interval mlp_tile sample_tokens lora_rank",
    }
    for least, names in at_least.items():
        for name in names.split():
            if (value := getattr(opts, name)) is not None and value < least:
                problems.append(f"{shard.flag_name(name)} must be >= {least}, got {value}")
    largest = torch.finfo(torch.float32).max  # AdamW keeps lr and its products in fp32
    for name in ["lr", "min_lr", "grad_clip", "weight_decay"]:
        value = getattr(opts, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            problems.append(f"{shard.flag_name(name)} must be a number >= 0, got {value}")
        elif value is not None and value > largest:
            problems.append(f"{shard.flag_name(name)} must be at most {largest:.3g}, got {value}")
    for name in ["gpu_memory", "host_memory"]:
        value = getattr(opts, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"{shard.flag_name(name)} must be a number of GiB > 0, got {value}")
    for name in ["beta1", "beta2"]:
        if not 0 <= getattr(opts, name) < 1:  # also refuses nan
            problems.append(f"--{name} must be in [0, 1), got {getattr(opts, name)}")
    if not 0 <= opts.seed < 2**63:  # numpy's and torch's generators take no other
        problems.append(f"--seed must be in [0, 2**63), got {opts.seed}")
    if opts.lora_rank and not (math.isfinite(opts.lora_alpha) and opts.lora_alpha > 0):
        problems.append(f"--lora-alpha must be a number > 0, got {opts.lora_alpha}")
    problems += output_clashes(opts)
    if not opts.estimate_memory and (opts.world_size or opts.nproc_per_node):
        problems.append(
            "--world-size and --nproc-per-node describe a machine for --estimate-memory; "
            "a run takes them from torchrun"
        )
    if not opts.lora_rank:
        problems += [
            f"{shard.flag_name(name)} needs --lora-rank > 0"
            for name in ("quantize_base", "lora_adapter", "export_adapter")
            if getattr(opts, name)
        ]
    try:
        lora = lora_config(opts)
    except ValueError as e:
        problems.append(str(e))
    else:  # fp8_ops leaves a 4-bit projection as it is
        if opts.fp8 and lora and lora.quantize_base and set(lora.targets) == set(LORA_TARGETS):
            problems.append(
                "--fp8 multiplies the bf16 projections in e4m3, and --quantize-base nf4 on "
                "--lora-targets all leaves none: drop --fp8, or adapt fewer projections"
            )
    problems += shard.technique_problems(opts, args, world_size, per_node)
    if problems:
        raise UsageError("; ".join(problems))


def output_clashes(opts: Options) -> list[str]:
    """An export that would land on what the run reads or writes: its --run-dir or the
    checkpoints in it, the checkpoint or adapter it starts from, or the other export."""
    where = lambda path: Path(path).resolve()  # noqa: E731
    run_dir = where(opts.run_dir)
    taken = {run_dir: "the --run-dir", run_dir / "checkpoints": "the --run-dir's checkpoints"}
    for name in ("hf_checkpoint", "lora_adapter"):
        if path := getattr(opts, name):
            taken[where(path)] = f"the {shard.flag_name(name)} directory"
    problems = []
    for name in ("export_hf", "export_adapter"):
        if not (given := getattr(opts, name)):
            continue
        out = where(given)
        if clash := taken.get(out) or (
            run_dir / "checkpoints" in out.parents and "inside the --run-dir's checkpoints"
        ):
            problems.append(
                f"{shard.flag_name(name)} {given} is {clash}: the export would replace it"
            )
        taken[out] = f"the {shard.flag_name(name)} directory"
    return problems


def lora_config(opts: Options) -> LoRAConfig | None:
    if opts.lora_rank <= 0:
        return None
    return LoRAConfig(
        rank=opts.lora_rank,
        alpha=opts.lora_alpha,
        dropout=opts.lora_dropout,
        targets=parse_lora_targets(opts.lora_targets),
        quantize_base=opts.quantize_base,
    )


def lr_at(step: int, opts: Options, max_steps: int) -> float:
    """lr at 0-based `step`: warmup to lr at warmup_steps - 1, decay to min_lr at max_steps - 1."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(max_steps - 1 - opts.warmup_steps, 1)
    if opts.decay == "cosine":
        progress = 0.5 * (1 - math.cos(math.pi * progress))
    return opts.lr - (opts.lr - opts.min_lr) * min(progress, 1.0)


def command_line(opts: Options, given: frozenset[str], **changes) -> str:
    """This run's command (the options it was given) with `changes`, runnable from here."""
    opts = dataclasses.replace(opts, **changes)
    world_size, per_node = shard.torchrun_processes()
    script = os.path.relpath(REPO / "train.py")
    words = ["python", script]
    if world_size > 1:
        words = ["torchrun", f"--nproc-per-node={per_node}", script]
        if world_size > per_node:
            words[1:1] = [f"--nnodes={world_size // per_node}"]
    named = given | changes.keys()
    fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(Options) if f.name in named}
    if fields.get("resume") == "latest":  # the bare flag
        fields["resume"] = True
    # False where the flag's default depends on the device: --no-kernels
    return shlex.join(words + shard.flags_of(fields, negated=True))


# ----------------------------------------------------------------------------------------
# Setup: what was given, checked; the plan; the model, its optimizer and the data
# ----------------------------------------------------------------------------------------


def model_args(opts: Options) -> ModelArgs:
    """The model's shape. A preset trained from scratch has no learned length (RoPE's angles
    come from positions): its max_seq_len follows --seq-len; a HF checkpoint's is its own."""
    if opts.hf_checkpoint:
        args = args_from_hf_config(opts.hf_checkpoint)
    else:
        args = ModelArgs.from_name(opts.model or "tiny")
        args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, opts.seq_len))
    if opts.max_seq_len:
        args = dataclasses.replace(args, max_seq_len=opts.max_seq_len)
    if opts.hf_checkpoint and opts.seq_len > args.max_seq_len:
        raise UsageError(
            f"--seq-len {opts.seq_len} is past the {args.max_seq_len} positions "
            f"{opts.hf_checkpoint} was trained on: pass --max-seq-len {opts.seq_len} to extend "
            f"its context"
        )
    args.check_sequence_length(opts.seq_len)
    return args


def default_lr(args: ModelArgs) -> float:
    """Llama 2 and 3's peak pre-training rates by size; models under 100M train stably at 10x."""
    n = args.num_params()
    return 3e-3 if n < 100e6 else 3e-4 if n <= 10e9 else 1.5e-4


def settle_options(opts: Options, args: ModelArgs, plan: shard.Plan) -> Options:
    """The options with lr, min_lr and grad_clip decided (the planned ones: read the plan)."""
    lr = default_lr(args) if opts.lr is None else opts.lr
    min_lr = lr / 10 if opts.min_lr is None else opts.min_lr
    if not 0 <= min_lr <= lr:
        raise UsageError(f"need 0 <= --min-lr <= --lr, got {min_lr} and {lr}")
    check_adamw_range(lr, opts.beta1, opts.weight_decay)
    grad_clip = opts.grad_clip
    if grad_clip is None:
        grad_clip = 0.0 if plan.optimizer_in_backward else 1.0
    return dataclasses.replace(opts, lr=lr, min_lr=min_lr, grad_clip=grad_clip)


def check_adamw_range(lr: float, beta1: float, weight_decay: float) -> None:
    """AdamW computes these products as float32 scalars: past its range, the first step overflows.
    lr and beta1 are the run's final ones: a resumed run may take its checkpoint's."""
    largest = torch.finfo(torch.float32).max
    problems = []
    if lr / (1 - beta1) > largest:
        problems.append(
            f"lr / (1 - beta1), AdamW's first step size, is {lr / (1 - beta1):.3g}: --lr is "
            f"at most {largest * (1 - beta1):.3g} with --beta1 {beta1}"
        )
    if lr * weight_decay > largest:
        problems.append(
            f"lr * weight_decay is {lr * weight_decay:.3g}: --lr is at most "
            f"{largest / weight_decay:.3g} with --weight-decay {weight_decay}"
        )
    if problems:
        raise UsageError(
            f"--lr {lr:g} overflows AdamW's float32 arithmetic: " + "; ".join(problems)
        )


def apply_techniques(
    model: Llama,
    plan: shard.Plan,
    world: shard.World,
    seed: int,
    hf_path: str | None,
    progress: Callable[[int, int], None] | None,
    lora_adapter: str | None = None,
) -> None:
    """Makes the meta-built model the one the plan describes, in the one order in which the
    techniques compose (every other docstring points here):
      0. LoRA (model.apply_lora) swaps in the adapted projections and freezes the rest, so
         that the next steps wrap, shard and fill the final modules;
      1. activation checkpointing (offload.apply_ac) and 2. MLP tiling (a checkpoint per tile)
         precede sharding: the forward recomputed in backward re-gathers through FSDP's hooks;
      3. context parallelism (shard.apply_context_parallel): its all-to-alls go around
         attention inside the blocks, so a recomputed block redoes them;
      4. FSDP (shard.apply_fsdp) shards the blocks as they now are (mixed precision, offload);
      5. materialization last: each rank allocates only its own shards, never the whole model.
    Activation offload wraps each forward instead (train_step); --fp8 picks the ops in build.
    torch.compile of each block (between 2 and 4) measured slower than eager: not offered."""
    if plan.lora:
        apply_lora(model, plan.lora, base_dtype=DTYPES[plan.param_dtype], kernels=plan.kernels)
    offload.apply_ac(model, plan.ac, every=plan.ac_every)
    offload.apply_mlp_tiling(model, plan.mlp_tile)
    shard.apply_context_parallel(model, shard.context_parallel_group(world, plan.context_parallel))
    if plan.optimizer_in_backward and not plan.cpu_offload:
        # One GPU, no FSDP: fp32 on the host, optim.OptimizerInBackward's master weights,
        # their initial values drawn on the GPU so that they equal shard.materialize's there.
        model.to_empty(device="cpu")
        fill_weights(model, seed, world.device, hf_path, progress=progress)
        return
    mesh = shard.build_mesh(plan.strategy, world)
    shard.apply_fsdp(
        model,
        mesh,
        plan.strategy,
        cpu_offload=plan.cpu_offload,
        param_dtype=DTYPES[plan.param_dtype],
        # The optimizer in backward reads each gradient in FSDP's hook: into pinned shards,
        # torch < 2.13 copies it without blocking, and the hook could read it too early.
        # Plain memory also spares the pinned allocator's rounding up, for slower copies.
        pin_memory=not plan.optimizer_in_backward,
    )
    shard.materialize(
        model, world, seed, hf_path, plan.cpu_offload, progress, plan.lora, lora_adapter
    )


@dataclass
class Run:
    """What setup makes and the loop uses."""

    opts: Options
    given: frozenset[str]
    args: ModelArgs
    plan: shard.Plan
    world: shard.World
    model: Llama
    optimizer: optim.ShardedAdamW | optim.OptimizerInBackward
    loader: PackedLoader
    run_dir: Path
    checkpointer: shard.Checkpointer
    evaluate: Callable[[], tuple[float, int]] | None  # --eval-data's loss and labelled tokens
    start_step: int
    max_steps: int
    text_tokenizer: Tokenizer | None
    export_tokenizer: HFTokenizer | None
    log: Callable
    lock: object  # run_dir/.lock, held open as long as the run lives (shard.lock_run_dir)


# The options that name what a checkpoint was made for (the data too: the loader's cursor
# counts its samples); another value given is refused (check_resumable, or the loader).
FIXED_BY_CHECKPOINT = ("model", "hf_checkpoint", "max_seq_len", "seq_len", "strategy",
                       "lora_rank", "lora_alpha", "lora_targets", "data", "tokenizer")  # fmt: skip
# The options of the run's course, which may change when given again.
KEPT_ON_RESUME = ("lr", "min_lr", "warmup_steps", "decay", "weight_decay", "beta1", "beta2",
                  "seed", "document_mask", "lora_dropout", "quantize_base")  # fmt: skip
# An option given keeps its partner from being taken: --model and --hf-checkpoint are one
# choice, a --tokenizer file belongs to its --data, and the saved min_lr may be the saved lr / 10.
GIVEN_WITH = {"model": "hf_checkpoint", "hf_checkpoint": "model", "data": "tokenizer",
              "lr": "min_lr"}  # fmt: skip


def taken_on_resume(opts: Options, given: frozenset[str], saved: dict) -> dict:
    """The options a resumed run takes from `saved` where they differ: a bare --resume goes on."""
    options = saved["options"]
    not_taken = given | {GIVEN_WITH[name] for name in given & GIVEN_WITH.keys()}
    return {
        name: options[name]
        for name in FIXED_BY_CHECKPOINT + KEPT_ON_RESUME
        if name not in not_taken and name in options and options[name] != getattr(opts, name)
    }


def resume_options(
    opts: Options,
    given: frozenset[str],
    saved: dict,
    data_parallel: int,
    taken: dict,
    log: Callable,
) -> Options:
    """The resumed options, `taken` in them: `saved`'s global batch and schedule unless given,
    so that another number of processes (`data_parallel`: see loader_of) splits the same batch."""
    saved_tokens, saved_steps = saved["run"]["tokens_per_step"], saved["run"]["max_steps"]
    said = []
    if taken:
        said.append(
            "the checkpoint's " + ", ".join(f"{shard.flag_name(k)} {v}" for k, v in taken.items())
        )
    if given & {"batch_tokens", "micro_batch", "grad_accum"}:
        said.append(f"global batch of {saved_tokens:,} tokens/step changed as given")
    else:
        if saved_tokens % (data_parallel * opts.seq_len):
            raise UsageError(
                f"the checkpoint's global batch of {saved_tokens:,} tokens does not split into "
                f"rows of {opts.seq_len} over {data_parallel} data-parallel ranks: pass "
                f"--batch-tokens to choose another"
            )
        opts = dataclasses.replace(opts, batch_tokens=saved_tokens)
        said.append(f"global batch of {saved_tokens:,} tokens/step kept")
    if given & {"max_steps", "max_tokens"}:
        steps = f"--max-tokens {opts.max_tokens}" if opts.max_tokens else opts.max_steps
        said.append(f"schedule {saved_steps} -> {steps} steps as given")
    else:
        opts = dataclasses.replace(opts, max_steps=saved_steps, max_tokens=None)
        said.append(f"schedule of {saved_steps} steps kept")
    log("resuming: " + "; ".join(said) + " (--batch-tokens, --max-steps change them)")
    return opts


def estimate(opts: Options) -> None:
    """--estimate-memory: the plan, and its memory, for the machine the flags describe (a
    GPU machine: the GPU defaults of --kernels and --param-dtype), checked as a run is."""
    args = model_args(opts)
    machine = shard.machine_to_estimate(
        opts.world_size, opts.nproc_per_node, opts.gpu_memory, opts.host_memory
    )
    check_options(opts, args, machine.world_size, machine.nproc_per_node)
    plan = shard.make_plan(opts, args, machine, bool(opts.document_mask), lora=lora_config(opts))
    print(plan.format())


def check_given(opts: Options, args: ModelArgs, lora: LoRAConfig | None, resuming: bool) -> None:
    """Everything given, checked before anything is written, in files every rank sees alike
    (a shared filesystem): all ranks raise the same error, and none waits on another."""
    run_dir = Path(opts.run_dir)
    shard.check_run_dir(run_dir)
    if not opts.resume:  # refuses an earlier run's checkpoints (a resume read them in setup)
        shard.find_checkpoint(None, run_dir / "checkpoints", log=print)
    if opts.hf_checkpoint:
        check_hf_checkpoint(args, opts.hf_checkpoint)
    if opts.lora_adapter:
        check_peft_adapter(args, lora, opts.lora_adapter)
    if opts.export_hf:
        HF_EXPORT.check(opts.export_hf)
    if opts.export_adapter:
        PEFT_ADAPTER.check(opts.export_adapter)
    exports = [shard.flag_name(n) for n in ("export_hf", "export_adapter") if getattr(opts, n)]
    if opts.resume and not resuming and exports:
        # A requeued run may start afresh, but an export asked of a resume means that run's.
        raise UsageError(
            f"--resume found no checkpoint in {run_dir / 'checkpoints'}, so "
            f"{' and '.join(exports)} would export weights trained from the start: give the "
            f"--run-dir whose checkpoints to continue, or leave out --resume"
        )
    if opts.hf_checkpoint and opts.lr is None:  # a resumed run has taken its checkpoint's
        raise UsageError(
            f"--lr is required with --hf-checkpoint: a fine-tune's rate depends on its data and "
            f"length (full fine-tunes of 7-8B models use 5e-6 to 2e-5; this model has "
            f"{params_text(args.num_params())} parameters)"
        )


def check_this_machine(opts: Options) -> None:
    """The options that need a GPU, where there is none (shard.init_distributed takes any)."""
    if torch.cuda.is_available():
        if opts.fp8 and torch.cuda.get_device_capability() < (8, 9):
            raise UsageError(
                f"--fp8 needs FP8 matmuls (compute capability 8.9+: Ada, Hopper); this "
                f"{torch.cuda.get_device_name()} has {torch.cuda.get_device_capability()}"
            )
        return
    if opts.fp8:
        raise UsageError("--fp8 needs a GPU with FP8 matmuls (Ada, Hopper); this run has none")
    if opts.kernels and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError("--kernels on the CPU needs TRITON_INTERPRET=1 (slow); use --no-kernels")
    if opts.memory_snapshot:
        raise UsageError("--memory-snapshot records CUDA allocations; this run has no GPU")
    if opts.gpu_memory is not None:
        raise UsageError(
            "--gpu-memory sets how much of the GPU a run plans within; this run has no GPU "
            "(--estimate-memory plans for a machine you are not on)"
        )


def open_run_data(
    opts: Options, args: ModelArgs, is_main: bool, log: Callable
) -> tuple[RunData, TokenDataset | None]:
    """The training data with its tokenizers (data.open_data), and --eval-data's, if given."""
    sizes = (args.vocab_size, args.max_seq_len)
    run_data = open_data(
        opts.data, opts.tokenizer, opts.hf_checkpoint, *sizes, opts.seq_len, is_main
    )
    export_tokenizer = run_data.export_tokenizer
    if opts.export_hf and not (export_tokenizer and export_tokenizer.has_tokenizer()):
        log(
            f"note: the export will have no tokenizer: pass --tokenizer with the file that "
            f"prepared {run_data.dataset.path} ({run_data.dataset.meta['tokenizer']}) to "
            f"include it"
        )
    if not opts.eval_data:
        return run_data, None
    return run_data, open_eval_data(opts.eval_data, *sizes, opts.seq_len, run_data.dataset)


def setup(opts: Options, given: frozenset[str]) -> Run:
    """The run, ready for its first step, in the order the module docstring gives."""
    log = (lambda *a, **k: None) if other_rank() else print
    # A resumed run's checkpoint first (read from its headers alone): the checks and the plan
    # below are of the options it takes from it, the model among them. A new run's directory
    # is looked at after its options (check_given): a typo is told before an earlier run.
    run_dir = Path(opts.run_dir)
    checkpoints = run_dir / "checkpoints"
    found = shard.find_checkpoint(opts.resume, checkpoints, log) if opts.resume else None
    resume_from, saved = found or (None, None)
    taken = taken_on_resume(opts, given, saved) if saved else {}
    opts = dataclasses.replace(opts, **taken)
    args = model_args(opts)
    check_options(opts, args, *shard.torchrun_processes())
    check_this_machine(opts)
    world = shard.init_distributed()
    torch.manual_seed(opts.seed)
    lora = lora_config(opts)
    check_given(opts, args, lora, resuming=saved is not None)
    run_data, held_out = open_run_data(opts, args, world.is_main, log)
    dataset, export_tokenizer = run_data.dataset, run_data.export_tokenizer
    run_record = {
        "model": dataclasses.asdict(args),
        "seq_len": opts.seq_len,
        "tokenizer": dataset.meta["tokenizer"],
        "strategy": opts.strategy,
        "world_size": world.world_size,
        "lora": dataclasses.asdict(lora) if lora else None,
        "context_parallel": opts.context_parallel,
    }
    damaged = []
    if saved:
        shard.check_resumable(saved["run"], json.loads(json.dumps(run_record)))
        damaged = shard.check_no_newer_checkpoints(checkpoints, saved["step"], resume_from)
        data_parallel = world.world_size // opts.context_parallel
        opts = resume_options(opts, given, saved, data_parallel, taken, log)

    # The plan before anything is loaded: a run that cannot fit stops here, saying what would.
    mask_documents = dataset.is_sft if opts.document_mask is None else opts.document_mask
    longest = dataset.meta.get("longest_document", opts.seq_len)
    machine = shard.this_machine(opts.gpu_memory, opts.host_memory, world)
    attended = attended_per_token(dataset, opts.seq_len) if mask_documents else None
    plan = shard.make_plan(
        opts, args, machine, mask_documents, lora=lora, long_documents=longest >= LONG_DOCUMENT,
        attended_per_token=attended,
    )  # fmt: skip
    opts = settle_options(opts, args, plan)
    log(plan.format())
    model, optimizer = build(opts, args, plan, world, resumed=resume_from is not None, log=log)
    max_steps = opts.max_steps
    if opts.max_tokens:
        max_steps = math.ceil(opts.max_tokens / plan.tokens_per_step)
    log_start(opts, args, plan, world, dataset, max_steps, log)
    loader = loader_of(dataset, plan, world, seed=opts.seed)
    evaluate_held_out = held_out_evaluation(opts, held_out, plan, world, model)
    checkpointer = shard.Checkpointer(
        checkpoints,
        opts.checkpoint_interval,
        opts.keep_checkpoints,
        world,
        record={
            "run": {**run_record, "tokens_per_step": plan.tokens_per_step, "max_steps": max_steps},
            "options": dataclasses.asdict(opts),
        },
    )
    step = 0
    if saved:  # the weights, optimizer state, data cursor and random state
        step = checkpointer.restore(resume_from, saved, optimizer, loader)
        by = plural(saved["run"]["world_size"], "process")
        log(f"resumed from {resume_from} at step {step} (saved by {by}, now {world.world_size})")
    elif opts.resume:
        start = f"from {opts.hf_checkpoint}" if opts.hf_checkpoint else "from random weights"
        log(f"no checkpoint in {checkpoints}: starting {start}")
    # Everything given is checked and loaded: from here on the run writes into its directory.
    lock = shard.lock_run_dir(run_dir, world.is_main)
    if world.is_main:
        shard.set_aside(damaged, log)
        if step < max_steps:  # a finished run's plan.json keeps the peaks it measured
            write_json(run_dir / "plan.json", plan.to_json())
    return Run(
        opts, given, args, plan, world, model, optimizer, loader, run_dir, checkpointer,
        evaluate_held_out, step, max_steps, run_data.text_tokenizer, export_tokenizer, log, lock,
    )  # fmt: skip


def build(opts: Options, args: ModelArgs, plan: shard.Plan, world, resumed: bool, log):
    """The model the plan describes, loaded or initialized, and its optimizer. Resuming reads
    the checkpoint's weights later, but a LoRA run's frozen base here: the checkpoint lacks it."""
    with torch.device("meta"):
        ops = triton_ops() if plan.kernels else REFERENCE_OPS
        if plan.fp8_projections:
            ops = fp8_ops(ops, plan.kernels)
        model = Llama(args, ops, opts.attention_backend, plan.document_mask)
    hf_path = opts.hf_checkpoint if not resumed or plan.lora else None
    adapter = opts.lora_adapter if not resumed else None
    progress = show_progress(f"loading {hf_path}") if hf_path and world.is_main else None
    apply_techniques(model, plan, world, opts.seed, hf_path, progress, adapter)
    if plan.lora:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log(
            f"LoRA r={plan.lora.rank} (alpha {plan.lora.alpha:g}) on "
            f"{','.join(plan.lora.targets)}"
            f"{', the base in NF4 (QLoRA)' if plan.lora.quantize_base else ''}: "
            f"{params_text(trained)} parameters train, the base's "
            f"{params_text(args.num_params())} are frozen"
        )
    betas, decay = (opts.beta1, opts.beta2), opts.weight_decay
    if plan.optimizer_in_backward and plan.cpu_offload:  # on FSDP's shards on the host
        return model, optim.ShardedOptimizerInBackward(model, opts.lr, betas, decay)
    if plan.optimizer_in_backward:
        dtype = DTYPES[plan.param_dtype]
        return model, optim.OptimizerInBackward(model, world.device, dtype, opts.lr, betas, decay)
    # Fused on the GPU, and on the CPU with --cpu-offload, where the step runs then.
    fused = world.device.type == "cuda" or plan.cpu_offload
    return model, optim.ShardedAdamW(model, betas, decay, opts.grad_clip, fused)


def log_start(opts, args, plan, world, dataset, max_steps: int, log: Callable) -> None:
    frozen = plan.lora is not None
    flops_per_token = args.flops_per_token(opts.seq_len, frozen)
    layout = "optimizer in backward" if plan.optimizer_in_backward else plan.strategy
    if plan.context_parallel > 1:
        layout += f", context parallel {plan.context_parallel}"
    masked = plan.document_mask
    log(
        f"model {opts.hf_checkpoint or opts.model or 'tiny'}: {params_text(args.num_params())} "
        f"params, {flops_per_token / 1e6:.1f} MFLOP/token ({4 if frozen else 6}N + 6LSd"
        f"{'; MFU counts attention within documents' if masked else ''}"
        f"{'; MFU against the bf16 peak, matmuls in FP8' if plan.fp8_projections else ''}) | "
        f"data {dataset.path}: {dataset.n_tokens:,} tokens ({dataset.meta['tokenizer']}"
        f"{', attention masked between documents' if masked else ''}) | "
        f"{plural(world.world_size, 'process')} x {world.device.type}, "
        f"{layout}, {plan.param_dtype} params, kernels {'on' if plan.kernels else 'off'} | "
        f"{plan.tokens_per_step:,} tokens/step, {max_steps} steps"
    )


# ----------------------------------------------------------------------------------------
# The step, and what the loop asks after it: log? evaluate? save? stop?
# ----------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One step's numbers, on the device and unread, so a step waits for no GPU work."""

    loss_sum: torch.Tensor  # of this rank's labelled tokens
    n_labels: torch.Tensor  # labelled tokens of the step on all ranks
    grad_norm: torch.Tensor  # before clipping
    optimizer_s: float  # host seconds in the optimizer's step


def train_step(
    model: Llama,
    optimizer: optim.ShardedAdamW | optim.OptimizerInBackward,
    micro_batches: Iterable[Batch],
    n_micro_batches: int,
    n_labels: torch.Tensor,
    offload_activations: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> StepResult:
    """One optimizer step over `n_micro_batches` micro-batches, taken one at a time (a step of
    many never holds them all). The loss is the mean over the step's labelled tokens on all
    ranks, not of per-micro-batch means: micro-batches hold different numbers of labelled
    tokens. `n_labels`: this rank's labelled tokens in the step, counted before it
    (PackedLoader.labels_ahead)."""
    dist.all_reduce(n_labels)
    n_labels = n_labels.clamp(min=1)
    loss_sum = torch.zeros((), device=n_labels.device)
    for i, b in enumerate(micro_batches):
        if n_micro_batches > 1:  # FSDP reduces the gradients in the last backward only
            model.set_requires_gradient_sync(i == n_micro_batches - 1)
        with offload_activations():
            loss = model(b.tokens, b.labels, b.positions, "sum", b.document_starts)
        # shard.apply_fsdp makes FSDP sum gradients over ranks (divide factor 1), so dividing
        # by the global count gives the gradient of the global mean.
        (loss / n_labels).backward()
        loss_sum += loss.detach()
    started = time.perf_counter()
    grad_norm = optimizer.step()
    return StepResult(loss_sum, n_labels, grad_norm, time.perf_counter() - started)


class MetricsLog:
    """Decides which steps are logged and writes them to stdout and metrics.jsonl (README.md).
    Values are read only on logged and saved steps (a read waits for the GPU), checking each
    step since the last read for a non-finite loss or gradient norm before a checkpoint is saved."""

    def __init__(self, run: Run):
        self.run = run
        self.path = run.run_dir / "metrics.jsonl"
        self.peak = peak_flops(run.world.device)
        self.nonfinite = torch.zeros((), dtype=torch.int32, device=run.world.device)
        self.attended = torch.zeros((), dtype=torch.float64, device=run.world.device)
        self.checked_step = self.logged_step = run.start_step
        self.started = self.logged_at = time.perf_counter()
        self.last: StepResult | None = None
        # metrics.jsonl only grows: a resume marks its start; a line cut short stays, ended here.
        if run.world.is_main:
            damaged, cut = damaged_lines(self.path)
            if damaged:
                lines = ", ".join(map(str, damaged[:5])) + (", ..." * (len(damaged) > 5))
                run.log(
                    f"{self.path}: {plural(len(damaged), 'line')} not a JSON record "
                    f"(line {lines}), left as found; readers skip them"
                )
            with open(self.path, "a", opener=no_follow) as f:
                if cut:
                    f.write("\n")
                if resumed_from := run.checkpointer.last:
                    f.write(json.dumps({"resumed_from": str(resumed_from), "step": run.start_step}))
                    f.write("\n")

    def counting(self, micro_batches: Iterator[Batch]) -> Iterator[Batch]:
        """The micro-batches, each counted into the pairs attention attended (MFU)."""
        plan = self.run.plan
        for b in micro_batches:
            self.attended += attended_pairs(b.positions, plan.document_mask, plan.seq_len)
            yield b

    def add(self, result: StepResult) -> None:
        self.last = result
        norm = result.grad_norm.to(self.run.world.device, non_blocking=True)  # no host sync
        finite = result.loss_sum.isfinite() & norm.isfinite()
        self.nonfinite += ~finite

    def evaluating(self, step: int, stopping: bool) -> bool:
        due = step % self.run.opts.eval_interval == 0 or step == self.run.max_steps
        return self.run.evaluate is not None and due and not stopping

    def logging(self, step: int, stopping: bool) -> bool:
        due = step % self.run.opts.log_interval == 0 or step == self.run.max_steps or stopping
        return due or self.evaluating(step, stopping)

    def read(self, step: int, last_saved: Path | None) -> tuple[float, float]:
        dist.all_reduce(self.last.loss_sum)
        dist.all_reduce(self.nonfinite, op=dist.ReduceOp.MAX)
        loss = (self.last.loss_sum / self.last.n_labels).item()
        grad_norm = self.last.grad_norm.item()
        if self.nonfinite.item():
            raise FloatingPointError(
                f"step {step}: loss {loss}, gradient norm {grad_norm}: a non-finite loss "
                f"or gradient norm in steps {self.checked_step + 1}-{step}. Stopped after its "
                f"update; the last checkpoint is {last_saved or 'none'}"
            )
        self.checked_step = step
        return loss, grad_norm

    def write(self, step: int, lr: float, loss: float, grad_norm: float, stopping: bool) -> None:
        run = self.run
        world, max_steps, tokens_per_step = run.world, run.max_steps, run.plan.tokens_per_step
        now, steps = time.perf_counter(), step - self.logged_step
        tokens_per_s = steps * tokens_per_step / (now - self.logged_at)
        dist.all_reduce(self.attended)
        flops = run.args.training_flops(
            steps * tokens_per_step, self.attended.item(), run.plan.lora is not None
        )
        self.attended.zero_()
        flops_per_device = flops / (now - self.logged_at) / world.world_size
        on_gpu = world.device.type == "cuda"
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "optimizer_s": self.last.optimizer_s,
            "tokens": step * tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / world.world_size,
            "model_tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / self.peak if self.peak else None,
            "peak_gpu_mem_gib": (
                torch.cuda.max_memory_allocated(world.device) / 2**30 if on_gpu else None
            ),
            "host_peak_rss_gib": shard.host_peak_rss_gib(),
            "elapsed_s": now - self.started,
            "eta_s": (now - self.started) / (step - run.start_step) * (max_steps - step),
            "eval_loss": None,
            "eval_tokens": None,
        }
        if self.evaluating(step, stopping):  # after the step's timing, left out of the next
            record["eval_loss"], record["eval_tokens"] = run.evaluate()
            now = time.perf_counter()
        if world.is_main:
            print(format_record(record, max_steps), flush=True)
            with open(self.path, "a", opener=no_follow) as f:
                f.write(json.dumps(record) + "\n")
        self.logged_at, self.logged_step = now, step


def damaged_lines(path: Path) -> tuple[list[int], bool]:
    """The numbers (from 1) of `path`'s lines that are not a JSON object, and whether its last
    is cut short (no newline). Read a line at a time: a long run's log may be large."""
    damaged, line = [], b"\n"
    if not path.is_file():
        return damaged, False
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                if line.strip() and not isinstance(json.loads(line), dict):
                    damaged.append(number)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
                damaged.append(number)
    return damaged, not line.endswith(b"\n")


def evaluate(model: Llama, batches: Callable[[], Iterator[Batch]], device) -> tuple[float, int]:
    """The mean loss over `batches()`' labelled tokens on all ranks, and their count (under
    no_grad: no activations kept, and the fused loss computes no gradients)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, labelled tokens
    with torch.no_grad():
        for b in batches():
            b = b.to(device, non_blocking=True)
            loss = model(b.tokens, b.labels, b.positions, "sum", b.document_starts)
            totals += torch.stack([loss.double(), (b.labels != IGNORE_INDEX).sum().double()])
    model.train()
    dist.all_reduce(totals)
    loss_sum, count = totals.tolist()
    return loss_sum / max(count, 1), int(count)


def held_out_evaluation(
    opts: Options, held_out: TokenDataset | None, plan: shard.Plan, world: shard.World, model
) -> Callable[[], tuple[float, int]] | None:
    """--eval-data's evaluation: its rows (--eval-tokens' or all), in order, split as training's."""
    if held_out is None:
        return None
    eval_loader = loader_of(held_out, plan, world)
    groups, n = world.world_size // plan.context_parallel, eval_loader.num_samples
    samples = min(-(-opts.eval_tokens // opts.seq_len), n) if opts.eval_tokens else n
    if samples < groups:
        raise UsageError(
            f"--eval-data {opts.eval_data} gives {plural(samples, 'sequence')} of {opts.seq_len} "
            f"tokens{' within --eval-tokens' if opts.eval_tokens else ''}: fewer than the "
            f"{groups} data-parallel groups, which take one at least each"
        )
    return functools.partial(evaluate, model, lambda: eval_loader.in_order(samples), world.device)


def loader_of(
    dataset: TokenDataset, plan: shard.Plan, world: shard.World, **kwargs
) -> PackedLoader:
    """This rank's rows: each group of context_parallel ranks reads its own, each rank a slice."""
    cp = plan.context_parallel
    return PackedLoader(
        dataset, plan.seq_len, plan.micro_batch, world.rank // cp, world.world_size // cp,
        pin_memory=world.device.type == "cuda", context_rank=world.rank % cp,
        context_parallel=cp, **kwargs,
    )  # fmt: skip


def format_record(r: dict, max_steps: int) -> str:
    line = f"step {r['step']:>{len(str(max_steps))}}/{max_steps} | loss {r['loss']:.4f}"
    if r["eval_loss"] is not None:
        line += f" | eval loss {r['eval_loss']:.4f} ({r['eval_tokens']:,} tokens)"
    line += (
        f" | lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s "
        f"({r['tokens_per_s_per_device']:,.0f}/device) | optimizer {r['optimizer_s']:.2f} s"
    )
    if r["mfu"] is not None:
        line += f" | mfu {100 * r['mfu']:.1f}%"
    if r["peak_gpu_mem_gib"] is not None:
        line += f" | gpu peak {r['peak_gpu_mem_gib']:.1f} GiB"
    return line + (
        f" | host peak rss {r['host_peak_rss_gib']:.1f} GiB | {hms(r['elapsed_s'])} elapsed, "
        f"eta {hms(r['eta_s'])}"
    )


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Instruments:
    """The one-off measurements beside the loop: memory peaks, --memory-snapshot, --profile."""

    def __init__(self, run: Run):
        self.run = run
        self.profiler = None
        self.trace = run.run_dir / f"trace-rank{run.world.rank}.json"
        if run.opts.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if run.world.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                # The first steps carry one-off costs (allocator growth, compilation).
                schedule=torch.profiler.schedule(wait=1, warmup=1, active=run.opts.profile),
                on_trace_ready=lambda prof: prof.export_chrome_trace(str(self.trace)),
                record_shapes=True,
            )
            self.profiler.start()
        if run.opts.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)

    def after(self, step: int) -> None:
        run, steps = self.run, step - self.run.start_step
        if self.profiler:
            self.profiler.step()
        if steps == 2 or step == run.max_steps and steps < 2:  # AdamW's state exists by then
            measured = shard.measured_memory(steps, run.world.device)
            run.log(run.plan.format_measured(measured))
            if run.world.is_main:
                write_json(run.run_dir / "plan.json", {**run.plan.to_json(), "measured": measured})
        if run.opts.memory_snapshot and (steps == 3 or step == run.max_steps and steps < 3):
            snapshot = run.run_dir / f"memory-snapshot-rank{run.world.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            run.log(f"wrote {snapshot} (open it at https://pytorch.org/memory_viz)")

    def close(self) -> None:
        if self.profiler:
            self.profiler.stop()
            if self.trace.exists():
                self.run.log(f"wrote {self.trace} (open it in https://ui.perfetto.dev)")


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C, SLURM's preemption, torchrun passing either on) stop the
    run after this step, with a checkpoint; a second one, at once. One within a second of the
    first is the same: a Ctrl-C reaches every worker, and torchrun passes it on again."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, is_main: bool, last_checkpoint: Callable[[], Path | None]):
        self.is_main = is_main
        self.last_checkpoint = last_checkpoint
        self.received: str | None = None
        self.received_at = 0.0
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self.received_at = name, time.monotonic()
            if self.is_main:  # every rank gets the signal; one says so
                to_stderr(
                    f"{name}: stopping after this step, with a checkpoint; again to stop at once"
                )
        elif time.monotonic() - self.received_at > 1.0:
            if self.is_main:
                last = self.last_checkpoint()
                to_stderr(f"{name} again: stopped at once; the last checkpoint is {last or 'none'}")
            os._exit(EXIT_STOPPED)  # as stopped after a step: the last checkpoint resumes

    def agreed(self) -> bool:
        """Whether any rank was asked to stop, alike on all: one all-reduce of a CPU integer
        (gloo, well under a millisecond on one node), which does not wait for the GPU."""
        stop = torch.tensor([self.received is not None], dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        return bool(stop)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# How long a worker whose torchrun died may take to stop on its own, as torchrun itself waits
# for the workers it sends SIGTERM (torch.distributed.elastic's close(timeout=30)).
LAUNCHER_GONE_GRACE_S = 30.0


def stop_when_launcher_dies(poll_s: float = 1.0) -> None:
    """A worker whose torchrun agent died alone (kill -9, the OOM killer) is adopted by another
    process and would train on, holding the run's lock: a thread sends it torchrun's SIGTERM.
    Alive LAUNCHER_GONE_GRACE_S later (stuck in a collective), it exits, any checkpoint whole."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        # Each rank that sees it says so: the first stops them all (StopSignals agrees).
        rank = os.environ.get("RANK", "0")
        to_stderr(f"rank {rank}: torchrun (pid {launcher}) is gone: stopping after this step")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(LAUNCHER_GONE_GRACE_S)
        while shard.SAVING.is_set():  # the stop's checkpoint: let it be written whole
            time.sleep(poll_s)
        to_stderr(f"rank {rank}: torchrun is gone and this rank has not stopped: exiting")
        os._exit(EXIT_STOPPED)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


# ----------------------------------------------------------------------------------------
# The terminal
# ----------------------------------------------------------------------------------------


def to_stderr(line: str) -> None:
    """One line on stderr in one write (print's newline is another): processes' lines stay whole."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def show_progress(what: str) -> Callable[[int, int], None]:
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        end = "\n" if done == total else ""
        elapsed = hms(time.perf_counter() - start)
        print(f"\r{what}: {done}/{total} tensors, {elapsed}", end=end, file=sys.stderr, flush=True)

    return report


def printable(text: str) -> str:
    """`text` with control characters but newlines and tabs escaped (\\x1b, \\r): a barely
    trained model samples any bytes, which raw could move the cursor or restyle the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


# ----------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------


def train(opts: Options, given: frozenset[str] = frozenset()) -> bool:
    """Trains as `opts` say; `given`: the options on the command line (parse_options),
    which resuming keeps. Returns whether the run reached its last step, or had (False: it
    stopped on a signal, with a checkpoint)."""
    if opts.estimate_memory:
        estimate(opts)
        return True
    run = setup(opts, given)
    if run.start_step >= run.max_steps:  # a finished run resumed: its exports, nothing to train
        finish(run, run.start_step)
        dist.destroy_process_group()
        return True
    model, optimizer, plan, device = run.model, run.optimizer, run.plan, run.world.device
    offload_activations = functools.partial(
        offload.activation_offload, model, plan.activation_offload, blocks=plan.offload_blocks
    )
    batches = iter(run.loader)
    stop = StopSignals(run.world.is_main, lambda: run.checkpointer.last)
    metrics, instruments = MetricsLog(run), Instruments(run)
    step, stopping = run.start_step, False
    model.train()
    while step < run.max_steps and not stopping:
        lr = lr_at(step, run.opts, run.max_steps)
        optimizer.set_lr(lr)  # before backward, where the optimizer in backward updates
        n_labels = torch.tensor(run.loader.labels_ahead(plan.grad_accum))
        micro_batches = (
            next(batches).to(device, non_blocking=True) for _ in range(plan.grad_accum)
        )
        result = train_step(
            model, optimizer, metrics.counting(micro_batches), plan.grad_accum,
            n_labels.to(device, non_blocking=True), offload_activations,
        )  # fmt: skip
        step += 1
        metrics.add(result)
        instruments.after(step)

        stopping = stop.agreed()
        logging = metrics.logging(step, stopping)
        saving = run.checkpointer.due(step, run.max_steps, stopping)
        if logging or saving:
            loss, grad_norm = metrics.read(step, run.checkpointer.last)
        if logging:
            metrics.write(step, lr, loss, grad_norm, stopping)
        if saving:
            run.log(f"saved {run.checkpointer.save(step, optimizer, run.loader)}")
            # A signal during the save stops here: the step in progress was this one.
            stopping = stopping or stop.agreed()
    stop.restore()
    instruments.close()
    finish(run, step)
    dist.destroy_process_group()
    return step == run.max_steps


def finish(run: Run, step: int) -> None:
    """On a signal, how to resume; at the last step, the exports, a sample and where all is.
    A command is printed only where a checkpoint holds the run's last weights to continue."""
    opts, log, last = run.opts, run.log, run.checkpointer.last
    saved_now = last is not None and shard.step_of(last) == step
    if step < run.max_steps:
        stopped = f"stopped at step {step} of {run.max_steps} on a signal"
        if saved_now:
            log(f"{stopped}; saved {last}. Resume with:\n  {resume_command(run)}")
        elif last:
            log(
                f"{stopped}; saved nothing (--checkpoint-interval 0): the last checkpoint is "
                f"{last}. Resume from there with:\n  {resume_command(run)}"
            )
        else:
            log(f"{stopped}; no checkpoint (--checkpoint-interval 0): nothing to resume from")
        return
    if opts.export_hf:
        dtype = DTYPES[run.plan.param_dtype]
        shard.export_hf(run.model, run.args, opts.export_hf, dtype, run.export_tokenizer, run.world)
        log(f"exported {opts.export_hf} ({run.plan.param_dtype})")
    if opts.export_adapter:
        lora, base_model = run.plan.lora, opts.hf_checkpoint
        shard.export_adapter(run.model, run.args, lora, opts.export_adapter, base_model, run.world)
        log(f"exported the LoRA adapter to {opts.export_adapter}")
    if step > run.start_step:  # a finished run's sample was printed when it finished
        print_sample(run)
    log(f"metrics: {run.run_dir / 'metrics.jsonl'}")
    if step == run.start_step:
        log(
            f"the run had finished at step {step} of {run.max_steps} ({last}): nothing to "
            f"train; --max-steps or --max-tokens with --resume train further"
        )
    elif saved_now:
        log(f"checkpoints: {last.parent} (the last: {last.name})")
        log(f"resume:  {resume_command(run)}")
        if not opts.export_hf:
            export = resume_command(run, export_hf=str(run.run_dir / "hf"))
            log(f"export:  {export}")
    else:
        kept = f"exported to {opts.export_hf}" if opts.export_hf else "not kept"
        log(f"no checkpoint of step {step} (--checkpoint-interval 0): its weights are {kept}")


def resume_command(run: Run, **changes) -> str:
    """The command that continues from the last checkpoint: --resume, with its path if not ours."""
    last = run.checkpointer.last
    own = last.parent.resolve() == run.checkpointer.root.resolve()
    return command_line(run.opts, run.given, resume="latest" if own else str(last), **changes)


def print_sample(run: Run) -> None:
    tokenizer, n = run.text_tokenizer, run.opts.sample_tokens
    if not n:
        return
    if tokenizer is None:
        run.log(
            f"no sample: the data's tokenizer ({run.loader.dataset.meta['tokenizer']}) was not "
            f"given; pass --tokenizer with the file that prepared the data to see {n} tokens "
            f"of the trained model"
        )
        return
    # BOS alone is not shown; a chat prompt is shown whole (some templates' first token is
    # BOS). A tokenizer without BOS (Qwen's) starts each document after the one before's EOS.
    start = "BOS" if tokenizer.bos_id is not None else "EOS"
    prompt, shown, after = [tokenizer.bos_id if start == "BOS" else tokenizer.eos_id], [], start
    if run.loader.dataset.is_sft:
        prompt = tokenizer.chat_prompt([{"role": "user", "content": "Hello! What can you do?"}])
        shown, after = prompt, "a user turn"
    run.model.eval()
    allowed = min(tokenizer.vocab_size, run.args.vocab_size)
    sample = generate(run.model, prompt, n, 0.8, allowed, stop_id=tokenizer.eos_id)
    run.log(f"\na sample of the trained model (after {after}, temperature 0.8):\n{'-' * 60}")
    run.log(printable(tokenizer.decode(shown + sample)) + f"\n{'-' * 60}")


def main(argv: list[str] | None = None) -> None:
    # Segments that grow in place: less memory reserved, at the same speed (bench/RESULTS.md,
    # "Pinned pieces and expandable segments"). Read at CUDA's first use, which is later.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    opts, given = parse_options(argv)
    # Outside the loop (whose StopSignals save first), SIGTERM stops the run as Ctrl-C does.
    # Not under torchrun: a rank waiting in a collective would not end on it.
    previous = signal.getsignal(signal.SIGTERM)
    if shard.torchrun_processes()[0] == 1:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun's
        stop_when_launcher_dies()
    try:
        finished = train(opts, given)
    except KeyboardInterrupt:
        if not other_rank():  # Ctrl-C under torchrun reaches every rank
            # Before the first step the command as given starts again; after the last, --resume.
            saved = shard.list_checkpoints(Path(opts.run_dir) / "checkpoints")
            again = command_line(opts, given, **({"resume": "latest"} if saved else {}))
            to_stderr(
                f"stopped outside the training steps; the checkpoints are as they were: {again}"
            )
        sys.exit(EXIT_STOPPED)
    except Exception as e:
        # What was given, and a non-finite step, fail every rank alike: rank 0 says it once.
        # Anything else may be one rank's own, or a bug: that rank says it, with its traceback.
        alike = isinstance(e, (UsageError, FloatingPointError))
        if not alike:
            sys.stderr.write(traceback.format_exc())
        quiet = other_rank() and alike
        if not quiet:
            rank = os.environ.get("RANK", "0")
            one_of_several = shard.torchrun_processes()[0] > 1 and not alike
            to_stderr(f"train.py error{f' (rank {rank})' if one_of_several else ''}: {e}")
        if dist.is_initialized():
            dist.destroy_process_group()
        if quiet:
            exit_after_rank_0(1)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not finished:
        sys.exit(EXIT_STOPPED)


def leave(status: int) -> NoReturn:
    """Ends the process at once, its output flushed: torch's DTensor sharding cache (C++) keeps
    the process group alive past destroy_process_group, and its gloo threads at times abort the
    interpreter's shutdown ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    try:
        main()
        status = 0
    except SystemExit as end:
        if not isinstance(end.code, int | None):  # a message: Python's own exit prints it
            raise
        status = end.code or 0
    leave(status)

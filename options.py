"""The command line, resolved once into what a run uses. In order: the options (one `Options`
dataclass, each field the flag of its name) and their parser; the checks of the options against
each other, the model and this machine; what a resumed run takes from its checkpoint; last,
`resolve`, which turns the command line (and a checkpoint's recorded options) into the final
options, the model's numbers and the plan before anything is built: each file's checks of what
it owns (the plan's rules, a dataset, a checkpoint) run from here.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import difflib
import functools
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch

import shard
from attention import CUDA_ONLY_BACKENDS, LONG_DOCUMENT, SDPA_BACKENDS
from config_json import args_from_hf_config
from data import RunData, TokenDataset, mean_document_pairs, open_data, open_eval_data
from files import UsageError, params_text
from hf import (
    HF_EXPORT,
    PEFT_ADAPTER,
    check_hf_checkpoint,
    check_peft_adapter,
    peft_adapter_settings,
    peft_prefix,
    weights_fingerprint,
)
from lora import LoRAConfig, check_lora_targets, parse_lora_targets
from metrics import report_to_problems, reporters_asked
from model import PRESETS, ModelArgs
from offload import AC_MODES
from plan import (
    BATCH_TOKENS,
    PARAM_DTYPES,
    PLANNED,
    SMALL_MODEL_BATCH_TOKENS,
    STRATEGIES,
    Machine,
    Plan,
    flag_name,
    flags_of,
    fp8_candidates,
    machine_to_estimate,
    make_plan,
    plan_problems,
)

REPO = Path(__file__).resolve().parent
DEFAULT_MODEL = "tiny"  # the preset trained without --model or --hf-checkpoint
GRAD_CLIP = 1.0  # the gradient norm clipped at without --grad-clip (Resolved.grad_clip)


def option(default, help: str, **argparse_kwargs):
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class Options:
    """`group`: the --help group that starts at the field."""

    model: str | None = option(
        None,
        f"model preset (default: {DEFAULT_MODEL}, unless --hf-checkpoint)",
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
        None,
        "the tokenizer the data must have been prepared with: a HF checkpoint or tokenizer "
        "directory, or its file (default: --hf-checkpoint's)",
        metavar="PATH",
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
    router_aux_loss_coef: float | None = option(
        None,
        "add a mixture-of-experts model's load-balancing loss at this weight, 0: not at all "
        "(default: as its config says: output_router_logits, router_aux_loss_coef)",
        metavar="W",
    )
    document_mask: bool | None = option(
        None, "no attention across the documents packed in a sequence (default: on for SFT data)"
    )
    batch_tokens: int | None = option(
        None,
        "tokens per optimizer step over all processes, rounded to whole sequences, at least "
        f"one per process or context-parallel group (default: {BATCH_TOKENS:,}; "
        f"{SMALL_MODEL_BATCH_TOKENS:,} for models under 100M parameters); --micro-batch "
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
    max_tokens: int | None = option(
        None, "train on this many tokens in all instead (sets max steps; counted over resumes)"
    )
    lr: float | None = option(
        None,
        "peak learning rate, after the warmup; required with --hf-checkpoint, unless "
        "resuming from a checkpoint (default: from scratch, 3e-3 under 100M "
        "parameters, 3e-4 up to 10B, 1.5e-4 above)",
    )
    min_lr: float | None = option(None, "learning rate at the last step (default: --lr / 10)")
    warmup_steps: int = option(20, "steps of linear warmup from 0")
    decay: str = option(
        "cosine", "decay from lr to min-lr after the warmup", choices=["cosine", "linear"]
    )
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices (not norms or biases)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float | None = option(
        None,
        f"clip the gradient's global norm to this, 0: no clipping (default: {GRAD_CLIP}; 0 "
        "with the optimizer in backward, which cannot clip)",
    )
    seed: int = option(0, "seed of the initialization and the data order")
    ac: str | None = option(
        None,
        "activation checkpointing: recompute in backward each whole block (full), all of it "
        "but attention (attention), all but the matmuls and attention (selective), or not "
        "(none) (default: planned)",
        choices=list(AC_MODES),
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
        choices=list(PARAM_DTYPES),
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
        "FULL_SHARD", "how FSDP shards", choices=list(STRATEGIES), group="parallelism"
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
        "their HF names q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj,up_proj; on an MoE "
        "model w1,w2,w3 take none, and experts_w13,experts_w2 (PEFT's target_parameters "
        "mlp.experts.gate_up_proj,mlp.experts.down_proj) adapt each expert (not in all: "
        "all,experts_w13,experts_w2 adds them)",
    )
    quantize_base: str | None = option(
        None, "store the frozen base's adapted projections in 4 bits (QLoRA)", choices=["nf4"]
    )
    lora_adapter: str | None = option(
        None,
        "start the adapters from this PEFT adapter directory (its rank, alpha, targets and "
        "dropout unless given)",
        metavar="DIR",
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
    report_to: str = option(
        "none",
        "also send each logged step's metrics.jsonl record, and the run's options and plan, to "
        "tensorboard (--run-dir's tensorboard/), wandb (Weights & Biases), or both: a comma "
        'list, each needing its package (pip install ".[report]")',
        metavar="NAMES",
    )
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


# Hugging Face TrainingArguments' and TRL's names of the options that longtune names otherwise,
# each with longtune's, for the suggestion an unknown option gets.
HF_NAMES = {
    "learning_rate": "lr", "lr_scheduler_type": "decay", "max_grad_norm": "grad_clip",
    "num_train_epochs": "max_tokens", "epochs": "max_tokens", "max_seq_length": "seq_len",
    "max_length": "seq_len", "per_device_train_batch_size": "micro_batch",
    "gradient_accumulation_steps": "grad_accum", "output_dir": "run_dir",
    "resume_from_checkpoint": "resume", "save_steps": "checkpoint_interval",
    "logging_steps": "log_interval", "eval_steps": "eval_interval",
}  # fmt: skip


def did_you_mean(name: str, known: list[str], spell: Callable[[str], str]) -> str:
    """The ": did you mean X?" of the unknown option `name`: longtune's of a Hugging Face
    name, or of the name with - for _ or _ for - (`spell` writes a field's name as `known`
    are written), else the closest of `known`, if any."""
    field = name.lstrip("-").replace("-", "_")
    ours = HF_NAMES.get(field, field)
    if ours == "max_tokens" and field != ours:  # epochs are counted in tokens
        return f": did you mean {spell(ours)} (the epochs x the dataset's tokens)?"
    close = [spell(ours)] if spell(ours) in known else difflib.get_close_matches(name, known, n=1)
    return f": did you mean {close[0]}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse that suggests a flag for a mistyped one, and takes no abbreviation (--max-step)."""

    def parse_args(self, argv=None, namespace=None):
        argv = sys.argv[1:] if argv is None else argv
        known = [s for action in self._actions for s in action.option_strings]
        for word in argv:
            name = word.split("=")[0]
            if name.startswith("--") and name not in known:
                self.error(f"unknown option {name}" + did_you_mean(name, known, flag_name))
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
    """The options, and the names of those given (on the command line, or in --config's
    file), which resuming keeps."""
    argv = sys.argv[1:] if argv is None else argv
    parser = options_parser()
    namespace, given = parse_given(parser, argv)
    if namespace.config:
        try:
            values = read_config(namespace.config)
        except UsageError as e:
            parser.error(str(e))
        # A flag given here replaces the file's value, and its partner's (GIVEN_WITH).
        values = {k: v for k, v in values.items() if k not in with_partners(given)}
        namespace, given = parse_given(parser, config_flags(values) + argv)
    if {"max_steps", "max_tokens"} <= given:
        parser.error("--max-tokens sets the number of steps: give it or --max-steps, not both")
    del namespace.config
    return Options(**vars(namespace)), given


def options_parser() -> Parser:
    about = "Train a Llama: on a CPU or a GPU, or one process per GPU under torchrun"
    parser = Parser(description=about, allow_abbrev=False)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of these options, each key an option's name with underscores "
        "(seq_len = 4096); flags given here win over it. A run writes its options, resolved, "
        "to --run-dir's config.toml",
    )
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
        if base == "bool":  # --x and --no-x, which replaces a --config file's x = true
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            kwargs.setdefault("metavar", "N" if base == "int" else None)
            group.add_argument(flag_name(f.name), type=types[base], **kwargs)
    return parser


def parse_given(parser: Parser, argv: list[str]) -> tuple[argparse.Namespace, frozenset[str]]:
    """`argv` parsed, and the options it names: parsed again into a namespace where each
    option holds a marker (argparse sets no default over a value already there), an option
    whose marker was replaced was given."""
    fields = [f.name for f in dataclasses.fields(Options)]
    not_given = object()
    marked = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(fields, not_given)))
    given = frozenset(name for name in fields if getattr(marked, name) is not not_given)
    return parser.parse_args(argv), given


def read_config(path: str) -> dict:
    """--config's file: TOML whose keys are Options' field names, each value of its type."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise UsageError(
            "--config reads TOML with Python 3.11's tomllib: use Python 3.11+"
        ) from None
    try:
        with open(path, "rb") as f:
            data = f.read()
        # A byte-order mark (as editors on Windows write) is not TOML; offsets count it.
        text = data.removeprefix(codecs.BOM_UTF8)
        values = tomllib.loads(text.decode())
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--config {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
            f"{e.start + len(data) - len(text)}): TOML files are UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path} is not valid TOML: {e}") from None
    types = {f.name: f.type.removesuffix(" | None") for f in dataclasses.fields(Options)}
    expected = {"bool": bool, "int": int, "float": (int, float), "str": str}
    said = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}
    for key, value in values.items():
        if key not in types:
            hint = did_you_mean(key.replace("-", "_"), list(types), str)
            raise UsageError(f"--config {path}: unknown option {key!r}{hint}")
        kind = types[key]
        if not isinstance(value, expected[kind]) or isinstance(value, bool) != (kind == "bool"):
            raise UsageError(f"--config {path}: {key} must be {said[kind]}, got {value!r}")
    return values


def config_flags(values: dict) -> list[str]:
    """The command line's words for a config file's values (as --x=value: a value may start
    with a dash)."""
    words = []
    for name, value in values.items():
        if isinstance(value, bool):
            words.append(flag_name(name if value else f"no_{name}"))
        else:
            words.append(f"{flag_name(name)}={value}")
    return words


def config_toml(opts: Options, given: frozenset[str]) -> str:
    """The options as a --config file (--run-dir's config.toml): what the run is, not how it
    was started (--resume is left out), nor where it exported to (the exports are left out, as
    a bare --resume leaves them: a run of the file with another --run-dir would write over
    this run's), nor what --lora-adapter's file gave (left_to_adapter: a run of the file takes
    them from its own adapter). None, the default of options without a value, is left out, and
    --max-steps where --max-tokens sets the steps. Strings as JSON writes them, which TOML's
    basic strings read."""
    values, from_adapter = dataclasses.asdict(opts), left_to_adapter(opts, given)
    for name in ("resume", "export_hf", "export_adapter", *from_adapter):
        del values[name]
    if opts.max_tokens:
        del values["max_steps"]
    lines = [
        "# A run's options, resolved: python train.py --config FILE (plan.json: its plan)",
        "# --export-hf and --export-adapter left out, as a bare --resume leaves them (a run of "
        "this file would write over this run's exports): give them again",
    ]
    if from_adapter:
        lines.append(
            f"# {', '.join(map(flag_name, from_adapter))} left out: a run of this file, as this "
            f"one, takes each from lora_adapter's adapter_config.json where it gives one, else "
            f"its default"
        )
    for name, value in values.items():
        if isinstance(value, bool):
            lines.append(f"{name} = {str(value).lower()}")
        elif isinstance(value, str):
            lines.append(f"{name} = {json.dumps(value, ensure_ascii=False)}")
        elif value is not None:
            lines.append(f"{name} = {value!r}")
    return "\n".join(lines) + "\n"


def check_options(opts: Options, args: ModelArgs, world_size: int, ranks_per_node: int) -> None:
    """The options against each other and the model's shape, before anything is read or joined,
    every problem in one error. `world_size`, `ranks_per_node`: the processes in all and on a
    node, torchrun's or the estimated machine's (opts.nproc_per_node is only the estimate's
    flag, None unless given)."""
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
                problems.append(f"{flag_name(name)} must be >= {least}, got {value}")
    largest = torch.finfo(torch.float32).max  # AdamW keeps lr and its products in fp32
    for name in ["lr", "min_lr", "grad_clip", "weight_decay", "router_aux_loss_coef"]:
        value = getattr(opts, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            problems.append(f"{flag_name(name)} must be a number >= 0, got {value}")
        elif value is not None and value > largest:
            problems.append(f"{flag_name(name)} must be at most {largest:.3g}, got {value}")
    for name in ["gpu_memory", "host_memory"]:
        value = getattr(opts, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"{flag_name(name)} must be a number of GiB > 0, got {value}")
    for name in ["beta1", "beta2"]:
        if not 0 <= getattr(opts, name) < 1:  # also refuses nan
            problems.append(f"--{name} must be in [0, 1), got {getattr(opts, name)}")
    if not 0 <= opts.seed < 2**63:  # numpy's and torch's generators take no other
        problems.append(f"--seed must be in [0, 2**63), got {opts.seed}")
    if opts.lora_rank and not (math.isfinite(opts.lora_alpha) and opts.lora_alpha > 0):
        problems.append(f"--lora-alpha must be a number > 0, got {opts.lora_alpha}")
    problems += output_clashes(opts)
    problems += report_to_problems(opts.report_to)
    if not opts.estimate_memory and (opts.world_size or opts.nproc_per_node):
        problems.append(
            "--world-size and --nproc-per-node describe a machine for --estimate-memory; "
            "a run takes them from torchrun"
        )
    if not opts.lora_rank:
        problems += [
            f"{flag_name(name)} needs --lora-rank > 0"
            for name in ("quantize_base", "export_adapter")
            if getattr(opts, name)
        ]
    if not opts.lora_rank and opts.lora_adapter:  # else its r was taken (taken_from_adapter)
        adapter = Path(opts.lora_adapter) / "adapter_config.json"
        problems.append(f"--lora-adapter: no {adapter} with the adapter's r (its rank)")
    try:
        lora = lora_config(opts)
        if lora:
            check_lora_targets(args, lora)
    except ValueError as e:
        problems.append(str(e))
    else:  # fp8_ops leaves a 4-bit projection as it is
        if opts.fp8 and not fp8_candidates(args, lora):
            problems.append(
                f"--fp8 multiplies the bf16 projections in e4m3, and --quantize-base nf4 on "
                f"--lora-targets {opts.lora_targets} leaves none: drop --fp8, or adapt fewer "
                f"projections"
            )
    problems += technique_problems(opts, args, world_size, ranks_per_node)
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
            taken[where(path)] = f"the {flag_name(name)} directory"
    problems = []
    for name in ("export_hf", "export_adapter"):
        if not (given := getattr(opts, name)):
            continue
        out = where(given)
        if clash := taken.get(out) or (
            run_dir / "checkpoints" in out.parents and "inside the --run-dir's checkpoints"
        ):
            problems.append(f"{flag_name(name)} {given} is {clash}: the export would replace it")
        taken[out] = f"the {flag_name(name)} directory"
    return problems


# --lora-adapter's settings (hf.peft_adapter_settings) -> the options that give them.
ADAPTER_OPTIONS = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
                   "lora_targets": "targets"}  # fmt: skip


def left_to_adapter(opts: Options, given: frozenset[str]) -> list[str]:
    """The options --lora-adapter's adapter_config.json gives where it says them: those not
    given (a --config file's values count as given)."""
    return [name for name in ADAPTER_OPTIONS if name not in given] if opts.lora_adapter else []


def taken_from_adapter(opts: Options, args: ModelArgs, given: frozenset[str]) -> dict:
    """The options a new run takes from --lora-adapter's adapter_config.json where not given,
    as PeftModel.from_pretrained reads it. A rank, alpha or targets given otherwise is refused,
    named (the adapter's weights are of its own); a --lora-dropout given replaces its dropout,
    a choice of the training, as on a resume (KEPT_ON_RESUME). (A resumed run's adapters are
    its checkpoint's, and so are these options: taken_on_resume.)"""
    if not opts.lora_adapter:
        return {}
    settings = peft_adapter_settings(args, opts.lora_adapter, opts.hf_checkpoint)
    taken, problems, left = {}, [], left_to_adapter(opts, given)
    for name, key in ADAPTER_OPTIONS.items():
        if key not in settings:
            continue
        ours = parse_lora_targets(opts.lora_targets) if key == "targets" else getattr(opts, name)
        theirs = ",".join(settings[key]) if key == "targets" else settings[key]
        if name in left:
            taken[name] = theirs
        elif ours != settings[key] and key != "dropout":
            problems.append(
                f"{flag_name(name)} {getattr(opts, name)} differs from the adapter's {theirs}"
            )
    if problems:
        raise UsageError(
            f"--lora-adapter {opts.lora_adapter}: "
            + "; ".join(problems)
            + " (leave the flags out to take the adapter's)"
        )
    return taken


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


def command_line(opts: Options, given: frozenset[str], **changes) -> str:
    """This run's command (the options it was given) with `changes`, runnable from here."""
    opts = dataclasses.replace(opts, **changes)
    world_size, nproc_per_node = shard.torchrun_processes()
    script = os.path.relpath(REPO / "train.py")
    words = ["python", script]
    if world_size > 1:
        words = ["torchrun", f"--nproc-per-node={nproc_per_node}", script]
        if world_size > nproc_per_node:
            words[1:1] = [f"--nnodes={world_size // nproc_per_node}"]
    named = given | changes.keys()
    fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(Options) if f.name in named}
    if fields.get("resume") == "latest":  # the bare flag
        fields["resume"] = True
    # False where the flag's default depends on the device: --no-kernels
    return shlex.join(words + flags_of(fields, negated=True))


def model_name(opts: Options) -> str:
    """The model the options name: --hf-checkpoint's directory, or the preset."""
    return opts.hf_checkpoint or opts.model or DEFAULT_MODEL


def model_args(opts: Options) -> ModelArgs:
    """The model's shape. A preset trained from scratch has no learned length (RoPE's angles
    come from positions): its max_seq_len follows --seq-len; a HF checkpoint's is its own."""
    if opts.hf_checkpoint:
        args = args_from_hf_config(opts.hf_checkpoint)
    else:
        args = ModelArgs.from_name(model_name(opts))
        args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, opts.seq_len))
    if opts.max_seq_len and opts.hf_checkpoint and opts.max_seq_len < args.max_seq_len:
        raise UsageError(
            f"--max-seq-len {opts.max_seq_len} is below the {args.max_seq_len} positions "
            f"{opts.hf_checkpoint} was trained on: it extends a context, never shortens one"
        )
    if opts.max_seq_len:
        args = dataclasses.replace(args, max_seq_len=opts.max_seq_len)
    if opts.seq_len > args.max_seq_len and opts.max_seq_len:
        raise UsageError(f"--seq-len {opts.seq_len} is past --max-seq-len {opts.max_seq_len}")
    if opts.seq_len > args.max_seq_len:
        default = " (the default)" if opts.seq_len == Options.seq_len else ""
        raise UsageError(
            f"--seq-len {opts.seq_len}{default} is past the {args.max_seq_len} positions "
            f"{opts.hf_checkpoint} was trained on: pass --seq-len {args.max_seq_len}, or "
            f"--max-seq-len {opts.seq_len} to extend its context"
        )
    if opts.router_aux_loss_coef is not None and not args.moe_layers:
        raise UsageError("--router-aux-loss-coef is for mixture-of-experts models")
    if opts.router_aux_loss_coef is not None:
        coef = opts.router_aux_loss_coef
        args = dataclasses.replace(args, router_aux_loss=coef > 0, router_aux_loss_coef=coef)
    return args


def default_lr(args: ModelArgs) -> float:
    """Llama 2 and 3's peak pre-training rates by size; models under 100M train stably at 10x."""
    n = args.num_params()
    return 3e-3 if n < 100e6 else 3e-4 if n <= 10e9 else 1.5e-4


def settle_options(opts: Options, args: ModelArgs) -> Options:
    """The options with lr and min_lr decided (the planned ones: read the plan). grad_clip
    stays as asked: its default follows the machine's plan (Resolved.grad_clip), which a
    resumed run on another machine makes anew."""
    lr = default_lr(args) if opts.lr is None else opts.lr
    min_lr = lr / 10 if opts.min_lr is None else opts.min_lr
    if not 0 <= min_lr <= lr:
        raise UsageError(f"need 0 <= --min-lr <= --lr, got {min_lr} and {lr}")
    check_adamw_range(lr, opts.beta1, opts.weight_decay)
    return dataclasses.replace(opts, lr=lr, min_lr=min_lr)


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


# The options that name what a checkpoint was made for (the data too: the loader's cursor
# counts its samples); another value given is refused (check_resumable, or the loader).
FIXED_BY_CHECKPOINT = ("model", "hf_checkpoint", "max_seq_len", "seq_len", "strategy",
                       "lora_rank", "lora_alpha", "lora_targets", "data", "tokenizer")  # fmt: skip


# The options of the run's course, which may change when given again (the seed may not:
# resume_options). Those of the machine (the memory techniques, --kernels, the attention
# backend, context parallelism) are planned anew; the exports are given again, as a branch
# off the run (another --run-dir) would write over the run's own.
KEPT_ON_RESUME = ("lr", "min_lr", "warmup_steps", "decay", "weight_decay", "beta1", "beta2",
                  "grad_clip", "seed", "document_mask", "lora_dropout", "quantize_base",
                  "router_aux_loss_coef", "param_dtype", "fp8", "eval_data", "eval_interval",
                  "eval_tokens", "checkpoint_interval", "keep_checkpoints", "log_interval",
                  "sample_tokens", "report_to")  # fmt: skip


# An option given keeps its partner from being taken (from a checkpoint, or a --config file):
# --model and --hf-checkpoint are one choice, a --tokenizer file belongs to its --data, the
# saved min_lr may be the saved lr / 10, and --max-tokens sets the steps.
GIVEN_WITH = {"model": "hf_checkpoint", "hf_checkpoint": "model", "data": "tokenizer",
              "lr": "min_lr", "max_steps": "max_tokens", "max_tokens": "max_steps"}  # fmt: skip


def with_partners(given: frozenset[str]) -> frozenset[str]:
    return given | {GIVEN_WITH[name] for name in given & GIVEN_WITH.keys()}


def taken_on_resume(opts: Options, given: frozenset[str], saved: dict) -> dict:
    """The options a resumed run takes from `saved` where they differ: a bare --resume goes on."""
    options = saved["options"]
    if "report_to" in options:  # an older run's "tensorboard,none" (allowed then): its reporters
        options = options | {"report_to": ",".join(reporters_asked(options["report_to"])) or "none"}
    return {
        name: options[name]
        for name in FIXED_BY_CHECKPOINT + KEPT_ON_RESUME
        if name not in with_partners(given)
        and name in options
        and options[name] != getattr(opts, name)
    }


def resume_options(
    opts: Options,
    given: frozenset[str],
    saved: dict,
    data_parallel: int,
    log: Callable,
) -> Options:
    """The resumed options: `saved`'s global batch and schedule unless given, so that another
    number of processes (`data_parallel`: see loader_of) splits the same batch."""
    saved_batch, saved_steps = saved["run"]["tokens_per_step"], saved["run"]["max_steps"]
    if opts.seed != (seed := saved["options"].get("seed", opts.seed)):  # given: another
        raise UsageError(
            f"--seed {opts.seed}: a resumed run goes on with its checkpoint's data order and "
            f"random state (seed {seed}); start a new run for another seed"
        )
    said = [
        f"the checkpoint's {flag_name(k)} not kept: give it again to export"
        for k in ("export_hf", "export_adapter")
        if saved["options"].get(k) and not getattr(opts, k)
    ]
    if given & {"batch_tokens", "micro_batch", "grad_accum"}:
        said.append(f"global batch of {saved_batch:,} tokens/step changed as given")
    else:
        if saved_batch % (data_parallel * opts.seq_len):
            raise UsageError(
                f"the checkpoint's global batch of {saved_batch:,} tokens does not split into "
                f"rows of {opts.seq_len} over {data_parallel} data-parallel ranks: pass "
                f"--batch-tokens to choose another"
            )
        opts = dataclasses.replace(opts, batch_tokens=saved_batch)
        said.append(f"global batch of {saved_batch:,} tokens/step kept")
    if given & {"max_steps", "max_tokens"}:
        asked = f"--max-tokens {opts.max_tokens}" if opts.max_tokens else f"{opts.max_steps} steps"
        said.append(f"schedule of {saved_steps} steps -> {asked} as given")
    else:
        opts = dataclasses.replace(opts, max_steps=saved_steps, max_tokens=None)
        said.append(f"schedule of {saved_steps} steps kept")
    log("resuming: " + "; ".join(said) + " (--batch-tokens, --max-steps change them)")
    return opts


def estimate(opts: Options, given: frozenset[str]) -> None:
    """--estimate-memory: the plan, and its memory, for the machine the flags describe (a
    GPU machine: the GPU defaults of --kernels and --param-dtype), checked as a run is."""
    args = model_args(opts)
    opts = dataclasses.replace(opts, **taken_from_adapter(opts, args, given))
    machine = machine_to_estimate(
        opts.world_size, opts.nproc_per_node, opts.gpu_memory, opts.host_memory
    )
    check_options(opts, args, machine.world_size, machine.nproc_per_node)
    # Without --data: causal rows, their documents possibly long (Plan's defaults).
    dataset = TokenDataset(opts.data) if opts.data else None
    if dataset is not None:
        dataset.check(args.vocab_size, opts.seq_len)
    print(plan_of(opts, args, machine, dataset).format())


def data_fields(opts: Options, args: ModelArgs, dataset: TokenDataset | None) -> dict:
    """The plan's fields the data decides: documents masked (by default where it is SFT), any
    long enough for the causal kernel, and the pairs a token attends on average over the
    layers (as windows cut some), for the step time. Without data: a causal row's."""
    mask = bool(dataset and dataset.is_sft) if opts.document_mask is None else opts.document_mask
    if dataset is None:
        return dict(document_mask=mask)
    longest = dataset.meta.get("longest_document", opts.seq_len)
    fields = dict(document_mask=mask, long_documents=longest >= LONG_DOCUMENT)
    if mask:
        per_window = functools.partial(mean_document_pairs, dataset, opts.seq_len)
        fields["attended_per_token"] = args.mean_over_layers(per_window)
    return fields


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
        check_peft_adapter(args, lora, opts.lora_adapter, opts.hf_checkpoint)
    if opts.export_hf:
        HF_EXPORT.check(opts.export_hf)
    if opts.export_adapter:
        PEFT_ADAPTER.check(opts.export_adapter)
    exports = [flag_name(n) for n in ("export_hf", "export_adapter") if getattr(opts, n)]
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
    if opts.attention_backend in CUDA_ONLY_BACKENDS:  # SDPA would fail at the first step
        raise UsageError(
            f"--attention-backend {opts.attention_backend} is a CUDA kernel; this run has no "
            f"GPU (auto, flash and math run on the CPU)"
        )
    if opts.gpu_memory is not None:
        raise UsageError(
            "--gpu-memory sets how much of the GPU a run plans within; this run has no GPU "
            "(--estimate-memory plans for a machine you are not on)"
        )


def open_run_data(
    opts: Options, args: ModelArgs, is_main: bool, log: Callable
) -> tuple[RunData, TokenDataset | None]:
    """The training data with its tokenizers (data.open_data), and --eval-data's, if given."""
    vocab = args.vocab_size
    run_data = open_data(
        opts.data, opts.tokenizer, opts.hf_checkpoint, vocab, opts.seq_len, is_main
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
    return run_data, open_eval_data(opts.eval_data, vocab, opts.seq_len, run_data.dataset)


def options_plan(opts: Options, machine: Machine, **fixed) -> tuple[Plan, dict]:
    """What the options fix of the plan, with `fixed` (the data's and LoRA's fields), and
    the planned fields they set (`wanted`: the planner keeps them)."""
    on_gpu = machine.gpu_gib is not None
    base = Plan(
        opts.seq_len, world_size=machine.world_size, nproc_per_node=machine.nproc_per_node,
        strategy=opts.strategy, ac_every=opts.ac_every, context_parallel=opts.context_parallel,
        param_dtype=opts.param_dtype or ("bf16" if on_gpu else "fp32"),
        kernels=on_gpu if opts.kernels is None else opts.kernels, fp8=opts.fp8, **fixed,
    )  # fmt: skip
    return base, {k: getattr(opts, k) for k in PLANNED if getattr(opts, k) is not None}


def technique_problems(
    opts: Options, args: ModelArgs, world_size: int, nproc_per_node: int
) -> list[str]:
    """plan_problems of the plan the options ask for on `world_size` processes,
    `nproc_per_node` a node. Whether LoRA is on matters, not how: check_options checks how,
    and LoRA options it refuses build no LoRAConfig, hence this stand-in."""
    lora = LoRAConfig(opts.lora_rank, opts.lora_alpha) if opts.lora_rank > 0 else None
    machine = Machine(world_size, nproc_per_node, gpu_gib=None, host_gib=0.0)
    base, wanted = options_plan(opts, machine, lora=lora)
    return plan_problems(args, dataclasses.replace(base, **wanted), opts.grad_clip)


def plan_of(
    opts: Options, args: ModelArgs, machine: Machine, dataset: TokenDataset | None = None
) -> Plan:
    """The options' plan on `machine` (plan.make_plan), with LoRA's fields and the data's
    (data_fields: without `dataset`, causal rows)."""
    fixed = data_fields(opts, args, dataset)
    base, wanted = options_plan(opts, machine, lora=lora_config(opts), **fixed)
    return make_plan(args, machine, base, wanted, opts.batch_tokens, opts.grad_clip)


@dataclass(frozen=True)
class Resolved:
    """What the command line (and a resumed run's checkpoint) come to, every check passed."""

    # Final: the checkpoint's where taken, lr and min_lr decided. As recorded (checkpoints,
    # config.toml), so not the run's steps or clip where --max-tokens or the plan decide them:
    # max_steps and grad_clip below.
    opts: Options
    given: frozenset[str]
    args: ModelArgs
    plan: Plan
    world: shard.World
    run_data: RunData
    held_out: TokenDataset | None  # --eval-data's
    max_steps: int  # --max-steps, or the steps --max-tokens leaves at this run's batch
    run_record: dict  # a checkpoint's record of the run (shard.check_resumable compares it)
    resume_from: Path | None
    saved: dict | None  # resume_from's train_state
    start_tokens: int  # trained on before this run (shard.tokens_trained), at its batch sizes
    damaged: list[Path]  # checkpoints newer than resume_from, which failed their check
    # Where PEFT finds the decoder on the base's model (hf.peft_prefix), read before the run:
    # --export-adapter names the adapter's tensors by it, and the base may move meanwhile.
    peft_prefix: str
    grad_clip: float  # --grad-clip, or its default on this plan


def as_flags(taken: dict) -> str:
    """Options taken from elsewhere (a checkpoint, an adapter), as the log line names them."""
    return ", ".join(f"{flag_name(k)} {v}" for k, v in taken.items())


def resolve(asked: Options, given: frozenset[str], log: Callable) -> Resolved:
    """The options as the run uses them, resolved in one place before anything is built. A
    resumed run's checkpoint first (read from its headers alone): the checks and the plan are
    of the options it takes from it, the model among them. A new run's directory is looked at
    after its options (check_given): a typo is told before an earlier run. Then the process
    group, the data, and the plan: a run that cannot fit stops here, saying what would."""
    checkpoints = Path(asked.run_dir) / "checkpoints"
    found = shard.find_checkpoint(asked.resume, checkpoints, log) if asked.resume else None
    resume_from, saved, damaged = found or (None, None, [])
    taken = taken_on_resume(asked, given, saved) if saved else {}
    if taken:  # before the checks: a problem with one of them is said after it
        log(f"resuming: the checkpoint's {as_flags(taken)}")
    chosen = dataclasses.replace(asked, **taken)
    args = model_args(chosen)
    if not saved and (from_adapter := taken_from_adapter(chosen, args, given)):
        log(f"the --lora-adapter's {as_flags(from_adapter)}")
        chosen = dataclasses.replace(chosen, **from_adapter)
    check_options(chosen, args, *shard.torchrun_processes())
    check_this_machine(chosen)
    world = shard.init_distributed()
    lora = lora_config(chosen)
    check_given(chosen, args, lora, resuming=saved is not None)
    run_data, held_out = open_run_data(chosen, args, world.is_main, log)
    dataset = run_data.dataset
    run_record = {
        "model": dataclasses.asdict(args),
        "seq_len": chosen.seq_len,
        "tokenizer": dataset.meta["tokenizer"],
        "dataset": dataset.identity(),
        "strategy": chosen.strategy,
        "world_size": world.world_size,
        "lora": dataclasses.asdict(lora) if lora else None,
        "context_parallel": chosen.context_parallel,
        # The base a LoRA checkpoint resumes on, read again from --hf-checkpoint.
        "base": weights_fingerprint(chosen.hf_checkpoint)
        if lora and chosen.hf_checkpoint
        else None,
    }
    planned = chosen
    if saved:
        shard.check_resumable(saved["run"], json.loads(json.dumps(run_record)))
        data_parallel = world.world_size // chosen.context_parallel
        planned = resume_options(chosen, given, saved, data_parallel, log)
    machine = shard.this_machine(planned.gpu_memory, planned.host_memory, world)
    plan = plan_of(planned, args, machine, dataset)
    opts = settle_options(planned, args)
    grad_clip = opts.grad_clip
    if grad_clip is None:  # the optimizer in backward cannot clip
        grad_clip = 0.0 if plan.optimizer_in_backward else GRAD_CLIP
    max_steps, seen = opts.max_steps, shard.tokens_trained(saved) if saved else 0
    if opts.max_tokens:  # the steps to train on the tokens left, at this run's batch
        step = saved["step"] if saved else 0
        max_steps = step + max(-(-(opts.max_tokens - seen) // plan.tokens_per_step), 0)
    run_record |= {"tokens_per_step": plan.tokens_per_step, "max_steps": max_steps}
    return Resolved(
        opts, given, args, plan, world, run_data, held_out, max_steps, run_record, resume_from,
        saved, seen, damaged, peft_prefix(opts.hf_checkpoint), grad_clip,
    )  # fmt: skip

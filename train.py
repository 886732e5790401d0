"""Train a Llama: the techniques' order, setup, then the loop, read top to bottom.

    python train.py           # "tiny" from scratch on Python's stdlib, as bytes; CPU or one GPU
    python train.py --help    # the options; docs/training.md: fine-tuning, the memory plan

`apply_techniques` (the one order in which they compose); `setup`: the options resolved
(options.resolve: the checkpoint to resume from and what it fixes, the checks, the data, the
plan), the model built, the loader, and the checkpoint's state restored; the step and what the
loop asks after it; then `train`, a loop of `train_step` calls whose logging, evaluation,
saving and stopping are each decided by the object that owns it (`MetricsLog`,
`shard.Checkpointer`, `StopSignals`); `finish`: the exports and a sample (`generate`); last
`main`, the command line's entry and exit status.
What was given is checked before the first step: one UsageError says what is wrong and expected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

import offload
import optim
import options
import shard
from data import Batch, PackedLoader, TokenDataset
from files import UsageError, params_text, plural, write_json, write_whole
from kernels import IGNORE_INDEX
from lora import apply_lora, lora_module_paths
from metrics import open_reporters, set_aside_earlier_run
from model import (
    REFERENCE_OPS,
    Llama,
    ModelArgs,
    attended_pairs,
    flops_formula,
    fp8_ops,
    triton_ops,
)
from options import Options, command_line, exit_after_rank_0, other_rank, parse_options
from plan import PARAM_DTYPES, Plan, host_peak_rss_gib, measured_memory

# The exit status of a run stopped by SIGTERM or Ctrl-C after saving a checkpoint (EX_TEMPFAIL:
# "try again"), so `train.py && export` stops there and a requeue script can tell it apart.
EXIT_STOPPED = 75


# ----------------------------------------------------------------------------------------
# The learning rate: warmup, then cosine or linear decay
# ----------------------------------------------------------------------------------------


def lr_at(step: int, opts: Options, max_steps: int) -> float:
    """lr at 0-based `step`: warmup to lr at warmup_steps - 1, decay to min_lr at max_steps - 1."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(max_steps - 1 - opts.warmup_steps, 1)
    if opts.decay == "cosine":
        progress = 0.5 * (1 - math.cos(math.pi * progress))
    return opts.lr - (opts.lr - opts.min_lr) * min(progress, 1.0)


# ----------------------------------------------------------------------------------------
# Setup: what was given, checked; the plan; the model, its optimizer and the data
# ----------------------------------------------------------------------------------------


def apply_techniques(
    model: Llama,
    plan: Plan,
    world: shard.World,
    seed: int,
    hf_path: str | None,
    progress: Callable[[int, int], None] | None,
    lora_adapter: str | None = None,
) -> None:
    """Makes the meta-built model the one the plan describes, in the one order in which the
    techniques compose (every other docstring points here):
      0. LoRA (lora.apply_lora) swaps in the adapted projections and freezes the rest, so
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
        apply_lora(model, plan.lora, PARAM_DTYPES[plan.param_dtype], kernels=plan.kernels)
    offload.apply_ac(model, plan.ac, every=plan.ac_every)
    offload.apply_mlp_tiling(model, plan.mlp_tile)
    shard.apply_context_parallel(model, shard.context_parallel_group(world, plan.context_parallel))
    if plan.optimizer_in_backward and not plan.cpu_offload:
        # One GPU, no FSDP: fp32 on the host, optim.OptimizerInBackward's master weights,
        # their initial values drawn on the GPU so that they equal shard.materialize's there.
        model.to_empty(device="cpu")
        shard.fill_weights(model, seed, world.device, hf_path, progress=progress)
        return
    mesh = shard.build_mesh(plan.strategy, world)
    shard.apply_fsdp(
        model,
        mesh,
        plan.strategy,
        cpu_offload=plan.cpu_offload,
        param_dtype=PARAM_DTYPES[plan.param_dtype],
        # The optimizer in backward reads each gradient in FSDP's hook: into pinned shards,
        # torch < 2.13 copies it without blocking, and the hook could read it too early.
        # Plain memory also spares the pinned allocator's rounding up, for slower copies.
        pin_memory=not plan.optimizer_in_backward,
    )
    shard.materialize(
        model, world, seed, hf_path, plan.cpu_offload, progress, plan.lora, lora_adapter
    )


@dataclass(frozen=True)
class Run(options.Resolved):
    """What setup makes of the resolved options, and the loop uses."""

    model: Llama
    optimizer: optim.Optimizer
    loader: PackedLoader
    run_dir: Path
    checkpointer: shard.Checkpointer
    evaluate: Callable[[], tuple[float, int]] | None  # --eval-data's loss and labelled tokens
    start_step: int
    log: Callable
    lock: object  # run_dir/.lock, held open as long as the run lives (shard.lock_run_dir)
    reporters: list  # the main rank's metrics.py reporters, which MetricsLog hands each record


def setup(asked: Options, given: frozenset[str]) -> Run:
    """The run, ready for its first step: the options resolved (options.resolve: the checks,
    the data, the plan), the model built by `apply_techniques`, a checkpoint's state restored,
    then what the run writes opened: plan.json, config.toml, metrics.py's reporters."""
    log = (lambda *a, **k: None) if other_rank() else print
    resolved = options.resolve(asked, given, log)
    opts, args, plan, world = resolved.opts, resolved.args, resolved.plan, resolved.world
    dataset, max_steps = resolved.run_data.dataset, resolved.max_steps
    log(plan.format())
    torch.manual_seed(opts.seed)
    resumed = resolved.resume_from is not None
    model, optimizer = build(opts, args, plan, world, resumed, resolved.grad_clip, log)
    log_start(opts, args, plan, world, dataset, max_steps, log)
    loader = loader_of(dataset, plan, world, seed=opts.seed)
    evaluate_held_out = held_out_evaluation(opts, resolved.held_out, plan, world, model)
    run_dir = Path(opts.run_dir)
    checkpointer = shard.Checkpointer(
        run_dir / "checkpoints",
        opts.checkpoint_interval,
        opts.keep_checkpoints,
        world,
        record={"run": resolved.run_record, "options": dataclasses.asdict(opts)},
    )
    step = 0
    if resolved.saved:  # the weights, optimizer state, data cursor and random state
        step = checkpointer.restore(resolved.resume_from, resolved.saved, optimizer, loader)
        by = plural(resolved.saved["run"]["world_size"], "process")
        log(
            f"resumed from {resolved.resume_from} at step {step}, {resolved.start_tokens:,} "
            f"tokens trained (saved by {by}, now {world.world_size})"
        )
    elif opts.resume:
        start = f"from {opts.hf_checkpoint}" if opts.hf_checkpoint else "from random weights"
        log(f"no checkpoint in {checkpointer.root}: starting {start}")
    # Everything given is checked and loaded: from here on the run writes into its directory.
    lock, reporters = shard.lock_run_dir(run_dir, world.is_main), []
    if world.is_main:
        shard.set_aside(resolved.damaged, log)
        if step < max_steps:  # a finished run logs nothing; its plan.json keeps its peaks
            if not step:  # before its plan.json and config.toml replace the earlier run's
                set_aside_earlier_run(run_dir, log)
            planned = plan.to_json()
            write_json(run_dir / "plan.json", planned)
            write_whole(run_dir / "config.toml", options.config_toml(opts, resolved.given))
            config = {"options": dataclasses.asdict(opts), **planned}  # the reporters' run
            last = checkpointer.last
            reporters = open_reporters(opts.report_to, run_dir, config, step, last, log)
    return Run(
        **vars(resolved), model=model, optimizer=optimizer, loader=loader, run_dir=run_dir,
        checkpointer=checkpointer, evaluate=evaluate_held_out, start_step=step, log=log, lock=lock,
        reporters=reporters,
    )  # fmt: skip


def build(opts: Options, args: ModelArgs, plan: Plan, world, resumed: bool, clip: float, log):
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
        paths = lora_module_paths(args.n_layers, plan.lora.targets, args.moe_layers)
        adapted = [t for t in plan.lora.targets if any(p.endswith(f".{t}") for p in paths)]
        log(
            f"LoRA r={plan.lora.rank} (alpha {plan.lora.alpha:g}) on "
            f"{','.join(adapted + list(plan.lora.expert_targets))}"
            f"{', the base in NF4 (QLoRA)' if plan.lora.quantize_base else ''}: "
            f"{params_text(trained)} parameters train, the base's "
            f"{params_text(args.num_params())} are frozen"
        )
    betas, decay = (opts.beta1, opts.beta2), opts.weight_decay
    if plan.optimizer_in_backward and plan.cpu_offload:  # on FSDP's shards on the host
        return model, optim.ShardedOptimizerInBackward(model, opts.lr, betas, decay)
    if plan.optimizer_in_backward:
        dtype = PARAM_DTYPES[plan.param_dtype]
        return model, optim.OptimizerInBackward(model, world.device, dtype, opts.lr, betas, decay)
    # Fused on the GPU, and on the CPU with --cpu-offload, where the step runs then.
    fused = world.device.type == "cuda" or plan.cpu_offload
    return model, optim.ShardedAdamW(model, betas, decay, clip, fused)


def log_start(opts, args, plan, world, dataset, max_steps: int, log: Callable) -> None:
    frozen = plan.lora is not None
    # The passes over the data, as Hugging Face's "Num Epochs": two figures below one.
    epochs = plan.tokens_per_step * max_steps / dataset.n_tokens
    epochs_text = f"{epochs:.2g}" if epochs < 1 else f"{epochs:,.1f}"
    flops_per_token = args.flops_per_token(opts.seq_len, frozen)
    layout = "optimizer in backward" if plan.optimizer_in_backward else plan.strategy
    if plan.context_parallel > 1:
        layout += f", context parallel {plan.context_parallel}"
    masked = plan.document_mask
    params = f"{params_text(args.num_params())} params"
    if args.moe_layers:
        params += (
            f" ({params_text(args.num_params(active=True))} active: "
            f"{args.experts_per_token} of {args.n_experts} experts a token)"
        )
    log(
        f"model {options.model_name(opts)}: {params}, "
        f"{flops_per_token / 1e6:.1f} MFLOP/token ({flops_formula(frozen)}"
        f"{'; MFU counts attention within documents' if masked else ''}"
        f"{'; windowed layers count their window' if args.sliding_window else ''}"
        f"{'; MFU against the bf16 peak, matmuls in FP8' if plan.fp8_projections else ''}) | "
        f"data {dataset.path}: {dataset.n_tokens:,} tokens ({dataset.meta['tokenizer']}"
        f"{', attention masked between documents' if masked else ''}) | "
        f"{plural(world.world_size, 'process')} x {world.device.type}, "
        f"{layout}, {plan.param_dtype} params, kernels {'on' if plan.kernels else 'off'} | "
        f"{plan.tokens_per_step:,} tokens/step, {max_steps} steps ({epochs_text} epochs of "
        f"the data)"
    )
    if opts.warmup_steps >= max_steps:
        log(
            f"note: --warmup-steps {opts.warmup_steps} is not below the run's {max_steps} "
            f"steps: the learning rate rises the whole run, to "
            f"{lr_at(max_steps - 1, opts, max_steps):.2e} at its last step (--lr {opts.lr:.2e}), "
            f"and never decays"
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
    optimizer_span: tuple  # device_clock's readings before and after the optimizer's step
    # An MoE model's last micro-batch: its load-balancing loss, its busiest expert's load.
    routing: torch.Tensor | None = None


def train_step(
    model: Llama,
    optimizer: optim.Optimizer,
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
    started = device_clock(n_labels.device)
    grad_norm = optimizer.step()
    span = (started, device_clock(n_labels.device))
    return StepResult(loss_sum, n_labels, grad_norm, span, model.routing)


def device_clock(device: torch.device) -> torch.cuda.Event | float:
    """Now on `device`'s timeline. On a GPU, an event the GPU records when its work gets there:
    the host runs ahead of the GPU, and its own clock would count the waits for the work queued
    before (a whole backward, at long sequences). On a CPU, the host's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    """The time from one device_clock reading to a later one; on a GPU it waits for the GPU to
    reach `end`, so it is read when the step is logged, not in the step."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# Dense bf16 tensor-core FLOP/s by GPU name, the denominator of MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


class MetricsLog:
    """Decides which steps are logged, makes their records and hands them to stdout and, on
    the main rank, to metrics.py's reporters (metrics.jsonl, --report-to). Values are read only
    on logged and saved steps (a read waits for the GPU), checking each step since the last
    read for a non-finite loss or gradient norm before a checkpoint is saved."""

    def __init__(self, run: Run):
        self.run = run
        self.nonfinite = torch.zeros((), dtype=torch.int32, device=run.world.device)
        self.flops = torch.zeros((), dtype=torch.float64, device=run.world.device)  # (MFU)
        self.checked_step = self.logged_step = run.start_step
        self.started = self.logged_at = time.perf_counter()
        self.loading_s = 0.0  # the host's seconds in the data loader since the last record
        self.last: StepResult | None = None

    def loading(self, load: Callable, *args):
        """load(*args), its host seconds counted as the data loader's (no wait for the GPU)."""
        started = time.perf_counter()
        loaded = load(*args)
        self.loading_s += time.perf_counter() - started
        return loaded

    def counting(self, micro_batches: Iterator[Batch]) -> Iterator[Batch]:
        """The micro-batches, each counted into the training FLOPs: this rank's tokens (a
        context-parallel rank's slices) and the pairs attention attended in them."""
        plan, args = self.run.plan, self.run.args
        for b in micro_batches:
            pairs = attended_pairs(b.positions, plan.document_mask, plan.seq_len, args)
            self.flops += args.training_flops(b.positions.numel(), pairs, plan.lora is not None)
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

    def write(
        self, step: int, tokens: int, lr: float, loss: float, grad_norm: float, stopping: bool
    ) -> None:
        run = self.run
        world, max_steps, tokens_per_step = run.world, run.max_steps, run.plan.tokens_per_step
        now, steps = time.perf_counter(), step - self.logged_step
        tokens_per_s = steps * tokens_per_step / (now - self.logged_at)
        dist.all_reduce(self.flops)
        flops_per_device = self.flops.item() / (now - self.logged_at) / world.world_size
        self.flops.zero_()
        routing = [None, None]  # each rank routes its own rows: their mean
        if self.last.routing is not None:
            dist.all_reduce(routing := self.last.routing.clone())
            routing = (routing / world.world_size).tolist()
        peak = peak_flops(world.device)
        on_gpu = world.device.type == "cuda"
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "optimizer_s": seconds_between(*self.last.optimizer_span),
            "tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / world.world_size,
            "model_tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / peak if peak else None,
            "peak_gpu_mem_gib": (
                torch.cuda.max_memory_allocated(world.device) / 2**30 if on_gpu else None
            ),
            # torchtitan's: the allocator's peak held from CUDA, and its retries (each a
            # cache flush and a wait for the GPU: memory too tight), both host-side reads.
            "peak_gpu_reserved_gib": (
                torch.cuda.max_memory_reserved(world.device) / 2**30 if on_gpu else None
            ),
            "gpu_alloc_retries": (
                torch.cuda.memory_stats(world.device).get("num_alloc_retries", 0)
                if on_gpu
                else None
            ),
            "host_peak_rss_gib": host_peak_rss_gib(),
            "data_loading_share": self.loading_s / (now - self.logged_at),
            "elapsed_s": now - self.started,
            "eta_s": (now - self.started) / (step - run.start_step) * (max_steps - step),
            "eval_loss": None,
            "eval_tokens": None,
            "aux_loss": routing[0],
            "expert_load": routing[1],
        }
        if self.evaluating(step, stopping):  # after the step's timing, left out of the next
            record["eval_loss"], record["eval_tokens"] = run.evaluate()
            now = time.perf_counter()
        if world.is_main:
            print(format_record(record, max_steps), flush=True)
            for reporter in self.run.reporters:
                reporter.log(record)
        self.logged_at, self.logged_step, self.loading_s = now, step, 0.0

    def close(self) -> None:
        for reporter in self.run.reporters:
            reporter.close()


def evaluate(model: Llama, loader: PackedLoader, samples: int, device) -> tuple[float, int]:
    """The mean loss over the labelled tokens of `loader`'s first `samples` rows on all ranks,
    and their count (under no_grad: no activations kept, and the fused loss computes no
    gradients)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, labelled tokens
    with torch.no_grad():
        for b in loader.in_order(samples):
            b = b.to(device, non_blocking=True)
            # The cross-entropy alone: the load-balancing term is training's.
            loss = model(b.tokens, b.labels, b.positions, "sum", b.document_starts, aux_loss=False)
            labelled = (b.labels != IGNORE_INDEX).sum()
            totals += torch.stack([loss.double(), labelled.double()])
    model.train()
    dist.all_reduce(totals)
    loss_sum, count = totals.tolist()
    return loss_sum / max(count, 1), int(count)


def held_out_evaluation(
    opts: Options, held_out: TokenDataset | None, plan: Plan, world: shard.World, model
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
    return functools.partial(evaluate, model, eval_loader, samples, world.device)


def loader_of(dataset: TokenDataset, plan: Plan, world: shard.World, **kwargs) -> PackedLoader:
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
    if r["expert_load"] is not None:
        line += f" | aux loss {r['aux_loss']:.4f} | expert load {r['expert_load']:.2f}"
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
            measured = measured_memory(steps, run.world.device)
            run.log(run.plan.format_measured(measured))
            if run.world.is_main:
                record = {**run.plan.to_json(), "measured": measured}
                write_json(run.run_dir / "plan.json", record)
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
    run after this step, with a checkpoint if the run `saves` any; a second one, at once. One
    within a second of the first is the same: a Ctrl-C reaches every worker, and torchrun
    passes it on again.
    Python runs a signal's handler once for all its arrivals during one long call (a CPU
    backward), so each is counted where it lands: the C handler writes a byte a signal to
    set_wakeup_fd's pipe, which a thread reads and times while that call holds no GIL."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(
        self, is_main: bool, last_checkpoint: Callable[[], Path | None], saves: bool = True
    ):
        self.is_main, self.last_checkpoint, self.saves = is_main, last_checkpoint, saves
        self.received: str | None = None
        self.received_at = 0.0

    def __enter__(self) -> StopSignals:
        # The pipe and its reader first, the handlers last: no signal between them is lost.
        self.arrivals, self.wakeup = os.pipe()
        os.set_blocking(self.wakeup, False)  # as set_wakeup_fd needs: a full pipe drops a byte
        self.reader = threading.Thread(target=self._read, name="stop-signals", daemon=True)
        self.reader.start()
        self.previous, self.previous_fd = {}, -1
        try:
            self.previous_fd = signal.set_wakeup_fd(self.wakeup, warn_on_full_buffer=False)
            for s in self.SIGNALS:
                self.previous[s] = signal.signal(s, lambda signum, frame: None)
        except BaseException:  # a Ctrl-C before our handlers (KeyboardInterrupt): let all go
            self.__exit__()
            raise
        return self

    def _read(self) -> None:
        while True:
            for signum in os.read(self.arrivals, 64):  # a byte each: the signal's number
                if signum == 0:  # __exit__'s: no signal is 0
                    return
                if signum in self.SIGNALS:  # the pipe has every Python-handled signal's
                    self._handle(signum, None)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self.received_at = name, time.monotonic()
            if self.is_main:  # every rank gets the signal; one says so
                saved = "a checkpoint" if self.saves else "no checkpoint (--checkpoint-interval 0)"
                to_stderr(f"{name}: stopping after this step, with {saved}; again to stop at once")
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

    def __exit__(self, *exception) -> None:
        """The handlers and the wakeup fd as they were, however the loop ended: in-process
        callers (tests, notebooks) get their Ctrl-C back; the reader stops, even when a signal
        arrives meanwhile (the caller's handler may raise)."""
        try:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(self.previous_fd)
        finally:
            os.write(self.wakeup, b"\0")
            self.reader.join()
            os.close(self.arrivals)
            os.close(self.wakeup)


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
    saves = bool(run.checkpointer.interval)
    with StopSignals(run.world.is_main, lambda: run.checkpointer.last, saves) as stop:
        metrics, instruments = MetricsLog(run), Instruments(run)
        step, tokens, stopping = run.start_step, run.start_tokens, False
        model.train()
        while step < run.max_steps and not stopping:
            lr = lr_at(step, run.opts, run.max_steps)
            optimizer.set_lr(lr)  # before backward, where the optimizer in backward updates
            n_labels = torch.tensor(metrics.loading(run.loader.labels_ahead, plan.grad_accum))
            micro_batches = (
                metrics.loading(next, batches).to(device, non_blocking=True)
                for _ in range(plan.grad_accum)
            )
            result = train_step(
                model, optimizer, metrics.counting(micro_batches), plan.grad_accum,
                n_labels.to(device, non_blocking=True), offload_activations,
            )  # fmt: skip
            step, tokens = step + 1, tokens + plan.tokens_per_step
            metrics.add(result)
            instruments.after(step)

            stopping = stop.agreed()
            logging = metrics.logging(step, stopping)
            saving = run.checkpointer.due(step, run.max_steps, stopping)
            if logging or saving:
                loss, grad_norm = metrics.read(step, run.checkpointer.last)
            if logging:
                metrics.write(step, tokens, lr, loss, grad_norm, stopping)
            if saving:
                run.log(f"saved {run.checkpointer.save(step, tokens, optimizer, run.loader)}")
                # A signal during the save stops here: the step in progress was this one.
                stopping = stopping or stop.agreed()
    instruments.close()
    metrics.close()
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
        dtype, tokenizer = PARAM_DTYPES[run.plan.param_dtype], run.run_data.export_tokenizer
        shard.export_hf(run.model, run.args, opts.export_hf, dtype, tokenizer, run.world)
        log(f"exported {opts.export_hf} ({run.plan.param_dtype})")
    if opts.export_adapter:
        lora, base_model, out = run.plan.lora, opts.hf_checkpoint, opts.export_adapter
        shard.export_adapter(run.model, run.args, lora, out, base_model, run.peft_prefix, run.world)
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
    tokenizer, n = run.run_data.text_tokenizer, run.opts.sample_tokens
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


@torch.no_grad()
def generate(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    allowed_ids: int | None = None,
    stop_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The tokens continuing `prompt`, sampled at `temperature` (0: the most likely) from ids
    below `allowed_ids` (a tokenizer smaller than the vocabulary), up to and including
    `stop_id`. No cache: for short samples. Drawn on the CPU, so every rank draws alike."""
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([prompt], device=device)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(tokens)[0, -1, :allowed_ids].float().cpu()  # [V]
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, next_id.to(device)[None]], dim=1)
        if next_id.item() == stop_id:
            break
    return tokens[0, len(prompt) :].tolist()


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
        finished = True
        if opts.estimate_memory:  # the plan and its memory, nothing trained
            options.estimate(opts, given)
        else:
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

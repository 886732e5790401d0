"""The optimizers, behind the one interface the loop calls (`Optimizer`): `ShardedAdamW`,
torch's AdamW over FSDP's shards after clipping the global gradient norm; and the optimizer
step in backward (`OptimizerInBackward` on one GPU, `ShardedOptimizerInBackward` on FSDP's
host shards: AdamW on the CPU for each parameter once its gradient is complete), which trades
time for memory as offload.py's techniques do. It imports of longtune's only files.py and
the model.
"""

import collections
import contextlib
import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from files import UsageError
from model import Llama


class Optimizer(Protocol):
    """What the loop (train.train_step) and the checkpoints call, on each optimizer here:
    set_lr() before a step's backward, step() after it (the gradient norm, unread),
    state_dict() / load_state_dict() by parameter name."""

    def set_lr(self, lr: float) -> None: ...
    def step(self) -> torch.Tensor: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clips the gradients to global L2 norm `max_norm` if > 0; returns the norm (0-dim).
    full_tensor() reduces the ranks' partial sums of squares, so all clip by the same norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def decayed(name: str, param: torch.Tensor) -> bool:
    """Whether AdamW decays a parameter: the weight matrices (embeddings, LoRA's adapters, an
    MoE's router and experts), as transformers' Trainer, not the norms, gpt-oss's sinks or a
    bias (gpt-oss's experts' are matrices too: [E, out])."""
    return param.ndim >= 2 and not name.endswith("bias")


class ShardedAdamW:
    """torch.optim.AdamW over FSDP's shards (weight decay where `decayed`),
    behind the interface optim.OptimizerInBackward shares: set_lr() before a step's
    backward, step() after it, state_dict() / load_state_dict() as {"model": fp32 weights,
    "optim": AdamW's state} by parameter name, so either kind of run resumes the other's."""

    def __init__(self, model: Llama, betas, weight_decay: float, grad_clip: float, fused: bool):
        self.model = model
        self.grad_clip = grad_clip
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA's alone
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for n, p in trained if decayed(n, p)], "weight_decay": weight_decay},
                {"params": [p for n, p in trained if not decayed(n, p)], "weight_decay": 0.0},
            ],
            lr=0.0,  # set_lr sets each step's
            betas=betas,
            fused=fused,
        )

    def set_lr(self, lr: float) -> None:
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def step(self) -> torch.Tensor:
        """Clips (--grad-clip), updates, frees the gradients; returns the norm unread, so the
        step has no host sync."""
        norm = clip_grad_norm_(self.model, self.grad_clip)
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        # Frozen parameters (a LoRA run's base) are not saved: they come from --hf-checkpoint.
        model_state, optim_state = get_state_dict(self.model, self.adamw, options=FROZEN_LEFT_OUT)
        return {"model": model_state, "optim": optim_state["state"]}

    def load_state_dict(self, state: dict) -> None:
        # The hyperparameters in param_groups come from the command line, not the checkpoint.
        _, current = get_state_dict(self.model, self.adamw, options=FROZEN_LEFT_OUT)
        optim_state = {"state": state["optim"], "param_groups": current["param_groups"]}
        set_state_dict(
            self.model,
            self.adamw,
            model_state_dict=state["model"],
            optim_state_dict=optim_state,
            options=FROZEN_LEFT_OUT,
        )


# strict=False: the frozen parameters are missing from the state on purpose; DCP has checked
# that the checkpoint holds every tensor of the state it filled.
FROZEN_LEFT_OUT = StateDictOptions(ignore_frozen_params=True, strict=False)


# Pinned host buffers for the weights' way up, each the largest parameter in param_dtype: one
# is copied while the other is filled. (Gradients need one: the worker takes one at a time.)
STAGING_SLOTS = 2


@torch.no_grad()
def adamw_(
    master: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """AdamW(fused=True)'s kernel on the fp32 `master` (`weight_decay`: 0 where not `decayed`,
    as ShardedAdamW's): the callers own the state, and the optimizer's per-call bookkeeping
    would take a third of the time (a 58M-element tensor on 2 CPU cores)."""
    state["step"] += 1
    torch._fused_adamw_(
        [master],
        [grad],
        [state["exp_avg"]],
        [state["exp_avg_sq"]],
        [],
        [state["step"]],
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        eps=1e-8,  # torch.optim.AdamW's default, as optim.ShardedAdamW's
        amsgrad=False,
        maximize=False,
    )


class _AdamWInBackward:
    """Both optimizers in backward: AdamW's state beside the fp32 `master` weights by name, and
    the worker to which each parameter's post-accumulate-grad hook (`_on_grad`) hands its
    gradient. optim.ShardedAdamW's interface (checkpoints go between them), no zeroing."""

    def __init__(self, params: dict[str, nn.Parameter], master: dict, lr, betas, weight_decay):
        self.lr, self.betas, self.master = lr, betas, master
        self.weight_decay = {n: weight_decay if decayed(n, p) else 0.0 for n, p in params.items()}
        self.state = {
            name: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(weight),
                   "exp_avg_sq": torch.zeros_like(weight)}
            for name, weight in master.items()
        }  # fmt: skip
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adamw")
        for name, param in params.items():
            param.register_post_accumulate_grad_hook(functools.partial(self._on_grad, name))

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def state_dict(self) -> dict:
        """The tensors themselves, not copies: read it between steps (after step())."""
        return {"model": dict(self.master), "optim": {n: dict(s) for n, s in self.state.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copies `state` (state_dict's layout) in; the tensors of state_dict() itself, filled
        in place (as DCP loads), copy nothing."""
        for name, master in self.master.items():
            master.copy_(state["model"][name])
            for key, tensor in self.state[name].items():
                tensor.copy_(state["optim"][name][key])


class OptimizerInBackward(_AdamWInBackward):
    """AdamW applied to each parameter on the CPU as soon as its gradient is complete in
    backward. The host keeps the fp32 master weights and AdamW's two moments (12 bytes per
    parameter); the GPU only the param_dtype working weights and the few gradients in flight.
    (AdamW offloaded after backward needs 16 bytes per parameter, fp32 gradients included:
    128.5 GB for 8B, more than a 128 GiB host.)

    A parameter's hook fires after its last use in this backward (a tied embedding's after
    both), so its working weight may be rewritten from then on. The worker copies the
    gradient to a pinned staging buffer on a side stream, runs AdamW on the fp32 master and
    copies it back in param_dtype on a second side stream (another copy engine). The hook
    waits only while a block's bytes of gradients wait on the GPU: backward is launched ahead
    of the GPU, and a hook that waited for each copy, or for a long update like the head's,
    held the launches back until the GPU ran dry (bench/RESULTS.md, "The optimizer in
    backward's stalls"). Without CUDA (the tests) the same code runs on torch.cpu's streams.

    Updating before the step's last gradient exists rules out clipping by the global norm,
    gradient accumulation (the hooks fire on every backward), FSDP (ShardedOptimizerInBackward
    takes its shards) and any check before the update: a non-finite gradient is seen after
    the parameters before it were updated."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        param_dtype: torch.dtype,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
    ):
        """`model`'s fp32 host parameters become the masters (the model in fp32 only once),
        each with a `param_dtype` copy on `device`."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streams = torch.get_device_module(self.device.type)
        self.params = dict(model.named_parameters())
        for name, param in self.params.items():
            if param.device.type != "cpu" or param.dtype != torch.float32:
                raise UsageError(
                    f"OptimizerInBackward takes a model on the host in fp32 (to_empty on the "
                    f"CPU, then shard.fill_weights); {name} is {param.dtype} on {param.device}"
                )
        master = {name: param.detach() for name, param in self.params.items()}
        super().__init__(self.params, master, lr, betas, weight_decay)
        for name, param in self.params.items():
            # A copy even where device and dtype are the master's (CPU fp32): the working
            # weight is never the master itself.
            param.data = master[name].to(device, param_dtype, copy=True)
        self.sq_norm = torch.zeros((), device=device)  # the step's sum of squared gradients
        self.updates: list[Future] = []  # this step's, waited for in step()
        # The gradients handed to the worker and not yet copied off the GPU, with their
        # bytes: the hook waits beyond a block's (one larger than that goes alone).
        self.on_gpu: collections.deque[tuple[threading.Event, int]] = collections.deque()
        self.on_gpu_bytes = 0
        block = sum(p.numel() for p in model.layers[0].parameters())
        self.max_on_gpu_bytes = block * param_dtype.itemsize
        largest = max(p.numel() for p in self.params.values())
        with torch.cuda.device(device) if self.cuda else contextlib.nullcontext():
            self.d2h, self.h2d = self.streams.Stream(), self.streams.Stream()  # on `device`
        staging = functools.partial(torch.empty, largest, dtype=param_dtype, pin_memory=self.cuda)
        self.grad_staging = staging()
        self.grad32 = torch.empty(largest)  # the worker's fp32 copy of one gradient
        self.weight_staging = [staging() for _ in range(STAGING_SLOTS)]
        self.weight_copied: list[torch.cuda.Event | None] = [None] * STAGING_SLOTS
        self.weight_copies = 0

    def _on_grad(self, name: str, param: nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        self.sq_norm += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        computed = self.streams.current_stream().record_event()  # None on the CPU
        nbytes = grad.numel() * grad.element_size()
        while self.on_gpu and self.on_gpu_bytes + nbytes > self.max_on_gpu_bytes:
            copied, oldest_bytes = self.on_gpu.popleft()
            copied.wait()
            self.on_gpu_bytes -= oldest_bytes
        copied = threading.Event()
        # In a list, so that the worker drops it once copied: the executor keeps the
        # arguments themselves until the call returns.
        args = (name, [grad], computed, copied, self.lr)
        self.updates.append(self.worker.submit(self._update, *args))
        self.on_gpu.append((copied, nbytes))
        self.on_gpu_bytes += nbytes

    @torch.no_grad()
    def _update(
        self,
        name: str,
        held: list[torch.Tensor],
        computed: torch.cuda.Event | None,
        copied: threading.Event,
        lr: float,
    ) -> None:
        """The worker's part for one parameter. The gradient `held`, complete once `computed`
        is, is dropped after its copy, so the allocator may reuse it at once (no
        record_stream); `copied` tells the hook so, even on failure (step() raises it)."""
        master, state = self.master[name], self.state[name]
        try:
            grad = held.pop()
            staging = self.grad_staging[: grad.numel()].view(grad.shape)
            with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
                self.d2h.wait_event(computed)
                with self.streams.stream(self.d2h):
                    staging.copy_(grad, non_blocking=True)
                    on_host = self.d2h.record_event()
                if on_host is not None:
                    on_host.synchronize()
        finally:
            grad = None
            copied.set()
        grad32 = self.grad32[: staging.numel()].view(staging.shape).copy_(staging)
        adamw_(master, grad32, state, lr, self.betas, self.weight_decay[name])
        self._copy_to_working(name)

    def _copy_to_working(self, name: str) -> None:
        param, master = self.params[name], self.master[name]
        i = self.weight_copies % STAGING_SLOTS
        self.weight_copies += 1
        if self.weight_copied[i] is not None:
            self.weight_copied[i].synchronize()  # the buffer's previous copy has left it
        staging = self.weight_staging[i][: master.numel()].view(master.shape).copy_(master)
        with self.streams.stream(self.h2d):
            param.detach().copy_(staging, non_blocking=True)
            self.weight_copied[i] = self.h2d.record_event()

    def step(self) -> torch.Tensor:
        """Waits for the step's updates (raising a worker's error) and makes the compute stream
        wait for their copies to the GPU. Returns the gradients' global L2 norm on the device,
        unread: no host sync (non-finite if a gradient was, every update applied by then)."""
        updates, self.updates = self.updates, []
        self.on_gpu.clear()  # every copy is done once every update is
        self.on_gpu_bytes = 0
        for update in updates:
            update.result()
        self.streams.current_stream().wait_stream(self.h2d)
        norm = self.sq_norm.sqrt()
        self.sq_norm.zero_()  # stream-ordered after the sqrt above
        return norm

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for name in self.master:
            self._copy_to_working(name)
        self.streams.current_stream().wait_stream(self.h2d)


class ShardedOptimizerInBackward(_AdamWInBackward):
    """The optimizer in backward over FSDP with CPU offload, on any number of processes: the
    fp32 host shards are the masters, gathered to the GPU in param_dtype only while their
    block runs. FSDP calls the hook once a gradient shard is on the host, and the worker
    updates the shard while backward goes on; at most a block's worth wait (`max_pending`),
    never the whole set. step() waits for them all, before the next forward's all-gathers
    read the shards. The state_dict holds DTensors, as optim.ShardedAdamW's. It rules out
    what OptimizerInBackward does (clipping, accumulation)."""

    def __init__(
        self,
        model: Llama,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
    ):
        params = dict(model.named_parameters())
        for name, param in params.items():
            # Plain memory, not pinned: train.apply_techniques says why.
            sharded = isinstance(param, DTensor) and param.device.type == "cpu"
            if not sharded or param.to_local().is_pinned():
                raise UsageError(
                    f"ShardedOptimizerInBackward takes a model sharded by FSDP with CPU "
                    f"offload, not pinned; {name} is a {type(param).__name__} on "
                    f"{param.device}{', pinned' if sharded else ''}"
                )
        super().__init__(params, params, lr, betas, weight_decay)
        self.sq_norm = torch.zeros(())  # of this rank's gradient shards; the worker's
        self.pending: collections.deque[Future] = collections.deque()
        self.max_pending = len(list(model.layers[0].parameters()))

    def _on_grad(self, name: str, param: nn.Parameter) -> None:
        grad = param.grad.to_local()
        param.grad = None
        while len(self.pending) >= self.max_pending:
            self.pending.popleft().result()
        self.pending.append(self.worker.submit(self._update, name, grad, self.lr))

    @torch.no_grad()
    def _update(self, name: str, grad: torch.Tensor, lr: float) -> None:
        self.sq_norm += grad.square().sum()
        state = {key: t.to_local() if isinstance(t, DTensor) else t
                 for key, t in self.state[name].items()}  # fmt: skip
        adamw_(self.master[name].to_local(), grad, state, lr, self.betas, self.weight_decay[name])

    def step(self) -> torch.Tensor:
        """As OptimizerInBackward's, but the norm on the host, from every rank's sum of squares."""
        while self.pending:
            self.pending.popleft().result()
        sq_norm, self.sq_norm = self.sq_norm, torch.zeros(())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq_norm)
        return sq_norm.sqrt()

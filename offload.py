"""What trades time for memory, in this order: activation checkpointing (`apply_ac`), MLP
tiling (`apply_mlp_tiling`), activation offload (`activation_offload`: what forward keeps goes
to host memory while compute goes on, and comes back in backward) and the optimizer step in
backward (`OptimizerInBackward` on one GPU, `ShardedOptimizerInBackward` on FSDP's host
shards: AdamW on the CPU for each parameter once its gradient is complete).
train.apply_techniques states how they compose with LoRA, context parallelism and FSDP.

`apply_ac` registers the checkpoint as hooks on each TransformerBlock (the composable
`checkpoint`), so the module tree and parameter names, which HF loading, checkpoints and
`fully_shard` rely on, stay as they were.
"""

import collections
import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from files import UsageError
from model import Llama

aten = torch.ops.aten

AC_MODES = ("none", "full", "attention", "selective")

# Per-op checkpointing policies: the ops whose outputs are kept; the rest of a block is
# recomputed in backward. "attention" keeps attention's output (and softmax statistics): at
# long sequences attention is most of a block's FLOPs and its output one [S, d] tensor, so
# little more memory than "full" spares the most expensive recompute. "selective" also keeps
# the matmuls'; the norms, RoPE and SwiGLU (elementwise, cheap, outputs as large) are redone.
ATTENTION_OPS = {
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
MATMUL_OPS = {aten.mm.default, aten._scaled_mm.default}  # bf16, and FP8 (--fp8)
SAVED_OPS = {"attention": ATTENTION_OPS, "selective": ATTENTION_OPS | MATMUL_OPS}


def apply_ac(model: Llama, mode: str, every: int = 1) -> None:
    """Checkpoints the blocks: "full" keeps only a block's input and recomputes it in backward;
    "attention" and "selective" also keep their SAVED_OPS' outputs and the document-masked
    attention's (`_KeptAttention`). every=k checkpoints blocks 0, k, 2k, ... only."""
    if mode not in AC_MODES:
        raise UsageError(
            f"unknown activation checkpointing mode {mode!r}; expected one of {AC_MODES}"
        )
    if every < 1:
        raise ValueError(f"activation checkpointing 'every' must be >= 1, got {every}")
    if mode == "none":
        return
    context_fn = None  # "full": the checkpoint's own contexts, which keep nothing
    if mode in SAVED_OPS:
        context_fn = functools.partial(_keeping_contexts, list(SAVED_OPS[mode]))
    for i, block in enumerate(model.layers):
        if i % every == 0:
            if context_fn is not None:
                block.attention.attend = _KeptAttention(block.attention.attend)
            # No randomness in the model (no dropout): no RNG state to save and restore.
            checkpoint(block, context_fn=context_fn, preserve_rng_state=False)


class _Phase:
    """Which pass of a checkpointed block runs: "forward", "recompute" or None. One at a time:
    forward runs on the main thread, the recompute on autograd's, never both at once."""

    now: str | None = None

    @classmethod
    @contextlib.contextmanager
    def of(cls, phase: str, policy: contextlib.AbstractContextManager) -> Iterator[None]:
        with policy:
            cls.now = phase
            try:
                yield
            finally:
                cls.now = None


def _keeping_contexts(saved_ops: list) -> tuple:
    """The checkpoint's (forward, recompute) contexts: the selective policy for SAVED_OPS,
    plus the phase `_KeptAttention` reads.

    The outputs the policy keeps stay on the GPU, outside activation_offload's hooks (as
    shard.block_bytes counts them): they are most of what a block keeps (under "selective"
    over 11 times the block's input in Llama 3 8B), too much to move behind the block's
    compute. torch 2.14 warns that a later release will route them through the hooks unless
    checkpoint(..., respect_saved_tensors_hooks=False), which the composable checkpoint
    refuses; torch.utils.checkpoint hands it on as this attribute of the policy's forward
    context, set here the same way (on the policy's context, not `_Phase.of`'s, so it stays)."""
    forward, recompute = create_selective_checkpoint_contexts(saved_ops)
    if hasattr(forward, "respect_saved_tensors_hooks"):  # torch >= 2.14
        forward.respect_saved_tensors_hooks = False
    return _Phase.of("forward", forward), _Phase.of("recompute", recompute)


class _KeptAttention:
    """Keeps the document-masked attention's output through a checkpointed block's recompute,
    as the policy keeps SDPA's: the policy sees aten ops through a dispatch mode, and compiled
    FlexAttention runs as Triton kernels. In forward the kernel runs outside the checkpoint's
    saved-tensor hooks (its autograd node keeps q, k, v, the output and the softmax statistics
    on the GPU, even with activation offload); the recompute takes the output kept here. That
    keeps q, k and v too (1.5x the output with 4 query heads per kv head), which SDPA's policy
    recomputes: flex's backward is reachable only through its autograd node."""

    def __init__(self, attend):
        self.attend = attend
        self.kept: torch.Tensor | None = None  # detached; requires_grad says the original's

    def __call__(self, q, k, v, mask):
        if mask is None or _Phase.now is None or not torch.is_grad_enabled():
            return self.attend(q, k, v, mask)
        if _Phase.now == "recompute":
            if self.kept is None:
                raise RuntimeError("attention recompute without a kept forward output")
            out, self.kept = self.kept, None
            return out
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = self.attend(q, k, v, mask)
        # Requiring grad as the original does, so the recompute saves the same tensors.
        self.kept = out.detach().requires_grad_(out.requires_grad)
        return out


def apply_mlp_tiling(model: Llama, tile_tokens: int) -> None:
    """Runs each block's feed-forward over tiles of `tile_tokens` positions, each checkpointed
    on its own, so the [tokens, ffn_dim] intermediates (gate, up, their product, their
    gradients) exist a tile at a time. The price, the tiles' forward again in backward, is
    paid only where no block recompute runs it anyway (_tiled_forward): blocks not
    checkpointed, or selective. The MLP acts on each position alone: the result is the same."""
    if tile_tokens == 0:
        return
    for block in model.layers:
        feed_forward = block.feed_forward
        # An instance attribute: nn.Module.__call__ finds it before the class's forward,
        # and the parameters, their names and the module tree stay as they were.
        feed_forward.forward = functools.partial(
            _tiled_forward, type(feed_forward).forward.__get__(feed_forward), tile_tokens
        )


def _tiled_forward(forward, tile_tokens: int, x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] <= tile_tokens:
        return forward(x)
    tiles = x.split(tile_tokens, dim=1)  # [B, S, D] -> [B, tile, D] views
    # Inside backward this is a checkpointed block's recompute, for the tensors the block
    # saved: of the MLP only the tiles' inputs (each tile's checkpoint reruns its forward in
    # its backward), and checkpoint's early stop never reads the tiles' outputs, so they are
    # not computed. The stand-in runs no op: selective's recompute allows only forward's ops.
    if torch._C._current_graph_task_id() != -1:
        forward = nn.Identity()
    return torch.cat(
        [torch_checkpoint(forward, tile, use_reentrant=False) for tile in tiles], dim=1
    )


# ----------------------------------------------------------------------------------------
# Activation offload
# ----------------------------------------------------------------------------------------


class _Offloaded:
    """One saved tensor: its storage's bytes on the host (`pieces`), the dtype, shape and
    strides to view them as it again, and `on_device`, its copy back (None until fetched),
    valid on the compute stream after `ready`."""

    __slots__ = (
        "pieces", "dtype", "shape", "stride", "device", "block", "on_device", "ready",
        "__weakref__",
    )  # fmt: skip


# Below this, a tensor's last bytes go into one buffer (activation_offload moves tensors of 1
# MiB and more, so this wastes at most half of what it moves).
SMALLEST_PIECE = 2**20


def host_pieces(nbytes: int, pin_memory: bool) -> list[torch.Tensor]:
    """Host buffers (uint8) of `nbytes` in all, powers of two, largest first: the pinned
    allocator rounds each request up to a power of two, so one buffer could double a block
    input, enough to run a 70B QLoRA run's host out of memory (bench/RESULTS.md, issue #24)."""
    whole = nbytes // SMALLEST_PIECE * SMALLEST_PIECE
    sizes = [1 << bit for bit in reversed(range(whole.bit_length())) if whole >> bit & 1]
    if nbytes > whole:
        sizes.append(nbytes - whole)
    return [torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory) for size in sizes]


class _Offloader:
    """activation_offload's saved_tensors_hooks: the copies run on a side stream, a block's
    tensors coming back during the backward of the block after it, so both overlap compute.

    Every device tensor is allocated on the compute stream, so the caching allocator keeps
    one pool (a side stream's would be a second, reserving far more than it holds). The side
    stream waits for the compute stream before each copy; `record_stream(side)` keeps a
    copy's device end from reuse until it is done; both directions share the side stream;
    the compute stream waits on `ready` before reading a fetched tensor. Without CUDA the
    copies are plain CPU copies, so the bookkeeping runs, and is tested, the same way."""

    def __init__(self, min_bytes: int):
        self.min_bytes = min_bytes
        self.cuda = torch.cuda.is_available()
        self.device_type = "cuda" if self.cuda else "cpu"
        self.streams = torch.get_device_module(self.device_type)
        self.stream = self.streams.Stream()
        self.block: int | None = None  # the block whose forward is running
        self.blocks: dict[int, list[weakref.ref]] = {}  # block -> its offloaded tensors
        self.fetched: set[int] = set()
        # Tensors seen in the running block, by storage and view: wq, wk and wv save the
        # same input, which is copied once. The references keep addresses from being reused.
        self.seen: dict[tuple, tuple[torch.Tensor, _Offloaded]] = {}
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0

    def _copy(self, flat: torch.Tensor, pieces: list[torch.Tensor], to_host: bool):
        """Copies the device bytes `flat` to the host `pieces` laid end to end, or back;
        returns the copy's event (None on the CPU)."""
        self.stream.wait_stream(self.streams.current_stream())
        with self.streams.stream(self.stream):
            start = 0
            for piece in pieces:
                part = flat[start : start + piece.numel()]
                source, destination = (part, piece) if to_host else (piece, part)
                destination.copy_(source, non_blocking=True)
                start += piece.numel()
            ready = self.stream.record_event()
        if self.cuda:
            flat.record_stream(self.stream)
        return ready

    def enter_block(self, index: int, *_) -> None:
        self.block = index

    def exit_block(self, *_) -> None:
        self.block = None
        self.seen.clear()

    def pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if (
            self.block is None  # outside the offloaded blocks
            or tensor.device.type != self.device_type
            or nbytes < self.min_bytes
            or isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)  # a weight's transpose
        ):
            return tensor
        storage, offset = tensor.untyped_storage(), tensor.storage_offset()
        key = (storage.data_ptr(), offset, tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key in self.seen:
            return self.seen[key][1]
        saved = _Offloaded()
        # Keep the layout (a transposed view stays transposed) when the view covers its
        # whole storage; otherwise a copy of its own (contiguous() keeps a row range a view).
        dense = offset == 0 and storage.nbytes() == nbytes
        source = tensor if dense else tensor.clone(memory_format=torch.contiguous_format)
        saved.dtype, saved.shape, saved.stride = tensor.dtype, tensor.shape, source.stride()
        saved.pieces = host_pieces(nbytes, pin_memory=self.cuda)
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        flat.set_(source.untyped_storage())
        self._copy(flat, saved.pieces, to_host=True)
        saved.device = tensor.device
        saved.block = self.block
        saved.on_device = None
        self.seen[key] = (tensor, saved)
        self.blocks.setdefault(self.block, []).append(weakref.ref(saved))
        self.offloaded_bytes += nbytes
        self.offloaded_tensors += 1
        return saved

    def _fetch_block(self, block: int) -> None:
        if block in self.fetched or block not in self.blocks:
            return
        self.fetched.add(block)
        for ref in self.blocks[block]:
            if (saved := ref()) is None or saved.on_device is not None:
                continue
            # Allocated on the compute stream, whose queued work may still use that memory.
            nbytes = sum(piece.numel() for piece in saved.pieces)
            flat = torch.empty(nbytes, dtype=torch.uint8, device=saved.device)
            saved.ready = self._copy(flat, saved.pieces, to_host=False)
            saved.on_device = flat.view(saved.dtype).as_strided(saved.shape, saved.stride)

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        self._fetch_block(saved.block)
        self._fetch_block(saved.block - 1)  # the next block in backward order: prefetch
        self.streams.current_stream().wait_event(saved.ready)
        # The device copy lives as long as autograd keeps `saved` (several nodes may
        # unpack it), i.e. until the block's backward is done with it.
        return saved.on_device


@contextlib.contextmanager
def activation_offload(
    model: Llama, enabled: bool = True, min_bytes: int = 2**20, blocks: int | None = None
) -> Iterator[_Offloader | None]:
    """While active (around forward), what the TransformerBlocks save for backward goes to
    pinned host memory: every saved activation, or under checkpointing the block inputs (the
    kept op outputs stay on the GPU). Tensors under `min_bytes`, weights and the last block
    stay: backward needs it first, so copying it out and back would only stall. `blocks`:
    only the first ones (the last needed in backward), when the host holds less than all.

    A block's memory is freed only once its copy is done, at the host link's speed, so
    offload pays when a block computes longer than it takes to move what it saves: with full
    checkpointing (the inputs only), not without (bench/RESULTS.md)."""
    if not enabled:
        yield None
        return
    last = len(model.layers) - 1
    if blocks is not None and not 0 <= blocks <= last:
        raise ValueError(f"activation offload of {blocks} blocks; expected 0 to {last}")
    offloader = _Offloader(min_bytes)
    handles = []
    for i, block in enumerate(model.layers[: last if blocks is None else blocks]):
        enter = functools.partial(offloader.enter_block, i)
        handles.append(block.register_forward_pre_hook(enter, prepend=True))
        handles.append(block.register_forward_hook(offloader.exit_block, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            yield offloader
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------------------
# Optimizer in backward
# ----------------------------------------------------------------------------------------

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
    """AdamW(fused=True)'s kernel on the fp32 `master`, weight decay on matrices only (as
    shard.ShardedAdamW's): the callers own the state, and the optimizer's per-call bookkeeping
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
        weight_decay=weight_decay if master.ndim >= 2 else 0.0,
        eps=1e-8,  # torch.optim.AdamW's default, as shard.ShardedAdamW's
        amsgrad=False,
        maximize=False,
    )


class _AdamWInBackward:
    """Both optimizers in backward: AdamW's state beside the fp32 `master` weights by name, and
    the worker to which each parameter's post-accumulate-grad hook (`_on_grad`) hands its
    gradient. shard.ShardedAdamW's interface (checkpoints go between them), no zeroing."""

    def __init__(self, params: dict[str, nn.Parameter], master: dict, lr, betas, weight_decay):
        self.lr, self.betas, self.weight_decay = lr, betas, weight_decay
        self.master = master
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
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
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
                    f"CPU, then model.fill_weights); {name} is {param.dtype} on {param.device}"
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
        adamw_(master, grad32, state, lr, self.betas, self.weight_decay)
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
    read the shards. The state_dict holds DTensors, as shard.ShardedAdamW's. It rules out
    what OptimizerInBackward does (clipping, accumulation)."""

    def __init__(
        self,
        model: Llama,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
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
        adamw_(self.master[name].to_local(), grad, state, lr, self.betas, self.weight_decay)

    def step(self) -> torch.Tensor:
        """As OptimizerInBackward's, but the norm on the host, from every rank's sum of squares."""
        while self.pending:
            self.pending.popleft().result()
        sq_norm, self.sq_norm = self.sq_norm, torch.zeros(())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq_norm)
        return sq_norm.sqrt()

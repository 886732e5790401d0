"""What trades time for memory, in this order: activation checkpointing (`apply_ac`), MLP
tiling (`apply_mlp_tiling`) and activation offload (`activation_offload`: what forward keeps
goes to host memory while compute goes on, and comes back in backward); optim.py holds the
fourth, the optimizer step in backward. train.apply_techniques states how they compose with
LoRA, context parallelism and FSDP.

`apply_ac` registers the checkpoint as hooks on each TransformerBlock (the composable
`checkpoint`), so the module tree and parameter names, which HF loading, checkpoints and
`fully_shard` rely on, stay as they were.
"""

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
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
# bf16, and FP8 (--fp8). Not aten._grouped_mm: kernels/moe.py adds gpt-oss's biases and the
# experts' adapters to its outputs in place, which a kept output would see twice on recompute.
MATMUL_OPS = {aten.mm.default, aten._scaled_mm.default}
SAVED_OPS = {"attention": ATTENTION_OPS, "selective": ATTENTION_OPS | MATMUL_OPS}


def check_ac_mode(mode: str) -> None:
    if mode not in AC_MODES:
        raise UsageError(
            f"unknown activation checkpointing mode {mode!r}; expected one of {AC_MODES}"
        )


def checkpointed(mode: str, block: int, every: int) -> bool:
    """Whether apply_ac checkpoints block `block`: under any mode but "none", blocks 0, every,
    2*every, ..."""
    return mode != "none" and block % every == 0


def keeps(mode: str, ops: set) -> bool:
    """Whether a block checkpointed under `mode` keeps the outputs of `ops` (ATTENTION_OPS,
    MATMUL_OPS) through its recompute."""
    return ops <= SAVED_OPS.get(mode, set())


def offloaded_blocks(n_layers: int, blocks: int | None) -> int:
    """How many blocks, from the first, activation_offload moves to the host: `blocks`, or all
    but the last (backward needs it first)."""
    return n_layers - 1 if blocks is None else blocks


def apply_ac(model: Llama, mode: str, every: int = 1) -> None:
    """Checkpoints the blocks: "full" keeps only a block's input and recomputes it in backward;
    "attention" and "selective" also keep their SAVED_OPS' outputs and a masked attention's
    (documents, a window, sinks: `_KeptAttention`). every=k checkpoints blocks 0, k, 2k, ...
    only."""
    check_ac_mode(mode)
    context_fn = None  # "full": the checkpoint's own contexts, which keep nothing
    if mode in SAVED_OPS:
        context_fn = functools.partial(_keeping_contexts, list(SAVED_OPS[mode]))
    for i, block in enumerate(model.layers):
        if checkpointed(mode, i, every):
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
    plan.block_bytes counts them): they are most of what a block keeps (under "selective"
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
    """Keeps a masked attention's output (documents, a sliding window) through a checkpointed
    block's recompute, as the policy keeps SDPA's: the policy sees aten ops through a dispatch
    mode, and compiled FlexAttention runs as Triton kernels. In forward the kernel runs outside
    the checkpoint's saved-tensor hooks (its autograd node keeps q, k, v, the output and the
    softmax statistics on the GPU, even with activation offload); the recompute takes the
    output kept here. That keeps q, k and v too (1.5x the output with 4 query heads per kv
    head), which SDPA's policy recomputes: flex's backward is reachable only through its
    autograd node."""

    def __init__(self, attend):
        self.attend = attend
        self.kept: torch.Tensor | None = None  # detached; requires_grad says the original's

    def __call__(self, q, k, v, mask, sinks=None):
        if mask is None or _Phase.now is None or not torch.is_grad_enabled():
            return self.attend(q, k, v, mask, sinks)
        if _Phase.now == "recompute":
            if self.kept is None:
                raise RuntimeError("attention recompute without a kept forward output")
            out, self.kept = self.kept, None
            return out
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = self.attend(q, k, v, mask, sinks)
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
    offloader = _Offloader(min_bytes)
    handles = []
    for i, block in enumerate(model.layers[: offloaded_blocks(len(model.layers), blocks)]):
        enter = functools.partial(offloader.enter_block, i)
        handles.append(block.register_forward_pre_hook(enter, prepend=True))
        handles.append(block.register_forward_hook(offloader.exit_block, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            yield offloader
    finally:
        for handle in handles:
            handle.remove()

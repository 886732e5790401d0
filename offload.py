"""Activation memory: checkpointing (recompute in backward what forward did not keep) and
offloading the tensors forward keeps to host memory while compute goes on.

`apply_ac` comes first in the order shard.py's docstring gives (AC, then FSDP): it
registers the checkpoint as hooks on each TransformerBlock (torch.distributed's composable
`checkpoint`), so the model's structure and parameter names stay as they were, which HF
loading and checkpoints rely on, and `fully_shard` wraps the same modules. In backward
the recomputed forward runs through FSDP's hooks again, which re-gather the block's
weights if they were freed.

`activation_offload` is used by train.py around the forward only; the saved tensors come
back during backward:

    with activation_offload(model, enabled=opts.activation_offload):
        loss = model(tokens, labels)
    loss.backward()
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

from model import Llama

aten = torch.ops.aten

AC_MODES = ("none", "full", "attention", "selective")

# Per-op checkpointing policies, as data: the ops whose outputs are kept; everything else in
# a block is recomputed in backward.
# "attention" keeps only attention's output (and its softmax statistics): at long sequences
# attention is most of a block's FLOPs while its output is one [S, d] tensor, so this costs
# little more memory than "full" and saves recomputing the most expensive op.
# "selective" also keeps the matmuls' outputs; the norms, RoPE and SwiGLU (elementwise, cheap
# to redo, with outputs as large) are recomputed. (torchtitan also keeps reduce_scatter
# outputs: those appear inside a block only with tensor parallelism, which longtune lacks.)
ATTENTION_OPS = {
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
SAVED_OPS = {"attention": ATTENTION_OPS, "selective": ATTENTION_OPS | {aten.mm.default}}


def apply_ac(model: Llama, mode: str, every: int = 1) -> None:
    """Activation checkpointing of the transformer blocks: "none"; "full" keeps only each
    checkpointed block's input and recomputes the block in backward; "attention" and
    "selective" also keep the outputs of their SAVED_OPS. With every=k only blocks 0, k, 2k, ... are
    checkpointed (the others keep everything: memory traded for less recompute)."""
    if mode not in AC_MODES:
        raise ValueError(
            f"unknown activation checkpointing mode {mode!r}; expected one of {AC_MODES}"
        )
    if every < 1:
        raise ValueError(f"activation checkpointing 'every' must be >= 1, got {every}")
    match mode:
        case "none":
            return
        case "full":
            context_fn = None
        case "attention" | "selective":
            context_fn = functools.partial(
                create_selective_checkpoint_contexts, list(SAVED_OPS[mode])
            )
    for i, block in enumerate(model.layers):
        if i % every == 0:
            # No randomness in the model (no dropout): no RNG state to save and restore.
            checkpoint(block, context_fn=context_fn, preserve_rng_state=False)


def apply_mlp_tiling(model: Llama, tile_tokens: int) -> None:
    """Runs each block's feed-forward over tiles of `tile_tokens` positions, each tile
    checkpointed on its own, so that the [tokens, ffn_dim] intermediates (gate, up, their
    product, and their gradients: about 6 such tensors, 2 GiB each at 128k tokens for
    llama3.2-1b) exist for one tile at a time, in forward and in backward. The price is
    one more forward of the MLP per step. The feed-forward acts on each position alone, so
    tiling does not change its result. Applied after `apply_ac`; 0 leaves the model as it is."""
    if tile_tokens < 0:
        raise ValueError(f"MLP tile size must be >= 0 tokens, got {tile_tokens}")
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
    return torch.cat(
        [torch_checkpoint(forward, tile, use_reentrant=False) for tile in tiles], dim=1
    )


# ----------------------------------------------------------------------------------------
# Activation offload
# ----------------------------------------------------------------------------------------


class _Offloaded:
    """One saved tensor, copied to host memory in forward; `on_device` is its copy back
    (None until fetched), valid on the compute stream after `ready`."""

    __slots__ = ("host", "device", "block", "on_device", "ready", "__weakref__")


class _Offloader:
    """saved_tensors_hooks that move the large tensors saved inside the TransformerBlocks
    to pinned host memory on a side stream, and bring a block's tensors back during the
    backward of the block after it, so that both copies overlap compute.

    Streams: every device tensor involved is allocated on the compute stream, so the
    caching allocator keeps one pool (tensors allocated on a side stream would go to a
    second pool, which measured 97 GiB reserved for 31 GiB allocated). The side stream
    waits for the compute stream before each copy; `record_stream(side)` keeps a copy's
    source (device to host) or destination (host to device) from being reused before the
    copy is done; host to device follows device to host on the same stream; the compute
    stream waits on `ready` before it reads a fetched tensor. Without CUDA the "copies" are
    plain CPU copies without streams, so the bookkeeping runs, and is tested, the same way."""

    def __init__(self, min_bytes: int):
        self.min_bytes = min_bytes
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.device_type = "cuda" if self.cuda else "cpu"
        self.block: int | None = None  # the block whose forward is running
        self.blocks: dict[int, list[weakref.ref]] = {}  # block -> its offloaded tensors
        self.fetched: set[int] = set()
        # Tensors seen in the running block, by storage and view: wq, wk and wv save the
        # same input, which is copied once. The references keep addresses from being reused.
        self.seen: dict[tuple, tuple[torch.Tensor, _Offloaded]] = {}
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0

    def _side_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

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
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if key in self.seen:
            return self.seen[key][1]
        saved = _Offloaded()
        # Keep the layout (a transposed view stays transposed) when the view covers its
        # whole storage; otherwise a contiguous copy.
        dense = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes
        shape_args = (tensor.shape, tensor.stride()) if dense else (tensor.shape,)
        make = torch.empty_strided if dense else torch.empty
        saved.host = make(*shape_args, dtype=tensor.dtype, device="cpu", pin_memory=self.cuda)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
            tensor.record_stream(self.stream)
        with self._side_stream():
            saved.host.copy_(tensor, non_blocking=self.cuda)
        saved.device = tensor.device
        saved.block = self.block
        saved.on_device = None
        self.seen[key] = (tensor, saved)
        self.blocks.setdefault(self.block, []).append(weakref.ref(saved))
        self.offloaded_bytes += nbytes
        self.offloaded_tensors += 1
        return saved

    def _fetch(self, saved: _Offloaded) -> None:
        if not self.cuda:
            saved.on_device = saved.host
            return
        # Allocated on the compute stream, whose queued work may still use that memory.
        saved.on_device = torch.empty_like(saved.host, device=saved.device)
        self.stream.wait_stream(torch.cuda.current_stream())
        with self._side_stream():
            saved.on_device.copy_(saved.host, non_blocking=True)
            saved.ready = self.stream.record_event()
        saved.on_device.record_stream(self.stream)

    def _fetch_block(self, block: int) -> None:
        if block in self.fetched or block not in self.blocks:
            return
        self.fetched.add(block)
        for ref in self.blocks[block]:
            if (saved := ref()) is not None and saved.on_device is None:
                self._fetch(saved)

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        self._fetch_block(saved.block)
        self._fetch_block(saved.block - 1)  # the next block in backward order: prefetch
        if self.cuda:
            torch.cuda.current_stream().wait_event(saved.ready)
        # The device copy lives as long as autograd keeps `saved` (several nodes may
        # unpack it), i.e. until the block's backward is done with it.
        return saved.on_device


@contextlib.contextmanager
def activation_offload(
    model: Llama, enabled: bool = True, min_bytes: int = 2**20
) -> Iterator[_Offloader | None]:
    """While active (around forward), tensors that the TransformerBlocks save for backward
    go to pinned host memory: with full checkpointing the block inputs, without it every
    saved activation (with selective, the block inputs: the kept op outputs stay on the
    GPU). Tensors under `min_bytes` and weights stay where they are, and so does all of the
    last block: backward needs it first, so copying it out and back would only stall.
    Yields the offloader (its `offloaded_bytes`, `offloaded_tensors`), or None.

    The copies run at the host link's speed, and a block's memory is freed only once its
    copy is done, so offload pays when a block computes longer than it takes to move what
    it saves: with full checkpointing (the inputs only) it cost 0.5% of step time on an
    H200; without checkpointing the step took 1.95x as long (bench/RESULTS.md)."""
    if not enabled:
        yield None
        return
    offloader = _Offloader(min_bytes)
    handles = []
    for i, block in enumerate(model.layers[:-1]):
        enter = functools.partial(offloader.enter_block, i)
        handles.append(block.register_forward_pre_hook(enter, prepend=True))
        handles.append(block.register_forward_hook(offloader.exit_block, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            yield offloader
    finally:
        for handle in handles:
            handle.remove()

"""Attention over packed documents and within sliding windows: the kernel each mask picks
(SDPA's backends, FlexAttention compiled with the GPU's tiles) and the masks, built per tile so
that nothing sequence x sequence exists on the GPU; gpt-oss's attention sinks
(`attention_with_sinks`). model.py's Attention calls `attention_kernel`; `Llama.attention_mask`
builds `Masks` once per forward. It imports no other file of longtune."""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

# Attention backends by name. "auto" tries cuDNN first, the fastest at long sequences on
# Hopper (bench/RESULTS.md, "Attention backends"); SDPA skips those that cannot take the input.
_SDPA = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SDPA_BACKENDS = {"auto": list(_SDPA.values())} | {name: [b] for name, b in _SDPA.items()}
CUDA_ONLY_BACKENDS = ("cudnn", "efficient")  # no CPU kernel: a run without a GPU is refused


# FlexAttention's tiles where they beat its defaults (bench/RESULTS.md, "FlexAttention's
# kernel options" and "FlexAttention's backward tiles"), measured on Hopper only (other GPUs
# have less shared memory): the forward's, queries x keys, up to head dim 128 (faster at 64,
# the same at 128; at Gemma 3's 256 it needs more shared memory than an SM has, and fails to
# compile); the backward's (M1/N1: dK and dV's pass, M2/N2: dQ's) at head dim 64 (at 128 they
# are slower).
FLEX_FORWARD_TILE_HEAD_DIM_UP_TO_128 = {"BLOCK_M": 128, "BLOCK_N": 64}
FLEX_BACKWARD_TILE_HEAD_DIM_64 = {
    "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
    "bwd_num_warps": 4, "bwd_num_stages": 3,
}  # fmt: skip


@functools.cache
def compiled_flex_attention() -> Callable:
    """flex_attention with the GPU's tiles, compiled (it runs fast only as one Triton kernel
    that skips the masked blocks) on first use, so importing the model loads no compiler."""
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q, k, v, block_mask: BlockMask, enable_gqa: bool, return_lse: bool = False):
        """The output, or with `return_lse` (output, its AuxOutput holding the logsumexp
        [B, H, S])."""
        options = flex_tiles(q.device, q.shape[-1]) if q.is_cuda else None
        return compiled(
            q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=options,
            return_aux=AuxRequest(lse=True) if return_lse else None,
        )  # fmt: skip

    return attend


@functools.cache
def flex_tiles(device: torch.device, head_dim: int) -> dict[str, int]:
    if torch.cuda.get_device_capability(device)[0] != 9:
        return {}
    forward = FLEX_FORWARD_TILE_HEAD_DIM_UP_TO_128 if head_dim <= 128 else {}
    backward = FLEX_BACKWARD_TILE_HEAD_DIM_64 if head_dim == 64 else {}
    return {**forward, **backward}


# FlexAttention's mask tile, queries x keys: each is skipped, computed whole or masked per element.
FLEX_BLOCK = 128

# Packed documents at least this long attend through SDPA's causal kernel (cuDNN), shorter ones
# through FlexAttention (bench/RESULTS.md, "Packed documents at the speed of the dense kernels").
LONG_DOCUMENT = 16384


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S]: which packed document each token is in, counted from 0 in each row
    (a document starts where its position is 0, or at the row's start). Nondecreasing."""
    restarts = positions == 0
    return restarts.cumsum(dim=-1) - restarts[:, :1].to(positions.dtype)


def document_starts(positions: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """[B, S] -> per row, 0 (a row may begin inside a document) and each later 0's offset. On
    the host: the model picks its attention kernels by it, which on a GPU tensor would wait."""
    positions = positions.cpu()
    return tuple((0, *(1 + torch.nonzero(row[1:] == 0).flatten()).tolist()) for row in positions)


def causal_prefix(length: int) -> int:
    """How many of a long document's first rows SDPA's causal kernel takes: `length` rounded
    down to a 32nd of its power of two, so that SDPA meets few shapes (cuDNN plans each new
    one). The rest, at most 1/32, go through FlexAttention."""
    step = max(1, (1 << (length.bit_length() - 1)) // 32)
    return length // step * step


@dataclass(frozen=True)
class PackedRows:
    """Attention over rows of packed documents (`packed_rows`). `prefixes`: per row, the
    (start, end) of each long document's `causal_prefix`, attended alone by SDPA's causal
    kernel. `short`: every other row's mask, FlexAttention's block mask on CUDA (skipping the
    prefixes' query tiles), else dense; None when the prefixes cover every row."""

    short: BlockMask | torch.Tensor | None
    prefixes: tuple[tuple[tuple[int, int], ...], ...]


def packed_rows(
    positions: torch.Tensor, starts: tuple[tuple[int, ...], ...], long_document: int
) -> PackedRows | None:
    """PackedRows for documents that start at `starts`; None where no row holds several."""
    if all(len(row) == 1 for row in starts):
        return None
    bsz, seq_len = positions.shape
    prefixes = tuple(
        tuple(
            (start, start + causal_prefix(end - start))
            for start, end in zip(row, (*row[1:], seq_len), strict=True)
            if end - start >= long_document
        )
        for row in starts
    )
    in_prefixes = torch.zeros(bsz, seq_len, dtype=torch.bool)
    for b, spans in enumerate(prefixes):
        for start, end in spans:
            in_prefixes[b, start:end] = True
    if in_prefixes.all():
        return PackedRows(None, prefixes)
    if positions.is_cuda:
        in_prefixes = in_prefixes.to(positions.device, non_blocking=True)
        return PackedRows(document_block_mask(positions, in_prefixes), prefixes)
    return PackedRows(dense_document_mask(positions), prefixes)


@dataclass(frozen=True)
class Masks:
    """Every block's attention mask (`Llama.attention_mask`): `causal` the causal layers'
    (None: SDPA's causal kernel; with attention sinks, window_mask's without a window),
    `windowed` the window_layers' (the same where no row is longer than the window)."""

    causal: torch.Tensor | BlockMask | PackedRows | None
    windowed: torch.Tensor | BlockMask | PackedRows | None


def window_mask(positions: torch.Tensor, window: int | None) -> torch.Tensor | BlockMask:
    """Causal attention within `window` (None: none) and each document (positions [B, S]):
    FlexAttention's block mask on CUDA, which skips the tiles outside the window, else dense.
    No long document's prefix goes through SDPA's causal kernel: it has no window (nor the
    logsumexp that attention sinks need)."""
    if positions.is_cuda:
        return document_block_mask(positions, window=window)
    return dense_document_mask(positions, window)


def document_block_mask(
    positions: torch.Tensor, skip: torch.Tensor | None = None, window: int | None = None
) -> BlockMask:
    """FlexAttention's mask for causal attention inside each packed document (positions:
    [B, S]), built per FLEX_BLOCK tile: nothing S x S exists, only [B, S/128, S/128] booleans.

    Documents are contiguous and numbered in order, so query tile i and key tile j < i share a
    document exactly when the key tile's last document is the query tile's first. Such a tile
    is "full" inside that one document; the diagonal and tiles a document starts in are
    "partial" (masked per element); the rest are skipped, as are query tiles holding only
    `skip` rows ([B, S]). Padding to whole tiles is a document of its own. With a `window`,
    a query attends only keys less than `window` before it: tiles wholly before that are
    skipped, tiles it crosses are partial."""
    bsz, seq_len = positions.shape
    n_tiles = -(-seq_len // FLEX_BLOCK)
    pad = n_tiles * FLEX_BLOCK - seq_len
    document = F.pad(document_ids(positions), (0, pad), value=seq_len)  # [B, n_tiles * 128]
    tiles = document.view(bsz, n_tiles, FLEX_BLOCK)
    first, last = tiles[..., 0], tiles[..., -1]  # [B, n_tiles]
    q_first, q_last = first[:, :, None], last[:, :, None]
    k_first, k_last = first[:, None, :], last[:, None, :]
    tile = torch.arange(n_tiles, device=positions.device)
    causal = tile[:, None] >= tile[None, :]
    shares_document = causal & (k_last >= q_first)  # [B, n_tiles (queries), n_tiles (keys)]
    below_diagonal = tile[:, None] > tile[None, :]
    full = below_diagonal & (k_first == k_last) & (k_last == q_first) & (q_first == q_last)
    if window is not None:  # the tiles' nearest and farthest (query, key) distances
        nearest = (tile[:, None] - tile[None, :] - 1) * FLEX_BLOCK + 1
        shares_document = shares_document & (nearest < window)
        full = full & (nearest + 2 * FLEX_BLOCK - 2 < window)
    partial = shares_document & ~full
    if skip is not None:
        skipped = F.pad(skip, (0, pad), value=False).view(bsz, n_tiles, FLEX_BLOCK).all(dim=-1)
        full, partial = full & ~skipped[:, :, None], partial & ~skipped[:, :, None]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document[b, q_idx] == document[b, kv_idx])

    def same_document_in_window(b, h, q_idx, kv_idx):
        return same_document_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    return BlockMask.from_kv_blocks(
        *_tile_indices(partial),
        *_tile_indices(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_document_causal if window is None else same_document_in_window,
        seq_lengths=(seq_len, seq_len),
    )


def _tile_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Q, K] booleans -> BlockMask's (number of key tiles [B, 1, Q], their indices in
    increasing order first [B, 1, Q, K]), int32."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return count[:, None], order.to(torch.int32)[:, None]


def dense_document_mask(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """`document_block_mask` element by element, [B, 1, S, S] booleans for SDPA: CPU runs use
    it, FlexAttention having no CPU backward (the tests compare the two)."""
    seq_len = positions.shape[1]
    document = document_ids(positions)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)  # keys less than `window` before the query
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


def attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask | PackedRows | None,
    sdpa_backends: list[SDPBackend],
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, H, S, Dh] -> [B, H, S, Dh] (k, v may have fewer heads) by the kernel `mask` picks;
    with `sinks` [H], attention_with_sinks."""
    if sinks is not None:
        return attention_with_sinks(q, k, v, mask, sinks)
    if isinstance(mask, PackedRows):
        return packed_attention(q, k, v, mask, sdpa_backends)
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)
    # The backend is chosen inside forward so that a checkpointed forward recomputed in
    # backward takes the same one (a cuDNN forward recomputed by flash fails).
    with sdpa_kernel(sdpa_backends, set_priority=True):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
        )


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """gpt-oss's attention: a learned logit per head (`sinks` [H]) in each softmax's
    denominator, so that a query may attend to nothing. With lse the logsumexp of a query's
    scores, that softmax is the plain one times exp(lse) / (exp(lse) + exp(sink)), that is
    sigmoid(lse - sink): the kernel's output rescaled, differentiably in q, k and the sinks.
    The logsumexp comes from FlexAttention (a BlockMask, on CUDA) or from the scores computed
    whole under a dense mask (the CPU's, S x S: for tests and short rows)."""
    if isinstance(mask, BlockMask):
        gqa = q.shape[1] != k.shape[1]
        out, aux = compiled_flex_attention()(q, k, v, mask, gqa, return_lse=True)
        lse = aux.lse
    else:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~mask, -math.inf)
        lse = scores.logsumexp(dim=-1)  # [B, H, S]
        out = torch.exp(scores - lse[..., None]).to(v.dtype) @ v
    return out * torch.sigmoid(lse - sinks.float()[:, None]).to(out.dtype)[..., None]


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: PackedRows,
    sdpa_backends: list[SDPBackend],
) -> torch.Tensor:
    """Attention over PackedRows. A prefix's rows are its document's first, so the causal
    kernel on their slice of the row gives them what the document mask would."""
    short = None if rows.short is None else attention_kernel(q, k, v, rows.short, sdpa_backends)
    if not any(rows.prefixes):
        return short
    spans = [(b, start, end) for b, row in enumerate(rows.prefixes) for start, end in row]
    prefixes = [
        attention_kernel(*(t[b : b + 1, :, start:end] for t in (q, k, v)), None, sdpa_backends)
        for b, start, end in spans
    ]
    bsz, n_heads, seq_len, head_dim = q.shape
    return _JoinPrefixes.apply(spans, (bsz, seq_len, n_heads, head_dim), short, *prefixes)


class _JoinPrefixes(torch.autograd.Function):
    """The attention output [B, H, S, Dh]: the prefixes' rows from `prefixes`, the others from
    `short` (None when the prefixes cover every row: a new [B, S, H, Dh] `shape`, transposed).
    Written into `short` itself, which the mask kernel's node saved: a copy would hold a third
    output-sized tensor per block under checkpointing's kept attention (offload._KeptAttention).
    That backward reads the output only via rowsum(output * gradient), zero on the prefixes'
    rows, so their values there do not matter; writing via `.data` keeps the saved version."""

    @staticmethod
    def forward(ctx, spans, shape, short, *prefixes):
        ctx.spans = spans
        out = prefixes[0].new_empty(shape).transpose(1, 2) if short is None else short
        for (b, start, end), prefix in zip(spans, prefixes, strict=True):
            out.data[b, :, start:end] = prefix[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_short = None
        if ctx.needs_input_grad[2]:
            grad_short = grad.clone()
            for b, start, end in ctx.spans:
                grad_short[b, :, start:end] = 0
        prefixes = (grad[b : b + 1, :, start:end] for b, start, end in ctx.spans)
        return None, None, grad_short, *prefixes

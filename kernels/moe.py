"""Mixture-of-experts experts: each token through the k experts its router chose, each expert a
SwiGLU of its own, added with the router's weights:
    y[t] = sum_j weights[t, j] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = experts[t, j]
x [T, D] (the tokens flattened); experts [T, k], integers in [0, E) (not checked: that would
need a host sync); weights [T, k], in x's dtype or fp32; w1 (gate) and w3 (up) [E, F, D], w2
(down) [E, D, F], as moe.py's MoE holds them. gpt-oss's experts add `biases` (b1, b3 [E, F],
b2 [E, D]) to their products and a clamped SwiGLU in place of SwiGLU (`activation`
"clamped_swiglu": kernels/swiglu.py's).
LoRA on the experts (`ExpertLoRA`) adds each expert's own low-rank products to its gate, up and
down products, computed on the same sorted rows: W[e] + scale * B[e] A[e] is never formed.

`moe_experts` works on the T*k rows of the (token, choice) pairs, sorted by expert so that each
expert's rows are contiguous:
    sort_by_expert  each pair's row in expert order (a stable counting sort: two Triton kernels
                    and a cumsum) and the experts' row offsets [E + 1]
    dispatch        x's rows copied to their pairs' rows, [T*k, D]
    grouped_mm      each expert's rows times its own weights: w1 and w3, the activation's
                    fused kernel (kernels/swiglu.py), then w2; a Triton grouped GEMM whose
                    programs find their expert in the offsets (dispatch_gate_up: dispatch and
                    the w1 and w3 products in one autograd Function, whose backward never adds
                    their [T*k, D] gradients); gpt-oss's biases added to the products in place
                    (add_expert_bias_)
    combine         y[t] = sum_j weights[t, j] * rows[position[t, j]]: a gather, the same sum
                    on every run (a scatter-add with atomics would not be)
Nothing on the way reads a value back to the host (no .item(), .tolist(), nonzero or
torch.bincount, whose CUDA version reads its input's max): the counts and offsets stay tensors
on the device, so a layer never waits for the GPU.

grouped_mm's products run in torch._grouped_mm (CUTLASS's grouped GEMM) where it exists, on
Hopper's bf16: at Qwen3-30B-A3B's shapes it measured 629-710 TFLOP/s against 376-598 for the
Triton kernel's best tiles (bench/RESULTS.md, "The grouped products' tiles"). The Triton kernel
runs elsewhere (other GPUs, fp32, the CPU interpreter), with the tiles that measured best.

Read in order: `moe_experts_reference`; then for each step its reference, its Triton kernels,
its autograd Function and its public function; and last `dispatch_gate_up` and `moe_experts`,
which takes the reference's arguments.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels.swiglu import clamped_swiglu, clamped_swiglu_reference, swiglu, swiglu_reference

# The experts' activations by name (`activation`): each one's fused kernel and its reference.
ACTIVATIONS = {
    "swiglu": (swiglu, swiglu_reference),
    "clamped_swiglu": (clamped_swiglu, clamped_swiglu_reference),  # gpt-oss's
}


def activation_problems(name: str) -> list[str]:
    """An `activation` not in ACTIVATIONS, said with the names it takes (else nothing)."""
    if name in ACTIVATIONS:
        return []
    return [f"activation {name!r}, expected one of {', '.join(ACTIVATIONS)}"]


class ExpertLoRA(NamedTuple):
    """LoRA's adapters on each expert's projections, as PEFT puts them on transformers' fused
    gate_up_proj and down_proj (one A for gate and up, whose B is that tensor's two halves):
        gate += scale * B1[e] A13[e] x,  up += scale * B3[e] A13[e] x
        out += scale * B2[e] A2[e] hidden
    a13 [E, r, D], b1 and b3 [E, F, r] (None: gate and up take none); a2 [E, r, F], b2 [E, D, r]
    (None: down takes none); in x's dtype."""

    scale: float
    a13: torch.Tensor | None
    b1: torch.Tensor | None
    b3: torch.Tensor | None
    a2: torch.Tensor | None
    b2: torch.Tensor | None


def moe_experts_reference(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: str = "swiglu",
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """The experts in plain PyTorch, a loop over experts; returns x's dtype. Each expert's
    tokens are found with nonzero, which reads their count on the host: a wait for the GPU
    per expert."""
    if problems := activation_problems(activation):
        raise ValueError(f"moe_experts_reference: {problems[0]}")
    _, reference = ACTIVATIONS[activation]
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, choice = (experts == e).nonzero(as_tuple=True)
        gate, up = x[token] @ w1[e].t(), x[token] @ w3[e].t()
        if lora is not None and lora.a13 is not None:
            low = x[token] @ lora.a13[e].t()
            gate = gate + lora.scale * (low @ lora.b1[e].t())
            up = up + lora.scale * (low @ lora.b3[e].t())
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[1][e]
        hidden = reference(gate, up)
        out = hidden @ w2[e].t() + (0 if biases is None else biases[2][e])
        if lora is not None and lora.a2 is not None:
            out = out + lora.scale * ((hidden @ lora.a2[e].t()) @ lora.b2[e].t())
        y = y.index_add(0, token, (weights[token, choice, None] * out).to(x.dtype))
    return y


# ----------------------------------------------------------------------------------------
# sort_by_expert: where each (token, choice) pair's row goes
# ----------------------------------------------------------------------------------------


def sort_by_expert_reference(
    experts: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (position [T, k], offsets [E + 1]), both int32. position[t, j] is the
    row of pair (t, j) once the T*k pairs are sorted by expert, stably (within an expert by
    token, then by choice); expert e's rows are offsets[e] to offsets[e + 1] - 1."""
    order = experts.flatten().argsort(stable=True)
    position = order.argsort()  # the inverse permutation: pair -> row
    offsets = F.pad(torch.bincount(experts.flatten(), minlength=n_experts).cumsum(0), (1, 0))
    return position.view(experts.shape).int(), offsets.int()


def _pairs_config(n_experts: int) -> tuple[int, int]:
    """(e_pad, block): a program of the sort compares `block` pairs with every expert, a
    [block, e_pad] one-hot of about 4096 int32 (rms_norm's step), at least 16 pairs. The
    counts between the two passes are then [E, pairs / block] int32: 16 MiB at 128 experts
    and a million pairs (Qwen3-30B-A3B's k = 8 at 131072 tokens)."""
    e_pad = triton.next_power_of_2(n_experts)
    return e_pad, max(4096 // e_pad, 16)


@triton.jit
def _one_hot(experts_ptr, n_pairs, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """This program's block of pairs: (pairs, their mask, their experts, and the experts'
    one-hot [BLOCK, E_PAD] as int32, all zero for the masked pairs past the end)."""
    pairs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = pairs < n_pairs
    expert = tl.load(experts_ptr + pairs, mask=mask, other=-1).to(tl.int32)
    one_hot = (expert[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    return pairs, mask, expert, one_hot


@triton.jit
def _block_counts_kernel(
    experts_ptr, counts_ptr, n_pairs, n_experts, n_blocks, E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """counts[e, b] = the number of block b's pairs (b * BLOCK to (b + 1) * BLOCK - 1, in the
    flattened [T, k] order) routed to expert e."""
    _, _, _, one_hot = _one_hot(experts_ptr, n_pairs, E_PAD, BLOCK)
    e = tl.arange(0, E_PAD)
    tl.store(
        counts_ptr + e * n_blocks + tl.program_id(0), tl.sum(one_hot, axis=0), mask=e < n_experts
    )


@triton.jit
def _positions_kernel(
    experts_ptr, starts_ptr, position_ptr, n_pairs, n_blocks, E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """For pair i of block b, routed to e: position[i] = starts[e, b] + the pairs of block b
    before i routed to e too, counted by a running sum of the one-hot down the block.
    starts[e, b], the first row of block b's pairs of e, comes from the counts."""
    pairs, mask, expert, one_hot = _one_hot(experts_ptr, n_pairs, E_PAD, BLOCK)
    before = tl.sum((tl.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)
    start = tl.load(starts_ptr + expert * n_blocks + tl.program_id(0), mask=mask, other=0)
    tl.store(position_ptr + pairs, start + before, mask=mask)


def sort_by_expert(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sort_by_expert_reference's (position, offsets), on the device: a counting sort, which
    for E small integer keys takes two passes over them, stable by construction and without
    atomics. counts = offsets.diff()."""
    experts = experts.contiguous()
    n_pairs = experts.numel()
    e_pad, block = _pairs_config(n_experts)
    n_blocks = triton.cdiv(n_pairs, block)
    counts = torch.empty(n_experts, n_blocks, dtype=torch.int32, device=experts.device)
    _block_counts_kernel[(n_blocks,)](
        experts, counts, n_pairs, n_experts, n_blocks, E_PAD=e_pad, BLOCK=block
    )
    # Read in (expert, block) order, the exclusive running sum of the counts is each block's
    # first row for each expert: the rows of every expert before it, then of its own pairs in
    # the blocks before. Expert e's first row is its first block's.
    counts = counts.flatten()
    starts = counts.cumsum(0, dtype=torch.int32) - counts
    position = torch.empty(experts.shape, dtype=torch.int32, device=experts.device)
    _positions_kernel[(n_blocks,)](
        experts, starts, position, n_pairs, n_blocks, E_PAD=e_pad, BLOCK=block
    )
    return position, F.pad(starts[::n_blocks], (0, 1), value=n_pairs)


# ----------------------------------------------------------------------------------------
# dispatch and combine: x's rows into expert order, and the experts' rows back to tokens
# ----------------------------------------------------------------------------------------


def dispatch_reference(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> rows [T*k, D], rows[position[t, j]] = x[t]."""
    return x[position.flatten().argsort() // position.shape[1]]


def combine_reference(
    rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """rows [T*k, D] -> y [T, D], y[t] = sum_j weights[t, j] * rows[position[t, j]], in rows'
    dtype."""
    return (weights[..., None] * rows[position]).sum(1).to(rows.dtype)


def _rows_config(dim: int, k: int) -> tuple[int, int]:
    """(k_pad, block_d): the row kernels move a token's k rows block_d columns at a time, a
    [k_pad, block_d] tile of about 8192 elements: at k = 8 and dim 2048, the gather-sum moved
    4.4 TB/s, and 1.8 at half that tile (bench/RESULTS.md, "The grouped products' tiles")."""
    k_pad = triton.next_power_of_2(k)
    return k_pad, min(triton.next_power_of_2(dim), max(8192 // k_pad, 16))


@triton.jit
def _scatter_rows_kernel(
    src_ptr, position_ptr, weights_ptr, rows_ptr, out_ptr, dweights_ptr, dim, k,
    K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One token t a program; for each of its choices j, with p = position[t, j]:
        out[p] = weights[t, j] * src[t]        (weights None: src[t], dispatch's forward)
        dweights[t, j] = <src[t], rows[p]>     (where rows is given: combine's backward,
                                                src = dy, the router's gradient)
    in fp32, each stored in its tensor's dtype. position is a permutation, so each row of out
    is written by one program: no atomics.
    """
    t = tl.program_id(0).to(tl.int64)
    choices = tl.arange(0, K_PAD)
    choice_mask = choices < k
    p = tl.load(position_ptr + t * k + choices, mask=choice_mask, other=0).to(tl.int64)
    scale = tl.full([K_PAD], 1.0, tl.float32)
    if weights_ptr is not None:
        scale = tl.load(weights_ptr + t * k + choices, mask=choice_mask, other=0.0).to(tl.float32)
    dot = tl.zeros([K_PAD], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = choice_mask[:, None] & (cols < dim)[None, :]
        src = tl.load(src_ptr + t * dim + cols, mask=cols < dim, other=0.0).to(tl.float32)
        out = scale[:, None] * src[None, :]
        tl.store(
            out_ptr + p[:, None] * dim + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
        )
        if rows_ptr is not None:
            rows = tl.load(rows_ptr + p[:, None] * dim + cols[None, :], mask=mask, other=0.0)
            dot += tl.sum(rows.to(tl.float32) * src[None, :], axis=1)
    if rows_ptr is not None:
        tl.store(
            dweights_ptr + t * k + choices, dot.to(dweights_ptr.dtype.element_ty), mask=choice_mask
        )


@triton.jit
def _gather_sum_kernel(
    src_ptr, position_ptr, weights_ptr, out_ptr, dim, k, K_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One token t a program: out[t] = sum_j weights[t, j] * src[position[t, j]] (weights
    None: the plain sum) in fp32, stored in out's dtype. combine's forward, and dispatch's
    backward: dx[t], the sum of the gradients of its k rows.
    """
    t = tl.program_id(0).to(tl.int64)
    choices = tl.arange(0, K_PAD)
    choice_mask = choices < k
    p = tl.load(position_ptr + t * k + choices, mask=choice_mask, other=0).to(tl.int64)
    scale = tl.full([K_PAD], 1.0, tl.float32)
    if weights_ptr is not None:
        scale = tl.load(weights_ptr + t * k + choices, mask=choice_mask, other=0.0).to(tl.float32)
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = choice_mask[:, None] & (cols < dim)[None, :]
        src = tl.load(src_ptr + p[:, None] * dim + cols[None, :], mask=mask, other=0.0)
        out = tl.sum(scale[:, None] * src.to(tl.float32), axis=0)
        tl.store(out_ptr + t * dim + cols, out.to(out_ptr.dtype.element_ty), mask=cols < dim)


def _per_token(kernel, position: torch.Tensor, dim: int, *tensors) -> None:
    """Launches a row kernel, one program a token, on `tensors` (None where it takes none)."""
    n_tokens, k = position.shape
    k_pad, block_d = _rows_config(dim, k)
    kernel[(n_tokens,)](*tensors, dim, k, K_PAD=k_pad, BLOCK_D=block_d)


def _dispatch(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """dispatch_reference's rows, without autograd (dispatch_gate_up's forward)."""
    x = x.contiguous()
    rows = x.new_empty(position.numel(), x.shape[1])
    _per_token(_scatter_rows_kernel, position, x.shape[1], x, position, None, None, rows, None)
    return rows


def _dispatch_backward(drows: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """dx [T, D]: each token's k rows' gradients summed."""
    dx = drows.new_empty(position.shape[0], drows.shape[1])
    _per_token(_gather_sum_kernel, position, dx.shape[1], drows.contiguous(), position, None, dx)
    return dx


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor):
        rows, weights = rows.contiguous(), weights.contiguous()
        y = rows.new_empty(position.shape[0], rows.shape[1])
        _per_token(_gather_sum_kernel, position, y.shape[1], rows, position, weights, y)
        ctx.save_for_backward(rows, position, weights)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        rows, position, weights = ctx.saved_tensors
        drows = torch.empty_like(rows)
        dweights = torch.empty_like(weights) if ctx.needs_input_grad[2] else None
        _per_token(
            _scatter_rows_kernel, position, rows.shape[1], dy.contiguous(), position, weights,
            rows if dweights is not None else None, drows, dweights,
        )  # fmt: skip
        return drows, None, dweights


def combine(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """combine_reference's y [T, D], with gradients for rows and the router's weights
    (dweights[t, j] = <dy[t], rows[position[t, j]]>), each in its own dtype."""
    return _Combine.apply(rows, position, weights)


# ----------------------------------------------------------------------------------------
# grouped_mm: each expert's rows times its own weights
# ----------------------------------------------------------------------------------------


def grouped_mm_reference(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [R, K], expert e's rows offsets[e] to offsets[e + 1] - 1; w [E, N, K] -> [R, N], each
    row times its expert's w[e]^T. A loop over experts that reads the offsets on the host."""
    bounds = offsets.tolist()
    return torch.cat([a[bounds[e] : bounds[e + 1]] @ w[e].t() for e in range(w.shape[0])])


# Tiles of the grouped products (BLOCK_M rows of one expert, BLOCK_N outputs, BLOCK_K of the
# inner dimension a step, warps, pipeline stages): the forward's and the weight gradient's that
# measured fastest on an H200 (bench/grouped_mm_tiles.py; bench/RESULTS.md). Each expert's last
# row tile is padded to BLOCK_M rows: much of the work when experts get few tokens each.
FORWARD_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
WEIGHT_GRAD_TILES = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b, accumulated in fp32; fp32 inputs multiplied in full fp32, as torch's
    default matmul (not TF32). UPCAST off the GPU: Triton's CPU interpreter multiplies bf16
    operands of tl.dot as their raw bits (triton-lang/triton#11584, not supported there), so
    the tiles are upcast to fp32 first, which is exact."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _grouped_mm_kernel(
    a_ptr, w_ptr, offsets_ptr, out_ptr, n_experts, N, K, stride_we, stride_wn, stride_wk,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """out[r] = w[e] @ a[r] for expert e's rows r, offsets[e] <= r < offsets[e + 1], stored in
    out's dtype. Each program a [BLOCK_M, BLOCK_N] tile of one expert's rows. The row tiles are
    numbered expert after expert, cdiv(count_e, BLOCK_M) of them for expert e, so a program
    finds its expert and first row in the offsets. The grid holds as many row tiles as any
    routing can need; the programs past the last tile compute nothing.
    """
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m = tl.program_id(0) // tiles_n
    tile_n = tl.program_id(0) % tiles_n
    experts = tl.arange(0, E_PAD)
    starts = tl.load(offsets_ptr + experts, mask=experts < n_experts, other=0)
    ends = tl.load(offsets_ptr + experts + 1, mask=experts < n_experts, other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tile_ends = tl.cumsum(tiles, axis=0)
    # The one expert whose tiles hold tile_m (none past the last tile: then no rows).
    mine = (tile_ends - tiles <= tile_m) & (tile_m < tile_ends)
    e = tl.sum(tl.where(mine, experts, 0), axis=0)
    first = tl.sum(tl.where(mine, starts + (tile_m - tile_ends + tiles) * BLOCK_M, 0), axis=0)
    end = tl.sum(tl.where(mine, ends, 0), axis=0)

    rows = first + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < end, cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + inner[None, :]
    w_ptrs = (
        w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn + inner[:, None] * stride_wk
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.where(first < end, K, 0), BLOCK_K):
        k_mask = k + inner < K
        a = tl.load(a_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k * stride_wk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, w, acc, UPCAST)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_mm_weight_grad_kernel(
    dout_ptr, a_ptr, offsets_ptr, dw_ptr, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """dw[e] = dout[rows of e]^T @ a[rows of e], [N, K] for each expert (zero for one without
    rows), summed in fp32 over the expert's rows BLOCK_M at a time and stored in dw's dtype.
    Each program one [BLOCK_N, BLOCK_K] tile of one expert's dw.
    """
    tiles_n, tiles_k = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    e = tl.program_id(0) // (tiles_n * tiles_k)
    cols_n = (tl.program_id(0) // tiles_k % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = (tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = cols_n < N, cols_k < K
    first, end = tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(first, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = (rows < end)[:, None]
        rows = rows.to(tl.int64)[:, None]
        dout = tl.load(
            dout_ptr + rows * N + cols_n[None, :], mask=row_mask & n_mask[None, :], other=0.0
        )
        a = tl.load(a_ptr + rows * K + cols_k[None, :], mask=row_mask & k_mask[None, :], other=0.0)
        acc = _dot(tl.trans(dout), a, acc, UPCAST)
    dw_ptrs = dw_ptr + e.to(tl.int64) * N * K + cols_n[:, None] * K + cols_k[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def _on_cutlass(a: torch.Tensor, n: int) -> bool:
    """Whether torch._grouped_mm takes a's product to n outputs: bf16 on Hopper (sm90) or
    later, rows of 16-byte multiples."""
    return (
        a.is_cuda
        and a.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(a.device) >= (9, 0)
        and a.shape[1] % 8 == 0
        and n % 8 == 0
    )


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The forward product: a [R, K] contiguous, w [E, N, K] of any strides."""
    if _on_cutlass(a, w.shape[1]):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offsets[1:])
    n_experts, n, k = w.shape
    out = a.new_empty(a.shape[0], n)
    # Each expert's last row tile may be partial: at most E - 1 tiles more than R rows fill.
    tiles_m = triton.cdiv(a.shape[0], FORWARD_TILES["BLOCK_M"]) + n_experts - 1
    _grouped_mm_kernel[(tiles_m * triton.cdiv(n, FORWARD_TILES["BLOCK_N"]),)](
        a, w, offsets, out, n_experts, n, k, *w.stride(),
        E_PAD=triton.next_power_of_2(n_experts), UPCAST=a.device.type != "cuda", **FORWARD_TILES,
    )  # fmt: skip
    return out


def _grouped_mm_weight_grad(
    dout: torch.Tensor, a: torch.Tensor, offsets: torch.Tensor, n_experts: int
):
    """dw [E, N, K] from dout [R, N] and a [R, K], both contiguous."""
    if _on_cutlass(a, dout.shape[1]):  # the offsets split the inner dimension, the rows
        return torch._grouped_mm(dout.t(), a, offs=offsets[1:])
    n, k = dout.shape[1], a.shape[1]
    dw = a.new_empty(n_experts, n, k)
    tiles = triton.cdiv(n, WEIGHT_GRAD_TILES["BLOCK_N"]) * triton.cdiv(
        k, WEIGHT_GRAD_TILES["BLOCK_K"]
    )
    _grouped_mm_weight_grad_kernel[(n_experts * tiles,)](
        dout, a, offsets, dw, n, k, UPCAST=a.device.type != "cuda", **WEIGHT_GRAD_TILES
    )
    return dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        a = a.contiguous()
        ctx.save_for_backward(a, w, offsets)
        return _grouped_mm(a, w, offsets)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        a, w, offsets = ctx.saved_tensors
        dout = dout.contiguous()
        # da = dout @ w[e] for each expert: the same product with w seen transposed, [E, K, N].
        da = _grouped_mm(dout, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = _grouped_mm_weight_grad(dout, a, offsets, w.shape[0]).to(w.dtype)
        return da, dw, None


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grouped_mm_reference's [R, N] for a [R, K] sorted by expert, w [E, N, K] in a's dtype and
    sort_by_expert's offsets (int32 [E + 1], offsets[E] = R), without reading the offsets on
    the host; gradients for a and w."""
    problems = []
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2]:
        problems.append(f"a {tuple(a.shape)} and w {tuple(w.shape)}, expected [R, K] and [E, N, K]")
    if a.dtype != w.dtype:
        problems.append(f"a {a.dtype} and w {w.dtype}, expected one dtype")
    if offsets.shape != (w.shape[0] + 1,) or offsets.dtype != torch.int32:
        problems.append(f"offsets {tuple(offsets.shape)} {offsets.dtype}, expected int32 [E + 1]")
    if problems:
        raise ValueError("grouped_mm: " + "; ".join(problems))
    return _GroupedMM.apply(a, w, offsets)


# ----------------------------------------------------------------------------------------
# add_expert_bias_: gpt-oss's biases, each sorted row's expert's, added in place
# ----------------------------------------------------------------------------------------


@triton.jit
def _add_expert_bias_kernel(
    rows_ptr, bias_ptr, offsets_ptr, n_rows, width, n_experts, E_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """rows[r] += bias[e] for a [BLOCK_R, BLOCK_C] tile, e the expert whose offsets hold r (the
    number of experts' ends at or before r), in fp32, stored in rows' dtype."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    e = tl.arange(0, E_PAD)
    ends = tl.load(offsets_ptr + 1 + e, mask=e < n_experts, other=n_rows + 1)
    # Rows past the last expert's (none in moe_experts) would read past the bias: clamped.
    expert = tl.minimum(tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1), n_experts - 1)
    mask = (r < n_rows)[:, None] & (c < width)[None, :]
    at = r[:, None] * width + c[None, :]
    bias = tl.load(bias_ptr + expert[:, None] * width + c[None, :], mask=mask, other=0.0)
    rows = tl.load(rows_ptr + at, mask=mask, other=0.0)
    total = rows.to(tl.float32) + bias.to(tl.float32)
    tl.store(rows_ptr + at, total.to(rows_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expert_bias_grad_kernel(
    drows_ptr, dbias_ptr, offsets_ptr, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    """dbias[e] = the sum of expert e's rows of drows, for a block of columns, in fp32: one
    program an expert's columns, its rows read in order (the same sum on every run)."""
    e = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start, end = tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    for first in range(start, end, BLOCK_R):
        r = first + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (r < end)[:, None] & (c < width)[None, :]
        drows = tl.load(drows_ptr + r[:, None] * width + c[None, :], mask=mask, other=0.0)
        total += tl.sum(drows.to(tl.float32), axis=0)
    tl.store(dbias_ptr + e * width + c, total, mask=c < width)


class _AddExpertBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor):
        n_rows, width = rows.shape
        block_c = min(triton.next_power_of_2(width), 128)
        grid = (triton.cdiv(n_rows, 32), triton.cdiv(width, block_c))
        _add_expert_bias_kernel[grid](
            rows, bias.contiguous(), offsets, n_rows, width, bias.shape[0],
            E_PAD=triton.next_power_of_2(bias.shape[0]), BLOCK_R=32, BLOCK_C=block_c,
        )  # fmt: skip
        ctx.mark_dirty(rows)
        ctx.save_for_backward(offsets)
        ctx.bias_dtype = bias.dtype
        return rows

    @staticmethod
    @once_differentiable
    def backward(ctx, drows: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        dbias = None
        if ctx.needs_input_grad[1]:
            drows = drows.contiguous()
            n_experts, width = offsets.shape[0] - 1, drows.shape[1]
            block_c = min(triton.next_power_of_2(width), 128)
            dbias = torch.empty(n_experts, width, dtype=torch.float32, device=drows.device)
            _expert_bias_grad_kernel[(n_experts, triton.cdiv(width, block_c))](
                drows, dbias, offsets, width, BLOCK_R=32, BLOCK_C=block_c
            )
            dbias = dbias.to(ctx.bias_dtype)
        return drows, dbias, None


def add_expert_bias_(rows: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [R, N] sorted by expert += bias [E, N] of each row's expert, in place: the
    reference's `rows + bias[expert]` without its [R, N] gather (gpt-oss's gate, up and down
    products, 8.4 GiB at 16 x 16384 tokens, measured: bench/RESULTS.md, "gpt-oss-20b on a
    GPU"); gradients for rows and the bias."""
    if not rows.is_contiguous():  # written in place, row after row
        raise ValueError(f"add_expert_bias_: rows {tuple(rows.shape)} must be contiguous")
    return _AddExpertBias.apply(rows, bias, offsets)


# ----------------------------------------------------------------------------------------
# The whole path
# ----------------------------------------------------------------------------------------


class _DispatchGateUp(torch.autograd.Function):
    """dispatch, then the gate and up products of the same rows, with ExpertLoRA's adapters on
    them (`a13`, `b1`, `b3`, `scale`; a13 None: none). In backward the input gradients go back
    through dispatch's gather-sum, each product's on its own (the adapters' added to the
    gate's), so the two are never added as [T*k, D] rows: that sum would cost a [T*k, D]
    buffer and three passes over one. Frozen weights (LoRA's base) take no gradient."""

    @staticmethod
    def forward(ctx, x, position, w1, w3, offsets, a13, b1, b3, scale):
        rows = _dispatch(x, position)
        gate, up = _grouped_mm(rows, w1, offsets), _grouped_mm(rows, w3, offsets)
        low = None
        if a13 is not None:  # [T*k, r]: rows times their expert's A, shared by gate and up
            low = _grouped_mm(rows, a13, offsets)
            gate.add_(_grouped_mm(low, b1, offsets), alpha=scale)
            up.add_(_grouped_mm(low, b3, offsets), alpha=scale)
        ctx.scale = scale
        ctx.save_for_backward(rows, position, w1, w3, offsets, a13, b1, b3, low)
        return gate, up

    @staticmethod
    @once_differentiable
    def backward(ctx, dgate: torch.Tensor, dup: torch.Tensor):
        rows, position, w1, w3, offsets, a13, b1, b3, low = ctx.saved_tensors
        dgate, dup = dgate.contiguous(), dup.contiguous()
        n_experts, needs = w1.shape[0], ctx.needs_input_grad
        dx = dw1 = dw3 = da13 = db1 = db3 = None
        dlow = None
        if a13 is not None:  # scale * (dgate B1[e] + dup B3[e]), [T*k, r]
            dlow = _grouped_mm(dgate, b1.transpose(1, 2), offsets)
            dlow = dlow.add_(_grouped_mm(dup, b3.transpose(1, 2), offsets)).mul_(ctx.scale)
            da13 = _grouped_mm_weight_grad(dlow, rows, offsets, n_experts).to(a13.dtype)
            db1, db3 = (
                _grouped_mm_weight_grad(d, low, offsets, n_experts).mul_(ctx.scale).to(b.dtype)
                for d, b in ((dgate, b1), (dup, b3))
            )
        if needs[0]:  # one [T*k, D] product alive at a time, each gather-summed into dx
            products = [(dgate, w1), (dup, w3)] + ([(dlow, a13)] if dlow is not None else [])
            for d, w in products:
                summed = _dispatch_backward(_grouped_mm(d, w.transpose(1, 2), offsets), position)
                dx = summed if dx is None else dx.add_(summed)
        if needs[2]:
            dw1 = _grouped_mm_weight_grad(dgate, rows, offsets, n_experts).to(w1.dtype)
        if needs[3]:
            dw3 = _grouped_mm_weight_grad(dup, rows, offsets, n_experts).to(w3.dtype)
        return dx, None, dw1, dw3, None, da13, db1, db3, None


def dispatch_gate_up(
    x: torch.Tensor, position: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offsets,
    lora: ExpertLoRA | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(gate, up) [T*k, F]: grouped_mm of dispatch_reference's rows by w1 and by w3 (and
    `lora`'s adapters on them), for sort_by_expert's position and offsets; gradients for x,
    w1, w3 and the adapters."""
    a13, b1, b3 = (None,) * 3 if lora is None else (lora.a13, lora.b1, lora.b3)
    scale = 0.0 if lora is None else lora.scale
    return _DispatchGateUp.apply(x, position, w1, w3, offsets, a13, b1, b3, scale)


def moe_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: str = "swiglu",
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """moe_experts_reference's y [T, D] in x's dtype, by the steps above, with no host sync;
    gradients for x, weights, w1, w3 and w2 (and the biases and adapters), each in its own
    dtype. Biases are added to the sorted rows in place (no selective checkpoint keeps a
    grouped product: offload.MATMUL_OPS), and the activation is its fused kernel; the
    adapters' products are grouped products of the same rows."""
    if experts.dim() != 2 or w1.dim() != 3:
        raise ValueError(
            f"moe_experts: experts {tuple(experts.shape)} and w1 {tuple(w1.shape)}, expected "
            "[T, k] and [E, F, D]"
        )
    (n_tokens, k), (n_experts, ffn_dim, dim) = experts.shape, w1.shape
    shapes = {
        "x": (x, (n_tokens, dim)),
        "weights": (weights, (n_tokens, k)),
        "w3": (w3, (n_experts, ffn_dim, dim)),
        "w2": (w2, (n_experts, dim, ffn_dim)),
    }
    pairs = () if lora is None else (("a13", "b1"), ("a13", "b3"), ("a2", "b2"))
    for a, b in pairs:  # A [E, r, in] and B [E, out, r] of one rank, given together or not
        a_t, b_t = getattr(lora, a), getattr(lora, b)
        if (a_t is None) != (b_t is None):
            raise ValueError(f"moe_experts: lora's {b} is given exactly when its {a} is")
        if a_t is not None:
            inner, outer = (dim, ffn_dim) if a == "a13" else (ffn_dim, dim)
            rank = a_t.shape[1] if a_t.dim() == 3 else 0
            shapes |= {a: (a_t, (n_experts, rank, inner)), b: (b_t, (n_experts, outer, rank))}
    problems = activation_problems(activation) + [
        f"{name} {tuple(t.shape)}, expected {shape}"
        for name, (t, shape) in shapes.items()
        if t.shape != shape
    ]
    adapters = [] if lora is None else zip(lora._fields[1:], lora[1:], strict=True)
    problems += [
        f"{name} {t.dtype}, expected x's {x.dtype}"
        for name, t in (("w1", w1), ("w3", w3), ("w2", w2), *adapters)
        if t is not None and t.dtype != x.dtype
    ]
    if weights.dtype not in (x.dtype, torch.float32):
        problems.append(f"weights {weights.dtype}, expected x's {x.dtype} or float32")
    if experts.dtype.is_floating_point or experts.dtype == torch.bool:
        problems.append(f"experts {experts.dtype}, expected integers")
    if problems:
        raise ValueError("moe_experts: " + "; ".join(problems))
    fused, _ = ACTIVATIONS[activation]
    position, offsets = sort_by_expert(experts, n_experts)
    gate, up = dispatch_gate_up(x, position, w1, w3, offsets, lora)
    if biases is not None:
        gate = add_expert_bias_(gate, biases[0], offsets)
        up = add_expert_bias_(up, biases[1], offsets)
    # The activation's backward may write the gradients over gate and up, read by nothing
    # else, as the dense MLP's does (model.triton_ops).
    hidden = fused(gate, up, overwrite=True)
    out = grouped_mm(hidden, w2, offsets)
    if lora is not None and lora.a2 is not None:
        low = grouped_mm(hidden, lora.a2, offsets)
        out = out.add_(grouped_mm(low, lora.b2, offsets), alpha=lora.scale)
    if biases is not None:
        out = add_expert_bias_(out, biases[2], offsets)
    return combine(out, position, weights)

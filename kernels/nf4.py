"""4-bit NormalFloat (NF4) weights with double-quantized scales, as QLoRA defines them
(Dettmers et al. 2023) and bitsandbytes stores them (`quantize_4bit(..., quant_type="nf4",
compress_statistics=True)`, block 64, scales' block 256): the same values bit for bit.

A weight W [N, K] (K a multiple of 64) is cut, in row-major order, into blocks of 64 values:
    absmax[b] = max |W in block b|                        (fp32)
    q = the index of the NF4 code value nearest to W / absmax[b]   (4 bits, two per byte;
        the first of a pair in the high nibble)
and the absmax values are quantized in turn ("double quantization"): their mean `offset`
is subtracted, then blocks of 256 of them are scaled by their own absmax (`absmax2`, fp32)
and rounded to the nearest of 256 values of bitsandbytes' signed dynamic 8-bit code. So:
    W[i] ~= NF4[q[i]] * (DYNAMIC[qabsmax[b]] * absmax2[b // 256] + offset),  b = i // 64
costing 4 + 8/64 + 32/(64 * 256) = 4.127 bits per weight.

Storage (`NF4Weight`): one row of bytes per row of W, [K/2 packed codes | K/64 qabsmax]
padded to a multiple of 4 bytes, viewed as the model's compute dtype. So FSDP2 shards it by
rows like any weight, and its mixed precision policy, which casts floating parameters to the
compute dtype, has nothing to cast (bitsandbytes' `quant_storage` does the same for FSDP).
The two small second-level tensors (absmax2, offset) are kept whole on every rank.

The matmul through a frozen NF4 weight takes one of two paths, the faster on the GPU: the
dequantization kernel writes W whole in the compute dtype for cuBLAS, or a Triton matmul
dequantizes each tile of W in registers as it loads it (`FUSED_MAX_ROWS` picks by the
number of tokens; `bench/kernels.py --only nf4` times both).

Read in order: the codes, quantization (PyTorch, once per weight as it is loaded), the
dequantization reference, the Triton dequantization kernel, the fused matmul kernel, and
`nf4_linear`, the matmul through a frozen NF4 weight, forward and backward (dx only).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 64  # values per absmax
SCALE_BLOCK = 256  # absmax values per second-level scale

# The 16 NF4 values: quantiles of N(0, 1) scaled to [-1, 1], with an exact 0 (QLoRA,
# appendix E; bitsandbytes' table, as fp32).
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit code (`create_dynamic_map()`, Dettmers 2015), the
    code of the double-quantized scales: for exponents e = 0..6, 2^e fractions (midpoints of
    linspace(0.1, 1, 2^e + 1)) times 10^(e - 6), both signs; then 0 and 1; sorted [256].
    Computed in the same fp32 steps, so the values are bitsandbytes' to the bit."""
    values = [0.0, 1.0]
    for e in range(7):
        boundaries = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        values += ((10 ** (e - 6)) * means).tolist() + ((-(10 ** (e - 6))) * means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


DYNAMIC_CODE = dynamic_code()


# ----------------------------------------------------------------------------------------
# Quantization (PyTorch; once per weight, as it is loaded)
# ----------------------------------------------------------------------------------------


def _nf4_index(scaled: torch.Tensor) -> torch.Tensor:
    """The NF4 code of each scaled value: how many of the 15 midpoints between consecutive
    code values (fp32) it exceeds, which is bitsandbytes' CUDA decision tree (`dQuantizeNF4`,
    whose thresholds are these midpoints) without the branches."""
    midpoints = (NF4_CODE[:-1] + NF4_CODE[1:]) * 0.5
    return torch.bucketize(scaled, midpoints.to(scaled.device)).to(torch.uint8)


def _dynamic_index(scaled: torch.Tensor) -> torch.Tensor:
    """The dynamic-code index of each scaled value, found as bitsandbytes' CUDA kernels find
    it (`dQuantize`): a binary search from index 127 in steps of 64, 32, ..., 1, then the
    nearer of the last pivot and the last pivot on the other side, compared with their fp32
    midpoint. That is the nearest value except on a tie, where the search path decides; the
    search itself is repeated here (7 steps over all values at once) to decide ties alike."""
    code = DYNAMIC_CODE.to(scaled.device)
    pivot = torch.full(scaled.shape, 127, dtype=torch.long, device=scaled.device)
    lower_pivot, upper_pivot = torch.zeros_like(pivot), torch.full_like(pivot, 255)
    lower, upper = torch.full_like(scaled, -1.0), torch.full_like(scaled, 1.0)
    value = code[pivot]
    for step in (64, 32, 16, 8, 4, 2, 1):
        above = scaled > value
        lower_pivot = torch.where(above, pivot, lower_pivot)
        lower = torch.where(above, value, lower)
        upper_pivot = torch.where(above, upper_pivot, pivot)
        upper = torch.where(above, upper, value)
        pivot = torch.where(above, pivot + step, pivot - step)
        value = code[pivot]
    upper = torch.where(upper_pivot == 255, code[255], upper)
    lower = torch.where(lower_pivot == 0, code[0], lower)
    above = scaled > value
    index = torch.where(
        above,
        torch.where(scaled > (upper + value) * 0.5, upper_pivot, pivot),
        torch.where(scaled < (lower + value) * 0.5, lower_pivot, pivot),
    )
    return index.to(torch.uint8)


def _blockwise_absmax_scaled(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax [n / block] fp32, x / absmax) over the flat fp32 x, as a multiplication by the
    reciprocal like bitsandbytes. An all-zero block scales to 0, so it dequantizes to zeros
    (bitsandbytes' CUDA kernel gets 0 * inf = NaN there, which its tree codes as -1)."""
    blocks = x.reshape(-1, block)
    absmax = blocks.abs().amax(dim=1)
    inverse = torch.where(absmax > 0, 1 / absmax, torch.zeros_like(absmax))
    return absmax, blocks * inverse[:, None]


@dataclass
class NF4Tensor:
    """A quantized [N, K] weight: `rows` [N, row_bytes] uint8 (packed codes, then qabsmax),
    `absmax2` [ceil(N*K/64/256)] fp32, `offset` [] fp32."""

    rows: torch.Tensor
    absmax2: torch.Tensor
    offset: torch.Tensor


def row_bytes(in_features: int) -> int:
    """Bytes per stored row: K/2 packed codes and K/64 quantized absmax values, padded to a
    multiple of 4 so the row can be viewed as bf16 or fp32."""
    return -(-(in_features // 2 + in_features // BLOCK) // 4) * 4


def check_quantizable(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 2 or shape[1] % BLOCK:
        raise ValueError(
            f"{name}: NF4 needs a matrix whose rows are a multiple of {BLOCK} values (blocks "
            f"of {BLOCK} within a row), got shape {tuple(shape)}"
        )


def quantize_nf4(weight: torch.Tensor) -> NF4Tensor:
    """Quantizes a [N, K] weight (any float dtype; computed in fp32 on its device)."""
    check_quantizable("weight", tuple(weight.shape))
    n, k = weight.shape
    absmax, scaled = _blockwise_absmax_scaled(weight.float(), BLOCK)
    codes = _nf4_index(scaled).reshape(n, k)
    packed = codes[:, 0::2] << 4 | codes[:, 1::2]  # [N, K/2]
    # Double quantization of the absmax values: minus their mean, blocks of 256 over the
    # flat [N * K/64] (bitsandbytes pads the last block; its padding is never read back).
    offset = absmax.mean()
    centered = absmax - offset
    pad = -centered.numel() % SCALE_BLOCK
    absmax2, scaled2 = _blockwise_absmax_scaled(F.pad(centered, (0, pad)), SCALE_BLOCK)
    qabsmax = _dynamic_index(scaled2.reshape(-1)[: centered.numel()]).reshape(n, -1)
    rows = torch.zeros(n, row_bytes(k), dtype=torch.uint8, device=weight.device)
    rows[:, : k // 2] = packed
    rows[:, k // 2 : k // 2 + k // BLOCK] = qabsmax
    return NF4Tensor(rows, absmax2, offset)


# ----------------------------------------------------------------------------------------
# Dequantization: the reference
# ----------------------------------------------------------------------------------------


def dequantize_nf4_reference(
    rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor, in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """W [N, K] in `dtype` from the stored rows (any dtype: read as bytes): the scale is
    computed in fp32 as a product, then a sum (each rounded, as bitsandbytes' two steps),
    times the NF4 value in fp32, rounded once to `dtype`."""
    k = in_features
    data = rows.view(torch.uint8).reshape(rows.shape[0], -1)
    packed = data[:, : k // 2].long()
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(data.shape[0], k)
    qabsmax = data[:, k // 2 : k // 2 + k // BLOCK].reshape(-1).long()
    second = torch.arange(qabsmax.numel(), device=rows.device) // SCALE_BLOCK
    absmax = DYNAMIC_CODE.to(rows.device)[qabsmax] * absmax2[second]
    absmax = (absmax + offset).reshape(data.shape[0], -1)
    values = NF4_CODE.to(rows.device)[codes].reshape(data.shape[0], -1, BLOCK)
    return (values * absmax[:, :, None]).reshape(data.shape[0], k).to(dtype)


def nf4_matmul_reference(
    a: torch.Tensor, rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
    in_features: int, w_transposed: bool,
) -> torch.Tensor:  # fmt: skip
    """a [M, K] @ W^T (w_transposed) or a [M, N] @ W, in a's dtype: W [N, K] dequantized
    whole by the reference, then PyTorch's matmul. The signature of every NF4 matmul here."""
    weight = dequantize_nf4_reference(rows, absmax2, offset, in_features, a.dtype)
    return a @ (weight.t() if w_transposed else weight)


# ----------------------------------------------------------------------------------------
# Dequantization: the Triton kernel
# ----------------------------------------------------------------------------------------


@triton.jit
def _four_values(nf4_ptr, bit0, bit1):
    """nf4_ptr[2 * bit1 + bit0] for each pair of bits, selected among 4 loaded scalars."""
    low = tl.where(bit0, tl.load(nf4_ptr + 1), tl.load(nf4_ptr))
    high = tl.where(bit0, tl.load(nf4_ptr + 3), tl.load(nf4_ptr + 2))
    return tl.where(bit1, high, low)


@triton.jit
def _nf4_values(codes, nf4_ptr, LOOKUP: tl.constexpr):
    """NF4[codes] in fp32. "table": a gather from the 16 values in memory (one load per code,
    from L1). "select": a tree of 15 selections on the code's 4 bits among the 16 values
    loaded once as scalars: no memory access per code, more arithmetic."""
    if LOOKUP == "table":
        values = tl.load(nf4_ptr + codes)
    else:
        bit0, bit1 = (codes & 1) != 0, (codes & 2) != 0
        below_8 = tl.where(
            (codes & 4) != 0,
            _four_values(nf4_ptr + 4, bit0, bit1),
            _four_values(nf4_ptr, bit0, bit1),
        )
        from_8 = tl.where(
            (codes & 4) != 0,
            _four_values(nf4_ptr + 12, bit0, bit1),
            _four_values(nf4_ptr + 8, bit0, bit1),
        )
        values = tl.where((codes & 8) != 0, from_8, below_8)
    return values


@triton.jit
def _dequantize_nf4_kernel(
    rows_ptr, absmax2_ptr, offset_ptr, nf4_ptr, dynamic_ptr, out_ptr,
    n_blocks, blocks_per_row, row_bytes, BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, LOOKUP: tl.constexpr,
):  # fmt: skip
    """BLOCKS blocks of BLOCK values (flat row-major order) per program. For block b in
    row r = b // blocks_per_row, j = b % blocks_per_row:
        scale = DYNAMIC[rows[r, K/2 + j]] * absmax2[b // SCALE_BLOCK] + offset   (fp32)
        out[b * BLOCK + 2i], out[b * BLOCK + 2i + 1]
            = NF4[byte >> 4] * scale, NF4[byte & 15] * scale,   byte = rows[r, j * BLOCK/2 + i]
    """
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    block_mask = blocks < n_blocks
    row = blocks // blocks_per_row
    j = blocks % blocks_per_row
    half = tl.arange(0, BLOCK // 2)
    byte_offsets = row[:, None] * row_bytes + j[:, None] * (BLOCK // 2) + half[None, :]
    packed = tl.load(rows_ptr + byte_offsets, mask=block_mask[:, None], other=0).to(tl.int32)
    codes = tl.join(packed >> 4, packed & 15).reshape(BLOCKS, BLOCK)  # high nibble first
    values = _nf4_values(codes, nf4_ptr, LOOKUP)
    qabsmax_offsets = row * row_bytes + blocks_per_row * (BLOCK // 2) + j
    qabsmax = tl.load(rows_ptr + qabsmax_offsets, mask=block_mask, other=0).to(tl.int32)
    absmax2 = tl.load(absmax2_ptr + blocks // SCALE_BLOCK, mask=block_mask, other=0.0)
    scale = tl.load(dynamic_ptr + qabsmax) * absmax2 + tl.load(offset_ptr)
    out = values * scale[:, None]
    out_offsets = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    out = out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch rounds
    tl.store(out_ptr + out_offsets, out, mask=block_mask[:, None])


_CODES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _codes_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _CODES:
        _CODES[device] = (NF4_CODE.to(device), DYNAMIC_CODE.to(device))
    return _CODES[device]


def _without_fp_fusion(device: torch.device) -> dict:
    """The launch option that keeps the scale's product and sum two roundings, as
    bitsandbytes computes them: a fused multiply-add, one rounding, would differ from it in
    the last bit. (Triton's interpreter takes no such option and fuses nothing.)"""
    return {} if device.type == "cpu" else {"enable_fp_fusion": False}


# How dequantize_nf4 runs, chosen by `bench/kernels.py --only nf4` (which times the others):
# blocks of 64 values per program, warps per program, and how a code finds its NF4 value.
DEQUANTIZE_LAUNCH = {"blocks_per_program": 64, "num_warps": 8, "lookup": "table"}


def dequantize_nf4(
    rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor, in_features: int,
    dtype: torch.dtype, blocks_per_program: int = DEQUANTIZE_LAUNCH["blocks_per_program"],
    num_warps: int = DEQUANTIZE_LAUNCH["num_warps"], lookup: str = DEQUANTIZE_LAUNCH["lookup"],
) -> torch.Tensor:  # fmt: skip
    """`dequantize_nf4_reference`'s result, bit for bit, from one Triton kernel that reads
    each packed byte and scale once and writes each value once. The last three arguments
    pick the launch (any of them gives the same bits)."""
    if lookup not in ("table", "select"):
        raise ValueError(f"lookup {lookup!r}: expected 'table' or 'select'")
    data = rows.view(torch.uint8).reshape(rows.shape[0], -1)
    n, k = data.shape[0], in_features
    out = torch.empty(n, k, dtype=dtype, device=rows.device)
    n_blocks = n * k // BLOCK
    nf4, dynamic = _codes_on(rows.device)
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _dequantize_nf4_kernel[grid](
        data, absmax2, offset, nf4, dynamic, out, n_blocks, k // BLOCK, data.shape[1],
        BLOCKS=blocks_per_program, BLOCK=BLOCK, SCALE_BLOCK=SCALE_BLOCK, LOOKUP=lookup,
        num_warps=num_warps, **_without_fp_fusion(rows.device),
    )  # fmt: skip
    return out


def nf4_matmul_dequantized(
    a: torch.Tensor, rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
    in_features: int, w_transposed: bool,
) -> torch.Tensor:  # fmt: skip
    """`nf4_matmul_reference` with W from `dequantize_nf4`: W written whole in a's dtype,
    then cuBLAS."""
    weight = dequantize_nf4(rows, absmax2, offset, in_features, a.dtype)
    return a @ (weight.t() if w_transposed else weight)


# ----------------------------------------------------------------------------------------
# Dequantization fused into the matmul: the Triton kernel
# ----------------------------------------------------------------------------------------


@triton.jit
def _nf4_tile(
    rows_ptr, absmax2_ptr, offset, nf4_ptr, dynamic_ptr, n, n_mask, k0, in_features,
    row_bytes, N_ROWS: tl.constexpr, K_COLS: tl.constexpr, LOOKUP: tl.constexpr,
    dtype: tl.constexpr,
):  # fmt: skip
    """W[n, k0 : k0 + K_COLS] as [N_ROWS, K_COLS] in `dtype`, the values and roundings of
    `_dequantize_nf4_kernel` (k0 and K_COLS multiples of 64: whole blocks). Where n_mask is
    false or k >= in_features the values are finite and meaningless: the caller's other
    operand is zero there, or the output is not stored."""
    j = k0 // 64 + tl.arange(0, K_COLS // 64)  # the blocks of the row
    row_start = n.to(tl.int64) * row_bytes
    half = k0 // 2 + tl.arange(0, K_COLS // 2)
    byte_mask = n_mask[:, None] & (half < in_features // 2)[None, :]
    packed = tl.load(rows_ptr + row_start[:, None] + half[None, :], mask=byte_mask, other=0)
    packed = packed.to(tl.int32)
    codes = tl.join(packed >> 4, packed & 15).reshape(N_ROWS, K_COLS)  # high nibble first
    values = _nf4_values(codes, nf4_ptr, LOOKUP)
    blocks_per_row = in_features // 64
    block_mask = n_mask[:, None] & (j < blocks_per_row)[None, :]
    qabsmax_offsets = row_start[:, None] + in_features // 2 + j[None, :]
    qabsmax = tl.load(rows_ptr + qabsmax_offsets, mask=block_mask, other=0).to(tl.int32)
    blocks = n.to(tl.int64)[:, None] * blocks_per_row + j[None, :]
    absmax2 = tl.load(absmax2_ptr + blocks // 256, mask=block_mask, other=0.0)
    scale = tl.load(dynamic_ptr + qabsmax) * absmax2 + offset  # [N_ROWS, K_COLS / 64]
    w = values.reshape(N_ROWS, K_COLS // 64, 64) * scale[:, :, None]
    return w.reshape(N_ROWS, K_COLS).to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _nf4_matmul_kernel(
    a_ptr, rows_ptr, absmax2_ptr, offset_ptr, nf4_ptr, dynamic_ptr, out_ptr,
    M, P, R, a_row_stride, a_col_stride, in_features, row_bytes,
    W_TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, LOOKUP: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    """out [M, P] = a [M, R] @ B with fp32 accumulation, B = W^T (W_TRANSPOSED: R = K,
    P = N) or B = W (R = N, P = K), for W [N, K] in NF4. Each program computes a
    [BLOCK_M, BLOCK_P] tile of out; for each step of BLOCK_R along R it loads the packed
    bytes and scales of its [BLOCK_R, BLOCK_P] tile of B and dequantizes them in registers
    (`_nf4_tile`), so W in the compute dtype never exists in memory."""
    # Programs in groups of GROUP_M row tiles, the group's programs sweeping the columns
    # together: the tiles of B they share are read from L2 rather than memory.
    pid = tl.program_id(0)
    tiles_m, tiles_p = tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_P)
    first_m = pid // (GROUP_M * tiles_p) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + pid % (GROUP_M * tiles_p) % group_m
    tile_p = pid % (GROUP_M * tiles_p) // group_m
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offset = tl.load(offset_ptr)
    a_rows = a_ptr + m.to(tl.int64)[:, None] * a_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        a_mask = (m < M)[:, None] & (r < R)[None, :]
        a = tl.load(a_rows + r[None, :] * a_col_stride, mask=a_mask, other=0.0)
        if W_TRANSPOSED:  # B[r, p] = W[p, r]
            w = _nf4_tile(
                rows_ptr, absmax2_ptr, offset, nf4_ptr, dynamic_ptr, p, p < P, r0,
                in_features, row_bytes, BLOCK_P, BLOCK_R, LOOKUP, a_ptr.dtype.element_ty,
            )  # fmt: skip
            w = tl.trans(w)
        else:  # B[r, p] = W[r, p]
            w = _nf4_tile(
                rows_ptr, absmax2_ptr, offset, nf4_ptr, dynamic_ptr, r, r < R,
                tile_p * BLOCK_P, in_features, row_bytes, BLOCK_R, BLOCK_P, LOOKUP,
                a_ptr.dtype.element_ty,
            )  # fmt: skip
        if DOT_IN_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out_offsets = m.to(tl.int64)[:, None] * P + p[None, :]
    out_mask = (m < M)[:, None] & (p < P)[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# Tiles (BLOCK_M, BLOCK_P, BLOCK_R, num_warps, num_stages) for Hopper, bf16: 128 x 128
# output tiles 64 deep (one NF4 block of each W row a step) at training token counts, and
# 64-row tiles for small inputs, so that their fewer output tiles still fill the SMs.
FUSED_TILES = {"large": (128, 128, 64, 8, 3), "small": (64, 128, 64, 4, 4)}
FUSED_SMALL_ROWS = 1024  # up to this many rows of a, the "small" tiles
FUSED_LOOKUP = "table"  # how a code finds its NF4 value in the fused kernel (_nf4_values)


def nf4_matmul_fused(
    a: torch.Tensor, rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
    in_features: int, w_transposed: bool, tiles: tuple[int, ...] | None = None,
    lookup: str = FUSED_LOOKUP,
) -> torch.Tensor:  # fmt: skip
    """`nf4_matmul_reference`'s product from one Triton kernel that dequantizes each tile
    of W as it loads it for tl.dot. `tiles`: (BLOCK_M, BLOCK_P, BLOCK_R, num_warps,
    num_stages), by default from FUSED_TILES by a's rows; `lookup`: "table" or "select"
    (`_nf4_values`)."""
    data = rows.view(torch.uint8).reshape(rows.shape[0], -1)
    n = data.shape[0]
    m, r = a.shape
    p = n if w_transposed else in_features
    if r != (in_features if w_transposed else n):
        raise ValueError(
            f"NF4 matmul: a has {r} columns; expected {in_features if w_transposed else n} "
            f"for W [{n}, {in_features}]{'^T' if w_transposed else ''}"
        )
    tiles = tiles or FUSED_TILES["small" if m <= FUSED_SMALL_ROWS else "large"]
    block_m, block_p, block_r, num_warps, num_stages = tiles
    out = torch.empty(m, p, dtype=a.dtype, device=a.device)
    nf4, dynamic = _codes_on(a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(p, block_p),)
    # fp32 operands are multiplied in fp32, as torch's matmul does (not TF32). Triton's
    # interpreter multiplies bf16 operands as their bit patterns (triton-lang/triton#11584):
    # on the CPU they are widened to fp32 first, the same exact products and fp32 sums.
    on_cpu = a.device.type == "cpu"
    precision = "ieee" if a.dtype == torch.float32 or on_cpu else "tf32"
    _nf4_matmul_kernel[grid](
        a, data, absmax2, offset, nf4, dynamic, out, m, p, r, a.stride(0), a.stride(1),
        in_features, data.shape[1], W_TRANSPOSED=w_transposed, BLOCK_M=block_m,
        BLOCK_P=block_p, BLOCK_R=block_r, GROUP_M=8, LOOKUP=lookup,
        PRECISION=precision, DOT_IN_FP32=on_cpu, num_warps=num_warps, num_stages=num_stages,
        **_without_fp_fusion(a.device),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------
# The matmul through a frozen NF4 weight
# ----------------------------------------------------------------------------------------

# The product's path, the faster of the two in `bench/kernels.py --only nf4` (H100, bf16):
# the fused kernel for inputs of up to this many rows (tokens), dequantize + cuBLAS above.
FUSED_MAX_ROWS = 0


def nf4_matmul(
    a: torch.Tensor, rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
    in_features: int, w_transposed: bool,
) -> torch.Tensor:  # fmt: skip
    """The Triton NF4 matmul: `nf4_matmul_fused` up to FUSED_MAX_ROWS rows of a, else
    `nf4_matmul_dequantized`."""
    fused = a.shape[0] <= FUSED_MAX_ROWS
    matmul = nf4_matmul_fused if fused else nf4_matmul_dequantized
    return matmul(a, rows, absmax2, offset, in_features, w_transposed)


class _NF4Linear(torch.autograd.Function):
    """y = x @ W^T with W dequantized for the matmul only (whole and freed right after, or
    tile by tile inside it), and again in backward for dx = dy @ W. (F.linear would keep a
    dequantized W from forward to backward, a bf16 copy of every frozen weight.) W is
    frozen: no gradient of its own."""

    @staticmethod
    def forward(ctx, x, rows, absmax2, offset, in_features, matmul):
        ctx.save_for_backward(rows, absmax2, offset)
        ctx.in_features, ctx.matmul = in_features, matmul
        y = matmul(x.reshape(-1, in_features), rows, absmax2, offset, in_features, True)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        rows, absmax2, offset = ctx.saved_tensors
        k = ctx.in_features
        dx = ctx.matmul(dy.reshape(-1, dy.shape[-1]), rows, absmax2, offset, k, False)
        return dx.reshape(*dy.shape[:-1], k), None, None, None, None, None


def nf4_linear(
    x: torch.Tensor, rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
    in_features: int, matmul=nf4_matmul,
) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ W^T for the NF4 weight W [N, K] in (rows, absmax2, offset), computed in
    x's dtype; `matmul` is `nf4_matmul` (Triton) or `nf4_matmul_reference` (PyTorch), or
    one of nf4_matmul's two paths."""
    return _NF4Linear.apply(x, rows, absmax2, offset, in_features, matmul)

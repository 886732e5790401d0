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

Read in order: the codes, quantization (PyTorch, once per weight as it is loaded), the
dequantization reference, the Triton dequantization kernel, and `nf4_linear`, the
matmul through a frozen NF4 weight that dequantizes in forward and again in backward.
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


def scale_count(numel: int) -> int:
    """The second-level scales (absmax2) of a weight of `numel` values."""
    return -(-numel // (BLOCK * SCALE_BLOCK))


def stored_bytes(out_features: int, in_features: int) -> int:
    """Bytes of a [out_features, in_features] weight in NF4: its packed rows, its fp32
    second-level scales and their offset (model.LoRALinear holds these)."""
    return out_features * row_bytes(in_features) + 4 * (scale_count(out_features * in_features) + 1)


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


# ----------------------------------------------------------------------------------------
# Dequantization: the Triton kernel
# ----------------------------------------------------------------------------------------

# 128 blocks of 64 values per program, 4 warps: the fastest of the launches tried, near the
# copy rate (bench/RESULTS.md, "NF4: the dequantization launch").
BLOCKS_PER_PROGRAM = 128
NUM_WARPS = 4


@triton.jit
def _dequantize_nf4_kernel(
    rows_ptr, absmax2_ptr, offset_ptr, nf4_ptr, dynamic_ptr, out_ptr,
    n_blocks, blocks_per_row, row_bytes, BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
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
    values = tl.load(nf4_ptr + codes)
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


def dequantize_nf4(
    rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor, in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """`dequantize_nf4_reference`'s result, bit for bit, from one Triton kernel that reads
    each packed byte and scale once and writes each value once."""
    data = rows.view(torch.uint8).reshape(rows.shape[0], -1)
    n, k = data.shape[0], in_features
    out = torch.empty(n, k, dtype=dtype, device=rows.device)
    n_blocks = n * k // BLOCK
    nf4, dynamic = _codes_on(rows.device)
    grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
    # No fused multiply-add: bitsandbytes rounds the scale's product and its sum separately,
    # and one rounding instead of two would differ from it in the last bit.
    fp_fusion = {} if rows.device.type == "cpu" else {"enable_fp_fusion": False}
    _dequantize_nf4_kernel[grid](
        data, absmax2, offset, nf4, dynamic, out, n_blocks, k // BLOCK, data.shape[1],
        BLOCKS=BLOCKS_PER_PROGRAM, BLOCK=BLOCK, SCALE_BLOCK=SCALE_BLOCK, num_warps=NUM_WARPS,
        **fp_fusion,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------
# The matmul through a frozen NF4 weight
# ----------------------------------------------------------------------------------------


# W dequantized whole, then cuBLAS: a Triton matmul that dequantized each tile of W as it
# loaded it was several times slower at its best tiles, since it dequantizes each W tile
# again for each tile of rows (64 times at 8192 tokens), where this path dequantizes each
# weight once, a few % of its matmul (bench/RESULTS.md, "NF4: the dequantization launch,
# and a fused dequantize-matmul").
class _NF4Linear(torch.autograd.Function):
    """y = x @ W^T with W dequantized from NF4 for the matmul and freed right after: backward
    dequantizes it again for dx = dy @ W. (F.linear would keep the dequantized W from forward
    to backward, a bf16 copy of every frozen weight.) W is frozen: no gradient of its own."""

    @staticmethod
    def forward(ctx, x, rows, absmax2, offset, in_features, dequantize):
        weight = dequantize(rows, absmax2, offset, in_features, x.dtype)
        ctx.save_for_backward(rows, absmax2, offset)
        ctx.in_features, ctx.dequantize = in_features, dequantize
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        rows, absmax2, offset = ctx.saved_tensors
        weight = ctx.dequantize(rows, absmax2, offset, ctx.in_features, dy.dtype)
        return dy @ weight, None, None, None, None, None


def nf4_linear(
    x: torch.Tensor, rows: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
    in_features: int, dequantize=dequantize_nf4,
) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ W^T for the NF4 weight W [N, K] in (rows, absmax2, offset), computed in
    x's dtype; `dequantize` is `dequantize_nf4` (Triton) or `dequantize_nf4_reference`."""
    return _NF4Linear.apply(x, rows, absmax2, offset, in_features, dequantize)

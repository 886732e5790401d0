"""FP8 (e4m3) linear layers with rowwise scales, the recipe of torchao's and torchtitan's
"rowwise" float8 training.

Each of a linear layer's three matmuls multiplies two e4m3 tensors, each scaled along the
dimension the matmul does not sum over, and accumulates in fp32 (`torch._scaled_mm`):
    y  = x  @ W^T    x per token (row),         W per output channel (row)
    dx = dy @ W      dy per token (row),        W per input channel (column)
    dW = dy^T @ x    dy per output channel (column), x per input channel (column)
A scale is amax / 448 over its row or column (448 is e4m3's largest finite value), so each row
uses e4m3's whole range and one outlier token spoils only its own row. An all-zero row gets the
smallest scale, never zero or a non-finite one.

Read in order: the plain-PyTorch references, the row and column quantization kernels, the
autograd Function, and `fp8_linear`, which takes F.linear's arguments.
"""

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The amax below which a row counts as zero: its scale is EPS / 448, still a normal float32.
EPS = 1e-12


def _inverse_scale(amax: torch.Tensor) -> torch.Tensor:
    """What the values are multiplied by before the cast: 448 / amax, in fp32, correctly
    rounded (a Python number over a tensor is a reciprocal times the number in torch)."""
    amax = amax.float().clamp(min=EPS)
    return torch.full_like(amax, FP8_MAX) / amax


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scale [M] fp32) with x ~= q * scale[:, None]."""
    inverse = _inverse_scale(x.abs().amax(dim=1))
    q = (x.float() * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, inverse.reciprocal()


def quantize_columns_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [K, M], scale [K] fp32): x's transpose, scaled per row of it."""
    return quantize_rows_reference(x.t())


def scaled_mm(a: torch.Tensor, a_scale, b: torch.Tensor, b_scale, out_dtype) -> torch.Tensor:
    """(a * a_scale[:, None]) @ (b * b_scale[:, None])^T for e4m3 a [M, K] and b [N, K], in
    fp32 accumulation. On the GPU, cuBLAS's e4m3 matmul; on the CPU the dequantized product,
    which checks everything around the matmul (the tests' path; train.py refuses --fp8 there)."""
    if a.device.type == "cuda":
        # Rowwise scales need a bf16 output; an fp32 weight's gradient is cast after.
        product = torch._scaled_mm(
            a, b.t(), scale_a=a_scale[:, None], scale_b=b_scale[None, :], out_dtype=torch.bfloat16
        )
        return product.to(out_dtype)
    product = (a.float() * a_scale[:, None]) @ (b.float() * b_scale[:, None]).t()
    return product.to(out_dtype)


@triton.jit
def _e4m3_bits(v):
    """The e4m3 byte nearest v (ties to even), |v| <= 448, by integer arithmetic on v's fp32
    bits: exactly torch's cast on every backend (Triton's CPU interpreter rounds its own fp8
    casts half up, and drops the carry into the exponent)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23
    # Normal in e4m3 (|v| >= 2^-6): keep 3 of the 23 mantissa bits, rounding into the
    # exponent on a carry; rebias the exponent from 127 to 7 (120 << 3 = 960).
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - 960
    # Subnormal in e4m3: a count of 2^-9, the significand shifted right by 14 - (exponent -
    # 127) and rounded; 8 of them is the smallest normal number's byte, so a carry is right too.
    significand = (magnitude & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exponent, 31)
    half = (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)
    subnormal = (significand + half) >> shift
    return (tl.where(exponent >= 121, normal, subnormal) | sign).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_rows, dim, EPS: tl.constexpr,
                          BLOCK: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """ROWS whole rows a program: amax over the row, then q = x * (448 / amax), scale =
    amax / 448 (amax at least EPS). One read of x, held in registers."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < dim)[None, :]
    offsets = rows[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Correctly rounded divisions (Triton's `/` is approximate on the GPU), as torch's.
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPS)
    inverse = tl.math.div_rn(tl.full([ROWS], 448.0, tl.float32), amax)
    q = tl.clamp(x * inverse[:, None], -448.0, 448.0)
    tl.store(q_ptr + offsets, _e4m3_bits(q), mask=mask)
    scale = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), inverse)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _column_amax_kernel(x_ptr, amax_ptr, n_rows, dim, rows_per_program,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Program (i, j): the amax of columns j*BLOCK_N.. over its range of rows, merged into
    amax (zeros first) with an atomic max: |x| >= 0, so the float max is exact."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < dim
    first = tl.program_id(0).to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    tl.atomic_max(amax_ptr + cols, amax, mask=col_mask)


@triton.jit
def _quantize_columns_kernel(x_ptr, amax_ptr, qt_ptr, n_rows, dim, EPS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Tile [BLOCK_M, BLOCK_N] of x [M, N], scaled by its columns' 448 / amax, stored
    transposed into qt [N, M]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < dim
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :], mask=mask, other=0.0)
    amax = tl.load(amax_ptr + cols, mask=col_mask, other=1.0)
    inverse = tl.math.div_rn(tl.full([BLOCK_N], 448.0, tl.float32), tl.maximum(amax, EPS))
    q = tl.clamp(x.to(tl.float32) * inverse[None, :], -448.0, 448.0)
    tl.store(qt_ptr + cols[None, :] * n_rows + rows[:, None], _e4m3_bits(q), mask=mask)


# Rows longer than this do not fit one program's registers in _quantize_rows_kernel.
MAX_ROW = 65536


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_reference's result, by one Triton pass over x."""
    n_rows, dim = x.shape
    if dim > MAX_ROW:
        raise ValueError(f"quantize_rows supports rows of at most {MAX_ROW} elements, got {dim}")
    x = x.contiguous()
    q = torch.empty(n_rows, dim, dtype=FP8, device=x.device)
    scale = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(dim)
    rows = max(4096 // block, 1)
    _quantize_rows_kernel[(triton.cdiv(n_rows, rows),)](
        x, q.view(torch.uint8), scale, n_rows, dim, EPS=EPS, BLOCK=block, ROWS=rows,
        num_warps=min(max(rows * block // 512, 1), 16),
    )  # fmt: skip
    return q, scale


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_columns_reference's result, by two Triton passes over x: the columns' amax,
    then the scaled, transposed copy."""
    n_rows, dim = x.shape
    x = x.contiguous()
    amax = torch.zeros(dim, dtype=torch.float32, device=x.device)
    qt = torch.empty(dim, n_rows, dtype=FP8, device=x.device)
    block_m, block_n = 64, 64
    # Enough row ranges that the amax pass fills the GPU when the matrix is narrow.
    splits = min(triton.cdiv(n_rows, block_m), max(1, 1024 // triton.cdiv(dim, block_n)))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, splits), block_m) * block_m
    _column_amax_kernel[(triton.cdiv(n_rows, rows_per_program), triton.cdiv(dim, block_n))](
        x, amax, n_rows, dim, rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n
    )
    _quantize_columns_kernel[(triton.cdiv(n_rows, block_m), triton.cdiv(dim, block_n))](
        x, amax, qt.view(torch.uint8), n_rows, dim, EPS=EPS, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return qt, _inverse_scale(amax).reciprocal()


class _FP8Linear(torch.autograd.Function):
    """y = x @ W^T (+ b), each matmul in e4m3. Saves x and W as given (bf16), not their e4m3
    copies: the backward needs them scaled along the other dimension, and quantizing an e4m3
    copy again would round twice."""

    @staticmethod
    def forward(ctx, x, weight, bias, triton_kernels: bool):
        rows, columns = (
            (quantize_rows, quantize_columns)
            if triton_kernels
            else (quantize_rows_reference, quantize_columns_reference)
        )
        x2d = x.reshape(-1, x.shape[-1])
        y = scaled_mm(*rows(x2d), *rows(weight), out_dtype=x.dtype)
        if bias is not None:
            y += bias
        ctx.save_for_backward(x2d, weight)
        ctx.quantizers, ctx.has_bias = (rows, columns), bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        rows, columns = ctx.quantizers
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(*rows(dy2d), *columns(weight), out_dtype=dy.dtype)
            dx = dx.view(*dy.shape[:-1], x2d.shape[1])
        if ctx.needs_input_grad[1]:
            dw = scaled_mm(*columns(dy2d), *columns(x2d), out_dtype=weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0, dtype=torch.float32).to(dy.dtype)
        return dx, dw, db, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias) with its three matmuls in e4m3 (the module docstring), the
    scales computed by the Triton kernels. x [..., K], weight [N, K]; K, N and the number of
    tokens multiples of 16, as cuBLAS's e4m3 matmul requires."""
    return _FP8Linear.apply(x, weight, bias, True)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """fp8_linear with the scales computed by the plain-PyTorch references."""
    return _FP8Linear.apply(x, weight, bias, False)

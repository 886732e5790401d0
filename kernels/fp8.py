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
autograd Function, and `fp8_linears`, F.linear for several weights that read one input.
The kernels take several tensors of one row length (a projection group's input and weights)
and quantize them in one launch: at 8,192 tokens a launch costs the host more than the
quantization costs the GPU (bench/RESULTS.md, "--fp8: the scales in the tiles kernel").
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
    """x [M, K] -> (e4m3 [K, M], scale [K] fp32): x's transpose, scaled per row of it, laid
    out row by row (cuBLAS's e4m3 matmul takes no other layout)."""
    return quantize_rows_reference(x.t().contiguous())


def quantize_both_reference(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """quantize_columns_reference(x), then quantize_rows_reference(x): an output gradient
    is needed both ways."""
    return quantize_columns_reference(x) + quantize_rows_reference(x)


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
    bits: torch's cast, where Triton's own is wrong (_to_e4m3)."""
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
def _to_e4m3(v, BY_BITS: tl.constexpr):
    """v (|v| <= 448) rounded to the nearest e4m3, ties to even, as its byte. The GPU converts
    in hardware, at twice the speed of _e4m3_bits (bench/RESULTS.md, "FP8 matmuls"); Triton's
    CPU interpreter rounds its fp8 casts half up and drops the carry into the exponent, so
    there the rounding is done on v's bits."""
    if BY_BITS:
        return _e4m3_bits(v)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_row_block(
    x_ptr, q_ptr, scale_ptr, block, n_rows, dim, EPS: tl.constexpr, BY_BITS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Rows block*ROWS.. of x [n_rows, dim]: amax over each row, then q = x * (448 / amax),
    scale = amax / 448 (amax at least EPS). One read of x, held in registers."""
    rows = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < dim)[None, :]
    offsets = rows[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Correctly rounded divisions (Triton's `/` is approximate on the GPU), as torch's.
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPS)
    inverse = tl.math.div_rn(tl.full([ROWS], 448.0, tl.float32), amax)
    q = tl.clamp(x * inverse[:, None], -448.0, 448.0)
    tl.store(q_ptr + offsets, _to_e4m3(q, BY_BITS), mask=mask)
    scale = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), inverse)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _quantize_rows_kernel(
    sources, n_rows, q_ptr, scale_ptr, dim, EPS: tl.constexpr, BY_BITS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """The rows of each source [n_rows[t], dim], ROWS whole rows a program, into q and scale
    stacked in the sources' order; source t's programs follow those of the sources before it
    (one launch for a projection group's input and weights, which share dim)."""
    program = tl.program_id(0)
    first_program, first_row = 0, tl.full([], 0, tl.int64)
    for t in tl.static_range(len(sources)):
        programs = tl.cdiv(n_rows[t], ROWS)
        if (program >= first_program) & (program < first_program + programs):
            _quantize_row_block(
                sources[t], q_ptr + first_row * dim, scale_ptr + first_row,
                program - first_program, n_rows[t], dim, EPS, BY_BITS, BLOCK, ROWS,
            )  # fmt: skip
        first_program += programs
        first_row += n_rows[t]


@triton.jit
def _amax_rows(x_ptr, col_amax_ptr, row_amax_ptr, first, last, dim, ROWS_TOO: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The amax of x's columns program_id(1)*BLOCK_N.. over rows first..last-1, merged into
    col_amax (zeros first) with an atomic max (|x| >= 0, so the float max is exact); with
    ROWS_TOO each row's amax over these columns into row_amax too."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < dim
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :], mask=mask, other=0.0)
        x = tl.abs(x.to(tl.float32))
        amax = tl.maximum(amax, tl.max(x, axis=0))
        if ROWS_TOO:
            tl.atomic_max(row_amax_ptr + rows, tl.max(x, axis=1), mask=rows < last)
    tl.atomic_max(col_amax_ptr + cols, amax, mask=col_mask)


@triton.jit
def _amax_kernel(sources, n_rows, amax_ptr, dim, rows_per_program, ROWS_TOO: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Program (i, j): _amax_rows over a range of rows_per_program rows of one source, the
    sources' ranges one after another along i. amax holds each source's column amaxes, then
    (ROWS_TOO) each one's row amaxes."""
    program = tl.program_id(0)
    first_program, first_row = 0, tl.full([], 0, tl.int64)
    for t in tl.static_range(len(sources)):
        programs = tl.cdiv(n_rows[t], rows_per_program)
        if (program >= first_program) & (program < first_program + programs):
            first = (program - first_program).to(tl.int64) * rows_per_program
            last = tl.minimum(first + rows_per_program, n_rows[t])
            row_amax_ptr = amax_ptr + len(sources) * dim + first_row
            _amax_rows(sources[t], amax_ptr + t * dim, row_amax_ptr, first, last, dim,
                       ROWS_TOO, BLOCK_M, BLOCK_N)  # fmt: skip
        first_program += programs
        first_row += n_rows[t]


@triton.jit
def _quantize_tile(
    x_ptr, amax_ptr, scale_ptr, qt_ptr, q_ptr, block_m, n_rows, dim, row_offset,
    EPS: tl.constexpr, BY_BITS: tl.constexpr, ROWS_TOO: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Tile (block_m, program_id(1)) [BLOCK_M, BLOCK_N] of x [n_rows, dim], scaled by its
    columns' 448 / amax and stored transposed into qt [dim, n_rows]; with ROWS_TOO also
    scaled by its rows' and stored into q. amax and scale hold the columns' values, and the
    rows' row_offset after them. The first tile of each column (and row) writes its scale:
    done here, not in torch after, as each of those small torch operations costs the host a
    launch."""
    rows = block_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < dim
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.load(amax_ptr + cols, mask=col_mask, other=1.0)
    inverse = tl.math.div_rn(tl.full([BLOCK_N], 448.0, tl.float32), tl.maximum(amax, EPS))
    q = tl.clamp(x * inverse[None, :], -448.0, 448.0)
    tl.store(qt_ptr + cols[None, :] * n_rows + rows[:, None], _to_e4m3(q, BY_BITS), mask=mask)
    if block_m == 0:
        scale = tl.math.div_rn(tl.full([BLOCK_N], 1.0, tl.float32), inverse)
        tl.store(scale_ptr + cols, scale, mask=col_mask)
    if ROWS_TOO:
        amax = tl.load(amax_ptr + row_offset + rows, mask=row_mask, other=1.0)
        inverse = tl.math.div_rn(tl.full([BLOCK_M], 448.0, tl.float32), tl.maximum(amax, EPS))
        q = tl.clamp(x * inverse[:, None], -448.0, 448.0)
        tl.store(q_ptr + rows[:, None] * dim + cols[None, :], _to_e4m3(q, BY_BITS), mask=mask)
        if tl.program_id(1) == 0:
            scale = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), inverse)
            tl.store(scale_ptr + row_offset + rows, scale, mask=row_mask)


@triton.jit
def _quantize_tiles_kernel(
    sources, n_rows, amax_ptr, scale_ptr, qt_ptr, q_ptr, dim, EPS: tl.constexpr,
    BY_BITS: tl.constexpr, ROWS_TOO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (i, j): _quantize_tile of one source, the sources' row blocks one after
    another along i; amax and scale laid out as _amax_kernel's, qt and q each source's
    copy after the copies of the sources before it."""
    program = tl.program_id(0)
    first_program, first_row = 0, tl.full([], 0, tl.int64)
    for t in tl.static_range(len(sources)):
        programs = tl.cdiv(n_rows[t], BLOCK_M)
        if (program >= first_program) & (program < first_program + programs):
            _quantize_tile(
                sources[t], amax_ptr + t * dim, scale_ptr + t * dim, qt_ptr + first_row * dim,
                q_ptr + first_row * dim, program - first_program, n_rows[t], dim,
                (len(sources) - t) * dim + first_row, EPS, BY_BITS, ROWS_TOO, BLOCK_M, BLOCK_N,
            )  # fmt: skip
        first_program += programs
        first_row += n_rows[t]


# Rows longer than this do not fit one program's registers in _quantize_rows_kernel.
MAX_ROW = 65536


def _same_row_length(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int, int]:
    """The tensors row by row, their row length, and their rows together."""
    dims = {t.shape[1] for t in tensors}
    if len(dims) != 1:
        raise ValueError(f"tensors quantized together need one row length, got {sorted(dims)}")
    return [t.contiguous() for t in tensors], dims.pop(), sum(t.shape[0] for t in tensors)


def quantize_rows_together(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """[quantize_rows_reference(t) for t in tensors], by one Triton pass over each, all in one
    launch (the tensors share a row length: a projection group's input and its weights)."""
    tensors, dim, total = _same_row_length(tensors)
    if dim > MAX_ROW:
        raise ValueError(f"quantize_rows supports rows of at most {MAX_ROW} elements, got {dim}")
    device = tensors[0].device
    q = torch.empty(total, dim, dtype=FP8, device=device)
    scale = torch.empty(total, dtype=torch.float32, device=device)
    # At least 4096 elements a program, 4 warps: the fastest of 2048-16384 and 4-16 warps at
    # the 1B's shapes (bench/RESULTS.md, "FP8 matmuls").
    block = triton.next_power_of_2(dim)
    rows = max(4096 // block, 1)
    n_rows = tuple(t.shape[0] for t in tensors)
    _quantize_rows_kernel[(sum(triton.cdiv(n, rows) for n in n_rows),)](
        tuple(tensors), n_rows, q.view(torch.uint8), scale, dim, EPS=EPS,
        BY_BITS=device.type != "cuda", BLOCK=block, ROWS=rows,
        num_warps=4,
    )  # fmt: skip
    return list(zip(q.split(n_rows), scale.split(n_rows), strict=True))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_reference's result, by one Triton pass over x."""
    return quantize_rows_together([x])[0]


def _quantize_tiles(tensors: list[torch.Tensor], rows_too: bool) -> list[tuple[torch.Tensor, ...]]:
    """quantize_columns's result for each tensor, then quantize_rows's if rows_too, by two
    launches for all: the amaxes, then the scaled copies. 64 x 64 tiles and 4 warps: of the
    seven sizes tried at the 1B's and 8B's shapes the fastest or within 5% (bench/RESULTS.md,
    "FP8 matmuls")."""
    tensors, dim, total = _same_row_length(tensors)
    device = tensors[0].device
    # All amaxes and scales in one zeroed allocation (one launch; the scales need no zeros).
    amax, scale = torch.zeros(
        2, len(tensors) * dim + (total if rows_too else 0), dtype=torch.float32, device=device
    )
    qt = torch.empty(total * dim, dtype=FP8, device=device)
    q = torch.empty(total * dim, dtype=FP8, device=device) if rows_too else qt  # else unused
    block_m, block_n = 64, 64
    # Enough row ranges that the amax pass fills the GPU when the matrix is narrow.
    splits = min(triton.cdiv(total, block_m), max(1, 1024 // triton.cdiv(dim, block_n)))
    rows_per_program = triton.cdiv(triton.cdiv(total, splits), block_m) * block_m
    n_rows = tuple(t.shape[0] for t in tensors)
    columns = triton.cdiv(dim, block_n)
    by_bits = device.type != "cuda"
    programs = sum(triton.cdiv(n, rows_per_program) for n in n_rows)
    _amax_kernel[(programs, columns)](
        tuple(tensors), n_rows, amax, dim, rows_per_program, ROWS_TOO=rows_too,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    _quantize_tiles_kernel[(sum(triton.cdiv(n, block_m) for n in n_rows), columns)](
        tuple(tensors), n_rows, amax, scale, qt.view(torch.uint8), q.view(torch.uint8), dim,
        EPS=EPS, BY_BITS=by_bits, ROWS_TOO=rows_too, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    # Each source's copies and scales: views of the buffers above, row by row.
    sizes, column_scales = [n * dim for n in n_rows], len(tensors) * dim
    qts = [c.view(dim, n) for c, n in zip(qt.split(sizes), n_rows, strict=True)]
    quantized = list(zip(qts, scale[:column_scales].split(dim), strict=True))
    if not rows_too:
        return quantized
    qs = [c.view(n, dim) for c, n in zip(q.split(sizes), n_rows, strict=True)]
    rows = zip(qs, scale[column_scales:].split(n_rows), strict=True)
    return [c + r for c, r in zip(quantized, rows, strict=True)]


def quantize_columns_together(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """[quantize_columns_reference(t) for t in tensors], in the two launches quantize_columns
    takes for one (the tensors share a row length: a projection group's input and weights)."""
    return _quantize_tiles(tensors, rows_too=False)


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_columns_reference's result, by Triton: the amax pass, then the copy."""
    return _quantize_tiles([x], rows_too=False)[0]


def quantize_both(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """quantize_both_reference's result in the two passes quantize_columns takes alone."""
    return _quantize_tiles([x], rows_too=True)[0]


class _FP8Linears(torch.autograd.Function):
    """ys[i] = x @ W_i^T (+ b_i) for the projections that read one input x, each matmul in
    e4m3, x quantized once for all of them and with the W_i in one launch (by row in forward,
    by column in backward; each output gradient both ways, one at a time to hold one's copies).
    Saves x and the W_i as given (bf16), not their e4m3 copies: the backward needs them
    scaled along the other dimension, and quantizing an e4m3 copy again would round twice."""

    @staticmethod
    def forward(ctx, x, quantizers, *weights_and_biases):
        rows, _, _ = quantizers
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        x2d = x.reshape(-1, x.shape[-1])
        # x and the weights share a row length: one launch quantizes all of them.
        x_rows, *weights_rows = rows([x2d, *weights])
        ys = []
        for weight, weight_rows, bias in zip(weights, weights_rows, biases, strict=True):
            y = scaled_mm(*x_rows, *weight_rows, out_dtype=x.dtype)
            # Not in place: selective checkpointing may hand back the matmul's kept output.
            y = y if bias is None else y + bias
            ys.append(y.view(*x.shape[:-1], weight.shape[0]))
        ctx.save_for_backward(x2d, *weights)
        ctx.quantizers = quantizers
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x2d, *weights = ctx.saved_tensors
        rows, columns, both = ctx.quantizers
        needs_x, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[2::2]
        needs_bias = ctx.needs_input_grad[3::2]
        # x's columns (for the dWs) and the weights' (for dx) in one launch, as in forward;
        # a frozen base's backward (LoRA) skips x's.
        wanted = ([x2d] if any(needs_weight) else []) + (weights if needs_x else [])
        columns_of = columns(wanted) if wanted else []
        x_columns = columns_of.pop(0) if any(needs_weight) else None
        dx, grads = None, []
        for i, (weight, dy) in enumerate(zip(weights, dys, strict=True)):
            dy2d = dy.reshape(-1, dy.shape[-1])
            part = None
            if needs_weight[i]:
                dy_columns_q, dy_columns_scale, *dy_rows = both(dy2d)
                dw = scaled_mm(dy_columns_q, dy_columns_scale, *x_columns, out_dtype=weight.dtype)
                del dy_columns_q
            else:
                dy_rows, dw = rows([dy2d])[0], None
            if needs_x:
                part = scaled_mm(*dy_rows, *columns_of[i], out_dtype=dy.dtype)
                dx = part if dx is None else dx.add_(part)
            db = None
            if needs_bias[i]:  # False for a bias of None
                db = dy2d.sum(0, dtype=torch.float32).to(dy.dtype)
            grads += [dw, db]
            del dy_rows, part  # before the next projection's copies are made
        if dx is not None:
            dx = dx.view(*dys[0].shape[:-1], x2d.shape[1])
        return dx, None, *grads


def _one_by_one(quantize):
    """A reference quantizer applied to each tensor of a list: the Triton ones' signature."""
    return lambda tensors: [quantize(t) for t in tensors]


# (rows, columns, both): the first two take a list of tensors of one row length (a projection
# group's input and weights, quantized in one launch), `both` one output gradient.
TRITON_QUANTIZERS = (quantize_rows_together, quantize_columns_together, quantize_both)
REFERENCE_QUANTIZERS = (
    _one_by_one(quantize_rows_reference),
    _one_by_one(quantize_columns_reference),
    quantize_both_reference,
)


def fp8_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    kernels: bool = True,
) -> tuple[torch.Tensor, ...]:
    """F.linear(x, w, b) for each weight and bias, each matmul in e4m3 (the module
    docstring), the scales computed by the Triton kernels or (not `kernels`) their references.
    x [..., K], each weight [N, K]; K, N and the number of tokens multiples of 16, as cuBLAS's
    e4m3 matmul requires."""
    quantizers = TRITON_QUANTIZERS if kernels else REFERENCE_QUANTIZERS
    pairs = [t for pair in zip(weights, biases, strict=True) for t in pair]
    return _FP8Linears.apply(x, quantizers, *pairs)

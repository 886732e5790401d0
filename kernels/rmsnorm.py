"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

Read in order: the plain-PyTorch reference, the launch configuration, the forward and backward
Triton kernels, the autograd Function, and `rms_norm`, which has the reference's signature.
"""

import functools

import torch
import triton
import triton.language as tl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch RMSNorm over the last dim; computes in fp32, returns x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


# One program holds a whole row in registers, so rows longer than this are refused.
MAX_DIM = 65536


def _launch_config(dim: int) -> tuple[int, int, int]:
    """(block, rows, num_warps): a program works on `rows` whole rows at a time, padded to
    `block` columns, about 4096 elements a step and 16 per thread: at Llama's widths one row
    and 8 warps was the fastest tried, more rows a program spilled registers
    (bench/RESULTS.md, "Kernels"). Shorter rows are stacked so that a step still moves a few
    KB."""
    block = triton.next_power_of_2(dim)
    rows = max(4096 // block, 1)
    return block, rows, min(max(rows * block // 512, 1), 16)


@functools.cache
def _programs_per_device(device: torch.device) -> int:
    """How many programs the backward splits the rows over: 8 per multiprocessor (4 and 16
    were about as fast), each summing the weight gradient of many rows in registers; the
    [programs, D] fp32 partial sums stay a few MB."""
    if device.type != "cuda":
        return 4
    return 8 * torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, dim, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    """ROWS rows per program. Per row, with r = rsqrt(mean(x^2) + eps) in fp32:
    y = (x * r) * w, stored in y's dtype, and r stored for the backward.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < dim)[None, :]
    offsets = rows[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = x * rstd[:, None] * w
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, n_rows, dim, rows_per_program,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Each program takes a contiguous range of rows, ROWS at a time. With x_hat = x * r
    (r the saved rstd), per row, over the D entries of the row:
        dx = r * (dy * w - x_hat * mean(dy * w * x_hat))
    and the program's share of the weight gradient, summed over its rows in fp32,
        dw_partial[program] = sum_rows dy * x_hat,
    which the caller sums over programs.
    """
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < dim
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < last
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * dim + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        x_hat = x * rstd
        dy_w = dy * w
        dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=1) / dim)[:, None]) * rstd
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_partial_ptr + program * dim + cols, tl.sum(dw, axis=0), mask=col_mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dim = x.shape[-1]
        if weight.shape != (dim,):
            raise ValueError(f"weight must have shape ({dim},), got {tuple(weight.shape)}")
        if dim > MAX_DIM:
            raise ValueError(f"rms_norm supports rows of at most {MAX_DIM} elements, got {dim}")
        x2d = x.contiguous().view(-1, dim)
        weight = weight.contiguous()
        y = torch.empty_like(x2d)
        rstd = torch.empty(x2d.shape[0], dtype=torch.float32, device=x.device)
        block, rows, num_warps = _launch_config(dim)
        _rms_norm_forward_kernel[(triton.cdiv(x2d.shape[0], rows),)](
            x2d, weight, y, rstd, x2d.shape[0], dim, eps, BLOCK=block, ROWS=rows,
            num_warps=num_warps,
        )  # fmt: skip
        ctx.save_for_backward(x2d, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        rows, dim = x2d.shape
        dy2d = dy.contiguous().view(rows, dim)
        dx = torch.empty_like(x2d)
        programs = min(_programs_per_device(x2d.device), max(rows, 1))
        # [programs, D] partial sums instead of one [rows, D] buffer or atomics on one row.
        dw_partial = torch.empty(programs, dim, dtype=torch.float32, device=x2d.device)
        block, rows_per_step, num_warps = _launch_config(dim)
        _rms_norm_backward_kernel[(programs,)](
            x2d, weight, rstd, dy2d, dx, dw_partial, rows, dim, triton.cdiv(rows, programs),
            BLOCK=block, ROWS=rows_per_step, num_warps=num_warps,
        )  # fmt: skip
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with weight [D]; fp32 statistics, x's dtype out.

    Gradients come back in each input's dtype (an fp32 weight with a bf16 x is fine)."""
    return _RMSNorm.apply(x, weight, eps)

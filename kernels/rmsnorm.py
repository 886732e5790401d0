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


def _launch_config(dim: int) -> tuple[int, int]:
    """(block, num_warps) for a row of `dim` elements: the row in one block, ~16 per thread."""
    block = triton.next_power_of_2(dim)
    return block, min(max(block // 512, 1), 16)


@functools.cache
def _programs_per_device(device: torch.device) -> int:
    """How many programs the backward splits the rows over: a few per multiprocessor, so that
    each program sums the weight gradient of many rows in registers."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, dim, eps, BLOCK: tl.constexpr):
    """One row per program. With r = rsqrt(mean(x^2) + eps) in fp32:
    y = (x * r) * w, stored in y's dtype, and r stored for the backward.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * dim + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, rows, dim, rows_per_program,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Each program takes a contiguous block of rows. With x_hat = x * r (r the saved rstd),
    per row, over the D entries of the row:
        dx = r * (dy * w - x_hat * mean(dy * w * x_hat))
    and the program's share of the weight gradient, summed over its rows in fp32,
        dw_partial[program] = sum_rows dy * x_hat,
    which the caller sums over programs.
    """
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        offsets = row * dim + cols
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        dy_w = dy * w
        dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=0) / dim)) * rstd
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_partial_ptr + program * dim + cols, dw, mask=mask)


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
        block, num_warps = _launch_config(dim)
        _rms_norm_forward_kernel[(x2d.shape[0],)](
            x2d, weight, y, rstd, dim, eps, BLOCK=block, num_warps=num_warps
        )
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
        block, num_warps = _launch_config(dim)
        _rms_norm_backward_kernel[(programs,)](
            x2d, weight, rstd, dy2d, dx, dw_partial, rows, dim, triton.cdiv(rows, programs),
            BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] with weight [D]; fp32 statistics, x's dtype out.

    Gradients come back in each input's dtype (an fp32 weight with a bf16 x is fine)."""
    return _RMSNorm.apply(x, weight, eps)

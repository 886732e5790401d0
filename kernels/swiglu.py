"""SwiGLU gate: silu(gate) * up.

Read in order: the plain-PyTorch reference, the launch configuration, the forward and backward
Triton kernels, the autograd Function, and `swiglu`, which takes the reference's arguments
(and `overwrite`, for the MLP's own memory).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _launch_config(numel: int) -> tuple[int, int]:
    """(block, num_warps) for an elementwise pass over `numel` elements: 2048 elements and
    16 warps a program, 4 elements a thread: at 8B's MLP shape the fastest of the blocks and
    warps tried, at the copy rate; evict-first loads were slower
    (bench/RESULTS.md, "Kernels")."""
    block = min(triton.next_power_of_2(numel), 2048)
    return block, min(max(block // 128, 1), 16)


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """out = silu(g) * u = g * sigmoid(g) * u, in fp32, stored in out's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr
):
    """With s = sigmoid(g) recomputed rather than saved (one fewer tensor to store and read):
        du = dout * g * s,   dg = dout * u * s * (1 + g * (1 - s)),
    the second from d/dg [g * s] = s + g * s * (1 - s).
    """
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dup_ptr + offsets, (dout * g * s).to(dup_ptr.dtype.element_ty), mask=mask)
    dg = dout * u * s * (1.0 + g * (1.0 - s))
    tl.store(dgate_ptr + offsets, dg.to(dgate_ptr.dtype.element_ty), mask=mask)


def _grid(numel: int, block: int) -> tuple[int]:
    return (triton.cdiv(numel, block),)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, overwrite: bool) -> torch.Tensor:
        # Leaves and aliased inputs are never overwritten (each element is read before it is
        # written, in the same program, so only distinct storages are safe).
        ctx.overwrite = (
            overwrite
            and gate.grad_fn is not None
            and up.grad_fn is not None
            and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
        )
        # The kernels walk the tensors as flat arrays; contiguous() is a no-op for the outputs
        # of two separate linears, and a copy only for strided views.
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        block, num_warps = _launch_config(gate.numel())
        _swiglu_forward_kernel[_grid(gate.numel(), block)](
            gate, up, out, gate.numel(), BLOCK=block, num_warps=num_warps
        )
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.overwrite:
            dgate, dup = gate, up
            # Where autograd checks versions (not through saved-tensor hooks: checkpointing,
            # offload), another saved use of gate or up now fails rather than reads these.
            torch.autograd.graph.increment_version((gate, up))
        else:
            dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        block, num_warps = _launch_config(gate.numel())
        _swiglu_backward_kernel[_grid(gate.numel(), block)](
            gate, up, dout.contiguous(), dgate, dup, gate.numel(), BLOCK=block,
            num_warps=num_warps,
        )  # fmt: skip
        return dgate, dup, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape and dtype; computes in fp32.
    overwrite=True: backward writes the gradients over gate and up, for a caller whose gate
    and up are its own intermediates that nothing else reads (the MLP's linears' outputs):
    its backward then holds three [tokens, ffn_dim] tensors at its peak, not five. Leaves
    and aliased inputs are left alone."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    return _SwiGLU.apply(gate, up, overwrite)

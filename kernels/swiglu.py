"""The gated feed-forward activations: SwiGLU, silu(gate) * up, and Gemma's GeGLU, gelu(gate) * up
with tanh GELU. One kernel computes both: each gate is g * sigmoid(x(g)), and a constexpr picks x.

Read in order: the plain-PyTorch references, the launch configuration, the gate's sigmoid, the
forward and backward Triton kernels, the autograd Function, and `swiglu` and `geglu`, which take
the references' arguments (and `overwrite`, for the MLP's own memory).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's activation: transformers' gelu_pytorch_tanh of gate, times up."""
    return F.gelu(gate, approximate="tanh") * up


def _launch_config(numel: int) -> tuple[int, int]:
    """(block, num_warps) for an elementwise pass over `numel` elements: 2048 elements and
    16 warps a program, 4 elements a thread: at 8B's MLP shape the fastest of the blocks and
    warps tried, at the copy rate; evict-first loads were slower
    (bench/RESULTS.md, "Kernels")."""
    block = min(triton.next_power_of_2(numel), 2048)
    return block, min(max(block // 128, 1), 16)


@triton.jit
def _gate_sigmoid(g, GELU: tl.constexpr):
    """(s, dx/dg) for the gate g * s, s = sigmoid(x):
    silu: x = g;
    tanh GELU: 0.5 * g * (1 + tanh(z)) with z = sqrt(2/pi) * (g + 0.044715 g^3), and
        0.5 * (1 + tanh(z)) = sigmoid(2z): x = 2z (no cancellation in 1 + tanh for g < 0).
    """
    if GELU:
        x = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2/pi) = 1.5957...
        dx = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        x = g
        dx = 1.0
    return tl.sigmoid(x), dx


@triton.jit
def _glu_forward_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr, GELU: tl.constexpr):
    """out = g * sigmoid(x(g)) * u, in fp32, stored in out's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s, _ = _gate_sigmoid(g, GELU)
    out = g * s * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr, GELU: tl.constexpr
):
    """With s = sigmoid(x(g)) recomputed rather than saved (one fewer tensor to store and read):
        du = dout * g * s,   dg = dout * u * s * (1 + g * (1 - s) * dx/dg),
    the second from d/dg [g * s] = s + g * s * (1 - s) * dx/dg.
    """
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s, dx = _gate_sigmoid(g, GELU)
    tl.store(dup_ptr + offsets, (dout * g * s).to(dup_ptr.dtype.element_ty), mask=mask)
    dg = dout * u * s * (1.0 + g * (1.0 - s) * dx)
    tl.store(dgate_ptr + offsets, dg.to(dgate_ptr.dtype.element_ty), mask=mask)


def _grid(numel: int, block: int) -> tuple[int]:
    return (triton.cdiv(numel, block),)


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, overwrite: bool, gelu: bool):
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
        _glu_forward_kernel[_grid(gate.numel(), block)](
            gate, up, out, gate.numel(), BLOCK=block, GELU=gelu, num_warps=num_warps
        )
        ctx.gelu = gelu
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
        _glu_backward_kernel[_grid(gate.numel(), block)](
            gate, up, dout.contiguous(), dgate, dup, gate.numel(), BLOCK=block, GELU=ctx.gelu,
            num_warps=num_warps,
        )  # fmt: skip
        return dgate, dup, None, None


def _glu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool, gelu: bool) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    return _GLU.apply(gate, up, overwrite, gelu)


def swiglu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape and dtype; computes in fp32.
    overwrite=True: backward writes the gradients over gate and up, for a caller whose gate
    and up are its own intermediates that nothing else reads (the MLP's linears' outputs):
    its backward then holds three [tokens, ffn_dim] tensors at its peak, not five. Leaves
    and aliased inputs are left alone."""
    return _glu(gate, up, overwrite, gelu=False)


def geglu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """geglu_reference's tanh-GELU(gate) * up, as `swiglu` in all else."""
    return _glu(gate, up, overwrite, gelu=True)

"""The gated feed-forward activations: SwiGLU, silu(gate) * up; Gemma's GeGLU, gelu(gate) * up
with tanh GELU; and gpt-oss's experts' clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(1.702 g)
with g the gate clamped from above. One kernel computes all three as a(gate) * b(up), a the
gate g * sigmoid(x(g)) and b the up, or gpt-oss's clamped up + 1; a constexpr picks x and the
clamps.

Read in order: the plain-PyTorch references, the launch configuration, the gate's and the up's
factors, the forward and backward Triton kernels, the autograd Function, and `swiglu`, `geglu`
and `clamped_swiglu`, which take the references' arguments (and `overwrite`, for the MLP's or
the experts' own memory).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

# gpt-oss's (transformers' GptOssExperts, its config's swiglu_alpha and swiglu_limit).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's activation: transformers' gelu_pytorch_tanh of gate, times up."""
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts' activation as transformers' GptOssExperts computes it: the gate
    clamped from above, the up on both sides, a sigmoid of gain alpha, and up + 1."""
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)


def _launch_config(numel: int) -> tuple[int, int]:
    """(block, num_warps) for an elementwise pass over `numel` elements: 2048 elements and
    16 warps a program, 4 elements a thread: at 8B's MLP shape the fastest of the blocks and
    warps tried, at the copy rate; evict-first loads were slower
    (bench/RESULTS.md, "Kernels")."""
    block = min(triton.next_power_of_2(numel), 2048)
    return block, min(max(block // 128, 1), 16)


@triton.jit
def _gate(
    g, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr = SWIGLU_ALPHA,
    LIMIT: tl.constexpr = SWIGLU_LIMIT,
):  # fmt: skip
    """(g, s, f) for the gate a = g * s, s = sigmoid(x(g)), and its derivative da/dg = s * f,
    f = 1 + g * (1 - s) * dx/dg, where x by the activation:
    swiglu: x = g;
    geglu: tanh GELU, 0.5 * g * (1 + tanh(z)) with z = sqrt(2/pi) * (g + 0.044715 g^3), and
        0.5 * (1 + tanh(z)) = sigmoid(2z): x = 2z (no cancellation in 1 + tanh for g < 0);
    clamped_swiglu: g clamped from above at LIMIT (the g returned), then x = ALPHA * g.
    """
    if ACTIVATION == "clamped_swiglu":
        g = tl.where(g > LIMIT, LIMIT, g)  # a NaN stays NaN, as torch.clamp's
        x, dx = ALPHA * g, ALPHA
    elif ACTIVATION == "geglu":
        x = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2/pi) = 1.5957...
        dx = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        x, dx = g, 1.0
    s = tl.sigmoid(x)
    return g, s, 1.0 + g * (1.0 - s) * dx


@triton.jit
def _up(u, ACTIVATION: tl.constexpr, LIMIT: tl.constexpr = SWIGLU_LIMIT):
    """The up's factor b: u itself, or clamped_swiglu's u clamped to [-LIMIT, LIMIT] plus 1."""
    if ACTIVATION == "clamped_swiglu":
        u = tl.where(u > LIMIT, LIMIT, tl.where(u < -LIMIT, -LIMIT, u)) + 1.0
    return u


@triton.jit
def _glu_forward_kernel(
    gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr
):
    """out = g * s * b, in fp32, stored in out's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g, s, _ = _gate(gate, ACTIVATION)
    out = g * s * _up(up, ACTIVATION)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr,
    ACTIVATION: tl.constexpr, LIMIT: tl.constexpr = SWIGLU_LIMIT,
):  # fmt: skip
    """du = dout * g * s and dg = dout * b * s * f, multiplied in this order (SwiGLU's and
    GeGLU's gradients as before the clamped variant, to the bit), with s recomputed rather
    than saved (one fewer tensor to store and read). clamped_swiglu's are 0 where gate or up
    was clamped, whatever dout (a NaN too), as torch.clamp's gradient, which passes at the
    bounds themselves."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g, s, f = _gate(gate, ACTIVATION)
    du = dout * g * s
    dg = dout * _up(up, ACTIVATION) * s * f
    if ACTIVATION == "clamped_swiglu":
        du = tl.where((up >= -LIMIT) & (up <= LIMIT), du, 0.0)
        dg = tl.where(gate <= LIMIT, dg, 0.0)
    tl.store(dup_ptr + offsets, du.to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offsets, dg.to(dgate_ptr.dtype.element_ty), mask=mask)


def _grid(numel: int, block: int) -> tuple[int]:
    return (triton.cdiv(numel, block),)


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, overwrite: bool, activation: str):
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
            gate, up, out, gate.numel(), BLOCK=block, ACTIVATION=activation, num_warps=num_warps
        )
        ctx.activation = activation
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
            gate, up, dout.contiguous(), dgate, dup, gate.numel(), BLOCK=block,
            ACTIVATION=ctx.activation, num_warps=num_warps,
        )  # fmt: skip
        return dgate, dup, None, None


def _glu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool, activation: str) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    return _GLU.apply(gate, up, overwrite, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape and dtype; computes in fp32.
    overwrite=True: backward writes the gradients over gate and up, for a caller whose gate
    and up are its own intermediates that nothing else reads (the MLP's linears' outputs):
    its backward then holds three [tokens, ffn_dim] tensors at its peak, not five. Leaves
    and aliased inputs are left alone."""
    return _glu(gate, up, overwrite, "swiglu")


def geglu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """geglu_reference's tanh-GELU(gate) * up, as `swiglu` in all else."""
    return _glu(gate, up, overwrite, "geglu")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """clamped_swiglu_reference's gpt-oss activation, as `swiglu` in all else: it keeps gate and
    up for backward, where the reference's clamps, sigmoid and products keep six tensors."""
    return _glu(gate, up, overwrite, "clamped_swiglu")

"""Rotary position embedding in the Hugging Face "rotate half" layout.

Each head's vector is split into halves [x1, x2] (not interleaved pairs); with the angle
a = position * inv_freq[i] for i < head_dim/2 and a scale c (1, or YaRN's attention factor,
which transformers multiplies into cos and sin) the rotation is
    y1 = c * (x1 * cos(a) - x2 * sin(a)),   y2 = c * (x2 * cos(a) + x1 * sin(a)).
Its gradient is the inverse rotation (a -> -a), scaled by c, applied to the output's gradient.

Read in order: the plain-PyTorch reference, the launch configuration, the Triton kernel (one
launch rotates q and k; the sign of the angle selects forward or backward), the autograd
Function, and `apply_rope`, which has the reference's signature.
"""

import torch
import triton
import triton.language as tl


def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, S, H, Dh], k: [B, S, Hkv, Dh], positions: [B, S] int, inv_freq: [Dh/2] fp32."""
    angles = positions.float()[..., None] * inv_freq.float()  # [B, S, Dh/2]
    cos = (angles.cos() * scale)[:, :, None, :]  # [B, S, 1, Dh/2]
    sin = (angles.sin() * scale)[:, :, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def _launch_config(n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(block_heads, block_kv_heads, block_half, num_warps) for one token's q and k heads."""
    block_heads = triton.next_power_of_2(n_heads)
    block_kv_heads = triton.next_power_of_2(n_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    # About 64 elements a thread: fewer warps were faster at the 8B shape (bench/RESULTS.md,
    # "Kernels").
    elements = (block_heads + block_kv_heads) * block_half * 2
    num_warps = min(triton.next_power_of_2(max(elements // 2048, 1)), 8)
    return block_heads, block_kv_heads, block_half, num_warps


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, out_ptr, n_heads, half, cos, sin, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rotates the heads of one token: x at x_ptr (heads stride_h apart, dims contiguous) into
    the contiguous [n_heads, 2 * half] block at out_ptr, in fp32, stored in out's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    x1_ptrs = x_ptr + heads * stride_h + dims
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    y1_ptrs = out_ptr + heads * (2 * half) + dims
    tl.store(y1_ptrs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(y1_ptrs + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr,
    q_stride_b, q_stride_s, q_stride_h, k_stride_b, k_stride_s, k_stride_h,
    seq_len, n_heads, n_kv_heads, half, scale,
    SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One token (b, s) per program, all its q and k heads. With a = positions[b, s] *
    inv_freq[i], computed in fp32 as in the reference, c = scale and SIGN = +1 (forward) or
    -1 (backward):
        out1 = x1 * c cos(a) - x2 * SIGN * c sin(a),   out2 = x2 * c cos(a) + x1 * SIGN * c sin(a).
    Inputs may be strided over b, s and heads; outputs are contiguous [B, S, heads, Dh].
    """
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    s = token - b * seq_len
    dims = tl.arange(0, BLOCK_HALF)
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(
        inv_freq_ptr + dims, mask=dims < half, other=0.0
    )
    cos = (tl.cos(angle) * scale)[None, :]
    sin = (SIGN * (tl.sin(angle) * scale))[None, :]
    _rotate_heads(
        q_ptr + b * q_stride_b + s * q_stride_s, q_stride_h, q_out_ptr + token * n_heads * 2 * half,
        n_heads, half, cos, sin, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + b * k_stride_b + s * k_stride_s, k_stride_h,
        k_out_ptr + token * n_kv_heads * 2 * half, n_kv_heads, half, cos, sin, BLOCK_HKV,
        BLOCK_HALF,
    )  # fmt: skip


def _rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    sign: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel on q [B, S, H, Dh] and k [B, S, Hkv, Dh]; returns new tensors."""
    bsz, seq_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    # The kernel reads each head's dims as contiguous; b, s and head strides are free (the
    # gradients that come back through SDPA's transpose are strided that way).
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    block_h, block_hkv, block_half, num_warps = _launch_config(n_heads, n_kv_heads, head_dim)
    _rope_kernel[(bsz * seq_len,)](
        q, k, q_out, k_out, positions.contiguous(), inv_freq.float().contiguous(),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        seq_len, n_heads, n_kv_heads, head_dim // 2, float(scale),
        SIGN=sign, BLOCK_H=block_h, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, scale):
        ctx.save_for_backward(positions, inv_freq)
        ctx.scale = scale
        return _rotate(q, k, positions, inv_freq, scale, sign=1)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        positions, inv_freq = ctx.saved_tensors
        dq, dk = _rotate(dq_out, dk_out, positions, inv_freq, ctx.scale, sign=-1)
        return dq, dk, None, None, None


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, S, H, Dh], k: [B, S, Hkv, Dh], positions: [B, S] int, inv_freq: [Dh/2] fp32,
    scale: multiplies cos and sin (YaRN's attention factor).

    Returns rotated copies of q and k (contiguous); the inputs are left untouched."""
    bsz, seq_len, _, head_dim = q.shape
    if head_dim % 2 or k.shape[-1] != head_dim or k.shape[:2] != (bsz, seq_len):
        raise ValueError(
            f"q [B, S, H, Dh] and k [B, S, Hkv, Dh] must agree on B, S and an even Dh, "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if positions.shape != (bsz, seq_len) or inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"positions must be [{bsz}, {seq_len}] and inv_freq [{head_dim // 2}], "
            f"got {tuple(positions.shape)} and {tuple(inv_freq.shape)}"
        )
    return _Rope.apply(q, k, positions, inv_freq, scale)

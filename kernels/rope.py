"""Rotary position embedding in the Hugging Face "rotate half" layout.

Each head's vector is split into halves [x1, x2] (not interleaved pairs); with the angle
a = position * inv_freq[i] for i < head_dim/2 the rotation is
    y1 = x1 * cos(a) - x2 * sin(a),   y2 = x2 * cos(a) + x1 * sin(a).
"""

import torch


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, S, H, Dh], k: [B, S, Hkv, Dh], positions: [B, S] int, inv_freq: [Dh/2] fp32."""
    angles = positions.float()[..., None] * inv_freq.float()  # [B, S, Dh/2]
    cos = angles.cos()[:, :, None, :]  # [B, S, 1, Dh/2]
    sin = angles.sin()[:, :, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)

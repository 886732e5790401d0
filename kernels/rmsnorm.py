"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32."""

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain PyTorch RMSNorm over the last dim; computes in fp32, returns x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)

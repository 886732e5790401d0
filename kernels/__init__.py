"""Hand-written Triton kernels, each beside its plain-PyTorch reference.

`model.Ops` holds the ops the model picks by reference (`model.REFERENCE_OPS`) or Triton
(`model.triton_ops`): each kernel takes its reference's arguments, swiglu and geglu also an
`overwrite` (set by triton_ops). The rest are picked where used, by the same switch (--kernels,
Plan.kernels): moe_experts runs clamped_swiglu for gpt-oss (its `overwrite` set), nf4_linear
takes the dequantization that lora.apply_lora picks, and fp8_linears picks its quantizers,
kernels or references, by its `kernels` argument.
"""

from kernels.cross_entropy import (
    IGNORE_INDEX,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from kernels.fp8 import fp8_linears
from kernels.moe import moe_experts, moe_experts_reference
from kernels.nf4 import dequantize_nf4, dequantize_nf4_reference, nf4_linear, quantize_nf4
from kernels.rmsnorm import rms_norm, rms_norm_reference
from kernels.rope import apply_rope, apply_rope_reference
from kernels.swiglu import (
    clamped_swiglu,
    clamped_swiglu_reference,
    geglu,
    geglu_reference,
    swiglu,
    swiglu_reference,
)

__all__ = [
    "IGNORE_INDEX",
    "apply_rope",
    "apply_rope_reference",
    "clamped_swiglu",
    "clamped_swiglu_reference",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "fp8_linears",
    "geglu",
    "geglu_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "moe_experts",
    "moe_experts_reference",
    "nf4_linear",
    "quantize_nf4",
    "rms_norm",
    "rms_norm_reference",
    "swiglu",
    "swiglu_reference",
]

"""LoRA: low-rank adapters on a model's linear layers over a frozen base, which may be stored in
4-bit NormalFloat (QLoRA), saved as PEFT's files (hf.py). Applied from outside, to the model
built on the meta device (train.apply_techniques):

    with torch.device("meta"):
        model = Llama(args)
    apply_lora(model, LoRAConfig(rank=16, alpha=32, quantize_base="nf4"), torch.bfloat16)

In order: the projections by name (longtune's and Hugging Face's), `LoRAConfig`, the layer
(`LoRALinear`), `apply_lora`, and the copy into a parameter that quantizes a 4-bit base.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from files import UsageError
from kernels import dequantize_nf4, dequantize_nf4_reference, nf4_linear, quantize_nf4
from kernels.nf4 import check_quantizable, row_bytes, scale_count

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
HF_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# The same projections by their HF / PEFT module names (adapter_config.json's target_modules).
HF_LORA_TARGETS = {
    ours.split(".")[1]: theirs.split(".")[1]
    for ours, theirs in HF_LAYER_NAMES.items()
    if not ours.endswith("norm.weight")
}
NF4_SUFFIX = "_nf4"  # `wq.weight_nf4`: the 4-bit storage of `wq.weight`


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    quantize_base: str | None = None  # None (the base in the compute dtype) or "nf4"

    def __post_init__(self):
        problems = []
        if self.rank < 1:
            problems.append(f"rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            problems.append(f"targets {list(self.targets)}: expected some of {LORA_TARGETS}")
        if self.quantize_base not in (None, "nf4"):
            problems.append(f"quantize_base {self.quantize_base!r}: expected None or 'nf4'")
        if problems:
            raise UsageError("LoRA: " + "; ".join(problems))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """ "all" or comma-separated longtune or HF names (HF_LORA_TARGETS), in LORA_TARGETS order."""
    if text == "all":
        return LORA_TARGETS
    by_hf = {hf: ours for ours, hf in HF_LORA_TARGETS.items()}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LORA_TARGETS and n not in by_hf]
    if unknown or not names:
        raise UsageError(
            f"LoRA targets {text!r}: unknown {unknown}; expected 'all' or names from "
            f"{list(LORA_TARGETS)} or their HF names {list(HF_LORA_TARGETS.values())}"
        )
    chosen = {by_hf.get(n, n) for n in names}
    return tuple(t for t in LORA_TARGETS if t in chosen)


class LoRALinear(nn.Module):
    """y = x W^T (+ b) + scale * dropout(x) A^T B^T (PEFT's LoRA layer; A [rank, in], B [out,
    rank]), W (`weight`) and b frozen in `base_dtype`. In NF4 (kernels/nf4.py) W is
    `weight_nf4`, packed rows viewed as `base_dtype`, which must be the compute dtype FSDP
    gathers in (so its mixed precision policy has nothing to cast), and two small second-level
    tensors kept whole as buffers (not in checkpoints: the base is re-read from the HF one)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: LoRAConfig,
        base_dtype: torch.dtype,
        dequantize: Callable,
        bias: bool = False,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scale, self.dropout = config.scale, config.dropout
        self.dequantize = dequantize
        self.quantized = config.quantize_base == "nf4"

        def frozen(*shape: int) -> nn.Parameter:
            empty = torch.empty(shape, dtype=base_dtype, device=device)
            return nn.Parameter(empty, requires_grad=False)

        if self.quantized:
            self.weight_nf4 = frozen(out_features, row_bytes(in_features) // base_dtype.itemsize)
            n_scales = scale_count(out_features * in_features)
            self.register_buffer("absmax2", torch.empty(n_scales, device=device), persistent=False)
            self.register_buffer("offset", torch.empty((), device=device), persistent=False)
        else:
            self.weight = frozen(out_features, in_features)
        self.bias = frozen(out_features) if bias else None
        self.lora_A = nn.Parameter(torch.empty(config.rank, in_features, device=device))
        self.lora_B = nn.Parameter(torch.empty(out_features, config.rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            # With FSDP's CPU offload the buffers stay on the host; they are a few KB.
            absmax2 = self.absmax2.to(x.device, non_blocking=True)
            offset = self.offset.to(x.device, non_blocking=True)
            base = nf4_linear(
                x, self.weight_nf4, absmax2, offset, self.in_features, self.dequantize
            )
        else:
            base = F.linear(x, self.weight)
        if self.bias is not None:
            base = base + self.bias
        return base + self.adapter(x)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    @torch.no_grad()
    def load_weight(self, tensor_slice, copy: Callable[[torch.Tensor, object], None]) -> None:
        """Sets W from the whole weight (a safetensors slice or a tensor); in NF4 quantized on
        the buffers' device (the rank's GPU) before `copy`, which may keep this rank's rows."""
        if not self.quantized:
            copy(self.weight, tensor_slice)
            return
        quantized = quantize_nf4(tensor_slice[:].to(self.absmax2.device))
        copy(self.weight_nf4, quantized.rows.view(self.weight_nf4.dtype))
        self.absmax2.copy_(quantized.absmax2)
        self.offset.copy_(quantized.offset)

    def base_weight(self, stored: torch.Tensor) -> torch.Tensor:
        """W in fp32 from `stored`, its whole (gathered) `weight` or `weight_nf4`."""
        if not self.quantized:
            return stored.float()
        return dequantize_nf4_reference(
            stored, self.absmax2.to(stored.device), self.offset.to(stored.device),
            self.in_features, torch.float32,
        )  # fmt: skip


def lora_module_paths(
    n_layers: int, targets: tuple[str, ...], moe_layers: tuple[int, ...] = ()
) -> list[str]:
    """`layers.{i}.attention.wq` and the like, in layer then target order; the experts of
    `moe_layers` are no linear layers and take no adapter."""
    where = {ours.split(".")[1]: ours.split(".")[0] for ours in HF_LAYER_NAMES}
    return [
        f"layers.{i}.{where[t]}.{t}"
        for i in range(n_layers)
        for t in targets
        if not (i in moe_layers and where[t] == "feed_forward")
    ]


def apply_lora(
    model: nn.Module, config: LoRAConfig, base_dtype: torch.dtype, kernels: bool = False
) -> None:
    """Replaces every block's target projections with LoRALinear and freezes the rest, stored
    in `base_dtype` (the compute dtype: no fp32 master copy of what is not trained). Applied
    first, to the meta-built model (train.apply_techniques)."""
    dequantize = dequantize_nf4 if kernels else dequantize_nf4_reference
    args = model.args
    for path in lora_module_paths(args.n_layers, config.targets, args.moe_layers):
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, attr)
        if config.quantize_base:
            try:  # the kernel's own check, about a model the user chose
                check_quantizable(f"{path}.weight", tuple(linear.weight.shape))
            except ValueError as e:
                raise UsageError(str(e)) from None
        lora = LoRALinear(
            linear.in_features, linear.out_features, config, base_dtype, dequantize,
            bias=linear.bias is not None, device=linear.weight.device,
        )  # fmt: skip
        setattr(parent, attr, lora)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            frozen = torch.empty_like(param, dtype=base_dtype)
            setattr(module, name, nn.Parameter(frozen, requires_grad=False))


def copy_whole_tensor(param: torch.Tensor, tensor_slice) -> None:
    param.copy_(tensor_slice[:])


def copy_into(model: nn.Module, name: str, tensor_slice, copy: Callable) -> None:
    """`copy(param, tensor_slice)` for `name`; a 4-bit base is quantized on the way in."""
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    if isinstance(owner, LoRALinear) and leaf == "weight":
        owner.load_weight(tensor_slice, copy)
    else:
        copy(model.get_parameter(name), tensor_slice)

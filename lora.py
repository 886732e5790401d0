"""LoRA: low-rank adapters on a model's linear layers over a frozen base, which may be stored in
4-bit NormalFloat (QLoRA), saved as PEFT's files (hf.py). Applied from outside, to the model
built on the meta device (train.apply_techniques):

    with torch.device("meta"):
        model = Llama(args)
    apply_lora(model, LoRAConfig(rank=16, alpha=32, quantize_base="nf4"), torch.bfloat16)

On a mixture-of-experts model (moe.py) the adapters go on the attention projections and, when
asked (`EXPERT_LORA_TARGETS`), on each expert's projections: [E, ...] adapters that
Ops.moe_experts adds as grouped low-rank products (kernels.moe.ExpertLoRA), in PEFT's
target_parameters format. QLoRA stores the experts, most of such a model's weights, in NF4 too
(`NF4MoE`).

In order: the projections by name (longtune's and Hugging Face's), `LoRAConfig`, the layer
(`LoRALinear`), the experts in NF4 (`NF4MoE`), the experts' adapters, `apply_lora`, a
parameter's full shape and the copy into it that quantizes a 4-bit base, and the adapters merged
into plain weights.
"""

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from files import UsageError
from kernels import dequantize_nf4, dequantize_nf4_reference, nf4_linear, quantize_nf4
from kernels.nf4 import check_quantizable, row_bytes, scale_count
from moe import EXPERT_ADAPTERS, EXPERT_WEIGHTS, MoE

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# Their paths in a block, ours -> Hugging Face's (hf.hf_names: the layer's tensors).
LORA_MODULES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
# The same projections by their HF / PEFT module names (adapter_config.json's target_modules).
HF_LORA_TARGETS = {
    ours.rpartition(".")[2]: theirs.rpartition(".")[2] for ours, theirs in LORA_MODULES.items()
}
# The experts' targets -> PEFT's target_parameters on transformers 5's fused [E, out, in]
# tensors (gpt-oss's [E, in, out]): one adapter on gate_up_proj (w1 and w3: one A, and a B whose
# rows are theirs, halves or gpt-oss's interleaved ones), one on down_proj (w2).
EXPERT_LORA_TARGETS = {
    "experts_w13": "mlp.experts.gate_up_proj",
    "experts_w2": "mlp.experts.down_proj",
}
# Every target (LoRAConfig.targets' choices), and each by its HF name (--lora-targets and
# adapter_config.json name them either way).
ALL_LORA_TARGETS = (*LORA_TARGETS, *EXPERT_LORA_TARGETS)
LORA_TARGETS_BY_HF = {hf: ours for ours, hf in (HF_LORA_TARGETS | EXPERT_LORA_TARGETS).items()}
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
        unknown = [t for t in self.targets if t not in ALL_LORA_TARGETS]
        if unknown or not self.targets:
            problems.append(f"targets {list(self.targets)}: expected some of {ALL_LORA_TARGETS}")
        if self.dropout and self.expert_targets:  # PEFT's adapter on a parameter has none
            problems.append(f"dropout must be 0 with the experts' adapters, got {self.dropout}")
        if self.quantize_base not in (None, "nf4"):
            problems.append(f"quantize_base {self.quantize_base!r}: expected None or 'nf4'")
        if problems:
            raise UsageError("LoRA: " + "; ".join(problems))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def expert_targets(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if t in EXPERT_LORA_TARGETS)


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """Comma-separated longtune or HF names (HF_LORA_TARGETS, EXPERT_LORA_TARGETS), "all" among
    them the linear layers (LORA_TARGETS: "all,experts_w2" adds the experts'), in that order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    names = [t for n in names for t in (LORA_TARGETS if n == "all" else (n,))]
    unknown = [n for n in names if n not in ALL_LORA_TARGETS and n not in LORA_TARGETS_BY_HF]
    if unknown or not names:
        raise UsageError(
            f"LoRA targets {text!r}: unknown {unknown}; expected 'all' or names from "
            f"{list(ALL_LORA_TARGETS)} or their HF names {list(LORA_TARGETS_BY_HF)}"
        )
    chosen = {LORA_TARGETS_BY_HF.get(n, n) for n in names}
    return tuple(t for t in ALL_LORA_TARGETS if t in chosen)


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
            absmax2, offset = _scales_on(x.device, self.absmax2, self.offset)
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
        load_nf4(self.weight_nf4, self.absmax2, self.offset, tensor_slice[:], copy)

    def base_weight(self, stored: torch.Tensor) -> torch.Tensor:
        """W in fp32 from `stored`, its whole (gathered) `weight` or `weight_nf4`."""
        if not self.quantized:
            return stored.float()
        return dequantize_nf4_reference(
            stored, self.absmax2.to(stored.device), self.offset.to(stored.device),
            self.in_features, torch.float32,
        )  # fmt: skip


def _scales_on(
    device: torch.device, absmax2: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An NF4 weight's second-level scales on `device`, where it is dequantized: with FSDP's
    CPU offload the buffers stay on the host; they are a few KB."""
    return absmax2.to(device, non_blocking=True), offset.to(device, non_blocking=True)


def load_nf4(
    stored: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor,
    copy: Callable,
) -> None:  # fmt: skip
    """Quantizes `weight` [..., in] as one [rows, in] matrix on the buffers' device (the rank's
    GPU) into `stored` (its rows viewed as stored's dtype, shaped as weight but the last dim)
    through `copy`, which may keep this rank's rows, and the two buffers."""
    quantized = quantize_nf4(weight.to(absmax2.device).flatten(0, -2))
    copy(stored, quantized.rows.view(stored.dtype).view(*weight.shape[:-1], -1))
    absmax2.copy_(quantized.absmax2)
    offset.copy_(quantized.offset)


class _Remade:
    """What autograd saved of a dequantized weight (it, or a view of it): how to make it again."""

    __slots__ = ("make", "size", "stride", "offset")

    def __init__(self, make: Callable[[], torch.Tensor], t: torch.Tensor):
        self.make, self.size, self.stride = make, t.size(), t.stride()
        self.offset = t.storage_offset()


class _DequantizeInBackward(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks under which what the ops save of the dequantized weights (by their
    storage: `make` for each) is kept as a way to dequantize it again when backward reads it,
    as nf4_linear does for one matmul: whatever Ops.moe_experts saves, no dequantized copy
    lives from forward to backward. Every other tensor goes to the hooks active outside
    (activation checkpointing's, activation offload's): only the innermost hooks run, so these
    hand on to them (found by torch's private `_top_saved_tensors_default_hooks`), or with
    none keep detached, so that a saved output holds no reference to its own node (a cycle
    that a graph dropped without backward would never free)."""

    def __init__(self, make: dict[int, Callable[[], torch.Tensor]]):
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(t: torch.Tensor):
            remade = make.get(t.untyped_storage().data_ptr()) if t.numel() else None
            if remade is not None:
                return _Remade(remade, t)
            return outer[0](t) if outer else t.detach()

        def unpack(packed) -> torch.Tensor:
            if isinstance(packed, _Remade):
                return packed.make().as_strided(packed.size, packed.stride, packed.offset)
            return outer[1](packed) if outer else packed

        # Closures, not bound methods: hooks holding this object would make it a reference
        # cycle, freed only when Python's garbage collector runs, and with it the outer hooks'
        # checkpoint frame and the block's input it keeps: one input a block, more with each
        # micro-batch until a collection (bench/RESULTS.md, "qwen3-30b-a3b QLoRA's missing 21%:
        # a reference cycle in the NF4 experts' hooks").
        super().__init__(pack, unpack)


class NF4MoE(MoE):
    """moe.MoE with its experts frozen in NF4 (QLoRA): each of w1, w3, w2 [E, out, in] is
    quantized as one [E * out, in] weight (kernels/nf4.py; each block of 64 values within one
    expert's row, one offset and list of second-level scales for the tensor), stored as
    `w1_nf4` [E, out, row_bytes / itemsize] in `base_dtype`, so that FSDP shards it by experts
    like the plain tensor; the scales are buffers kept whole, as LoRALinear's."""

    def __init__(self, moe: MoE, base_dtype: torch.dtype, dequantize: Callable):
        n_experts, ffn_dim, dim = moe.w1.shape
        device = moe.w1.device
        with torch.device(device):  # the model's: meta, as apply_lora finds it
            super().__init__(
                dim, ffn_dim, n_experts, moe.top_k, moe.norm_topk_prob, moe.rounds_weights,
                moe.ops, moe.gpt_oss,
            )  # fmt: skip
        self.dequantize = dequantize
        self.shapes = {name: getattr(self, name).shape for name in EXPERT_WEIGHTS}
        for name, (n_experts, out, k) in self.shapes.items():
            delattr(self, name)
            rows = torch.empty(n_experts, out, row_bytes(k) // base_dtype.itemsize,
                               dtype=base_dtype, device=device)  # fmt: skip
            self.register_parameter(name + NF4_SUFFIX, nn.Parameter(rows, requires_grad=False))
            n_scales = scale_count(n_experts * out * k)
            absmax2, offset = torch.empty(n_scales, device=device), torch.empty((), device=device)
            self.register_buffer(f"{name}_absmax2", absmax2, persistent=False)
            self.register_buffer(f"{name}_offset", offset, persistent=False)

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        # The whole layer's experts dequantized at once, in the compute dtype: what an FSDP
        # gather of the layer's bf16 experts costs too, freed when the layer is done. Backward
        # dequantizes again each tensor it reads (_DequantizeInBackward), from the storage as
        # nf4_linear saves it: FSDP refills it for backward.
        make = {
            n: functools.partial(self.expert_weight, n, x.dtype, getattr(self, n + NF4_SUFFIX))
            for n in EXPERT_WEIGHTS
        }
        w = {name: m() for name, m in make.items()}
        by_storage = {w[name].untyped_storage().data_ptr(): make[name] for name in EXPERT_WEIGHTS}
        with _DequantizeInBackward(by_storage):
            return self.apply_experts(x, experts, weights, w["w1"], w["w3"], w["w2"])

    def expert_weight(
        self, name: str, dtype: torch.dtype, stored: torch.Tensor | None = None,
        dequantize: Callable | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Expert tensor `name` [E, out, in] in `dtype` from `stored`, its whole (gathered)
        storage (default: the module's)."""
        stored = getattr(self, name + NF4_SUFFIX) if stored is None else stored
        n_experts, out, k = self.shapes[name]
        absmax2, offset = _scales_on(
            stored.device, getattr(self, f"{name}_absmax2"), getattr(self, f"{name}_offset")
        )
        rows = stored.reshape(n_experts * out, -1)
        flat = (dequantize or self.dequantize)(rows, absmax2, offset, k, dtype)
        return flat.view(n_experts, out, k)

    @torch.no_grad()
    def load_expert(self, name: str, tensor_slice, copy: Callable) -> None:
        """Sets expert tensor `name` from the whole [E, out, in] (hf.ExpertSlices, a tensor),
        quantized as LoRALinear.load_weight does."""
        absmax2, offset = getattr(self, f"{name}_absmax2"), getattr(self, f"{name}_offset")
        load_nf4(getattr(self, name + NF4_SUFFIX), absmax2, offset, tensor_slice[:], copy)


def lora_module_paths(
    n_layers: int, targets: tuple[str, ...], moe_layers: tuple[int, ...] = ()
) -> list[str]:
    """`layers.{i}.attention.wq` and the like, in layer then target order. On a mixture-of-
    experts model (any `moe_layers`) the feed-forward targets take no adapter, on its dense
    layers either: PEFT (0.21, on transformers 5) reads gate_proj, up_proj and down_proj on
    such a model as the experts' (transformers 4 held them as per-expert linear layers of those
    names), so a dense layer's adapter would not load there. The experts' own adapters
    (EXPERT_LORA_TARGETS) are no linear layer's: expert_lora_shapes."""
    path = {ours.rpartition(".")[2]: ours for ours in LORA_MODULES}
    return [
        f"layers.{i}.{path[t]}"
        for i in range(n_layers)
        for t in targets
        if t in LORA_TARGETS and not (moe_layers and path[t].startswith("feed_forward."))
    ]


def expert_lora_shapes(args, config: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """The adapters `config` puts on each MoE layer's experts of model.ModelArgs `args`:
    moe.LORA_PARAMS's names -> shapes (kernels.moe.ExpertLoRA's). PEFT's adapter on an
    [E, out, in] tensor is [E, rank, in] and [E, out, rank] (stored [E * rank, in] and
    [out, rank * E]: hf.py); gate_up_proj's out holds w1's rows and w3's (hf.gate_up_rows:
    gpt-oss's interleaved), whose B is split in two here. gpt-oss's biases take none."""
    n_experts, ffn_dim, dim, r = args.n_experts, args.expert_ffn_dim, args.dim, config.rank
    out_in = {"w1": (ffn_dim, dim), "w3": (ffn_dim, dim), "w2": (dim, ffn_dim)}
    shapes = {}
    for a, bs in (EXPERT_ADAPTERS[t] for t in config.expert_targets):
        for weight, b in bs.items():
            out, inner = out_in[weight]
            shapes |= {a: (n_experts, r, inner), b: (n_experts, out, r)}
    return shapes


def check_lora_targets(args, config: LoRAConfig) -> None:
    """Refuses targets that adapt nothing on model.ModelArgs `args`: an MoE model's dense
    feed-forward ones alone, the experts' on a model without experts."""
    experts = ",".join(config.expert_targets)
    if experts and not args.moe_layers:
        raise UsageError(
            f"LoRA targets {experts} adapt an MoE model's experts: {args.family} has none"
        )
    if not experts and not lora_module_paths(args.n_layers, config.targets, args.moe_layers):
        raise UsageError(
            f"LoRA targets {list(config.targets)} adapt nothing on a mixture-of-experts model: "
            f"its feed-forward projections take no adapter; choose some of wq,wk,wv,wo,"
            f"{','.join(EXPERT_LORA_TARGETS)}"
        )


def apply_lora(
    model: nn.Module, config: LoRAConfig, base_dtype: torch.dtype, kernels: bool = False
) -> None:
    """Replaces every block's target projections with LoRALinear (and with QLoRA the MoE
    layers with NF4MoE) and freezes the rest, stored in `base_dtype` (the compute dtype: no
    fp32 master copy of what is not trained); then adds the experts' adapters where asked.
    Applied first, to the meta-built model (train.apply_techniques)."""
    dequantize = dequantize_nf4 if kernels else dequantize_nf4_reference
    args = model.args
    check_lora_targets(args, config)
    paths = lora_module_paths(args.n_layers, config.targets, args.moe_layers)
    for path in paths:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, attr)
        if config.quantize_base:
            _check_quantizable(f"{path}.weight", linear.weight.shape)
        lora = LoRALinear(
            linear.in_features, linear.out_features, config, base_dtype, dequantize,
            bias=linear.bias is not None, device=linear.weight.device,
        )  # fmt: skip
        setattr(parent, attr, lora)
    for i in args.moe_layers if config.quantize_base else ():
        block = model.layers[i]
        for name in EXPERT_WEIGHTS:
            n_experts, out, k = getattr(block.feed_forward, name).shape
            _check_quantizable(f"layers.{i}.feed_forward.{name}", (n_experts * out, k))
        block.feed_forward = NF4MoE(block.feed_forward, base_dtype, dequantize)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            frozen = torch.empty_like(param, dtype=base_dtype)
            setattr(module, name, nn.Parameter(frozen, requires_grad=False))
    for i in args.moe_layers if config.expert_targets else ():
        moe = model.layers[i].feed_forward
        device = moe.router.weight.device
        for name, shape in expert_lora_shapes(args, config).items():
            moe.register_parameter(name, nn.Parameter(torch.empty(shape, device=device)))
        moe.lora_scale = config.scale


def _check_quantizable(name: str, shape: tuple[int, ...]) -> None:
    try:  # the kernel's own check, about a model the user chose
        check_quantizable(name, tuple(shape))
    except ValueError as e:
        raise UsageError(str(e)) from None


def copy_whole_tensor(param: torch.Tensor, tensor_slice) -> None:
    param.copy_(tensor_slice[:])


def _frozen_base(model: nn.Module, name: str) -> tuple[torch.Size, Callable] | None:
    """Of a frozen base weight its module loads itself (a LoRALinear's weight, an NF4MoE's
    experts: in NF4 no parameter has the name), its shape and `load(tensor_slice, copy)`; None
    for any other parameter."""
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    if isinstance(owner, LoRALinear) and leaf == "weight":
        return torch.Size((owner.out_features, owner.in_features)), owner.load_weight
    if isinstance(owner, NF4MoE) and leaf in EXPERT_WEIGHTS:
        return owner.shapes[leaf], functools.partial(owner.load_expert, leaf)
    return None


def full_shape(model: nn.Module, name: str) -> torch.Size:
    """Parameter `name`'s shape as a checkpoint holds it: a 4-bit weight's unpacked."""
    base = _frozen_base(model, name)
    return model.get_parameter(name).shape if base is None else base[0]


def copy_into(model: nn.Module, name: str, tensor_slice, copy: Callable) -> None:
    """`copy(param, tensor_slice)` for `name`; a 4-bit base is quantized on the way in."""
    base = _frozen_base(model, name)
    if base is None:
        copy(model.get_parameter(name), tensor_slice)
    else:
        _, load = base
        load(tensor_slice, copy)


def merged_named_tensors(
    model: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor]
) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, full tensor) for hf.save_hf_checkpoint, each LoRALinear merged into one weight
    W + scale * B @ A in fp32, so that a plain Llama (transformers' or longtune's) computes
    what the adapted model does without dropout; the experts' too (merged_experts), 4-bit
    ones (NF4MoE) dequantized. `gather(param)`: the whole parameter."""
    lora = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    for name, param in model.named_parameters():
        owner_path, _, leaf = name.rpartition(".")
        if owner_path in moes and leaf.removesuffix(NF4_SUFFIX) in EXPERT_WEIGHTS:
            weight = leaf.removesuffix(NF4_SUFFIX)
            yield f"{owner_path}.{weight}", merged_experts(moes[owner_path], weight, param, gather)
        elif owner_path in moes and leaf.endswith(("lora_A", "lora_B")):
            continue
        elif owner_path not in lora or leaf == "bias":
            yield name, gather(param)
        elif leaf in ("weight", "weight" + NF4_SUFFIX):
            module = lora[owner_path]
            base = module.base_weight(gather(param))
            delta = gather(module.lora_B).float() @ gather(module.lora_A).float()
            yield f"{owner_path}.weight", base + module.scale * delta


# Each expert tensor's adapters: its B, and its A (w1's and w3's shared).
EXPERT_LORA_FACTORS = {w: (b, a) for a, bs in EXPERT_ADAPTERS.values() for w, b in bs.items()}


def merged_experts(moe: MoE, weight: str, stored: torch.Tensor, gather: Callable) -> torch.Tensor:
    """Expert tensor `weight` [E, out, in] whole from `stored` (its parameter, 4-bit in an
    NF4MoE: dequantized), with its adapters W[e] + scale * B[e] @ A[e] in fp32 where it has any."""
    whole = gather(stored)
    if isinstance(moe, NF4MoE):
        whole = moe.expert_weight(weight, torch.float32, whole, dequantize_nf4_reference)
    b, a = EXPERT_LORA_FACTORS[weight]
    if not hasattr(moe, a):
        return whole
    delta = torch.bmm(gather(getattr(moe, b)).float(), gather(getattr(moe, a)).float())
    return whole.float() + moe.lora_scale * delta

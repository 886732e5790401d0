"""The Llama model longtune trains (Llama 2 to 3.2; Mistral, Qwen2/2.5, Qwen3, SmolLM3 share
its block; Qwen3-MoE and Mixtral replace its feed-forward by experts, moe.py; Gemma 3 adds
norms and GeGLU, `Family.gemma`; gpt-oss biases, attention sinks and biased experts,
`Family.gpt_oss`); hf.py reads and writes it as HF checkpoints, lora.py adapts it.

In order: the model's numbers (`ModelArgs`, presets, FLOPs), the ops the kernels replace
(`Ops`), then the network. It imports kernels/, attention.py (the kernels and masks over packed
documents and windows), lora.py's layers and copy helpers, moe.py's `MoE`, files.py's
`UsageError`.

The model knows nothing of sharding, checkpointing or offload: shard.py and offload.py apply
them from outside, in train.apply_techniques' order. Build it on the meta device and
materialize it after sharding:

    with torch.device("meta"):
        model = Llama(ModelArgs.from_name("llama3.2-1b"))
    model.to_empty(device="cuda")
    model.init_weights(seed=0)          # or hf.load_hf_checkpoint(model, path)
"""

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import BlockMask

from attention import (
    LONG_DOCUMENT,
    SDPA_BACKENDS,
    Masks,
    PackedRows,
    attention_kernel,
    document_starts,
    packed_rows,
    window_mask,
)
from files import UsageError
from kernels import (
    IGNORE_INDEX,
    apply_rope_reference,
    fp8_linears,
    geglu_reference,
    linear_cross_entropy_reference,
    moe_experts_reference,
    rms_norm_reference,
    swiglu_reference,
)
from lora import NF4_SUFFIX, LoRALinear, copy_into, copy_whole_tensor, full_shape
from moe import MoE, Routed, expert_load, load_balancing_loss

# ----------------------------------------------------------------------------------------
# The model's numbers
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as transformers computes it (rope_frequencies), with the fields
    config_json.HF_ROPE_KEYS reads."""

    rope_type: str = "llama3"
    factor: float = 8.0
    original_max_seq_len: int = 8192  # the length the model was pre-trained at
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: YaRN's 0.1 ln(factor) + 1

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES[1:]:
            raise UsageError(
                f"RoPE scaling {self.rope_type!r}: expected one of {', '.join(ROPE_TYPES[1:])}"
            )

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's attention factor, on cos and sin (so on q.k squared); 1 for other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return yarn_mscale(self.factor)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # "default": no scaling


@dataclass(frozen=True)
class Family:
    """A HF `model_type`: its class and the block switches that transformers fixes by type alone."""

    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    nope: bool = False  # has layers without RoPE (SmolLM3's no_rope_layers)
    window: str = "none"  # which layers a sliding window may cover: "none", "all", "some"
    moe: str = "none"  # which layers are mixture-of-experts: "none", "all", "some"
    # The router's top-k weights cast to the activations' dtype before they scale the experts'
    # outputs (Qwen3-MoE's), or kept in fp32 (Mixtral's).
    rounds_router_weights: bool = False
    # Gemma's: RMSNorm scaled by 1 + weight (weights start at 0), the embedding scaled by
    # sqrt(dim), a norm after attention and after the feed-forward too, GeGLU (tanh GELU).
    gemma: bool = False
    # gpt-oss's: a bias on wo too, attention sinks (a learned logit per head in the softmax's
    # denominator, attention.attention_with_sinks), and experts whose router and projections
    # have biases, with a clamped SwiGLU (kernels.clamped_swiglu).
    gpt_oss: bool = False


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", window="all"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, window="some"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, window="some"),
    "smollm3": Family("SmolLM3ForCausalLM", nope=True, window="some"),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", qk_norm=True, window="all", moe="some", rounds_router_weights=True
    ),
    "mixtral": Family("MixtralForCausalLM", window="all", moe="all"),
    "gemma3_text": Family("Gemma3ForCausalLM", qk_norm=True, window="some", gemma=True),
    "gpt_oss": Family(
        "GptOssForCausalLM",
        qkv_bias=True,
        window="some",
        moe="all",
        rounds_router_weights=True,
        gpt_oss=True,
    ),
}

# More parameters than this is a config no machine holds (20 TB of bf16 weights alone), so a
# typo or a hostile file, refused before any module is built.
MAX_PARAMS = 10**13


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    # The family's switches, Llama's by default.
    family: str = "llama"  # the HF model_type an export is written as
    head_dim: int | None = None  # None: dim / n_heads
    qkv_bias: bool = False  # a bias on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    nope_layers: tuple[int, ...] = ()  # layers that attend without RoPE (SmolLM3's NoPE)
    # On `window_layers` each query attends its last `sliding_window` positions, itself
    # included (transformers' rule: key > query - window), within its document when masked.
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()
    # Gemma 3's: window_layers' RoPE base, unscaled (None: rope_theta, scaled as the others),
    # and the attention's scale, query_pre_attn_scalar^-1/2 (None: head_dim^-1/2).
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    # Mixture-of-experts feed-forwards (moe.py) on `moe_layers`, the others dense (ffn_dim).
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_dim: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalized to sum to 1
    moe_layers: tuple[int, ...] = ()
    router_aux_loss: bool = False  # the load-balancing loss added (HF's output_router_logits)
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        problems = []
        if self.head_dim is None:  # derived, never overwriting what the caller set
            if self.dim % self.n_heads:
                raise UsageError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} is odd; RoPE rotates pairs")
        problems += self._family_problems()
        if self.num_params() > MAX_PARAMS:
            experts = f", {self.n_experts} experts of {self.expert_ffn_dim}" * bool(self.n_experts)
            problems.append(
                f"dim {self.dim}, n_layers {self.n_layers}, ffn_dim {self.ffn_dim}{experts} and "
                f"vocab_size {self.vocab_size} make {self.num_params():.3g} parameters, expected "
                f"at most {MAX_PARAMS:.0e}"
            )
        if problems:
            raise UsageError("; ".join(problems))

    def _family_problems(self) -> list[str]:
        """What an export as `family` would lose: each switch its HF class fixes."""
        family = FAMILIES.get(self.family)
        if family is None:
            return [f"family {self.family!r}: expected one of {', '.join(FAMILIES)}"]
        problems = [
            f"{name} {getattr(self, name)} in family {self.family!r}, whose blocks have "
            f"{name} {getattr(family, name)}"
            for name in ("qkv_bias", "qk_norm")
            if getattr(self, name) != getattr(family, name)
        ]
        layers = range(self.n_layers)
        if self.nope_layers and not family.nope:
            problems.append(f"nope_layers {self.nope_layers}: family {self.family!r} has none")
        named = (*self.nope_layers, *self.window_layers, *self.moe_layers)
        if not set(named) <= set(layers):
            problems.append(
                f"nope_layers, window_layers and moe_layers are layers 0..{self.n_layers - 1}"
            )
        if (self.sliding_window is None) != (not self.window_layers):
            problems.append("a sliding_window needs window_layers, and window_layers a window")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window {self.sliding_window} must be at least 1")
        for name in ("local_rope_theta", "query_pre_attn_scalar"):  # Gemma 3's
            if (getattr(self, name) is None) == family.gemma:
                has = "needs one" if family.gemma else "has none"
                problems.append(f"{name} {getattr(self, name)}: family {self.family!r} {has}")
        if self.window_layers and family.window == "none":
            problems.append(f"family {self.family!r} has no sliding window")
        every_layer = len(self.window_layers) == self.n_layers
        if self.window_layers and family.window == "all" and not every_layer:
            problems.append(f"family {self.family!r} has its sliding window on every layer")
        return problems + self._moe_problems(family)

    def _moe_problems(self, family: Family) -> list[str]:
        if family.moe == "none":
            return [f"family {self.family!r} has no experts"] if self.moe_layers else []
        problems = []
        if not 1 <= self.experts_per_token <= self.n_experts or self.expert_ffn_dim < 1:
            problems.append(
                f"experts_per_token {self.experts_per_token} must be from 1 to n_experts "
                f"{self.n_experts}, and expert_ffn_dim {self.expert_ffn_dim} at least 1"
            )
        if family.moe == "all" and len(self.moe_layers) != self.n_layers:
            problems.append(f"family {self.family!r} has experts on every layer")
        if family.moe == "all" and not self.norm_topk_prob:
            problems.append(f"family {self.family!r} renormalizes its top-k weights")
        if not self.router_aux_loss_coef >= 0:  # a negative one rewards a collapsed router
            problems.append(f"router_aux_loss_coef {self.router_aux_loss_coef} must be >= 0")
        return problems

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in PRESETS:
            raise UsageError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return PRESETS[name]

    def feed_forward_params(self, layer: int, active: bool = False) -> int:
        """Block `layer`'s feed-forward weights: w1 w2 w3; an MoE block's router and its
        experts' w1 w2 w3, all of them or the `active` ones a token passes through."""
        if layer not in self.moe_layers:
            return 3 * self.dim * self.ffn_dim
        experts = self.experts_per_token if active else self.n_experts
        return self.dim * self.n_experts + experts * 3 * self.dim * self.expert_ffn_dim

    def _block_params(self, layer: int = 0, active: bool = False) -> tuple[int, int]:
        """Block `layer`'s (matmul weights, other parameters: norms and biases)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        matmul = self.dim * (2 * q + 2 * kv) + self.feed_forward_params(layer, active)
        gemma = self.family in FAMILIES and FAMILIES[self.family].gemma  # (refused if not)
        other = (4 if gemma else 2) * self.dim  # the block's norms
        other += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        if self.family in FAMILIES and FAMILIES[self.family].gpt_oss:  # wo's bias, the sinks
            other += self.dim + self.n_heads
            experts = self.experts_per_token if active else self.n_experts
            other += self.n_experts + experts * (2 * self.expert_ffn_dim + self.dim)
        return matmul, other

    def num_params(self, active: bool = False) -> int:
        """All parameters, or (`active`) those a token passes through: of an MoE block, the
        experts_per_token of its experts."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        blocks = sum(sum(self._block_params(i, active)) for i in range(self.n_layers))
        return blocks + embeddings + self.dim

    def matmul_params(self, active: bool = False) -> int:
        """The blocks' matmul weights (of MoE blocks, the `active` experts' only if asked)."""
        return sum(self._block_params(i, active)[0] for i in range(self.n_layers))

    def training_flops(self, tokens: float, attended_pairs: float, frozen: bool = False) -> float:
        """Training FLOPs of `tokens` tokens attending `attended_pairs` (query, key) pairs:
        weight_flops per matmul weight per token, plus 12*L*H*Dh per pair (QK^T and AV,
        2*H*Dh each, x3). An MoE block counts the experts a token passes through."""
        # The embedding lookup is not a matmul; a tied embedding still is the output matmul.
        output = self.vocab_size * self.dim
        matmul_params = self.matmul_params(active=True) + output
        per_pair = 12 * self.n_layers * self.n_heads * self.head_dim
        return weight_flops(frozen) * matmul_params * tokens + per_pair * attended_pairs

    def flops_per_token(self, seq_len: int, frozen: bool = False) -> float:
        """Per token of causal rows of `seq_len` tokens: flops_formula's, S/2 keys each on a
        causal layer (fewer on a windowed one: attended_per_token)."""
        return self.training_flops(1, self.attended_per_token(seq_len), frozen)

    def attended_per_token(self, seq_len: int) -> float:
        """The pairs a token of a causal row of `seq_len` attends, averaged over the layers
        (as attended_pairs counts them): S/2, or min(i + 1/2, W) for query i in a window W."""
        return self.mean_over_layers(
            lambda window: seq_len / 2 if seq_len <= window else window - window**2 / seq_len / 2
        )

    def mean_over_layers(
        self, of_window: Callable[[float], float | torch.Tensor]
    ) -> float | torch.Tensor:
        """`of_window(window)` averaged over the layers: math.inf on the causal layers,
        `sliding_window` on `window_layers`."""
        windowed = len(self.window_layers) / self.n_layers
        if not windowed:
            return of_window(math.inf)
        return (1 - windowed) * of_window(math.inf) + windowed * of_window(self.sliding_window)

    def window_shorter(self, seq_len: int | None = None) -> bool:
        """Whether the sliding window is shorter than rows of `seq_len` (None: of any length, some
        longer): then the windowed layers need a mask of their own."""
        window = self.sliding_window
        return window is not None and (seq_len is None or seq_len > window)

    def attention_masked(self, document_mask: bool, seq_len: int | None = None) -> bool:
        """Whether Llama.attention_mask may give attention a mask, not SDPA's causal kernel
        alone: the documents packed in a row kept apart (`document_mask`), a window shorter than
        rows of `seq_len` (None: of any length), or gpt-oss's attention sinks (a kernel's
        logsumexp: not SDPA's)."""
        return document_mask or self.window_shorter(seq_len) or FAMILIES[self.family].gpt_oss


def weight_flops(frozen: bool = False) -> int:
    """Training FLOPs per matmul weight per token: forward 2, backward 4 (the input's gradient
    and the weight's); 4 if `frozen` (LoRA's base: no weight gradient, adapters not counted)."""
    return 4 if frozen else 6


def flops_formula(frozen: bool = False) -> str:
    """ModelArgs.flops_per_token as the log writes it: N matmul weights, L layers of H heads of
    Dh, a causal row of S tokens (S/2 keys a token, 12*L*H*Dh FLOPs a (query, key) pair)."""
    return f"{weight_flops(frozen)}N + 6*L*S*H*Dh"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


# Llama 3.1's and 3.2's context: RoPE scaled to 128K tokens.
_LLAMA31 = {"rope_scaling": RopeScaling(factor=8.0), "max_seq_len": 131072}
_LLAMA32 = {**_LLAMA31, "rope_scaling": RopeScaling(factor=32.0), "tie_embeddings": True}
_QWEN = {"norm_eps": 1e-6, "rope_theta": 1e6}  # Qwen2.5's and Qwen3's


def _gemma3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, window: int):
    """A Gemma 3 shape from its config.json on the hub (google/gemma-3-*-pt)."""
    return dict(
        family="gemma3_text", dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, head_dim=256, norm_eps=1e-6, rope_theta=1e6,
        tie_embeddings=True, qk_norm=True, sliding_window=window,
        window_layers=tuple(i for i in range(n_layers) if (i + 1) % 6),
        local_rope_theta=1e4, query_pre_attn_scalar=256,
    )  # fmt: skip


# Gemma 3 4b+: 128K tokens by RoPE scaled 8x on the global layers.
_GEMMA3_LONG = {
    "vocab_size": 262208, "max_seq_len": 131072, "rope_scaling": RopeScaling("linear", 8.0)
}  # fmt: skip

PRESETS: dict[str, ModelArgs] = {
    "llama2-7b": ModelArgs(
        n_kv_heads=32, vocab_size=32000, ffn_dim=11008, rope_theta=10000.0, max_seq_len=4096
    ),
    "llama3-8b": ModelArgs(),
    "llama3.1-8b": ModelArgs(**_LLAMA31),
    "llama3.1-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **_LLAMA31),
    "llama3.2-1b": ModelArgs(dim=2048, n_layers=16, ffn_dim=8192, **_LLAMA32),
    "llama3.2-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, ffn_dim=8192, **_LLAMA32),
    # The Llama family's other published shapes, from their config.json on the hub.
    "mistral-7b": ModelArgs(  # v0.3 (v0.1's 4096-token sliding window is gone)
        family="mistral",
        vocab_size=32768,
        rope_theta=1e6,
        max_seq_len=32768,
    ),
    "qwen2.5-7b": ModelArgs(
        family="qwen2",
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        vocab_size=152064,
        ffn_dim=18944,
        **_QWEN,
        max_seq_len=131072,
        qkv_bias=True,
    ),
    "qwen3-8b": ModelArgs(
        family="qwen3",
        n_layers=36,
        vocab_size=151936,
        ffn_dim=12288,
        **_QWEN,
        max_seq_len=40960,
        head_dim=128,
        qk_norm=True,
    ),
    # Mixture-of-experts (moe.py).
    "qwen3-30b-a3b": ModelArgs(
        family="qwen3_moe",
        dim=2048,
        n_layers=48,
        n_kv_heads=4,
        vocab_size=151936,
        ffn_dim=6144,
        **_QWEN,
        max_seq_len=40960,
        head_dim=128,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        expert_ffn_dim=768,
        norm_topk_prob=True,
        moe_layers=tuple(range(48)),
    ),
    "mixtral-8x7b": ModelArgs(
        family="mixtral",
        vocab_size=32000,
        rope_theta=1e6,
        max_seq_len=32768,
        n_experts=8,
        experts_per_token=2,
        expert_ffn_dim=14336,
        norm_topk_prob=True,
        moe_layers=tuple(range(32)),
    ),
    # Gemma 3's text models (a 4b+ checkpoint's text_config, whose other keys are
    # Gemma3TextConfig's defaults): 5 windowed layers in 6, each with RoPE base 10^4.
    "gemma-3-1b": ModelArgs(
        **_gemma3(1152, 26, 4, 1, 6912, 512), vocab_size=262144, max_seq_len=32768
    ),
    "gemma-3-4b": ModelArgs(**_gemma3(2560, 34, 8, 4, 10240, 1024), **_GEMMA3_LONG),
    "gemma-3-12b": ModelArgs(**_gemma3(3840, 48, 16, 8, 15360, 1024), **_GEMMA3_LONG),
    "gemma-3-27b": ModelArgs(  # its heads 128 wide, attention scaled by 168^-1/2
        **{**_gemma3(5376, 62, 32, 16, 21504, 1024), "head_dim": 128, "query_pre_attn_scalar": 168},
        **_GEMMA3_LONG,
    ),
    # openai/gpt-oss-20b's config.json on the hub (its experts in MXFP4 there, dequantized on
    # load): a window of 128 on every other layer, YaRN to 128K tokens, 4 of 32 experts.
    "gpt-oss-20b": ModelArgs(
        family="gpt_oss",
        dim=2880,
        n_layers=24,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        vocab_size=201088,
        ffn_dim=2880,
        rope_theta=150000.0,
        rope_scaling=RopeScaling("yarn", 32.0, 4096, truncate=False),
        max_seq_len=131072,
        qkv_bias=True,
        sliding_window=128,
        window_layers=tuple(range(0, 24, 2)),
        n_experts=32,
        experts_per_token=4,
        expert_ffn_dim=2880,
        norm_topk_prob=True,
        moe_layers=tuple(range(24)),
    ),
    # For tests and CPU runs: odd sizes on purpose, a vocabulary that fits the byte tokenizer.
    "tiny": ModelArgs(
        dim=96,
        n_layers=4,
        n_heads=6,
        n_kv_heads=2,
        vocab_size=320,
        ffn_dim=200,
        rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=256),
        max_seq_len=2048,
    ),
}


def attended_pairs(
    positions: torch.Tensor, document_mask: bool, seq_len: int, args: ModelArgs
) -> torch.Tensor | float:
    """The (query, key) pairs a layer computes in these rows (or a context-parallel rank's
    slices), averaged over the layers: S^2/2 per row, or with the document mask l^2/2 per
    document, the sum of (position + 1/2); on a windowed layer each query's capped at the
    window. A tensor stays on the device: it is read on log steps only."""
    if document_mask:
        return args.mean_over_layers(
            lambda window: pairs_attended(positions, window).sum(dtype=torch.float64)
        )
    return positions.numel() * args.attended_per_token(seq_len)


def pairs_attended(positions, window: float):
    """The (query, key) pairs a query at each of `positions` (counted from its document's
    start) attends, as the FLOPs count them: position + 1/2 (the diagonal's half), at most the
    window. `positions`: a tensor, or a numpy array (data.mean_document_pairs)."""
    return (positions + 0.5).clip(max=window)


def rope_frequencies(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """inv_freq [head_dim/2] fp32 as transformers computes it, with the model's scaling ("llama3"
    slows long wavelengths and keeps short ones, "yarn" slows dimensions along a ramp; YaRN's
    attention factor is RopeScaling.cos_sin_scale)."""
    exponents = torch.arange(0, args.head_dim, 2, device=device, dtype=torch.int64).float()
    inv_freq = 1.0 / args.rope_theta ** (exponents / args.head_dim)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        blend = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - blend) * inv_freq / s.factor + blend * inv_freq
        long_wavelen = s.original_max_seq_len / s.low_freq_factor
        short_wavelen = s.original_max_seq_len / s.high_freq_factor
        scaled = torch.where(wavelen > long_wavelen, inv_freq / s.factor, inv_freq)
        is_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
        return torch.where(is_band, blended, scaled)
    pos_freqs = args.rope_theta ** (exponents / args.head_dim)  # as transformers rounds

    def dimension(turns: float) -> float:  # the dimension that turns `turns` times
        wavelengths = s.original_max_seq_len / (turns * 2 * math.pi)
        return args.head_dim * math.log(wavelengths) / (2 * math.log(args.rope_theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, args.head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(args.head_dim // 2, dtype=torch.float32, device=device)
    kept = 1 - ((dims - low) / (high - low)).clamp(0, 1)
    return (1.0 / (s.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


# ----------------------------------------------------------------------------------------
# The seam between the model and kernels/: the ops a kernel fuses, by reference or Triton
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable  # (x [..., D], weight [D], eps) -> [..., D]
    apply_rope: Callable  # (q [B,S,H,Dh], k [B,S,Hkv,Dh], positions [B,S], inv_freq, scale) -> q, k
    swiglu: Callable  # (gate, up) -> silu(gate) * up
    geglu: Callable  # (gate, up) -> tanh-GELU(gate) * up, Gemma's
    linear_cross_entropy: Callable  # (hidden [N,D], weight [V,D], labels [N], ignore, reduction)
    project: Callable  # (x, linears) -> [linear(x) for each], the projections reading one x
    moe_experts: Callable  # (x [T,D], experts [T,k], weights [T,k], w1, w3, w2[, biases,
    # activation, lora]) -> [T,D]; gpt-oss's experts add biases and a clamped SwiGLU
    # (activation "clamped_swiglu"), LoRA its adapters (kernels.moe.ExpertLoRA)


def project(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [linear(x) for linear in linears]


REFERENCE_OPS = Ops(
    rms_norm=rms_norm_reference,
    apply_rope=apply_rope_reference,
    swiglu=swiglu_reference,
    geglu=geglu_reference,
    linear_cross_entropy=linear_cross_entropy_reference,
    project=project,
    moe_experts=moe_experts_reference,
)


def triton_ops() -> Ops:
    """The Triton kernels; they run on CUDA, or on the CPU under TRITON_INTERPRET=1."""
    import kernels

    return dataclasses.replace(
        REFERENCE_OPS,
        rms_norm=kernels.rms_norm,
        apply_rope=kernels.apply_rope,
        # The MLP's gate and up are its linears' outputs, read by nothing else: the kernel's
        # backward may write its gradients over them (kernels.swiglu).
        swiglu=functools.partial(kernels.swiglu, overwrite=True),
        geglu=functools.partial(kernels.geglu, overwrite=True),
        linear_cross_entropy=kernels.linear_cross_entropy,
        moe_experts=kernels.moe_experts,
    )


def fp8_ops(ops: Ops, kernels: bool) -> Ops:
    """`ops` with the projections reading one input in one fp8_linears call (--fp8), which
    quantizes it once; a LoRA base too, not a 4-bit one. Head and embedding stay in bf16. The
    scales by the Triton kernels, or (not `kernels`) their references."""

    def fp8_project(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        in_fp8 = [
            m for m in linears
            if type(m) is nn.Linear or (isinstance(m, LoRALinear) and not m.quantized)
        ]  # fmt: skip
        weights, biases = [m.weight for m in in_fp8], [m.bias for m in in_fp8]
        outputs = iter(fp8_linears(x, weights, biases, kernels) if in_fp8 else ())
        projected = []
        for m in linears:
            if m not in in_fp8:
                projected.append(m(x))
            elif isinstance(m, LoRALinear):
                projected.append(next(outputs) + m.adapter(x))
            else:
                projected.append(next(outputs))
        return projected

    return dataclasses.replace(ops, project=fp8_project)


# ----------------------------------------------------------------------------------------
# The network
# ----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops, plus_one: bool = False):
        """`plus_one`: Gemma's, scaled by 1 + weight."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.ops = ops
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plus_one:  # as transformers' Gemma3RMSNorm: scaled in fp32, then rounded once
            return self.ops.rms_norm(x.float(), 1 + self.weight.float(), self.eps).type_as(x)
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self, args: ModelArgs, ops: Ops, sdpa_backends: list[SDPBackend], use_rope: bool = True
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, q_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        gpt_oss = FAMILIES[args.family].gpt_oss
        self.wo = nn.Linear(q_dim, args.dim, bias=gpt_oss)
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if gpt_oss else None
        # QK-norm (Qwen3): q.k stays in range without a softmax temperature.
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            gemma = FAMILIES[args.family].gemma
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, ops, plus_one=gemma)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, ops, plus_one=gemma)
        self.use_rope = use_rope
        self.rope_scale = args.rope_scaling.cos_sin_scale if args.rope_scaling else 1.0
        # Gemma 3's scale, query_pre_attn_scalar^-1/2, applied to q before the kernels' own
        # head_dim^-1/2: the attention wrappers (offload.py, shard.py) then need no scale.
        self.q_scale = 1.0
        if args.query_pre_attn_scalar is not None:
            self.q_scale = math.sqrt(args.head_dim / args.query_pre_attn_scalar)
        self.ops = ops
        self.sdpa_backends = sdpa_backends

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        mask: torch.Tensor | BlockMask | PackedRows | None = None,
    ) -> torch.Tensor:
        """Causal attention; `mask` (one of `Llama.attention_mask`'s) also keeps it inside
        documents, or a sliding window."""
        bsz, seq_len, _ = x.shape
        q, k, v = self.ops.project(x, (self.wq, self.wk, self.wv))
        q = q.view(bsz, seq_len, self.n_heads, self.head_dim)
        k = k.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.ops.apply_rope(q, k, positions, inv_freq, self.rope_scale)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, Dh]
        out = self.attend(q, k, v, mask, self.sinks)
        (out,) = self.ops.project(out.transpose(1, 2).reshape(bsz, seq_len, -1), (self.wo,))
        return out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockMask | PackedRows | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attention_kernel` with this model's SDPA backends: a method of its own so that
        offload.apply_ac can keep its output and shard.apply_context_parallel can wrap it.
        Each replaces `attention.attend` on the instance, in train.apply_techniques' order, so
        a call runs, outermost first: shard._attend_whole_sequence (context parallelism: an
        all-to-all trades the sequence for heads), offload._KeptAttention (the "attention" and
        "selective" checkpointing of this block), then this method. Context parallelism also
        wraps `Llama.forward` (shard._forward_rows), `Llama.attention_mask` (_whole_row_mask)
        and an MoE model's `Llama.routed` (_pooled_routing)."""
        return attention_kernel(q, k, v, mask, self.sdpa_backends, sinks)


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, ops: Ops, gelu: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.ops = ops
        self.activation = ops.geglu if gelu else ops.swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU, or Gemma's GeGLU. MLP tiling (offload.apply_mlp_tiling) replaces it on the
        instance with offload._tiled_forward, which runs it once per tile of positions, each
        tile checkpointed; nothing else wraps it."""
        gate, up = self.ops.project(x, (self.w1, self.w3))
        (out,) = self.ops.project(self.activation(gate, up), (self.w2,))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, ops: Ops, sdpa_backends: list[SDPBackend], layer: int):
        super().__init__()
        gemma = FAMILIES[args.family].gemma
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, ops, gemma)
        self.attention = Attention(args, ops, sdpa_backends, layer not in args.nope_layers)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, ops, gemma)
        # Gemma's norms of the attention's and the feed-forward's outputs too.
        self.post_attention_norm = self.post_ffn_norm = nn.Identity()
        if gemma:
            self.post_attention_norm = RMSNorm(args.dim, args.norm_eps, ops, plus_one=True)
            self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps, ops, plus_one=True)
        if layer in args.moe_layers:
            self.feed_forward = MoE(
                args.dim, args.expert_ffn_dim, args.n_experts, args.experts_per_token,
                args.norm_topk_prob, FAMILIES[args.family].rounds_router_weights, ops,
                FAMILIES[args.family].gpt_oss,
            )  # fmt: skip
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim, ops, gelu=gemma)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        mask: torch.Tensor | BlockMask | PackedRows | None = None,
    ) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), positions, inv_freq, mask)
        h = x + self.post_attention_norm(attended)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


def logits_or_loss(h, weight: torch.Tensor, labels, ops: Ops, reduction: str) -> torch.Tensor:
    if labels is None:
        return F.linear(h, weight)
    return ops.linear_cross_entropy(
        h.flatten(0, 1), weight, labels.flatten(), IGNORE_INDEX, reduction
    )


class Output(nn.Module):
    """The untied head. Its weight is used only inside its own call, whether for the logits or
    for the fused loss: hooks on the module (FSDP's gather of the [norm, output] group and its
    post-forward, shard.apply_fsdp) see every use. (torch 2.11 warned otherwise.)"""

    def __init__(self, dim: int, vocab_size: int, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim))  # Llama.init_weights sets it
        self.ops = ops

    def forward(self, h, labels=None, reduction: str = "mean") -> torch.Tensor:
        return logits_or_loss(h, self.weight, labels, self.ops, reduction)


class Llama(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        ops: Ops = REFERENCE_OPS,
        attention_backend: str = "auto",
        document_mask: bool = False,
    ):
        """`document_mask`: no attention across the documents packed in a row (attention_mask)."""
        super().__init__()
        if attention_backend not in SDPA_BACKENDS:
            raise UsageError(
                f"unknown attention backend {attention_backend!r}; "
                f"expected one of {sorted(SDPA_BACKENDS)}"
            )
        self.args = args
        self.ops = ops
        self.document_mask = document_mask
        self.long_document = LONG_DOCUMENT  # tests lower it to try both routes on small rows
        # An MoE model's last load-balancing loss and busiest expert's load, for the metrics.
        self.routing: torch.Tensor | None = None
        backends = SDPA_BACKENDS[attention_backend]
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(args, ops, backends, i) for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps, ops, plus_one=FAMILIES[args.family].gemma)
        # A tied model has no output module but reuses the embedding: one Parameter shared by
        # two modules would not survive `to_empty`, which re-creates each module's parameters.
        self.output = None
        if not args.tie_embeddings:
            self.output = Output(args.dim, args.vocab_size, ops)

    def attention_mask(
        self, positions: torch.Tensor, starts: tuple[tuple[int, ...], ...] | None = None
    ) -> Masks:
        """Every block's mask (some block's one where `ModelArgs.attention_masked`), chosen once
        per forward so that a block recomputed in backward gets the same kernels. `starts`
        (data.Batch has them) saves reading them off the GPU."""
        window = self.args.sliding_window
        within_window = not self.args.window_shorter(positions.shape[1])
        has_sinks = FAMILIES[self.args.family].gpt_oss  # need a kernel's logsumexp: not SDPA's
        causal = None
        if self.document_mask and not has_sinks:
            if starts is None:
                starts = document_starts(positions)
            causal = packed_rows(positions, starts, self.long_document)
        if within_window and not has_sinks:
            return Masks(causal, causal)
        if not self.document_mask:  # the window counts along the row, whatever its documents
            bsz, seq_len = positions.shape
            positions = torch.arange(seq_len, device=positions.device).expand(bsz, seq_len)
        if not has_sinks:
            return Masks(causal, window_mask(positions, window))
        full = window_mask(positions, None)
        return Masks(full, full if within_window else window_mask(positions, window))

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        reduction: str = "mean",
        document_starts: tuple[tuple[int, ...], ...] | None = None,
        aux_loss: bool = True,
    ) -> torch.Tensor:
        """tokens, labels, positions: [B, S]. Without labels, logits [B, S, V]; with them, the
        loss ("mean" over labels that are not -100, or "sum") by `Ops.linear_cross_entropy`,
        which need not build the logits, plus the load-balancing term where `router_aux_loss`
        and `aux_loss` (train.evaluate's is the cross-entropy alone). Packed documents'
        positions restart at 0."""
        bsz, seq_len = tokens.shape
        if positions is None:
            positions = torch.arange(seq_len, device=tokens.device).expand(bsz, seq_len)
        inv_freq = rope_frequencies(self.args, tokens.device)
        local_inv_freq = inv_freq  # Gemma 3's window layers have a RoPE base of their own
        if self.args.local_rope_theta is not None:
            local = dataclasses.replace(
                self.args, rope_theta=self.args.local_rope_theta, rope_scaling=None
            )
            local_inv_freq = rope_frequencies(local, tokens.device)
        masks = self.attention_mask(positions, document_starts)
        for i in self.args.moe_layers:  # each MoE layer's routing in this forward
            self.layers[i].feed_forward.routed = []
            self.layers[i].feed_forward.recording = True
        h = self.tok_embeddings(tokens)
        if FAMILIES[self.args.family].gemma:  # sqrt(dim) rounded to h's dtype, as transformers
            h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype)
        for i, layer in enumerate(self.layers):
            if i in self.args.window_layers:
                h = layer(h, positions, local_inv_freq, masks.windowed)
            else:
                h = layer(h, positions, inv_freq, masks.causal)
        h = self.norm(h)
        if self.output is None:  # tied: the embedding's weight (FSDP's root group holds it)
            loss = logits_or_loss(h, self.tok_embeddings.weight, labels, self.ops, reduction)
        else:
            loss = self.output(h, labels, reduction)
        if labels is None or not self.args.moe_layers:
            return loss  # without labels, the logits
        routed = self.routed()
        for i in self.args.moe_layers:  # read: a recompute in backward adds nothing (MoE.forward)
            self.layers[i].feed_forward.recording = False
        aux = load_balancing_loss(routed)
        # The metrics log's figures (train.StepResult), left on the device: no wait for the GPU.
        self.routing = torch.stack([aux.detach(), expert_load(routed).max()])
        if not (self.args.router_aux_loss and aux_loss):
            return loss
        # transformers adds coef x the load-balancing loss to the mean; to a sum, the same per
        # labelled token, so that train_step's division by the step's count gives that mean.
        per_label = 1 if reduction == "mean" else (labels != IGNORE_INDEX).sum()
        return loss + self.args.router_aux_loss_coef * aux * per_label

    def routed(self) -> list[Routed]:
        """The last forward's routing on each MoE layer, for the load-balancing loss and the
        experts' load. Context parallelism pools it over the ranks sharing the rows (shard.py)."""
        calls = [self.layers[i].feed_forward.routed for i in self.args.moe_layers]
        return [sum(routed[1:], start=routed[0]) for routed in calls]

    def initial_value(self, name: str, seed: int, device: torch.device) -> torch.Tensor:
        """The full initial tensor of parameter `name` (fp32), one per (seed, name) whatever the
        device and sharding. wo and w2 write into the residual stream: scaled down so that its
        variance does not grow with depth. LoRA's adapters as PEFT's: B = 0, so an adapted model
        starts equal to its base; A as nn.Linear's default (kaiming-uniform, a = sqrt(5))."""
        shape = full_shape(self, name)  # a 4-bit weight's is no parameter's
        if name.endswith("norm.weight"):  # Gemma's scale by 1 + weight
            plus_one = FAMILIES[self.args.family].gemma
            return (torch.zeros if plus_one else torch.ones)(shape, device=device)
        if name.endswith(("lora_B", "bias")):
            return torch.zeros(shape, device=device)
        generator = torch.Generator(device).manual_seed(seed + zlib.crc32(name.encode()))
        if name.endswith("lora_A"):  # [rank, in], an expert's [E, rank, in]
            bound = 1 / math.sqrt(shape[-1])
            return (torch.rand(shape, generator=generator, device=device) * 2 - 1) * bound
        std = 0.02
        if name.endswith(("wo.weight", "w2.weight", "feed_forward.w2")):
            std /= math.sqrt(2 * self.args.n_layers)
        return torch.randn(shape, generator=generator, device=device) * std

    @torch.no_grad()
    def init_weights(
        self,
        seed: int = 0,
        device: torch.device | None = None,
        copy: Callable[[torch.Tensor, object], None] | None = None,
        trainable_only: bool = False,
    ) -> None:
        """Each parameter's initial value (or the trainable ones' alone) computed whole on `device`
        (default: its own), moved in by `copy(param, full_tensor)` (shard.py's: a rank's rows)."""
        for name, param in self.named_parameters():
            if param.requires_grad or not trainable_only:
                name = name.removesuffix(NF4_SUFFIX)  # a quantized weight's value is the weight's
                full = self.initial_value(name, seed, device or param.device)
                copy_into(self, name, full, copy or copy_whole_tensor)

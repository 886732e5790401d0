"""The Llama model longtune trains (Llama 2 to 3.2; Mistral, Qwen2/2.5, Qwen3, SmolLM3 share
its block), its LoRA adapters, and the HF checkpoints and PEFT adapters it reads and writes.

In order: the model's numbers (`ModelArgs`, presets, FLOPs), the ops the kernels replace
(`Ops`), attention over packed documents, the network, HF checkpoints, then LoRA and PEFT
adapters. User input is checked with data.py's `UsageError`, `read_json` and `OutputDir`.

The model knows nothing of sharding, checkpointing or offload: shard.py and offload.py apply
them from outside, in train.apply_techniques' order. Build it on the meta device and
materialize it after sharding:

    with torch.device("meta"):
        model = Llama(ModelArgs.from_name("llama3.2-1b"))
    model.to_empty(device="cuda")
    model.init_weights(seed=0)          # or load_hf_checkpoint(model, path)
"""

import dataclasses
import functools
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from data import SPECIAL_TOKEN_KEYS, HFTokenizer, document_starts
from files import OutputDir, UsageError, give_ordinary_mode, read_json
from kernels import (
    IGNORE_INDEX,
    apply_rope_reference,
    dequantize_nf4,
    dequantize_nf4_reference,
    fp8_linears,
    linear_cross_entropy_reference,
    nf4_linear,
    quantize_nf4,
    rms_norm_reference,
    swiglu_reference,
)
from kernels.nf4 import check_quantizable, row_bytes, scale_count

# ----------------------------------------------------------------------------------------
# The model's numbers
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as transformers computes it (rope_frequencies), with HF_ROPE_KEYS' fields."""

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
        return _yarn_mscale(self.factor)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # "default": no scaling

# Each scaling's RopeScaling fields -> their keys in HF rope settings.
HF_ROPE_KEYS = {
    "linear": {"factor": "factor"},
    "llama3": {
        "factor": "factor",
        "original_max_seq_len": "original_max_position_embeddings",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
    },
    "yarn": {
        "factor": "factor",
        "original_max_seq_len": "original_max_position_embeddings",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
        "truncate": "truncate",
        "attention_factor": "attention_factor",
    },
}


@dataclass(frozen=True)
class Family:
    """A HF `model_type`: its class and the block switches that transformers fixes by type alone."""

    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    nope: bool = False  # has layers without RoPE (SmolLM3's no_rope_layers)
    window: str = "none"  # which layers a sliding window may cover: "none", "all", "some"


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", window="all"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, window="some"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, window="some"),
    "smollm3": Family("SmolLM3ForCausalLM", nope=True, window="some"),
}

# ModelArgs field -> its key in every family's config.json: for from_hf_config and hf_config.
HF_CONFIG_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}
# What every family's block fixes, by config.json key: from_hf_config refuses anything else.
HF_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
# What each number or switch of config.json may be, (kind, least, most): integers within
# [least, most], other numbers in (least, most]. Sizes stop below 2^32 (token ids are uint32);
# layers at 1024, 8x Llama 3.1 405B's 126, since each is a module built before the planner can
# refuse the model (10^6 took minutes; ModelArgs bounds the parameters the sizes make together).
# An epsilon above 1 would outweigh the mean square of unit-scale activations; 1e308 is inf in
# fp32, which makes every norm's output 0.
_SIZE = (int, 1, 2**32 - 1)
_POSITIVE = (float, 0, math.inf)
HF_RANGES = {
    **dict.fromkeys(["hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "intermediate_size", "max_position_embeddings", "head_dim", "sliding_window",
                     "no_rope_layer_interval", "original_max_position_embeddings"], _SIZE),
    "num_hidden_layers": (int, 1, 1024),
    "max_window_layers": (int, 0, 2**32 - 1),
    "rms_norm_eps": (float, 0, 1),
    **dict.fromkeys(["rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                     "beta_slow", "attention_factor"], _POSITIVE),
    **dict.fromkeys(["tie_word_embeddings", "use_sliding_window"], (bool, False, True)),
}  # fmt: skip
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
    # A sliding window on `window_layers`, not implemented (check_sequence_length keeps
    # sequences inside it: plain causal attention); kept so an export is the model it came from.
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()

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
            problems.append(
                f"dim {self.dim}, n_layers {self.n_layers}, ffn_dim {self.ffn_dim} and vocab_size "
                f"{self.vocab_size} make {self.num_params():.3g} parameters, expected at most "
                f"{MAX_PARAMS:.0e}"
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
        if not set(self.nope_layers) <= set(layers) or not set(self.window_layers) <= set(layers):
            problems.append(f"nope_layers and window_layers are layers 0..{self.n_layers - 1}")
        if (self.sliding_window is None) != (not self.window_layers):
            problems.append("a sliding_window needs window_layers, and window_layers a window")
        if self.window_layers and family.window == "none":
            problems.append(f"family {self.family!r} has no sliding window")
        every_layer = len(self.window_layers) == self.n_layers
        if self.window_layers and family.window == "all" and not every_layer:
            problems.append(f"family {self.family!r} has its sliding window on every layer")
        return problems

    def check_sequence_length(self, seq_len: int) -> None:
        if self.sliding_window is not None and seq_len > self.sliding_window:
            raise UsageError(
                f"this {self.family} model attends within a sliding window of "
                f"{self.sliding_window} tokens on layers {list(self.window_layers)}, which "
                f"longtune does not implement: --seq-len {seq_len} must be at most "
                f"{self.sliding_window} (then attention is plain causal)"
            )

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in PRESETS:
            raise UsageError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike) -> "ModelArgs":
        """A HF `config.json` (or its directory); a missing key is read from HF_CONFIG_DEFAULTS."""
        path = Path(path)
        config_path = path / "config.json" if path.is_dir() else path
        if path.is_file() and path.suffix != ".json":
            raise _checkpoint_is_a_directory(path)
        if not config_path.is_file():
            raise UsageError(f"no Hugging Face config.json at {config_path}")
        raw = read_json(config_path)
        try:
            family = raw.get("model_type")
            if not isinstance(family, str) or family not in FAMILIES:
                raise UsageError(
                    f"model_type is {family or 'missing'!r}; longtune reads the dense Llama "
                    f"family: {', '.join(FAMILIES)}"
                )
            # A null num_key_value_heads or head_dim is derived from the heads, as transformers
            # derives it; a null sliding_window is none; another null is the default.
            derived = {k for k in ("num_key_value_heads", "head_dim") if raw.get(k, 0) is None}
            given = {k: v for k, v in raw.items() if v is not None or k == "sliding_window"}
            config = {**HF_CONFIG_DEFAULTS[family], **given}
            config = {k: v for k, v in config.items() if k not in derived}
            for key, expected in HF_FIXED.items():
                if config.get(key, expected) != expected:
                    raise UsageError(f"{key} is {config[key]!r}, expected {expected!r}")
            # transformers >= 5 writes `rope_parameters`, older ones `rope_theta` + `rope_scaling`.
            rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
            _check_hf_numbers(config, rope)
            n_layers = config["num_hidden_layers"]
            nope_layers = _nope_layers(config, n_layers) if family == "smollm3" else ()
            window, window_layers = _sliding_window(config, family, n_layers, nope_layers)
            fields = {field: config[key] for field, key in HF_CONFIG_KEYS.items() if key in config}
            fields.setdefault("n_kv_heads", fields["n_heads"])  # head_dim: ModelArgs derives it
            return cls(
                **fields,
                rope_theta=rope.get("rope_theta", config["rope_theta"]),
                rope_scaling=_rope_scaling(config, rope),
                family=family,
                qkv_bias=FAMILIES[family].qkv_bias,
                qk_norm=FAMILIES[family].qk_norm,
                nope_layers=nope_layers,
                sliding_window=window,
                window_layers=window_layers,
            )
        except UsageError as e:
            raise UsageError(f"{config_path}: {e}") from None

    def _block_params(self) -> tuple[int, int]:
        """A block's (matmul weights, other parameters: norms and biases)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        matmul = self.dim * (2 * q + 2 * kv) + 3 * self.dim * self.ffn_dim  # wq wk wv wo w1 w2 w3
        other = 2 * self.dim  # the two norms
        other += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        return matmul, other

    def num_params(self) -> int:
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * sum(self._block_params()) + embeddings + self.dim

    def training_flops(self, tokens: float, attended_pairs: float, frozen: bool = False) -> float:
        """Training FLOPs of `tokens` tokens attending `attended_pairs` (query, key) pairs: 6 per
        matmul weight per token (forward 2, backward 4; 4 if `frozen`: LoRA's base, no weight
        gradient, adapters not counted), plus 12*L*H*Dh per pair (QK^T and AV, 2*H*Dh each, x3)."""
        # The embedding lookup is not a matmul; a tied embedding still is the output matmul.
        output = self.vocab_size * self.dim
        matmul_params = self.n_layers * self._block_params()[0] + output
        per_pair = 12 * self.n_layers * self.n_heads * self.head_dim
        return (4 if frozen else 6) * matmul_params * tokens + per_pair * attended_pairs

    def flops_per_token(self, seq_len: int, frozen: bool = False) -> float:
        """Per token of causal rows of `seq_len` tokens: 6N + 6*L*S*d (4N frozen), S/2 keys each."""
        return self.training_flops(1, seq_len / 2, frozen)


def _rope_scaling(config: dict, rope: dict) -> RopeScaling | None:
    """HF rope settings as transformers reads them: what they leave out is RopeScaling's
    default, except the pre-training length (max_position_embeddings) and YaRN's attention
    factor when mscale and mscale_all_dim are both given (DeepSeek's form)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UsageError(
            f"rope_type {rope_type!r} is not one longtune computes; expected one of "
            f"{', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    keys = HF_ROPE_KEYS[rope_type]
    needs = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k in keys.values()]
    missing = [k for k in needs if rope.get(k) is None]
    if missing:  # transformers refuses these too: it has no default for them
        raise UsageError(f"rope_type {rope_type!r} needs {missing} as well")
    values = {field: rope[key] for field, key in keys.items() if rope.get(key) is not None}
    if "truncate" in rope and "truncate" in keys:  # a null one too, as transformers reads it
        values["truncate"] = rope["truncate"]
    if "original_max_seq_len" in keys:
        values.setdefault("original_max_seq_len", config["max_position_embeddings"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if rope_type == "yarn" and "attention_factor" not in values and mscale and mscale_all_dim:
        ratio = _yarn_mscale(rope["factor"], mscale) / _yarn_mscale(rope["factor"], mscale_all_dim)
        values["attention_factor"] = ratio
    return RopeScaling(rope_type, **values)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _nope_layers(config: dict, n_layers: int) -> tuple[int, ...]:
    """SmolLM3's NoPE layers: `no_rope_layers` (1 = RoPE), by default each interval-th layer."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config["no_rope_layer_interval"]
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) < n_layers or any(f not in (0, 1) for f in flags):
        raise UsageError(
            f"no_rope_layers is {flags!r}, expected a 0 or 1 for each of the {n_layers} layers"
        )
    return tuple(i for i in range(n_layers) if not flags[i])


def _sliding_window(
    config: dict, family: str, n_layers: int, nope_layers: tuple[int, ...]
) -> tuple[int | None, tuple[int, ...]]:
    """(window, its layers) as transformers reads them: Mistral's on every layer; Qwen2/3's
    and SmolLM3's only with `use_sliding_window`, on the `layer_types` called sliding (by
    default Qwen's from `max_window_layers` on, SmolLM3's NoPE layers)."""
    window = config.get("sliding_window")
    if family == "llama" or window is None:
        return None, ()
    if family == "mistral":
        return window, tuple(range(n_layers))
    if not config["use_sliding_window"]:
        return None, ()
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) < n_layers:
        first = config["max_window_layers"] if family != "smollm3" else n_layers
        types = ["sliding_attention" if i >= first or i in nope_layers else "full_attention"
                 for i in range(n_layers)]  # fmt: skip
    layers = tuple(i for i in range(n_layers) if types[i] == "sliding_attention")
    return (window, layers) if layers else (None, ())


def _check_hf_numbers(config: dict, rope: dict) -> None:
    """Refuses, in one error, each number or switch given outside its HF_RANGES."""
    if not isinstance(rope, dict):
        raise UsageError(f"the rope settings are {rope!r}, expected an object")
    given = {key: config[key] for key in HF_RANGES if config.get(key) is not None}
    given |= {key: rope[key] for key in HF_RANGES if rope.get(key) is not None}  # rope's wins
    problems = [_range_problem(key, value, *HF_RANGES[key]) for key, value in given.items()]
    problems = [problem for problem in problems if problem]
    if problems:
        raise UsageError("; ".join(problems))


def _range_problem(key: str, value, kind: type, least, most) -> str | None:
    if kind is bool:
        ok, expected = type(value) is bool, "true or false"
    elif kind is int:  # a bool is an int to Python, never to a config
        ok = type(value) is int and least <= value <= most
        expected = f"an integer from {least} to {most}"
    else:
        ok = type(value) in (int, float) and math.isfinite(value) and least < value <= most
        expected = f"a number > {least}" + (f" and at most {most}" if most < math.inf else "")
    return None if ok else f"{key} is {value!r}, expected {expected}"


# What a config.json without the key means: transformers' config class defaults by model_type
# (5.x keeps rope_theta in rope_parameters), which tests/test_model.py checks.
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    **HF_FIXED,
}
# Mistral's and Qwen2's classes have no bias switches.
_WITHOUT_BIASES = {k: v for k, v in _LLAMA_DEFAULTS.items() if not k.endswith("_bias")}
_QWEN2_DEFAULTS = {
    **_WITHOUT_BIASES,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
HF_CONFIG_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {
        **_WITHOUT_BIASES,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "qwen2": _QWEN2_DEFAULTS,
    "qwen3": {**_QWEN2_DEFAULTS, "head_dim": 128, "attention_bias": False},
    "smollm3": {
        **_LLAMA_DEFAULTS,
        "vocab_size": 128256,
        "hidden_size": 2048,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_theta": 2000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "no_rope_layer_interval": 4,
    },
}

# Llama 3.1's and 3.2's context: RoPE scaled to 128K tokens.
_LLAMA31 = {"rope_scaling": RopeScaling(factor=8.0), "max_seq_len": 131072}
_LLAMA32 = {**_LLAMA31, "rope_scaling": RopeScaling(factor=32.0), "tie_embeddings": True}
_QWEN = {"norm_eps": 1e-6, "rope_theta": 1e6}  # Qwen2.5's and Qwen3's

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


# Dense bf16 tensor-core FLOP/s by GPU name, the denominator of MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def attended_pairs(
    positions: torch.Tensor, document_mask: bool, seq_len: int
) -> torch.Tensor | float:
    """The (query, key) pairs causal attention computes in these rows (or a context-parallel
    rank's slices): S^2/2 per row, or with the document mask l^2/2 per document, the sum of
    (position + 1/2). A tensor stays on the device: it is read on log steps only."""
    if document_mask:
        return positions.sum(dtype=torch.float64) + positions.numel() / 2
    return positions.numel() * seq_len / 2


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
    linear_cross_entropy: Callable  # (hidden [N,D], weight [V,D], labels [N], ignore, reduction)
    project: Callable  # (x, linears) -> [linear(x) for each], the projections reading one x


def project(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [linear(x) for linear in linears]


REFERENCE_OPS = Ops(
    rms_norm=rms_norm_reference,
    apply_rope=apply_rope_reference,
    swiglu=swiglu_reference,
    linear_cross_entropy=linear_cross_entropy_reference,
    project=project,
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
        linear_cross_entropy=kernels.linear_cross_entropy,
    )


def fp8_ops(ops: Ops, triton_kernels: bool) -> Ops:
    """`ops` with the projections reading one input in one fp8_linears call (--fp8), which
    quantizes it once; a LoRA base too, not a 4-bit one. Head and embedding stay in bf16."""

    def fp8_project(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
        in_fp8 = [
            m for m in linears
            if type(m) is nn.Linear or (isinstance(m, LoRALinear) and not m.quantized)
        ]  # fmt: skip
        weights, biases = [m.weight for m in in_fp8], [m.bias for m in in_fp8]
        outputs = iter(fp8_linears(x, weights, biases, triton_kernels) if in_fp8 else ())
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


# Attention backends by name. "auto" tries cuDNN first, the fastest at long sequences on
# Hopper (bench/RESULTS.md, "Attention backends"); SDPA skips those that cannot take the input.
_SDPA = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
SDPA_BACKENDS = {"auto": list(_SDPA.values())} | {name: [b] for name, b in _SDPA.items()}


# FlexAttention's tiles where they beat its defaults (bench/RESULTS.md, "FlexAttention's
# kernel options" and "FlexAttention's backward tiles"): the forward's, queries x keys; the
# backward's (M1/N1: dK and dV's pass, M2/N2: dQ's) only where measured, head dim 64 on Hopper
# (at 128 they are slower; other GPUs have less shared memory).
FLEX_FORWARD_TILE = {"BLOCK_M": 128, "BLOCK_N": 64}
FLEX_BACKWARD_TILE_HEAD_DIM_64 = {
    "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
    "bwd_num_warps": 4, "bwd_num_stages": 3,
}  # fmt: skip


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention with the GPU's tiles, compiled (it runs fast only as one Triton kernel
    that skips the masked blocks) on first use, so importing the model loads no compiler."""
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q, k, v, block_mask: BlockMask, enable_gqa: bool) -> torch.Tensor:
        options = flex_tiles(q.device, q.shape[-1]) if q.is_cuda else None
        return compiled(
            q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=options
        )

    return attend


@functools.cache
def flex_tiles(device: torch.device, head_dim: int) -> dict[str, int]:
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    backward = FLEX_BACKWARD_TILE_HEAD_DIM_64 if hopper and head_dim == 64 else {}
    return {**FLEX_FORWARD_TILE, **backward}


# FlexAttention's mask tile, queries x keys: each is skipped, computed whole or masked per element.
FLEX_BLOCK = 128

# Packed documents at least this long attend through SDPA's causal kernel (cuDNN), shorter ones
# through FlexAttention (bench/RESULTS.md, "Packed documents at the speed of the dense kernels").
LONG_DOCUMENT = 16384


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S]: which packed document each token is in, counted from 0 in each row
    (a document starts where its position is 0, or at the row's start). Nondecreasing."""
    restarts = positions == 0
    return restarts.cumsum(dim=-1) - restarts[:, :1].to(positions.dtype)


def causal_prefix(length: int) -> int:
    """How many of a long document's first rows SDPA's causal kernel takes: `length` rounded
    down to a 32nd of its power of two, so that SDPA meets few shapes (cuDNN plans each new
    one). The rest, at most 1/32, go through FlexAttention."""
    step = max(1, (1 << (length.bit_length() - 1)) // 32)
    return length // step * step


@dataclass(frozen=True)
class PackedRows:
    """Attention over rows of packed documents (`packed_rows`). `prefixes`: per row, the
    (start, end) of each long document's `causal_prefix`, attended alone by SDPA's causal
    kernel. `short`: every other row's mask, FlexAttention's block mask on CUDA (skipping the
    prefixes' query tiles), else dense; None when the prefixes cover every row."""

    short: BlockMask | torch.Tensor | None
    prefixes: tuple[tuple[tuple[int, int], ...], ...]


def packed_rows(
    positions: torch.Tensor, starts: tuple[tuple[int, ...], ...], long_document: int
) -> PackedRows | None:
    """PackedRows for documents that start at `starts`; None where no row holds several."""
    if all(len(row) == 1 for row in starts):
        return None
    bsz, seq_len = positions.shape
    prefixes = tuple(
        tuple(
            (start, start + causal_prefix(end - start))
            for start, end in zip(row, (*row[1:], seq_len), strict=True)
            if end - start >= long_document
        )
        for row in starts
    )
    in_prefixes = torch.zeros(bsz, seq_len, dtype=torch.bool)
    for b, spans in enumerate(prefixes):
        for start, end in spans:
            in_prefixes[b, start:end] = True
    if in_prefixes.all():
        return PackedRows(None, prefixes)
    if positions.is_cuda:
        in_prefixes = in_prefixes.to(positions.device, non_blocking=True)
        return PackedRows(document_block_mask(positions, in_prefixes), prefixes)
    return PackedRows(dense_document_mask(positions), prefixes)


def document_block_mask(positions: torch.Tensor, skip: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention's mask for causal attention inside each packed document (positions:
    [B, S]), built per FLEX_BLOCK tile: nothing S x S exists, only [B, S/128, S/128] booleans.

    Documents are contiguous and numbered in order, so query tile i and key tile j < i share a
    document exactly when the key tile's last document is the query tile's first. Such a tile
    is "full" inside that one document; the diagonal and tiles a document starts in are
    "partial" (masked per element); the rest are skipped, as are query tiles holding only
    `skip` rows ([B, S]). Padding to whole tiles is a document of its own."""
    bsz, seq_len = positions.shape
    n_tiles = -(-seq_len // FLEX_BLOCK)
    pad = n_tiles * FLEX_BLOCK - seq_len
    document = F.pad(document_ids(positions), (0, pad), value=seq_len)  # [B, n_tiles * 128]
    tiles = document.view(bsz, n_tiles, FLEX_BLOCK)
    first, last = tiles[..., 0], tiles[..., -1]  # [B, n_tiles]
    q_first, q_last = first[:, :, None], last[:, :, None]
    k_first, k_last = first[:, None, :], last[:, None, :]
    tile = torch.arange(n_tiles, device=positions.device)
    causal = tile[:, None] >= tile[None, :]
    shares_document = causal & (k_last >= q_first)  # [B, n_tiles (queries), n_tiles (keys)]
    below_diagonal = tile[:, None] > tile[None, :]
    full = below_diagonal & (k_first == k_last) & (k_last == q_first) & (q_first == q_last)
    partial = shares_document & ~full
    if skip is not None:
        skipped = F.pad(skip, (0, pad), value=False).view(bsz, n_tiles, FLEX_BLOCK).all(dim=-1)
        full, partial = full & ~skipped[:, :, None], partial & ~skipped[:, :, None]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document[b, q_idx] == document[b, kv_idx])

    return BlockMask.from_kv_blocks(
        *_tile_indices(partial),
        *_tile_indices(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_document_causal,
        seq_lengths=(seq_len, seq_len),
    )


def _tile_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Q, K] booleans -> BlockMask's (number of key tiles [B, 1, Q], their indices in
    increasing order first [B, 1, Q, K]), int32."""
    count = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return count[:, None], order.to(torch.int32)[:, None]


def dense_document_mask(positions: torch.Tensor) -> torch.Tensor:
    """`document_block_mask` element by element, [B, 1, S, S] booleans for SDPA: CPU runs use
    it, FlexAttention having no CPU backward (the tests compare the two)."""
    seq_len = positions.shape[1]
    document = document_ids(positions)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


def attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask | PackedRows | None,
    sdpa_backends: list[SDPBackend],
) -> torch.Tensor:
    """[B, H, S, Dh] -> [B, H, S, Dh] (k, v may have fewer heads) by the kernel `mask` picks."""
    if isinstance(mask, PackedRows):
        return packed_attention(q, k, v, mask, sdpa_backends)
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)
    # The backend is chosen inside forward so that a checkpointed forward recomputed in
    # backward takes the same one (a cuDNN forward recomputed by flash fails).
    with sdpa_kernel(sdpa_backends, set_priority=True):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
        )


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: PackedRows,
    sdpa_backends: list[SDPBackend],
) -> torch.Tensor:
    """Attention over PackedRows. A prefix's rows are its document's first, so the causal
    kernel on their slice of the row gives them what the document mask would."""
    short = None if rows.short is None else attention_kernel(q, k, v, rows.short, sdpa_backends)
    if not any(rows.prefixes):
        return short
    spans = [(b, start, end) for b, row in enumerate(rows.prefixes) for start, end in row]
    prefixes = [
        attention_kernel(*(t[b : b + 1, :, start:end] for t in (q, k, v)), None, sdpa_backends)
        for b, start, end in spans
    ]
    bsz, n_heads, seq_len, head_dim = q.shape
    return _JoinPrefixes.apply(spans, (bsz, seq_len, n_heads, head_dim), short, *prefixes)


class _JoinPrefixes(torch.autograd.Function):
    """The attention output [B, H, S, Dh]: the prefixes' rows from `prefixes`, the others from
    `short` (None when the prefixes cover every row: a new [B, S, H, Dh] `shape`, transposed).
    Written into `short` itself, which the mask kernel's node saved: a copy would hold a third
    output-sized tensor per block under checkpointing's kept attention (offload._KeptAttention).
    That backward reads the output only via rowsum(output * gradient), zero on the prefixes'
    rows, so their values there do not matter; writing via `.data` keeps the saved version."""

    @staticmethod
    def forward(ctx, spans, shape, short, *prefixes):
        ctx.spans = spans
        out = prefixes[0].new_empty(shape).transpose(1, 2) if short is None else short
        for (b, start, end), prefix in zip(spans, prefixes, strict=True):
            out.data[b, :, start:end] = prefix[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_short = None
        if ctx.needs_input_grad[2]:
            grad_short = grad.clone()
            for b, start, end in ctx.spans:
                grad_short[b, :, start:end] = 0
        prefixes = (grad[b : b + 1, :, start:end] for b, start, end in ctx.spans)
        return None, None, grad_short, *prefixes


# ----------------------------------------------------------------------------------------
# The network
# ----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        self.wo = nn.Linear(q_dim, args.dim, bias=False)
        # QK-norm (Qwen3): q.k stays in range without a softmax temperature.
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, ops)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, ops)
        self.use_rope = use_rope
        self.rope_scale = args.rope_scaling.cos_sin_scale if args.rope_scaling else 1.0
        self.ops = ops
        self.sdpa_backends = sdpa_backends

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        mask: PackedRows | None = None,
    ) -> torch.Tensor:
        """Causal attention; `mask` (`Llama.attention_mask`) also keeps it inside documents."""
        bsz, seq_len, _ = x.shape
        q, k, v = self.ops.project(x, (self.wq, self.wk, self.wv))
        q = q.view(bsz, seq_len, self.n_heads, self.head_dim)
        k = k.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.ops.apply_rope(q, k, positions, inv_freq, self.rope_scale)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, Dh]
        out = self.attend(q, k, v, mask)
        (out,) = self.ops.project(out.transpose(1, 2).reshape(bsz, seq_len, -1), (self.wo,))
        return out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockMask | PackedRows | None,
    ) -> torch.Tensor:
        """`attention_kernel` with this model's SDPA backends: a method of its own so that
        offload.apply_ac can keep its output and shard.apply_context_parallel can wrap it."""
        return attention_kernel(q, k, v, mask, self.sdpa_backends)


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, ops: Ops):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.ops.project(x, (self.w1, self.w3))
        (out,) = self.ops.project(self.ops.swiglu(gate, up), (self.w2,))
        return out


class TransformerBlock(nn.Module):
    def __init__(
        self, args: ModelArgs, ops: Ops, sdpa_backends: list[SDPBackend], use_rope: bool = True
    ):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, ops)
        self.attention = Attention(args, ops, sdpa_backends, use_rope)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, ops)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, ops)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        mask: PackedRows | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions, inv_freq, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        ops: Ops = REFERENCE_OPS,
        attention_backend: str = "auto",
        mask_documents: bool = False,
    ):
        """`mask_documents`: no attention across the documents packed in a row (attention_mask)."""
        super().__init__()
        if attention_backend not in SDPA_BACKENDS:
            raise UsageError(
                f"unknown attention backend {attention_backend!r}; "
                f"expected one of {sorted(SDPA_BACKENDS)}"
            )
        self.args = args
        self.ops = ops
        self.mask_documents = mask_documents
        self.long_document = LONG_DOCUMENT  # tests lower it to try both routes on small rows
        backends = SDPA_BACKENDS[attention_backend]
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(args, ops, backends, use_rope=i not in args.nope_layers)
            for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps, ops)
        # A tied model has no output module but reuses the embedding: one Parameter shared by
        # two modules would not survive `to_empty`, which re-creates each module's parameters.
        self.output = None
        if not args.tie_embeddings:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def attention_mask(
        self, positions: torch.Tensor, starts: tuple[tuple[int, ...], ...] | None = None
    ) -> PackedRows | None:
        """Every block's mask, chosen once per forward so that a block recomputed in backward
        gets the same kernels. `starts` (data.Batch has them) saves reading them off the GPU."""
        if not self.mask_documents:
            return None
        if starts is None:
            starts = document_starts(positions)
        return packed_rows(positions, starts, self.long_document)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        reduction: str = "mean",
        document_starts: tuple[tuple[int, ...], ...] | None = None,
    ) -> torch.Tensor:
        """tokens, labels, positions: [B, S]. Without labels, logits [B, S, V]; with them, the
        loss ("mean" over labels that are not -100, or "sum") by `Ops.linear_cross_entropy`,
        which need not build the logits. Packed documents' positions restart at 0."""
        bsz, seq_len = tokens.shape
        if positions is None:
            positions = torch.arange(seq_len, device=tokens.device).expand(bsz, seq_len)
        inv_freq = rope_frequencies(self.args, tokens.device)
        mask = self.attention_mask(positions, document_starts)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, positions, inv_freq, mask)
        h = self.norm(h)
        output_weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        if labels is None:
            return F.linear(h, output_weight)
        return self.ops.linear_cross_entropy(
            h.flatten(0, 1), output_weight, labels.flatten(), IGNORE_INDEX, reduction
        )

    def initial_value(self, name: str, seed: int, device: torch.device) -> torch.Tensor:
        """The full initial tensor of parameter `name` (fp32), one per (seed, name) whatever the
        device and sharding. wo and w2 write into the residual stream: scaled down so that its
        variance does not grow with depth. LoRA's adapters as PEFT's: B = 0, so an adapted model
        starts equal to its base; A as nn.Linear's default (kaiming-uniform, a = sqrt(5))."""
        owner_path, _, leaf = name.rpartition(".")
        owner = self.get_submodule(owner_path)
        if isinstance(owner, LoRALinear) and leaf == "weight":  # a 4-bit one is no parameter
            shape = torch.Size((owner.out_features, owner.in_features))
        else:
            shape = self.get_parameter(name).shape
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device)
        if name.endswith(("lora_B", "bias")):
            return torch.zeros(shape, device=device)
        generator = torch.Generator(device).manual_seed(seed + zlib.crc32(name.encode()))
        if name.endswith("lora_A"):
            bound = 1 / math.sqrt(shape[1])
            return (torch.rand(shape, generator=generator, device=device) * 2 - 1) * bound
        std = 0.02
        if name.endswith(("wo.weight", "w2.weight")):
            std /= math.sqrt(2 * self.args.n_layers)
        return torch.randn(shape, generator=generator, device=device) * std

    @torch.no_grad()
    def init_weights(
        self,
        seed: int = 0,
        device: torch.device | None = None,
        copy: Callable[[torch.Tensor, object], None] | None = None,
    ) -> None:
        """Each parameter's initial value, computed whole on `device` (default: the parameter's)
        and moved in by `copy(param, full_tensor)` (shard.py's keeps this rank's rows)."""
        for name, param in self.named_parameters():
            name = name.removesuffix(NF4_SUFFIX)  # a quantized weight's value is the weight's
            full = self.initial_value(name, seed, device or param.device)
            copy_into(self, name, full, copy or copy_whole_tensor)


@torch.no_grad()
def generate(
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    allowed_ids: int | None = None,
    stop_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The tokens continuing `prompt`, sampled at `temperature` (0: the most likely) from ids
    below `allowed_ids` (a tokenizer smaller than the vocabulary), up to and including
    `stop_id`. No cache: for short samples. Drawn on the CPU, so every rank draws alike."""
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([prompt], device=device)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(tokens)[0, -1, :allowed_ids].float().cpu()  # [V]
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, next_id.to(device)[None]], dim=1)
        if next_id.item() == stop_id:
            break
    return tokens[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------------------
# Hugging Face checkpoints: config.json + safetensors (one file, or shards with an index)
# ----------------------------------------------------------------------------------------

# A --export-hf directory (files.OutputDir): what it may hold, and the file that marks it.
HF_EXPORT = OutputDir(
    "export",
    "longtune_export.json",
    ("*.json", "*.safetensors", "tokenizer.model", "chat_template.jinja"),
)

# RoPE layout: longtune rotates the two halves of each head (HF's "rotate half", not Meta's
# interleaved pairs), the layout of HF checkpoints' q_proj/k_proj rows: no permutation on load.

_HF_LAYER_NAMES = {
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


def hf_names(args: ModelArgs) -> dict[str, str]:
    """longtune parameter name -> HF tensor name (a tied output has no entry of its own)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    layer = dict(_HF_LAYER_NAMES)
    if args.qkv_bias:
        layer |= {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
    if args.qk_norm:
        layer |= {f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
    for i in range(args.n_layers):
        for ours, theirs in layer.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def _checkpoint_is_a_directory(path: Path) -> UsageError:
    return UsageError(
        f"{path} is a file: a Hugging Face checkpoint is the directory that holds "
        f"config.json and the safetensors files (give {path.parent})"
    )


def hf_tensor_files(path: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it, from the index or the file."""
    path = Path(path)
    if path.is_file():
        raise _checkpoint_is_a_directory(path)
    if not path.is_dir():
        raise UsageError(f"Hugging Face checkpoint directory {path} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UsageError(
                f'{index}: expected a "weight_map" object of tensor name -> safetensors '
                f"file name, found {type(weight_map).__name__ if weight_map else 'none'}"
            )
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise UsageError(f"{index}: {name} is in {file!r}, expected a file name")
        # Inside the checkpoint (a shard may be a link, as in the HF cache: not resolved).
        outside = [f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts]
        if outside:
            raise UsageError(f"{index}: names files outside {path}: {sorted(set(outside))[:3]}")
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        found = sorted(p.name for p in path.iterdir())
        raise UsageError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json "
            f"(found {found}); longtune reads safetensors only, never pickled .bin/.pth files"
        )
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


# The dtypes of a weight, as safetensors headers name them.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def _open_safetensors(file: Path):
    # A device or a FIFO is never opened (/dev/zero has no end, a FIFO waits for a writer).
    if not file.is_file():
        wrong = "is not a regular file" if file.exists() else "does not exist"
        raise UsageError(f"safetensors file {file} (named in the index) {wrong}")
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:  # OSError: a file the kernel makes, /proc's
        raise UsageError(f"{file} is not a readable safetensors file: {e}") from e


def check_hf_checkpoint(args: ModelArgs, path: str | os.PathLike) -> dict[str, Path]:
    """Refuses a checkpoint that does not fit `args` with one error listing every difference,
    reading only config and headers. Returns HF tensor name -> file."""
    theirs = ModelArgs.from_hf_config(path)
    problems = [
        f"config {f.name}: checkpoint has {getattr(theirs, f.name)!r}, model has "
        f"{getattr(args, f.name)!r}"
        for f in dataclasses.fields(ModelArgs)
        if f.name != "max_seq_len" and getattr(theirs, f.name) != getattr(args, f.name)
    ]
    files = hf_tensor_files(path)
    with torch.device("meta"):
        params = dict(Llama(args).named_parameters())
    expected = {hf: tuple(params[ours].shape) for ours, hf in hf_names(args).items()}
    shapes, dtypes = {}, {}
    for file in sorted(set(files.values())):
        with _open_safetensors(file) as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
                dtypes[name] = f.get_slice(name).get_dtype()
    for name, shape in expected.items():
        if name not in shapes:
            problems.append(f"missing tensor {name}: expected shape {shape}")
        elif shapes[name] != shape:
            problems.append(f"tensor {name}: checkpoint shape {shapes[name]}, model {shape}")
        elif dtypes[name] not in FLOAT_DTYPES:
            # Copied into a float parameter an integer tensor would load without a word.
            problems.append(
                f"tensor {name}: dtype {dtypes[name]}, expected one of {sorted(FLOAT_DTYPES)}"
            )
    # A tied model's checkpoint may still carry a copy of the embedding as lm_head.
    tolerated = {"lm_head.weight"} if args.tie_embeddings else set()
    for name in sorted(set(shapes) - set(expected) - tolerated):
        if not name.endswith("rotary_emb.inv_freq"):  # a buffer older exports saved
            problems.append(f"unexpected tensor {name} with shape {shapes[name]}")
    if problems:
        raise UsageError(f"checkpoint {path} does not fit the model:\n  " + "\n  ".join(problems))
    return files


class CheckedSlice:
    """A safetensors slice whose reads are checked for NaN and inf by one aminmax pass
    (allocating nothing of their size): a tensor holding one is named in `nonfinite`, so that a
    damaged checkpoint is refused before training, not blamed on a NaN loss later."""

    def __init__(self, piece, name: str, nonfinite: list[str]):
        self.piece, self.name, self.nonfinite = piece, name, nonfinite

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.piece[index]
        if tensor.numel() and not all(v.isfinite() for v in torch.aminmax(tensor)):
            self.nonfinite.append(self.name)
        return tensor


def refuse_nonfinite(path: str | os.PathLike, nonfinite: list[str]) -> None:
    if nonfinite:
        raise UsageError(
            f"{path}: {', '.join(sorted(set(nonfinite))[:5])} hold NaN or inf values: the "
            f"checkpoint is damaged (training from it would give a NaN loss at once)"
        )


def copy_whole_tensor(param: torch.Tensor, tensor_slice) -> None:
    param.copy_(tensor_slice[:])


@torch.no_grad()
def load_hf_checkpoint(
    model: Llama,
    path: str | os.PathLike,
    copy: Callable[[torch.Tensor, object], None] = copy_whole_tensor,
    progress: Callable[[int, int], None] | None = None,
    agree: Callable[[list[str]], list[str]] = lambda nonfinite: nonfinite,
) -> None:
    """Loads HF weights into `model`'s materialized parameters one tensor at a time, so that
    host memory peaks near one tensor. `copy(param, safetensors_slice)` moves each in (shard.py's
    reads only its rank's rows). NaN and inf (CheckedSlice) are refused at the end, after
    `agree` has gathered what each rank found."""
    found = []
    files = check_hf_checkpoint(model.args, path)
    names = hf_names(model.args)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append((ours, theirs))
    done = 0
    for file, file_names in sorted(by_file.items()):
        with _open_safetensors(file) as f:
            for ours, theirs in file_names:
                copy_into(model, ours, CheckedSlice(f.get_slice(theirs), theirs, found), copy)
                done += 1
                if progress is not None:
                    progress(done, len(names))
    refuse_nonfinite(path, agree(found))


@torch.no_grad()
def fill_weights(
    model: "Llama",
    seed: int,
    device: torch.device,
    hf_path: str | os.PathLike | None = None,
    copy: Callable[[torch.Tensor, object], None] = copy_whole_tensor,
    progress: Callable[[int, int], None] | None = None,
    lora: "LoRAConfig | None" = None,
    lora_adapter: str | os.PathLike | None = None,
    agree: Callable[[list[str]], list[str]] = lambda nonfinite: nonfinite,
) -> None:
    """Fills a materialized model through `copy`: from a HF checkpoint (as load_hf_checkpoint)
    or from initial values drawn on `device` (so any layout gets the same weights); LoRA's
    adapters from `lora_adapter` (a PEFT adapter directory) or their initial values."""
    if hf_path is None:
        model.init_weights(seed, device=device, copy=copy)
    else:
        load_hf_checkpoint(model, hf_path, copy, progress, agree)
        if lora is not None and lora_adapter is None:  # adapters from their initial values
            for name, param in model.named_parameters():
                if param.requires_grad:
                    copy(param, model.initial_value(name, seed, device))
    if lora_adapter is not None:
        load_peft_adapter(model, lora, lora_adapter, copy, agree)


def hf_config(args: ModelArgs, dtype: torch.dtype, special_ids: dict | None = None) -> dict:
    """A config.json that transformers reads as the same model (rope settings both the
    transformers >= 5 way and the older way), with the tokenizer's special token ids."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    s = args.rope_scaling
    if s is not None:
        rope["rope_type"] = s.rope_type
        for field, key in HF_ROPE_KEYS[s.rope_type].items():
            # attention_factor None: YaRN's formula; truncate None: none, written as null
            if getattr(s, field) is not None or field == "truncate":
                rope[key] = getattr(s, field)
    config = {
        "architectures": [FAMILIES[args.family].architecture],
        "model_type": args.family,
        **{key: getattr(args, field) for field, key in HF_CONFIG_KEYS.items()},
        **{k: v for k, v in HF_FIXED.items() if k in HF_CONFIG_DEFAULTS[args.family]},
        "rope_parameters": rope,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope if s is not None else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.family == "mistral":
        config["sliding_window"] = args.sliding_window
    if args.family == "smollm3":
        nope = set(args.nope_layers)
        config["no_rope_layers"] = [int(i not in nope) for i in range(args.n_layers)]
    if FAMILIES[args.family].window == "some":
        windowed = set(args.window_layers)
        config |= {
            "use_sliding_window": args.sliding_window is not None,
            "sliding_window": args.sliding_window,
            "layer_types": [
                "sliding_attention" if i in windowed else "full_attention"
                for i in range(args.n_layers)
            ],
        }
    if args.family in ("qwen2", "qwen3"):
        # Qwen's rule for the window's layers, from here on; layer_types says them all.
        config["max_window_layers"] = min(args.window_layers, default=args.n_layers)
    # Without a tokenizer's ids, none: the family's defaults are ids of its own vocabulary.
    return config | dict.fromkeys(SPECIAL_TOKEN_KEYS) | (special_ids or {})


def save_hf_checkpoint(
    args: ModelArgs,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: HFTokenizer | None = None,
) -> None:
    """Writes config.json, safetensors shards and their index, the tokenizer's files and a
    generation_config.json, consuming `named_tensors` one at a time (a sharded model can gather
    each just before it is written). Atomic: `out_dir` is replaced once complete (HF_EXPORT)."""
    names = hf_names(args)
    shards: list[list[str]] = []  # the HF names each written shard holds
    shard: dict[str, torch.Tensor] = {}
    total_bytes = 0
    with HF_EXPORT.writing(out_dir) as tmp:

        def flush():  # to part-k: the final names need the number of shards
            save_file(shard, tmp / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            shards.append(list(shard))
            shard.clear()

        for ours, tensor in named_tensors:
            if ours not in names:
                continue  # the tied output, which HF does not store
            tensor = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
            if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > max_shard_bytes:
                flush()
            shard[names[ours]] = tensor
            total_bytes += tensor.nbytes
        flush()
        weight_map = {}
        for k, held in enumerate(shards):
            final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(tmp / f"part-{k}.safetensors", tmp / final)
            give_ordinary_mode(tmp / final)
            weight_map |= dict.fromkeys(held, final)
        missing = set(names.values()) - set(weight_map)
        if missing:
            raise ValueError(f"cannot export: no tensor given for {sorted(missing)[:5]}")
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        special_ids = tokenizer.special_ids if tokenizer else {}
        (tmp / "config.json").write_text(json.dumps(hf_config(args, dtype, special_ids), indent=2))
        if tokenizer:
            for name, contents in tokenizer.files.items():
                (tmp / name).write_bytes(contents)
            if "generation_config.json" not in tokenizer.files:
                # generate() pads finished rows with EOS when there is no pad token. (config.json
                # names only a real one: transformers gives pad_token_id's embedding no gradient.)
                pad_id = special_ids.get("pad_token_id")
                if pad_id is None:
                    pad_id = special_ids["eos_token_id"]
                generation = {**special_ids, "pad_token_id": pad_id}
                (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))


# ----------------------------------------------------------------------------------------
# LoRA: low-rank adapters on the blocks' linear layers over a frozen base, which may be
# stored in 4-bit NormalFloat (QLoRA), saved as PEFT's files. Applied from outside:
#
#     with torch.device("meta"):
#         model = Llama(args)
#     apply_lora(model, LoRAConfig(rank=16, alpha=32, quantize_base="nf4"), torch.bfloat16)
# ----------------------------------------------------------------------------------------

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# The same projections by their HF / PEFT module names (adapter_config.json's target_modules).
HF_LORA_TARGETS = {
    ours.split(".")[1]: theirs.split(".")[1]
    for ours, theirs in _HF_LAYER_NAMES.items()
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


def _lora_module_paths(args: ModelArgs, targets: tuple[str, ...]) -> list[str]:
    """`layers.{i}.attention.wq` and the like, in layer then target order."""
    where = {ours.split(".")[1]: ours.split(".")[0] for ours in _HF_LAYER_NAMES}
    return [f"layers.{i}.{where[t]}.{t}" for i in range(args.n_layers) for t in targets]


def apply_lora(
    model: Llama, config: LoRAConfig, base_dtype: torch.dtype, kernels: bool = False
) -> None:
    """Replaces every block's target projections with LoRALinear and freezes the rest, stored
    in `base_dtype` (the compute dtype: no fp32 master copy of what is not trained). Applied
    first, to the meta-built model (train.apply_techniques)."""
    dequantize = dequantize_nf4 if kernels else dequantize_nf4_reference
    for path in _lora_module_paths(model.args, config.targets):
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


def copy_into(model: Llama, name: str, tensor_slice, copy: Callable) -> None:
    """`copy(param, tensor_slice)` for `name`; a 4-bit base is quantized on the way in."""
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    if isinstance(owner, LoRALinear) and leaf == "weight":
        owner.load_weight(tensor_slice, copy)
    else:
        copy(model.get_parameter(name), tensor_slice)


def peft_names(args: ModelArgs, targets: tuple[str, ...]) -> dict[str, str]:
    """longtune adapter name -> PEFT's (`base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight`)."""
    hf = hf_names(args)
    names = {}
    for path in _lora_module_paths(args, targets):
        module = "base_model.model." + hf[f"{path}.weight"].removesuffix(".weight")
        for ab in ("lora_A", "lora_B"):
            names[f"{path}.{ab}"] = f"{module}.{ab}.weight"
    return names


# A --export-adapter directory (files.OutputDir).
PEFT_ADAPTER = OutputDir(
    "adapter",
    "longtune_adapter.json",
    ("adapter_*.json", "adapter_*.safetensors", "longtune_adapter.json"),
)


def peft_adapter_config(config: LoRAConfig, base_model: str | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(HF_LORA_TARGETS[t] for t in config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_peft_adapter(
    args: ModelArgs,
    config: LoRAConfig,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    base_model: str | None = None,
) -> None:
    """Writes adapter_config.json + adapter_model.safetensors (fp32, PEFT's names), which
    `peft.PeftModel.from_pretrained(base, out_dir)` loads. Atomic like save_hf_checkpoint."""
    names = peft_names(args, config.targets)
    tensors = {
        names[ours]: t.detach().to("cpu", torch.float32).contiguous()
        for ours, t in named_tensors
        if ours in names
    }
    if missing := sorted(set(names.values()) - set(tensors)):
        raise ValueError(f"cannot save the adapter: no tensor given for {missing[:5]}")
    with PEFT_ADAPTER.writing(out_dir) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        give_ordinary_mode(tmp / "adapter_model.safetensors")
        adapter_config = peft_adapter_config(config, base_model)
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


PEFT_DEFAULTS_ONLY = {
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "layers_pattern": None,
    "lora_bias": False,
    "modules_to_save": None,
}


def check_peft_adapter(args: ModelArgs, config: LoRAConfig, path: str | os.PathLike) -> Path:
    """Refuses a PEFT adapter that does not fit (config, tensor shapes from the headers) with
    one error listing every difference. Returns the safetensors file."""
    path = Path(path)
    config_file, tensors_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for file in (config_file, tensors_file):
        if not file.is_file():
            raise UsageError(f"LoRA adapter: {file} does not exist")
    theirs = read_json(config_file)
    ours = peft_adapter_config(config, None)
    problems = [
        f"adapter_config.json {key}: adapter has {theirs.get(key)!r}, expected {ours[key]!r}"
        + (f" (--lora-rank {ours['r']}: pass --lora-rank {theirs.get('r')})" * (key == "r"))
        for key in ("peft_type", "r", "lora_alpha", "bias", "use_rslora", "use_dora")
        if theirs.get(key, ours[key]) != ours[key]
    ]
    # Unimplemented PEFT settings load only at their defaults (a pattern changes ranks or scales).
    problems += [
        f"adapter_config.json {key}: adapter has {theirs[key]!r}, which longtune does not "
        f"implement (expected {default!r})"
        for key, default in PEFT_DEFAULTS_ONLY.items()
        if theirs.get(key) is not None and theirs[key] != default
    ]
    # These initializations change the base too: on the original base the adapter is wrong.
    init = theirs.get("init_lora_weights")
    if isinstance(init, str) and init.split("_")[0] in ("pissa", "olora", "corda", "loftq"):
        problems.append(
            f"adapter_config.json init_lora_weights: adapter has {init!r}, trained on a base "
            f"PEFT changed: convert it to a plain LoRA adapter with PEFT first "
            f"(save_pretrained's path_initial_model_for_weight_conversion)"
        )
    targets = theirs.get("target_modules")
    if sorted(targets if isinstance(targets, list) else [targets]) != ours["target_modules"]:
        problems.append(
            f"adapter_config.json target_modules: adapter has {targets!r}, expected "
            f"{ours['target_modules']} (--lora-targets)"
        )
    with torch.device("meta"):
        model = Llama(args)
    apply_lora(model, config, torch.float32)
    expected = {
        peft: tuple(model.get_parameter(name).shape)
        for name, peft in peft_names(args, config.targets).items()
    }
    with _open_safetensors(tensors_file) as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    if theirs.get("r") != ours["r"]:  # every adapter's shape differs by the rank: not listed
        expected = {name: shapes.get(name, shape) for name, shape in expected.items()}
    for name, shape in expected.items():
        if name not in shapes:
            problems.append(f"missing tensor {name}: expected shape {shape}")
        elif shapes[name] != shape:
            problems.append(f"tensor {name}: adapter shape {shapes[name]}, model {shape}")
    problems += [f"unexpected tensor {n}" for n in sorted(set(shapes) - set(expected))]
    if problems:
        raise UsageError(f"LoRA adapter {path} does not fit:\n  " + "\n  ".join(problems))
    return tensors_file


@torch.no_grad()
def load_peft_adapter(
    model: Llama,
    config: LoRAConfig,
    path: str | os.PathLike,
    copy: Callable[[torch.Tensor, object], None] = copy_whole_tensor,
    agree: Callable[[list[str]], list[str]] = lambda nonfinite: nonfinite,
) -> None:
    """Loads a PEFT adapter into the LoRA model; `copy` and `agree` as in load_hf_checkpoint."""
    file = check_peft_adapter(model.args, config, path)
    nonfinite = []
    with _open_safetensors(file) as f:
        for ours, theirs in peft_names(model.args, config.targets).items():
            copy(model.get_parameter(ours), CheckedSlice(f.get_slice(theirs), theirs, nonfinite))
    refuse_nonfinite(file, agree(nonfinite))


def merged_named_tensors(
    model: Llama, gather: Callable[[torch.Tensor], torch.Tensor]
) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, full tensor) for save_hf_checkpoint, each LoRALinear merged into one weight
    W + scale * B @ A in fp32, so that a plain Llama (transformers' or longtune's) computes
    what the adapted model does without dropout. `gather(param)`: the whole parameter."""
    lora = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, param in model.named_parameters():
        owner_path, _, leaf = name.rpartition(".")
        if owner_path not in lora or leaf == "bias":
            yield name, gather(param)
        elif leaf in ("weight", "weight" + NF4_SUFFIX):
            module = lora[owner_path]
            base = module.base_weight(gather(param))
            delta = gather(module.lora_B).float() @ gather(module.lora_A).float()
            yield f"{owner_path}.weight", base + module.scale * delta

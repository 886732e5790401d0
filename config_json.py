"""A Hugging Face checkpoint's config.json, read into `ModelArgs` (`args_from_hf_config`: every
key's type and range checked, what each family's block fixes refused when it differs, a
missing key read as transformers' config class reads it) and written back (`hf_config`), as
tables of keys and defaults. hf.py holds the tensors. It imports model.py, gpt-oss's SwiGLU
constants (kernels/swiglu.py), tokenizer.py's special token keys and files.py's rules.
"""

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from files import LOCAL_PATH, UsageError, read_json
from kernels.swiglu import SWIGLU_ALPHA, SWIGLU_LIMIT
from model import FAMILIES, ROPE_TYPES, ModelArgs, RopeScaling, yarn_mscale
from tokenizer import SPECIAL_TOKEN_KEYS

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

# ModelArgs field -> its key in every family's config.json: for args_from_hf_config and hf_config.
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
# What every family's block fixes, by config.json key: args_from_hf_config refuses anything else.
HF_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
# Gemma 3's, whose class reads hidden_activation, not hidden_act; longtune has no softcapping.
GEMMA3_FIXED = {
    "attention_bias": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
# gpt-oss's: biases on the attention's projections, its experts' clamped SwiGLU (kernels.swiglu).
GPT_OSS_FIXED = {
    "hidden_act": "silu", "attention_bias": True,
    "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": SWIGLU_LIMIT,
}  # fmt: skip
FAMILY_FIXED = {"gemma3_text": GEMMA3_FIXED, "gpt_oss": GPT_OSS_FIXED}
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
    **dict.fromkeys(["num_experts", "num_local_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "decoder_sparse_step"], _SIZE),
    "router_aux_loss_coef": (float, -math.inf, math.inf),
    "max_window_layers": (int, 0, 2**32 - 1),
    "rms_norm_eps": (float, 0, 1),
    **dict.fromkeys(["rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                     "beta_slow", "attention_factor", "rope_local_base_freq",
                     "query_pre_attn_scalar"], _POSITIVE),
    "sliding_window_pattern": _SIZE,
    **dict.fromkeys(["tie_word_embeddings", "use_sliding_window", "norm_topk_prob",
                     "output_router_logits"], (bool, False, True)),
}  # fmt: skip


# A multimodal model_type -> its text_config's, where that leaves it out.
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


def _text_model(raw: dict, config_path: Path) -> dict:
    """The config of the text model: a multimodal model's (Gemma 3 4b+) text_config, whose
    output transformers ties by the top-level key (Gemma3Config's: true if left out, null is
    false), not by text_config's; any other config as it is."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict) or "text_config" in text:
        what = "dict holding a text_config" if isinstance(text, dict) else type(text).__name__
        raise UsageError(
            f"{config_path}: text_config is a {what}, expected an object of the text model's "
            f"own keys"
        )
    tie = raw.get("tie_word_embeddings", True)
    return {
        "model_type": TEXT_MODEL_TYPES.get(raw.get("model_type")),
        **text,
        "tie_word_embeddings": False if tie is None else tie,
    }


def args_from_hf_config(path: str | os.PathLike) -> ModelArgs:
    """The `config.json` of a HF checkpoint's directory (a file given in the directory's place
    is refused); a missing key is read from HF_CONFIG_DEFAULTS."""
    path = Path(path)
    config_path = path / "config.json"
    if path.is_file():
        beside = (path.parent / "config.json").is_file()
        raise UsageError(
            f"{path} is a file: a Hugging Face checkpoint is the directory that holds "
            f"config.json and the safetensors files" + (f" (give {path.parent})" if beside else "")
        )
    if not config_path.is_file():
        hub_id = not path.exists() and len(path.parts) == 2  # as `org/model`
        raise UsageError(
            f"no Hugging Face config.json at {config_path}" + (f" ({LOCAL_PATH})" if hub_id else "")
        )
    raw = _text_model(read_json(config_path), config_path)
    try:
        family = raw.get("model_type")
        if not isinstance(family, str) or family not in FAMILIES:
            raise UsageError(
                f"model_type is {family or 'missing'!r}; longtune reads the dense Llama "
                f"family, its mixture-of-experts kin, Gemma 3 and gpt-oss: {', '.join(FAMILIES)}"
            )
        # A null num_key_value_heads or head_dim is derived from the heads, as transformers
        # derives it; a null sliding_window is none; another null is the default.
        derived = {k for k in ("num_key_value_heads", "head_dim") if raw.get(k, 0) is None}
        given = {k: v for k, v in raw.items() if v is not None or k == "sliding_window"}
        if family == "qwen3_moe" and "num_local_experts" in given:  # transformers 5 saves it so
            given.setdefault("num_experts", given.pop("num_local_experts"))
        config = {**HF_CONFIG_DEFAULTS[family], **given}
        config = {k: v for k, v in config.items() if k not in derived}
        gemma = FAMILIES[family].gemma
        for key, expected in FAMILY_FIXED.get(family, HF_FIXED).items():
            if config.get(key, expected) != expected:
                raise UsageError(f"{key} is {config[key]!r}, expected {expected!r}")
        quantization = config.get("quantization_config") or {}
        if not isinstance(quantization, dict):
            raise UsageError(f"quantization_config is {quantization!r}, expected an object")
        quantization = quantization.get("quant_method")
        if quantization not in (None, "mxfp4") or (quantization and family != "gpt_oss"):
            raise UsageError(
                f"quantization_config's quant_method is {quantization!r}: longtune reads "
                f"gpt-oss's mxfp4 experts, else unquantized checkpoints"
            )
        # transformers >= 5 writes `rope_parameters`, older ones `rope_theta` + `rope_scaling`.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        gemma_fields = _gemma_fields(config, rope) if gemma else {}
        if gemma and "full_attention" in rope:  # transformers 5's: settings by layer type
            rope = rope["full_attention"] or {}
        _check_hf_numbers(config, rope)
        n_layers = config["num_hidden_layers"]
        nope_layers = _nope_layers(config, n_layers) if family == "smollm3" else ()
        window, window_layers = _sliding_window(config, family, n_layers, nope_layers)
        fields = {field: config[key] for field, key in HF_CONFIG_KEYS.items() if key in config}
        if FAMILIES[family].moe != "none":
            fields |= _experts(config, family, n_layers)
        fields.setdefault("n_kv_heads", fields["n_heads"])  # head_dim: ModelArgs derives it
        return ModelArgs(
            **fields,
            rope_theta=rope.get("rope_theta", config["rope_theta"]),
            rope_scaling=_rope_scaling(config, rope),
            family=family,
            qkv_bias=FAMILIES[family].qkv_bias,
            qk_norm=FAMILIES[family].qk_norm,
            nope_layers=nope_layers,
            sliding_window=window,
            window_layers=window_layers,
            **gemma_fields,
        )
    except UsageError as e:
        raise UsageError(f"{config_path}: {e}") from None


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
        ratio = yarn_mscale(rope["factor"], mscale) / yarn_mscale(rope["factor"], mscale_all_dim)
        values["attention_factor"] = ratio
    return RopeScaling(rope_type, **values)


def _gemma_fields(config: dict, rope: dict) -> dict:
    """Gemma 3's local RoPE base (unscaled: anything else is refused) and attention scale."""
    local = rope.get("sliding_attention") if "full_attention" in rope else None
    local = local or {"rope_theta": config["rope_local_base_freq"]}
    if not isinstance(local, dict):
        raise UsageError(f"rope_parameters' sliding_attention is {local!r}, expected an object")
    if local.get("rope_type", "default") != "default":
        raise UsageError(
            f"sliding_attention's rope_type is {local['rope_type']!r}, expected 'default'"
        )
    theta = local.get("rope_theta", config["rope_local_base_freq"])
    _check_hf_numbers({"rope_local_base_freq": theta}, {})
    return {"local_rope_theta": theta, "query_pre_attn_scalar": config["query_pre_attn_scalar"]}


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
    if family in ("mistral", "mixtral"):
        return window, tuple(range(n_layers))
    if family in ("gemma3_text", "gpt_oss"):  # by default 5 windowed layers in 6, or 1 in 2
        pattern = config["sliding_window_pattern"] if family == "gemma3_text" else 2
        types = _layer_types(config, n_layers, lambda i: (i + 1) % pattern)
        layers = tuple(i for i in range(n_layers) if types[i] == "sliding_attention")
        return (window, layers) if layers else (None, ())
    if not config["use_sliding_window"]:
        return None, ()
    if family == "qwen3_moe":  # on every layer
        return window, tuple(range(n_layers))
    first = config["max_window_layers"] if family != "smollm3" else n_layers
    types = _layer_types(config, n_layers, lambda i: i >= first or i in nope_layers)
    layers = tuple(i for i in range(n_layers) if types[i] == "sliding_attention")
    return (window, layers) if layers else (None, ())


LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(config: dict, n_layers: int, sliding: Callable[[int], bool]) -> list[str]:
    """`layer_types`: one of LAYER_TYPES a layer (the only two longtune reads; anything else is
    refused); where it is missing (null), the layers `sliding` picks."""
    types = config.get("layer_types")
    if types is None:
        return [LAYER_TYPES[not sliding(i)] for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - set(LAYER_TYPES):
        raise UsageError(
            f"layer_types is {types!r}, expected one of {', '.join(LAYER_TYPES)} for each of "
            f"the {n_layers} layers"
        )
    return types


# Far above any hub model's experts times their layers (tens of thousands): the checkpoint
# names each one's tensors (hf.hf_names), so millions would take minutes to check.
MAX_EXPERTS = 2**18


def _experts(config: dict, family: str, n_layers: int) -> dict:
    """The MoE fields as transformers reads them: Mixtral's experts on every layer, their
    weights renormalized; Qwen3-MoE's on each decoder_sparse_step-th layer not in
    mlp_only_layers, its own intermediate size, renormalized as norm_topk_prob says."""
    fields = {
        "n_experts": config["num_experts" if family == "qwen3_moe" else "num_local_experts"],
        "experts_per_token": config["num_experts_per_tok"],
        "router_aux_loss": config["output_router_logits"],
        "router_aux_loss_coef": float(config["router_aux_loss_coef"]),
    }
    # gpt-oss's softmax over the top k logits is the top k renormalized, as Mixtral's.
    if family in ("gpt_oss", "mixtral"):
        if family == "mixtral" and config["router_jitter_noise"] != 0:
            raise UsageError(
                f"router_jitter_noise is {config['router_jitter_noise']!r}, expected 0 (no noise "
                f"on the router's input)"
            )
        experts = {"expert_ffn_dim": config["intermediate_size"], "norm_topk_prob": True}
        experts["moe_layers"] = tuple(range(n_layers))
    else:
        dense = config["mlp_only_layers"] or []
        layer_numbers = isinstance(dense, list) and all(type(i) is int for i in dense)
        if not layer_numbers or not set(dense) <= set(range(n_layers)):
            raise UsageError(
                f"mlp_only_layers is {dense!r}, expected a list of layer numbers from 0 to "
                f"{n_layers - 1}"
            )
        step = config["decoder_sparse_step"]
        layers = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        experts = {"expert_ffn_dim": config["moe_intermediate_size"], "moe_layers": layers}
        experts["norm_topk_prob"] = config["norm_topk_prob"]
    total = fields["n_experts"] * len(experts["moe_layers"])
    if total > MAX_EXPERTS:
        raise UsageError(
            f"{fields['n_experts']} experts on {len(experts['moe_layers'])} layers make {total}, "
            f"expected at most {MAX_EXPERTS} (each is tensors of its own in a checkpoint)"
        )
    return fields | experts


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
# (5.x keeps rope_theta in rope_parameters), which tests/test_hf.py checks.
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
_ROUTER_DEFAULTS = {"output_router_logits": False, "router_aux_loss_coef": 0.001}
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
    "qwen3_moe": {
        **{k: v for k, v in _QWEN2_DEFAULTS.items() if k != "max_window_layers"},
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,  # none dense
        **_ROUTER_DEFAULTS,
    },
    "mixtral": {
        **_WITHOUT_BIASES,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,
        **_ROUTER_DEFAULTS,
    },
    "gpt_oss": {  # GptOssConfig's; its rope_parameters are read as older files' rope_scaling
        **_WITHOUT_BIASES,
        **GPT_OSS_FIXED,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "sliding_window": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        **_ROUTER_DEFAULTS,
    },
    "gemma3_text": {
        **{k: v for k, v in _WITHOUT_BIASES.items() if k != "hidden_act"},
        **GEMMA3_FIXED,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}


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
    if args.family in ("mistral", "mixtral", "qwen3_moe"):
        config["sliding_window"] = args.sliding_window
    if args.family == "qwen3_moe":
        config["use_sliding_window"] = args.sliding_window is not None
    if FAMILIES[args.family].moe != "none":
        config |= {
            "num_experts" if args.family == "qwen3_moe" else "num_local_experts": args.n_experts,
            "num_experts_per_tok": args.experts_per_token,
            "output_router_logits": args.router_aux_loss,
            "router_aux_loss_coef": args.router_aux_loss_coef,
        }
    if args.family == "mixtral":
        config |= {"intermediate_size": args.expert_ffn_dim, "router_jitter_noise": 0.0}
    if args.family == "gpt_oss":  # exported in bf16 or fp32: no quantization_config
        config |= {**GPT_OSS_FIXED, "intermediate_size": args.expert_ffn_dim}
    if args.family == "qwen3_moe":
        config |= {
            "moe_intermediate_size": args.expert_ffn_dim,
            "norm_topk_prob": args.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(args.n_layers) if i not in args.moe_layers],
        }
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
    if args.family == "gemma3_text":  # RoPE settings by layer type, as transformers 5 writes
        local = {"rope_type": "default", "rope_theta": args.local_rope_theta}
        config |= {
            **GEMMA3_FIXED,
            "query_pre_attn_scalar": args.query_pre_attn_scalar,
            "rope_parameters": {"full_attention": rope, "sliding_attention": local},
            "rope_local_base_freq": args.local_rope_theta,
        }
    if args.family in ("gemma3_text", "gpt_oss"):  # no switch: layer_types says the layers
        del config["use_sliding_window"]
    if args.family in ("qwen2", "qwen3"):
        # Qwen's rule for the window's layers, from here on; layer_types says them all.
        config["max_window_layers"] = min(args.window_layers, default=args.n_layers)
    # Without a tokenizer's ids, none: the family's defaults are ids of its own vocabulary.
    return config | dict.fromkeys(SPECIAL_TOKEN_KEYS) | (special_ids or {})

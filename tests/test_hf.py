"""HF checkpoints and PEFT adapters (hf.py): config.json read as transformers reads it, exports
transformers and PEFT load back, and the errors a bad checkpoint or adapter gets. The tiny HF
models and the helpers that load them are tests/test_model.py's and tests/test_lora.py's.

Tolerances: fp32 on CPU, max |a - b| / max |b| <= 1e-5 for logits (FP32_RTOL).
"""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lora import (
    CONFIG,
    FAMILIES,
    adapters,
    hf_checkpoint,
    hf_model,
    lora_model,
    randomize_adapters,
    tokens_for,
)
from test_model import (
    FAMILY_CONFIGS,
    FP32_RTOL,
    HF_CONFIGS,
    gemma3_multimodal_checkpoint,
    load_longtune,
    make_family_model,
    make_hf_model,
    rel_err,
    sample_batch,
    save_hf,
)

from config_json import HF_CONFIG_DEFAULTS, args_from_hf_config, hf_config
from files import UsageError
from hf import (
    check_hf_checkpoint,
    load_peft_adapter,
    peft_adapter_settings,
    save_hf_checkpoint,
    save_peft_adapter,
    weights_fingerprint,
)
from lora import LoRAConfig, merged_named_tensors
from model import PRESETS, RopeScaling
from tokenizer import ByteTokenizer, read_hf_tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize("variant", sorted(HF_CONFIGS))
def test_export_loads_back_into_transformers(tmp_path, variant):
    hf = make_hf_model(variant)
    ours = load_longtune(save_hf(hf, tmp_path / "in"))
    out = tmp_path / "out"
    save_hf_checkpoint(
        ours.args, ours.named_parameters(), out, dtype=torch.float32, max_shard_bytes=50_000
    )
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens, _ = sample_batch(ours.args.vocab_size)
    assert rel_err(reloaded(tokens).logits, hf(tokens).logits) <= FP32_RTOL
    assert args_from_hf_config(out) == ours.args


def test_export_replaces_previous_directory_whole(tmp_path):
    ours = load_longtune(save_hf(make_hf_model("gqa-untied"), tmp_path / "in"))
    out = tmp_path / "out"
    save_hf_checkpoint(ours.args, ours.named_parameters(), out)
    stale = out / "model-00002-of-00002.safetensors"  # a shard of an older, larger export
    stale.write_bytes(b"")
    marker = json.loads((out / "longtune_export.json").read_text())
    marker["files"].append(stale.name)
    (out / "longtune_export.json").write_text(json.dumps(marker))
    save_hf_checkpoint(ours.args, ours.named_parameters(), out)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # no temp dirs left

    def interrupted():  # Ctrl-C half-way through the tensors
        for i, named in enumerate(ours.named_parameters()):
            if i == 3:
                raise KeyboardInterrupt
            yield named

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        save_hf_checkpoint(ours.args, interrupted(), out)
    with pytest.raises(ValueError, match="cannot export: no tensor given for"):
        save_hf_checkpoint(ours.args, list(ours.named_parameters())[:3], out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("with_config", [False, True])
def test_export_never_replaces_files_an_export_does_not_write(tmp_path, with_config):
    """A directory of the user's files is refused, also when it holds a config.json (a
    downloaded model with its README): nothing in it is touched."""
    ours = load_longtune(save_hf(make_hf_model("gqa-untied"), tmp_path / "in"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    if with_config:
        (mine / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="mine holds notes.txt, which no export writes"):
        save_hf_checkpoint(ours.args, ours.named_parameters(), mine)
    assert (mine / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "mine"]


def test_export_replaces_only_a_checkpoint_longtune_wrote(tmp_path):
    """A HF checkpoint of transformers' (only files an export also writes) is refused, and
    stays as it was; longtune's own export is marked, and a second export replaces it."""
    theirs = save_hf(make_hf_model("gqa-untied"), tmp_path / "theirs")
    ours = load_longtune(theirs)
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    with pytest.raises(
        ValueError, match="but no longtune_export.json, which every export longtune writes holds"
    ):
        save_hf_checkpoint(ours.args, ours.named_parameters(), theirs)
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before
    save_hf_checkpoint(ours.args, ours.named_parameters(), tmp_path / "out")
    assert json.loads((tmp_path / "out/longtune_export.json").read_text())["kind"] == "export"
    save_hf_checkpoint(ours.args, ours.named_parameters(), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "theirs"]


# ---- bad checkpoints: each refused with one clear error before anything is trained ----


@pytest.fixture
def good_checkpoint(tmp_path) -> Path:
    return save_hf(make_hf_model("gqa-untied"), tmp_path / "ckpt")


def rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_weights_fingerprint_tells_changed_weights_from_a_copy(good_checkpoint, tmp_path):
    """A LoRA checkpoint resumes on its base (shard.check_resumable): a copy elsewhere or an
    edited config.json is the same base, weights written over (a fine-tune) are not."""
    before = weights_fingerprint(good_checkpoint)
    copy = shutil.copytree(good_checkpoint, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    assert weights_fingerprint(copy) == before
    rewrite_tensors(copy, lambda tensors: [t.add_(1e-3) for t in tensors.values()])
    assert weights_fingerprint(copy) != before


def test_missing_tensor_is_named(good_checkpoint):
    rewrite_tensors(good_checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_longtune(good_checkpoint)


def test_unexpected_tensor_is_named(good_checkpoint):
    rewrite_tensors(good_checkpoint, lambda t: t.update(extra_adapter=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"unexpected tensor extra_adapter with shape \(3,\)"):
        load_longtune(good_checkpoint)


def test_wrong_shape_names_tensor_and_both_shapes(good_checkpoint):
    rewrite_tensors(good_checkpoint, lambda t: t.update({"model.norm.weight": torch.ones(71)}))
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight: checkpoint shape \(71,\), model \(72,\)"
    ):
        load_longtune(good_checkpoint)


def test_checkpoint_of_another_model_names_the_config_fields(good_checkpoint):
    args = args_from_hf_config(good_checkpoint)
    other = dataclasses.replace(args, n_layers=4, vocab_size=300)
    with pytest.raises(ValueError, match=r"config n_layers: checkpoint has 3, model has 4") as e:
        check_hf_checkpoint(other, good_checkpoint)
    assert "config vocab_size: checkpoint has 211, model has 300" in str(e.value)


def test_missing_directory_is_a_file_not_found_error(tmp_path):
    with pytest.raises(ValueError, match="no Hugging Face config.json"):
        load_longtune(tmp_path / "nowhere")


def test_pickled_weights_are_refused(good_checkpoint):
    (good_checkpoint / "model.safetensors").rename(good_checkpoint / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        load_longtune(good_checkpoint)


def test_file_that_is_not_safetensors_is_refused(good_checkpoint):
    (good_checkpoint / "model.safetensors").write_bytes(
        b"\x80\x04 this is a pickle, not safetensors"
    )
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_longtune(good_checkpoint)


def test_shard_named_in_index_but_absent_is_named(tmp_path):
    path = save_hf(make_hf_model("gqa-untied"), tmp_path, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (path / gone).unlink()
    with pytest.raises(ValueError, match=gone):
        load_longtune(path)


def test_config_of_another_architecture_is_refused(good_checkpoint):
    config = json.loads((good_checkpoint / "config.json").read_text())
    for other in ("gemma", "qwen2_moe", "deepseek_v3"):
        config["model_type"] = other
        (good_checkpoint / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"model_type is '{other}'; longtune reads the dense "
                           "Llama family, its mixture-of-experts kin, Gemma 3 and gpt-oss: llama, "
                           "mistral, qwen2, qwen3, smollm3, qwen3_moe, mixtral, gemma3_text, "
                           "gpt_oss$"):  # fmt: skip
            load_longtune(good_checkpoint)


def test_non_float_tensor_is_refused(good_checkpoint):
    # Copied into a float parameter it would load without a word, as integers.
    rewrite_tensors(
        good_checkpoint,
        lambda t: t.update({"model.norm.weight": torch.ones(72, dtype=torch.int32)}),
    )
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight: dtype I32, expected"):
        load_longtune(good_checkpoint)


def test_config_without_optional_keys_reads_as_transformers_reads_it(good_checkpoint):
    config = json.loads((good_checkpoint / "config.json").read_text())
    for key in ["rms_norm_eps", "num_key_value_heads", "head_dim", "max_position_embeddings"]:
        config.pop(key)
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(good_checkpoint)
    ours = args_from_hf_config(good_checkpoint)
    assert ours.norm_eps == theirs.rms_norm_eps == 1e-6
    assert ours.n_kv_heads == theirs.num_key_value_heads == ours.n_heads
    assert ours.max_seq_len == theirs.max_position_embeddings == 2048


def test_config_without_a_key_transformers_cannot_default_names_it(good_checkpoint):
    config = json.loads((good_checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: rope_type 'llama3' needs \['low_freq"):
        args_from_hf_config(good_checkpoint)
    config.pop("model_type")
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: model_type is 'missing'"):
        args_from_hf_config(good_checkpoint)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_file_that_is_not_json_is_named(tmp_path, name):
    path = save_hf(make_hf_model("gqa-untied"), tmp_path, max_shard_size="40KB")
    (path / name).write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=f"{name} is not valid JSON"):
        load_longtune(path)


def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    path = save_hf(make_hf_model("gqa-untied"), tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    for outside in ("../elsewhere.safetensors", "/etc/passwd"):
        index["weight_map"][first] = outside
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match=f"names files outside {path}: \\['{outside}'\\]"):
            load_longtune(path)


def test_config_values_of_the_wrong_kind_are_named_together(good_checkpoint):
    config = json.loads((good_checkpoint / "config.json").read_text())
    config |= {"num_attention_heads": 0, "hidden_size": "64", "rms_norm_eps": -1e-6}
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_longtune(good_checkpoint)
    for expected in ("hidden_size is '64', expected an integer from 1 to",
                     "num_attention_heads is 0, expected an integer from 1 to",
                     "rms_norm_eps is -1e-06, expected a number > 0"):  # fmt: skip
        assert expected in str(error.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        # Each layer is a module built before anything is planned: 10^6 took minutes.
        ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000, expected an integer from"),
        ({"vocab_size": 2**40}, "vocab_size is 1099511627776, expected an integer from 1 to"),
        ({"intermediate_size": 2**24, "hidden_size": 2**20},
         "dim 1048576, n_layers 3, ffn_dim 16777216 and vocab_size 211 make 1.58e+14 parameters"),
        ({"model_type": ["llama"]}, "model_type is ['llama']; longtune reads the dense Llama"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes', expected true or false"),
        ({"num_hidden_layers": True}, "num_hidden_layers is True, expected an integer"),
        # 1e308 is inf in fp32: every norm's output 0, and the run trained with grad norm 0.
        ({"rms_norm_eps": 1e308}, "rms_norm_eps is 1e+308, expected a number > 0 and at most 1"),
    ],
)  # fmt: skip
def test_config_sizes_past_any_machine_or_values_of_another_kind_are_named(
    good_checkpoint, changes, message
):
    config = json.loads((good_checkpoint / "config.json").read_text())
    (good_checkpoint / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ValueError, match=re.escape(message)):
        args_from_hf_config(good_checkpoint)


# The newer families' configs, tiny, with what transformers would default besides.
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "vocab_size": 64,
}
GEMMA3 = TINY | {"model_type": "gemma3_text", "sliding_window": 8}


@pytest.mark.parametrize(
    "config, message",
    [
        # transformers refuses layer_types of another length or unknown types; read otherwise
        # as the default pattern, the windows would have fallen on other layers unsaid.
        (GEMMA3 | {"layer_types": ["sliding_attention"]}, "layer_types is ['sliding_attention'], "
         "expected one of sliding_attention, full_attention for each of the 2 layers"),
        (GEMMA3 | {"layer_types": ["local", "global"]}, "layer_types is ['local', 'global']"),
        (TINY | {"model_type": "gpt_oss", "layer_types": "sliding_attention"},
         "layer_types is 'sliding_attention', expected one of"),
        (TINY | {"model_type": "qwen3", "use_sliding_window": True, "layer_types": [None] * 2},
         "layer_types is [None, None], expected one of"),
        (TINY | {"model_type": "qwen3_moe", "mlp_only_layers": [2]},
         "mlp_only_layers is [2], expected a list of layer numbers from 0 to 1"),
        # Before, an AttributeError with a traceback, or 300 lines of the default's tensors.
        (TINY | {"model_type": "gpt_oss", "quantization_config": "mxfp4"},
         "quantization_config is 'mxfp4', expected an object"),
        (GEMMA3 | {"rope_parameters": {"full_attention": {}, "sliding_attention": "x"}},
         "rope_parameters' sliding_attention is 'x', expected an object"),
        ({"model_type": "gemma3", "text_config": {"text_config": GEMMA3}},
         "text_config is a dict holding a text_config, expected an object of the text model's"),
        ({"model_type": "gemma3", "text_config": [GEMMA3]}, "text_config is a list, expected"),
    ],
)  # fmt: skip
def test_config_structures_of_the_newer_families_are_refused_in_one_line(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        args_from_hf_config(tmp_path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "config, message",
    [
        # Each expert's tensors are named one by one: 10^7 took minutes before any error.
        (TINY | {"model_type": "mixtral", "num_local_experts": 10**7},
         "10000000 experts on 2 layers make 20000000, expected at most 262144"),
        (TINY | {"model_type": "qwen3_moe", "num_experts": 2**17, "moe_intermediate_size": 2**20},
         "n_layers 2, ffn_dim 48, 131072 experts of 1048576 and vocab_size 64 make 2.64e+13"),
    ],
)  # fmt: skip
def test_experts_past_any_checkpoint_are_refused_naming_them(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        args_from_hf_config(tmp_path)


@pytest.mark.parametrize(
    "shard, message",
    [
        ("/proc/self/environ", "is not a readable safetensors file"),  # the kernel's, size 0
        ("/dev/zero", "(named in the index) is not a regular file"),  # has no end
        ("a FIFO", "(named in the index) is not a regular file"),  # would wait for a writer
        (3, "model.safetensors.index.json: lm_head.weight is in 3, expected a file name"),
    ],
)
def test_a_shard_that_is_not_a_safetensors_file_is_named(tmp_path, shard, message):
    path = save_hf(make_hf_model("gqa-untied"), tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    if shard == 3:
        index["weight_map"]["lm_head.weight"] = shard
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        first = path / index["weight_map"]["lm_head.weight"]
        first.unlink()
        os.mkfifo(first) if shard == "a FIFO" else first.symlink_to(shard)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_longtune(path)


def test_a_checkpoint_with_many_problems_names_the_first_and_counts_the_rest(good_checkpoint):
    """An MoE model's every expert tensor of another size would be thousands of lines."""
    config = json.loads((good_checkpoint / "config.json").read_text())
    (good_checkpoint / "config.json").write_text(json.dumps(config | {"intermediate_size": 64}))
    with pytest.raises(ValueError) as refused:
        load_longtune(good_checkpoint)
    lines = str(refused.value).splitlines()
    assert len(lines) == 10 and lines[-1] == "  and 1 more"
    assert "layers.0.mlp.gate_proj.weight: checkpoint shape (136, 72), model (64, 72)" in lines[1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda weight_map: weight_map.pop("model.norm.weight"),
         "missing tensor model.norm.weight: expected shape (72,)"),  # was a KeyError
        (lambda weight_map: weight_map.update({"model.norm.weight": weight_map["lm_head.weight"]}),
         "missing tensor model.norm.weight: expected shape (72,) (the index puts it in model-"),
    ],
)  # fmt: skip
def test_an_index_that_disagrees_with_its_shards_is_refused_naming_the_tensor(
    tmp_path, edit, message
):
    path = save_hf(make_hf_model("gqa-untied"), tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.norm.weight"] != index["weight_map"]["lm_head.weight"]
    edit(index["weight_map"])
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_longtune(path)


def test_index_without_weight_map_is_named(tmp_path):
    path = save_hf(make_hf_model("gqa-untied"), tmp_path, max_shard_size="40KB")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match='index.json: expected a "weight_map" object'):
        load_longtune(path)


# ---- the Llama family as the hub ships it: each type's config.json and export ----


def test_export_carries_the_hf_checkpoints_tokenizer_and_ids(good_checkpoint, tmp_path):
    """An export of a model that came from a HF checkpoint carries that checkpoint's
    tokenizer files and generation_config.json as they were, and its special token ids."""

    for name, contents in ByteTokenizer().hf_files().items():
        (good_checkpoint / name).write_bytes(contents)
    (good_checkpoint / "generation_config.json").write_text('{"temperature": 0.6}')
    config = json.loads((good_checkpoint / "config.json").read_text())
    config.update(bos_token_id=256, eos_token_id=[257, 1], pad_token_id=None)
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    ours = load_longtune(good_checkpoint)
    out = tmp_path / "export"
    tokenizer = read_hf_tokenizer(good_checkpoint)
    save_hf_checkpoint(ours.args, ours.named_parameters(), out, tokenizer=tokenizer)
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert (out / name).read_bytes() == (good_checkpoint / name).read_bytes(), name
    exported = json.loads((out / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (256, [257, 1])
    assert transformers.AutoTokenizer.from_pretrained(out)("a")["input_ids"] == [256, 97]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_or_inf_weight_is_refused_naming_the_tensor(tmp_path, value):
    hf = make_hf_model("gqa-untied")
    with torch.no_grad():
        hf.model.layers[1].mlp.up_proj.weight[3, 5] = value
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight hold NaN or inf"):
        load_longtune(save_hf(hf, tmp_path / "hf"))


def test_a_tied_checkpoint_holding_another_lm_head_is_refused_as_transformers_unties_it(tmp_path):
    """config.json ties the output (tie_word_embeddings true) and the file also holds
    lm_head.weight: a copy of the embedding loads tied, with transformers' logits; another
    head, which transformers uses untied, is refused naming the tensor and the key, even one
    that differs in its last row alone (2 ranks: tests/test_shard.py)."""
    path = save_hf(make_hf_model("gqa-llama3.1-scaling-tied"), tmp_path)
    tensors = load_file(path / "model.safetensors")
    head = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors | {"lm_head.weight": head}, path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    tokens, _ = sample_batch(211)
    assert rel_err(load_longtune(path)(tokens), theirs(tokens).logits) <= FP32_RTOL
    head[-1] += 1e-3
    save_file(tensors | {"lm_head.weight": head}, path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert theirs.lm_head.weight is not theirs.model.embed_tokens.weight
    message = (
        "lm_head.weight differs from model.embed_tokens.weight, but config.json's top-level "
        "tie_word_embeddings is true"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        load_longtune(path)


@pytest.mark.parametrize("variant", sorted(FAMILY_CONFIGS))
def test_each_family_exports_as_its_own_class(tmp_path, variant):
    hf = make_family_model(variant)
    ours = load_longtune(save_hf(hf, tmp_path / "in"))
    out = tmp_path / "out"
    save_hf_checkpoint(ours.args, ours.named_parameters(), out, dtype=torch.float32)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded) is type(hf)
    tokens, _ = sample_batch(ours.args.vocab_size)
    assert rel_err(reloaded(tokens).logits, hf(tokens).logits) <= FP32_RTOL
    assert args_from_hf_config(out) == ours.args
    for key in ("tie_word_embeddings", "sliding_window", "no_rope_layers",
                "use_sliding_window", "layer_types"):  # fmt: skip
        assert getattr(reloaded.config, key, None) == getattr(hf.config, key, None), key
    rope, their_rope = reloaded.model.rotary_emb, hf.model.rotary_emb
    for name, inv_freq in their_rope.named_buffers():  # Gemma 3's: one per layer type
        assert torch.equal(rope.get_buffer(name), inv_freq), name
    scalings = [key for key in vars(their_rope) if key.endswith("attention_scaling")]
    assert scalings and all(getattr(rope, k) == getattr(their_rope, k) for k in scalings)
    attention = reloaded.model.layers[0].self_attn
    assert attention.head_dim == hf.model.layers[0].self_attn.head_dim


def test_config_defaults_are_each_transformers_class_defaults():
    import dataclasses as dc

    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config", "smollm3": "SmolLM3Config",
               "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
               "gemma3_text": "Gemma3TextConfig", "gpt_oss": "GptOssConfig"}  # fmt: skip
    assert set(classes) == set(HF_CONFIG_DEFAULTS)
    for family, defaults in HF_CONFIG_DEFAULTS.items():
        config_class = getattr(transformers, classes[family])
        fields = {f.name: f.default for f in dc.fields(config_class)}
        # transformers 5 keeps RoPE bases in rope_parameters (Gemma 3's: global and local),
        # and reads Gemma 3's sliding_window_pattern from the keyword arguments alone.
        theta = config_class.default_theta
        thetas = theta if isinstance(theta, dict) else {"global": theta}
        fields |= {"rope_theta": thetas["global"], "rope_local_base_freq": thetas.get("local")}
        if family == "gemma3_text":
            pattern = config_class().layer_types.index("full_attention") + 1
            fields["sliding_window_pattern"] = pattern
        if family == "gpt_oss":  # its YaRN, set in __post_init__
            rope = config_class().rope_parameters
            fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        for key, value in defaults.items():
            assert fields[key] == value, (family, key)
        # What is absent here derives from the heads there.
        for key in ("num_key_value_heads", "head_dim"):
            assert key in defaults or fields.get(key) is None, (family, key)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0, expected None"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0, expected None"),
        ({"hidden_activation": "gelu"},
         "hidden_activation is 'gelu', expected 'gelu_pytorch_tanh'"),
        ({"use_bidirectional_attention": True},
         "use_bidirectional_attention is True, expected False"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "sliding_attention's rope_type is 'linear', expected 'default'"),
    ],
)  # fmt: skip
def test_a_gemma3_switch_longtune_does_not_compute_is_refused(tmp_path, change, message):
    save_hf(make_family_model("gemma3"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=re.escape(message)):
        args_from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="local_rope_theta None: family 'gemma3_text' needs one"):
        dataclasses.replace(PRESETS["gemma-3-1b"], local_rope_theta=None)


def test_qwen3_without_head_dim_reads_qwen3s_default_head_dim(tmp_path):
    hf = make_family_model("qwen3")
    save_hf(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("head_dim")
    config |= {"hidden_size": 64, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert args_from_hf_config(tmp_path).head_dim == theirs.head_dim == 128


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "ntk"])
def test_a_rope_type_longtune_does_not_compute_is_refused_naming_those_it_does(
    good_checkpoint, rope_type
):
    config = json.loads((good_checkpoint / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
    (good_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not one longtune computes; "
                       "expected one of default, linear, llama3, yarn$"):  # fmt: skip
        args_from_hf_config(good_checkpoint)


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScaling("linear", 2.5),
        RopeScaling("llama3", 8.0, 8192, 1.0, 4.0),
        RopeScaling("yarn", 4.0, 64, beta_fast=16.0, beta_slow=2.0, attention_factor=1.25),
        RopeScaling("yarn", 4.0, 64, truncate=None),  # transformers' null: no truncation
        RopeScaling("yarn", 4.0, 64, truncate=False),
    ],
    ids=lambda s: f"{s.rope_type}-truncate-{s.truncate}",
)
def test_the_exported_config_reads_back_as_the_same_rope_scaling(tmp_path, scaling):
    args = dataclasses.replace(PRESETS["tiny"], rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args, torch.float32)))
    assert args_from_hf_config(tmp_path).rope_scaling == scaling


# ---- PEFT adapters out and in, and the merged export ----


def test_saved_adapter_loads_in_peft_and_back(tmp_path):
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    randomize_adapters(model)
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), out, base_model=str(path))
    assert json.loads((out / "adapter_config.json").read_text())["r"] == CONFIG.rank
    theirs = peft.PeftModel.from_pretrained(hf_model(path), out).eval()
    tokens = tokens_for(model)
    assert rel_err(model(tokens), theirs(tokens).logits) <= FP32_RTOL
    fresh = lora_model(path)
    load_peft_adapter(fresh, CONFIG, out)
    loaded = adapters(fresh)
    assert all(torch.equal(t, loaded[n]) for n, t in adapters(model).items())


@pytest.mark.parametrize("saved_as", ["hub", "transformers-5"])
def test_an_adapter_of_a_multimodal_base_loads_in_peft_on_it_and_back(tmp_path, saved_as):
    """Gemma 3 4b+: PEFT finds the decoder's projections of Gemma3ForConditionalGeneration
    under model.language_model., beside the vision tower's q/k/v_proj, which the adapter's
    target_modules (a regular expression) leave alone: PEFT's logits on the base it names."""
    _, path = gemma3_multimodal_checkpoint(tmp_path / "base", saved_as)
    model = lora_model(path)
    randomize_adapters(model)
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), out, base_model=str(path))
    theirs = peft.PeftModel.from_pretrained(hf_model(path), out).eval()
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    assert rel_err(model(tokens), theirs(tokens).logits) <= FP32_RTOL  # below the image tokens
    assert not any("vision" in n for n, _ in theirs.named_modules() if n.endswith("lora_A"))
    fresh = lora_model(path)
    load_peft_adapter(fresh, CONFIG, out, str(path))
    loaded = adapters(fresh)
    assert all(torch.equal(t, loaded[n]) for n, t in adapters(model).items())


def test_an_adapter_of_the_other_kind_of_base_is_said_so_in_one_problem(tmp_path):
    """A text model's adapter names (base_model.model.model.layers.*, as longtune exported a
    multimodal Gemma 3's before) on a multimodal base, and the reverse: one problem saying so,
    not each tensor missing and unexpected."""
    _, multimodal = gemma3_multimodal_checkpoint(tmp_path / "multimodal")
    text = hf_checkpoint(tmp_path / "text")
    for base, named_as in ((multimodal, "model."), (text, "model.language_model.")):
        model = lora_model(base)
        out = tmp_path / f"adapter-{base.name}"
        save_peft_adapter(model.args, CONFIG, model.named_parameters(), out, str(base), named_as)
        with pytest.raises(ValueError) as refused:
            load_peft_adapter(lora_model(base), CONFIG, out, str(base))
        message = str(refused.value)
        assert f"named for a decoder under {named_as} " in message
        assert "missing tensor" not in message and "unexpected tensor" not in message


def test_a_base_named_only_and_a_broken_expression_are_each_said_in_one_line(tmp_path):
    """base_model is also PEFT's label (a hub id, no directory here): the adapter is named as a
    text model's; target_modules that is no regular expression is refused, naming it."""
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), out, base_model="org/model")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/model"
    assert isinstance(config["target_modules"], list)
    (out / "adapter_config.json").write_text(json.dumps(config | {"target_modules": "(q_proj"}))
    with pytest.raises(ValueError, match=r"target_modules: '\(q_proj' is no regular expression"):
        load_peft_adapter(lora_model(path), CONFIG, out)
    (out / "adapter_config.json").write_text(json.dumps(config | {"target_modules": 5}))
    with pytest.raises(ValueError, match="adapter_config.json target_modules: adapter has 5, "):
        load_peft_adapter(lora_model(path), CONFIG, out)  # a number: named, no traceback


def test_an_adapter_records_a_local_base_by_its_absolute_path(tmp_path, monkeypatch):
    """PEFT's AutoPeftModelForCausalLM loads the base it names, from wherever it runs: a
    relative path would be looked for there, then on the hub. (A hub id stays: above.)"""
    hf_checkpoint(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model = lora_model(Path("base"))
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), "adapter", base_model="base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path.resolve() / "base")
    Path("current").symlink_to("base")  # pinned as named, not to the link's target
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), "adapter", base_model="current")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path.cwd() / "current")


@pytest.mark.parametrize(
    "key, value, expected",
    [("r", "4", "an integer > 0"), ("r", 4.0, "an integer > 0"), ("r", True, "an integer > 0"),
     ("r", 0, "an integer > 0"), ("lora_alpha", "16", "a number"),
     ("lora_dropout", "0.1", "a number")],
)  # fmt: skip
def test_an_adapter_number_of_the_wrong_type_is_refused_naming_it(tmp_path, key, value, expected):
    """Neither dropped (a dropout of "0.1" trained without one) nor said as a missing rank or
    a difference that a flag would mend."""
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | {key: value}))
    said = f"{out / 'adapter_config.json'} {key}: adapter has {value!r}, expected {expected}"
    with pytest.raises(UsageError, match=f"^{re.escape(said)}$"):
        peft_adapter_settings(model.args, out)
    with pytest.raises(UsageError, match=f"^{re.escape(said)}$"):
        load_peft_adapter(lora_model(path), CONFIG, out)
    del config["r"]  # absent, as PEFT's default: none taken
    (out / "adapter_config.json").write_text(json.dumps(config))
    assert "rank" not in peft_adapter_settings(model.args, out)


def test_an_adapter_of_another_config_is_refused_with_each_difference(tmp_path):
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), tmp_path / "adapter")
    other = LoRAConfig(rank=8, alpha=8.0, targets=("wq", "wv"))
    with pytest.raises(ValueError) as error:
        load_peft_adapter(lora_model(path, other), other, tmp_path / "adapter")
    message = str(error.value)
    for expected in ("r: adapter has 4, expected 8 (--lora-rank 8: pass --lora-rank 4)",
                     "target_modules", "unexpected tensor"):  # fmt: skip
        assert expected in message
    assert "adapter shape" not in message  # each shape differs by the rank: that says it


def test_an_adapter_tensor_of_integers_is_refused_as_a_checkpoints_is(tmp_path):
    """Copied into the float adapters it would have loaded rounded, without a word."""
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    name = next(n for n in tensors if n.endswith("lora_A.weight"))
    tensors[name] = (tensors[name] * 100).int()
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"tensor {name}: dtype I32, expected one of")):
        load_peft_adapter(lora_model(path), CONFIG, tmp_path / "adapter")


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_that_is_no_regular_file_is_named_so(tmp_path, name):
    """A FIFO in the place of one: before, said not to exist."""
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), tmp_path / "adapter")
    (tmp_path / "adapter" / name).unlink()
    os.mkfifo(tmp_path / "adapter" / name)
    with pytest.raises(ValueError, match=re.escape(f"{name} is not a regular file")):
        load_peft_adapter(model, CONFIG, tmp_path / "adapter")


def test_an_adapter_with_peft_settings_longtune_lacks_is_refused(tmp_path):
    """Per-layer ranks or scales, transposed weights, a subset of layers: each named, none
    loaded as if it were not there."""
    path = hf_checkpoint(tmp_path / "base")
    model = lora_model(path)
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), tmp_path / "adapter")
    config_file = tmp_path / "adapter/adapter_config.json"
    config = json.loads(config_file.read_text())
    # PEFT's defaults, as it writes them, load.
    defaults = {"rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}
    config_file.write_text(json.dumps({**config, **defaults, "modules_to_save": None}))
    load_peft_adapter(lora_model(path), CONFIG, tmp_path / "adapter")
    changed = {
        "alpha_pattern": {"q_proj": 64},
        "rank_pattern": {"v_proj": 8},
        "fan_in_fan_out": True,
        "layers_to_transform": [0],
        "layers_pattern": "layers",
        "lora_bias": True,
        "modules_to_save": ["lm_head"],
        "init_lora_weights": "pissa_niter_4",
    }
    config_file.write_text(json.dumps({**config, **changed}))
    with pytest.raises(ValueError) as error:
        load_peft_adapter(lora_model(path), CONFIG, tmp_path / "adapter")
    message = str(error.value)
    assert "alpha_pattern: adapter has {'q_proj': 64}, which longtune does not" in message
    for key in changed:
        assert f"adapter_config.json {key}: adapter has {changed[key]!r}" in message


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_export_loads_in_transformers(tmp_path, family):
    path = hf_checkpoint(tmp_path / "base", family)
    model = lora_model(path)
    randomize_adapters(model)
    out = tmp_path / "merged"
    named = merged_named_tensors(model, lambda p: p.detach())
    save_hf_checkpoint(model.args, named, out, dtype=torch.float32)
    tokens = tokens_for(model)
    assert rel_err(hf_model(out)(tokens).logits, model(tokens)) <= FP32_RTOL


def test_a_hub_id_given_as_a_checkpoint_is_told_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="huggingface-cli download ID --local-dir DIR"):
        args_from_hf_config("meta-llama/Llama-3.2-1B")
    with pytest.raises(UsageError) as missing:  # a path of other shape: no hub id
        args_from_hf_config(tmp_path / "nothing")
    assert "huggingface-cli" not in str(missing.value)

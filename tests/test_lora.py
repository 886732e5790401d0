"""LoRA (lora.apply_lora) against PEFT's LoRA on transformers (the numerical oracle), and the
model on a 4-bit base (PEFT adapters out and in, and the merged export: tests/test_hf.py).

Tolerances: fp32 on CPU, max |a - b| / max |b| <= 1e-5 for logits and gradients. The model
on an NF4 base against the same model on the dequantized base: the same weights, so the
same 1e-5 (the matmul runs as x @ W^T in one and F.linear in the other).
"""

import dataclasses
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

import prepare
import train
from config_json import args_from_hf_config
from files import UsageError
from hf import (
    check_peft_adapter,
    hf_names,
    load_peft_adapter,
    peft_adapter_settings,
    peft_expert_names,
    peft_names,
    save_hf_checkpoint,
    save_peft_adapter,
    to_peft_experts,
)
from kernels import dequantize_nf4, dequantize_nf4_reference, quantize_nf4
from kernels.moe import ExpertLoRA, moe_experts, moe_experts_reference
from lora import (
    EXPERT_LORA_TARGETS,
    HF_LORA_TARGETS,
    LORA_TARGETS,
    LoRAConfig,
    LoRALinear,
    NF4MoE,
    _DequantizeInBackward,
    apply_lora,
    merged_named_tensors,
    parse_lora_targets,
)
from model import REFERENCE_OPS, Llama, ModelArgs, fp8_ops, triton_ops
from moe import EXPERT_WEIGHTS, LORA_PARAMS
from shard import fill_weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FP32_RTOL = 1e-5
CONFIG = LoRAConfig(rank=4, alpha=8.0)
NF4_CONFIG = LoRAConfig(rank=4, alpha=8.0, quantize_base="nf4")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# The family's config class, and what the tiny checkpoint sets beyond the common sizes:
# Qwen2's q/k/v biases come with its class, Qwen3's QK-norm too; Mistral's and Qwen3's
# head_dim 48, not 128 / 4; SmolLM3's second layer without RoPE; Gemma 3's GeGLU and norms.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"head_dim": 48, "sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 48}),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0], "pad_token_id": None}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 48, "pad_token_id": None}),
}


def hf_checkpoint(path: Path, family: str = "llama") -> Path:
    """A tiny HF model of `family` (GQA, untied) whose rows are multiples of 64, so NF4
    applies; norms and biases random (HF starts them at 1 and 0), so that they are loaded."""
    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        vocab_size=160,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
    model.save_pretrained(path)
    return path


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def lora_model(path: Path, config: LoRAConfig = CONFIG, seed: int = 0, ops=REFERENCE_OPS) -> Llama:
    with torch.device("meta"):
        model = Llama(args_from_hf_config(path), ops)
    apply_lora(model, config, torch.float32)
    model.to_empty(device="cpu")
    fill_weights(model, seed, torch.device("cpu"), path, lora=config)  # adapters' initial values
    return model


def randomize_adapters(model: Llama) -> None:
    """B starts at 0, which would leave A without a gradient: random values for both."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def tokens_for(model: Llama) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.args.vocab_size, (2, 24), generator=g)


def assert_same_logits_and_gradients(model: Llama, plain: Llama, tokens: torch.Tensor) -> None:
    """`model`'s logits equal `plain`'s, and so do the gradients of `plain`'s trained parameters."""
    logits, plain_logits = model(tokens), plain(tokens)
    assert rel_err(logits, plain_logits) <= FP32_RTOL
    logits.square().mean().backward()
    plain_logits.square().mean().backward()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            assert rel_err(model.get_parameter(name).grad, p.grad) <= FP32_RTOL, name


def assert_peft_logits_and_gradients(model: Llama, theirs, names: dict[str, str]) -> None:
    """`model`'s logits equal PEFT's model `theirs`'s, and each of `names` (ours -> PEFT's) has
    our adapter's gradient."""
    tokens = tokens_for(model)
    logits, their_logits = model(tokens), theirs(tokens).logits
    assert rel_err(logits, their_logits) <= FP32_RTOL
    logits.square().mean().backward()
    their_logits.square().mean().backward()
    their_params = {n.replace(".default", ""): p for n, p in theirs.named_parameters()}
    for ours, peft_name in names.items():
        assert rel_err(model.get_parameter(ours).grad, their_params[peft_name].grad) <= FP32_RTOL


def adapters(model: Llama) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_only_adapters_train_and_the_base_model_is_unchanged_at_step_0(tmp_path):
    path = hf_checkpoint(tmp_path)
    model = lora_model(path)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(LORA_TARGETS) * model.args.n_layers
    assert all(".lora_A" in n or ".lora_B" in n for n in trainable)
    tokens = tokens_for(model)
    assert rel_err(model(tokens), hf_model(path)(tokens).logits) <= FP32_RTOL
    # One initial value per (seed, name): the same again, another with another seed.
    again = adapters(lora_model(path))
    assert all(torch.equal(t, again[n]) for n, t in adapters(model).items())
    a_name = next(n for n in trainable if n.endswith("lora_A"))
    assert not torch.equal(adapters(model)[a_name], adapters(lora_model(path, seed=1))[a_name])
    bound = 1 / model.args.dim**0.5  # PEFT's kaiming-uniform A, over wq's dim inputs
    assert adapters(model)[a_name].abs().max() <= bound


def peft_model_like(model: Llama, path: Path):
    """PEFT's LoRA on transformers with our config and our adapters' values."""
    config = peft.LoraConfig(
        r=CONFIG.rank,
        lora_alpha=CONFIG.alpha,
        lora_dropout=0.0,
        target_modules=sorted(HF_LORA_TARGETS.values()),
    )
    theirs = peft.get_peft_model(hf_model(path), config)
    names = peft_names(model.args, CONFIG.targets)
    state = {names[n]: t for n, t in adapters(model).items()}
    result = peft.set_peft_model_state_dict(theirs, state)
    assert not result.unexpected_keys
    return theirs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_adapter_gradients_match_peft(tmp_path, family):
    """PEFT's target names are the family's too; Qwen2's biases stay in the frozen base."""
    path = hf_checkpoint(tmp_path, family)
    model = lora_model(path)
    randomize_adapters(model)
    theirs, names = peft_model_like(model, path), peft_names(model.args, CONFIG.targets)
    assert_peft_logits_and_gradients(model, theirs, names)


def test_targets_accept_hf_names_and_refuse_unknown_ones():
    assert parse_lora_targets("q_proj, v_proj,w2") == ("wq", "wv", "w2")
    assert parse_lora_targets("all") == LORA_TARGETS
    with pytest.raises(ValueError, match="qkv"):
        parse_lora_targets("qkv")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_on_nf4_base_equals_model_on_dequantized_base(tmp_path, family):
    """Only the targets' weights are in 4 bits: Qwen2's q/k/v biases and Qwen3's q/k norms
    stay as loaded, frozen."""
    path = hf_checkpoint(tmp_path, family)
    quantized = lora_model(path, NF4_CONFIG)
    plain = lora_model(path)
    randomize_adapters(quantized)
    randomize_adapters(plain)
    with torch.no_grad():  # the plain model's base := the dequantized 4-bit base
        for name, module in quantized.named_modules():
            if isinstance(module, LoRALinear):
                dequantized = module.base_weight(module.weight_nf4)
                plain.get_submodule(name).weight.copy_(dequantized)
    assert not any(isinstance(getattr(m, "weight", None), torch.nn.Parameter)
                   for m in quantized.modules() if isinstance(m, LoRALinear))  # fmt: skip
    hf = dict(transformers.AutoModelForCausalLM.from_pretrained(path).named_parameters())
    kept = {name: hf_name for name, hf_name in hf_names(quantized.args).items()
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight"))}  # fmt: skip
    assert len(kept) == {"qwen2": 6, "qwen3": 4, "gemma3_text": 4}.get(family, 0)
    for name, hf_name in kept.items():
        param = quantized.get_parameter(name)
        assert not param.requires_grad and torch.equal(param, hf[hf_name]), name
    assert_same_logits_and_gradients(quantized, plain, tokens_for(plain))


# --fp8's gradients against the model without it, norm-wise per tensor: each projection's e4m3
# rounding is within 6e-2 (tests/test_kernels.py), compounded through the blocks of the tiny
# checkpoint (measured up to 0.17 on an adapter's B; a missing base or adapter term is ~1).
FP8_TOLERANCE = 0.25


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp8_runs_a_bf16_base_in_e4m3_and_leaves_a_4_bit_base_as_it_is(tmp_path, family):
    """With LoRA, --fp8 multiplies the frozen base (and its Qwen2 biases, added) in e4m3 and
    adds the adapters as they are: their gradients are within FP8's error of the model
    without --fp8, and not equal to them. QLoRA's 4-bit base is not in FP8: equal."""
    path = hf_checkpoint(tmp_path, family)
    fp8 = fp8_ops(REFERENCE_OPS, kernels=False)
    for config, tolerance in [(CONFIG, FP8_TOLERANCE), (NF4_CONFIG, 0.0)]:
        models = [lora_model(path, config, ops=ops) for ops in (fp8, REFERENCE_OPS)]
        grads = []
        for model in models:
            randomize_adapters(model)
            model(tokens_for(model)).square().mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        for name, want in grads[1].items():
            error = ((grads[0][name] - want).norm() / want.norm()).item()
            assert error <= tolerance and (error > 0 or tolerance == 0), (config, name, error)


def test_nf4_needs_rows_that_are_multiples_of_64():
    with torch.device("meta"):
        model = Llama(ModelArgs.from_name("tiny"))  # dim 96
    with pytest.raises(ValueError, match=r"layers.0.attention.wq.weight: NF4 .* \(96, 96\)"):
        apply_lora(model, LoRAConfig(rank=2, alpha=2.0, quantize_base="nf4"), torch.float32)


# ---- Mixture-of-experts models (moe.py): adapters on attention, QLoRA's experts in NF4 ----

# Rows multiples of 64, so NF4 applies (but gpt-oss's w2, which no QLoRA test takes); Qwen3-MoE's
# layer 1 dense.
MOE_CONFIGS = {
    "gpt_oss": lambda **kw: transformers.GptOssConfig(
        **kw, head_dim=16, intermediate_size=32, num_local_experts=4, sliding_window=8,
    ),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **kw, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
        mlp_only_layers=[1], norm_topk_prob=True,
    ),
    "mixtral": lambda **kw: transformers.MixtralConfig(
        **kw, intermediate_size=64, num_local_experts=4
    ),
}  # fmt: skip


def moe_checkpoint(path: Path, name: str) -> Path:
    config = MOE_CONFIGS[name](
        vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # experts' weights are zeros until initialized by from_pretrained
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_lora_on_an_moe_model_adapts_attention_and_loads_in_peft(tmp_path, name):
    """Adapters on wq wk wv wo of every layer; none on the feed-forwards, dense or experts,
    and target_modules says so: PEFT on transformers 5 reads gate_proj/up_proj/down_proj on
    Qwen3-MoE as its experts' (and would then drop a dense layer's adapters). The router and
    experts are frozen. PEFT's model has our adapters and no others, with equal logits and
    adapter gradients."""
    path = moe_checkpoint(tmp_path / "base", name)
    model = lora_model(path)
    randomize_adapters(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 4 * model.args.n_layers
    assert all(".attention.w" in n for n in trainable)
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, CONFIG, model.named_parameters(), out, base_model=str(path))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert "target_parameters" not in config  # PEFT before 0.17 refuses the key
    theirs = peft.PeftModel.from_pretrained(hf_model(path), out, is_trainable=True)
    their_params = {n.replace(".default", ""): p for n, p in theirs.named_parameters()}
    names = peft_names(model.args, CONFIG.targets)
    assert sorted(n for n, p in their_params.items() if p.requires_grad) == sorted(names.values())
    assert_peft_logits_and_gradients(model, theirs, names)


def test_train_py_says_lora_adapts_attention_only_on_an_moe_model(tmp_path, capsys):
    """`--lora-targets all` on an MoE model: the log names the projections adapted (the
    feed-forward targets take no adapter there), then the experts' when asked."""
    config = MOE_CONFIGS["qwen3_moe"](
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    data = prepare.prepare([Path(json.__file__)], tmp_path / "data", workers=1)
    argv = ["--hf-checkpoint", str(tmp_path / "hf"), "--data", str(data), "--lr", "1e-3",
            "--seq-len", "32", "--batch-tokens", "64", "--max-steps", "1",
            "--lora-rank", "2"]  # fmt: skip
    train.main([*argv, "--run-dir", str(tmp_path / "all")])
    assert "LoRA r=2 (alpha 16) on wq,wk,wv,wo: " in capsys.readouterr().out
    targets = ["--lora-targets", "wq,w1,experts_w13,experts_w2"]
    train.main([*argv, *targets, "--run-dir", str(tmp_path / "experts")])
    assert "LoRA r=2 (alpha 16) on wq,experts_w13,experts_w2: " in capsys.readouterr().out


def test_feed_forward_targets_alone_adapt_nothing_on_an_moe_model_and_are_refused():
    with torch.device("meta"):
        model = Llama(ModelArgs.from_name("qwen3-30b-a3b"))
    with pytest.raises(
        UsageError, match=r"\['w1', 'w2'\] adapt nothing .* wq,wk,wv,wo,experts_w13"
    ):
        apply_lora(model, LoRAConfig(rank=2, alpha=2.0, targets=("w1", "w2")), torch.float32)


def dequantized_twin(quantized: Llama, path: Path, config: LoRAConfig = CONFIG) -> Llama:
    """The LoRA model on the quantized one's base, dequantized (fp32), and its adapters."""
    plain = lora_model(path, config)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, LoRALinear):
                plain.get_submodule(name).weight.copy_(module.base_weight(module.weight_nf4))
            if isinstance(module, NF4MoE):
                for w in EXPERT_WEIGHTS:
                    dequantized = module.expert_weight(w, torch.float32)
                    plain.get_submodule(name).get_parameter(w).copy_(dequantized)
        for name, p in quantized.named_parameters():
            if p.requires_grad:
                plain.get_parameter(name).copy_(p)
    return plain


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])  # gate_up_proj: w1's rows, then w3's
def test_qlora_stores_the_experts_in_nf4_as_loaded_and_equals_them_dequantized(tmp_path, name):
    """Each expert tensor quantized on load as one [E * out, in] weight; the layer's output, its
    input's gradient equal the MoE on the dequantized experts exactly (the same
    Ops.moe_experts on the same values); the model's logits and adapter gradients within fp32
    (the attention's NF4 matmul rounds as x @ W^T)."""
    path = moe_checkpoint(tmp_path, name)
    quantized = lora_model(path, NF4_CONFIG)
    randomize_adapters(quantized)
    plain = dequantized_twin(quantized, path)
    hf = dict(hf_model(path).named_parameters())
    layer = quantized.layers[0].feed_forward
    assert isinstance(layer, NF4MoE) and not any(p.requires_grad for p in layer.parameters())
    assert not hasattr(layer, "w1")
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2F, D]: w1 then w3
    want = quantize_nf4(gate_up[:, :64].flatten(0, 1))
    assert torch.equal(layer.w1_nf4.view(torch.uint8).flatten(0, 1), want.rows)
    assert torch.equal(layer.w1_absmax2, want.absmax2) and torch.equal(layer.w1_offset, want.offset)

    x = torch.randn(2, 5, 64, requires_grad=True)
    reference = plain.layers[0].feed_forward
    y, y_ref = layer(x), reference(x)
    assert torch.equal(y, y_ref)
    grad = torch.randn_like(y)
    (dx,), (dx_ref,) = torch.autograd.grad(y, x, grad), torch.autograd.grad(y_ref, x, grad)
    assert torch.equal(dx, dx_ref)

    assert_same_logits_and_gradients(quantized, plain, tokens_for(quantized))


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "triton"])
def test_no_dequantized_expert_outlives_the_forward_and_backward_dequantizes_again(
    tmp_path, kernels
):
    """What Ops.moe_experts saves of the dequantized experts (the Triton path the tensors,
    the reference views of them) is dequantized again in backward, so none is alive after
    forward, even under an outer saved-tensor hook that keeps what it is given (activation
    offload's, a checkpoint's), which still gets every other saved tensor. The input's
    gradient is the same under that hook and under torch's checkpoint."""
    path = moe_checkpoint(tmp_path, "mixtral")
    model = lora_model(path, NF4_CONFIG, ops=triton_ops() if kernels else REFERENCE_OPS)
    layer = model.layers[0].feed_forward
    made = []

    def spy(*args):
        weight = (dequantize_nf4 if kernels else dequantize_nf4_reference)(*args)
        made.append(weakref.ref(weight))
        return weight

    layer.dequantize = spy
    x = torch.randn(2, 5, 64, requires_grad=True)
    grad = torch.randn(2, 5, 64)
    (want,) = torch.autograd.grad(layer(x), x, grad)
    assert len(made) > 3 and all(ref() is None for ref in made)
    kept = []
    made.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = layer(x)
    assert len(made) == 3 and all(ref() is None for ref in made) and kept
    assert torch.equal(torch.autograd.grad(y, x, grad)[0], want)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    assert torch.equal(torch.autograd.grad(y, x, grad)[0], want)


def test_qwen3_30b_a3bs_experts_in_nf4_take_about_half_a_byte_a_parameter():
    """In bf16 storage: the packed codes, a byte of scale per 64 values, the second-level
    scales: 0.516 bytes per parameter at Qwen3-30B-A3B's widths (1/3.9 of bf16)."""
    with torch.device("meta"):
        model = Llama(ModelArgs.from_name("qwen3-30b-a3b"))
    apply_lora(model, NF4_CONFIG, torch.bfloat16)
    layer = model.layers[0].feed_forward
    stored = sum(t.nbytes for n, t in layer.named_parameters() if n.endswith("_nf4"))
    stored += sum(t.nbytes for t in layer.buffers())
    params = sum(torch.Size(s).numel() for s in layer.shapes.values())
    assert params == 3 * 128 * 768 * 2048
    assert stored / params == pytest.approx(0.5 + 1 / 64 + 4 / 64 / 256, rel=1e-3)


def test_a_qlora_moe_model_exports_merged_with_its_experts_dequantized(tmp_path):
    path = moe_checkpoint(tmp_path / "base", "qwen3_moe")
    model = lora_model(path, NF4_CONFIG)
    randomize_adapters(model)
    named = merged_named_tensors(model, lambda p: p.detach())
    save_hf_checkpoint(model.args, named, tmp_path / "merged", dtype=torch.float32)
    tokens = tokens_for(model)
    assert rel_err(hf_model(tmp_path / "merged")(tokens).logits, model(tokens)) <= FP32_RTOL


def test_what_the_nf4_experts_hooks_pass_on_is_freed_with_a_graph_never_backpropagated():
    """Without hooks outside, the other saved tensors are kept detached: exp saves its own
    output, which kept as it is would hold the node that holds it, a cycle through C++ that
    is never freed when a forward's graph is dropped without backward."""
    x = torch.randn(8, 8, requires_grad=True)
    with _DequantizeInBackward({}):
        y = x.exp()
    kept = weakref.ref(y)
    del y
    assert kept() is None


def test_the_nf4_experts_hooks_leave_no_cycle_that_keeps_a_checkpointed_input(tmp_path):
    """The hooks are closures: an object whose hooks were its own bound methods would be a
    reference cycle, freed only by the garbage collector, and with it the checkpoint's frame
    and the block's input (on qwen3-30b-a3b QLoRA, 5.5 GiB more at 2 micro-batches a step)."""
    layer = lora_model(moe_checkpoint(tmp_path, "mixtral"), NF4_CONFIG).layers[0].feed_forward
    h = torch.randn(2, 5, 64, requires_grad=True) * 1  # the block's input, not a leaf
    kept = weakref.ref(h)
    gc.disable()
    try:
        torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False).sum().backward()
        del h
        assert kept() is None
    finally:
        gc.enable()


# ---- LoRA on the experts (kernels.moe.ExpertLoRA), in PEFT's target_parameters format ----

EXPERTS_CONFIG = LoRAConfig(rank=4, alpha=8.0, targets=("wq", "wv", "experts_w13", "experts_w2"))


def test_an_experts_adapter_read_without_the_experts_targets_is_refused_in_one_line(tmp_path):
    """Its target_parameters named against the targets asked, none: an error, not a KeyError
    (a dense adapter's config has no target_parameters to compare with)."""
    path = moe_checkpoint(tmp_path / "base", "qwen3_moe")
    model = lora_model(path, EXPERTS_CONFIG)
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, EXPERTS_CONFIG, model.named_parameters(), out)
    attention_only = dataclasses.replace(EXPERTS_CONFIG, targets=("wq", "wv"))
    with pytest.raises(UsageError, match=r"target_parameters: adapter has \[.*expected \[\]"):
        check_peft_adapter(model.args, attention_only, out)


def test_expert_adapters_equal_the_merged_experts_on_both_paths_with_an_empty_expert():
    """W[e] + scale * B[e] A[e] never formed, yet the same output and gradients for x, the
    router's weights and every adapter as the reference on the merged weights; expert 3 gets
    no rows (its adapters' gradients zero)."""
    torch.manual_seed(0)
    n_tokens, dim, ffn, n_experts, k, r = 13, 32, 48, 5, 2, 4
    x = torch.randn(n_tokens, dim, requires_grad=True)
    experts = torch.stack([torch.randperm(n_experts - 1)[:k] for _ in range(n_tokens)])
    experts[experts == 3] = 4  # none chose expert 3
    weights = torch.rand(n_tokens, k, requires_grad=True)
    w1, w3, w2 = (
        torch.randn(n_experts, a, b) * 0.2 for a, b in ((ffn, dim), (ffn, dim), (dim, ffn))
    )
    shapes = [(n_experts, r, dim), (n_experts, ffn, r), (n_experts, ffn, r), (n_experts, r, ffn),
              (n_experts, dim, r)]  # fmt: skip
    factors = [(torch.randn(s) * 0.3).requires_grad_() for s in shapes]
    lora = ExpertLoRA(2.0, *factors)
    a13, b1, b3, a2, b2 = factors
    merged = (w1 + 2 * b1 @ a13, w3 + 2 * b3 @ a13, w2 + 2 * b2 @ a2)
    want = moe_experts_reference(x, experts, weights, *merged)
    want_grads = torch.autograd.grad(want.square().sum(), [x, weights, *factors])
    for run in (moe_experts_reference, moe_experts):
        y = run(x, experts, weights, w1, w3, w2, lora=lora)
        assert rel_err(y, want) <= FP32_RTOL
        grads = torch.autograd.grad(y.square().sum(), [x, weights, *factors])
        for grad, want_grad in zip(grads, want_grads, strict=True):
            assert rel_err(grad, want_grad) <= FP32_RTOL
        assert all(g[3].abs().max() == 0 for g in grads[2:]) and grads[2].abs().max() > 0


@pytest.mark.parametrize(
    "name, kernels, targets",
    [
        ("qwen3_moe", False, EXPERTS_CONFIG.targets),
        ("mixtral", True, EXPERTS_CONFIG.targets),
        ("gpt_oss", False, EXPERTS_CONFIG.targets),
        ("gpt_oss", True, EXPERTS_CONFIG.targets),
        ("qwen3_moe", True, ("experts_w13",)),
        ("mixtral", False, ("wo", "experts_w2")),
    ],
)
def test_expert_adapters_export_to_peft_with_equal_logits_and_gradients(
    tmp_path, name, kernels, targets
):
    """PEFT's model loads the exported adapter (target_parameters on its fused experts, one or
    both, nested) with our adapters and no others; logits and every adapter's gradient equal,
    the base experts frozen, without one; saved by PEFT and read back, the same adapters."""
    config = dataclasses.replace(EXPERTS_CONFIG, targets=targets)
    path = moe_checkpoint(tmp_path / "base", name)
    model = lora_model(path, config, ops=triton_ops() if kernels else REFERENCE_OPS)
    randomize_adapters(model)
    layer = model.layers[0].feed_forward
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable and all("_lora_" in n for n in trainable)  # frozen: gpt-oss's biases too
    out = tmp_path / "adapter"
    save_peft_adapter(model.args, config, model.named_parameters(), out, base_model=str(path))
    theirs = peft.PeftModel.from_pretrained(hf_model(path), out, is_trainable=True)
    their_params = {n.replace(".default", ""): p for n, p in theirs.named_parameters()}
    names = peft_names(model.args, config.targets)
    expert_names = peft_expert_names(model.args, config.targets)
    trained = sorted(n for n, p in their_params.items() if p.requires_grad)
    assert trained == sorted([*names.values(), *expert_names])
    assert_peft_logits_and_gradients(model, theirs, names)
    for peft_name, ours in expert_names.items():
        grads = [model.get_parameter(n).grad for n in ours]
        grad = to_peft_experts(peft_name, grads, [*ours.values()])
        assert rel_err(grad, their_params[peft_name].grad) <= FP32_RTOL, peft_name
    assert layer.w1.grad is None and layer.w2.grad is None

    theirs.save_pretrained(tmp_path / "peft")  # as PEFT writes it, read back: our adapters
    fresh = lora_model(path, config, seed=1)
    load_peft_adapter(fresh, config, tmp_path / "peft")
    assert all(torch.equal(t, adapters(fresh)[n]) for n, t in adapters(model).items())


def test_an_adapter_made_by_peft_as_the_gpt_oss_recipe_reads_back_with_peft_logits(tmp_path):
    """Hugging Face's gpt-oss recipe: target_modules "all-linear" (PEFT saves each attention
    projection's full name) and target_parameters on the experts; made and saved by PEFT with
    nonzero B, read here: PEFT's logits. The recipe's experts of some layers only
    ("1.mlp.experts.gate_up_proj") are refused in one line."""
    path = moe_checkpoint(tmp_path / "base", "gpt_oss")
    g = torch.Generator().manual_seed(3)
    for layers in ("", "1."):
        experts = [f"{layers}mlp.experts.gate_up_proj", f"{layers}mlp.experts.down_proj"]
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", target_parameters=experts
        )
        theirs = peft.get_peft_model(hf_model(path), config)
        with torch.no_grad():
            for p in theirs.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        theirs.save_pretrained(tmp_path / f"adapter{layers}")
        if not layers:
            tokens = tokens_for(lora_model(path))
            want = theirs(tokens).logits
    config = dataclasses.replace(
        EXPERTS_CONFIG, targets=("wq", "wk", "wv", "wo", *EXPERT_LORA_TARGETS)
    )
    ours = lora_model(path, config)
    settings = {"targets": config.targets, "rank": 4, "alpha": 8.0, "dropout": 0.0}
    assert peft_adapter_settings(ours.args, tmp_path / "adapter") == settings  # --lora-adapter's
    load_peft_adapter(ours, config, tmp_path / "adapter")
    assert rel_err(ours(tokens), want) <= FP32_RTOL
    refused = r"target_parameters: .* some layers only \(not on \['model.layers.0.mlp.experts"
    with pytest.raises(UsageError, match=refused + r".* reads no such adapter$"):
        load_peft_adapter(ours, config, tmp_path / "adapter1.")


def test_qlora_on_the_experts_keeps_them_in_nf4_and_equals_them_dequantized(tmp_path):
    """With --quantize-base nf4 the experts stay 4-bit and frozen, the adapters trained on
    them: logits and adapter gradients as the same adapters on the dequantized experts (PEFT
    has no NF4 experts on the CPU to compare with; the dequantized twin equals PEFT above).
    Merged into an HF checkpoint, transformers computes the same logits."""
    config = dataclasses.replace(EXPERTS_CONFIG, quantize_base="nf4")
    path = moe_checkpoint(tmp_path / "base", "qwen3_moe")
    quantized = lora_model(path, config, ops=triton_ops())
    layer = quantized.layers[0].feed_forward
    bound = 1 / quantized.args.dim**0.5  # PEFT's kaiming-uniform A, over an expert's dim inputs
    assert 0.5 * bound < layer.w13_lora_A.abs().max() <= bound and not layer.w1_lora_B.any()
    randomize_adapters(quantized)
    assert isinstance(layer, NF4MoE) and not hasattr(layer, "w1")
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == set(LORA_PARAMS)
    plain = dequantized_twin(quantized, path, EXPERTS_CONFIG)
    assert_same_logits_and_gradients(quantized, plain, tokens_for(quantized))

    named = merged_named_tensors(quantized, lambda p: p.detach())
    save_hf_checkpoint(quantized.args, named, tmp_path / "merged", dtype=torch.float32)
    tokens = tokens_for(quantized)
    with torch.no_grad():
        merged, logits = hf_model(tmp_path / "merged")(tokens).logits, quantized(tokens)
    assert rel_err(merged, logits) <= FP32_RTOL


def test_expert_targets_parse_from_peft_names_and_are_refused_where_they_adapt_nothing():
    both = parse_lora_targets("mlp.experts.down_proj,q_proj,experts_w13")
    assert both == ("wq", "experts_w13", "experts_w2")
    assert parse_lora_targets("all") == LORA_TARGETS  # the default adapts no expert
    assert parse_lora_targets("experts_w2, all") == (*LORA_TARGETS, "experts_w2")
    with pytest.raises(UsageError, match="dropout must be 0 with the experts' adapters"):
        LoRAConfig(rank=2, alpha=2.0, dropout=0.1, targets=("experts_w2",))
    experts = LoRAConfig(rank=2, alpha=2.0, targets=("wq", "experts_w2"))
    with torch.device("meta"):
        model = Llama(ModelArgs.from_name("llama3.2-1b"))
    with pytest.raises(UsageError, match="experts_w2 adapt an MoE .* llama has none"):
        apply_lora(model, experts, torch.float32)

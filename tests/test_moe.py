"""Mixture-of-experts blocks (moe.py) against transformers' Qwen3MoeForCausalLM and
MixtralForCausalLM on tiny checkpoints saved here: logits, the loss with and without the
load-balancing loss, every gradient (the router's too), and the export loaded back; the expert
computation on odd routings, a collapsed router; transformers 5's fused expert tensors; what is
refused; checkpointing and MLP tiling; a chat fine-tune through train.py, exported. The
experts' odd routings are tests/test_moe_kernels.py's; sharded training tests/test_shard.py's."""

import dataclasses
import json
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers
from test_tokenizers import QWEN_CONVERSATIONS, QWEN_TEMPLATES, qwen_dir

import offload
import options
import plan
import prepare
import train
from config_json import args_from_hf_config
from files import UsageError
from hf import (
    FusedRows,
    has_fused_experts,
    hf_names,
    hf_tensor_files,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from kernels import moe_experts_reference
from model import REFERENCE_OPS, Llama, ModelArgs, triton_ops
from moe import Routed, expert_counts, expert_load, load_balancing_loss

SIZES = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip
CONFIGS = {
    # Layer 1 dense (mlp_only_layers), the top-k weights as the router gives them.
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **(SIZES | kw), head_dim=8, intermediate_size=40, moe_intermediate_size=24,
        num_experts=5, mlp_only_layers=[1], norm_topk_prob=False,
    ),
    "qwen3_moe_sparse_step": lambda **kw: transformers.Qwen3MoeConfig(
        **(SIZES | kw), head_dim=8, intermediate_size=40, moe_intermediate_size=24,
        num_experts=5, decoder_sparse_step=2, norm_topk_prob=True,
    ),
    "mixtral": lambda **kw: transformers.MixtralConfig(
        **(SIZES | kw), intermediate_size=24, num_local_experts=5
    ),
}  # fmt: skip
FP32 = dict(rtol=1e-5, atol=1e-6)


def checkpoint(tmp_path, name: str, aux: bool, fused=False, router=0.2, **config):
    """transformers' model of CONFIGS[name], random weights (the router's of std `router`),
    saved as the hub stores it or, `fused`, as transformers 5 holds it (FusedRows)."""
    torch.manual_seed(0)
    config = CONFIGS[name](output_router_logits=aux, router_aux_loss_coef=0.05, **config)
    theirs = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # experts' weights are zeros until initialized by from_pretrained
        for n, p in theirs.named_parameters():
            p.normal_(0, router if n.endswith("mlp.gate.weight") else 0.2)
    theirs.save_pretrained(tmp_path / name, save_original_format=not fused)
    return theirs, tmp_path / name


def ours_from(path, ops=None) -> Llama:
    model = Llama(args_from_hf_config(path), *([ops] if ops else []))
    load_hf_checkpoint(model, path)
    return model


def their_grads(theirs, args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers' gradients by longtune's names: its modules hold the experts fused."""
    params = dict(theirs.named_parameters())
    grads = {}
    for ours, name in hf_names(args, fused_experts=True).items():
        if isinstance(name, FusedRows):
            grads[ours] = params[name.name].grad[:, name.rows]
        else:
            grads[ours] = params[name].grad
    return grads


def assert_same_as_transformers(ours: Llama, theirs, aux: bool) -> None:
    """Logits, the loss (with the aux term when `aux`), the aux term alone, every gradient."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (2, 11), generator=g)
    labels = torch.randint(0, 97, (2, 11), generator=g)
    labels[0, :3] = -100
    out = theirs(input_ids=tokens, labels=labels, output_router_logits=aux)
    # transformers shifts labels inside; longtune's labels are the next tokens already.
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    torch.testing.assert_close(ours(tokens), out.logits, **FP32)
    loss = ours(tokens, shifted)
    torch.testing.assert_close(loss, out.loss, **FP32)
    if aux:
        torch.testing.assert_close(load_balancing_loss(ours.routed()), out.aux_loss, **FP32)
    out.loss.backward()
    loss.backward()
    want = their_grads(theirs, ours.args)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, want[n], **FP32, msg=n)


@pytest.mark.parametrize("aux", [False, True], ids=["ce", "with_aux_loss"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_and_gradients_equal_transformers(tmp_path, name, aux):
    theirs, path = checkpoint(tmp_path, name, aux)
    ours = ours_from(path)
    args = ours.args
    assert args.router_aux_loss == aux and args.n_experts == 5
    expected_layers = {"qwen3_moe": (0, 2), "qwen3_moe_sparse_step": (1,), "mixtral": (0, 1, 2)}
    assert args.moe_layers == expected_layers[name]
    assert_same_as_transformers(ours, theirs, aux)
    if aux:  # not a negligible term
        assert load_balancing_loss(ours.routed()) * 0.05 > 1e-3


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_triton_experts_equal_transformers_too(tmp_path, name):
    """Ops.moe_experts by kernels/moe.py (sort, grouped products, combine; the interpreter
    here), with the other Triton kernels, the aux loss on."""
    theirs, path = checkpoint(tmp_path, name, aux=True)
    assert_same_as_transformers(ours_from(path, triton_ops()), theirs, aux=True)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_experts_take_the_router_weights_in_transformers_dtype(tmp_path, name):
    """In bf16, through Ops.moe_experts: Qwen3-MoE's top-k weights cast to the activations'
    dtype, Mixtral's kept in fp32, as their routers in transformers return them."""
    theirs, path = checkpoint(tmp_path, name, aux=False)
    seen = []

    def spy(x, experts, weights, w1, w3, w2, lora=None):
        seen.append((x.dtype, weights.dtype))
        return moe_experts_reference(x, experts, weights, w1, w3, w2, lora=lora)

    ours = ours_from(path, dataclasses.replace(REFERENCE_OPS, moe_experts=spy))
    ours.to(torch.bfloat16)(torch.randint(0, 97, (1, 7)))
    router = theirs.to(torch.bfloat16).model.layers[0].mlp.gate
    _, their_weights, _ = router(torch.randn(3, 32, dtype=torch.bfloat16))
    assert their_weights.dtype == {"qwen3_moe": torch.bfloat16, "mixtral": torch.float32}[name]
    assert seen == [(torch.bfloat16, their_weights.dtype)] * len(ours.args.moe_layers)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_collapsed_router_leaves_experts_empty_as_transformers_does(tmp_path, name, k):
    """A zero router: every probability 1/E, so every token goes to the same k experts
    (torch.topk's ties, broken alike in both) and the others are given none."""
    theirs, path = checkpoint(tmp_path, name, aux=True, router=0, num_experts_per_tok=k)
    ours = ours_from(path)
    assert_same_as_transformers(ours, theirs, aux=True)
    for routed in ours.routed():
        assert (routed.chosen == 0).sum() == 5 - k
    assert expert_load(ours.routed()).tolist() == [5 / k] * len(ours.args.moe_layers)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_transformers_5s_fused_experts_load_as_the_hubs_do(tmp_path, name):
    theirs, path = checkpoint(tmp_path, name, aux=False, fused=True)
    assert has_fused_experts(hf_tensor_files(path))
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours_from(path)(tokens), theirs(tokens).logits, **FP32)


@pytest.mark.parametrize("rows", [slice(1, 3), slice(5, 5)], ids=["two", "none"])
@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_a_ranks_experts_are_read_alone_from_either_layout(tmp_path, fused, rows):
    """shard.py's copy reads its rows of dim 0: of an expert tensor, its experts alone, or none
    (FSDP leaves the last ranks of a tensor with fewer rows than ranks nothing)."""
    _, path = checkpoint(tmp_path, "mixtral", aux=False, fused=fused)
    whole = ours_from(path)
    read = {}

    def some_experts(param, tensor_slice):
        if param.dim() == 3:
            read[param] = tensor_slice[rows]

    part = Llama(whole.args)
    load_hf_checkpoint(part, path, some_experts)
    params = dict(part.named_parameters())
    assert len(read) == 3 * len(whole.args.moe_layers)
    for n, p in whole.named_parameters():
        if p.dim() == 3:
            torch.testing.assert_close(read[params[n]], p.detach()[rows], rtol=0, atol=0)


def test_a_sum_loss_carries_the_aux_term_per_labelled_token(tmp_path):
    """train_step divides a "sum" loss by the step's labelled tokens: the aux term then counts
    as it does in transformers' mean loss."""
    _, path = checkpoint(tmp_path, "mixtral", aux=True)
    ours = ours_from(path)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = tokens.roll(-1, 1)
    labels[:, -3:] = -100
    mean, total = ours(tokens, labels), ours(tokens, labels, reduction="sum")
    torch.testing.assert_close(total / (labels != -100).sum(), mean, **FP32)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_export_loads_in_transformers_with_the_same_logits(tmp_path, name):
    _, path = checkpoint(tmp_path, name, aux=False)
    ours = ours_from(path)
    save_hf_checkpoint(ours.args, ours.named_parameters(), tmp_path / "out", torch.float32)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert (
        type(again).__name__
        == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[name]
    )
    tokens = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(tokens), again(tokens).logits, **FP32)
    assert args_from_hf_config(tmp_path / "out") == ours.args


def routed(experts: torch.Tensor, probs: torch.Tensor) -> Routed:
    return Routed(expert_counts(experts, probs.shape[-1]), probs.sum(dim=0), probs.shape[0])


def test_the_load_balancing_loss_is_k_for_an_even_router_and_counts_every_layer():
    """Even: f_e = k / E, P_e = 1 / E, so E * sum f_e P_e = k. Layers are counted together,
    not averaged: a collapsed layer and an even one give transformers' pooled value."""
    even = routed(torch.tensor([[0, 1], [2, 3]] * 4), torch.full((8, 4), 0.25))
    assert load_balancing_loss([even] * 3).item() == pytest.approx(2)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    collapsed = routed(torch.tensor([[0, 1]] * 8), probs)
    # f = (4 + 8, 4 + 8, 4, 4) / 16, P = (0.25 + 0.7, 0.25 + 0.1, ...) / 2
    pooled = 4 * (12 / 16 * 0.475 + 12 / 16 * 0.175 + 2 * 4 / 16 * 0.175)
    assert load_balancing_loss([even, collapsed]).item() == pytest.approx(pooled)


def test_the_expert_load_is_the_busiest_experts_share_against_the_mean():
    probs = torch.full((6, 3), 1 / 3)
    even = routed(torch.tensor([[0], [1], [2]] * 2), probs)
    one = routed(torch.zeros(6, 1, dtype=torch.int64), probs)
    skewed = routed(torch.tensor([[0], [0], [0], [0], [1], [2]]), probs)
    assert expert_load([even, one, skewed]).tolist() == pytest.approx([1, 3, 2])


def test_the_held_out_loss_is_the_cross_entropy_alone(tmp_path):
    """--eval-data's loss leaves out the load-balancing term training adds: at lr 0 (the weights
    unchanged) it is the same with the term weighed 0 and 1, where the training loss is not."""
    _, path = checkpoint(tmp_path, "mixtral", aux=True, vocab_size=300)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data, held_out = (
        prepare.prepare([stdlib / f"{name}.py"], tmp_path / name, workers=1)
        for name in ("textwrap", "shlex")
    )
    records = {}
    for coef in ("0", "1"):
        run_dir = tmp_path / f"run-{coef}"
        train.main(["--hf-checkpoint", str(path), "--data", str(data), "--eval-data",
                    str(held_out), "--eval-tokens", "128", "--eval-interval", "1",
                    "--seq-len", "64", "--batch-tokens", "128", "--lr", "0", "--max-steps", "1",
                    "--router-aux-loss-coef", coef, "--checkpoint-interval", "0",
                    "--sample-tokens", "0", "--run-dir", str(run_dir)])  # fmt: skip
        records[coef] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert records["1"]["loss"] > records["0"]["loss"] + 0.1
    assert records["1"]["eval_loss"] == pytest.approx(records["0"]["eval_loss"], rel=1e-6)


def test_a_negative_aux_loss_coefficient_is_refused(tmp_path):
    _, path = checkpoint(tmp_path, "mixtral", aux=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"router_aux_loss_coef": -0.01}))
    with pytest.raises(UsageError, match=r"router_aux_loss_coef -0\.01 must be >= 0$"):
        args_from_hf_config(path)


def test_other_moe_types_are_refused_in_one_line(tmp_path):
    config = {"model_type": "qwen2_moe", "hidden_size": 32, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UsageError, match="model_type is 'qwen2_moe'; .*qwen3_moe, mixtral, gemma3_text, gpt_oss$"
    ):
        args_from_hf_config(tmp_path)


@pytest.mark.parametrize(
    "ac,tile", [("full", 0), ("selective", 0), ("attention", 4), ("none", 4), ("full", 4)]
)
def test_checkpointing_and_mlp_tiling_route_as_one_forward(tmp_path, ac, tile):
    """A recomputed block routes its tokens again, and MLP tiling routes each tile apart: the
    loss with the aux term, every gradient (the router's too) and the metrics' figures equal
    the plain model's; tiles of 4 positions cut rows of 11 unevenly."""
    _, path = checkpoint(tmp_path, "qwen3_moe", aux=True)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 97, (2, 2, 11), generator=g)
    runs = []
    for techniques in [False, True]:
        model = ours_from(path)
        if techniques:
            offload.apply_ac(model, ac)
            offload.apply_mlp_tiling(model, tile)
        loss = model(tokens, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        runs.append((loss, model.routing, grads))
    (loss, routing, grads), (want_loss, want_routing, want_grads) = runs
    torch.testing.assert_close(loss, want_loss, **FP32)
    torch.testing.assert_close(routing, want_routing, **FP32)
    assert routing[1] > 1  # the experts' load is not even: a test of the counts
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, **FP32, msg=name)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_a_recompute_in_backward_records_no_routing(tmp_path, ac):
    """A checkpointed block's recompute routes again but records nothing once the model has
    read its forward's routing: a record's probabilities' sum would hold the recomputed graph
    up to the router (the block's attention activations) until the next forward."""
    _, path = checkpoint(tmp_path, "qwen3_moe", aux=True)
    model = ours_from(path)
    offload.apply_ac(model, ac)
    tokens, labels = torch.randint(0, 97, (2, 2, 11), generator=torch.Generator().manual_seed(1))
    model(tokens, labels).backward()
    assert [len(model.layers[i].feed_forward.routed) for i in model.args.moe_layers] == [1] * len(
        model.args.moe_layers
    )


def test_the_aux_loss_flag_sets_the_weight_and_is_for_moe_models_only():
    opts = options.Options(model="qwen3-30b-a3b", router_aux_loss_coef=0.01)
    args = options.model_args(opts)
    assert args.router_aux_loss and args.router_aux_loss_coef == 0.01
    off = options.model_args(dataclasses.replace(opts, router_aux_loss_coef=0))
    assert not off.router_aux_loss
    with pytest.raises(UsageError, match="^--router-aux-loss-coef is for mixture-of-experts"):
        options.model_args(options.Options(model="tiny", router_aux_loss_coef=0.01))


@pytest.mark.parametrize("aux", [False, True])
def test_the_aux_loss_flag_is_taken_over_a_hf_checkpoints_config(tmp_path, aux):
    """A checkpoint's output_router_logits and router_aux_loss_coef are a run's choice: the
    flag sets them without the checkpoint being refused as another model."""
    _, path = checkpoint(tmp_path, "qwen3_moe", aux)
    args = options.model_args(options.Options(hf_checkpoint=str(path), router_aux_loss_coef=0.01))
    model = Llama(args)
    load_hf_checkpoint(model, path)
    assert model.args.router_aux_loss and model.args.router_aux_loss_coef == 0.01


def test_the_presets_count_all_experts_and_train_the_active_ones():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (its model card's, rounded), within 2%."""
    args = ModelArgs.from_name("qwen3-30b-a3b")
    assert args.num_params() == pytest.approx(30.5e9, rel=0.01)
    active = args.training_flops(1, 0) / 6 + args.vocab_size * args.dim  # + the embedding
    assert active == pytest.approx(3.3e9, rel=0.02)
    assert args.num_params(active=True) == pytest.approx(active, rel=1e-4)  # + the norms


def test_a_chat_fine_tune_of_qwen3_moe_exports_what_transformers_reads(tmp_path, capsys):
    """Real use on the CPU: a Qwen3-MoE checkpoint beside a Qwen tokenizer.json and chat
    template, chat jsonl prepared with them, trained with the aux loss on and exported; the
    metrics log the aux loss and the experts' load, and transformers' loss on the export,
    loaded as the same class, equals longtune's on a conversation."""
    directory = qwen_dir(tmp_path, QWEN_TEMPLATES["qwen3"])
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    config = CONFIGS["qwen3_moe"](
        vocab_size=len(their_tokenizer), output_router_logits=True, router_aux_loss_coef=0.05
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in QWEN_CONVERSATIONS * 20))
    sft = prepare.prepare([chat], tmp_path / "sft", directory, workers=1)
    run_dir, export = tmp_path / "run", tmp_path / "export"
    train.main(["--hf-checkpoint", str(directory), "--data", str(sft), "--lr", "1e-2",
                "--seq-len", "64", "--batch-tokens", "256", "--max-steps", "3",
                "--run-dir", str(run_dir), "--export-hf", str(export)])  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["aux_loss"] > 0 and r["expert_load"] >= 1 for r in records)
    said = capsys.readouterr()
    assert "| aux loss " in said.out
    assert " active: 2 of 5 experts a token), " in said.out + said.err

    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    ids = their_tokenizer.apply_chat_template(QWEN_CONVERSATIONS[1], return_dict=False)
    tokens = torch.tensor([ids])
    shifted = torch.cat([tokens[:, 1:], torch.tensor([[-100]])], dim=1)
    ours = ours_from(export)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(tokens, shifted), theirs(tokens, labels=tokens).loss, **FP32
        )
    before = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert not torch.equal(
        theirs.model.layers[0].mlp.gate.weight, before.model.layers[0].mlp.gate.weight
    )


def test_the_planner_counts_qloras_experts_in_nf4():
    """Qwen3-30B-A3B's base under QLoRA: its experts (29B of its 30.5B parameters) in NF4 at
    ~0.52 byte a parameter (lora.NF4MoE), a whole layer's of them dequantized at once."""
    args = ModelArgs.from_name("qwen3-30b-a3b")
    lora = plan.LoRAConfig(rank=16, alpha=16.0, targets=("wq", "wk", "wv", "wo"))
    bf16 = plan.count_weights(args, lora, 2)
    nf4 = plan.count_weights(args, dataclasses.replace(lora, quantize_base="nf4"), 2)
    experts = 3 * args.n_experts * args.expert_ffn_dim * args.dim  # a layer's
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    quantized = args.n_layers * (experts + args.dim * (2 * q + 2 * kv))  # and the targets
    saved = bf16.frozen_bytes - nf4.frozen_bytes
    assert saved / quantized == pytest.approx(2 - 0.516, rel=0.01)
    assert nf4.dequantized == experts and bf16.dequantized == 0


def test_fp8_is_refused_where_every_linear_projection_is_in_4_bits_with_the_experts_too():
    """--lora-targets all,experts_w13,experts_w2 leaves no bf16 projection, as all does."""
    opts = options.Options(model="qwen3-30b-a3b", lora_rank=16, quantize_base="nf4", fp8=True,
                           lora_targets="all,experts_w13,experts_w2")  # fmt: skip
    with pytest.raises(UsageError, match="--fp8 multiplies the bf16 projections in e4m3"):
        options.check_options(opts, options.model_args(opts), 1, 1)

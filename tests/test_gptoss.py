"""gpt-oss (`gpt_oss`) against transformers' GptOssForCausalLM on tiny checkpoints saved here:
logits, loss and every gradient (the attention sinks' and every bias's) at rows several times
the window, with and without packed documents, with the reference ops and the Triton kernels;
that the sinks and the window matter; the export loaded back; MXFP4 experts dequantized as
transformers does; the preset's size."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from test_model import (
    FP32_RTOL,
    assert_same_logits_and_loss,
    random_positions,
    rel_err,
    sample_batch,
)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import plan
import prepare
import train
from config_json import args_from_hf_config
from files import UsageError
from hf import FusedRows, dequantize_mxfp4, hf_names, load_hf_checkpoint, save_hf_checkpoint
from model import PRESETS, REFERENCE_OPS, Llama, triton_ops
from moe import load_balancing_loss

WINDOW = 6  # sample_batch's rows are 40 tokens
CONFIG = dict(
    vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=5,
    num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
    router_aux_loss_coef=0.05,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 16},
)  # fmt: skip


def gpt_oss_checkpoint(path, **changes):
    """transformers' model, random weights: sinks of std 1 (so that they matter), the experts'
    gate and up large enough that the SwiGLU's clamps at +-7 cut some values."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**(CONFIG | changes))
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
            else:
                p.normal_(0, {"sinks": 1.0, "gate_up_proj": 0.8}.get(name.split(".")[-1], 0.2))
    hf.save_pretrained(path)
    return hf, path


def assert_same_logits_and_loss_by_document(ours: Llama, hf, positions) -> torch.Tensor:
    """test_model's assert_same_logits_and_loss, transformers running each packed document
    alone: its eager attention, gpt-oss's, masks no documents."""
    tokens, labels = sample_batch(ours.args.vocab_size)
    rows = []
    for row, row_positions in zip(tokens, positions, strict=True):
        starts = [*(row_positions == 0).nonzero().flatten().tolist(), len(row)]
        documents = zip(starts, starts[1:], strict=False)
        logits = [hf(row[None, a:b], use_cache=False).logits for a, b in documents]
        rows.append(torch.cat(logits, dim=1))
    hf_logits = torch.cat(rows)
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    hf_loss.backward()
    loss = ours(tokens, labels, positions)
    loss.backward()
    assert rel_err(ours(tokens, positions=positions), hf_logits) <= FP32_RTOL
    assert rel_err(loss, hf_loss) <= FP32_RTOL
    return loss


def their_grad(hf_params: dict, name) -> torch.Tensor:
    """transformers' gradient of the part `name` (hf_names') of one of its tensors, as ours is
    held; an expert no token chose has none there, zeros here."""
    tensor_name = name.name if isinstance(name, FusedRows) else name
    param = hf_params[tensor_name]
    grad = torch.zeros_like(param) if param.grad is None else param.grad
    if not isinstance(name, FusedRows):
        return grad
    return grad[..., name.rows].transpose(1, 2) if name.transposed else grad[:, name.rows]


def assert_same_gradients(ours: Llama, hf) -> None:
    hf_params = dict(hf.named_parameters())
    names = hf_names(ours.args)
    assert {n.name if isinstance(n, FusedRows) else n for n in names.values()} == set(hf_params)
    for name, theirs in names.items():
        grad = ours.get_parameter(name).grad
        expected = their_grad(hf_params, theirs)
        if name.endswith("wk.bias"):  # nearly cancels (test_model.assert_same_gradients)
            scale = hf_params[theirs.replace("bias", "weight")].grad.abs().max()
            assert (grad - expected).abs().max() <= FP32_RTOL * scale, name
        elif expected.abs().max() > 0:
            assert rel_err(grad, expected) <= FP32_RTOL, name
        else:
            assert torch.equal(grad, expected), name


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed-documents"])
def test_gpt_oss_matches_transformers_past_its_window(tmp_path, packed):
    """Rows of 40 tokens, window 6 on layers 0 and 2: logits, loss and every gradient equal
    GptOssForCausalLM's (fp32, 1e-5), with packed documents too; the load-balancing loss too.
    Without the sinks, or without the window, the loss differs; the export loads back as
    GptOssForCausalLM with the same logits."""
    hf, path = gpt_oss_checkpoint(tmp_path / "in")
    args = args_from_hf_config(path)
    assert (args.family, args.sliding_window, args.window_layers) == ("gpt_oss", WINDOW, (0, 2))
    assert args.rope_scaling.rope_type == "yarn" and args.rope_scaling.truncate is False
    ours = Llama(args, document_mask=packed)
    load_hf_checkpoint(ours, path)
    assert sum(p.numel() for p in ours.parameters()) == args.num_params()
    tokens, labels = sample_batch(args.vocab_size)
    positions = None
    if packed:  # documents crossing the window's edge, a different split in each row
        positions = random_positions([[15, 25], [3, 30, 7]])
        loss = assert_same_logits_and_loss_by_document(ours, hf, positions)
    else:
        loss = assert_same_logits_and_loss(ours, hf)
        out = hf(tokens, output_router_logits=True, use_cache=False)
        ours(tokens, labels)
        assert rel_err(load_balancing_loss(ours.routed()), out.aux_loss) <= FP32_RTOL
    assert_same_gradients(ours, hf)

    state = ours.state_dict()
    with torch.no_grad():  # a sink of -inf adds nothing to the denominator: plain softmax
        for block in ours.layers:
            block.attention.sinks.fill_(-torch.inf)
    assert rel_err(ours(tokens, labels, positions), loss) > 1e-4
    ours.load_state_dict(state)
    unwindowed = dataclasses.replace(args, sliding_window=None, window_layers=())
    causal = Llama(unwindowed, document_mask=packed)
    causal.load_state_dict(state)
    assert rel_err(causal(tokens, labels, positions), loss) > 1e-4

    save_hf_checkpoint(args, ours.named_parameters(), tmp_path / "out", dtype=torch.float32)
    assert args_from_hf_config(tmp_path / "out") == args
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported) is type(hf)
    assert rel_err(exported(tokens, use_cache=False).logits, ours(tokens)) <= FP32_RTOL


def test_gpt_oss_through_the_triton_kernels_matches_transformers(tmp_path):
    """The experts' biases and clamped SwiGLU through kernels/moe.py's sorted rows (the
    interpreter here), with the other Triton kernels."""
    hf, path = gpt_oss_checkpoint(tmp_path)
    ours = Llama(args_from_hf_config(path), triton_ops())
    load_hf_checkpoint(ours, path)
    tokens, labels = (t[:1, :20] for t in sample_batch(ours.args.vocab_size))  # 3 windows
    hf_loss = F.cross_entropy(hf(tokens, use_cache=False).logits[0], labels[0])
    hf_loss.backward()
    loss = ours(tokens, labels)
    loss.backward()
    assert rel_err(loss, hf_loss) <= FP32_RTOL
    assert_same_gradients(ours, hf)


def test_gpt_oss_trains_through_train_py_and_exports_what_transformers_reads(tmp_path):
    """Two steps of train.py from a tiny gpt-oss checkpoint on byte-tokenized text, rows of 32
    past the window of 6: the export loads as GptOssForCausalLM, trained (the sinks moved),
    with longtune's logits."""
    hf, path = gpt_oss_checkpoint(tmp_path / "hf", vocab_size=320)
    data = prepare.prepare([Path(json.__file__)], tmp_path / "data", workers=1)
    export = tmp_path / "export"
    train.main(["--hf-checkpoint", str(path), "--data", str(data), "--lr", "1e-2",
                "--seq-len", "32", "--batch-tokens", "128", "--max-steps", "2",
                "--run-dir", str(tmp_path / "run"), "--export-hf", str(export)])  # fmt: skip
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(theirs).__name__ == "GptOssForCausalLM"
    sinks = theirs.model.layers[0].self_attn.sinks
    assert not torch.equal(sinks, hf.model.layers[0].self_attn.sinks)
    ours = Llama(args_from_hf_config(export))
    load_hf_checkpoint(ours, export)
    tokens, _ = sample_batch(320)
    with torch.no_grad():
        assert rel_err(theirs(tokens, use_cache=False).logits, ours(tokens)) <= FP32_RTOL


def test_mxfp4_dequantizes_as_transformers_does():
    """Random blocks and scales, every code and a range of exponents: the hub's [E, out, G, 16]
    give [E, out, in], which transformers returns transposed, bit for bit in bf16."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == (3, 10, 128) and ours.dtype == torch.bfloat16
    assert torch.equal(ours.transpose(1, 2), theirs)


def mxfp4_copy(path: Path, out: Path) -> dict[str, torch.Tensor]:
    """The checkpoint at `path` with random MXFP4 experts (as the hub's gpt-oss) written to
    `out`; returns `path`'s tensors with those experts as transformers dequantizes them."""
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    quantized = dict(tensors)
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        n_experts, k, rows = tensors[name].shape  # transformers' [E, in, out]
        n_blocks = -(-k // 32)  # a row's last block padded where 32 does not divide k
        blocks = torch.randint(0, 256, (n_experts, rows, n_blocks, 16), generator=g).byte()
        scales = torch.randint(122, 130, (n_experts, rows, n_blocks), generator=g).byte()
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del quantized[name]
        quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
    out.mkdir()
    safetensors.torch.save_file(quantized, out / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    return tensors


def test_mxfp4_experts_load_and_export_in_bf16(tmp_path):
    """A checkpoint with MXFP4 experts (quantization_config mxfp4, as the hub's gpt-oss) loads
    as the same checkpoint with the experts transformers' dequantization gives; the export is
    bf16 and has no quantization_config."""
    _, path = gpt_oss_checkpoint(tmp_path / "plain")
    mxfp4 = tmp_path / "mxfp4"
    safetensors.torch.save_file(mxfp4_copy(path, mxfp4), path / "model.safetensors")

    args = args_from_hf_config(mxfp4)
    plain, ours = Llama(args), Llama(args)
    load_hf_checkpoint(plain, path)
    load_hf_checkpoint(ours, mxfp4)
    for (name, p), q in zip(ours.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    save_hf_checkpoint(args, ours.named_parameters(), tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in exported and exported["torch_dtype"] == "bfloat16"
    back = Llama(args_from_hf_config(tmp_path / "out"))
    load_hf_checkpoint(back, tmp_path / "out")
    for (name, p), q in zip(back.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(p, q.to(torch.bfloat16).float()), name


def test_mxfp4_experts_whose_rows_are_no_whole_blocks_are_refused_naming_them(tmp_path):
    """Rows of 48 in blocks of 32 (two blocks a row in the file, the last padded): before, a
    RuntimeError with a traceback at the copy, after the model was built. One problem: the
    blocks' shape is not said again."""
    _, path = gpt_oss_checkpoint(tmp_path / "plain", intermediate_size=48)
    mxfp4_copy(path, tmp_path / "mxfp4")
    message = "down_proj_blocks: MXFP4 holds rows in blocks of 32 values, the model's are 48 long"
    with pytest.raises(UsageError, match=re.escape(message)) as refused:
        load_hf_checkpoint(Llama(args_from_hf_config(tmp_path / "mxfp4")), tmp_path / "mxfp4")
    assert "checkpoint shape" not in str(refused.value)


# openai/gpt-oss-20b's config.json on the hub, as transformers 4.55 wrote it (rope_scaling and
# rope_theta), its experts in MXFP4; the keys transformers does not read left out.
HUB_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False,
    "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}  # fmt: skip


def test_gpt_oss_20b_preset_is_the_hubs_config_with_the_published_sizes(tmp_path):
    """The preset is what its config.json reads as; its model card's 20.9B parameters, 3.6B
    active (which count the output's matrix, not the embedding's)."""
    args = PRESETS["gpt-oss-20b"]
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIG))
    assert args_from_hf_config(tmp_path) == args
    with torch.device("meta"):  # the planner's count is the modules' (biases, sinks too)
        assert sum(p.numel() for p in Llama(args).parameters()) == args.num_params()
    assert plan.count_weights(args, None, 2).trained == args.num_params()
    assert round(args.num_params() / 1e9, 1) == 20.9
    assert round((args.num_params(active=True) - args.vocab_size * args.dim) / 1e9, 1) == 3.6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", [False, True], ids=["reference-ops", "triton-ops"])
def test_sinks_through_flex_attention_on_gpu_match_the_dense_path(kernels):
    """On CUDA the sinks rescale FlexAttention's output by the logsumexp it returns (compiled,
    fp32 here), packed documents and a 128-token window on layer 0, the experts through the
    Triton kernels or the reference: the loss and every gradient (the sinks' included) those
    of the CPU's dense path (loss within 1e-4, each gradient within 1e-3 of its largest)."""
    args = dataclasses.replace(
        PRESETS["gpt-oss-20b"], dim=256, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000,
        ffn_dim=128, expert_ffn_dim=128, n_experts=4, experts_per_token=2, window_layers=(0,),
        moe_layers=(0, 1),
    )  # fmt: skip
    on_cpu = Llama(args, document_mask=True)
    on_cpu.init_weights(seed=0)
    with torch.no_grad():  # sinks that matter
        for block in on_cpu.layers:
            block.attention.sinks.normal_(0, 1)
    on_gpu = Llama(args, triton_ops() if kernels else REFERENCE_OPS, document_mask=True).cuda()
    on_gpu.load_state_dict(on_cpu.state_dict())
    tokens, labels = sample_batch(args.vocab_size, bsz=2, seq_len=1024)
    positions = torch.cat([torch.arange(300), torch.arange(724)]).expand(2, 1024)
    dense = on_cpu(tokens, labels, positions)
    dense.backward()
    flex = on_gpu(tokens.cuda(), labels.cuda(), positions.cuda())
    flex.backward()
    assert abs(flex.item() - dense.item()) <= 1e-4 * dense.item()
    for (name, p), q in zip(on_gpu.named_parameters(), on_cpu.parameters(), strict=True):
        assert rel_err(p.grad.cpu(), q.grad) <= 1e-3, name


@pytest.mark.parametrize(
    "change, message",
    [
        ({"swiglu_limit": 10.0}, "swiglu_limit is 10.0, expected 7.0"),
        ({"attention_bias": False}, "attention_bias is False, expected True"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}},
         "quantization_config's quant_method is 'bitsandbytes': longtune reads gpt-oss's mxfp4"),
        ({"model_type": "mixtral", "attention_bias": False, "sliding_window": None},
         "quantization_config's quant_method is 'mxfp4': longtune reads gpt-oss's mxfp4"),
    ],
)  # fmt: skip
def test_what_longtune_does_not_compute_is_refused_in_one_line(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIG | change))
    with pytest.raises(UsageError, match=re.escape(message)):
        args_from_hf_config(tmp_path)

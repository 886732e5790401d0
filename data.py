"""What a user gives and gets back as files, and the batches a training run reads from them.

In order: tokenizers (and a Hugging Face checkpoint's tokenizer files); `prepare` (text and
JSONL files into a dataset directory); the packed, resumable loader; the default corpus; opening
a run's data. It imports of longtune's only files.py's rules and kernels' IGNORE_INDEX.

A prepared dataset is a directory of three files:
    tokens.bin     uint32, documents back to back, each BOS (if there is one) + tokens + EOS
    loss_mask.bin  uint8, one per token: bit 0 (LABEL) where the token may be a label (not in an
                   SFT prompt, nor a document's first token); bit 1 (BOS_INSIDE) on a BOS inside a
                   document (a chat template's before each exchange, as Llama 2's); bit 2
                   (STARTS_DOCUMENT) on a document's first token where no BOS marks it
    meta.json      the tokenizer that wrote it, the counts the files must match, and "sft": true
                   when prompts are unlabelled, so training keeps packed documents apart by default

    python data.py prepare --input docs/ chat.jsonl --output data/mine [--tokenizer DIR_OR_FILE]
"""

import argparse
import base64
import binascii
import gc
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import sysconfig
import threading
import time
import typing
import unicodedata
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain, groupby
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
import sentencepiece
import tiktoken
import torch
import torch.distributed as dist
from jinja2.sandbox import ImmutableSandboxedEnvironment

from files import NO_SPACE, OutputDir, UsageError, no_space, read_json
from kernels import IGNORE_INDEX

FORMAT_VERSION = 1
LABEL, BOS_INSIDE, STARTS_DOCUMENT = 1, 2, 4  # the bits of loss_mask.bin

# ---------------------------------------------------------------------------------------------
# Tokenizers


# {"role": "system" | "user" | "assistant", "content": ...} and any other fields the data gives
# (Qwen3's "reasoning_content"), which a chat template reads as transformers passes them.
Message = dict[str, object]
# A rendered conversation as runs of token ids, each with whether its tokens are labels.
Segments = list[tuple[list[int], bool]]


def _check_role_and_content_only(messages: list[Message], chat_format: str) -> None:
    """A built-in chat format renders role and content only: another field ("tool_calls") is
    refused, not dropped from training, unless null or empty (a table as JSONL has every key)."""
    for i, message in enumerate(messages):
        for key, value in message.items():
            if key not in ("role", "content") and value not in (None, "", [], {}):
                raise UsageError(
                    f"messages[{i}].{key}: {chat_format} renders a message's role and "
                    f"content only; remove the field, or give a tokenizer whose chat template "
                    f"renders it"
                )


class Tokenizer:
    """What preparation and training need from a tokenizer. `encode` adds no BOS or EOS, and a
    special token's name in its text stays text: data cannot inject structure it should not.
    `render_chat` renders a conversation `_check_messages` accepted from its BOS on, labelling
    the assistant turns' content and end-of-turn token; `chat_prompt`, one ending in a user
    turn, then the generation prompt. Here both render a built-in chat format, from what a
    subclass gives: `_header(role)` (a turn's opening ids), `_end_of_turn` (the id closing
    it) and, for `hf_files`, `_ranks`, `_specials`, `_pattern` and `_pad`."""

    name: str  # identifies the tokenizer and its file, recorded in meta.json
    vocab_size: int
    bos_id: int | None  # None: the tokenizer has none (Qwen's), and documents start without one
    eos_id: int
    pad_id: int | None  # a token meant for padding only, if the tokenizer has one
    _chat_format: str  # the built-in chat format's name, for errors
    _strip = False  # whether a turn's content is stripped of surrounding whitespace

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def hf_files(self) -> dict[str, bytes]:
        """The same tokenizer as files AutoTokenizer loads (name -> contents), adding BOS at each
        document's start as training saw it."""
        return byte_level_bpe_files(self._ranks, self._specials, self._pattern, self._pad)

    def render_chat(self, messages: list[Message]) -> Segments:
        _check_role_and_content_only(messages, self._chat_format)
        segments = [([self.bos_id], False)]
        for message in messages:
            role, content = message["role"], message["content"]
            content = content.strip() if self._strip else content
            segments.append((self._header(role), False))
            segments.append(([*self.encode(content), self._end_of_turn], role == "assistant"))
        return segments

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        return [*_ids(self.render_chat(messages)), *self._header("assistant")]


class ByteTokenizer(Tokenizer):
    """Bytes 0..255, then BOS and EOS: with no other specials, a turn's header is "<|role|>\\n"."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    pad_id = None
    _chat_format = "the bytes tokenizer's chat format"
    _end_of_turn = eos_id
    _ranks = {bytes([b]): b for b in range(256)}
    _specials = {"<bos>": bos_id, "<eos>": eos_id}
    _pattern = None
    _pad = "<eos>"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def _header(self, role: str) -> list[int]:
        return self.encode(f"<|{role}|>\n")


# The pre-tokenizer split of Meta's Llama 3 tokenizer.py.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3.1's 256 special tokens in id order, numbered after the BPE ranks (from 128000 in
# Meta's file). Llama 3.0 named fewer of them; the ids of those it shares are the same.
_LLAMA3_NAMED = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIALS = _LLAMA3_NAMED + [
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(_LLAMA3_NAMED))
]


class TiktokenTokenizer(Tokenizer):
    """Llama 3: a tiktoken BPE ranks file ("base64-token rank" per line) plus 256 specials.
    Conversations render in Meta's chat format, content stripped as Meta's ChatFormat does."""

    _chat_format = "Llama 3's chat format"
    _strip = True
    _pattern = LLAMA3_PATTERN
    _pad = "<|finetune_right_pad_id|>"

    def __init__(self, path: Path):
        data = path.read_bytes()
        ranks: dict[bytes, int] = {}
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line:
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as e:
                raise UsageError(f"{path} line {lineno}: expected 'base64-token rank'") from e
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise UsageError(f"{path}: the BPE ranks must be 0..{n - 1}, each once")
        if missing := [b for b in range(256) if bytes([b]) not in ranks]:
            raise UsageError(
                f"{path}: no rank for {len(missing)} of the 256 single bytes (the first: "
                f"{missing[0]}); a BPE ranks file ranks every byte (a truncated file?)"
            )
        specials = {token: n + i for i, token in enumerate(LLAMA3_SPECIALS)}
        self.name = f"tiktoken:{_sha256(data)}"
        self._ranks, self._specials = ranks, specials
        self.vocab_size = n + len(specials)
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]
        self._end_of_turn = specials["<|eot_id|>"]
        self.pad_id = specials[self._pad]
        self._encoding = tiktoken.Encoding(
            self.name, pat_str=self._pattern, mergeable_ranks=ranks, special_tokens=specials
        )

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    def _header(self, role: str) -> list[int]:
        start, end = self._specials["<|start_header_id|>"], self._specials["<|end_header_id|>"]
        return [start, *self.encode(role), end, *self.encode("\n\n")]


class _TemplateTokenizer(Tokenizer):
    """Conversations render with `chat_template` (None: `_without_template`), tokenized as
    apply_chat_template(tokenize=True) does (`_encode_rendered`: ids and each one's bytes), the
    special tokens it writes as tokens; labels: the tokens of `ChatTemplate.assistant_spans`."""

    def use_chat_template(self, path: Path | None) -> None:
        """Renders and exports conversations with the Jinja file `path` (None: the directory's)."""
        self.chat_template = _find_chat_template(self._path.parent, path, self._template_tokens)

    def render_chat(self, messages: list[Message]) -> Segments:
        if self.chat_template is None:
            return self._without_template(messages)
        text, spans = self.chat_template.assistant_spans(messages, self._specials_pattern)
        ids, lengths = self._encode_rendered(text)
        spans = [tuple(self._bytes_before(text, i) for i in span) for span in spans]
        return _labelled_runs(ids, lengths, spans, self.bos_id)

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        if self.chat_template is None:
            return _ids(self._without_template(messages))
        ids = self._encode_rendered(self.chat_template.render(messages, True))[0].tolist()
        return ids if self.bos_id is None or ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def _bytes_before(self, text: str, i: int) -> int:
        """Where character i of `text` falls in the bytes of its tokens."""
        return len(text[:i].encode("utf-8", "surrogatepass"))


# transformers' LlamaTokenizer (legacy=False) reads a tokenizer.model without its normalizer:
# "▁" only before the input's start, if it has no space (Metaspace "first"). This NormalizerSpec
# appended to the proto does the same (fields 2-4: no char map, no dummy prefix, spaces kept).
_SP_AS_TRANSFORMERS = b"\x1a\x06\x12\x00\x18\x00\x20\x00"


class SentencePieceTokenizer(_TemplateTokenizer):
    """A sentencepiece model proto (Llama 2's, Mistral's; RuntimeError if it is not one). The
    special tokens a chat template writes are its control pieces (BOS, EOS, Mistral's [INST])."""

    def __init__(self, path: Path, chat_template: Path | None = None):
        data = path.read_bytes()
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        self._encoder = sentencepiece.SentencePieceProcessor(model_proto=data + _SP_AS_TRANSFORMERS)
        self._proto, self._path = data, path
        self.name = f"sentencepiece:{_sha256(data)}"
        self.vocab_size = self._sp.vocab_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        if self.bos_id < 0 or self.eos_id < 0:
            raise UsageError(
                f"{path}: the sentencepiece model needs BOS and EOS pieces, "
                f"has bos_id={self.bos_id} eos_id={self.eos_id}"
            )
        pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        self._specials = {
            p: i for i, p in enumerate(pieces) if self._sp.is_control(i) or self._sp.is_unknown(i)
        }
        self._specials_pattern = _alternatives(self._specials)
        tokens, _ = _hf_special_tokens(path.parent, {p: i for i, p in enumerate(pieces)})
        self._template_tokens = {"bos_token": pieces[self.bos_id]} | tokens
        self._template_tokens.setdefault("eos_token", pieces[self.eos_id])
        self.use_chat_template(chat_template)

    def encode(self, text: str) -> list[int]:
        if text and not text.startswith((" ", "▁")):
            text = " " + text  # the "▁" transformers prefixes
        return self._encoder.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def _encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        # Only the text at the template's very start gets the "▁" prefix.
        parts = self._specials_pattern.split(text) if self._specials_pattern else [text]
        ids, lengths = [], []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self._specials[part])
                lengths.append(len(part.encode()))
                continue
            prefix = " " if k == 0 and part and not part.startswith((" ", "▁")) else ""
            pieces = self._encoder.encode(prefix + part, out_type=str)  # an unknown: its text
            part_ids = self._encoder.piece_to_id(pieces)
            ids += part_ids
            for i, p in zip(part_ids, pieces, strict=True):
                lengths.append(1 if self._sp.is_byte(i) else len(p.replace("▁", " ").encode()))
            if prefix:  # no byte of the text
                lengths[len(lengths) - len(pieces)] -= 1
        return np.array(ids, dtype=np.int64), np.array(lengths, dtype=np.int64)

    def _without_template(self, messages: list[Message]) -> Segments:
        """Meta's Llama 2 chat format, but Meta starts every exchange with BOS and here only the
        first does: a BOS starts a new document for the loader. The answer is encoded on its own
        (its leading "▁" stands for the space after [/INST]), so labels start at a token."""
        _check_role_and_content_only(messages, "Llama 2's chat format")
        if "[INST]" in self._specials:
            raise UsageError(
                f"{self._path} has [INST] as a control token (Mistral's), which Llama 2's chat "
                f"format writes as text: give the chat template it was trained with (its "
                f"checkpoint directory's, or --chat-template FILE)"
            )
        system = messages[0]["content"].strip() if messages[0]["role"] == "system" else None
        segments = [([self.bos_id], False)]
        for message in messages[1:] if system is not None else messages:
            content = message["content"].strip()
            if message["role"] == "assistant":
                segments.append(([*self.encode(content), self.eos_id], True))
                continue
            if system is not None:
                content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
                system = None
            segments.append((self.encode(f"[INST] {content} [/INST]"), False))
        return segments

    def hf_files(self) -> dict[str, bytes]:
        # transformers builds its LlamaTokenizer from the sentencepiece model itself.
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": self._sp.id_to_piece(self.bos_id),
            "eos_token": self._sp.id_to_piece(self.eos_id),
            "pad_token": self._sp.id_to_piece(self.eos_id if self.pad_id is None else self.pad_id),
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self._sp.unk_id() >= 0:
            config["unk_token"] = self._sp.id_to_piece(self._sp.unk_id())
        files = {"tokenizer.model": self._proto, "tokenizer_config.json": _json_bytes(config)}
        if self.chat_template is not None:
            _set_chat_template(files, self.chat_template.source.encode())
        return files


# ---- Hugging Face tokenizer.json: a byte-level BPE, encoded by tiktoken

# GPT-2's split: the regex of HF's ByteLevel pre-tokenizer with use_regex.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# GPT-2's split after HF's Digits pre-tokenizer has cut every digit (or run of digits) into a
# piece of its own: no other piece holds a digit, so " ?\p{N}+" never matches, and a whitespace
# run before a digit ends its piece as it would end the text ("(?!\S)" sees the piece's end).
GPT2_AFTER_DIGITS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"


class ByteLevelBPETokenizer(_TemplateTokenizer):
    """A HF tokenizer.json of a byte-level BPE (Llama 3's, Qwen's), encoded by tiktoken without
    `tokenizers`, its special tokens and chat template from the files beside it. tiktoken
    merges first the adjacent pair whose joined bytes rank lowest, HF's BPE the pair listed
    first in `merges`: so a merged token ranks by the first merge making it, after the single
    bytes (whose ranks never matter). Where the file's ids already rise in that order (any file
    `tokenizers` trained) they are the ranks, else a table maps ranks to ids. What this cannot
    encode as `tokenizers` does is refused, never approximated."""

    def __init__(self, path: Path, chat_template: Path | None = None):
        data = path.read_bytes()
        # GC off until the 100k+ merges are freed: the passes they set off outlast the parse itself.
        with _gc_paused():
            try:
                spec = json.loads(data)
            except ValueError as e:
                raise UsageError(f"{path}: not valid JSON ({e})") from e
            _check_byte_level_bpe(path, spec)
            vocab: dict[str, int] = spec["model"]["vocab"]
            made = _merged_tokens(path, spec["model"].pop("merges"), vocab)
        self._nfc = (spec.get("normalizer") or {}).get("type") == "NFC"
        pattern = _split_pattern(path, spec.get("pre_tokenizer"))
        added = {}
        for token in spec.get("added_tokens") or []:
            flags = [f for f in ("lstrip", "rstrip", "single_word") if token.get(f)]
            if flags:
                raise UsageError(
                    f"{path}: added token {token['content']!r} sets {', '.join(flags)}, which "
                    f"longtune does not reproduce"
                )
            added[token["content"]] = token["id"]
        _check_ids(path, vocab, added)
        self.vocab_size = 1 + max([*vocab.values(), *added.values()])
        alphabet = _bytes_as_text()
        # A vocabulary may lack bytes its training text never held (21 in SmolLM2's): `tokenizers`
        # drops them from the text; here they get ids past the vocabulary, which encoding drops.
        single = {bytes([b]): vocab.get(c, self.vocab_size + b) for b, c in alphabet.items()}
        merged = dict(zip(_byte_level_bytes(path, made), [vocab[t] for t in made], strict=True))
        if np.all(np.diff(list(merged.values())) > 0):
            ranks, specials, self._table = {**single, **merged}, added, None
        else:
            ranks = {token: rank for rank, token in enumerate([*single, *merged])}
            specials = {token: len(ranks) + i for i, token in enumerate(added)}
            table = [*single.values(), *merged.values(), *added.values()]
            self._table = np.array(table, dtype=np.int64)
        # Each id's bytes, for decoding and for finding which tokens hold an assistant's text.
        self._bytes = [b""] * self.vocab_size
        for token, i in [*single.items(), *merged.items()]:
            if i < self.vocab_size:
                self._bytes[i] = token
        for token, i in added.items():
            self._bytes[i] = token.encode()
        self._lengths = np.array([len(b) for b in self._bytes], dtype=np.int64)
        # Added tokens that are not special (DeepSeek-R1's "<think>") are vocabulary, matched in
        # any text as `tokenizers` does; special ones only where a chat template writes them.
        special = {t["content"] for t in spec.get("added_tokens") or [] if t.get("special")}
        self._plain_added = set(added) - special
        # The added tokens: where text is cut before it is normalized, and where a turn ends.
        self._specials_pattern = _alternatives(added)
        self._plain_added_pattern = _alternatives(self._plain_added)
        self._special_ranks = specials
        self.name = f"tokenizer.json:{_sha256(data)}"
        self._encoding = tiktoken.Encoding(
            self.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        _check_no_empty_match(path, self._encoding)
        self._path, self._data = path, data
        tokens, special_ids = _hf_special_tokens(path.parent, added | vocab)
        self.bos_id, self.eos_id, self.pad_id = special_ids
        if self.eos_id is None:
            raise UsageError(
                f"{path.parent}: no EOS token in tokenizer_config.json, config.json or "
                f"generation_config.json; longtune ends each document with EOS"
            )
        for name, i in [("BOS", self.bos_id), ("EOS", self.eos_id)]:
            if i is not None and not (isinstance(i, int) and 0 <= i < self.vocab_size):
                raise UsageError(
                    f"{path.parent}: the {name} id {i!r} is not in the vocabulary of "
                    f"{self.vocab_size} ids"
                )
        self._template_tokens = tokens
        self.use_chat_template(chat_template)

    def encode(self, text: str) -> list[int]:
        return self._encode(text, allowed_special=self._plain_added).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def hf_files(self) -> dict[str, bytes]:
        """The files read, but tokenizer_config.json names BOS and EOS, and the template
        rendered with is the only copy (so a --chat-template given to `prepare` is exported)."""
        files = {"tokenizer.json": self._data}
        for name in HF_TOKENIZER_FILES:
            if name not in TOKENIZER_FILES and (self._path.parent / name).is_file():
                files[name] = (self._path.parent / name).read_bytes()
        config = json.loads(files.get("tokenizer_config.json", b"{}"))
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for key, i in [("bos_token", self.bos_id), ("eos_token", self.eos_id)]:
            config.setdefault(key, None if i is None else self._bytes[i].decode())
        files["tokenizer_config.json"] = _json_bytes(config)
        if self.chat_template is not None:
            _set_chat_template(files, self.chat_template.source.encode())
        return files

    def _encode(self, text: str, allowed_special: set[str] | str) -> np.ndarray:
        """Added tokens in `allowed_special` ("all": all) are tokens, others text. As an array,
        the table and the drop below are one numpy operation each, and no token is a Python int."""
        try:
            if self._nfc:
                # Each piece on its own: rejoined, a normalized text could spell an added token
                # that was not there (NFC makes ";" of U+037E), which `tokenizers` never finds.
                pieces = self._pieces(text, allowed_special)
                ids = np.concatenate(
                    [
                        self._encoding.encode_to_numpy(piece, disallowed_special=())
                        if k % 2 == 0
                        else np.array([self._special_ranks[piece]], dtype=np.uint32)
                        for k, piece in enumerate(pieces)
                    ]
                )
            else:
                ids = self._encoding.encode_to_numpy(
                    text, allowed_special=allowed_special, disallowed_special=()
                )
        except UnicodeEncodeError:
            # Lone surrogates cannot reach tiktoken's Rust (a chat prompt given in code may
            # hold them; data has them replaced when read).
            return self._encode(_without_lone_surrogates(text), allowed_special)
        if self._table is not None:
            ids = self._table[ids]
        return ids[ids < self.vocab_size]  # bytes the vocabulary lacks

    def _pieces(self, text: str, allowed_special: set[str] | str) -> list[str]:
        """Cut at `_encode`'s added tokens (text, token, ..., text), texts then NFC-normalized."""
        pattern = self._specials_pattern if allowed_special == "all" else self._plain_added_pattern
        pieces = pattern.split(text) if pattern else [text]
        pieces[::2] = [unicodedata.normalize("NFC", piece) for piece in pieces[::2]]
        return pieces

    def _encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self._encode(text, allowed_special="all")
        return ids, self._lengths[ids]

    def _bytes_before(self, text: str, i: int) -> int:
        # NFC may join characters (a decomposed accent): the bytes of the normalized text.
        before = "".join(self._pieces(text[:i], "all")) if self._nfc else text[:i]
        return len(before.encode("utf-8", "surrogatepass"))

    def _without_template(self, messages: list[Message]) -> Segments:
        raise UsageError(
            f"tokenizer {self._path} has no chat template (in tokenizer_config.json or "
            f"chat_template.jinja) to render conversations with: give one with --chat-template FILE"
        )


def _labelled_runs(
    ids: np.ndarray, lengths: np.ndarray, spans: list[tuple[int, int]], bos_id: int | None
) -> Segments:
    """Runs of `ids`, labels where a token's `lengths` bytes meet an assistant turn's span (a
    token straddling the turn's start too, as in transformers' assistant mask)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    is_label = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        is_label[(starts < end) & (ends > begin)] = True
    if bos_id is not None and ids[:1].tolist() != [bos_id]:
        # A template writing no BOS: documents start at one all the same.
        ids = np.concatenate([[bos_id], ids])
        is_label = np.concatenate([[False], is_label])
    runs = groupby(zip(ids.tolist(), is_label.tolist(), strict=True), key=lambda t: t[1])
    return [([i for i, _ in run], label) for label, run in runs]


def _check_byte_level_bpe(path: Path, spec: dict) -> None:
    """Refuse, naming what the file holds, a tokenizer.json tiktoken cannot encode faithfully."""
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if model.get("type") != "BPE":
        holds = f"a {model.get('type') or 'typeless'} model"
    elif model.get("byte_fallback"):
        holds = "a BPE with byte fallback (sentencepiece's kind, as Llama 2's and Mistral's)"
    elif normalizer not in (None, {"type": "NFC"}, {"type": "Sequence", "normalizers": []}):
        holds = f"a {normalizer.get('type')} normalizer, which changes the text before it is split"
    elif model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        holds = "a BPE whose tokens carry subword prefixes or suffixes"
    elif model.get("dropout"):
        holds = "a BPE with dropout"
    else:
        return
    raise UsageError(
        f"{path} holds {holds}, which longtune does not encode faithfully (it reads byte-level "
        f"BPE): pass the checkpoint's tokenizer.model (sentencepiece, or Llama 3's tiktoken "
        f"ranks) instead"
    )


def _check_ids(path: Path, vocab: dict[str, int], added: dict[str, int]) -> None:
    """Ids as `tokenizers` numbers them: integers below the count of tokens (so no table sized
    by a stray 1e10), one token each (an added token may repeat its vocabulary entry)."""
    bound, by_id = len(vocab) + len(added), {}
    for token, i in [*vocab.items(), *added.items()]:
        if type(i) is not int or not 0 <= i < bound:
            raise UsageError(
                f"{path}: the token {token!r} has the id {i!r}, expected an integer from 0 to "
                f"{bound - 1}"
            )
        if by_id.setdefault(i, token) != token:
            raise UsageError(f"{path}: the tokens {by_id[i]!r} and {token!r} both have the id {i}")


def _merged_tokens(path: Path, merges: list, vocab: dict[str, int]) -> list[str]:
    """The tokens `merges` ([left, right], or "left right") make, once each, by first merge."""
    pairs = [m.split(" ") for m in merges] if merges and isinstance(merges[0], str) else merges
    if set(map(len, pairs)) - {2}:
        pair = next(p for p in pairs if len(p) != 2)
        raise UsageError(f"{path}: the merge {pair!r} is not a pair of tokens")
    made = dict.fromkeys(map("".join, pairs))
    if unknown := made.keys() - vocab.keys():
        left, right = next(p for p in pairs if "".join(p) in unknown)
        raise UsageError(
            f"{path}: the merge {left!r} {right!r} makes {left + right!r}, which is not in the "
            f"vocabulary"
        )
    return list(made)


def _alternatives(tokens: Iterable[str]) -> re.Pattern | None:
    """Any of `tokens`, longest first (as `tokenizers` finds them), grouped: re.split keeps them."""
    tokens = sorted(tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None


# A character of each kind a pre-tokenizer's regex tells apart.
EMPTY_MATCH_PROBE = "Hi, all: 12 ab\n\t  \u00fc \u6f22\u5b57 \U0001f642!? x"


def _check_no_empty_match(path: Path, encoding: tiktoken.Encoding) -> None:
    """tiktoken panics (a Rust panic, mid-dataset) where the Split regex matches no characters,
    as `a*` does between two b's; `tokenizers` skips such matches. Refused here, at load, on a
    text of each kind of character, with the panic's own report kept off stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            encoding.encode_ordinary(EMPTY_MATCH_PROBE)
    except BaseException as e:  # pyo3's PanicException derives from BaseException only
        if type(e).__name__ != "PanicException":
            raise
        raise UsageError(
            f"{path}: its pre-tokenizer's Split regex can match no characters, which "
            f"longtune's encoder (tiktoken) cannot take: make it match at least one"
        ) from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _split_pattern(path: Path, pre_tokenizer: dict | None) -> str:
    """tiktoken's split regex for a tokenizer.json's pre-tokenizer: the shapes the error below
    lists, or ByteLevel alone (no split, as a byte tokenizer's export)."""

    def steps(step: dict) -> list[dict]:
        if step.get("type") == "Sequence":
            return [s for inner in step.get("pretokenizers", []) for s in steps(inner)]
        return [step]

    found = steps(pre_tokenizer) if pre_tokenizer else []
    *splits, last = found or [{}]
    if last.get("type") == "ByteLevel" and not last.get("add_prefix_space"):
        kinds = [s.get("type") for s in splits]
        if not splits:
            return GPT2_PATTERN if last.get("use_regex", True) else r"[\s\S]+"
        if kinds == ["Digits"] and last.get("use_regex", True):
            digits = r"\p{N}" if splits[0].get("individual_digits") else r"\p{N}+"
            return f"{digits}|{GPT2_AFTER_DIGITS}"
        split = splits[0]
        if (
            kinds == ["Split"]
            and not last.get("use_regex", True)
            and "Regex" in split.get("pattern", {})
            and (pattern := _split_pieces(split["pattern"]["Regex"], split))
        ):
            return pattern
    described = " then ".join(json.dumps(s, sort_keys=True) for s in found) or "none"
    raise UsageError(
        f"{path}: its pre-tokenizer ({described}) is not one longtune reproduces; it reads a "
        f"Split by a regex (not Removed unless inverted) then ByteLevel (as Llama 3's), ByteLevel "
        f"with GPT-2's regex, or Digits then that (as SmolLM2's), without add_prefix_space"
    )


def _split_pieces(regex: str, split: dict) -> str | None:
    """The pieces of `tokenizers`' Split by `regex` as the matches of one regex (None: none
    does). tiktoken drops the text between its regex's matches; `tokenizers` keeps each such
    gap (up to where `regex` next matches) as a piece, and `behavior` joins a match to the
    piece before or after it (or runs of matches together, or drops them); `invert` swaps what
    is a match and what a gap. Atomic gaps: once one ends, no backtracking retries it shorter."""
    one, gap = f"(?:{regex})", rf"(?>(?:(?!{regex})[\s\S])+)"
    behavior, invert = split.get("behavior"), bool(split.get("invert"))
    if invert:  # gaps never touch each other, matches may: an inverted Contiguous is the same
        swapped = {"MergedWithPrevious": "MergedWithNext", "MergedWithNext": "MergedWithPrevious"}
        behavior = swapped.get(behavior, behavior)
    pieces = {
        "Isolated": f"{one}|{gap}",
        "Contiguous": f"{one}+|{gap}",
        "MergedWithPrevious": f"{gap}?{one}|{gap}",
        "MergedWithNext": f"{one}{gap}?|{gap}",
        "Removed": regex if invert else None,  # inverted, the gaps go: as tiktoken drops them
    }
    return pieces.get(behavior)


def _hf_special_tokens(
    directory: Path, ids: dict[str, int]
) -> tuple[dict[str, str], tuple[int | None, int | None, int | None]]:
    """A HF tokenizer directory's special tokens: their strings, for chat templates, and the ids
    of BOS, EOS and pad, as tokenizer_config.json names them, else config.json's or
    generation_config.json's (the first of a list of EOS). One named null is none, as
    transformers reads it (Qwen's BOS: its config.json's bos_token_id is for pretraining)."""
    read = lambda name: read_json(directory / name) if (directory / name).is_file() else {}
    tokenizer_config = read("tokenizer_config.json")
    configs = [read("config.json"), read("generation_config.json")]
    strings, found = {}, []
    for name in ("bos", "eos", "pad", "unk"):
        value = tokenizer_config.get(f"{name}_token")
        value = value.get("content") if isinstance(value, dict) else value
        if value is None and f"{name}_token" in tokenizer_config:
            found.append(None)
            continue
        if isinstance(value, str):
            if value not in ids:
                raise UsageError(
                    f"{directory / 'tokenizer_config.json'}: {name}_token {value!r} is not a "
                    f"token of the tokenizer"
                )
            strings[f"{name}_token"] = value
            found.append(ids[value])
            continue
        given = [c[f"{name}_token_id"] for c in configs if c.get(f"{name}_token_id") is not None]
        first = given[0] if given else None
        found.append(first[0] if isinstance(first, list) else first)
    bos, eos, pad, _ = found
    return strings, (bos, eos, pad)


def _find_chat_template(
    directory: Path, given: Path | None, tokens: dict[str, str]
) -> "ChatTemplate | None":
    """`given`, else chat_template.jinja, else tokenizer_config.json's ("default" of a list)."""
    if given is not None and not given.is_file():
        raise UsageError(f"chat template file {given} not found")
    path = given or directory / "chat_template.jinja"
    if path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), tokens, str(path))
        except UnicodeDecodeError as e:
            raise UsageError(f"chat template {path} is not UTF-8 text ({e})") from e
    config_path = directory / "tokenizer_config.json"
    source = read_json(config_path).get("chat_template") if config_path.is_file() else None
    if isinstance(source, list):
        named = [t for t in source if isinstance(t, dict) and t.get("name") == "default"]
        source = named[0].get("template") if named else None
    if source is None:
        return None
    if not isinstance(source, str):
        raise UsageError(
            f"{config_path}: chat_template is {type(source).__name__}, expected a template "
            f"(a string) or a list of named ones"
        )
    return ChatTemplate(source, tokens, f"{config_path} chat_template")


class ChatTemplate:
    """A HF chat template, rendered as apply_chat_template renders it. It is a downloaded file's
    code, run in jinja2's immutable sandbox: it reaches only what is passed in, and changes none."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str):
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            with _time_limit(self.RENDER_SECONDS):  # compiling folds constants: 7 ** (7 ** 11)
                self._template = environment.from_string(source)
        except _TimeUp:
            raise UsageError(
                f"chat template {name}: still compiling after {self.RENDER_SECONDS:g} s"
            ) from None
        except jinja2.TemplateSyntaxError as e:
            raise UsageError(f"chat template {name} line {e.lineno}: {e.message}") from e
        self.source, self.name, self._tokens = source, name, special_tokens

    # A conversation renders in milliseconds. The sandbox bounds what a template reaches, not
    # how long it runs: one that loops for longer than this is stopped and named.
    RENDER_SECONDS = 10.0
    # Nor how much it writes: a template writes the messages' content (some twice) and a few
    # words of its own per turn. Past this many characters per character of content, plus a
    # million, it writes text of its own making ('x' * 10**9), which aborts tiktoken after it.
    RENDER_CHARS_PER_CONTENT = 4

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        try:
            with _time_limit(self.RENDER_SECONDS):
                text = self._template.render(
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self._tokens,
                )
        except _TimeUp:
            raise UsageError(
                f"chat template {self.name}: still rendering a conversation of "
                f"{len(messages)} messages after {self.RENDER_SECONDS:g} s"
            ) from None
        except Exception as e:  # noqa: BLE001 - any error of the template's code is its own
            kind = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
            raise UsageError(f"chat template {self.name}: {kind}{e}") from e
        content = sum(len(message["content"]) for message in messages)
        if len(text) > self.RENDER_CHARS_PER_CONTENT * content + 1_000_000:
            raise UsageError(
                f"chat template {self.name}: renders a conversation of {content:,} characters of "
                f"content as {len(text):,} characters, more than "
                f"{self.RENDER_CHARS_PER_CONTENT} per character of content + 1,000,000"
            )
        return text

    def assistant_spans(
        self, messages: list[Message], added_tokens: re.Pattern | None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, rendered once, and each assistant turn's span in it (character
        offsets), which the loss is taken on. A turn starts where the turns before it with the
        generation prompt end; that text must begin the whole conversation's. It ends with the last
        of `added_tokens` in it when rendered last (ChatML's "\\n" after <|im_end|> is not in it),
        else with that text's end. A template may render a turn otherwise once later turns follow
        (Qwen3's drops earlier answers' reasoning): the turn then runs from its start through as
        many end-of-turn tokens of the whole text, and must end as its last-turn rendering does
        (only its start may be dropped). Anything else is refused."""
        text = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            start = len(before)
            if not (through.startswith(before) and text.startswith(before)):
                raise UsageError(
                    f"the chat template {self.name} does not render messages[:{i}] with the "
                    f"generation prompt as the beginning of messages[:{i + 1}] and of the "
                    f"whole conversation, so where its assistant turn messages[{i}] starts "
                    f"cannot be found: give a template that renders the turns before an answer "
                    f"alike with --chat-template FILE"
                )
            turn = through[start:]
            closings = list(added_tokens.finditer(turn)) if added_tokens else []
            end = start + len(turn)
            if closings:
                turn, closing = turn[: closings[-1].end()], closings[-1].group()
                end = start
                for _ in range(turn.count(closing)):
                    found = text.find(closing, end)
                    end = len(text) + 1 if found < 0 else found + len(closing)
            if not (end <= len(text) and turn.endswith(text[start:end])):
                raise UsageError(
                    f"the chat template {self.name} renders the assistant turn messages[{i}] "
                    f"in the whole conversation as {text[start:end][:80]!r}, which is not how "
                    f"it ends when the turn is the last one ({turn[-80:]!r}), so its tokens "
                    f"cannot be found: give a template that renders earlier answers alike or "
                    f"only drops what they start with, with --chat-template FILE"
                )
            spans.append((start, end))
        return text, spans


class _TimeUp(BaseException):  # not an Exception: the template's own handling misses it
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raises _TimeUp in the block after `seconds`, by SIGALRM; unbounded outside the main
    thread (only it receives signals) or while someone else's timer (one per process) runs."""
    if threading.current_thread() is not threading.main_thread() or any(
        signal.getitimer(signal.ITIMER_REAL)
    ):
        yield
        return
    armed = True

    def expire(signum, frame):
        if armed:  # not once the block is done: an alarm landing as it ends is no error
            raise _TimeUp

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}` renders as its body: assistant spans are found alike in every template."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: Jinja's own escapes HTML characters, which templates do not want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


# Where a Hugging Face checkpoint directory keeps its tokenizer, in the order looked for.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")


def tokenizer_file(directory: str | Path) -> Path | None:
    """The tokenizer file of a HF checkpoint directory, if any: tokenizer.model before a
    tokenizer.json converted from it (a BPE with byte fallback), which longtune does not read."""
    found = [Path(directory) / n for n in TOKENIZER_FILES if (Path(directory) / n).is_file()]
    if [f.name for f in found[:2]] == ["tokenizer.json", "tokenizer.model"] and re.search(
        rb'"byte_fallback":\s*true', found[0].read_bytes()
    ):
        return found[1]
    return found[0] if found else None


def load_tokenizer(path: str | Path | None, chat_template: str | Path | None = None) -> Tokenizer:
    """None: the byte tokenizer; a directory: its tokenizer_file; a file: a tokenizer.json, a
    Llama 3 tiktoken ranks file, or a sentencepiece model; `chat_template` replaces its template."""
    if path is not None:
        path = Path(path)
        if path.is_dir():
            if (found := tokenizer_file(path)) is None:
                raise UsageError(
                    f"tokenizer directory {path} holds no {', '.join(TOKENIZER_FILES[:-1])} or "
                    f"{TOKENIZER_FILES[-1]}: pass the tokenizer file"
                )
            path = found
        if not path.is_file():
            raise UsageError(f"tokenizer file {path} not found")
        if path.stat().st_size == 0:
            raise UsageError(f"tokenizer file {path} is empty")
        with open(path, "rb") as f:
            first_line = f.readline(1024)
        if first_line.lstrip().startswith(b"{"):
            try:
                return ByteLevelBPETokenizer(path, chat_template and Path(chat_template))
            except UsageError:
                raise
            except (LookupError, TypeError, AttributeError, ValueError) as e:
                # A field missing or of another type than tokenizers writes.
                raise UsageError(
                    f"tokenizer file {path} is not a tokenizer.json as `tokenizers` writes "
                    f"one ({type(e).__name__}: {e})"
                ) from e
    fields = first_line.split() if path else []
    try:  # a tiktoken ranks file's first line, "base64-token rank"
        ranks = len(fields) == 2 and fields[1].isdigit()
        ranks = ranks and bool(base64.b64decode(fields[0], validate=True))
    except binascii.Error:
        ranks = False
    if path is None or ranks:
        if chat_template is not None:
            raise UsageError(
                f"the tokenizer {path or 'bytes'} has its built-in chat format: a chat template "
                f"renders conversations with a tokenizer.json or a sentencepiece model"
            )
        return TiktokenTokenizer(path) if path else ByteTokenizer()
    try:
        return SentencePieceTokenizer(path, chat_template and Path(chat_template))
    except (RuntimeError, UnicodeDecodeError) as e:  # not a model proto; a piece not UTF-8
        raise UsageError(
            f"tokenizer file {path} is neither a HF tokenizer.json, a tiktoken BPE ranks file "
            f"(Llama 3: lines of 'base64-token rank') nor a sentencepiece model (Llama 2)"
        ) from e


def _bytes_as_text() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte a printable character, the printable ones as is."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def _byte_level_bytes(path: Path, tokens: Iterable[str]) -> list[bytes]:
    """`_bytes_as_text` undone; a UsageError names a token written outside that alphabet."""
    alphabet = _bytes_as_text()
    # Both in C: each character of the alphabet becomes the one numbered as its byte, any other
    # below 256 becomes U+FFFD, and latin-1 refuses all above.
    table = {b: "\ufffd" for b in range(256)} | {ord(c): b for b, c in alphabet.items()}
    tokens = list(tokens)
    try:
        return [token.translate(table).encode("latin-1") for token in tokens]
    except UnicodeEncodeError:
        text = next(t for t in tokens if not set(t) <= set(alphabet.values()))
        raise UsageError(
            f"{path}: token {text!r} is not written in the byte-level alphabet, so the file is "
            f"not a byte-level BPE"
        ) from None


def byte_level_bpe_files(
    ranks: dict[bytes, int], specials: dict[str, int], pattern: str | None, pad: str
) -> dict[str, bytes]:
    """The HF files of a byte-level BPE of tiktoken `ranks`, its first special BOS, its second
    EOS: ByteLevelBPETokenizer's reading undone (every split of a token into two tokens is a
    merge, listed by the rank of the token made)."""
    alphabet = _bytes_as_text()
    text = lambda token: "".join(alphabet[b] for b in token)
    splits = sorted(
        (rank, ranks[token[:i]], text(token[:i]), text(token[i:]))
        for token, rank in ranks.items()
        for i in range(1, len(token))
        if token[:i] in ranks and token[i:] in ranks
    )
    bos, eos = list(specials)[:2]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    byte_level["use_regex"] = False
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated"}
    split["invert"] = False
    pre_tokenizers = [split] if pattern else []
    piece = lambda kind, id, type_id: {kind: {"id": id, "type_id": type_id}}
    bos_first = [piece("SpecialToken", bos, 0), piece("Sequence", "A", 0)]
    flags = dict.fromkeys(["single_word", "lstrip", "rstrip", "normalized"], False)
    tokenizer = {
        "added_tokens": [
            {"id": i, "content": token, **flags, "special": True} for token, i in specials.items()
        ],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*pre_tokenizers, byte_level]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": bos_first,
            "pair": [*bos_first, piece("SpecialToken", bos, 1), piece("Sequence", "B", 1)],
            "special_tokens": {bos: {"id": bos, "ids": [specials[bos]], "tokens": [bos]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "ignore_merges": True,  # a piece that is a token is that token, as in tiktoken
            "vocab": {text(token): rank for token, rank in ranks.items()},
            "merges": [[left, right] for *_, left, right in splits],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": _json_bytes(tokenizer), "tokenizer_config.json": _json_bytes(config)}


def _ids(segments: Segments) -> list[int]:
    return [i for ids, _ in segments for i in ids]


def _set_chat_template(files: dict[str, bytes], template: bytes) -> None:
    """Makes chat_template.jinja the only template: one in tokenizer_config.json could differ."""
    config = json.loads(files.get("tokenizer_config.json", b"{}"))
    config.pop("chat_template", None)
    files["tokenizer_config.json"] = _json_bytes(config)
    files["chat_template.jinja"] = template


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


# The files of a HF checkpoint that make its tokenizer and its generation defaults.
HF_TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
]
SPECIAL_TOKEN_KEYS = ["bos_token_id", "eos_token_id", "pad_token_id"]


@dataclass(frozen=True)
class HFTokenizer:
    """An export's tokenizer files (name -> contents) and special ids by SPECIAL_TOKEN_KEYS."""

    files: dict[str, bytes]
    special_ids: dict[str, int | list[int] | None]

    def has_tokenizer(self) -> bool:
        # A checkpoint may have only generation_config.json.
        return bool(set(self.files) - {"generation_config.json"})


def read_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    path = Path(path)
    files = {n: (path / n).read_bytes() for n in HF_TOKENIZER_FILES if (path / n).is_file()}
    config = read_json(path / "config.json")
    return HFTokenizer(files, {key: config.get(key) for key in SPECIAL_TOKEN_KEYS})


# ---------------------------------------------------------------------------------------------
# Preparation: text and JSONL files -> tokens.bin, loss_mask.bin, meta.json


Example = tuple[str, str] | list[Message]  # (prompt, text), prompt "" for a text; or messages
Document = tuple[Example, int, str]  # with the bytes of input it came from, and where
Encoded = tuple[np.ndarray, np.ndarray]  # (tokens uint32, loss mask uint8)
ROLES = ("system", "user", "assistant")


def prepare(
    inputs: Iterable[str | Path],
    output_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    workers: int | None = None,
    seq_len: int | None = None,
    chat_template: str | Path | None = None,
) -> Path:
    """Tokenize `inputs` into the dataset directory `output_dir`, replacing any there. Each
    input is a text file (one document), a .jsonl file (one document per line: {"text": ...},
    {"prompt": ..., "response": ...} whose prompt gets no loss, or {"messages": [...]} with loss
    on the assistant turns), or a directory standing for its files. With `seq_len`, longer
    conversations are split (`_split_conversation`); meta.json counts the splits and the
    documents still longer. Output is the same for any number of workers (None: one per CPU)."""
    files = _input_files(inputs)
    output = Path(output_dir).resolve()
    if inside := [str(f) for f in files if output in f.resolve().parents]:
        raise UsageError(f"the inputs {inside} are inside the output directory {output_dir}")
    # A bad tokenizer or template fails here, not in each worker.
    tokenizer = load_tokenizer(tokenizer_path, chat_template)
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise UsageError(f"workers must be at least 1, got {workers}")
    if seq_len is not None and seq_len < 1:
        raise UsageError(f"seq_len must be at least 1 (or None: split nothing), got {seq_len}")
    progress = _Progress(total_bytes=sum(f.stat().st_size for f in files))
    sft, split, pieces, longest, too_long = False, 0, 0, 0, 0
    with progress, DatasetWriter(output_dir) as writer:
        loading = (tokenizer_path, chat_template)
        encoded = _encode_all(_read_documents(files), tokenizer, loading, seq_len, workers)
        for documents, n_bytes in encoded:
            if len(documents) > 1:
                split, pieces = split + 1, pieces + len(documents)
            for tokens, mask in documents:
                writer.add(tokens, mask)
                # An unlabelled token after the first (BOS or not) is a prompt: SFT data.
                sft = sft or not (mask[1:] & LABEL).all()
                longest = max(longest, len(tokens))
                too_long += seq_len is not None and len(tokens) > seq_len
            progress.update(n_bytes, len(documents), sum(len(t) for t, _ in documents))
        if writer.n_documents == 0:
            raise UsageError(f"no documents in the inputs {[str(f) for f in files]}")
        template = getattr(tokenizer, "chat_template", None)
        return writer.finish(
            tokenizer,
            sft=sft,
            files={DATASET_CHAT_TEMPLATE: template.source.encode()} if template else {},
            chat_template=template and template.name,
            longest_document=longest,
            split_seq_len=seq_len,
            n_conversations_split=split,
            n_documents_from_splits=pieces,
            n_documents_longer_than_seq_len=too_long,
        )


# The chat template a dataset's conversations were rendered with travels in it: training
# renders its sample prompt with that template, and an export carries it.
DATASET_CHAT_TEMPLATE = "chat_template.jinja"
DATASET = OutputDir(
    "dataset", "meta.json", ("meta.json", "tokens.bin", "loss_mask.bin", DATASET_CHAT_TEMPLATE)
)


class DatasetWriter:
    """Written beside `output_dir`, put in place by `finish`; leaving the block first removes it."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self._tmp = DATASET.make_temp(self.output_dir)
        try:  # __exit__ removes it only once this returns: a stop here must, too
            # Open for the writer's life: closed by `finish`, or by __exit__ after an error.
            self._tokens_file = open(self._tmp / "tokens.bin", "wb")  # noqa: SIM115
            self._mask_file = open(self._tmp / "loss_mask.bin", "wb")  # noqa: SIM115
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self.n_tokens = 0
        self.n_documents = 0

    def add(self, tokens: np.ndarray, loss_mask: np.ndarray) -> None:
        """One document: its tokens (uint32, from BOS on) and where they may be labels (uint8)."""
        # Through the file, not ndarray.tofile: its errors carry no errno, so no NO_SPACE.
        self._tokens_file.write(tokens)
        self._mask_file.write(loss_mask)
        self.n_tokens += len(tokens)
        self.n_documents += 1

    def finish(
        self, tokenizer: Tokenizer, sft: bool, files: dict[str, bytes] | None = None, **summary
    ) -> Path:
        """`summary`: the caller's counts for meta.json; `files`: name -> contents."""
        self._close()
        for name, contents in (files or {}).items():
            (self._tmp / name).write_bytes(contents)
        meta = {
            "format_version": FORMAT_VERSION,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            "n_tokens": self.n_tokens,
            "n_documents": self.n_documents,
            "sft": sft,
            **summary,
        }
        (self._tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        DATASET.swap_in(self._tmp, self.output_dir)
        return self.output_dir

    def _close(self) -> None:
        self._tokens_file.close()
        self._mask_file.close()

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: object, error: BaseException | None, tb: object) -> None:
        try:
            self._close()
        except OSError:  # flushing the rest onto a full disk fails again: `error` says it
            if error is None:
                raise
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)  # gone already after `finish`
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            raise no_space(f"the dataset {self.output_dir}", self._tmp.parent) from None


def _input_files(inputs: Iterable[str | Path]) -> list[Path]:
    """A directory stands for its files, sorted, hidden ones left out, every one a text (as a
    code tree's .json files are). Refused: a .json file named alone (JSON lines read as one
    text would train on their syntax) and a prepared dataset (its binary files would too)."""
    inputs, files = [Path(i) for i in inputs], []
    for item in inputs:
        if (item / DATASET.marker).is_file() and (item / "tokens.bin").is_file():
            raise UsageError(
                f"input {item} is a prepared dataset: pass it to train.py --data, or give "
                f"prepare the files it was made from"
            )
        if item.is_dir():
            files += sorted(
                p
                for p in item.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(item).parts)
            )
        elif item.suffix.lower() == ".json":
            raise UsageError(
                f"input {item}: a .json file is not read; prepare reads .jsonl files (one JSON "
                f"object a line: text, prompt/response or messages) and text files; rename it "
                f".jsonl if it holds one object a line"
            )
        elif item.is_file():
            files.append(item)
        else:
            raise UsageError(f"input {item} not found")
    if not files:
        raise UsageError(f"no files in the inputs {[str(i) for i in inputs]}")
    return files


def _read_documents(files: list[Path]) -> Iterator[Document]:
    for path in files:
        if path.suffix.lower() == ".jsonl":
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        where = f"{path} line {lineno}"
                        yield _parse_jsonl_line(line, where), len(line), where
        else:
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"{path} is not UTF-8 text (bad byte at offset {e.start}); inputs are UTF-8 "
                    f"text files, one document each, or .jsonl files"
                ) from e
            if "\0" in text:  # valid UTF-8, yet binary: NUL is in no text a model should learn
                raise UsageError(
                    f"{path} holds NUL bytes (at offset {data.index(0)}): a binary file, not "
                    f"text; inputs are UTF-8 text files, one document each, or .jsonl files"
                )
            if text:
                yield ("", text), len(data), str(path)


def _parse_jsonl_line(line: bytes, where: str) -> Example:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where}: not valid UTF-8 JSON ({e})") from e
    except RecursionError:  # json's C parser recurses once per level of nesting
        raise UsageError(f"{where}: JSON nested too deep to read") from None
    if b"\\ud" in line.lower():  # an escaped UTF-16 surrogate, maybe a lone one
        record = _without_lone_surrogates(record)
    if isinstance(record, dict):
        if "messages" in record:
            return _check_messages(record["messages"], where)
        if isinstance(record.get("text"), str):
            return "", record["text"]
        if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
            return record["prompt"], record["response"]
    raise UsageError(
        f'{where}: expected a JSON object with a string "text", strings "prompt" and "response", '
        f'or a list "messages"'
    )


def _without_lone_surrogates(value):
    """Each lone UTF-16 surrogate in `value`'s strings made U+FFFD, as tiktoken's encode does:
    JSON can escape one, but no UTF-8 text holds one, and no tokenizer encodes one."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_lone_surrogates(v) for k, v in value.items()}
    return value


def _check_messages(messages: object, where: str) -> list[Message]:
    """Each message kept whole: its fields beyond role and content are for a chat template."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(
            f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} '
            f"objects, got {json.dumps(messages)[:80]}"
        )
    has_system = isinstance(messages[0], dict) and messages[0].get("role") == "system"
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise UsageError(f'{where}: {name} must be an object with "role" and "content"')
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise UsageError(f"{where}: {name}.role is {role!r}, expected one of {ROLES}")
        if not isinstance(content, str):
            got = "missing" if content is None else f"of type {type(content).__name__}"
            raise UsageError(f"{where}: {name}.content is {got}, expected a string")
        expected = "system" if i == 0 and has_system else ROLES[1 + (i - has_system) % 2]
        if role != expected:
            raise UsageError(
                f"{where}: {name}.role is {role!r}, expected {expected!r}: an optional system "
                f"message first, then user and assistant turns alternating from a user turn"
            )
    if len(messages) < 2 + has_system:
        raise UsageError(f"{where}: messages has no assistant turn, so nothing to train on")
    return messages


def _encode_document(
    tokenizer: Tokenizer, document: Document, seq_len: int | None
) -> tuple[list[Encoded], int]:
    """The documents of one example (one, or several for a conversation split at seq_len), and
    its bytes of input."""
    example, n_bytes, where = document
    if isinstance(example, list):
        try:
            pieces = _split_conversation(tokenizer, example, seq_len)
            encoded = [_encode_segments(tokenizer.render_chat(p), tokenizer.bos_id) for p in pieces]
        except UsageError as e:  # a chat template refusing a conversation: name it
            raise UsageError(f"{where}: {e}") from e
        return encoded, n_bytes
    prompt, text = example
    # A prompt is no label: it is the question, not what the model should learn to write.
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    segments = [([*bos, *tokenizer.encode(prompt)], False)]
    segments.append(([*tokenizer.encode(text), tokenizer.eos_id], True))
    return [_encode_segments(segments, tokenizer.bos_id)], n_bytes


def _encode_segments(segments: Segments, bos_id: int | None) -> Encoded:
    tokens = np.fromiter(chain.from_iterable(ids for ids, _ in segments), dtype=np.uint32)
    is_label = np.array([LABEL * is_label for _, is_label in segments], dtype=np.uint8)
    mask = np.repeat(is_label, [len(ids) for ids, _ in segments])
    # A document's first token is never a label: predicting one document's start from an
    # unrelated one's end teaches nothing. Without a BOS to mark where it starts, a bit does.
    if bos_id is None:
        mask[0] = STARTS_DOCUMENT
    else:
        mask[1:][tokens[1:] == bos_id] |= BOS_INSIDE
    return tokens, mask


def _split_conversation(
    tokenizer: Tokenizer, messages: list[Message], seq_len: int | None
) -> list[list[Message]]:
    """A conversation longer than seq_len tokens cut between exchanges (a user turn and its
    answer) into pieces of at most seq_len, each led by the system prompt: one the model could
    have seen. A longer exchange stays whole (the loader cuts it); a lone user turn is dropped."""

    def length(piece: list[Message]) -> int:
        return sum(len(ids) for ids, _ in tokenizer.render_chat(piece))

    if seq_len is None or length(messages) <= seq_len:
        return [messages]
    system = messages[:1] if messages[0]["role"] == "system" else []
    exchanges = [messages[i : i + 2] for i in range(len(system), len(messages), 2)]
    pieces, current = [], exchanges[0]
    for exchange in exchanges[1:]:
        if length(system + current + exchange) > seq_len:
            pieces.append(system + current)
            current = []
        current = current + exchange
    pieces.append(system + current)
    return [piece for piece in pieces if any(m["role"] == "assistant" for m in piece)]


_worker_tokenizer: Tokenizer | None = None  # each pool process loads its own from the path


def _init_worker(loading: tuple) -> None:
    global _worker_tokenizer
    # A worker ends on the SIGTERM Pool.terminate sends it, whatever handler it was forked with
    # (`main` makes SIGTERM raise KeyboardInterrupt in its own process).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process: the parent
    _worker_tokenizer = load_tokenizer(*loading)


def _encode_chunk(chunk: list[Document], seq_len: int | None) -> list[tuple[list[Encoded], int]]:
    return [_encode_document(_worker_tokenizer, doc, seq_len) for doc in chunk]


def _encode_all(
    documents: Iterator[Document],
    tokenizer: Tokenizer,
    loading: tuple,
    seq_len: int | None,
    workers: int,
) -> Iterator[tuple[list[Encoded], int]]:
    """In input order. At most two chunks per worker are in flight: Pool.imap would read the
    whole corpus into its queue up front. `loading`: load_tokenizer's arguments."""
    if workers == 1:
        yield from (_encode_document(tokenizer, doc, seq_len) for doc in documents)
        return
    with multiprocessing.Pool(workers, _init_worker, (loading,)) as pool:
        pending = deque()
        for chunk in _chunks(documents, max_bytes=1 << 20):
            pending.append(pool.apply_async(_encode_chunk, (chunk, seq_len)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
        # Each worker ends on the end-of-tasks sentinel close() sends. Leaving by `with` alone
        # terminates them, and a test once hung there for good: a worker the SIGTERM did not
        # end waited on the task queue's lock, which Pool.terminate holds.
        pool.close()
        pool.join()


def _chunks(documents: Iterator[Document], max_bytes: int) -> Iterator[list]:
    chunk, size = [], 0
    for doc in documents:
        chunk.append(doc)
        size += doc[1]
        if size >= max_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@dataclass
class _Progress:
    """One line on stderr, redrawn at most 4 times a second."""

    total_bytes: int
    done_bytes: int = 0
    documents: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    last_draw: float = 0.0

    def update(self, n_bytes: int, n_documents: int, n_tokens: int) -> None:
        self.done_bytes += n_bytes
        self.documents += n_documents
        self.tokens += n_tokens
        if time.perf_counter() - self.last_draw >= 0.25:
            self._draw()

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        if error_type is None:
            self.done_bytes = self.total_bytes  # blank JSONL lines are never counted
            self._draw()
        if self.last_draw:  # after an error too, which then gets a line of its own
            sys.stderr.write("\n")

    def _draw(self) -> None:
        self.last_draw = time.perf_counter()
        fraction = min(self.done_bytes / max(self.total_bytes, 1), 1.0)
        rate = self.tokens / max(self.last_draw - self.start, 1e-6)
        sys.stderr.write(
            f"\rprepare [{'#' * int(30 * fraction):<30}] {fraction:4.0%}  {self.documents:,} docs"
            f"  {self.tokens:,} tokens  {rate:,.0f} tokens/s"
        )
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Loading


META_FIELDS = {  # what meta.json holds besides format_version
    "tokenizer": str,
    "vocab_size": int,
    "bos_id": int | None,  # None: the tokenizer has no BOS
    "eos_id": int,
    "n_tokens": int,
    "n_documents": int,
}


class TokenDataset:
    """A prepared dataset directory, memory-mapped, checked against its meta.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if self.path.is_file():
            raise UsageError(
                f"{self.path} is a file, not a prepared dataset directory: make one with "
                f"`python data.py prepare --input {self.path} --output DIR`, then pass DIR"
            )
        if not meta_path.is_file():
            raise UsageError(
                f"{meta_path} not found: {self.path} is not a prepared dataset "
                f"(make one with `python data.py prepare --input FILES --output {self.path}`)"
            )
        self.meta = read_json(meta_path)
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise UsageError(
                f"{meta_path} has format_version {self.meta.get('format_version')!r}, "
                f"expected {FORMAT_VERSION}: prepare the dataset again"
            )
        problems = []
        for key, kind in META_FIELDS.items():
            expected = getattr(kind, "__name__", str(kind))  # "int | None" has no __name__
            if key not in self.meta:
                problems.append(f"no field {key!r} (expected type {expected})")
            # type(), not isinstance: True is not a count
            elif type(self.meta[key]) not in (typing.get_args(kind) or (kind,)):
                problems.append(f"{key} is {self.meta[key]!r}, expected type {expected}")
        if problems:
            raise UsageError(f"{meta_path}: " + "; ".join(problems))
        self.n_tokens: int = self.meta["n_tokens"]
        self.bos_id: int | None = self.meta["bos_id"]
        self.tokens = self._map("tokens.bin", np.uint32)
        self.loss_mask = self._map("loss_mask.bin", np.uint8)

    @property
    def chat_template(self) -> Path | None:
        path = self.path / DATASET_CHAT_TEMPLATE
        return path if path.is_file() else None

    @property
    def is_sft(self) -> bool:
        # Datasets from before the field were prepared from text.
        return bool(self.meta.get("sft", False))

    def _map(self, name: str, dtype: type) -> np.ndarray:
        file = self.path / name
        expected = self.n_tokens * np.dtype(dtype).itemsize
        if not file.is_file():
            raise UsageError(f"{file} not found (meta.json expects {expected:,} bytes)")
        actual = file.stat().st_size
        if actual != expected:
            raise UsageError(
                f"{file} is {actual:,} bytes, expected {expected:,} ({self.n_tokens:,} tokens of "
                f"{np.dtype(dtype).name} per meta.json): truncated, or from another preparation"
            )
        if expected == 0:
            return np.zeros(0, dtype)  # numpy cannot map an empty file
        return np.memmap(file, dtype=dtype, mode="r")

    def max_token_id(self) -> int:
        chunk = 1 << 26  # 256 MB of uint32 at a time: flat memory on datasets larger than RAM
        return max(int(self.tokens[i : i + chunk].max()) for i in range(0, self.n_tokens, chunk))

    def has_labels(self) -> bool:
        chunk = 1 << 28  # 256 MB at a time; a normal dataset answers in its first chunk
        masks = (self.loss_mask[i : i + chunk] for i in range(1, self.n_tokens, chunk))
        return any((mask & LABEL).any() for mask in masks)

    def check(self, vocab_size: int, seq_len: int, use: str = "train") -> None:
        """One error naming each reason this dataset cannot `use` ("train", "evaluate") with
        rows of `seq_len` (options.model_args holds it within the model's length)."""
        problems = []
        if self.n_tokens < seq_len + 1:
            problems.append(
                f"the dataset has {self.n_tokens:,} tokens, one sample of seq_len {seq_len} "
                f"needs {seq_len + 1:,}"
            )
        if self.n_tokens and (max_token_id := self.max_token_id()) >= vocab_size:
            problems.append(
                f"token id {max_token_id:,} in tokens.bin is >= the model's vocab_size "
                f"{vocab_size:,} (the dataset's tokenizer is {self.meta['tokenizer']} with "
                f"vocab_size {self.meta['vocab_size']:,})"
            )
        if self.n_tokens and not self.has_labels():
            problems.append(
                "loss_mask.bin is all 0: no token is a label, so the loss would be 0 and "
                "nothing would be learned"
            )
        if problems:
            raise UsageError(f"dataset {self.path} cannot {use} this model: " + "; ".join(problems))


def document_starts(positions: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """[B, S] -> per row, 0 (a row may begin inside a document) and each later 0's offset. On
    the host: the model picks its attention kernels by it, which on a GPU tensor would wait."""
    positions = positions.cpu()
    return tuple((0, *(1 + torch.nonzero(row[1:] == 0).flatten()).tolist()) for row in positions)


@dataclass
class Batch:
    """One rank's micro-batch, each tensor int64 [micro_batch, seq_len]. labels are the next
    tokens, IGNORE_INDEX where no loss is taken (SFT prompts, each document's first token).
    positions count from 0 at each document's and each sample's first token, so they stay
    below seq_len; a 0 marks where attention may start a new document."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    # Of the whole rows, so that the ranks sharing one (context parallelism) pick alike kernels.
    document_starts: tuple[tuple[int, ...], ...]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        fields = (self.tokens, self.labels, self.positions)
        moved = (t.to(device, non_blocking=non_blocking) for t in fields)
        return Batch(*moved, self.document_starts)


class PackedLoader:
    """An endless iterator of Batch for one rank. Sample i is tokens[i*S : i*S + S + 1] (S:
    seq_len), so the stream is read once per epoch, in one seeded permutation per epoch. Each
    step takes the next world_size * micro_batch samples of that order, rank r the r-th
    micro_batch of them, and moves the cursor (shared by all ranks) past them: only that
    product is tied to the cursor, so state_dict() resumes on any number of ranks. With context
    parallelism, rank and world_size count the data-parallel groups, and each of a group's
    `context_parallel` (N) ranks gets columns [context_rank * S/N, (context_rank + 1) * S/N) of
    the same rows, positions counted on the whole row."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        pin_memory: bool = False,
        context_rank: int = 0,
        context_parallel: int = 1,
    ):
        self.num_samples = (dataset.n_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"dataset {dataset.path} has {dataset.n_tokens:,} tokens, "
                f"one sample of seq_len {seq_len} needs {seq_len + 1:,}"
            )
        self.dataset = dataset
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.pin_memory = pin_memory
        shard = seq_len // context_parallel
        self.columns = slice(context_rank * shard, (context_rank + 1) * shard)
        self.epoch = 0
        self.cursor = 0  # samples of this epoch's order read so far, by all ranks together
        self._orders: dict[int, np.ndarray] = {}

    def state_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in ("epoch", "cursor", "seed", "num_samples")}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_samples"] != self.num_samples:
            raise UsageError(
                f"the checkpoint's loader cut its dataset into {state['num_samples']:,} samples, "
                f"this one cuts {self.dataset.path} into {self.num_samples:,}: resume with the "
                f"same dataset and seq_len"
            )
        self.epoch, self.cursor, self.seed = state["epoch"], state["cursor"], state["seed"]
        self._orders = {}

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> Batch:
        first = self.cursor + self.rank * self.micro_batch
        indices = [self._sample_index(first + k) for k in range(self.micro_batch)]
        self.cursor += self.world_size * self.micro_batch
        self.epoch += self.cursor // self.num_samples
        self.cursor %= self.num_samples
        return self._batch(indices)

    def labels_ahead(self, micro_batches: int) -> int:
        """This rank's labelled tokens in its next `micro_batches` batches, read from the loss
        mask alone, the cursor left where it is: a step divides its loss by the count before
        its first backward, then makes its micro-batches one at a time."""
        count = 0
        for m in range(micro_batches):
            first = self.cursor + (m * self.world_size + self.rank) * self.micro_batch
            for k in range(self.micro_batch):
                start = self._sample_index(first + k) * self.seq_len
                mask = self.dataset.loss_mask[start + 1 : start + self.seq_len + 1]
                count += int(np.count_nonzero(_labelled(mask[self.columns])))
        return count

    def in_order(self, max_samples: int | None = None) -> Iterator[Batch]:
        """The first `max_samples` samples once, in stored order, this rank's group taking its
        contiguous share (the last micro-batch may be smaller). Every group gets as many (the
        rest is left out), so every rank runs as many forwards (FSDP's collectives pair them)."""
        n = self.num_samples if max_samples is None else min(max_samples, self.num_samples)
        share = n // self.world_size
        first = self.rank * share
        for start in range(first, first + share, self.micro_batch):
            yield self._batch(range(start, min(start + self.micro_batch, first + share)))

    def _batch(self, indices: Iterable[int]) -> Batch:
        samples = [self._sample(i) for i in indices]
        rows = [np.stack(field) for field in zip(*samples, strict=True)]
        starts = document_starts(torch.from_numpy(rows[2]))
        tensors = [torch.from_numpy(np.ascontiguousarray(x[:, self.columns])) for x in rows]
        if self.pin_memory:
            tensors = [t.pin_memory() for t in tensors]
        return Batch(*tensors, starts)

    def _sample_index(self, offset: int) -> int:
        # `offset` counts from the current epoch's start; a step may run into the next epoch.
        epoch = self.epoch + offset // self.num_samples
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}
            rng = np.random.default_rng(self.seed + epoch)
            self._orders[epoch] = rng.permutation(self.num_samples)
        return int(self._orders[epoch][offset % self.num_samples])

    def _sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        start = i * self.seq_len
        window = self.dataset.tokens[start : start + self.seq_len + 1].astype(np.int64)
        mask = self.dataset.loss_mask[start : start + self.seq_len + 1]
        tokens = window[:-1]
        labels = np.where(_labelled(mask[1:]), window[1:], IGNORE_INDEX)
        return tokens, labels, window_positions(tokens, mask[:-1], self.dataset.bos_id)


def _labelled(mask: np.ndarray) -> np.ndarray:
    """Where a loss_mask.bin slice makes its tokens labels."""
    return (mask & LABEL) != 0


def window_positions(tokens: np.ndarray, mask: np.ndarray, bos_id: int | None) -> np.ndarray:
    """Batch.positions of a window; a document it cuts restarts at 0 (nothing before is visible)."""
    index = np.arange(len(tokens))
    is_start = (mask & STARTS_DOCUMENT) != 0
    if bos_id is not None:
        is_start |= (tokens == bos_id) & ((mask & BOS_INSIDE) == 0)
    is_start[0] = True
    return index - np.maximum.accumulate(np.where(is_start, index, 0))


def attended_per_token(dataset: TokenDataset, seq_len: int, samples: int = 64) -> float:
    """The mean (query, key) pairs a token attends with documents masked apart (position + 1/2,
    as model.attended_pairs) over `samples` windows: for the planner's packed step time."""
    n = max((dataset.n_tokens - 1) // seq_len, 1)  # one window, short, in too small a dataset
    means = []
    for i in np.linspace(0, n - 1, min(samples, n)).astype(np.int64):
        start = int(i) * seq_len
        tokens = dataset.tokens[start : start + seq_len]
        mask = dataset.loss_mask[start : start + seq_len]
        positions = window_positions(tokens, mask, dataset.bos_id)
        means.append(positions.mean())
    return float(np.mean(means)) + 0.5


# ---------------------------------------------------------------------------------------------
# The default corpus


def default_corpus(cache_dir: str | Path, max_bytes: int = 32 << 20) -> Path:
    """The Python standard library's own source, byte-tokenized, prepared once per Python: a corpus
    on every machine. Not safe from several processes at once: one rank, then barrier."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, listing, total = [], [], 0
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        # Installed packages differ between machines; test suites hold odd files, a poor corpus.
        if parts[0] in ("site-packages", "dist-packages") or not path.is_file():
            continue
        if any(part in ("test", "tests", "idle_test") for part in parts[:-1]):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        listing.append(f"{'/'.join(parts)}\t{size}\n")
        total += size
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    output = Path(cache_dir) / f"stdlib-py{version}-{_sha256(''.join(listing).encode())}"
    meta_path = output / "meta.json"
    if meta_path.is_file():
        meta = read_json(meta_path)
        if meta.get("format_version") == FORMAT_VERSION and meta.get("tokenizer") == "bytes":
            return output
    # One process: bytes tokenize in well under a second here, and train.py may call this once
    # CUDA is up, when forking a pool of workers is best avoided.
    return prepare(files, output, workers=1)


# ---------------------------------------------------------------------------------------------
# A training run's data (train.setup)

CACHE = Path(__file__).resolve().parent / ".cache"  # where the default corpus is prepared


@dataclass(frozen=True)
class RunData:
    """`text_tokenizer` decodes the end-of-run sample; `export_tokenizer` is what exports carry."""

    dataset: TokenDataset
    text_tokenizer: Tokenizer | None
    export_tokenizer: HFTokenizer | None


def open_data(
    data: str | None,
    tokenizer: str | None,
    hf_checkpoint: str | None,
    vocab_size: int,
    seq_len: int,
    is_main: bool,
) -> RunData:
    """The dataset, checked against the model and the tokenizer: --tokenizer's, else the
    --hf-checkpoint directory's, must be the one the data was prepared with. The export carries
    the checkpoint's tokenizer files, else that one's, with the dataset's chat template."""
    if data:
        dataset = TokenDataset(data)
    else:
        if is_main:
            default_corpus(CACHE)
        dist.barrier()
        dataset = TokenDataset(default_corpus(CACHE))
    dataset.check(vocab_size, seq_len)
    prepared_with = dataset.meta["tokenizer"]
    source = tokenizer or (hf_checkpoint and tokenizer_file(hf_checkpoint))
    text_tokenizer = load_tokenizer(source) if source else None
    if text_tokenizer and text_tokenizer.name != prepared_with:
        given = "--tokenizer" if tokenizer else "the checkpoint's tokenizer"
        raise UsageError(
            f"dataset {dataset.path} was prepared with tokenizer {prepared_with}, but {given} "
            f"{source} is {text_tokenizer.name}: prepare the data with it (python data.py "
            f"prepare --tokenizer {source} ...)"
        )
    if prepared_with == ByteTokenizer.name:
        text_tokenizer = ByteTokenizer()
    if text_tokenizer and dataset.meta["bos_id"] != text_tokenizer.bos_id:
        # The same tokenizer.json read another way: a dataset prepared before a null
        # bos_token in tokenizer_config.json meant no BOS has one before each document.
        raise UsageError(
            f"dataset {dataset.path} starts its documents with BOS id {dataset.meta['bos_id']}, "
            f"but its tokenizer {source or prepared_with} has BOS {text_tokenizer.bos_id}: "
            f"prepare the data again (python data.py prepare ...)"
        )
    if dataset.chat_template and hasattr(text_tokenizer, "use_chat_template"):
        text_tokenizer.use_chat_template(dataset.chat_template)
    export_tokenizer = read_hf_tokenizer(hf_checkpoint) if hf_checkpoint else None
    if export_tokenizer and export_tokenizer.has_tokenizer() and dataset.chat_template:
        # The template the model was trained with, the dataset's, in place of the checkpoint's.
        _set_chat_template(export_tokenizer.files, dataset.chat_template.read_bytes())
    if not (export_tokenizer and export_tokenizer.has_tokenizer()) and text_tokenizer:
        ids = (text_tokenizer.bos_id, text_tokenizer.eos_id, text_tokenizer.pad_id)
        special_ids = dict(zip(SPECIAL_TOKEN_KEYS, ids, strict=True))
        export_tokenizer = HFTokenizer(text_tokenizer.hf_files(), special_ids)
    return RunData(dataset, text_tokenizer, export_tokenizer)


def open_eval_data(
    eval_data: str, vocab_size: int, seq_len: int, training: TokenDataset
) -> TokenDataset:
    """Checked against the model (as open_data) and the training data."""
    held_out = TokenDataset(eval_data)
    held_out.check(vocab_size, seq_len, use="evaluate")
    if held_out.path.resolve() == training.path.resolve():
        raise UsageError(f"--eval-data {held_out.path} is the training data: nothing is held out")
    if held_out.meta["tokenizer"] != training.meta["tokenizer"]:
        raise UsageError(
            f"--eval-data {held_out.path} was prepared with tokenizer "
            f"{held_out.meta['tokenizer']}, the training data {training.path} with "
            f"{training.meta['tokenizer']}: prepare both with the same one"
        )
    return held_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser(
        "prepare", help="tokenize text and JSONL files into a dataset", allow_abbrev=False
    )
    prep.add_argument("--input", nargs="+", required=True, help="files or directories")
    prep.add_argument("--output", required=True, help="the dataset directory to write")
    prep.add_argument(
        "--tokenizer",
        help="a HF checkpoint or tokenizer directory, a tokenizer.json, or a Llama 3 or Llama 2 "
        "tokenizer.model (default: bytes)",
    )
    prep.add_argument(
        "--chat-template",
        help="a Jinja chat template file for the conversations (default: the tokenizer "
        "directory's)",
    )
    prep.add_argument("--workers", type=int, help="default: one per CPU")
    prep.add_argument(
        "--seq-len",
        type=int,
        help="split conversations longer than this many tokens between their exchanges "
        "(default: split none; the loader cuts every document at its samples' boundaries)",
    )
    args = parser.parse_args(argv)
    # SIGTERM (a job's time limit) as Ctrl-C: the half-written dataset is removed either way.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        output = prepare(
            args.input, args.output, args.tokenizer, args.workers, args.seq_len, args.chat_template
        )
    except UsageError as e:  # what was given: one line, no traceback
        print(f"data.py error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"data.py: stopped; {args.output} is as it was", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(summary(read_json(output / "meta.json"), output))


def summary(meta: dict, output: Path) -> str:
    lines = [
        f"wrote {output}: {meta['n_documents']:,} document{'s' * (meta['n_documents'] != 1)}, "
        f"{meta['n_tokens']:,} tokens, "
        f"tokenizer {meta['tokenizer']}, longest document {meta['longest_document']:,} tokens"
    ]
    if meta["sft"]:
        lines.append("SFT data: loss only on responses and assistant turns")
    seq_len = meta["split_seq_len"]
    if seq_len is None:
        lines.append(
            "conversations were not split (no --seq-len): the loader cuts any document longer "
            "than a sample, and one crossing a sample boundary, into pieces that see only "
            "themselves"
        )
        return "\n".join(lines)
    lines.append(
        f"{meta['n_conversations_split']:,} conversations longer than --seq-len {seq_len:,} "
        f"tokens were split between exchanges into {meta['n_documents_from_splits']:,} documents"
    )
    if meta["n_documents_longer_than_seq_len"]:
        lines.append(
            f"{meta['n_documents_longer_than_seq_len']:,} documents are still longer than "
            f"{seq_len:,} tokens (text, or a single exchange): the loader cuts them into pieces "
            f"that see only themselves"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Tokenizers, and the tokenizer files of a Hugging Face checkpoint. In order: the `Tokenizer`
interface and its kinds (bytes; Llama 3's tiktoken ranks file; sentencepiece, Llama 2's and
Mistral's; a Hugging Face tokenizer.json: a byte-level BPE, encoded by tiktoken, or a BPE with
byte fallback, encoded by sentencepiece), `load_tokenizer`, and last the files an export
carries (`HFTokenizer`). Conversations render with chat_template.py's templates. prepare.py
encodes with them; data.py decodes a run's sample.
"""

import base64
import binascii
import gc
import hashlib
import json
import os
import re
import struct
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, groupby
from pathlib import Path

import numpy as np
import sentencepiece
import tiktoken

from chat_template import (
    Message,
    Segments,
    check_role_and_content_only,
    find_chat_template,
    labelled_runs,
)
from files import LOCAL_PATH, UsageError, read_json


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
        """The files AutoTokenizer loads (name -> contents), adding BOS to documents as trained."""
        return byte_level_bpe_files(self._ranks, self._specials, self._pattern, self._pad)

    def render_chat(self, messages: list[Message]) -> Segments:
        check_role_and_content_only(messages, self._chat_format)
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
        self.name = f"tiktoken:{sha256_of(data)}"
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
        self.chat_template = find_chat_template(self._path.parent, path, self._template_tokens)

    def render_chat(self, messages: list[Message]) -> Segments:
        if self.chat_template is None:
            return self._without_template(messages)
        text, spans = self.chat_template.assistant_spans(messages, self._turn_ends)
        ids, lengths = self._encode_rendered(text)
        spans = [tuple(self._bytes_before(text, i) for i in span) for span in spans]
        return labelled_runs(ids, lengths, spans, self.bos_id)

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
        self.name = f"sentencepiece:{sha256_of(data)}"
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
        self._turn_ends = (self._specials_pattern,)
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
        check_role_and_content_only(messages, "Llama 2's chat format")
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
            set_chat_template(files, self.chat_template.source.encode())
        return files


# ---- Hugging Face tokenizer.json


def _read_tokenizer_json(path: Path, chat_template: Path | None) -> Tokenizer:
    """The tokenizer of a tokenizer.json: the bytes tokenizer where it is that one's export (same
    JSON, same ids), else a BPE with byte fallback, else a byte-level BPE (other models refused)."""
    data = path.read_bytes()
    # GC off while the 100k+ merges and what is made of them live: its passes would outlast both.
    with _gc_paused():
        try:
            spec = json.loads(data)
        except ValueError as e:
            raise UsageError(f"{path}: not valid JSON ({e})") from e
        model = spec.get("model") or {}
        byte_fallback = model.get("type") == "BPE" and model.get("byte_fallback")
        kind = ByteFallbackBPETokenizer if byte_fallback else ByteLevelBPETokenizer
        read = kind(path, data, spec, chat_template)
    ours = ByteTokenizer()  # a bytes run's export, however re-saved: its data fits a run from it
    ids = (read.bos_id, read.eos_id, read.chat_template) == (ours.bos_id, ours.eos_id, None)
    same = ids and json.loads(data) == json.loads(ours.hf_files()["tokenizer.json"])
    return ours if same else read


class _JsonTokenizer(_TemplateTokenizer):
    """What both kinds of tokenizer.json share: the added tokens (cut from the text before the
    model sees it), the special tokens and chat template from the files beside it, and each
    id's `_bytes` (decoding) and `_lengths` (the bytes of the text it encodes as
    `_bytes_before` counts them). A subclass gives `_encode` and `_pieces`."""

    def _read_added(self, path: Path, spec: dict) -> dict[str, int]:
        added = {}
        for token in spec.get("added_tokens") or []:
            flags = [f for f in ("lstrip", "rstrip", "single_word") if token.get(f)]
            if flags:
                raise UsageError(
                    f"{path}: added token {token['content']!r} sets {', '.join(flags)}, which "
                    f"longtune does not reproduce"
                )
            added[token["content"]] = token["id"]
        # Added tokens that are not special (DeepSeek-R1's "<think>") are vocabulary, matched in
        # any text as `tokenizers` does; special ones only where a chat template writes them.
        special = {t["content"] for t in spec.get("added_tokens") or [] if t.get("special")}
        self._plain_added = set(added) - special
        self._added_pattern = _alternatives(added)
        self._plain_added_pattern = _alternatives(self._plain_added)
        # A turn ends at its last special token (not at Gemma's "\n", an added token too), or
        # where it has none at its last added one (an end-of-turn token added as not special).
        self._turn_ends = (_alternatives(special), self._added_pattern)
        return added

    def _read_specials(self, path: Path, data: bytes, ids: dict[str, int]) -> None:
        """BOS, EOS and pad from the files beside `path`, checked against the vocabulary."""
        self.name = f"tokenizer.json:{sha256_of(data)}"
        self._path, self._data = path, data
        tokens, special_ids = _hf_special_tokens(path.parent, ids)
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
            set_chat_template(files, self.chat_template.source.encode())
        return files

    def _cut(self, text: str, allowed_special: set[str] | str) -> list[str]:
        """`text` cut at `_encode`'s added tokens: text, token, ..., text."""
        pattern = self._added_pattern if allowed_special == "all" else self._plain_added_pattern
        return pattern.split(text) if pattern else [text]

    def _encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self._encode(text, allowed_special="all")
        return ids, self._lengths[ids]

    def _bytes_before(self, text: str, i: int) -> int:
        # The normalizer may change the text (NFC joins a decomposed accent; "▁" is 3 bytes):
        # the bytes of the normalized text, as `_lengths` counts them.
        return len("".join(self._pieces(text[:i], "all")).encode("utf-8", "surrogatepass"))

    def _without_template(self, messages: list[Message]) -> Segments:
        raise UsageError(
            f"tokenizer {self._path} has no chat template (in tokenizer_config.json or "
            f"chat_template.jinja) to render conversations with: give one with --chat-template FILE"
        )


# ---- A byte-level BPE, encoded by tiktoken

# GPT-2's split: the regex of HF's ByteLevel pre-tokenizer with use_regex.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# GPT-2's split after HF's Digits pre-tokenizer has cut every digit (or run of digits) into a
# piece of its own: no other piece holds a digit, so " ?\p{N}+" never matches, and a whitespace
# run before a digit ends its piece as it would end the text ("(?!\S)" sees the piece's end).
GPT2_AFTER_DIGITS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"


class ByteLevelBPETokenizer(_JsonTokenizer):
    """A HF tokenizer.json of a byte-level BPE (Llama 3's, Qwen's), encoded by tiktoken without
    `tokenizers`. tiktoken merges first the adjacent pair whose joined bytes rank lowest, HF's
    BPE the pair listed first in `merges`: so a merged token ranks by the first merge making
    it, after the single bytes (whose ranks never matter). Where the file's ids already rise in
    that order (any file `tokenizers` trained) they are the ranks, else a table maps ranks to
    ids. What this cannot encode as `tokenizers` does is refused, never approximated."""

    def __init__(self, path: Path, data: bytes, spec: dict, chat_template: Path | None):
        _check_byte_level_bpe(path, spec)
        vocab: dict[str, int] = spec["model"]["vocab"]
        pairs = _merge_pairs(path, spec["model"].pop("merges"), vocab)
        made = list(dict.fromkeys(map("".join, pairs)))
        self._nfc = (spec.get("normalizer") or {}).get("type") == "NFC"
        pattern = _split_pattern(path, spec.get("pre_tokenizer"))
        added = self._read_added(path, spec)
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
        self._special_ranks = specials
        self._read_specials(path, data, added | vocab)
        self._encoding = tiktoken.Encoding(
            self.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        _check_no_empty_match(path, self._encoding)
        self.use_chat_template(chat_template)

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
            return self._encode(without_lone_surrogates(text), allowed_special)
        except ValueError as e:  # its regex engine gives up past a count of backtracking steps
            raise UsageError(
                f"{self._path}: its pre-tokenizer's Split regex failed on a text of "
                f"{len(text):,} characters ({e}); expected a regex that does not backtrack "
                f"without bound"
            ) from None
        if self._table is not None:
            ids = self._table[ids]
        return ids[ids < self.vocab_size]  # bytes the vocabulary lacks

    def _pieces(self, text: str, allowed_special: set[str] | str) -> list[str]:
        """Cut at `_encode`'s added tokens (text, token, ..., text), texts NFC-normalized."""
        pieces = self._cut(text, allowed_special)
        if self._nfc:
            pieces[::2] = [unicodedata.normalize("NFC", piece) for piece in pieces[::2]]
        return pieces


# ---- A BPE with byte fallback, encoded by sentencepiece

# sentencepiece's piece types (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


class ByteFallbackBPETokenizer(_JsonTokenizer):
    """A HF tokenizer.json of a BPE with byte fallback (sentencepiece's kind: Llama 2's,
    Mistral's, Gemma's), encoded by sentencepiece from a model proto made of it. Of the adjacent
    pairs that join into a token, HF's BPE merges first the pair listed first in `merges`,
    sentencepiece the pair joining into the token of highest score, each the leftmost of equals:
    a token scores minus the place of its merges, where each token's merges are listed together
    and every split of a token into two tokens is a merge (a file converted from sentencepiece).
    The text is cut at the added tokens, each piece normalized here as the file's Prepend and
    Replace normalizers and Metaspace pre-tokenizer say. What this cannot encode as `tokenizers`
    does is refused, never approximated; unchecked: one token's different merges met at once."""

    def __init__(self, path: Path, data: bytes, spec: dict, chat_template: Path | None):
        model = spec["model"]
        flags = ["dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges"]
        if held := [flag for flag in flags if model.get(flag)]:
            raise UsageError(
                f"{path} holds a BPE with byte fallback and {', '.join(held)}, which longtune "
                f"does not encode faithfully"
            )
        vocab: dict[str, int] = model["vocab"]
        added = self._read_added(path, spec)
        _check_ids(path, vocab, added)
        by_id = {i: token for token, i in [*vocab.items(), *added.items()]}
        if len(by_id) != 1 + max(by_id):
            gap = min(set(range(len(by_id))) - by_id.keys())
            raise UsageError(f"{path}: no token has the id {gap}; expected ids 0 to {max(by_id)}")
        self.vocab_size = len(by_id)
        tokens = [by_id[i] for i in range(self.vocab_size)]
        self._replace, self._prepend, split = _space_rules(path, spec)
        self._added = added
        pieces = _sentencepiece_pieces(path, model, tokens, added, split)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=_model_proto(pieces))
        except RuntimeError as e:
            raise UsageError(f"{path}: sentencepiece refuses the BPE made of it ({e})") from e
        # Each id's text ("▁" a space; a Strip decoder's leading space kept), its normalized bytes.
        self._bytes = [
            bytes([int(p[3:5], 16)]) if kind == _BYTE else p.replace("▁", " ").encode()
            for p, _, kind in pieces
        ]
        lengths = [1 if kind == _BYTE else len(p.encode()) for p, _, kind in pieces]
        self._lengths = np.array(lengths, dtype=np.int64)
        self._read_specials(path, data, added | vocab)
        self.use_chat_template(chat_template)

    def _encode(self, text: str, allowed_special: set[str] | str) -> np.ndarray:
        pieces = self._pieces(text, allowed_special)
        try:
            encoded = iter(self._sp.encode([piece.encode() for piece in pieces[::2]]))
        except UnicodeEncodeError:  # lone surrogates, as ByteLevelBPETokenizer takes them
            return self._encode(without_lone_surrogates(text), allowed_special)
        ids = [next(encoded) if k % 2 == 0 else [self._added[p]] for k, p in enumerate(pieces)]
        return np.fromiter(chain.from_iterable(ids), dtype=np.int64)

    def _pieces(self, text: str, allowed_special: set[str] | str) -> list[str]:
        """Cut at `_encode`'s added tokens (text, token, ..., text), each text with its spaces
        as "▁" and a "▁" before it where `_prepend` says ("first": the text's start only)."""
        pieces = self._cut(text, allowed_special)
        for k in range(0, len(pieces), 2):
            piece = pieces[k].replace(" ", "▁") if self._replace else pieces[k]
            wanted = {"every": True, "always": True, "first": k == 0, "never": False}[self._prepend]
            if piece and wanted and (self._prepend == "every" or not piece.startswith("▁")):
                piece = "▁" + piece
            pieces[k] = piece
        return pieces


def _space_rules(path: Path, spec: dict) -> tuple[bool, str, bool]:
    """Whether a space becomes "▁"; where a "▁" goes before a text: "every" (the Prepend
    normalizer), "always" or "first" unless it starts with one (Metaspace's schemes), "never";
    whether the text is split before each "▁" (Metaspace's split)."""
    normalizer, pre_tokenizer = spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = (normalizer or {}).get("normalizers", [normalizer]) if normalizer else []
    replace, prepend, split = False, "never", False
    for step in steps:
        if step == {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}:
            replace = True
        elif step == {"type": "Prepend", "prepend": "▁"}:
            prepend = "every"
        else:
            raise UsageError(
                f"{path}: its normalizer step {json.dumps(step, ensure_ascii=False)} is not one "
                f'longtune reproduces for a BPE with byte fallback; it reads Replace of " " by '
                f'"▁" and Prepend of "▁"'
            )
    kind = (pre_tokenizer or {}).get("type")
    at_spaces = pre_tokenizer and pre_tokenizer.get("pattern") == {"String": " "}
    if kind == "Metaspace" and pre_tokenizer.get("replacement") == "▁":
        scheme = pre_tokenizer.get("prepend_scheme")
        scheme = scheme or ("always" if pre_tokenizer.get("add_prefix_space", True) else "never")
        replace, prepend = True, prepend if prepend == "every" else scheme
        split = pre_tokenizer.get("split", True)
    elif not (pre_tokenizer is None or kind == "Split" and at_spaces and replace):
        raise UsageError(
            f"{path}: its pre-tokenizer {json.dumps(pre_tokenizer, ensure_ascii=False)} is not "
            f'one longtune reproduces for a BPE with byte fallback; it reads Metaspace with "▁", '
            f'or a Split at " " after the normalizer has replaced every space'
        )
    for token in spec.get("added_tokens") or []:
        # Matched in the normalized text, and cut from it after the Prepend: refused where it
        # would not match as in the text itself.
        if token.get("normalized") and (prepend == "every" or " " in token["content"]):
            raise UsageError(
                f"{path}: added token {token['content']!r} is matched in the normalized text "
                f"(normalized: true), which longtune does not reproduce with its normalizer"
            )
    return replace, prepend, split


def _sentencepiece_pieces(
    path: Path, model: dict, tokens: list[str], added: dict[str, int], split: bool
) -> list[tuple[str, float, int]]:
    """Each id's sentencepiece piece, score and type: a token made by merges or a character
    scores minus the place of its merges (normal); the 256 bytes are <0xNN> (byte); the unknown
    token, the added ones and tokens no merge makes are never made from text (control)."""
    unknown = model.get("unk_token")
    if unknown not in tokens:
        raise UsageError(f"{path}: the BPE's unk_token {unknown!r} is not in its vocabulary")
    byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
    if missing := sorted(byte_tokens - set(tokens)):
        raise UsageError(
            f"{path}: byte fallback lacks {len(missing)} of the 256 byte tokens, e.g. {missing[0]}"
        )
    pairs = _merge_pairs(path, model.pop("merges"), model["vocab"])
    made = [token for token, _ in groupby(map("".join, pairs))]
    place = {token: -float(k) for k, token in enumerate(made)}
    if len(place) < len(made):
        token = next(t for t, n in Counter(made).items() if n > 1)
        raise UsageError(
            f"{path}: the merges making {token!r} are not listed together, so no score of the "
            f"token orders them as `tokenizers` does (expected merges in their tokens' order)"
        )
    plain = set(tokens) - set(added) - byte_tokens - {unknown}
    normal = {t for t in plain if len(t) == 1 or t in place}
    sizes = {len(t) for t in normal}  # a part is a token, so of one of these lengths
    cuts = ((t, i) for t in normal for i in range(1, len(t)) if i in sizes and len(t) - i in sizes)
    joined = {(t[:i], t[i:]) for t, i in cuts if t[:i] in normal and t[i:] in normal}
    if unmerged := joined - set(map(tuple, pairs)):
        left, right = min(unmerged)
        raise UsageError(
            f"{path}: {left!r} and {right!r} join into the token {left + right!r}, but no merge "
            f"joins them, which sentencepiece's BPE would (expected every split of a token "
            f"into two tokens among its merges, as converted from sentencepiece)"
        )
    if lacking := set("".join(normal)) - normal:
        raise UsageError(
            f"{path}: the character {min(lacking)!r} is in a token but is no token itself, so "
            f"`tokenizers` writes its bytes where sentencepiece would merge it"
        )
    if split and (inner := next((t for t in normal if "▁" in t[1:]), None)):
        raise UsageError(
            f'{path}: its Metaspace pre-tokenizer splits before each "▁", which the token '
            f"{inner!r} holds past its start (expected split: false)"
        )
    kinds = {unknown: _UNKNOWN} | dict.fromkeys(byte_tokens, _BYTE) | dict.fromkeys(normal, _NORMAL)
    return [(t, place.get(t, 0.0), kinds.get(t, _CONTROL)) for t in tokens]


def _model_proto(pieces: list[tuple[str, float, int]]) -> bytes:
    """A sentencepiece ModelProto of `pieces`, written in protobuf's wire format (protobuf is no
    dependency): a BPE with byte fallback, and a normalizer that changes nothing (no character
    map, no "▁" before the text, spaces kept: `_pieces` normalized the text already)."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes([*out, n])

    def message(field: int, payload: bytes) -> bytes:  # a length-delimited field
        return varint(field << 3 | 2) + varint(len(payload)) + payload

    def number(field: int, value: int) -> bytes:  # a varint field
        return varint(field << 3) + varint(value)

    def piece(text: bytes, score: float, kind: int) -> bytes:  # fields 1-3: piece, score, type
        body = b"\n" + varint(len(text)) + text + struct.pack("<BfBB", 0x15, score, 0x18, kind)
        return b"\n" + varint(len(body)) + body

    out = [piece(p.encode(), s, kind) for p, s, kind in pieces]
    trainer = number(3, 2) + number(35, 1)  # model_type BPE, byte_fallback
    normalizer = message(2, b"") + number(3, 0) + number(4, 0) + number(5, 0)
    return b"".join([*out, message(2, trainer), message(3, normalizer)])


def _check_byte_level_bpe(path: Path, spec: dict) -> None:
    """Refuse, naming what the file holds, a tokenizer.json tiktoken cannot encode faithfully."""
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if model.get("type") != "BPE":
        holds = f"a {model.get('type') or 'typeless'} model"
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


def _merge_pairs(path: Path, merges: list, vocab: dict[str, int]) -> list:
    """`merges` ([left, right], or "left right") as pairs, each joining into a token."""
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
    return pairs


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


# Where a Hugging Face checkpoint directory keeps its tokenizer, in the order looked for.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")


def tokenizer_file(directory: str | Path) -> Path | None:
    """The tokenizer file of a HF checkpoint directory, if any: tokenizer.model before a
    tokenizer.json converted from it (a BPE with byte fallback), the original before its copy."""
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
            raise UsageError(f"tokenizer file {path} not found ({LOCAL_PATH})")
        if path.stat().st_size == 0:
            raise UsageError(f"tokenizer file {path} is empty")
        with open(path, "rb") as f:
            first_line = f.readline(1024)
        if first_line.lstrip().startswith(b"{"):
            try:
                return _read_tokenizer_json(path, chat_template and Path(chat_template))
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


def set_chat_template(files: dict[str, bytes], template: bytes) -> None:
    """Makes chat_template.jinja the only template: one in tokenizer_config.json could differ."""
    config = json.loads(files.get("tokenizer_config.json", b"{}"))
    config.pop("chat_template", None)
    files["tokenizer_config.json"] = _json_bytes(config)
    files["chat_template.jinja"] = template


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


def without_lone_surrogates(value):
    """Each lone UTF-16 surrogate in `value`'s strings made U+FFFD, as tiktoken's encode does:
    JSON can escape one, but no UTF-8 text holds one, and no tokenizer encodes one."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: without_lone_surrogates(v) for k, v in value.items()}
    return value


def sha256_of(data: bytes) -> str:
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

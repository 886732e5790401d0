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
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np
import sentencepiece
import tiktoken

from chat_template import Message, find_chat_template
from files import UsageError, read_json

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
            set_chat_template(files, self.chat_template.source.encode())
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
        self.name = f"tokenizer.json:{sha256_of(data)}"
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
            set_chat_template(files, self.chat_template.source.encode())
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

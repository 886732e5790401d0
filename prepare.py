"""`prepare`: text files and files of records (.jsonl, a .json array, .parquet, .csv: plain text,
prompt/response pairs, chat conversations, TRL's prompt/completion, ShareGPT and Alpaca records
mapped to them) into a dataset directory, encoded by a pool of workers; `show`, the first
examples as they would be trained; then the default corpus. The order: prepare and show, the
dataset writer, reading the inputs (files, records, their shapes), encoding them, the default
corpus. The format `prepare` writes (and data.py's TokenDataset reads) is a directory of three
files:
    tokens.bin     uint32, documents back to back, each BOS (if there is one) + tokens + EOS
    loss_mask.bin  uint8, one per token: bit 0 (LABEL) where the token may be a label (not in an
                   SFT prompt, nor a document's first token); bit 1 (BOS_INSIDE) on a BOS inside a
                   document (a chat template's before each exchange, as Llama 2's); bit 2
                   (STARTS_DOCUMENT) on a document's first token where no BOS marks it
    meta.json      the tokenizer that wrote it, the counts the files must match, and "sft": true
                   when prompts are unlabelled, so training keeps packed documents apart by default

    python data.py prepare --input docs/ chat.jsonl --output data/mine [--tokenizer DIR_OR_FILE]
"""

import csv
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import sysconfig
import time
from collections import Counter, defaultdict, deque
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, groupby, islice
from pathlib import Path
from typing import BinaryIO

import numpy as np

from files import NO_SPACE, OutputDir, UsageError, no_space, plural, read_json
from tokenizer import (
    ByteTokenizer,
    Message,
    Segments,
    Tokenizer,
    load_tokenizer,
    sha256_of,
    without_lone_surrogates,
)

FORMAT_VERSION = 1
LABEL, BOS_INSIDE, STARTS_DOCUMENT = 1, 2, 4  # the bits of loss_mask.bin
META_FIELDS = {  # what meta.json holds besides format_version
    "tokenizer": str,
    "vocab_size": int,
    "bos_id": int | None,  # None: the tokenizer has no BOS
    "eos_id": int,
    "n_tokens": int,
    "n_documents": int,
}


# (prompt, text), prompt "" for a text; or (messages, how many of them are a prompt: its
# assistant turns are not trained on, as TRL's completion_only_loss)
Example = tuple[str, str] | tuple[list[Message], int]
RECORD_SUFFIXES = (".jsonl", ".parquet", ".csv")
HUB_IMAGES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".svg")  # a card's pictures
# datasets.load_dataset's names for the splits of a hub dataset's folder: a word of a file's or
# a directory's name, between its ends or non-word characters (-, _, ., space, digits)
SPLITS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
SPLIT_WORD = re.compile(
    rf"(?:^|[-_. 0-9])({'|'.join(w for words in SPLITS.values() for w in words)})(?:[-_. 0-9]|$)",
    re.IGNORECASE,
)
# Why a directory's files are passed over (`_folder_files`): what `reading_notes` says of them
PASSED_OVER = {
    "hub metadata": "{n} of hub metadata beside the record files not read",
    "prepared dataset": "{n} inside the inputs not read (train.py --data takes a prepared dataset)",
    "reached twice": "{n} reached by more than one path (given twice, or a link) read once",
    "no split": "{n} naming no split beside the train split not read (as datasets does)",
    "split": "the hub dataset's {split} split not read, only its train split ({n}; prepare it "
    "alone, --input its files, e.g. for train.py --eval-data)",
}
NAMED = 5  # the paths a note names beside their count, as meta.json keeps them
InputFile = tuple[Path, str]  # and how it is read: a suffix of RECORD_SUFFIXES, ".json" or "text"
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
    text_column: str | None = None,
) -> Path:
    """Tokenize `inputs` into the dataset directory `output_dir`, replacing any there. Each
    input is a text file (one document), a file of records (.jsonl, a .json array, .parquet, or
    .csv with a `text_column`) of one of the shapes `_example` reads, or a directory standing
    for its files (`_input_files`). With `seq_len`, longer conversations are split
    (`_split_conversation`); meta.json counts the splits, the documents still longer, those
    trained on whole, each shape's records, the files of a directory passed over (by why) and
    its .json files read as text.
    Output is the same for any number of workers (None: one per CPU)."""
    files, passed_over, tokenizer = _open_inputs(
        inputs, tokenizer_path, chat_template, seq_len, text_column
    )
    output = Path(output_dir).resolve()
    if inside := [str(f) for f, _ in files if output in f.resolve().parents]:
        raise UsageError(f"the inputs {inside} are inside the output directory {output_dir}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise UsageError(f"workers must be at least 1, got {workers}")
    progress = _Progress(total_bytes=sum(f.stat().st_size for f, _ in files))
    split, pieces, longest, too_long, whole, shapes = 0, 0, 0, 0, 0, Counter()
    with progress, DatasetWriter(output_dir) as writer:
        loading = (tokenizer_path, chat_template)
        examples = _read_documents(files, text_column or "text", shapes)
        for documents, n_bytes in _encode_all(examples, tokenizer, loading, seq_len, workers):
            if len(documents) > 1:
                split, pieces = split + 1, pieces + len(documents)
            for tokens, mask in documents:
                writer.add(tokens, mask)
                # An unlabelled token after the first (BOS or not) is a prompt: a document
                # with none is trained on whole, and any other makes the data SFT data.
                whole += bool((mask[1:] & LABEL).all())
                longest = max(longest, len(tokens))
                too_long += seq_len is not None and len(tokens) > seq_len
            progress.update(n_bytes, len(documents), sum(len(t) for t, _ in documents))
        if writer.n_documents == 0:
            raise UsageError(f"no documents in the inputs {[str(f) for f, _ in files]}")
        template = getattr(tokenizer, "chat_template", None)
        notes, json_as_text = _kept_notes(passed_over, files)
        return writer.finish(
            tokenizer,
            sft=whole < writer.n_documents,
            files={DATASET_CHAT_TEMPLATE: template.source.encode()} if template else {},
            chat_template=template and template.name,
            longest_document=longest,
            split_seq_len=seq_len,
            n_conversations_split=split,
            n_documents_from_splits=pieces,
            n_documents_longer_than_seq_len=too_long,
            records_by_shape=dict(shapes),
            n_documents_trained_whole=whole,
            inputs_passed_over=notes,
            json_read_as_text=json_as_text,
        )


def show(
    inputs: Iterable[str | Path],
    n: int,
    tokenizer_path: str | Path | None = None,
    chat_template: str | Path | None = None,
    seq_len: int | None = None,
    text_column: str | None = None,
    color: bool = False,
) -> str:
    """The first `n` examples of `inputs` as `prepare` would write them, decoded, the trained
    tokens (labels) between ⟦ and ⟧, or green with `color` (for a terminal): what axolotl's
    preprocess --debug shows, to check a template and its labels before a run."""
    if n < 1:
        raise UsageError(f"show takes a number of examples of at least 1, got {n}")
    files, passed_over, tokenizer = _open_inputs(
        inputs, tokenizer_path, chat_template, seq_len, text_column
    )
    shapes = Counter()
    examples = list(islice(_read_documents(files, text_column or "text", shapes), n))
    encoded = _encode_all(iter(examples), tokenizer, (tokenizer_path, chat_template), seq_len, 1)
    marks = ("\x1b[32m", "\x1b[0m") if color else ("⟦", "⟧")
    lines = [f"trained tokens are {'green' if color else 'between ⟦ and ⟧'}"]
    for (_, _, where), (documents, _) in zip(examples, encoded, strict=True):
        for tokens, mask in documents:
            trained = int(np.count_nonzero(mask & LABEL))
            lines.append(f"--- {where}: {len(tokens):,} tokens, {trained:,} trained")
            lines.append(_marked(tokenizer, tokens, mask, marks))
    notes = reading_notes(shapes, *_kept_notes(passed_over, files))
    return "\n".join(lines + notes)


def reading_notes(
    shapes: dict[str, int], passed_over: dict[str, dict], json_read_as_text: dict
) -> list[str]:
    """What `show` and prepare's summary say of how the inputs were read: a line for each shape
    of record mapped to messages, for each reason files of a directory were passed over
    (PASSED_OVER), and for the .json files read as text; of files as `_kept_notes` lists them."""
    notes = [
        f"{plural(n, f'{shape} record')} mapped to messages: {MAPPINGS[shape]}"
        for shape, n in shapes.items()
        if shape in MAPPINGS
    ]
    for why, listed in passed_over.items():
        split = why.removesuffix(" split")
        n = plural(listed["n"], "prepared dataset" if why == "prepared dataset" else "file")
        note = PASSED_OVER.get(why, PASSED_OVER["split"]).format(n=n, split=split)
        notes.append(f"{note}: {_some(listed)}")
    if json_read_as_text["n"]:
        notes.append(
            f"{plural(json_read_as_text['n'], '.json file')} read as text, as every file of a "
            f"folder that holds more than records and hub metadata: {_some(json_read_as_text)}"
        )
    return notes


def _some(listed: dict) -> str:
    return ", ".join(listed["first"]) + (", ..." if listed["n"] > len(listed["first"]) else "")


def _kept_notes(
    passed_over: dict[str, list[str]], files: list[InputFile]
) -> tuple[dict[str, dict], dict]:
    """The files passed over, by why, and the .json files read as text, as meta.json keeps and
    `reading_notes` names them: each a count and the first NAMED paths (a tree's thousands of
    package.json files, or a hub dataset's test shards, would swell meta.json)."""
    as_text = [str(p) for p, kind in files if kind == "text" and p.suffix.lower() == ".json"]
    return {why: _listed(paths) for why, paths in passed_over.items()}, _listed(as_text)


def _listed(paths: list[str]) -> dict:
    return {"n": len(paths), "first": paths[:NAMED]}


def _open_inputs(
    inputs: Iterable[str | Path],
    tokenizer_path: str | Path | None,
    chat_template: str | Path | None,
    seq_len: int | None,
    text_column: str | None,
) -> tuple[list[InputFile], dict[str, list[str]], Tokenizer]:
    files, passed_over = _input_files(inputs, text_column)
    # A bad tokenizer or template fails here, not in each worker.
    tokenizer = load_tokenizer(tokenizer_path, chat_template)
    if seq_len is not None and seq_len < 1:
        raise UsageError(f"seq_len must be at least 1 (or None: split nothing), got {seq_len}")
    return files, passed_over, tokenizer


def _marked(tokenizer: Tokenizer, tokens: np.ndarray, mask: np.ndarray, marks: tuple) -> str:
    pieces = []
    labels = (mask & LABEL).tolist()
    for label, run in groupby(zip(tokens.tolist(), labels, strict=True), key=lambda t: t[1]):
        text = _decoded(tokenizer, [token for token, _ in run])
        pieces.append(f"{marks[0]}{text}{marks[1]}" if label else text)
    return "".join(pieces)


def _decoded(tokenizer: Tokenizer, ids: list[int]) -> str:
    """`ids` as text, a BOS or EOS the tokenizer decodes to nothing (bytes', sentencepiece's)
    named: where a document starts and a turn ends is what a reader checks."""
    names = {tokenizer.bos_id: "<bos>", tokenizer.eos_id: "<eos>"}
    text = []
    for special, run in groupby(ids, key=names.__contains__):
        run = list(run)
        if special:
            text += [tokenizer.decode([i]) or names[i] for i in run]
        else:
            text.append(tokenizer.decode(run))
    return "".join(text)


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


def _input_files(
    inputs: Iterable[str | Path], text_column: str | None = None
) -> tuple[list[InputFile], dict[str, list[str]]]:
    """The files to read, each once, where first reached (one reached by more than one path,
    given twice or a link, is said to be), and those of the inputs' directories passed over, by
    why (PASSED_OVER), each once, none that is read. A directory stands for its files
    (`_folder_files`), whose reading of a file wins over its reading alone; between two readings
    alone (a file and a link to it), the first wins. Refused: a .json file named alone that is
    not a JSON array of records (`_json_records`), a prepared dataset (its binary files would
    train on their syntax), a file two directories read differently, a .csv without
    `text_column`, and parquet without pyarrow."""
    inputs, files, passed_over = [Path(i) for i in inputs], {}, defaultdict(list)
    twice = []
    for item in inputs:
        if _is_dataset(item):
            raise UsageError(
                f"input {item} is a prepared dataset: pass it to train.py --data, or give "
                f"prepare the files it was made from"
            )
        if item.is_dir():
            found, folder = _folder_files(item, passed_over), item
        elif item.is_file():
            found, folder = [(item, _kind(item, in_folder=False))], None
        else:
            raise UsageError(f"input {item} not found")
        for path, kind in found:
            if (key := path.resolve()) in files:
                twice.append(key)
            first, first_kind, first_folder = files.setdefault(key, (path, kind, folder))
            # A folder's reading wins over a reading alone, in either order; else the first.
            if first_folder is None and folder is not None:
                files[key] = (first, kind, folder)
            elif folder is not None and kind != first_kind:
                raise UsageError(
                    f"input {path} is read as {first_kind} within {first_folder} and as {kind} "
                    f"within {folder}: give one of them"
                )
    if not files:
        raise UsageError(f"no files in the inputs {[str(i) for i in inputs]}")
    for path, kind, _ in files.values():  # before any is read
        if kind == ".csv" and text_column is None:
            raise UsageError(
                f"input {path}: a .csv file is read only with --text-column NAME, the column "
                f"that holds each row's document (its other columns are not trained on)"
            )
        if kind == ".parquet":
            _parquet_module(path)
    notes = {why: _unread(paths, files.keys()) for why, paths in passed_over.items()}
    notes["reached twice"] = [str(files[key][0]) for key in dict.fromkeys(twice)]
    return [(path, kind) for path, kind, _ in files.values()], {w: p for w, p in notes.items() if p}


def _unread(paths: list[str], read: Container[Path]) -> list[str]:
    """`paths` each once, by the file each leads to, those of `read` left out."""
    return list({key: p for p in paths if (key := Path(p).resolve()) not in read}.values())


def _folder_files(folder: Path, passed_over: dict[str, list[str]]) -> list[InputFile]:
    """A directory's files, sorted, hidden ones and prepared datasets within left out, each
    read as `_kind` says. One whose files are record files (.jsonl, .parquet, .csv, a .json
    array or JSON Lines) and hub metadata alone (a downloaded hub dataset) stands for the
    record files of one split (`_hub_split`): its card is no document. Any other mix (a code
    tree with a fixture .jsonl) reads every file."""

    def hidden(path: Path) -> bool:
        return any(part.startswith(".") for part in path.relative_to(folder).parts)

    datasets = sorted(
        p.parent for p in folder.rglob(DATASET.marker) if not hidden(p) and _is_dataset(p.parent)
    )
    passed_over["prepared dataset"] += map(str, datasets)
    found = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not hidden(p) and not any(d in p.parents for d in datasets)
    )
    read = [(p, _kind(p, in_folder=True)) for p in found]
    others = [p for p, kind in read if kind == "text"]
    if len(others) == len(read) or not all(_is_hub_metadata(p, folder) for p in others):
        # A tree of texts: its .json files are texts too, whatever they hold.
        return [(p, "text" if p.suffix.lower() == ".json" else kind) for p, kind in read]
    passed_over["hub metadata"] += map(str, others)
    return _hub_split(folder, [(p, kind) for p, kind in read if kind != "text"], passed_over)


def _hub_split(
    folder: Path, records: list[InputFile], passed_over: dict[str, list[str]]
) -> list[InputFile]:
    """The record files a hub dataset's folder stands for, as datasets.load_dataset reads it:
    where no file names a split (`_split`), all of them; else those of its train split, the
    others passed over; with no train split, those of its one split where every file names it.
    No train split and several splits, or files naming none beside: refused (which to read is
    the user's choice, not a guess)."""
    splits = {p: _split(p, folder) for p, _ in records}
    named = sorted({split for split in splits.values() if split})
    if not named:
        return records
    unnamed = list(splits.values()).count(None)
    if "train" not in named and (len(named) > 1 or unnamed):
        beside = f" and {plural(unnamed, 'file')} naming no split" if unnamed else ""
        raise UsageError(
            f"input {folder}: a hub dataset of the {' and '.join(named)} "
            f"split{'s' * (len(named) > 1)}{beside}, no train split: prepare one, --input its "
            f"files (e.g. for train.py --eval-data)"
        )
    read = "train" if "train" in named else named[0]
    for path, split in splits.items():
        if split != read:
            passed_over[f"{split} split" if split else "no split"].append(str(path))
    return [(p, kind) for p, kind in records if splits[p] == read]


def _split(path: Path, folder: Path) -> str | None:
    """The split (of SPLITS) that `path`'s directories within `folder` name, else its name:
    data/test/0.parquet and data/test-00000-of-00001.parquet are both of the test split."""
    for part in path.relative_to(folder).parts:
        if word := SPLIT_WORD.search(part):
            return next(s for s, words in SPLITS.items() if word[1].lower() in words)
    return None


def _is_dataset(path: Path) -> bool:
    return (path / DATASET.marker).is_file() and (path / "tokens.bin").is_file()


def _kind(path: Path, in_folder: bool) -> str:
    """How a file is read: by its suffix, but a .json file in a folder as records only when it
    holds a JSON array of objects, or JSON Lines (as ".jsonl"), as datasets' json loader reads
    either (a hub dataset's data, if the folder is one), else as text (a code tree's
    package.json); a malformed one is refused when read."""
    suffix = path.suffix.lower()
    if suffix == ".json" and in_folder:
        with path.open("rb") as f:
            head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
            if head[:1] == b"[" and head[1:].lstrip()[:1] == b"{":
                return suffix
            f.seek(0)
            return ".jsonl" if _holds_json_lines(f) else "text"
    return suffix if suffix in (*RECORD_SUFFIXES, ".json") else "text"


def _holds_json_lines(f: BinaryIO) -> bool:
    """Whether the first two non-empty lines of `f` are each a JSON object (one line of more
    than 16 MB is not read whole, and so is none)."""
    objects = 0
    while objects < 2 and (line := f.readline(1 << 24)):
        if line.strip():
            try:
                if not isinstance(json.loads(line), dict):
                    return False
            except (ValueError, RecursionError):
                return False
            objects += 1
    return objects == 2


def _is_hub_metadata(path: Path, folder: Path) -> bool:
    """A file a hub dataset's repository holds beside its data, at its top: its card
    (README.md), dataset_infos.json, a license, a citation (CITATION.cff), an image (hidden
    files, such as .gitattributes, are left out before). A docs tree's other .md files are
    documents."""
    name = path.name.lower()
    top = path.parent == folder and (
        name in ("readme.md", "dataset_infos.json") or name.startswith(("license", "citation"))
    )
    return top or path.suffix.lower() in HUB_IMAGES


def _read_documents(files: list[InputFile], text_key: str, shapes: Counter) -> Iterator[Document]:
    """Each file's examples, counting in `shapes` the shapes of their records (`_example`)."""
    for path, kind in files:
        match kind:
            case ".jsonl":
                records = _jsonl_records(path)
            case ".json":
                records = _json_records(path)
            case ".parquet":
                records = _parquet_records(path, text_key)
            case ".csv":
                records = _csv_records(path, text_key)
            case _:
                if text := _read_text(path):
                    yield ("", text), path.stat().st_size, str(path)
                continue
        for record, n_bytes, where in records:
            example, shape = _example(record, where, text_key)
            shapes[shape] += 1
            yield example, n_bytes, where


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path} is not UTF-8 text (bad byte at offset {e.start}); inputs are UTF-8 "
            f"text files, one document each, or .jsonl, .parquet or .csv files"
        ) from e
    if "\0" in text:  # valid UTF-8, yet binary: NUL is in no text a model should learn
        raise UsageError(
            f"{path} holds NUL bytes (at offset {data.index(0)}): a binary file, not "
            f"text; inputs are UTF-8 text files, one document each, or .jsonl, .parquet or "
            f".csv files"
        )
    return text


# Records: (the record, its bytes of input, where it is)


def _jsonl_records(path: Path) -> Iterator[tuple[object, int, str]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UsageError(f"{where}: not valid UTF-8 JSON ({e})") from e
            except RecursionError:  # json's C parser recurses once per level of nesting
                raise UsageError(f"{where}: JSON nested too deep to read") from None
            if b"\\ud" in line.lower():  # an escaped UTF-16 surrogate, maybe a lone one
                record = without_lone_surrogates(record)
            yield record, len(line), where


def _json_records(path: Path) -> Iterator[tuple[object, int, str]]:
    """A JSON array of records (alpaca_data.json), read whole as datasets' json loader reads it.
    A record's bytes are its share of the file's size."""
    content = path.read_bytes()
    try:
        records = json.loads(content)
    except ValueError as e:
        raise UsageError(
            f"input {path}: not a JSON array of records ({e}); rename it .jsonl if it holds one "
            f"JSON object a line"
        ) from e
    except RecursionError:
        raise UsageError(f"input {path}: JSON nested too deep to read") from None
    if not isinstance(records, list):
        raise UsageError(
            f"input {path}: a .json file is read as a JSON array of records, this one holds a "
            f"JSON {'object' if isinstance(records, dict) else type(records).__name__}"
        )
    if b"\\ud" in content.lower():  # an escaped UTF-16 surrogate, maybe a lone one
        records = without_lone_surrogates(records)
    size, n = len(content), len(records)
    for i, record in enumerate(records):
        yield record, size * (i + 1) // n - size * i // n, f"{path} record {i + 1}"


def _parquet_module(path: Path):
    try:
        import pyarrow.parquet
    except ImportError:
        raise UsageError(
            f"input {path}: parquet is read with pyarrow: pip install pyarrow"
        ) from None
    return pyarrow


PARQUET_BATCH_ROWS = 64  # in memory at once, beside the row group being read: 64 long documents


def _parquet_records(path: Path, text_key: str) -> Iterator[tuple[object, int, str]]:
    """A batch of rows at a time, only the columns a shape reads: a hub dataset's file may be
    larger than memory. A row's bytes are its share of the file's (compressed) size."""
    pyarrow = _parquet_module(path)
    try:
        file = pyarrow.parquet.ParquetFile(path)
        size, n_rows = path.stat().st_size, file.metadata.num_rows
        columns = [c for c in file.schema_arrow.names if c in RECORD_KEYS or c == text_key]
        row = 0
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            for record in batch.to_pylist():
                row += 1
                yield record, size * row // n_rows - size * (row - 1) // n_rows, f"{path} row {row}"
    except pyarrow.ArrowException as e:
        raise UsageError(f"input {path}: not a parquet file pyarrow can read ({e})") from e


def _csv_records(path: Path, text_key: str) -> Iterator[tuple[object, int, str]]:
    """Rows of the stdlib's csv dialect (quoted fields may hold newlines), a header first."""
    csv.field_size_limit(sys.maxsize)  # a document is longer than csv's 128 KiB default
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            if text_key not in (reader.fieldnames or []):
                raise UsageError(
                    f"input {path}: no column {text_key!r} (--text-column) in its header "
                    f"{reader.fieldnames}"
                )
            for row, record in enumerate(reader, 1):
                text = record[text_key]
                yield {text_key: text}, len(text or ""), f"{path} row {row}"
        except UnicodeDecodeError as e:
            raise UsageError(f"input {path}: not UTF-8 text ({e})") from e
        except csv.Error as e:
            raise UsageError(f"input {path} line {reader.line_num}: not CSV ({e})") from e


# Shapes: each record becomes an example, as one of these (other fields of it are not read)

RECORD_KEYS = ("text", "prompt", "response", "completion", "messages", "conversations")
RECORD_KEYS += ("instruction", "input", "output", "system")
SHAPES = (
    'a string "text" (or --text-column\'s), strings "prompt" and "response" (or "completion"), '
    'lists of messages "prompt" and "completion", a list "messages", a list "conversations" '
    '(ShareGPT: "from" and "value"), or strings "instruction" and "output" (Alpaca: "input" and '
    '"system" optional)'
)
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user"}
SHAREGPT_ROLES |= {"gpt": "assistant", "assistant": "assistant"}
# The shapes whose records are conversations, which prepare --seq-len splits.
CONVERSATION_SHAPES = ("messages", "ShareGPT", "Alpaca", "conversational prompt/completion")
MAPPINGS = {  # the shapes mapped to messages, as prepare's summary says
    "ShareGPT": "conversations' from human or user -> user, gpt or assistant -> assistant, "
    "system -> system, value -> content",
    "Alpaca": 'system -> system, instruction + "\\n\\n" + input -> user, output -> assistant '
    '(a "text" beside them is not read)',
}


def _example(record: object, where: str, text_key: str) -> tuple[Example, str]:
    """The example of a record, and the name of its shape: the first it has of messages,
    ShareGPT, prompt/response (TRL's string prompt/completion too), TRL's conversational
    prompt/completion (lists of messages), Alpaca, then text. A text beside a shape of prompts
    is not read, as TRL takes a prompt before its text field: tatsu-lab/alpaca's "text" is its
    instruction, input and output written into one, which would train on the prompt. A null
    field counts as absent: a table (parquet, or JSONL written from one) has every column in
    every row."""
    if isinstance(record, dict):
        record = {key: value for key, value in record.items() if value is not None}
        if "messages" in record:
            return (_check_messages(record["messages"], where), 0), "messages"
        if "conversations" in record:
            messages = _from_sharegpt(record["conversations"], where)
            return (_check_messages(messages, where, "conversations"), 0), "ShareGPT"
        prompt, answer = record.get("prompt"), record.get("response", record.get("completion"))
        if isinstance(prompt, str) and isinstance(answer, str):
            return (prompt, answer), "prompt/response"
        if isinstance(prompt, list) and isinstance(answer, list):
            messages = _check_messages(prompt + answer, where, "prompt + completion")
            if all(m["role"] != "assistant" for m in answer):
                raise UsageError(
                    f"{where}: completion has no assistant turn, so nothing to train on"
                )
            return (messages, len(prompt)), "conversational prompt/completion"
        alpaca = ("instruction", "output", "input", "system")
        if {"instruction", "output"} <= record.keys() and all(
            isinstance(record.get(key, ""), str) for key in alpaca
        ):
            return (_check_messages(_from_alpaca(record), where), 0), "Alpaca"
        if isinstance(record.get(text_key), str):
            return ("", record[text_key]), "text"
    got = f"its keys are {sorted(record)}" if isinstance(record, dict) else f"got {record!r:.80}"
    raise UsageError(f"{where}: expected a record (a JSON object, or a row) with {SHAPES}; {got}")


def _from_sharegpt(turns: object, where: str) -> list[Message]:
    if not isinstance(turns, list) or not turns:
        raise UsageError(
            f'{where}: "conversations" must be a non-empty list of {{"from": ..., "value": ...}} '
            f"objects (ShareGPT), got {json.dumps(turns, default=str)[:80]}"
        )
    messages = []
    for i, turn in enumerate(turns):
        role = turn.get("from") if isinstance(turn, dict) else None
        if role not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise UsageError(
                f'{where}: conversations[{i}] must be an object with "from" one of '
                f'{tuple(SHAREGPT_ROLES)} and a string "value" (ShareGPT), got '
                f"{json.dumps(turn, default=str)[:80]}"
            )
        messages.append({"role": SHAREGPT_ROLES[role], "content": turn["value"]})
    return messages


def _from_alpaca(record: dict) -> list[Message]:
    user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    return [
        *system,
        {"role": "user", "content": user},
        {"role": "assistant", "content": record["output"]},
    ]


def _check_messages(messages: object, where: str, field: str = "messages") -> list[Message]:
    """Each message kept whole: its fields beyond role and content are for a chat template.
    `field`: the record's, as errors name it."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(
            f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} '
            f"objects, got {json.dumps(messages, default=str)[:80]}"
        )
    has_system = isinstance(messages[0], dict) and messages[0].get("role") == "system"
    for i, message in enumerate(messages):
        name = f"{field}[{i}]"
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
        raise UsageError(f"{where}: {field} has no assistant turn, so nothing to train on")
    return messages


def _encode_document(
    tokenizer: Tokenizer, document: Document, seq_len: int | None
) -> tuple[list[Encoded], int]:
    """The documents of one example (one, or several for a conversation split at seq_len), and
    its bytes of input."""
    example, n_bytes, where = document
    if isinstance(example[0], list):
        messages, n_prompt = example
        untrained = {id(m) for m in messages[:n_prompt] if m["role"] == "assistant"}
        encoded, bos = [], tokenizer.bos_id
        try:
            for piece in _split_conversation(tokenizer, messages, seq_len, untrained):
                n = sum(id(m) in untrained for m in piece)
                encoded.append(_encode_segments(_unlabelled(tokenizer.render_chat(piece), n), bos))
        except UsageError as e:  # a chat template refusing a conversation: name it
            raise UsageError(f"{where}: {e}") from e
        return encoded, n_bytes
    prompt, text = example
    # A prompt is no label: it is the question, not what the model should learn to write.
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    segments = [([*bos, *tokenizer.encode(prompt)], False)]
    segments.append(([*tokenizer.encode(text), tokenizer.eos_id], True))
    return [_encode_segments(segments, tokenizer.bos_id)], n_bytes


def _unlabelled(segments: Segments, n: int) -> Segments:
    """`segments` with their first `n` labelled runs (a prompt's assistant turns) unlabelled:
    a chat rendering labels each assistant turn as one run."""
    runs = [i for i, (_, is_label) in enumerate(segments) if is_label][:n]
    return [(ids, is_label and i not in runs) for i, (ids, is_label) in enumerate(segments)]


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
    tokenizer: Tokenizer, messages: list[Message], seq_len: int | None, untrained: set[int]
) -> list[list[Message]]:
    """A conversation longer than seq_len tokens cut between exchanges (a user turn and its
    answer) into pieces of at most seq_len, each led by the system prompt: one the model could
    have seen. A longer exchange stays whole (the loader cuts it); a piece with no answer to
    train on (a lone user turn, or answers whose ids are in `untrained`) is dropped."""

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
    trained = {id(m) for m in messages if m["role"] == "assistant"} - untrained
    return [piece for piece in pieces if any(id(m) in trained for m in piece)]


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


# The longest a chunk of CHUNK_BYTES may take to encode. A tokenizer encodes one in about a
# second; a pre-tokenizer's Split regex may backtrack quadratically in a run of characters
# (tiktoken's Rust engine checks no signal), which would take hours where this says so.
CHUNK_BYTES = 1 << 20
CHUNK_SECONDS = 300.0


def _encode_all(
    documents: Iterator[Document],
    tokenizer: Tokenizer,
    loading: tuple,
    seq_len: int | None,
    workers: int,
) -> Iterator[tuple[list[Encoded], int]]:
    """In input order. At most two chunks per worker are in flight: Pool.imap would read the
    whole corpus into its queue up front. `loading`: load_tokenizer's arguments. Only bytes,
    which run no regex, are encoded in this process (default_corpus's, once CUDA is up): a
    worker can be stopped when a chunk takes past CHUNK_SECONDS."""
    if isinstance(tokenizer, ByteTokenizer):
        yield from (_encode_document(tokenizer, doc, seq_len) for doc in documents)
        return
    with multiprocessing.Pool(workers, _init_worker, (loading,)) as pool:
        pending = deque()

        def oldest() -> list[tuple[list[Encoded], int]]:
            try:  # it started at the latest when the chunk before it finished
                return pending.popleft().get(timeout=CHUNK_SECONDS)
            except multiprocessing.TimeoutError:
                raise UsageError(
                    f"encoding {CHUNK_BYTES >> 20} MB of the input took over {CHUNK_SECONDS:g} s "
                    f"with the tokenizer {loading[0]}: its pre-tokenizer's Split regex may "
                    f"backtrack without bound on a long run of characters"
                ) from None  # leaving the `with` terminates the workers

        for chunk in _chunks(documents, max_bytes=CHUNK_BYTES):
            pending.append(pool.apply_async(_encode_chunk, (chunk, seq_len)))
            if len(pending) >= 2 * workers:
                yield from oldest()
        while pending:
            yield from oldest()
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
    output = Path(cache_dir) / f"stdlib-py{version}-{sha256_of(''.join(listing).encode())}"
    meta_path = output / "meta.json"
    if meta_path.is_file():
        meta = read_json(meta_path)
        if meta.get("format_version") == FORMAT_VERSION and meta.get("tokenizer") == "bytes":
            return output
    # One process: bytes tokenize in well under a second here, and train.py may call this once
    # CUDA is up, when forking a pool of workers is best avoided.
    return prepare(files, output, workers=1)

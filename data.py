"""The batches a training run reads, and opening a run's data. In order: the dataset
(`TokenDataset`, prepare.py's format, memory-mapped), the packed, resumable loader; a training
run's data with its tokenizers (options.resolve); last, the command line of
`python data.py prepare` (prepare.py).

    python data.py prepare --input docs/ chat.jsonl --output data/mine [--tokenizer DIR_OR_FILE]
"""

import argparse
import json
import math
import signal
import sys
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from attention import document_starts
from files import UsageError, plural, read_json
from kernels import IGNORE_INDEX
from model import pairs_attended
from prepare import (
    BOS_INSIDE,
    CONVERSATION_SHAPES,
    DATASET_CHAT_TEMPLATE,
    FORMAT_VERSION,
    LABEL,
    META_FIELDS,
    STARTS_DOCUMENT,
    default_corpus,
    prepare,
    reading_notes,
    show,
)
from tokenizer import (
    SPECIAL_TOKEN_KEYS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    read_hf_tokenizer,
    set_chat_template,
    sha256_of,
    tokenizer_file,
)

# ---------------------------------------------------------------------------------------------
# Loading

TOKEN_CHUNK = 1 << 26  # 256 MB of uint32 at a time: flat memory on datasets larger than RAM


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
            # A directory of the user's files is prepare's input, never its output.
            if (self.path / "config.json").is_file():
                how = "--input FILES --output DIR`; a checkpoint is --hf-checkpoint's"
            elif self.path.is_dir() and any(self.path.iterdir()):
                how = f"--input {self.path} --output NEW_DIR`, then pass NEW_DIR"
            else:
                how = f"--input FILES --output {self.path}`"
            raise UsageError(
                f"{meta_path} not found: {self.path} is not a prepared dataset (make one with "
                f"`python data.py prepare {how})"
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
        chunks = range(0, self.n_tokens, TOKEN_CHUNK)
        return max(int(self.tokens[i : i + TOKEN_CHUNK].max()) for i in chunks)

    def has_labels(self) -> bool:
        chunk = 1 << 28  # 256 MB at a time; a normal dataset answers in its first chunk
        masks = (self.loss_mask[i : i + chunk] for i in range(1, self.n_tokens, chunk))
        return any((mask & LABEL).any() for mask in masks)

    def identity(self) -> str:
        """What a resumed run compares (options.resolve's run record): the tokenizer and the
        numbers of tokens and documents (META_FIELDS), not where the dataset is or how it was
        prepared, so that a move or a second prepare of the same inputs keeps it."""
        return sha256_of(json.dumps({k: self.meta[k] for k in META_FIELDS}).encode())

    def num_samples(self, seq_len: int) -> int:
        """The samples of `seq_len` tokens the stream holds: each reads one token more, its last
        label, with which the next sample starts (PackedLoader)."""
        return (self.n_tokens - 1) // seq_len

    def window(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """`length` tokens from `start` and their loss mask values, memory-mapped (read where
        used)."""
        span = slice(start, start + length)
        return self.tokens[span], self.loss_mask[span]

    def too_short(self, seq_len: int) -> str | None:
        """Why the stream holds no sample of `seq_len` ("has N tokens, ..."), or None."""
        if self.num_samples(seq_len) >= 1:
            return None
        return (
            f"has {self.n_tokens:,} tokens, one sample of seq_len {seq_len} needs {seq_len + 1:,}"
        )

    def check(self, vocab_size: int, seq_len: int, use: str = "train") -> None:
        """One error naming each reason this dataset cannot `use` ("train", "evaluate") with
        rows of `seq_len` (options.model_args holds it within the model's length)."""
        problems = [f"the dataset {short}"] if (short := self.too_short(seq_len)) else []
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

    # What state_dict holds, all counts (shard.TRAIN_STATE_FIELDS checks a checkpoint's).
    STATE_KEYS = ("epoch", "cursor", "seed", "num_samples")

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
        if short := dataset.too_short(seq_len):
            raise ValueError(f"dataset {dataset.path} {short}")
        self.num_samples = dataset.num_samples(seq_len)
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
        return {key: getattr(self, key) for key in self.STATE_KEYS}

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
        indices = self._micro_batch(0)
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
            for i in self._micro_batch(m):
                _, mask = self._window(i)
                count += int(np.count_nonzero(_labelled(mask)[self.columns]))
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

    def _micro_batch(self, ahead: int) -> list[int]:
        """The samples of this rank's micro-batch `ahead` calls of __next__ from now (0: the
        next), the cursor left where it is."""
        first = self.cursor + (ahead * self.world_size + self.rank) * self.micro_batch
        return [self._sample_index(first + k) for k in range(self.micro_batch)]

    def _sample_index(self, offset: int) -> int:
        # `offset` counts from the current epoch's start; a step may run into the next epoch.
        epoch = self.epoch + offset // self.num_samples
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}
            rng = np.random.default_rng(self.seed + epoch)
            self._orders[epoch] = rng.permutation(self.num_samples)
        return int(self._orders[epoch][offset % self.num_samples])

    def _window(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's S + 1 tokens and loss mask values."""
        return self.dataset.window(i * self.seq_len, self.seq_len + 1)

    def _sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window, mask = self._window(i)
        window = window.astype(np.int64)
        tokens = window[:-1]
        labels = np.where(_labelled(mask), window[1:], IGNORE_INDEX)
        return tokens, labels, window_positions(tokens, mask[:-1], self.dataset.bos_id)


def _labelled(mask: np.ndarray) -> np.ndarray:
    """Where a sample's loss mask window (S + 1 values) makes its next tokens labels: [S]."""
    return (mask[1:] & LABEL) != 0


def window_positions(tokens: np.ndarray, mask: np.ndarray, bos_id: int | None) -> np.ndarray:
    """Batch.positions of a window; a document it cuts restarts at 0 (nothing before is visible)."""
    index = np.arange(len(tokens))
    is_start = (mask & STARTS_DOCUMENT) != 0
    if bos_id is not None:
        is_start |= (tokens == bos_id) & ((mask & BOS_INSIDE) == 0)
    is_start[0] = True
    return index - np.maximum.accumulate(np.where(is_start, index, 0))


def mean_document_pairs(
    dataset: TokenDataset, seq_len: int, sliding_window: float = math.inf, samples: int = 64
) -> float:
    """The mean (query, key) pairs a token attends on a layer of `sliding_window` with
    documents masked apart (model.pairs_attended) over `samples` windows of `seq_len`: for the
    planner's packed step time (options.data_fields averages it over the layers)."""
    n = max(dataset.num_samples(seq_len), 1)  # one window, short, in too small a dataset
    means = []
    for i in np.linspace(0, n - 1, min(samples, n)).astype(np.int64):
        tokens, mask = dataset.window(int(i) * seq_len, seq_len)
        positions = window_positions(tokens, mask, dataset.bos_id)
        means.append(pairs_attended(positions, sliding_window).mean())
    return float(np.mean(means))


# ---------------------------------------------------------------------------------------------
# A training run's data (options.resolve)

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
    --hf-checkpoint directory's, must be the one the data was prepared with, with the same BOS
    and EOS. The export carries that tokenizer, with the dataset's chat template: when it is
    the checkpoint's, the checkpoint's files and config.json's ids, else its own."""
    own = hf_checkpoint and tokenizer_file(hf_checkpoint)
    source = tokenizer or own
    text_tokenizer = load_tokenizer(source) if source else None
    given = "--tokenizer" if tokenizer else "the checkpoint's tokenizer"
    if data:
        dataset = TokenDataset(data)
    elif text_tokenizer and text_tokenizer.name != ByteTokenizer.name:  # before it is prepared
        raise UsageError(
            f"no --data: the default corpus is byte-tokenized, but {given} {source} is "
            f"{text_tokenizer.name}: prepare data with it (python data.py prepare --tokenizer "
            f"{source} --input FILES --output DIR), then pass --data DIR"
        )
    else:
        if is_main:
            default_corpus(CACHE)
        dist.barrier()
        dataset = TokenDataset(default_corpus(CACHE))
    dataset.check(vocab_size, seq_len)
    meta, prepared_with = dataset.meta, dataset.meta["tokenizer"]
    if text_tokenizer and text_tokenizer.name != prepared_with:
        raise UsageError(
            f"dataset {dataset.path} was prepared with tokenizer {prepared_with}, but {given} "
            f"{source} is {text_tokenizer.name}: prepare the data with it (python data.py "
            f"prepare --tokenizer {source} ...)"
        )
    if prepared_with == ByteTokenizer.name:
        text_tokenizer = ByteTokenizer()
    ends = (text_tokenizer.bos_id, text_tokenizer.eos_id) if text_tokenizer else None
    if ends and (meta["bos_id"], meta["eos_id"]) != ends:
        # The name hashes tokenizer.json alone: BOS and EOS come from the tokenizer_config.json
        # beside it (and data prepared before a null bos_token meant none has a BOS).
        raise UsageError(
            f"{dataset.path / 'meta.json'} has bos_id {meta['bos_id']} and eos_id "
            f"{meta['eos_id']}, but the tokenizer {source or prepared_with} has BOS {ends[0]} and "
            f"EOS {ends[1]}: pass --tokenizer with the directory that prepared the data (its "
            f"tokenizer_config.json names BOS and EOS), or prepare the data again with this one"
        )
    if dataset.chat_template and hasattr(text_tokenizer, "use_chat_template"):
        text_tokenizer.use_chat_template(dataset.chat_template)
    export_tokenizer = read_hf_tokenizer(hf_checkpoint) if hf_checkpoint else None
    from_checkpoint = own and any(Path(source).samefile(p) for p in (own, hf_checkpoint))
    if from_checkpoint and export_tokenizer.has_tokenizer():
        if dataset.chat_template:  # the template trained with, in place of the checkpoint's
            set_chat_template(export_tokenizer.files, dataset.chat_template.read_bytes())
    elif text_tokenizer:
        # From its own files: the checkpoint's are another tokenizer's, or hold none beside an
        # original/tokenizer.model.
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
    # A copy under another path: the same identity and tokens (other tokens of the same
    # number differ in the first chunk compared).
    if held_out.identity() == training.identity() and all(
        np.array_equal(held_out.tokens[i : i + TOKEN_CHUNK], training.tokens[i : i + TOKEN_CHUNK])
        for i in range(0, training.n_tokens, TOKEN_CHUNK)
    ):
        raise UsageError(
            f"--eval-data {held_out.path} holds the same tokens as the training data "
            f"{training.path}: nothing is held out"
        )
    for key in ("tokenizer", "bos_id", "eos_id"):  # the name hashes tokenizer.json alone
        if held_out.meta[key] != training.meta[key]:
            raise UsageError(
                f"--eval-data {held_out.path} was prepared with {key} {held_out.meta[key]}, "
                f"the training data {training.path} with {training.meta[key]}: prepare both "
                f"with the same one"
            )
    return held_out


def main(argv: list[str] | None = None) -> None:
    about = "Prepare text, JSONL, parquet and CSV files as a dataset for train.py"
    parser = argparse.ArgumentParser(description=about, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser(
        "prepare", help="tokenize text and record files into a dataset", allow_abbrev=False
    )
    prep.add_argument(  # given again, adds (argparse's default keeps the last alone)
        "--input",
        nargs="+",
        action="extend",
        required=True,
        help="text, .jsonl, .parquet, .csv files or folders",
    )
    prep.add_argument("--output", help="the dataset directory to write (not with --show)")
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
    prep.add_argument(
        "--text-column",
        metavar="NAME",
        help="the column (.csv, .parquet) or key (.jsonl) holding a record's text (default: "
        "text); a .csv is read only with it",
    )
    prep.add_argument(
        "--show",
        type=int,
        metavar="N",
        help="print the first N examples as they would be trained, the trained tokens marked, "
        "and write nothing",
    )
    args = parser.parse_args(argv)
    if (args.output is None) == (args.show is None):
        prep.error("give --output DIR to write the dataset, or --show N to print examples")
    # SIGTERM (a job's time limit) as Ctrl-C: the half-written dataset is removed either way.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.show is not None:
            reading = (args.tokenizer, args.chat_template, args.seq_len, args.text_column)
            print(show(args.input, args.show, *reading, color=sys.stdout.isatty()))
            return
        output = prepare(
            args.input,
            args.output,
            args.tokenizer,
            args.workers,
            args.seq_len,
            args.chat_template,
            args.text_column,
        )
    except UsageError as e:  # what was given: one line, no traceback
        print(f"data.py error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        kept = f"; {args.output} is as it was" if args.output else ""
        print(f"data.py: stopped{kept}", file=sys.stderr, flush=True)
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
    shapes, seq_len = meta.get("records_by_shape", {}), meta["split_seq_len"]  # absent: older
    lines += reading_notes(shapes, meta["inputs_passed_over"], meta["json_read_as_text"])
    if meta["sft"]:
        whole = meta.get("n_documents_trained_whole", 0)
        text = f"; {plural(whole, 'document')} with no prompt (text) trained on whole"
        lines.append(f"SFT data: loss only on responses and assistant turns{text if whole else ''}")
    conversations = any(shapes.get(shape) for shape in CONVERSATION_SHAPES)
    if seq_len is None:
        if conversations:
            lines.append(
                "conversations were not split (no --seq-len): the loader cuts any document "
                "longer than a sample, and one crossing a sample boundary, into pieces that see "
                "only themselves"
            )
        return "\n".join(lines)
    if conversations:
        lines.append(
            f"{meta['n_conversations_split']:,} conversations longer than --seq-len {seq_len:,} "
            f"tokens were split between exchanges into {meta['n_documents_from_splits']:,} "
            f"documents"
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

"""`prepare`: text and JSONL files (plain text, prompt/response pairs, chat conversations) into
a dataset directory, encoded by a pool of workers; then the default corpus. The format it writes
(and data.py's TokenDataset reads) is a directory of three files:
    tokens.bin     uint32, documents back to back, each BOS (if there is one) + tokens + EOS
    loss_mask.bin  uint8, one per token: bit 0 (LABEL) where the token may be a label (not in an
                   SFT prompt, nor a document's first token); bit 1 (BOS_INSIDE) on a BOS inside a
                   document (a chat template's before each exchange, as Llama 2's); bit 2
                   (STARTS_DOCUMENT) on a document's first token where no BOS marks it
    meta.json      the tokenizer that wrote it, the counts the files must match, and "sft": true
                   when prompts are unlabelled, so training keeps packed documents apart by default

    python data.py prepare --input docs/ chat.jsonl --output data/mine [--tokenizer DIR_OR_FILE]
"""

import json
import multiprocessing
import os
import shutil
import signal
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

from files import NO_SPACE, OutputDir, UsageError, no_space, read_json
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
        record = without_lone_surrogates(record)
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

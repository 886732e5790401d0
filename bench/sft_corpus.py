"""A packed SFT corpus of realistic conversation lengths for the document-masking benchmark,
written as a prepared dataset (prepare.DatasetWriter) in Llama 3's vocabulary, with no tokenizer
file: its token ids are random, since only the document lengths shape the attention's cost.

    python bench/sft_corpus.py --out /tmp/sft --tokens 50000000 [--seed 0] [--corpus long-tail]
    python train.py --model llama3.2-1b --data /tmp/sft --seq-len 131072 ...

Document lengths (BOS included), by --corpus:
- "sft" (the default): a log-normal with a median of 3,000 tokens and sigma 1.0 (mean ~4,900;
  10% above ~10,800; 1% above ~30,600), capped at 32,768;
- "long-tail": short chats with a tail of long documents: 70% of documents log-normal around
  500 tokens (sigma 0.5), 25% around 4,000 (sigma 0.3), 5% uniform in 16,384-100,000 (they
  hold about two thirds of the tokens and most of the attended pairs).
Each at least 16; the last document is cut (or, if that leaves it under 16, merged into the
one before) so the corpus holds exactly --tokens tokens. Each document is one exchange as
data.py's chat rendering labels it: BOS, a prompt of a quarter of it (no loss), a response
(loss) ending in Llama 3's <|eot_id|> (a label). Ids are drawn
uniformly from the 128,000 BPE ranks of Llama 3, so the dataset checks against any model of
the Llama 3 vocabulary (128,256). meta.json marks it SFT ("sft": true), so training masks
attention between its documents by default.
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import TokenDataset  # noqa: E402
from prepare import DatasetWriter  # noqa: E402
from tokenizer import LLAMA3_SPECIALS  # noqa: E402

LLAMA3_RANKS = 128_000  # BPE ranks of Meta's Llama 3 tokenizer; its specials are numbered after
LLAMA3 = SimpleNamespace(
    name="random-ids-llama3-vocab",
    vocab_size=LLAMA3_RANKS + len(LLAMA3_SPECIALS),
    bos_id=LLAMA3_RANKS + LLAMA3_SPECIALS.index("<|begin_of_text|>"),
    eos_id=LLAMA3_RANKS + LLAMA3_SPECIALS.index("<|end_of_text|>"),
)
EOT_ID = LLAMA3_RANKS + LLAMA3_SPECIALS.index("<|eot_id|>")
SHORTEST = 16


def sft_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(3000), 1.0, size=n), SHORTEST, 32768)


def long_tail_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    kind = rng.choice(3, size=n, p=[0.70, 0.25, 0.05])
    chat = rng.lognormal(np.log(500), 0.5, size=n)
    medium = rng.lognormal(np.log(4000), 0.3, size=n)
    long = rng.uniform(16384, 100_000, size=n)
    return np.maximum(np.choose(kind, [chat, medium, long]), SHORTEST)


CORPORA = {
    "sft": (sft_lengths, "log-normal, median 3000, sigma 1.0, clipped to [16, 32768]"),
    "long-tail": (
        long_tail_lengths,
        "70% log-normal around 500 (sigma 0.5), 25% around 4000 (sigma 0.3), 5% uniform in "
        "[16384, 100000], at least 16",
    ),
}


def document_lengths(n_tokens: int, rng: np.random.Generator, corpus: str = "sft") -> np.ndarray:
    """Lengths drawn by `corpus` summing to exactly n_tokens (the last one cut to fit)."""
    draw, _ = CORPORA[corpus]
    lengths = np.zeros(0, np.int64)
    while lengths.sum() < n_tokens:
        lengths = np.concatenate([lengths, draw(max(n_tokens // 3000, 16), rng).astype(np.int64)])
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, n_tokens)) + 1  # the first document reaching n_tokens
    lengths = lengths[:count]
    lengths[-1] -= ends[count - 1] - n_tokens
    if lengths[-1] < SHORTEST and count > 1:  # too short for a BOS, a prompt and an answer
        lengths[-2] += lengths[-1]
        lengths = lengths[:-1]
    return lengths


def write_corpus(out: Path, n_tokens: int, seed: int, corpus: str = "sft") -> Path:
    rng = np.random.default_rng(seed)
    lengths = document_lengths(n_tokens, rng, corpus)
    with DatasetWriter(out) as writer:
        for length in lengths:
            tokens = rng.integers(0, LLAMA3_RANKS, size=length, dtype=np.uint32)
            tokens[0] = LLAMA3.bos_id
            tokens[-1] = EOT_ID
            mask = np.ones(length, np.uint8)
            mask[: max(1, length // 4)] = 0  # BOS and the prompt
            writer.add(tokens, mask)
        return writer.finish(
            LLAMA3,
            sft=True,
            longest_document=int(lengths.max()),
            split_seq_len=None,
            document_lengths=f"{corpus}: {CORPORA[corpus][1]}, seed {seed}",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the dataset directory to write")
    parser.add_argument("--tokens", required=True, type=int, help="tokens in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="sft")
    args = parser.parse_args()
    if args.tokens < SHORTEST:
        raise ValueError(f"--tokens must be at least {SHORTEST}, got {args.tokens}")
    start = time.perf_counter()
    dataset = TokenDataset(write_corpus(args.out, args.tokens, args.seed, args.corpus))
    starts = np.flatnonzero(dataset.tokens == LLAMA3.bos_id)
    lengths = np.diff(np.append(starts, dataset.n_tokens))
    print(
        f"wrote {dataset.path} in {time.perf_counter() - start:.1f} s: {dataset.n_tokens:,} "
        f"tokens, {len(lengths):,} documents of median {np.median(lengths):,.0f}, mean "
        f"{lengths.mean():,.0f}, 90th percentile {np.percentile(lengths, 90):,.0f}, longest "
        f"{lengths.max():,} tokens; sft={dataset.is_sft}"
    )


if __name__ == "__main__":
    main()

"""`prepare` speed with a HF tokenizer.json against the same vocabulary as a tiktoken ranks file
(issue #22): the same encoder underneath (tiktoken, Llama 3's split), so what differs is the
tokenizer.json path's own work (added tokens, the rank-to-id table where ids are out of merge
order). The vocabulary is SmolLM2's (bench/smollm2.py writes it); the text, the default corpus.

    python bench/tokenizer_json_speed.py --out /tmp/speed [--repeats 2]
"""

import argparse
import base64
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import smollm2  # noqa: E402

import data  # noqa: E402
import files  # noqa: E402
import prepare  # noqa: E402
import tokenizer  # noqa: E402


def corpus_jsonl(out: Path) -> Path:
    """The default corpus's documents (its byte-tokenized dataset, decoded) as one JSONL file."""
    dataset = data.TokenDataset(prepare.default_corpus(REPO / ".cache"))
    tokens = dataset.tokens
    starts = [i for i in range(len(tokens)) if tokens[i] == tokenizer.ByteTokenizer.bos_id]
    ends = [*starts[1:], len(tokens)]
    path = out / "corpus.jsonl"
    with open(path, "w") as f:
        for start, end in zip(starts, ends, strict=True):
            text = bytes(tokens[start + 1 : end - 1].tolist()).decode()
            f.write(json.dumps({"text": text}) + "\n")
    return path


def vocabularies(out: Path) -> dict[str, Path]:
    """SmolLM2's BPE as: a tiktoken ranks file; the tokenizer.json longtune exports of it (ids
    in merge order); that file with its ids shuffled (the table path); SmolLM2's own file."""
    own = smollm2.write_tokenizer(out / "smollm2")
    encoding = tokenizer.load_tokenizer(own)._encoding
    ranks = sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1])
    dense = {token: rank for rank, (token, _) in enumerate(ranks)}
    ranks_file = out / "tiktoken" / "tokenizer.model"
    ranks_file.parent.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in dense.items())
    ranks_file.write_text("".join(lines))
    specials = {token: len(dense) + i for i, token in enumerate(tokenizer.LLAMA3_SPECIALS)}
    in_order = out / "tokenizer-json"
    shuffled = out / "tokenizer-json-shuffled"
    for directory in (in_order, shuffled):
        directory.mkdir(exist_ok=True)
        files = tokenizer.byte_level_bpe_files(
            dense, specials, tokenizer.LLAMA3_PATTERN, "<|eot_id|>"
        )
        for name, contents in files.items():
            (directory / name).write_bytes(contents)
    spec = json.loads((shuffled / "tokenizer.json").read_text())
    ids = list(range(len(dense)))
    random.Random(0).shuffle(ids)
    spec["model"]["vocab"] = {t: ids[i] for t, i in spec["model"]["vocab"].items()}
    (shuffled / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return {
        "tiktoken ranks file": ranks_file,
        "tokenizer.json, ids in merge order": in_order,
        "tokenizer.json, ids shuffled (table)": shuffled,
        "SmolLM2's own tokenizer.json (digits split)": own,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="a directory outside the checkout")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_jsonl(args.out)
    results = {}
    for name, path in vocabularies(args.out).items():
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            dataset = prepare.prepare([corpus], args.out / "ds", path, workers=args.workers)
            best = min(best, time.perf_counter() - start)
        n_tokens = files.read_json(dataset / "meta.json")["n_tokens"]
        results[name] = (best, n_tokens)
    reference = results["tiktoken ranks file"][0]
    print(f"{corpus.stat().st_size / 1e6:.1f} MB of text, workers={args.workers}, best of "
          f"{args.repeats}:")  # fmt: skip
    for name, (seconds, n_tokens) in results.items():
        print(
            f"  {name}: {seconds:.2f} s, {n_tokens / seconds:,.0f} tokens/s, "
            f"{reference / seconds:.0%} of the ranks file's speed ({n_tokens:,} tokens)"
        )


if __name__ == "__main__":
    main()

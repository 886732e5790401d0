"""train.py end to end on the CPU: the tiny preset for a few dozen steps on a small dataset.

Runs that must survive a kill or use several processes run as subprocesses; the rest call
train.main in this process. Losses are fp32 on the CPU: a resumed run repeats the same
operations on the same numbers, so its losses match the uninterrupted run's to rtol 1e-6;
runs that split the same batch over 2 processes sum in another order, so rtol 1e-4.
"""

import dataclasses
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import dist_worker as w
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from test_readme import first_screen_commands

import attention
import data
import files
import options
import prepare
import shard
import tokenizer
import train
from config_json import args_from_hf_config
from hf import save_hf_checkpoint
from model import PRESETS, Llama, ModelArgs
from plan import PLAN_KEYS

REPO = Path(__file__).resolve().parent.parent
# Tests that pin CPU numbers (fp32, reference ops, no MFU) or start 2 processes on one device;
# test_gpu_run covers CUDA.
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="pins the CPU run's numbers")
# Small enough for two CI cores: ~25 ms a step.
SMALL = ["--seq-len", "128", "--batch-tokens", "1024", "--micro-batch", "8", "--warmup-steps", "5",
         "--log-interval", "1"]  # fmt: skip
SMALL += ["--sample-tokens", "0"]  # test_readme_train_then_test sees the sample


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """280k tokens: three stdlib modules through the byte tokenizer."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ["argparse.py", "dataclasses.py", "inspect.py"]]
    return prepare.prepare(files, tmp_path_factory.mktemp("data") / "stdlib", workers=1)


def run_subprocess(*argv: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    result = subprocess.run(
        [*launcher, str(REPO / "train.py"), *argv], capture_output=True, text=True, timeout=240
    )
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed:\n{result.stdout}\n{result.stderr}")
    return result


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; the last record of a step counts (a resumed run logs again the steps
    a killed run took after its checkpoint; metrics.jsonl keeps both)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="session")
def reference_run(dataset, tmp_path_factory) -> Path:
    """40 uninterrupted steps, checkpoints every 10: what the resumed runs must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "40", "--checkpoint-interval", "10"]
    train.main([*argv, "--run-dir", str(run_dir)])
    return run_dir


@CPU_ONLY
def test_loss_falls_and_each_step_is_logged(reference_run):
    records = [json.loads(x) for x in (reference_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    # From about ln(320) = 5.8 (uniform over the vocabulary), by more than 2 in 40 steps.
    assert records[0]["loss"] > 5.0
    assert records[-1]["loss"] < records[0]["loss"] - 2.0
    assert records[-1]["mfu"] is None and records[-1]["peak_gpu_mem_gib"] is None  # CPU
    assert records[-1]["tokens"] == 40 * 128 * 8
    assert records[4]["lr"] == pytest.approx(3e-3)  # step 5 ends the warmup
    # keep_checkpoints defaults to 2
    assert sorted(p.name for p in (reference_run / "checkpoints").iterdir()) == [
        "step-000030",
        "step-000040",
    ]


def test_a_second_signal_stops_at_once_and_exits_as_stopped(monkeypatch, capsys):
    """A second SIGTERM (or Ctrl-C) a second or more after the first stops the process at
    once, with the status of a stopped run (75): its last checkpoint resumes it."""
    exits = []
    monkeypatch.setattr(train.os, "_exit", exits.append)
    before = signal.getsignal(signal.SIGINT)
    with train.StopSignals(True, lambda: Path("runs/x/checkpoints/step-000007")) as stop:
        stop._handle(signal.SIGTERM, None)
        stop._handle(signal.SIGTERM, None)  # within a second: the same stop
        assert exits == [] and stop.received == "SIGTERM"
        stop.received_at -= 2
        stop._handle(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is before  # the caller's Ctrl-C back
    assert exits == [train.EXIT_STOPPED]
    err = capsys.readouterr().err
    assert (
        "SIGINT again: stopped at once; the last checkpoint is runs/x/checkpoints/step-0000" in err
    )


# One long call that holds no GIL and no signal interrupts (as a CPU backward): a wait on a
# future, which a thread ends after two SIGINTs 1.3 s apart.
TWO_SIGNALS_IN_ONE_CALL = """
import os, signal, threading, time
import torch, train
done = torch.futures.Future()
def send():
    for pause in (0.2, 1.3):
        time.sleep(pause)
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    done.set_result(None)
with train.StopSignals(True, lambda: None):
    threading.Thread(target=send).start()
    done.wait()
"""


def test_a_second_signal_during_one_long_call_stops_at_once():
    """Python would run the handler once for both: each arrival is counted where it lands."""
    result = subprocess.run([sys.executable, "-c", TWO_SIGNALS_IN_ONE_CALL], cwd=REPO,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == train.EXIT_STOPPED, result.stderr
    assert "SIGINT again: stopped at once; the last checkpoint is none" in result.stderr


def test_a_bad_command_line_is_said_once_under_torchrun(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default --run-dir is the cwd's runs/default
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--max-steps", "3", "--max-tokens", "1000"])
    assert exit_info.value.code == 2
    assert "--max-tokens sets the number of steps: give it or --max-steps, not both" in (
        capsys.readouterr().err
    )
    # Every process of torchrun parses it; rank 0 says it, the others exit after a moment.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    waits = []
    monkeypatch.setattr(train.time, "sleep", waits.append)
    for argv in (["--zzqqxx"], ["--seq-len", "many"], ["--max-steps", "3", "--max-tokens", "9"]):
        with pytest.raises(SystemExit) as exit_info:
            train.main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == ""
    assert waits == [2, 2, 2]
    with pytest.raises(SystemExit) as exit_info:  # a bad option found after parsing: the same
        train.main(["--seed", "-1"])
    assert exit_info.value.code == 1 and capsys.readouterr().err == "" and waits[3:] == [2]
    monkeypatch.delenv("WORLD_SIZE")  # a stray RANK outside torchrun hides nothing
    with pytest.raises(SystemExit):
        train.main(["--zzqqxx"])
    assert "unknown option --zzqqxx" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--seed", "-1"])
    assert "train.py error: --seed must be in" in capsys.readouterr().err and len(waits) == 4


def test_a_bad_option_is_told_before_an_earlier_runs_checkpoints(capsys, monkeypatch, tmp_path):
    """README's first run leaves runs/default/checkpoints: a typo is still told as such."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs/default/checkpoints/step-000002").mkdir(parents=True)
    plan = dict.fromkeys(["flags", "planned", "plan", "machine", "estimate"])
    (tmp_path / "runs/default/plan.json").write_text(json.dumps(plan))  # an earlier run's
    with pytest.raises(SystemExit):
        train.main(["--seed", "-1"])
    err = capsys.readouterr().err
    assert "train.py error: --seed must be in" in err and "earlier run" not in err
    with pytest.raises(SystemExit):
        train.main(["--seed", "1"])
    assert "holds checkpoints of an earlier run: pass --resume" in capsys.readouterr().err


def test_resuming_with_other_lora_settings_is_refused_naming_them():
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["wq", "wv"], "quantize_base": None}
    run = {"model": {}, "seq_len": 8, "tokenizer": "bytes", "strategy": "FULL_SHARD", "lora": lora}
    shard.check_resumable(run, run)
    shard.check_resumable(run, {**run, "lora": {**lora, "dropout": 0.1, "quantize_base": "nf4"}})
    with pytest.raises(ValueError, match=r"lora: checkpoint \{'rank': 4.*, this run None"):
        shard.check_resumable(run, {**run, "lora": None})


@pytest.mark.parametrize(
    "field, message",
    [
        ("dataset", "another dataset .* then start a new run with"),
        # A LoRA checkpoint holds the adapters alone: its base's fingerprint is recorded.
        ("base", "weights of the base checkpoint .* changed"),
    ],
)
def test_resuming_on_another_dataset_or_base_is_refused_and_an_older_checkpoint_resumes(
    field, message
):
    run = {"model": {}, "seq_len": 8, "tokenizer": "bytes", "strategy": "FULL_SHARD",
           "lora": None, field: "0123456789ab"}  # fmt: skip
    shard.check_resumable(run, run)
    with pytest.raises(files.UsageError, match=message):
        shard.check_resumable(run, {**run, field: "ba9876543210"})
    # saved before the record had the field: resumes as it did
    shard.check_resumable({k: v for k, v in run.items() if k != field}, run)


def test_a_new_lr_on_resume_recomputes_min_lr_and_a_run_dir_keeps_the_users_files(tmp_path):
    saved = {"run": {"tokens_per_step": 1024, "max_steps": 10}, "options": {
        "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "seed": 7}}  # fmt: skip
    opts = options.Options(lr=1e-4, seq_len=128)
    assert options.taken_on_resume(opts, frozenset({"lr"}), saved) == {"warmup_steps": 5, "seed": 7}
    # A run's directory with a plot and a log beside its files, and a new one with an empty
    # subdirectory made for an export, are run directories.
    for name in ("metrics.jsonl", "metrics.png", "train.log"):
        (tmp_path / "run" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "run" / name).write_text("")
    (tmp_path / "run" / "plan.json").write_text(json.dumps(dict.fromkeys(PLAN_KEYS)))
    shard.check_run_dir(tmp_path / "run")
    (tmp_path / "new" / "hf").mkdir(parents=True)
    shard.check_run_dir(tmp_path / "new")


def test_sigterm_before_the_first_step_exits_as_a_stop(monkeypatch, capsys, tmp_path):
    """A signal while the run is set up (loading a large checkpoint, say) ends it with the
    stop status a requeue script waits for, with one line, no traceback."""
    monkeypatch.setattr(train, "setup", lambda *a: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == train.EXIT_STOPPED
    err = capsys.readouterr().err
    assert "stopped outside the training steps" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_during_a_save_stops_after_it(dataset, monkeypatch, tmp_path, capsys):
    """The save in progress finishes, and the run stops there: no further step."""
    save = shard.Checkpointer.save

    def signalled_save(self, step, *args):
        os.kill(os.getpid(), signal.SIGTERM)
        return save(self, step, *args)

    monkeypatch.setattr(shard.Checkpointer, "save", signalled_save)
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "6", "--checkpoint-interval", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train.main([*argv, "--run-dir", str(tmp_path)])
    assert exit_info.value.code == train.EXIT_STOPPED
    assert "stopped at step 2 of 6" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000002"]
    assert list(losses(tmp_path)) == [1, 2]


def test_sigterm_without_checkpoints_promises_none(dataset, monkeypatch, tmp_path, capsys):
    """--checkpoint-interval 0: the first line says no checkpoint comes; the run still exits
    as stopped (75: run it again), which docs/training.md says starts it over."""
    lr_at = train.lr_at

    def signalled_lr_at(step, *args):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return lr_at(step, *args)

    monkeypatch.setattr(train, "lr_at", signalled_lr_at)
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "50", "--checkpoint-interval", "0"]
    with pytest.raises(SystemExit) as exit_info:
        train.main([*argv, "--run-dir", str(tmp_path)])
    assert exit_info.value.code == train.EXIT_STOPPED
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after this step, with no checkpoint (--checkpoint-interval 0)" in err
    assert "with a checkpoint" not in err and not (tmp_path / "checkpoints").exists()


def test_a_sample_prints_control_characters_escaped():
    sampled = tokenizer.ByteTokenizer().decode(list(b"ok\x1b[2J\rdone\n\tend\x00") + [0xFF])
    assert train.printable(sampled) == "ok\\x1b[2J\\rdone\n\tend\\x00\ufffd"


def test_lr_warms_up_linearly_then_decays_to_min_lr():
    opts = options.Options(lr=1.0, min_lr=0.1, warmup_steps=4, decay="linear")
    assert [train.lr_at(s, opts, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    opts.warmup_steps = 3
    # Steps 3..9 decay: step 9, the last of 10, is at min_lr.
    assert train.lr_at(5, opts, 10) == pytest.approx(1.0 - 0.9 / 3)
    assert train.lr_at(9, opts, 10) == pytest.approx(0.1)
    opts.decay = "cosine"
    assert train.lr_at(5, opts, 10) == pytest.approx(1.0 - 0.9 * 0.5 * (1 - np.cos(np.pi / 3)))
    assert train.lr_at(9, opts, 10) == pytest.approx(0.1)


@CPU_ONLY
def test_killed_run_resumes_step_for_step(dataset, tmp_path, monkeypatch):
    """SIGKILL while the step-20 checkpoint is written: every checkpoint left is complete, and
    the resumed run's losses are those of the same run uninterrupted, in a process of its own
    as the killed and the resumed runs are (one in the tests' process, after other tests have
    run there, can differ in the last bits of a float32 sum). The processes run one thread
    each: on CI's machine two two-thread processes of the same run once differed in the last
    bits at step 18, the gradient spike after which the runs' small differences grow."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path / "run"
    argv = [
        "--data",
        str(dataset),
        *SMALL,
        "--max-steps",
        "40",
        "--checkpoint-interval",
        "10",
        "--run-dir",
        str(run_dir),
    ]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # SIGKILL while the step-20 checkpoint is being written, or just after.
    deadline = time.monotonic() + 120
    ckpts = run_dir / "checkpoints"
    while not (ckpts / ".tmp-step-000020").exists() and not (ckpts / "step-000020").exists():
        assert proc.poll() is None, "the run ended before its step-20 checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Every step-* directory is complete; a half-written one still has its .tmp- name.
    for ckpt in ckpts.glob("step-*"):
        # safetensors shards and a JSON record only: resuming unpickles nothing.
        names = {p.name for p in ckpt.iterdir()}
        assert "train_state.json" in names, ckpt
        assert any(n.endswith(".safetensors") for n in names), ckpt
        assert all(n.endswith((".safetensors", ".json")) for n in names), names
    assert not (ckpts / "step-000040").exists()

    run_subprocess(*argv, "--resume")
    uninterrupted = tmp_path / "uninterrupted"
    run_subprocess(*argv[:-1], str(uninterrupted))  # the same run into another --run-dir
    resumed, reference = losses(run_dir), losses(uninterrupted)
    assert sorted(resumed) == list(range(1, 41))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), step
    assert not list(ckpts.glob(".tmp-*"))


@CPU_ONLY
def test_accumulation_checkpointing_and_offload_keep_the_losses(dataset, tmp_path):
    # One micro-batch of 8 against two of 4 with both activation-memory techniques: the same
    # samples and math, summed in another order (fp32: rel 1e-5).
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "6"]
    train.main([*argv, "--run-dir", str(tmp_path / "plain")])
    train.main(
        [
            *argv,
            "--run-dir",
            str(tmp_path / "variant"),
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--ac",
            "full",
            "--ac-every",
            "2",
            "--activation-offload",
        ]
    )
    plain, variant = losses(tmp_path / "plain"), losses(tmp_path / "variant")
    assert variant == pytest.approx(plain, rel=1e-5)


IN_BACKWARD = ["--optimizer-in-backward", "--grad-clip", "0"]


@CPU_ONLY
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_optimizer_in_backward_trains_resumes_and_shares_checkpoints(
    cpu_offload, dataset, tmp_path
):
    """8 steps with the optimizer in backward (alone, or on FSDP's host shards with
    --cpu-offload), with activation checkpointing and MLP tiling (their recomputation must
    not update a parameter twice), against plain AdamW: the same losses (rel 1e-5, fp32:
    the AdamW kernels round differently). Resumed from its step-4 checkpoint it repeats its
    losses (rel 1e-6), and plain AdamW resumes from that checkpoint too (the same layout)."""
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "8", "--checkpoint-interval", "4"]
    argv += ["--grad-clip", "0"]
    train.main([*argv, "--run-dir", str(tmp_path / "plain")])
    in_backward = [*IN_BACKWARD, "--ac", "full", "--mlp-tile", "32"]
    in_backward += ["--cpu-offload"] if cpu_offload else ["--no-cpu-offload"]
    train.main([*argv, *in_backward, "--run-dir", str(tmp_path / "oib")])
    plain, oib = losses(tmp_path / "plain"), losses(tmp_path / "oib")
    assert oib == pytest.approx(plain, rel=1e-5)
    assert oib[8] < oib[1] - 1.0

    ckpt = tmp_path / "oib/checkpoints/step-000004"
    branch = ["--resume", str(ckpt), "--run-dir"]
    train.main([*argv, *in_backward, *branch, str(tmp_path / "oib_resumed")])
    later = {step: loss for step, loss in oib.items() if step > 4}
    assert losses(tmp_path / "oib_resumed") == pytest.approx(later, rel=1e-6)
    train.main([*argv, *branch, str(tmp_path / "plain_resumed")])
    later = {step: loss for step, loss in plain.items() if step > 4}
    assert losses(tmp_path / "plain_resumed") == pytest.approx(later, rel=1e-5)


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (["--grad-clip", "1.0"], 1, "--grad-clip 1.0 (the global norm is known only after "
                                    "the updates; pass --grad-clip 0)"),
        (["--grad-clip", "0", "--grad-accum", "2"], 1, "cannot be used with --grad-accum 2"),
        (["--grad-clip", "0", "--strategy", "NO_SHARD"], 1, "with --strategy NO_SHARD"),
        (["--grad-clip", "0", "--no-cpu-offload"], 2,
         "cannot be used with 2 processes without --cpu-offload (it runs on one GPU)"),
    ],
)  # fmt: skip
def test_optimizer_in_backward_refuses_what_it_cannot_do(
    argv, world_size, message, dataset, tmp_path, capsys, monkeypatch
):
    # As torchrun sets them; the check reads WORLD_SIZE before any process group is joined.
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    argv = ["--data", str(dataset), "--optimizer-in-backward", *argv]
    with pytest.raises(SystemExit):
        train.main([*argv, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert message in err and "--optimizer-in-backward cannot be used with" in err
    assert not (tmp_path / "run").exists()


@CPU_ONLY
def test_two_processes_then_resume_on_one(dataset, reference_run, tmp_path):
    # 2 processes x 4 sequences read the same samples as 1 process x 8 (one global cursor).
    argv = [
        "--data",
        str(dataset),
        *SMALL,
        "--max-steps",
        "40",
        "--checkpoint-interval",
        "10",
        "--keep-checkpoints",
        "4",
        "--run-dir",
        str(tmp_path),
    ]
    run_subprocess(*argv, "--micro-batch", "4", nproc=2)
    two, reference = losses(tmp_path), losses(reference_run)
    for step, loss in reference.items():
        assert two[step] == pytest.approx(loss, rel=1e-4), step
    ckpt = tmp_path / "checkpoints/step-000020"
    assert json.loads((ckpt / "train_state.json").read_text())["run"]["world_size"] == 2

    # Back to step 20 on one process, in a branch (the run directory has later checkpoints):
    # DCP reshards the 2 shards into 1.
    run_subprocess(*argv, "--resume", str(ckpt), "--run-dir", str(tmp_path / "branch"))
    resumed = losses(tmp_path / "branch")
    assert sorted(resumed) == list(range(21, 41))
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), step
    assert losses(tmp_path) == two  # the 2-process run's own history is untouched


@CPU_ONLY
def test_context_parallel_equals_data_parallel_and_resumes_on_another_layout(dataset, tmp_path):
    """4 processes as 2 (data) x 2 (context), each holding half of each row of its data
    group, against 2 data-parallel processes on the same global batch, with packed
    documents, --ac attention and 2 accumulated micro-batches: the same losses and gradient
    norms (fp32: rel 1e-5, the sums go in another order). Resumed from its step-3
    checkpoint on one process (another world size, no context parallelism), the same
    later steps. Both end with the same sample: the context-parallel model generates
    through whole rows. The held-out loss (every 3 steps, 20 sequences split over the
    data-parallel groups) is the same in all three."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = prepare.prepare([stdlib / "textwrap.py"], tmp_path / "held_out", workers=1)
    argv = ["--data", str(dataset), *SMALL, "--micro-batch", "2", "--grad-accum", "2",
            "--document-mask", "--ac", "attention", "--max-steps", "6",
            "--checkpoint-interval", "3", "--keep-checkpoints", "2", "--eval-data",
            str(held_out), "--eval-interval", "3", "--eval-tokens", "2560"]  # fmt: skip
    sample = ["--sample-tokens", "12"]
    dp = run_subprocess(*argv, *sample, "--run-dir", str(tmp_path / "dp"), nproc=2)
    cp_dir = tmp_path / "cp"
    cp = run_subprocess(
        *argv, *sample, "--run-dir", str(cp_dir), "--context-parallel", "2", nproc=4
    )
    heading = "a sample of the trained model"
    assert heading in cp.stdout
    assert (
        cp.stdout.split(heading)[1].split("metrics:")[0]
        == (dp.stdout.split(heading)[1].split("metrics:")[0])
    )
    records = {name: metrics(tmp_path / name) for name in ("dp", "cp")}
    for key in ("loss", "grad_norm", "eval_loss"):
        cp = [r[key] for r in records["cp"] if r[key] is not None]
        assert cp == pytest.approx([r[key] for r in records["dp"] if r[key] is not None], rel=1e-5)
    assert [r["eval_tokens"] for r in records["cp"] if r["eval_loss"]] == [20 * 128] * 2
    assert records["cp"][-1]["tokens"] == 6 * 2 * 2 * 2 * 128  # steps x data x mb x accum x S
    # Each rank counts the attention of its slices of the rows; together, the rows' own.
    flops = {
        name: [r["model_tflops_per_device"] / r["tokens_per_s_per_device"] for r in records[name]]
        for name in ("dp", "cp")
    }
    assert flops["cp"] == pytest.approx(flops["dp"], rel=1e-9)

    ckpt = cp_dir / "checkpoints/step-000003"
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["run"]["context_parallel"] == 2 and state["run"]["world_size"] == 4
    resumed_dir = tmp_path / "resumed"
    one = [*argv, "--micro-batch", "8", "--grad-accum", "1", "--run-dir", str(resumed_dir)]
    run_subprocess(*one, "--resume", str(ckpt))
    resumed = losses(resumed_dir)
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses(cp_dir)[step], rel=1e-5), step
    assert metrics(resumed_dir)[-1]["eval_loss"] == pytest.approx(
        records["cp"][-1]["eval_loss"], rel=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("flags", [[], ["--document-mask"]], ids=["causal", "documents"])
def test_context_parallel_on_two_gpus_equals_one(flags, tmp_path):
    """One 8192-token row per step over 2 GPUs (NCCL's all-to-all; cuDNN for causal rows,
    FlexAttention's block mask for packed documents of 50 to 3000 tokens, which cross the
    halves) against the same rows on one GPU: the losses agree to bf16's 2e-2."""
    rng = np.random.default_rng(0)
    tokens = []
    while len(tokens) < 100_000:
        tokens += [256, *rng.integers(0, 256, rng.integers(50, 3000)), 257]
    docs = write_dataset(tmp_path / "docs", tokens)
    argv = ["--data", str(docs), "--seq-len", "8192", "--max-seq-len", "8192",
            "--micro-batch", "1", "--max-steps", "4", "--warmup-steps", "1", "--log-interval",
            "1", "--checkpoint-interval", "0", "--ac", "attention", *flags]  # fmt: skip
    run_subprocess(*argv, "--run-dir", str(tmp_path / "one"))
    run_subprocess(*argv, "--run-dir", str(tmp_path / "cp"), "--context-parallel", "2", nproc=2)
    one, cp = losses(tmp_path / "one"), losses(tmp_path / "cp")
    assert cp == pytest.approx(one, rel=2e-2)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@CPU_ONLY
def test_export_loads_in_transformers_with_the_same_logits(dataset, reference_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    export = tmp_path / "hf"
    # Resuming at the last step trains no further: this only exports the final weights.
    train.main(
        [
            "--data",
            str(dataset),
            *SMALL,
            "--max-steps",
            "40",
            "--run-dir",
            str(reference_run),
            "--resume",
            "--export-hf",
            str(export),
        ]
    )
    assert len(losses(reference_run)) == 40

    args = args_from_hf_config(export)
    assert args == ModelArgs.from_name("tiny")
    ours = Llama(args)
    from hf import load_hf_checkpoint

    load_hf_checkpoint(ours, export)
    init = ours.initial_value("layers.0.attention.wq.weight", 0, torch.device("cpu"))
    assert not torch.equal(ours.layers[0].attention.wq.weight, init), "exported untrained weights"
    theirs = LlamaForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32 on both sides; the two differ only in the order of float operations.
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)

    # As a user of transformers takes it: the tokenizer the data was prepared with (bytes),
    # BOS first as in training, the special ids in both configs, generation that continues
    # as ours does (greedy, fp32), files anyone may read (mkdtemp alone makes 0700).
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    inputs = tokenizer("def main(", return_tensors="pt")
    assert inputs.input_ids[0].tolist() == [256, *b"def main("]
    generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)[
        0, inputs.input_ids.shape[1] :
    ]
    assert generated.tolist() == train.generate(
        ours, inputs.input_ids[0].tolist(), 12, temperature=0
    )
    stop = generated[3].item()  # the sample ends at its stop token, which it keeps
    first_stop = generated.tolist().index(stop) + 1
    assert (
        train.generate(ours, inputs.input_ids[0].tolist(), 12, 0, stop_id=stop)
        == generated[:first_stop].tolist()
    )
    assert tokenizer.decode(generated, skip_special_tokens=True)  # some text
    for name, pad in [("config.json", None), ("generation_config.json", 257)]:
        config = json.loads((export / name).read_text())
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
            256,
            257,
            pad,
        )
    umask = os.umask(0)
    os.umask(umask)
    assert export.stat().st_mode & 0o777 == 0o777 & ~umask
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in export.iterdir())


DAMAGES = {
    "truncated shard": "shard-00001-model-00001-of-00001.safetensors is 2,360,130 bytes, it was "
    "4,720,260 when saved",
    "missing shard": "shard shard-00001-model-00001-of-00001.safetensors is missing",
    "foreign shard": "holds model.lora_a, not a tensor of this checkpoint",
    "non-float tensor": "model.norm.weight has dtype I32",
    "missing train_state.json": "is incomplete: it has no train_state.json",
}


def damage(checkpoint: Path, case: str) -> None:
    shard = checkpoint / "shard-00001-model-00001-of-00001.safetensors"
    if case == "truncated shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif case == "missing shard":
        shard.unlink()
    elif case == "foreign shard":
        save_file({"model.lora_a": torch.zeros(1_180_000)}, shard)  # about the same size
    elif case == "non-float tensor":  # int32 is as long as float32: the file keeps its size
        with safe_open(shard, framework="pt") as f:
            metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
        save_file(tensors, shard, metadata=metadata)
    else:
        (checkpoint / "train_state.json").unlink()


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_damaged_checkpoint_is_refused_naming_it(case, dataset, reference_run, tmp_path, capsys):
    """Checked from sizes and headers before anything is loaded: one line naming the
    checkpoint and the damage, no traceback from inside torch's checkpoint reader."""
    checkpoint = tmp_path / "step-000040"
    shutil.copytree(reference_run / "checkpoints" / checkpoint.name, checkpoint)
    damage(checkpoint, case)
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "40", "--resume", str(checkpoint)]
    with pytest.raises(SystemExit) as exit_info:
        train.main([*argv, "--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoint} is " in err and DAMAGES[case] in err, err
    assert err.count("train.py error") == 1 and "Traceback" not in err


@CPU_ONLY
def test_resume_latest_passes_over_a_damaged_checkpoint(dataset, reference_run, tmp_path, capsys):
    shutil.copytree(reference_run / "checkpoints", tmp_path / "checkpoints")
    damage(tmp_path / "checkpoints/step-000040", "truncated shard")
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "40", "--run-dir", str(tmp_path)]
    train.main([*argv, "--resume"])
    out = capsys.readouterr().out
    assert "passing over a damaged checkpoint: checkpoint" in out
    assert f"resuming from {tmp_path / 'checkpoints/step-000030'}, the newest intact" in out
    reference = losses(reference_run)
    assert losses(tmp_path) == pytest.approx({s: reference[s] for s in range(31, 41)}, rel=1e-6)
    # The damaged one is set aside, not deleted, and not replaced by the new step 40.
    assert (tmp_path / "checkpoints/damaged-step-000040").is_dir()


def write_dataset(path: Path, tokens, tokenizer: str = "bytes") -> Path:
    path.mkdir()
    np.asarray(tokens, np.uint32).tofile(path / "tokens.bin")
    np.ones(len(tokens), np.uint8).tofile(path / "loss_mask.bin")
    meta = {
        "format_version": prepare.FORMAT_VERSION,
        "tokenizer": tokenizer,
        "vocab_size": 258,
        "bos_id": 256,
        "eos_id": 257,
        "n_tokens": len(tokens),
        "n_documents": 1,
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def bad_inputs(tmp: Path, dataset: Path, reference_run: Path) -> dict[str, tuple[list, str]]:
    """name -> (argv, a piece of the error message)."""
    ckpt = str(reference_run / "checkpoints/step-000030")
    past_vocab = write_dataset(tmp / "past_vocab", [1, 2, 3] * 100 + [400])
    other_tokenizer = write_dataset(tmp / "other_tokenizer", [1, 2, 3] * 100, "tiktoken:abc")
    short = write_dataset(tmp / "short", [1, 2, 3] * 100)
    other_bos = write_dataset(tmp / "other_bos", [1, 2, 3] * 200)
    meta = json.loads((other_bos / "meta.json").read_text())
    (other_bos / "meta.json").write_text(json.dumps({**meta, "bos_id": 5}))
    other_eos = write_dataset(tmp / "other_eos", [1, 2, 3] * 200)
    other_data = write_dataset(tmp / "other_data", [4, 5, 6] * 200)
    (other_eos / "meta.json").write_text(json.dumps({**meta, "eos_id": 10}))
    users_dir = tmp / "users_dir"
    users_dir.mkdir()
    (users_dir / "notes.txt").write_text("the user's")
    users_plan = tmp / "users_plan"
    users_plan.mkdir()
    (users_plan / "plan.json").write_text("{}")
    (users_plan / "README.md").write_text("the user's")
    someone_elses = {"checkpoint": ("config.json", "model.safetensors"), "adapter": (
        "adapter_config.json", "adapter_model.safetensors")}  # fmt: skip
    for name, names in someone_elses.items():
        (tmp / name).mkdir()
        for file in names:
            (tmp / name / file).write_text("{}")
    a_file = tmp / "a_file"
    a_file.write_text("the user's")
    other_run = tmp / "other_run"
    step_40 = "checkpoints/step-000040"
    shutil.copytree(reference_run / step_40, other_run / step_40)
    return {
        "nan in a checkpoint's weight": (
            [
                "--data",
                str(dataset),
                "--hf-checkpoint",
                str(nan_checkpoint(tmp / "nan")),
                "--lr",
                "1e-4",
            ],
            "model.layers.1.self_attn.v_proj.weight hold NaN or inf values",
        ),  # fmt: skip
        "hf checkpoint given as its weights file": (
            [
                "--data",
                str(dataset),
                "--hf-checkpoint",
                str(qlora_base(tmp / "file") / "model.safetensors"),
                "--lr",
                "1e-4",
            ],
            "model.safetensors is a file: a Hugging Face checkpoint is the directory",
        ),  # fmt: skip
        "lr past float32": (["--data", str(dataset), "--lr", "1e39"], "--lr must be at most 3.4"),
        "report to an unknown reporter": (
            ["--data", str(dataset), "--report-to", "tensorboard,mlflow"],
            "--report-to takes a comma list of tensorboard, wandb (or none), got 'mlflow'",
        ),
        "data is a file": (
            ["--data", str(dataset / "meta.json")],
            "meta.json is a file, not a prepared dataset directory: make one with",
        ),
        "hf checkpoint given as its config.json": (
            [
                "--data",
                str(dataset),
                "--lr",
                "1e-4",
                "--hf-checkpoint",
                str(qlora_base(tmp / "config") / "config.json"),
            ],
            "config.json is a file: a Hugging Face checkpoint is the directory",
        ),  # fmt: skip
        "resume given a run dir": (
            ["--data", str(dataset), "--resume", str(reference_run)],
            f"{reference_run} is a run directory, not a checkpoint: --resume --run-dir",
        ),
        "run dir of the user's files": (
            ["--data", str(dataset), "--run-dir", str(users_dir)],
            "users_dir holds notes.txt, and no plan.json or checkpoint of a run",
        ),
        "run dir of the user's files, one named as a run's": (
            ["--data", str(dataset), "--run-dir", str(users_plan)],
            "holds README.md, plan.json, and no plan.json or checkpoint of a run",
        ),
        "export over the run dir": (
            ["--data", str(dataset), "--export-hf", str(tmp / "run")],
            f"--export-hf {tmp / 'run'} is the --run-dir: the export would replace it",
        ),
        "adapter export over the adapter given": (
            [
                "--data",
                str(dataset),
                "--lora-rank",
                "2",
                "--lora-adapter",
                str(tmp / "a"),
                "--export-adapter",
                str(tmp / "a"),
            ],
            f"--export-adapter {tmp / 'a'} is the --lora-adapter directory: the export would",
        ),  # fmt: skip
        "both exports in one directory": (
            [
                "--data",
                str(dataset),
                "--lora-rank",
                "2",
                "--export-hf",
                str(tmp / "e"),
                "--export-adapter",
                str(tmp / "e"),
            ],
            f"--export-adapter {tmp / 'e'} is the --export-hf directory: the export would",
        ),  # fmt: skip
        "negative seed": (["--data", str(dataset), "--seed", "-1"], "--seed must be in [0, 2**63)"),
        "a GPU of no memory": (
            ["--estimate-memory", "--gpu-memory", "0"],
            "--gpu-memory must be a number of GiB > 0, got 0.0",
        ),
        "gpu memory without a GPU": (
            ["--data", str(dataset), "--gpu-memory", "5"],
            "--gpu-memory sets how much of the GPU a run plans within; this run has no GPU",
        ),
        "another run's checkpoint into a run dir of checkpoints": (
            ["--data", str(dataset), "--resume", ckpt, "--run-dir", str(other_run)],
            f"{other_run / 'checkpoints'} holds checkpoints of another run (step-000040), and",
        ),
        "export over the user's files": (
            ["--data", str(dataset), "--export-hf", str(users_dir)],
            "export directory " + str(users_dir) + " holds notes.txt, which no export writes",
        ),
        "adapter over the user's files": (
            ["--data", str(dataset), "--lora-rank", "2", "--export-adapter", str(users_dir)],
            "adapter directory " + str(users_dir) + " holds notes.txt, which no adapter writes",
        ),
        "export over a checkpoint longtune did not write": (
            ["--data", str(dataset), "--export-hf", str(tmp / "checkpoint")],
            "holds config.json, model.safetensors but no longtune_export.json, which every export",
        ),
        "adapter over an adapter longtune did not write": (
            ["--data", str(dataset), "--lora-rank", "2", "--export-adapter", str(tmp / "adapter")],
            "adapter_model.safetensors but no longtune_adapter.json, which every adapter",
        ),
        "export under a file": (
            ["--data", str(dataset), "--export-hf", str(a_file / "hf")],
            f"export directory {a_file / 'hf'}: {a_file} is a file",
        ),
        "max seq len of 0": (
            ["--data", str(dataset), "--max-seq-len", "0"],
            "--max-seq-len must be >= 1, got 0",
        ),
        "run dir under a file": (
            ["--data", str(dataset), "--run-dir", str(a_file / "run")],
            f"--run-dir {a_file / 'run'}: {a_file} is a file",
        ),
        "token id past vocab": (["--data", str(past_vocab)], "token id 400 in tokens.bin"),
        "seq len past a checkpoint's": (
            [
                "--data",
                str(dataset),
                "--hf-checkpoint",
                str(qlora_base(tmp / "hf")),
                "--lr",
                "1e-4",
                "--seq-len",
                "4096",
            ],
            "--seq-len 4096 is past the 512 positions " + str(tmp / "hf") + " was trained on: "
            "pass --seq-len 512, or --max-seq-len 4096 to extend its context",
        ),  # fmt: skip
        "missing data dir": (["--data", str(tmp / "nowhere")], "is not a prepared dataset"),
        "missing hf checkpoint": (
            ["--data", str(dataset), "--hf-checkpoint", str(tmp / "nowhere")],
            "no Hugging Face config.json",
        ),
        "checkpoint of another model": (
            ["--data", str(dataset), "--model", "llama3.2-1b", "--resume", ckpt],
            "model dim: checkpoint 96, this run 2048",
        ),
        "checkpoint of another seq len": (
            ["--data", str(dataset), "--seq-len", "64", "--resume", ckpt],
            "seq_len: checkpoint 128, this run 64",
        ),
        "checkpoint of another tokenizer": (
            ["--data", str(other_tokenizer), "--seq-len", "128", "--resume", ckpt],
            "tokenizer: checkpoint 'bytes', this run 'tiktoken:abc'",
        ),
        "checkpoint of another dataset": (
            ["--data", str(other_data), "--seq-len", "128", "--resume", ckpt],
            "cannot resume on another dataset (its identity, of its tokenizer and counts, ",
        ),
        "earlier run without --resume": (
            ["--data", str(dataset), "--run-dir", str(reference_run)],
            "holds checkpoints of an earlier run: pass --resume",
        ),
        "older checkpoint in place": (
            ["--data", str(dataset), *SMALL, "--resume", ckpt, "--run-dir", str(reference_run)],
            "here would save over the later checkpoints ['step-000040']",
        ),
        "bad option": (["--data", str(dataset), "--min-lr", "1.0"], "need 0 <= --min-lr <= --lr"),
        "non-finite option": (["--data", str(dataset), "--beta2", "nan"], "--beta2 must be in"),
        "memory snapshot without CUDA": (
            ["--data", str(dataset), "--memory-snapshot"],
            "--memory-snapshot records CUDA allocations; this run has no GPU",
        ),
        "CUDA's attention kernel without a GPU": (
            ["--data", str(dataset), "--attention-backend", "efficient"],
            "--attention-backend efficient is a CUDA kernel; this run has no GPU",
        ),
        "fp8 without a GPU": (  # a model of widths FP8 takes (the tiny one's are not)
            ["--data", str(dataset), "--fp8", "--model", "llama3.2-1b"],
            "--fp8 needs a GPU with FP8 matmuls (Ada, Hopper); this run has none",
        ),
        "fp8 on a base all in 4 bits": (
            ["--data", str(dataset), "--fp8", "--lora-rank", "2", "--quantize-base", "nf4"],
            "--fp8 multiplies the bf16 projections in e4m3, and --quantize-base nf4 on "
            "--lora-targets all leaves none",
        ),
        "lora options without a rank": (
            ["--data", str(dataset), "--quantize-base", "nf4", "--lora-targets", "qkv"],
            "--quantize-base needs --lora-rank > 0",
        ),
        "nf4 on rows of 96": (
            ["--data", str(dataset), "--lora-rank", "2", "--quantize-base", "nf4"],
            "layers.0.attention.wq.weight: NF4 needs a matrix whose rows are a multiple of 64",
        ),
        "experts' adapters on a model without experts": (
            ["--data", str(dataset), "--lora-rank", "2", "--lora-targets", "wq,experts_w2"],
            "LoRA targets experts_w2 adapt an MoE model's experts: llama has none",
        ),
        "missing lora adapter": (
            ["--data", str(dataset), "--lora-rank", "2", "--lora-adapter", str(tmp / "nowhere")],
            "adapter_config.json does not exist",
        ),
        "missing lora adapter to take the rank from": (
            ["--data", str(dataset), "--lora-adapter", str(tmp / "nowhere")],
            f"--lora-adapter: no {tmp / 'nowhere' / 'adapter_config.json'} with the adapter's r",
        ),
        "context parallel not dividing the sequence": (
            ["--data", str(dataset), "--seq-len", "100", "--context-parallel", "3"],
            "--context-parallel 3 must divide --seq-len 100",
        ),
        "context parallel not dividing the heads": (
            ["--data", str(dataset), "--context-parallel", "4"],
            "--context-parallel 4 splits attention by heads: it must divide the 6 query heads",
        ),
        "offload blocks past the model": (
            ["--data", str(dataset), "--activation-offload", "--offload-blocks", "4"],
            "--offload-blocks 4 needs --activation-offload and a value from 0 to 3",
        ),
        "context parallel past the processes": (
            ["--data", str(dataset), "--context-parallel", "2"],
            "--context-parallel 2 must divide the ranks per node (1) and the world size (1)",
        ),
        # llama3.2-1b's fp32 state alone is 18.5 GiB: checked before anything is loaded.
        "host too small": (
            ["--data", str(dataset), "--model", "llama3.2-1b", "--host-memory", "8"],
            "no plan fits 256-token sequences on the CPU with 8.0 GiB of host memory",
        ),
        "batch tokens against micro-batches": (
            [
                "--data",
                str(dataset),
                "--batch-tokens",
                "1000",
                "--micro-batch",
                "2",
                "--grad-accum",
                "2",
            ],
            "--batch-tokens 1000 is not --micro-batch 2 x --grad-accum 2 x 1 process x",
        ),  # fmt: skip
        "batch tokens against gradient accumulation": (
            # --grad-accum 1000000 --batch-tokens 128 built a million micro-batches a step
            [
                "--data",
                str(dataset),
                "--batch-tokens",
                "1024",
                "--grad-accum",
                "3",
                "--max-steps",
                "1",
            ],
            "--grad-accum 3 does not split --batch-tokens 1024 (4 sequences of --seq-len 256 a "
            "rank) into micro-batches: give a --grad-accum that divides 4, or --micro-batch",
        ),
        "machine flags without --estimate-memory": (
            ["--data", str(dataset), "--world-size", "8"],
            "--world-size and --nproc-per-node describe a machine for --estimate-memory",
        ),
        "eval data of another tokenizer": (
            ["--data", str(dataset), "--seq-len", "128", "--eval-data", str(other_tokenizer)],
            "the training data " + str(dataset) + " with bytes: prepare both with the same one",
        ),
        "eval data of another BOS": (  # the same tokenizer.json, another tokenizer_config.json
            ["--data", str(dataset), "--seq-len", "128", "--eval-data", str(other_bos)],
            "other_bos was prepared with bos_id 5, the training data",
        ),
        "eval data is the training data": (
            ["--data", str(dataset), "--eval-data", str(dataset)],
            "is the training data: nothing is held out",
        ),
        "eval data shorter than a sequence": (
            ["--data", str(dataset), "--eval-data", str(short), "--seq-len", "512"],
            "short cannot evaluate this model: the dataset has 300 tokens, one sample of seq_len",
        ),
        "lr that AdamW's first step overflows": (
            ["--data", str(dataset), "--lr", "1e38", "--min-lr", "1e38", "--warmup-steps", "0"],
            "--lr 1e+38 overflows AdamW's float32 arithmetic: lr / (1 - beta1), AdamW's first "
            "step size, is 1e+39: --lr is at most 3.4e+37 with --beta1 0.9",
        ),
        "lr times weight decay past float32": (
            ["--data", str(dataset), "--lr", "1e37", "--weight-decay", "100"],
            "lr * weight_decay is 1e+39: --lr is at most 3.4e+36 with --weight-decay 100",
        ),
        "data whose BOS is not its tokenizer's": (
            ["--data", str(other_bos), "--seq-len", "128"],
            "other_bos/meta.json has bos_id 5 and eos_id 257, but the tokenizer bytes has "
            "BOS 256 and EOS 257: pass --tokenizer with the directory that prepared the data",
        ),
        "data whose EOS is not its tokenizer's": (
            ["--data", str(other_eos), "--seq-len", "128"],
            "other_eos/meta.json has bos_id 256 and eos_id 10, but the tokenizer bytes has "
            "BOS 256 and EOS 257",
        ),
        "export of a resume that finds no checkpoint": (
            ["--data", str(dataset), "--resume", "--export-hf", str(tmp / "new_export")],
            f"--resume found no checkpoint in {tmp / 'run' / 'checkpoints'}, so --export-hf "
            "would export weights trained from the start",
        ),
    }


CASES = [
    "hf checkpoint given as its weights file",
    "nan in a checkpoint's weight",
    "lr past float32",
    "data is a file",
    "hf checkpoint given as its config.json",
    "resume given a run dir",
    "run dir of the user's files",
    "run dir of the user's files, one named as a run's",
    "export over the run dir",
    "adapter export over the adapter given",
    "both exports in one directory",
    "negative seed",
    "gpu memory without a GPU",
    "a GPU of no memory",
    "another run's checkpoint into a run dir of checkpoints",
    "export over the user's files",
    "adapter over the user's files",
    "token id past vocab",
    "seq len past a checkpoint's",
    "missing data dir",
    "missing hf checkpoint",
    "checkpoint of another model",
    "checkpoint of another seq len",
    "checkpoint of another tokenizer",
    "checkpoint of another dataset",
    "earlier run without --resume",
    "older checkpoint in place",
    "bad option",
    "non-finite option",
    "memory snapshot without CUDA",
    "CUDA's attention kernel without a GPU",
    "fp8 without a GPU",
    "fp8 on a base all in 4 bits",
    "lora options without a rank",
    "nf4 on rows of 96",
    "experts' adapters on a model without experts",
    "missing lora adapter",
    "missing lora adapter to take the rank from",
    "context parallel not dividing the sequence",
    "context parallel not dividing the heads",
    "context parallel past the processes",
    "offload blocks past the model",
    "host too small",
    "batch tokens against micro-batches",
    "batch tokens against gradient accumulation",
    "machine flags without --estimate-memory",
    "eval data of another tokenizer",
    "eval data of another BOS",
    "eval data is the training data",
    "eval data shorter than a sequence",
    "export over a checkpoint longtune did not write",
    "adapter over an adapter longtune did not write",
    "export under a file",
    "run dir under a file",
    "max seq len of 0",
    "lr that AdamW's first step overflows",
    "lr times weight decay past float32",
    "export of a resume that finds no checkpoint",
    "data whose BOS is not its tokenizer's",
    "data whose EOS is not its tokenizer's",
    "report to an unknown reporter",
]


# The cases that only a machine without a GPU can show.
WITHOUT_A_GPU = (
    "memory snapshot without CUDA", "gpu memory without a GPU", "fp8 without a GPU",
    "CUDA's attention kernel without a GPU",
)  # fmt: skip


def test_every_bad_input_is_a_case(dataset, reference_run, tmp_path):
    """CASES parametrizes the test below: an input of bad_inputs left out of it never runs."""
    assert sorted(bad_inputs(tmp_path, dataset, reference_run)) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_before_any_step(case, dataset, reference_run, tmp_path, capsys):
    if case in WITHOUT_A_GPU and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv, message = bad_inputs(tmp_path, dataset, reference_run)[case]
    run_dir = tmp_path / "run"
    if "--run-dir" not in argv:
        argv = [*argv, "--run-dir", str(run_dir)]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert message in err
    assert err.count("train.py error") == 1 and "Traceback" not in err
    assert not run_dir.exists()  # nothing trained, nothing written
    assert sorted(p.name for p in (tmp_path / "users_dir").iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
        "config.json", "model.safetensors"]  # fmt: skip


@CPU_ONLY
def test_bad_input_ends_every_process(dataset, tmp_path):
    argv = ["--data", str(tmp_path / "nowhere"), "--run-dir", str(tmp_path / "run")]
    result = run_subprocess(*argv, nproc=2, check=False)
    assert result.returncode != 0
    # Every rank finds the same error; rank 0 says it, once.
    assert result.stderr.count("train.py error: ") == 1, result.stderr
    assert "is not a prepared dataset" in result.stderr
    # Found only once the data-parallel groups are known: still before any step, said once.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = prepare.prepare([stdlib / "textwrap.py"], tmp_path / "held_out", workers=1)
    argv = ["--data", str(dataset), *SMALL, "--eval-data", str(held_out), "--eval-tokens",
            "100", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    result = run_subprocess(*argv, nproc=2, check=False)
    assert result.returncode != 0 and result.stderr.count("train.py error: ") == 1
    assert "gives 1 sequence of 128 tokens within --eval-tokens: fewer than the 2" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("in_backward", [False, True])
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(in_backward, dataset, tmp_path, capsys):
    # An absurd learning rate: the first update overflows the weights, the next loss is NaN.
    argv = [
        "--data",
        str(dataset),
        *SMALL,
        *(IN_BACKWARD if in_backward else []),
        "--lr",
        "1e30",
        "--min-lr",
        "1e30",
        "--warmup-steps",
        "0",
        "--checkpoint-interval",
        "1",
        "--run-dir",
        str(tmp_path),
    ]
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit):
        train.main(argv)
    assert signal.getsignal(signal.SIGINT) is handler  # StopSignals let go on the error too
    err = capsys.readouterr().err
    # Checked at log steps, with no host sync in between: the update of the step is made.
    assert "step 2: loss" in err and "nan" in err and "Stopped after its update" in err
    assert f"the last checkpoint is {tmp_path / 'checkpoints/step-000001'}" in err
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000001"]
    assert list(losses(tmp_path)) == [1]


def test_estimate_memory_plans_for_the_machine_given(tmp_path, capsys):
    """llama3.1-8b at 131072 tokens: on one 80 GiB GPU with a 128 GiB host only the
    optimizer in backward fits (one sequence a step); on 8 GPUs of a node, FSDP shards the
    fp32 state and the default batch (2^19 tokens, at least a sequence per GPU) holds."""
    argv = ["--estimate-memory", "--model", "llama3.1-8b", "--seq-len", "131072",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    train.main([*argv, "--gpu-memory", "80", "--host-memory", "128"])
    one = capsys.readouterr().out
    assert "--optimizer-in-backward" in one and "131,072 tokens/step" in one
    assert "needs 71.0 of 80.0 GiB per GPU" in one and "GPU total" in one
    train.main([*argv, "--gpu-memory", "80", "--host-memory", "1000", "--world-size", "8"])
    eight = capsys.readouterr().out
    assert "--optimizer-in-backward" not in eight and "1,048,576 tokens/step" in eight
    assert "8 processes" in eight
    # --nproc-per-node alone is one node of that many, as torchrun reads it.
    train.main([*argv, "--gpu-memory", "80", "--host-memory", "1000", "--nproc-per-node", "8"])
    assert capsys.readouterr().out == eight
    assert not (tmp_path / "run").exists()


def test_estimate_memory_reads_the_datas_documents_as_the_run_does(tmp_path, capsys):
    """--data's documents decide the plan as in a run: SFT data masks them by default; the
    causal kernel's kept outputs count only where some document is long (these are not:
    without data the estimate assumes they may be; 0.5 GiB a layer at llama3.2-1b's 131072);
    the step time is of the pairs its documents attend, not a causal row's."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "Q" * 900, "response": "A" * 3000}) + "\n"
                             for _ in range(40)))  # fmt: skip
    dataset = prepare.prepare([pairs], tmp_path / "data", workers=1)
    argv = ["--estimate-memory", "--model", "llama3.2-1b", "--seq-len", "131072", "--ac",
            "attention", "--gpu-memory", "80", "--host-memory", "64"]  # fmt: skip

    def printed(*extra: str) -> str:
        train.main([*argv, *extra])
        return capsys.readouterr().out

    from_data = printed("--data", str(dataset))
    assert from_data == printed("--data", str(dataset), "--document-mask")
    assert from_data != printed("--document-mask")
    assert from_data != printed("--data", str(dataset), "--no-document-mask")
    opts, _ = options.parse_options([*argv, "--data", str(dataset)])
    fields = options.data_fields(opts, options.model_args(opts), data.TokenDataset(dataset))
    assert fields["document_mask"] and not fields["long_documents"]
    assert 0 < fields["attended_per_token"] < 131072 / 20  # a causal row's: 65,536


def test_the_allocator_grows_segments_in_place_unless_the_user_chose(monkeypatch, capsys):
    argv = ["--estimate-memory", "--model", "tiny", "--gpu-memory", "80", "--host-memory", "64"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    train.main(argv)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    train.main(argv)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    capsys.readouterr()


def test_estimate_memory_refuses_what_the_run_would(tmp_path, capsys):
    """The estimate applies the run's rules: 3 context-parallel ranks cannot split the tiny
    preset's 2 key/value heads, and the world size comes from --world-size, not torchrun."""
    argv = ["--estimate-memory", "--world-size", "3", "--context-parallel", "3", "--seq-len",
            "264", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    with pytest.raises(SystemExit):
        train.main(argv)
    err = capsys.readouterr().err
    assert "--context-parallel 3 splits attention by heads" in err and "plan:" not in err
    assert not (tmp_path / "run").exists()


def test_lr_follows_the_model_size_and_is_required_for_a_hf_checkpoint(dataset, tmp_path, capsys):
    tiny, eight_b = ModelArgs.from_name("tiny"), ModelArgs.from_name("llama3.1-8b")
    assert (options.default_lr(tiny), options.default_lr(eight_b)) == (3e-3, 3e-4)
    settled = options.settle_options(options.Options(), eight_b)
    assert (settled.lr, settled.min_lr, settled.grad_clip) == (3e-4, pytest.approx(3e-5), None)
    settled = options.settle_options(options.Options(lr=1e-5), eight_b)
    assert settled.min_lr == pytest.approx(1e-6)  # follows --lr unless set

    hf = tmp_path / "hf"
    model = Llama(tiny)
    save_hf_checkpoint(tiny, model.named_parameters(), hf, torch.float32)
    with pytest.raises(SystemExit):
        train.main(["--hf-checkpoint", str(hf), "--run-dir", str(tmp_path / "run")])
    assert "--lr is required with --hf-checkpoint" in capsys.readouterr().err
    # A resumed fine-tune keeps its checkpoint's lr.
    argv = ["--hf-checkpoint", str(hf), "--data", str(dataset), *SMALL, "--run-dir",
            str(tmp_path / "run"), "--checkpoint-interval", "1"]  # fmt: skip
    train.main([*argv, "--max-steps", "1", "--lr", "2e-3", "--min-lr", "2e-3"])
    train.main([*argv, "--max-steps", "2", "--resume"])
    records = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if "lr" in r] == [pytest.approx(4e-4), pytest.approx(8e-4)]


def test_max_tokens_counts_the_tokens_trained_before_a_resume_at_another_batch(dataset, tmp_path):
    """A checkpoint keeps the tokens trained by its step (2 x 1,024); resumed at 2,048 a step,
    --max-tokens 8192 trains the 6,144 left (3 steps) and the log counts on from 2,048. A
    checkpoint saved before the count was kept took its run record's tokens/step each step."""
    argv = ["--data", str(dataset), *SMALL, "--checkpoint-interval", "1"]
    train.main([*argv, "--max-steps", "2", "--run-dir", str(tmp_path / "run")])
    state = tmp_path / "run" / "checkpoints" / "step-000002" / "train_state.json"
    resume = [*argv, "--resume", str(state.parent), "--batch-tokens", "2048"]
    resume += ["--max-tokens", "8192"]
    for run in ("resumed", "resumed_from_an_older_checkpoint"):
        train.main([*resume, "--run-dir", str(tmp_path / run)])
        records = [r for r in metrics(tmp_path / run) if "tokens" in r]
        assert [(r["step"], r["tokens"]) for r in records] == [(3, 4096), (4, 6144), (5, 8192)]
        assert records[-1]["eta_s"] == 0
        last = tmp_path / run / "checkpoints" / "step-000005"
        assert json.loads((last / "train_state.json").read_text())["tokens"] == 8192
        older = json.loads(state.read_text())
        state.write_text(json.dumps({k: v for k, v in older.items() if k != "tokens"}))


@CPU_ONLY
def test_the_plan_is_saved_with_the_peaks_reached_and_keeps_the_flags_given(dataset, tmp_path,
                                                                             capsys):  # fmt: skip
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "3", "--checkpoint-interval", "0",
            "--ac", "full", "--mlp-tile", "32", "--run-dir", str(tmp_path)]  # fmt: skip
    train.main(argv)
    out = capsys.readouterr().out
    assert "plan: --ac full --mlp-tile 32 --micro-batch 8 --grad-accum 1" in out
    assert "memory after 2 steps: host peak RSS" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["plan"]["ac"] == "full" and saved["plan"]["mlp_tile"] == 32
    planned = ["activation_offload", "offload_blocks", "cpu_offload", "optimizer_in_backward",
               "grad_accum"]  # fmt: skip
    assert saved["planned"] == planned
    assert saved["tokens_per_step"] == 1024 and saved["machine"]["gpu_gib"] is None
    assert saved["measured"]["steps"] == 2 and saved["measured"]["host_peak_rss_gib"] > 0


def test_the_start_says_the_epochs_and_a_warmup_as_long_as_the_run(dataset, tmp_path, capsys):
    argv = ["--data", str(dataset), *SMALL, "--lr", "2e-3", "--max-steps", "2"]
    train.main([*argv, "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    epochs = 2 * 1024 / data.TokenDataset(dataset).n_tokens  # ~0.0073: two figures
    assert f"1,024 tokens/step, 2 steps ({epochs:.2g} epochs of the data)\n" in out, out
    assert (
        "note: --warmup-steps 5 is not below the run's 2 steps: the learning rate rises the "
        "whole run, to 8.00e-04 at its last step (--lr 2.00e-03), and never decays\n"
    ) in out


def test_a_runs_config_toml_gives_back_its_options(dataset, tmp_path):
    """A run given --config and flags keeps its options, resolved (lr's min_lr decided), in
    config.toml; --config of that file parses to the options its checkpoint records."""
    config = tmp_path / "run.toml"
    config.write_text(f'data = "{dataset}"\nseq_len = 128\nlr = 2e-3\nmax_steps = 50\n')
    run_dir = tmp_path / "run"
    train.main(["--config", str(config), *SMALL[2:], "--max-steps", "1", "--run-dir", str(run_dir)])
    saved = json.loads((run_dir / "checkpoints/step-000001/train_state.json").read_text())
    assert saved["options"]["lr"] == 2e-3 and saved["options"]["min_lr"] == 2e-4
    assert saved["options"]["max_steps"] == 1 and saved["options"]["seq_len"] == 128
    again, _ = options.parse_options(["--config", str(run_dir / "config.toml")])
    assert dataclasses.asdict(again) == saved["options"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_with_kernels_in_bf16(dataset, tmp_path):
    run_subprocess("--data", str(dataset), *SMALL, "--max-steps", "30", "--run-dir", str(tmp_path))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    assert records[-1]["peak_gpu_mem_gib"] > 0
    if any(name in torch.cuda.get_device_name() for name in train.PEAK_FLOPS):
        assert 0 < records[-1]["mfu"] < 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_optimizers_time_is_the_gpus_not_the_hosts():
    # The logged optimizer_s: the host queues GPU work and runs on; its clock would time the
    # queueing (here about nothing), the GPU's events the work (here a sleep of ~0.2 s).
    device = torch.device("cuda")
    torch.cuda.synchronize()
    host_started = time.perf_counter()
    started = train.device_clock(device)
    torch.cuda._sleep(400_000_000)  # GPU clock cycles
    ended = train.device_clock(device)
    host_s = time.perf_counter() - host_started
    gpu_s = train.seconds_between(started, ended)
    assert gpu_s > 0.05 and host_s < gpu_s / 5


def test_an_adapter_is_named_for_its_multimodal_base_as_the_run_found_it(
    dataset, tmp_path, monkeypatch
):
    """--export-adapter names the tensors where PEFT finds them on the base's model (a
    multimodal Gemma 3's under model.language_model.), read as the run starts: a base moved
    while the run trains does not turn them into a text model's."""
    from test_model import gemma3_multimodal_checkpoint

    _, base = gemma3_multimodal_checkpoint(tmp_path / "base", vocab_size=512)
    setup = train.setup

    def setup_then_move_the_base(*a):
        run = setup(*a)
        base.rename(tmp_path / "moved")
        return run

    monkeypatch.setattr(train, "setup", setup_then_move_the_base)
    adapter = tmp_path / "adapter"
    train.main(["--data", str(dataset), *SMALL, "--hf-checkpoint", str(base), "--lora-rank", "2",
                "--lr", "1e-3", "--max-steps", "1", "--checkpoint-interval", "0",
                "--export-adapter", str(adapter), "--run-dir", str(tmp_path / "run")])  # fmt: skip
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("base_model.model.model.language_model.") for n in names)


@CPU_ONLY
def test_max_seq_len_extends_the_context_and_is_exported(dataset, tmp_path):
    # tiny allows 2048 positions; --max-seq-len raises the limit the data check enforces.
    out = tmp_path / "hf"
    argv = ["--data", str(dataset), "--seq-len", "2560", "--batch-tokens", "2560",
            "--sample-tokens", "0", "--max-steps", "1", "--checkpoint-interval", "0",
            "--max-seq-len", "4096", "--export-hf", str(out)]  # fmt: skip
    train.main([*argv, "--run-dir", str(tmp_path / "run")])
    assert args_from_hf_config(out).max_seq_len == 4096


def test_sft_data_masks_documents_unless_told_not_to(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    lines = [{"prompt": f"question {i}? " * 3, "response": f"answer {i}. " * 4} for i in range(60)]
    pairs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    sft = prepare.prepare([pairs], tmp_path / "sft", workers=1)
    argv = ["--data", str(sft), *SMALL, "--max-steps", "1", "--checkpoint-interval", "0"]
    train.main([*argv, "--run-dir", str(tmp_path / "a")])
    assert "attention masked between documents" in capsys.readouterr().out
    train.main([*argv, "--no-document-mask", "--run-dir", str(tmp_path / "b")])
    assert "attention masked between documents" not in capsys.readouterr().out

    # The logged FLOPs count the attention computed: within each document when masked (each
    # document of l tokens l^2/2 pairs), over the whole row of 128 otherwise.
    def flops_per_token(run: str) -> float:
        record = json.loads((tmp_path / run / "metrics.jsonl").read_text())
        return record["model_tflops_per_device"] * 1e12 / record["tokens_per_s_per_device"]

    rows = next(iter(data.PackedLoader(data.TokenDataset(sft), 128, 8)))
    starts = torch.nonzero(rows.positions.flatten() == 0).flatten().tolist()
    lengths = torch.tensor(starts[1:] + [rows.positions.numel()]) - torch.tensor(starts)
    assert len(starts) > 8 and lengths.max() < 128  # several documents a row
    args = options.model_args(options.Options())
    pairs = (lengths.double() ** 2 / 2).sum().item()
    assert flops_per_token("a") == pytest.approx(args.training_flops(1024, pairs) / 1024, rel=1e-9)
    assert flops_per_token("b") == pytest.approx(args.flops_per_token(128), rel=1e-9)


@CPU_ONLY
def test_eval_loss_is_the_held_out_loss_that_transformers_computes(dataset, tmp_path):
    """--eval-data every 2 steps and at the end, over the first 2000 tokens (16 sequences
    of 128, in order): the last one equals the mean loss transformers computes on the same
    rows with the exported weights (fp32: rel 1e-5); evaluating changes no training step."""
    from transformers import LlamaForCausalLM

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = prepare.prepare([stdlib / "textwrap.py"], tmp_path / "held_out", workers=1)
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "5", "--checkpoint-interval", "0"]
    evaluated = ["--eval-data", str(held_out), "--eval-interval", "2", "--eval-tokens", "2000"]
    train.main([*argv, *evaluated, "--export-hf", str(tmp_path / "hf"), "--run-dir",
                str(tmp_path / "run")])  # fmt: skip
    train.main([*argv, "--run-dir", str(tmp_path / "plain")])
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records if r["eval_loss"] is not None] == [2, 4, 5]
    assert [r["loss"] for r in records] == [r["loss"] for r in metrics(tmp_path / "plain")]

    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    total, count = 0.0, 0
    for b in data.PackedLoader(data.TokenDataset(held_out), 128, 8).in_order(16):
        with torch.no_grad():
            logits = model(input_ids=b.tokens, position_ids=b.positions).logits
        total += F.cross_entropy(
            logits.flatten(0, 1).double(), b.labels.flatten(), reduction="sum"
        ).item()  # labels of -100 (IGNORE_INDEX) are left out
        count += int((b.labels != data.IGNORE_INDEX).sum())
    assert count == records[-1]["eval_tokens"] and count > 1900
    assert records[-1]["eval_loss"] == pytest.approx(total / count, rel=1e-5)


@CPU_ONLY
def test_document_mask_trains(dataset, tmp_path):
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "10", "--checkpoint-interval", "0"]
    train.main([*argv, "--document-mask", "--run-dir", str(tmp_path)])
    logged = losses(tmp_path)
    assert logged[10] < logged[1] - 0.5


@CPU_ONLY
@pytest.mark.parametrize("long", [False, True])
def test_the_plan_counts_long_documents_prefixes_only_where_the_data_has_them(tmp_path, long):
    """attention.LONG_DOCUMENT tokens or more (bytes here) in some document: the plan keeps the
    causal kernel's heads' outputs in its estimate; the data's longest document says."""
    text = "def f(x):\n    return x + 1\n" * (800 if long else 20)  # 21,600 or 540 bytes
    files = []
    for i in range(20):
        files.append(tmp_path / f"doc{i}.py")
        files[-1].write_text(text)
    dataset = prepare.prepare(files, tmp_path / "data", workers=1)
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), "--model", "tiny", "--seq-len", "256", "--max-steps", "1",
            "--checkpoint-interval", "0", "--document-mask", "--run-dir", str(run_dir)]  # fmt: skip
    train.main(argv)
    plan = json.loads((run_dir / "plan.json").read_text())["plan"]
    assert plan["document_mask"] and plan["long_documents"] == long


def nan_checkpoint(path: Path) -> Path:
    """qlora_base with one NaN in a weight."""
    base = qlora_base(path)
    file = base / "model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.1.self_attn.v_proj.weight"][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return base


def qlora_base(path: Path, seed: int = 0) -> Path:
    """A small HF Llama whose rows are multiples of 64 (NF4 blocks), for the byte dataset."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=192, vocab_size=320, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


@CPU_ONLY
def test_nan_in_adapter_rows_one_rank_reads_ends_every_process(dataset, tmp_path):
    """Under FSDP each rank reads only its rows of a PEFT adapter: a NaN in rank 1's rows
    is refused by both ranks (said once), not by rank 1 alone while rank 0 waits."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    base = qlora_base(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(LlamaForCausalLM.from_pretrained(base), config).save_pretrained(
        tmp_path / "adapter"
    )
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = next(n for n in tensors if "layers.1.self_attn.q_proj.lora_B" in n)
    tensors[name][-1, 0] = float("nan")  # the last row: in rank 1's shard
    save_file(tensors, file, metadata={"format": "pt"})
    argv = ["--data", str(dataset), *SMALL, "--micro-batch", "4", "--hf-checkpoint", str(base),
            "--lr", "1e-4", "--lora-adapter", str(tmp_path / "adapter"),
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    result = run_subprocess(*argv, nproc=2, check=False)
    assert result.returncode != 0
    assert result.stderr.count("train.py error: ") == 1, result.stderr
    assert f"{name.split('.lora_B')[0]}.lora_B" in result.stderr
    assert "hold NaN or inf values" in result.stderr


@CPU_ONLY
def test_qlora_trains_resumes_and_exports_what_peft_and_transformers_load(dataset, tmp_path):
    """--lora-rank with --quantize-base nf4 from an HF checkpoint: checkpoints hold only
    the adapters and resume step for step; the adapter loads in PEFT and continues with
    --lora-adapter; the merged export is the dequantized base + scale * B @ A."""
    peft = pytest.importorskip("peft")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from kernels import dequantize_nf4_reference, quantize_nf4

    base = qlora_base(tmp_path / "base")
    run_dir, adapter, merged = tmp_path / "run", tmp_path / "adapter", tmp_path / "merged"
    lora = ["--hf-checkpoint", str(base), "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2",
            "--lora-targets", "q_proj,v_proj,w2", "--quantize-base", "nf4"]  # fmt: skip
    argv = ["--data", str(dataset), *SMALL, *lora, "--max-steps", "6",
            "--checkpoint-interval", "3", "--run-dir", str(run_dir)]  # fmt: skip
    train.main([*argv, "--export-adapter", str(adapter), "--export-hf", str(merged)])
    first = losses(run_dir)
    assert first[6] < first[1]
    for file in (run_dir / "checkpoints" / "step-000003").glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names = [n for n in f.keys() if n.startswith("model.")]
        assert names and all(".lora_" in n for n in names), names

    branch = tmp_path / "branch"  # run_dir has the later step-000006
    resume = ["--resume", str(run_dir / "checkpoints" / "step-000003"), "--run-dir", str(branch)]
    train.main([*argv, *resume])
    for step, loss in losses(branch).items():
        assert loss == pytest.approx(first[step], rel=1e-6), step
    assert sorted(losses(branch)) == [4, 5, 6]
    # A base written over since (a fine-tune of it, say): the adapters would train on it.
    changed = qlora_base(tmp_path / "changed", seed=1)
    shutil.copytree(changed, base, dirs_exist_ok=True)
    again = [*argv, "--resume", str(run_dir / "checkpoints" / "step-000003"), "--run-dir",
             str(tmp_path / "again")]  # fmt: skip
    with pytest.raises(files.UsageError, match="weights of the base checkpoint .* changed"):
        options.resolve(*options.parse_options(again), print)
    shutil.copytree(qlora_base(tmp_path / "same"), base, dirs_exist_ok=True)

    theirs = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    )
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        prefix = "base_model.model.model.layers.1.self_attn.q_proj"
        lora_a, lora_b = (
            f.get_tensor(f"{prefix}.lora_A.weight"),
            f.get_tensor(f"{prefix}.lora_B.weight"),
        )
    loaded = theirs.base_model.model.model.layers[1].self_attn.q_proj
    assert torch.equal(loaded.lora_B["default"].weight, lora_b) and lora_b.abs().max() > 0

    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    q = quantize_nf4(original.model.layers[1].self_attn.q_proj.weight.detach())
    dequantized = dequantize_nf4_reference(q.rows, q.absmax2, q.offset, 128, torch.float32)
    expected = dequantized + (8 / 4) * lora_b @ lora_a
    torch.testing.assert_close(
        exported.model.layers[1].self_attn.q_proj.weight, expected, rtol=1e-6, atol=1e-6
    )
    # Not a target: the base's own weights.
    assert torch.equal(exported.model.layers[1].self_attn.k_proj.weight,
                       original.model.layers[1].self_attn.k_proj.weight)  # fmt: skip

    # The adapter's r, alpha, targets and dropout, as PEFT reads them, unless given: the run's
    # plan.json records them, its config.toml leaves them to the adapter a run of it names
    # (test_options); one given otherwise is refused, named.
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"lora_dropout": 0.05}))
    continued = tmp_path / "continued"
    given = [
        "--data",
        str(dataset),
        *SMALL,
        "--hf-checkpoint",
        str(base),
        "--lr",
        "1e-2",
        "--quantize-base",
        "nf4",
        "--lora-adapter",
        str(adapter),
        "--max-steps",
        "1",
    ]
    with pytest.raises(files.UsageError, match=r"--lora-alpha 16.0 differs from the adapter's 8"):
        options.resolve(*options.parse_options([*given, "--lora-alpha", "16"]), print)
    train.main([*given, "--run-dir", str(continued)])
    assert losses(continued)[1] < first[1]
    train.main([*given, "--estimate-memory"])  # taken as a run takes them, not refused
    used = json.loads((continued / "plan.json").read_text())["plan"]["lora"]
    assert used == {"rank": 4, "alpha": 8.0, "dropout": 0.05, "targets": ["wq", "wv", "w2"],
                    "quantize_base": "nf4"}  # fmt: skip
    recorded = (continued / "config.toml").read_text()
    assert '\nquantize_base = "nf4"\n' in recorded and "\nlora_rank" not in recorded


@CPU_ONLY
def test_sigterm_under_torchrun_saves_and_the_resume_matches_step_for_step(
    dataset, reference_run, tmp_path
):
    """SIGTERM to torchrun's whole process group (as SLURM and Ctrl-C signal every process;
    torchrun then passes it on again): both ranks finish the step they are in, agree to
    stop, save a checkpoint there and say how to resume; the resumed run then matches the
    uninterrupted one step for step (2 processes x 4 against 1 x 8: rel 1e-4, as above)."""
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--micro-batch", "4", "--max-steps", "40",
            "--checkpoint-interval", "25", "--run-dir", str(run_dir)]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    proc = subprocess.Popen(
        [*launcher, str(REPO / "train.py"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to signal as a whole
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert 3 <= stopped < 25, out + err
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{stopped:06d}"]
    # (torchrun itself ends with a traceback of the SignalException it raises to stop.)
    assert err.count("SIGTERM: stopping after this step") == 1 and "train.py error" not in err
    resume = out.split("Resume with:\n")[1].split("\n")[0].split()
    assert resume[:2] == ["torchrun", "--nproc-per-node=2"] and "--resume" in resume

    run_subprocess(*argv, "--resume", nproc=2)
    resumed, reference = losses(run_dir), losses(reference_run)
    assert sorted(resumed) == list(range(1, 41))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-4), step


def test_a_live_run_locks_its_directory_and_a_dead_one_does_not(dataset, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "1", "--checkpoint-interval", "0"]
    argv += ["--run-dir", str(run_dir)]
    with open(run_dir / ".lock", "w") as held:  # what a live run holds
        held.write("pid 123 on elsewhere\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SystemExit):
            train.main(argv)
    err = capsys.readouterr().err
    assert f"run directory {run_dir} is in use by a live run (pid 123 on elsewhere)" in err
    assert not (run_dir / "metrics.jsonl").exists()
    # The lock file of a run that died is not held: the next run goes ahead.
    train.main(argv)
    assert list(losses(run_dir)) == [1]


@CPU_ONLY
def test_resume_keeps_the_global_batch_and_schedule_unless_given(
    dataset, reference_run, tmp_path, capsys
):
    # The reference ran 1 process x 8 sequences for 40 steps, with 5 warmup steps; this
    # command names none of them.
    argv = ["--data", str(dataset), "--seq-len", "128"]
    argv += ["--log-interval", "1", "--sample-tokens", "0", "--run-dir", str(tmp_path)]
    argv += ["--resume", str(reference_run / "checkpoints/step-000030")]
    train.main(argv)
    out = capsys.readouterr().out
    kept = "global batch of 1,024 tokens/step kept"
    assert kept in out
    assert "schedule of 40 steps kept" in out
    resuming = next(line for line in out.splitlines() if line.startswith("resuming: "))
    assert "the checkpoint's " in resuming and "--warmup-steps 5" in resuming, resuming
    reference = losses(reference_run)
    assert losses(tmp_path) == pytest.approx({s: reference[s] for s in range(31, 41)}, rel=1e-6)


def test_a_bare_resume_goes_on_at_the_checkpoints_sequence_length(dataset, tmp_path, capsys):
    """`--seq-len 4096 --max-steps 2`, then `--resume --max-steps 4`: the resumed run goes on
    at 4096 tokens on the same data; given again, another --seq-len is refused."""
    run_dir = tmp_path / "run"
    common = ["--log-interval", "1", "--sample-tokens", "0", "--run-dir", str(run_dir)]
    train.main(["--data", str(dataset), "--seq-len", "4096", "--max-steps", "2", *common])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(["--resume", "--seq-len", "256", "--max-steps", "4", *common])
    assert "seq_len: checkpoint 4096, this run 256" in capsys.readouterr().err
    train.main(["--resume", "--max-steps", "4", *common])
    resuming = next(line for line in capsys.readouterr().out.splitlines() if "resuming: " in line)
    assert f"the checkpoint's --seq-len 4096, --data {dataset}, --lr" in resuming, resuming
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    state = json.loads((run_dir / "checkpoints/step-000004/train_state.json").read_text())
    assert (state["run"]["seq_len"], state["run"]["tokens_per_step"]) == (4096, 4096)


def test_a_bare_resume_goes_on_with_the_checkpoints_model_preset(
    dataset, tmp_path, monkeypatch, capsys
):
    """A run of a preset other than the default, resumed with --resume alone, goes on with
    that preset; another preset given is refused. (The preset, of two blocks, is this
    test's: the real ones but tiny are too large for a CPU; it is not among --model's
    choices, so the first run is started from its options.)"""
    monkeypatch.setitem(PRESETS, "tiny-2", dataclasses.replace(PRESETS["tiny"], n_layers=2))
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "1", "--run-dir", str(run_dir)]
    opts, given = options.parse_options(argv)
    train.train(dataclasses.replace(opts, model="tiny-2"), given | {"model"})
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(["--resume", "--model", "tiny", "--run-dir", str(run_dir)])
    assert "model n_layers: checkpoint 2, this run 4" in capsys.readouterr().err
    train.main(["--resume", "--max-steps", "2", "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert "resuming: the checkpoint's --model tiny-2, --seq-len 128, --data" in out, out
    assert "model tiny-2: " in out and sorted(losses(run_dir)) == [1, 2]
    state = json.loads((run_dir / "checkpoints/step-000002/train_state.json").read_text())
    assert state["run"]["model"]["n_layers"] == 2


@CPU_ONLY
def test_readme_train_then_test(tmp_path):
    """README's first run (shortened) in a copy of the checkout, then the tests that
    start train.py in a process of its own: they pass beside the run's runs/default and
    .cache/, and (tests/conftest.py) leave the copy as it was. The run ends with a sample
    of its model, where its files are, and the commands to resume and export."""
    copy = tmp_path / "longtune"
    copy.mkdir()
    for path in [*REPO.glob("*.py"), REPO / "pyproject.toml"]:
        shutil.copy(path, copy / path.name)
    for folder in ["kernels", "tests"]:
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    assert "python train.py" in first_screen_commands()  # README's first run, shortened here
    train_run = subprocess.run(
        [sys.executable, "train.py", "--max-steps", "2", "--micro-batch", "2", "--seq-len", "64",
         "--checkpoint-interval", "2", "--sample-tokens", "40"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train_run.returncode == 0, train_run.stderr
    out = train_run.stdout
    assert "a sample of the trained model" in out
    assert "metrics: runs/default/metrics.jsonl" in out
    assert "checkpoints: runs/default/checkpoints (the last: step-000002)" in out
    assert "resume:  python train.py --seq-len 64 --micro-batch 2 --max-steps 2" in out
    assert "export:  python train.py" in out and "--export-hf runs/default/hf" in out
    test_run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_train.py",
         "tests/test_options.py", "-k",
         "bad_input_ends_every_process or help_lists_every_option or said_once"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert test_run.returncode == 0, test_run.stdout + test_run.stderr
    assert "3 passed" in test_run.stdout


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(train.UsageError, match="8 processes per node were asked .* 1 GPU:"):
        shard.check_gpus()


@CPU_ONLY
def test_a_preset_from_scratch_trains_past_its_preset_length(dataset, tmp_path):
    """The tiny preset's length is 2048; trained from scratch it takes --seq-len 4096, and
    its export records the length it was trained at."""
    argv = ["--data", str(dataset), "--seq-len", "4096", "--batch-tokens", "4096",
            "--max-steps", "1", "--sample-tokens", "0", "--run-dir", str(tmp_path / "run"),
            "--export-hf", str(tmp_path / "hf")]  # fmt: skip
    train.main(argv)
    assert list(losses(tmp_path / "run")) == [1]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096


@CPU_ONLY
def test_the_cards_length_plans_and_starts_on_the_cpu(dataset, tmp_path):
    """`python train.py --seq-len 131072` (here on the test dataset): the plan is printed,
    saying a step takes minutes, and the model starts; stopped there (SIGKILL)."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "--data", str(dataset), "--seq-len", "131072",
         "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("model tiny"):
                break
    finally:
        proc.kill()
        proc.wait()
    out = "".join(lines)
    assert "plan:" in out and "131,072 tokens/step" in out and "a step takes about" in out, out
    assert "model tiny" in out, out


@CPU_ONLY
def test_sigterm_exits_with_its_own_status_and_the_commands_work_from_anywhere(dataset, tmp_path):
    """A stopped run exits EXIT_STOPPED (75), not 0, so `train && export` stops; the resume
    command it prints runs from the directory the user is in."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "1000", "--log-interval", "1",
            "--run-dir", str(run_dir)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *argv],
        cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == train.EXIT_STOPPED == 75, err
    resume = out.split("Resume with:\n")[1].split("\n")[0].split()
    assert resume[:2] == ["python", os.path.relpath(REPO / "train.py", elsewhere)]
    assert "--resume" in resume


def test_plot_reads_a_resumed_runs_metrics(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from plot_metrics import read_metrics

    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9},
             {"resumed_from": "runs/a/checkpoints/step-000001", "step": 1},
             {"step": 2, "loss": 2.8}, {"step": 3, "loss": 2.7}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 3.0), (2, 2.8), (3, 2.7)]


@CPU_ONLY
def test_what_a_run_says_at_its_start_and_end(dataset, reference_run, tmp_path, capsys):
    """--resume with nothing to resume from a HF checkpoint says where it starts from; a
    LoRA run says what trains; a finished run resumed trains nothing and prints no resume
    command."""
    base = qlora_base(tmp_path / "base")
    argv = ["--data", str(dataset), *SMALL, "--max-steps", "1", "--hf-checkpoint", str(base),
            "--lr", "1e-3", "--lora-rank", "2", "--resume",
            "--run-dir", str(tmp_path / "lora")]  # fmt: skip
    train.main(argv)
    out = capsys.readouterr().out
    assert f"starting from {base}" in out
    assert "LoRA r=2 (alpha 16) on wq,wk,wv,wo,w1,w2,w3: " in out and "parameters train" in out
    finished = tmp_path / "finished"
    shutil.copytree(reference_run, finished)
    train.main(["--data", str(dataset), *SMALL, "--resume", "--run-dir", str(finished)])
    out = capsys.readouterr().out
    assert "the run had finished at step 40 of 40" in out and "resume:" not in out


@CPU_ONLY
def test_a_finished_run_resumed_exports_keeps_its_records_and_exits_0(
    dataset, reference_run, tmp_path, capsys
):
    """A run past its --max-steps has nothing to train: it exports and ends with status 0
    (SystemExit 75, EXIT_STOPPED, would have a requeue script resubmit it forever), its
    plan.json (with the peaks measured) and metrics.jsonl as they were, no sample again."""
    finished = tmp_path / "finished"
    shutil.copytree(reference_run, finished)
    records = {name: (finished / name).read_bytes() for name in ["plan.json", "metrics.jsonl"]}
    assert "measured" in json.loads(records["plan.json"])
    export = tmp_path / "hf"
    train.main(["--data", str(dataset), *SMALL, "--max-steps", "1", "--resume", "--run-dir",
                str(finished), "--export-hf", str(export), "--sample-tokens", "8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "the run had finished at step 40 of 1" in out and "a sample" not in out
    assert (export / "config.json").is_file()
    assert records == {name: (finished / name).read_bytes() for name in records}


def write_ranks_file(path: Path) -> Path:
    """A tiny Llama 3 style ranks file: the 256 single bytes (the same ids as the bytes,
    other token names), then a few merges."""
    import base64

    tokens = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" t", b"in"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


@CPU_ONLY
def test_the_checkpoints_tokenizer_checks_the_data_decodes_the_sample_and_is_exported(
    dataset, tmp_path, capsys
):
    """Data prepared with another tokenizer than the HF checkpoint's is refused, though its
    ids fit the vocabulary; the checkpoint's original/tokenizer.model (and no top-level
    tokenizer files) is the one the sample decodes with and the export carries."""
    base = qlora_base(tmp_path / "base")
    (base / "original").mkdir()
    ranks = write_ranks_file(base / "original" / "tokenizer.model")
    argv = ["--hf-checkpoint", str(base), "--lr", "1e-3", *SMALL, "--max-steps", "1"]
    with pytest.raises(SystemExit):
        train.main([*argv, "--data", str(dataset), "--run-dir", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert f"was prepared with tokenizer bytes, but the checkpoint's tokenizer {ranks}" in err
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the theme of the thing " * 400)
    mine = prepare.prepare([corpus], tmp_path / "mine", ranks, workers=1)
    argv += ["--data", str(mine), "--run-dir", str(tmp_path / "b"), "--sample-tokens", "5"]
    train.main([*argv, "--export-hf", str(tmp_path / "hf")])
    assert "a sample of the trained model (after BOS" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.encode("the thing", add_special_tokens=False) == tokenizer.load_tokenizer(
        ranks
    ).encode("the thing")


@CPU_ONLY
def test_sft_data_samples_after_a_user_turn(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    turn = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    }
    chat.write_text((json.dumps(turn) + "\n") * 200)
    sft = prepare.prepare([chat], tmp_path / "sft", workers=1)
    train.main(["--data", str(sft), "--seq-len", "64", "--batch-tokens", "256", "--max-steps", "1",
                "--sample-tokens", "4", "--run-dir", str(tmp_path / "run")])  # fmt: skip
    out = capsys.readouterr().out
    assert "a sample of the trained model (after a user turn, temperature 0.8)" in out
    assert "<|user|>\nHello! What can you do?<|assistant|>\n" in out


def process_states() -> dict[int, tuple[str, int]]:
    """pid -> (state, parent pid) of every process (Linux's /proc)."""
    states = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:  # ended while listed
            continue
        states[int(stat.parent.name)] = (state, int(ppid))
    return states


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie waits only for its parent to read its end)."""
    states = process_states()
    return [pid for pid in pids if pid in states and states[pid][0] != "Z"]


@CPU_ONLY
def test_workers_stop_when_their_torchrun_is_killed_and_the_run_resumes(dataset, tmp_path):
    """kill -9 of torchrun alone (the OOM killer, an operator): its two workers, adopted by
    another process, stop within 10 s, with a checkpoint of the step they were in, and
    release the run directory: the resume runs."""
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--micro-batch", "4", "--max-steps", "1000",
            "--checkpoint-interval", "500", "--run-dir", str(run_dir)]  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    proc = subprocess.Popen(
        [*launcher, str(REPO / "train.py"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = [pid for pid, (_, ppid) in process_states().items() if ppid == proc.pid]
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while alive(workers) and time.monotonic() < killed + 10:
        time.sleep(0.1)
    assert not alive(workers), "workers outlived their torchrun by 10 s"
    out, err = proc.communicate(timeout=10)
    assert "torchrun (pid" in err and "is gone: stopping after this step" in err, out + err
    (saved,) = (run_dir / "checkpoints").iterdir()
    stopped = shard.step_of(saved)
    assert f"stopped at step {stopped} of 1000 on a signal; saved {saved}" in out, out + err

    run_subprocess(*argv, "--resume", "--max-steps", str(stopped + 2), nproc=2)
    assert max(losses(run_dir)) == stopped + 2


@CPU_ONLY
def test_a_resume_after_a_cut_metrics_line_logs_on_a_line_of_its_own(dataset, tmp_path, capsys):
    """A metrics.jsonl whose last line was cut (a kill mid-write, a full disk), or replaced
    by bytes that are not JSON: the resumed run says which lines are damaged, leaves them as
    they are, and writes its records on lines of their own, which the plot reads."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot_metrics import read_metrics

    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--checkpoint-interval", "2", "--run-dir",
            str(run_dir)]  # fmt: skip
    train.main([*argv, "--max-steps", "2"])
    metrics = run_dir / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 3, "loss": 2.')  # a kill mid-write
    before = metrics.read_bytes()
    capsys.readouterr()
    train.main([*argv, "--max-steps", "3", "--resume"])
    out = capsys.readouterr().out
    assert f"{metrics}: 1 line not a JSON record (line 3), left as found; readers skip them" in out
    after = metrics.read_bytes()
    assert after.startswith(before + b"\n")  # nothing rewritten
    marker = json.loads(after[len(before) + 1 :].splitlines()[0])
    assert marker == {"resumed_from": str(run_dir / "checkpoints/step-000002"), "step": 2}
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert f"{metrics}: skipped 1 line that is not a record (line 3)" in capsys.readouterr().err

    garbage = bytes(range(256)) * 4  # not UTF-8; newlines and carriage returns within
    metrics.write_bytes(garbage)
    train.main([*argv, "--max-steps", "4", "--resume"])
    out = capsys.readouterr().out
    assert f"{metrics}: 5 lines not a JSON record (line 1, 2, 3, 4, 5), left as found" in out
    assert metrics.read_bytes().startswith(garbage)
    assert [r["step"] for r in read_metrics(run_dir)] == [4]


@CPU_ONLY
def test_the_end_of_a_run_prints_only_commands_that_do_what_they_say(
    dataset, reference_run, tmp_path, capsys
):
    """A run resumed from another run's checkpoint into a new directory: without checkpoints
    it names none and prints no command; with them, its export command exports the weights
    it trained (it resumes the last checkpoint, trains nothing more, and exports)."""
    start = str(reference_run / "checkpoints/step-000030")
    argv = ["--data", str(dataset), *SMALL, "--resume", start, "--max-steps", "32"]
    capsys.readouterr()
    train.main([*argv, "--run-dir", str(tmp_path / "none"), "--checkpoint-interval", "0"])
    out = capsys.readouterr().out
    assert "no checkpoint of step 32 (--checkpoint-interval 0): its weights are not kept" in out
    assert "checkpoints:" not in out and "resume:" not in out and "export:" not in out

    run_dir = tmp_path / "kept"
    train.main([*argv, "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert f"checkpoints: {run_dir / 'checkpoints'} (the last: step-000032)" in out
    export = shlex.split(out.split("export:  ")[1].split("\n")[0])
    assert export[:2] == ["python", os.path.relpath(REPO / "train.py")]
    train.main(export[2:])
    out = capsys.readouterr().out
    assert "the run had finished at step 32 of 32" in out and f"exported {run_dir / 'hf'}" in out
    # The final norm's weight, by the same name in both: the checkpoint's, not a fresh one.
    with safe_open(run_dir / "hf" / "model-00001-of-00001.safetensors", "pt") as f:
        exported = f.get_tensor("model.norm.weight")
    (saved,) = (run_dir / "checkpoints/step-000032").glob("*model*.safetensors")
    with safe_open(saved, "pt") as f:
        trained = f.get_tensor("model.norm.weight")
    assert torch.equal(exported, trained) and not torch.equal(trained, torch.ones_like(trained))


# Tiny checkpoints of the Llama family that transformers saves: (config class, its switches).
FAMILY_CHECKPOINTS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(head_dim=24, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),  # a bias on q, k and v
    "qwen3": ("Qwen3Config", dict(head_dim=24)),  # q/k norms, a head dim apart from dim / heads
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0], pad_token_id=None)),  # no RoPE in 1
}


@CPU_ONLY
@pytest.mark.parametrize("family", sorted(FAMILY_CHECKPOINTS))
def test_a_family_checkpoint_trains_as_transformers_computes_and_over_context_parallel_ranks(
    family, dataset, tmp_path
):
    """A tiny checkpoint of each of the Llama family's model types that transformers saved
    (untied): the step-1 loss of train.py --hf-checkpoint is transformers' own over the same
    rows, and 2 gloo ranks sharing each row (--context-parallel 2) take the same steps as one
    process (fp32: rel 1e-5, the sums go in another order)."""
    import transformers

    config_class, switches = FAMILY_CHECKPOINTS[family]
    config = getattr(transformers, config_class)(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=320, max_position_embeddings=512,
        tie_word_embeddings=False, **switches,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path / "hf")
    argv = ["--data", str(dataset), *SMALL, "--hf-checkpoint", str(tmp_path / "hf"),
            "--lr", "1e-3", "--max-steps", "3", "--checkpoint-interval", "0"]  # fmt: skip
    run_subprocess(*argv, "--run-dir", str(tmp_path / "one"))
    run_subprocess(*argv, "--run-dir", str(tmp_path / "cp"), "--context-parallel", "2", nproc=2)
    one, cp = metrics(tmp_path / "one"), metrics(tmp_path / "cp")
    assert [r["loss"] for r in cp] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in cp] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    b = next(iter(data.PackedLoader(data.TokenDataset(dataset), 128, 8, seed=0)))
    with torch.no_grad():
        logits = model(input_ids=b.tokens, position_ids=b.positions).logits
    loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten())  # -100 left out
    assert one[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)


@CPU_ONLY
@pytest.mark.parametrize(
    "config_class, window, documents, layers",
    [
        ("MistralConfig", dict(sliding_window=16), True, (0, 1)),  # Mistral v0.1: every layer
        (
            "Qwen2Config",
            dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
            False,
            (1,),
        ),
        (  # Gemma 3: its first layer local, with a RoPE base of its own
            "Gemma3TextConfig",
            dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                 head_dim=24, query_pre_attn_scalar=20, pad_token_id=None),
            True,
            (0,),
        ),
    ],
)  # fmt: skip
def test_a_checkpoint_with_a_sliding_window_trains_past_it_as_transformers_computes(
    config_class, window, documents, layers, dataset, tmp_path
):
    """--seq-len 128, 8 times the window, through the whole of train.py (the planner too,
    which builds a one-layer copy of the model): the step-1 loss is transformers' over the
    same rows, with --document-mask on short packed documents too (which transformers, given
    their positions and no cache, masks apart), there on 2 context-parallel gloo ranks too
    (rel 1e-5). The logged FLOPs and the plan count each query's min(position + 1/2, window)
    pairs on a windowed layer."""
    import transformers

    config = getattr(transformers, config_class)(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=320, max_position_embeddings=512,
        tie_word_embeddings=False, **window,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path / "hf")
    data_dir, flags = dataset, []
    if documents:  # 64 rows of 128: the plan's data.mean_document_pairs reads each
        rng = np.random.default_rng(0)
        tokens = []
        while len(tokens) <= 64 * 128:
            tokens += [256, *rng.integers(0, 256, rng.integers(5, 60)), 257]
        data_dir, flags = (
            write_dataset(tmp_path / "docs", tokens[: 64 * 128 + 1]),
            ["--document-mask"],
        )
    run_dir = tmp_path / "run"
    argv = ["--data", str(data_dir), *SMALL, "--hf-checkpoint", str(tmp_path / "hf"), "--lr",
            "1e-3", "--max-steps", "1", "--checkpoint-interval", "0", *flags]  # fmt: skip
    train.main([*argv, "--run-dir", str(run_dir)])
    (record,) = metrics(run_dir)
    if documents:  # 2 gloo ranks, each attending whole rows for half the heads, alike
        run_subprocess(*argv, "--run-dir", str(tmp_path / "cp"), "--context-parallel", "2", nproc=2)
        (cp,) = metrics(tmp_path / "cp")
        assert cp["loss"] == pytest.approx(record["loss"], rel=1e-5)
        assert cp["grad_norm"] == pytest.approx(record["grad_norm"], rel=1e-5)

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    b = next(iter(data.PackedLoader(data.TokenDataset(data_dir), 128, 8, seed=0)))
    assert (b.positions[:, 1:] == 0).any() == documents  # packed documents, or none
    with torch.no_grad():
        logits = model(input_ids=b.tokens, position_ids=b.positions, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten())  # -100 left out
    assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)

    args = args_from_hf_config(tmp_path / "hf")
    assert args.sliding_window == 16 and args.window_layers == layers

    def pairs(positions: torch.Tensor) -> float:  # per layer, averaged over the layers
        per_query = positions.double() + 0.5
        windows = [16 if i in args.window_layers else math.inf for i in range(args.n_layers)]
        return sum(per_query.clamp(max=w).sum().item() for w in windows) / args.n_layers

    rows = b.positions if documents else torch.arange(128).expand(8, 128)
    flops = record["model_tflops_per_device"] * 1e12 / record["tokens_per_s_per_device"]
    assert flops == pytest.approx(args.training_flops(1024, pairs(rows)) / 1024, rel=1e-9)
    if documents:
        every_row = torch.cat(
            [r.positions for r in data.PackedLoader(data.TokenDataset(data_dir), 128, 8).in_order()]
        )
        planned = json.loads((run_dir / "plan.json").read_text())["plan"]["attended_per_token"]
        assert planned == pytest.approx(pairs(every_row) / every_row.numel(), rel=1e-9)


def test_a_bare_resume_goes_on_as_the_run_was(dataset, tmp_path, capsys):
    """A bare --resume takes the run's course from its checkpoint: clipping, the held-out data,
    the checkpoints kept (before, each fell back to its default, and the default of 2 rotated
    away three of the run's checkpoints). Another --seed is refused: the checkpoint's data
    order and random state go on whatever it says. The exports are not kept (a branch would
    write over the run's own): the resume line names them. A clipping left to its default is
    the new plan's: the optimizer in backward, which clips nothing, may be asked."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = prepare.prepare([stdlib / "textwrap.py"], tmp_path / "held_out", workers=1)
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--grad-clip", "0.05", "--eval-data", str(held_out),
            "--eval-interval", "2", "--eval-tokens", "256", "--checkpoint-interval", "1",
            "--keep-checkpoints", "5", "--run-dir", str(run_dir)]  # fmt: skip
    train.main([*argv, "--max-steps", "3", "--export-hf", str(tmp_path / "export")])
    capsys.readouterr()
    train.main(["--resume", "--max-steps", "5", "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert "the checkpoint's --export-hf not kept: give it again to export" in out
    assert "exported" not in out
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == [f"step-00000{i}" for i in range(1, 6)]
    state = json.loads((run_dir / "checkpoints/step-000005/train_state.json").read_text())
    assert state["options"]["grad_clip"] == 0.05
    assert state["options"]["eval_data"] == str(held_out)
    assert metrics(run_dir)[-1]["eval_loss"] is not None
    with pytest.raises(SystemExit):
        train.main(["--resume", "--max-steps", "6", "--seed", "7", "--run-dir", str(run_dir)])
    assert "--seed 7: a resumed run goes on with its checkpoint's data order" in (
        capsys.readouterr().err
    )
    default_clip = ["--data", str(dataset), *SMALL, "--checkpoint-interval", "1"]
    train.main([*default_clip, "--max-steps", "1", "--run-dir", str(tmp_path / "clip")])
    train.main(["--resume", "--max-steps", "2", "--optimizer-in-backward", "--run-dir",
                str(tmp_path / "clip")])  # fmt: skip
    assert list(losses(tmp_path / "clip")) == [1, 2]


def test_max_seq_len_never_shortens_a_checkpoints_context(tmp_path):
    tiny = PRESETS["tiny"]  # 2048 positions
    save_hf_checkpoint(tiny, Llama(tiny).named_parameters(), tmp_path / "hf", torch.float32)
    argv = ["--hf-checkpoint", str(tmp_path / "hf"), "--max-seq-len", "1024"]
    opts, _ = options.parse_options(argv)
    with pytest.raises(files.UsageError, match="--max-seq-len 1024 is below the 2048 positions"):
        options.model_args(opts)


def test_a_default_seq_len_past_a_checkpoints_positions_is_named_so(tmp_path):
    short = dataclasses.replace(PRESETS["tiny"], max_seq_len=128)
    save_hf_checkpoint(short, Llama(short).named_parameters(), tmp_path / "hf", torch.float32)
    opts, _ = options.parse_options(["--hf-checkpoint", str(tmp_path / "hf")])
    with pytest.raises(files.UsageError) as error:
        options.model_args(opts)
    assert str(error.value) == (
        f"--seq-len 256 (the default) is past the 128 positions {tmp_path / 'hf'} was trained "
        f"on: pass --seq-len 128, or --max-seq-len 256 to extend its context"
    )


def test_a_checkpoint_saved_before_rope_scaling_had_a_type_resumes():
    """The run record of a llama3.2-1b checkpoint saved at c52560e, before RopeScaling had a
    type and YaRN's fields: it resumes (the missing fields are Llama 3.1's defaults), and a
    checkpoint of another factor is still refused."""
    old_model = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                 "vocab_size": 128256, "ffn_dim": 8192, "norm_eps": 1e-05,
                 "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_seq_len": 8192},
                 "max_seq_len": 131072, "tie_embeddings": True}  # fmt: skip
    record = {"seq_len": 4096, "tokenizer": "bytes", "strategy": "FULL_SHARD", "lora": None}
    now = json.loads(json.dumps(dataclasses.asdict(PRESETS["llama3.2-1b"])))
    shard.check_resumable({**record, "model": old_model}, {**record, "model": now})
    other = {**old_model, "rope_scaling": {**old_model["rope_scaling"], "factor": 8.0}}
    with pytest.raises(files.UsageError, match="model rope_scaling: checkpoint"):
        shard.check_resumable({**record, "model": other}, {**record, "model": now})


def test_the_results_that_the_code_cites_are_in_results():
    """Each (bench/RESULTS.md, "name") in the code, the README and docs/ names text of RESULTS."""
    results = " ".join((REPO / "bench" / "RESULTS.md").read_text().split())
    sources = [*REPO.glob("*.py"), *REPO.glob("kernels/*.py"), *REPO.glob("bench/*.py")]
    cited = []
    for path in [*sources, REPO / "README.md", *REPO.glob("docs/*.md")]:
        for cite in re.finditer(
            r'RESULTS(?:\.md)?[,:]?\s*\(?((?:"[^"]+"[,\s]*(?:and\s*)?)+)', path.read_text()
        ):
            # A name may run over lines, each a comment's.
            cited += [(path.name, " ".join(re.sub(r"\n\s*#?", " ", name).split()))
                      for name in re.findall(r'"([^"]+)"', cite.group(1))]  # fmt: skip
    assert len(cited) > 20
    assert [(path, name) for path, name in cited if name not in results] == []


def test_a_step_makes_its_micro_batches_one_at_a_time():
    """train_step takes the next micro-batch only after the last one's forward and backward: a
    step of many micro-batches holds one (a million of them, made up front, filled the host)."""
    model = w.sharded_model(shard.init_distributed(), w.TINY, "FULL_SHARD", 1, cpu_offload=False)
    optimizer = w.RecordingAdamW(model)
    tokens, labels, positions = (t[0] for t in w.batches(w.TINY, 1))
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(len(forwards)))

    def micro_batches():
        for i in range(w.MICRO_BATCHES):
            assert len(forwards) == i  # the micro-batches before it have been through the model
            yield data.Batch(
                tokens[i], labels[i], positions[i], attention.document_starts(positions[i])
            )

    n_labels = (labels != data.IGNORE_INDEX).sum()
    result = train.train_step(model, optimizer, micro_batches(), w.MICRO_BATCHES, n_labels)
    assert len(forwards) == w.MICRO_BATCHES > 1 and result.loss_sum.isfinite()

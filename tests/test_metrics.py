"""metrics.py: each logged record reaches TensorBoard and W&B (offline) as metrics.jsonl has
it, read back with TensorBoard's own reader and W&B's own protobuf records, and a resumed run
continues both. TensorBoard keeps scalars as float32: rtol 1e-6."""

import json
import struct
import sys
import sysconfig
from pathlib import Path

import pytest

import metrics
import prepare
import train

# The test extra installs both; the GPU machine, which has neither, skips this file.
tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

SMALL = ["--seq-len", "128", "--batch-tokens", "1024", "--micro-batch", "8", "--log-interval",
         "1", "--sample-tokens", "0", "--checkpoint-interval", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return prepare.prepare([stdlib / "argparse.py"], tmp_path_factory.mktemp("data"), workers=1)


def wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file: LevelDB's log format (blocks of 32 KiB
    after a 7-byte header; each record a 7-byte header, whole or in pieces that end at its
    LAST), each a W&B protobuf Record."""
    data, pos, block, records, piece = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        piece += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(wandb_internal_pb2.Record.FromString(piece))
            piece = b""
    return records


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch) -> None:
    """W&B offline, its files under tmp_path."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)


def test_each_record_reaches_tensorboard_and_wandb_and_a_resume_continues_both(
    dataset, tmp_path, offline_wandb
):
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--run-dir", str(run_dir)]
    train.main([*argv, "--max-steps", "2", "--report-to", "tensorboard,wandb"])
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    train.main([*argv, "--max-steps", "3", "--resume", "--report-to", "wandb,tensorboard"])
    # W&B's service process writes the .wandb files: stopping it has them written whole (a
    # loaded machine read one before its last record was, once in four runs of the suite).
    sys.modules["wandb"].teardown()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(records[0]) >= {"peak_gpu_reserved_gib", "gpu_alloc_retries"}
    assert all(0 < r["data_loading_share"] < 1 for r in records)
    numbers = [(r["step"], k, v) for r in records for k, v in r.items() if k != "step" and v]
    assert {k for _, k, _ in numbers} >= {"loss", "lr", "grad_norm", "tokens_per_s", "eta_s"}

    events = tensorboard.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for step, name, value in numbers:
        assert [e.value for e in events.Scalars(name) if e.step == step] == pytest.approx(
            [value], rel=1e-6
        )
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"flags": "--ac none' in config and '"seq_len": 128' in config

    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [r.name.rsplit("-", 1)[1] for r in runs] == [run_id, run_id]  # one run, continued
    logged, configs = {}, []
    for run in runs:
        for record in wandb_records(next(run.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                step = record.history.step.num
                for item in record.history.item:
                    logged[step, item.key or ".".join(item.nested_key)] = json.loads(
                        item.value_json
                    )
            elif kind == "run":
                config = record.run.config.update
                configs.append(
                    {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in config}
                )
    assert logged == {**logged, **{(step, name): value for step, name, value in numbers}}
    assert configs[-1]["options"]["max_steps"] == 3 and configs[-1]["plan"]["seq_len"] == 128


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["step"] for record in map(json.loads, lines) if "loss" in record]


def test_a_new_run_sets_aside_an_earlier_one_that_left_no_checkpoint(
    dataset, tmp_path, offline_wandb, capsys
):
    """An earlier run with no checkpoint to resume from (killed before its first, or
    --checkpoint-interval 0) is another run: its records move aside whole with a copy of its
    options and plan, said in one line, and the new run logs its own steps to its own file,
    TensorBoard directory and W&B id."""
    run_dir = tmp_path / "run"
    argv = ["--data", str(dataset), *SMALL, "--run-dir", str(run_dir), "--checkpoint-interval",
            "0", "--report-to", "tensorboard,wandb"]  # fmt: skip
    train.main([*argv, "--max-steps", "2", "--lr", "0.05"])
    earlier_id = (run_dir / "wandb_run_id").read_text()
    earlier_plan = (run_dir / "plan.json").read_text()
    capsys.readouterr()
    train.main([*argv, "--max-steps", "3"])
    sys.modules["wandb"].teardown()  # the .wandb files written whole (as above)
    aside = run_dir / "earlier-run-1"
    assert (
        f"moved its metrics.jsonl, tensorboard, wandb_run_id to {aside} (and a copy of its "
        f"plan.json, config.toml)" in capsys.readouterr().out
    )
    assert "max_steps = 2" in (aside / "config.toml").read_text()  # the earlier run's, not this
    assert (aside / "plan.json").read_text() == earlier_plan
    assert "max_steps = 3" in (run_dir / "config.toml").read_text()
    assert steps_logged(aside) == [1, 2] and steps_logged(run_dir) == [1, 2, 3]
    assert (aside / "wandb_run_id").read_text() == earlier_id
    assert (run_dir / "wandb_run_id").read_text() != earlier_id
    for directory, steps in ((aside, [1, 2]), (run_dir, [1, 2, 3])):
        events = tensorboard.EventAccumulator(str(directory / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("loss")] == steps
    # --resume with no checkpoint starts anew too (a second set aside); with one, it continues.
    saving = [*argv[:-4], "--report-to", "tensorboard"]
    train.main([*saving, "--max-steps", "4", "--resume"])
    train.main([*saving, "--max-steps", "5", "--resume"])
    assert steps_logged(run_dir) == [1, 2, 3, 4, 5] and steps_logged(run_dir / "earlier-run-2") == [
        1,
        2,
        3,
    ]
    assert not (run_dir / "earlier-run-3").exists()


def test_an_earlier_run_goes_aside_numbered_after_the_highest_there(tmp_path):
    """earlier-run-2 with no -1 (removed by the user): the next is 3, so the numbers keep the
    runs' order."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "earlier-run-2").mkdir()
    metrics.set_aside_earlier_run(tmp_path, lambda line: None)
    assert steps_logged(tmp_path / "earlier-run-3") == [1]
    assert not (tmp_path / "earlier-run-1").exists()


def test_a_mistyped_wandb_mode_is_one_line_before_any_step(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offine")
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", str(dataset), *SMALL, "--run-dir", str(run_dir),
                    "--report-to", "wandb"])  # fmt: skip
    assert exit_info.value.code == 1
    err = capsys.readouterr().err  # the modes as this version of W&B has them
    assert err.startswith("train.py error: --report-to wandb: WANDB_MODE is 'offine', expected ")
    assert "'online'" in err and "'offline'" in err and err.count("\n") == 1
    assert not run_dir.exists()


def test_report_to_none_is_refused_beside_a_reporter():
    assert metrics.report_to_problems("none") == metrics.report_to_problems("") == []
    assert metrics.report_to_problems("none,tensorboard") == [
        "--report-to none reports to nothing: not with tensorboard"
    ]


def test_a_missing_package_is_one_line_before_any_step(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec says so
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", str(dataset), *SMALL, "--run-dir", str(run_dir),
                    "--report-to", "tensorboard,wandb"])  # fmt: skip
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err == "train.py error: --report-to wandb needs its package: pip install wandb\n"
    assert not run_dir.exists()


def test_wandb_without_a_login_is_one_line_before_any_step(dataset, tmp_path, monkeypatch, capsys):
    """W&B's UsageError (no API key) told as what the user does about it, no traceback; its
    server a closed local port, so that nothing reaches the network whatever W&B tries."""
    import wandb

    wandb.teardown()  # W&B keeps the settings it first read (the offline run's above) until then
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"HOME": tmp_path, "NETRC": tmp_path / "netrc", "WANDB_SILENT": "true",
                        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                        "WANDB_BASE_URL": "http://127.0.0.1:9"}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data", str(dataset), *SMALL, "--run-dir", str(run_dir),
                    "--max-steps", "1", "--report-to", "wandb"])  # fmt: skip
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("train.py error: --report-to wandb: W&B did not start (No API key")
    assert err.count("\n") == 1 and "wandb login" in err and "WANDB_API_KEY" in err
    assert "WANDB_MODE=offline" in err and (run_dir / "metrics.jsonl").read_text() == ""


def test_the_metrics_log_is_never_written_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(victim)
    resumed = tmp_path / "run" / "checkpoints" / "step-000010"
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        metrics.JsonLines(tmp_path / "run", 10, resumed, print)
    assert victim.read_text() == "the user's"

"""Where a run's metrics go. train.MetricsLog decides the logged steps and makes each one's
record (docs/training.md lists its fields); the main rank hands it to every reporter here,
which train.setup opens with the run's other files: always `JsonLines` (run_dir/metrics.jsonl),
and with --report-to, `TensorBoard` (run_dir/tensorboard) and `WandB` (Weights & Biases), which
start with the run's config (its options and plan.json). A resumed run continues each; a new
run where an earlier one logged and left no checkpoint sets that one's records aside first
(set_aside_earlier_run, before train.setup writes the new run's plan.json and config.toml).
TensorBoard's and W&B's packages are imported only when asked, and a missing one is told before
the run starts (report_to_problems); so is a W&B that cannot start without the user (no login).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from files import UsageError, no_follow, plural

# --report-to's names, and the package each needs (pip install it).
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def report_to_names(report_to: str) -> list[str]:
    """--report-to's comma list, each name stripped, "none" kept (report_to_problems')."""
    return [name for name in map(str.strip, report_to.split(",")) if name]


def reporters_asked(report_to: str) -> list[str]:
    return [name for name in report_to_names(report_to) if name != "none"]


def report_to_problems(report_to: str) -> list[str]:
    """--report-to's unknown names, missing packages and W&B's mode, before anything is built."""
    problems, asked = [], reporters_asked(report_to)
    if asked and "none" in report_to_names(report_to):
        problems.append(f"--report-to none reports to nothing: not with {', '.join(asked)}")
    for name in asked:
        if name not in REPORTERS:
            problems.append(
                f"--report-to takes a comma list of {', '.join(REPORTERS)} (or none), got {name!r}"
            )
        elif importlib.util.find_spec(REPORTERS[name]) is None:
            problems.append(f"--report-to {name} needs its package: pip install {REPORTERS[name]}")
        elif name == "wandb" and "WANDB_MODE" in os.environ:
            problems += wandb_mode_problems(os.environ["WANDB_MODE"])
    return problems


def wandb_mode_problems(mode: str) -> list[str]:
    """WANDB_MODE checked by W&B's own settings (its modes change between versions), which
    wandb.init would raise mid-start as a long pydantic traceback."""
    import pydantic
    import wandb

    try:
        wandb.Settings(mode=mode)
    except pydantic.ValidationError as e:
        expected = e.errors()[0]["msg"].removeprefix("Input should be ")
        return [f"--report-to wandb: WANDB_MODE is {mode!r}, expected {expected}"]
    return []


def open_reporters(
    report_to: str, run_dir: Path, config: dict, start_step: int, resumed_from, log
) -> list:
    """metrics.jsonl's writer, then each reporter --report-to names."""
    asked, opened = reporters_asked(report_to), [JsonLines(run_dir, start_step, resumed_from, log)]
    if "tensorboard" in asked:
        opened.append(TensorBoard(run_dir, config, start_step))
    if "wandb" in asked:
        opened.append(WandB(run_dir, config))
    return opened


# What a run's reporters keep in its directory, which a new run starts without.
RECORDS = ("metrics.jsonl", "tensorboard", "wandb_run_id")

# What train.setup writes of each run, which set_aside_earlier_run keeps a copy of: the earlier
# run's options and plan. (Copied: should the process die before the new run writes its own,
# check_run_dir still sees the directory as a run's.)
RUN_CONFIG = ("plan.json", "config.toml")


def set_aside_earlier_run(run_dir: Path, log) -> None:
    """A run starting at step 0 where an earlier one logged steps but left no checkpoint (it
    died before its first, or ran with --checkpoint-interval 0) is another run: the earlier
    one's records move whole to run_dir/earlier-run-N, so that metrics.jsonl, TensorBoard and
    W&B (a new id) each hold one run's steps, and readers need no rule for a second run in a
    file. (Moved, not marked in place: TensorBoard and W&B have no such mark.) Its options
    and plan go with them, copied (RUN_CONFIG); W&B's own files (run_dir/wandb) are per id.
    N is the highest there + 1, so that the numbers follow the runs."""
    metrics = run_dir / "metrics.jsonl"
    if not (metrics.is_file() and metrics.stat().st_size):  # an earlier start logged no step
        return
    names = (path.name.removeprefix("earlier-run-") for path in run_dir.glob("earlier-run-*"))
    aside = run_dir / f"earlier-run-{max((int(n) for n in names if n.isdigit()), default=0) + 1}"
    aside.mkdir()
    copied = [name for name in RUN_CONFIG if (run_dir / name).is_file()]
    for name in copied:
        shutil.copyfile(run_dir / name, aside / name)
    moved = [name for name in RECORDS if (run_dir / name).exists()]
    for name in moved:
        os.replace(run_dir / name, aside / name)
    log(
        f"{run_dir} holds the records of an earlier run with no checkpoint to resume from: "
        f"moved its {', '.join(moved)} to {aside}"
        + (f" (and a copy of its {', '.join(copied)})" * bool(copied))
        + ", this run starts its own"
    )


class JsonLines:
    """metrics.jsonl, which only grows: a resume marks its start (`resumed_from`), and a line
    cut short (a kill mid-write, a full disk) stays as it was, ended here."""

    def __init__(self, run_dir: Path, start_step: int, resumed_from: Path | None, log):
        self.path = run_dir / "metrics.jsonl"
        damaged, cut = damaged_lines(self.path)
        if damaged:
            lines = ", ".join(map(str, damaged[:5])) + (", ..." * (len(damaged) > 5))
            log(
                f"{self.path}: {plural(len(damaged), 'line')} not a JSON record "
                f"(line {lines}), left as found; readers skip them"
            )
        with open(self.path, "a", opener=no_follow) as f:
            if cut:
                f.write("\n")
            if resumed_from:
                f.write(json.dumps({"resumed_from": str(resumed_from), "step": start_step}) + "\n")

    def log(self, record: dict) -> None:
        with open(self.path, "a", opener=no_follow) as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


def damaged_lines(path: Path) -> tuple[list[int], bool]:
    """The numbers (from 1) of `path`'s lines that are not a JSON object, and whether its last
    is cut short (no newline). Read a line at a time: a long run's log may be large."""
    damaged, line = [], b"\n"
    if not path.is_file():
        return damaged, False
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                if line.strip() and not isinstance(json.loads(line), dict):
                    damaged.append(number)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
                damaged.append(number)
    return damaged, not line.endswith(b"\n")


class TensorBoard:
    """Each number of a record as a scalar of its name at its step; the config as text. A
    resumed run writes a new event file into the same directory, hiding the earlier files'
    steps after its checkpoint (a killed run logged them): as in metrics.jsonl, the last
    record of a step counts."""

    def __init__(self, run_dir: Path, config: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        purge = start_step + 1 if start_step else None
        self.writer = SummaryWriter(run_dir / "tensorboard", purge_step=purge)
        # Indented four spaces: TensorBoard renders the text as Markdown, this as code.
        text = "    " + json.dumps(config, indent=1).replace("\n", "\n    ")
        self.writer.add_text("config", text, start_step)

    def log(self, record: dict) -> None:
        for name, value in record.items():
            if name != "step" and value is not None:
                self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()  # a record is seen as it is logged, and kept if the run is killed

    def close(self) -> None:
        self.writer.close()


class WandB:
    """One W&B run per run: its id is kept in run_dir/wandb_run_id, which a resumed run
    continues (W&B ignores a step logged again: the killed run's record of it stays).
    WANDB_PROJECT (default: longtune), WANDB_MODE=offline and the others apply; W&B's own
    files go to run_dir/wandb unless WANDB_DIR says where."""

    def __init__(self, run_dir: Path, config: dict):
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: a new one
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "longtune"),
                name=run_dir.resolve().name,
                id=run_id,
                resume="allow",
                config=config,
                dir=os.environ.get("WANDB_DIR", run_dir),
            )
        except (wandb.errors.UsageError, wandb.errors.CommError) as e:  # no key, a wrong one
            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(
                f"--report-to wandb: W&B did not start ({said}): run `wandb login` or set "
                f"WANDB_API_KEY, or log offline with WANDB_MODE=offline (wandb sync uploads later)"
            ) from None
        if run_id is None:
            with open(id_file, "w", opener=no_follow) as f:
                f.write(self.run.id + "\n")

    def log(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()

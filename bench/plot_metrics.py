"""Plots a run's loss and tokens/s from its metrics.jsonl into a PNG you can open.

    pip install matplotlib        # or: pip install ".[plot]"; never needed to train
    python bench/plot_metrics.py runs/default            # writes runs/default/metrics.png
    python bench/plot_metrics.py runs/a runs/b --out compare.png

One figure, two panels sharing the step axis: the loss (dots: the held-out loss, where the
run had --eval-data; the learning rate on a second axis) above, tokens/s per device below.
Several run directories are drawn on the same panels, labelled by directory. A record is
one log step (train.py's --log-interval).
"""

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    """The step records of a run, one per step in step order. metrics.jsonl holds two kinds
    of line (docs/training.md, "metrics.jsonl"): a step's record, which has "loss", and a resume's
    marker {"resumed_from": ..., "step": N}; after a resume the steps a killed run logged
    past its checkpoint are logged again, and the last record of a step is the one that
    counts. A line that is no such record (cut short by a kill or a full disk, or not JSON at all)
    is skipped, and the number skipped said on stderr."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a --run-dir?)")
    records, skipped = [], []
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        else:
            skipped.append(number)
    if skipped:
        first = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        noun = "line that is not a record" if len(skipped) == 1 else "lines that are not records"
        print(f"{path}: skipped {len(skipped)} {noun} (line {first})", file=sys.stderr)
    by_step = {r["step"]: r for r in records if "loss" in r}
    return [by_step[step] for step in sorted(by_step)]


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, sharex=True, figsize=(9, 7))
    lr_ax = loss_ax.twinx()
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        (line,) = loss_ax.plot(steps, [r["loss"] for r in records], label=name)
        evals = [r for r in records if r.get("eval_loss") is not None]
        if evals:
            eval_steps, eval_losses = [r["step"] for r in evals], [r["eval_loss"] for r in evals]
            loss_ax.plot(
                eval_steps, eval_losses, "o", color=line.get_color(), label=f"{name}, held out"
            )
        lr_ax.plot(steps, [r["lr"] for r in records], color=line.get_color(), alpha=0.3, ls="--")
        speed_ax.plot(steps, [r["tokens_per_s_per_device"] for r in records], label=name)
    loss_ax.set_ylabel("loss (mean over the step's labelled tokens)")
    lr_ax.set_ylabel("learning rate (dashed)")
    speed_ax.set_ylabel("tokens/s per device")
    speed_ax.set_xlabel("step")
    loss_ax.legend()
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="train.py --run-dir directories")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/metrics.png)")
    opts = parser.parse_args()
    try:
        runs = {str(d): read_metrics(d) for d in opts.run_dirs}
    except FileNotFoundError as e:
        sys.exit(f"plot_metrics.py: {e}")
    out = opts.out or opts.run_dirs[0] / "metrics.png"
    plot(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

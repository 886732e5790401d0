"""longtune against its peer (HF transformers + Liger, bench/peer_hf.py) in one call: the
same model shape, sequence length, optimizer (AdamW, fp32 master weights, bf16 compute)
and random initial weights. longtune runs through train.py itself, on the default corpus,
or both on the rows of --data (e.g. packed documents from bench/sft_corpus.py; the peer then
masks attention between them with --peer-attn).

    python bench/long_context.py --preset llama3.2-1b --seq 8192 32768 \\
        --longtune "--ac full" "--ac none" --peers hf+liger hf
    # QLoRA: longtune's flags carry the LoRA options; --peer-qlora R makes the peer QLoRA too
    python bench/long_context.py --preset llama3.1-8b --seq 8192 --peer-qlora 16 \\
        --longtune "--lora-rank 16 --lora-alpha 32 --quantize-base nf4 --ac full"

One sequence per GPU per step (--batch-tokens seq x nproc); what the flags leave open,
train.py plans (the "plan" field of each longtune row).
Prints one row per run: tokens/s per GPU, MFU (model.flops_formula's 6*N + 6*L*S*H*Dh FLOPs per
token, 4*N for a frozen base, the attention counted within documents where they are masked
apart, against 989 TFLOP/s), peak GPU memory (torch.cuda.max_memory_allocated), peak host RSS.
Step times are the median over the steps after the first two (warm-up: compilation, allocator),
or the last step's when --steps is below 3 (for steps of minutes, where warm-up is a small
part). longtune logs each step, so the host waits for the GPU after each one; the peer times its
steps with no wait between them. --window T times both alike: T warm-up steps, then T steps
timed as one window with no wait inside it (longtune logs at steps T and 2T only).
A run that fails (e.g. out of memory) gets its last error line instead.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], log_dir: Path, name: str, timeout: float) -> tuple[int, str]:
    log = log_dir / f"{name}.log"
    try:
        with log.open("w") as f:
            proc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = -1
    return code, log.read_text()


def last_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[:150]
    return (lines[-1] if lines else "no output")[:150]


def longtune(preset: str, seq_len: int, flags: str, steps: int, log_dir: Path, nproc: int,
             timeout: float, data: str | None, window: int) -> dict:  # fmt: skip
    run_dir = Path(tempfile.mkdtemp(prefix="longtune-bench-"))
    launcher = [sys.executable] if nproc == 1 else ["torchrun", f"--nproc-per-node={nproc}"]
    cmd = launcher + [
        "train.py", "--model", preset, "--seq-len", str(seq_len),
        "--batch-tokens", str(seq_len * nproc),
        "--max-steps", str(2 * window if window else steps),
        "--log-interval", str(window or 1), "--checkpoint-interval", "0",
        "--lr", "1e-5", "--min-lr", "1e-5", "--warmup-steps", "0", "--run-dir", str(run_dir),
        "--sample-tokens", "0",
    ] + (["--data", data] if data else []) + shlex.split(flags)  # fmt: skip
    name = f"longtune-{preset}-{seq_len}-{flags.replace(' ', '').replace('-', '')}"
    code, output = run(cmd, log_dir, name, timeout)
    metrics = run_dir / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    trace = run_dir / "trace-rank0.json"
    if trace.exists():  # --profile in the flags: keep where the profiled step's time went
        summary = subprocess.run([sys.executable, "bench/profile_summary.py", str(trace)],
                                 cwd=ROOT, capture_output=True, text=True).stdout  # fmt: skip
        (log_dir / f"{name}-profile.txt").write_text(summary)
        print(summary, flush=True)
    timed = records[2:] or records[-1:]  # with --window: the record of steps T+1..2T
    # The flags train.py planned for the run, whatever of them were given.
    plan = [line for line in output.splitlines() if line.startswith("plan: ")]
    impl = f"longtune {flags}" if flags else "longtune, planned"
    if code != 0 or not timed:
        return {"impl": impl, "error": last_error(output)}
    return {
        "impl": impl,
        "plan": plan[0].split(" | ")[0].removeprefix("plan: ") if plan else None,
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
        # The tokens of a step over its time: with --context-parallel a row is split over
        # GPUs, so seq_len / (tokens/s per GPU) would not be a step's time.
        "step_s": statistics.median(r["tokens"] / r["step"] / r["tokens_per_s"] for r in timed),
        "optimizer_s": statistics.median(r["optimizer_s"] for r in timed),
        "peak_gib": max(r["peak_gpu_mem_gib"] for r in records),
        "host_gib": max(r["host_peak_rss_gib"] for r in records),
        "loss": records[-1]["loss"],
    }


def peer(impl: str, preset: str, seq_len: int, steps: int, log_dir: Path, nproc: int,
         timeout: float, data: str | None, attn: str, qlora: int, window: int) -> dict:  # fmt: skip
    launcher = [sys.executable] if nproc == 1 else ["torchrun", f"--nproc-per-node={nproc}"]
    cmd = launcher + ["bench/peer_hf.py", "--preset", preset, "--seq-len", str(seq_len),
                      "--steps", str(window or steps - 2), "--warmup", str(window or 2),
                      "--attn", attn]  # fmt: skip
    if data:
        cmd += ["--data", data]
    if impl == "hf":
        cmd.append("--no-liger")
    if qlora:
        cmd += ["--qlora", str(qlora)]
    code, output = run(cmd, log_dir, f"{impl.replace('+', '-')}-{preset}-{seq_len}", timeout)
    results = [line for line in output.splitlines() if line.startswith("{")]
    if code != 0 or not results:
        return {"impl": impl, "error": last_error(output)}
    return json.loads(results[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--seq", type=int, nargs="+", default=[8192])
    parser.add_argument(
        "--longtune", nargs="*", default=[""], help='flag sets; "" (the default): all planned'
    )
    parser.add_argument("--peers", nargs="*", default=["hf+liger"], choices=["hf+liger", "hf"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--data", help="a prepared dataset both train on (default: random)")
    parser.add_argument("--peer-attn", default="sdpa", choices=["sdpa", "flex_attention"])
    parser.add_argument("--peer-qlora", type=int, default=0, metavar="R",
                        help="the peers train QLoRA of rank R (bench/peer_hf.py)")  # fmt: skip
    parser.add_argument("--window", type=int, default=0, metavar="T",
                        help="T warm-up steps, then T timed as one window")  # fmt: skip
    parser.add_argument("--log-dir", default=os.environ.get("OUT", "bench-logs"))
    opts = parser.parse_args()
    log_dir = Path(opts.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq_len in opts.seq:
        for flags in opts.longtune:
            result = longtune(opts.preset, seq_len, flags, opts.steps, log_dir, opts.nproc,
                              opts.timeout, opts.data, opts.window)  # fmt: skip
            rows.append((seq_len, result))
            print(json.dumps({"seq_len": seq_len, **result}), flush=True)
        for impl in opts.peers:
            result = peer(impl, opts.preset, seq_len, opts.steps, log_dir, opts.nproc,
                          opts.timeout, opts.data, opts.peer_attn, opts.peer_qlora,
                          opts.window)  # fmt: skip
            rows.append((seq_len, result))
            print(json.dumps({"seq_len": seq_len, **result}), flush=True)
    print(f"\n{opts.preset}, {opts.nproc} GPU(s)")
    print(f"{'seq':>7}  {'impl':34} {'tok/s/GPU':>10} {'MFU':>6} {'peak GiB':>9} {'host GiB':>9}")
    for seq_len, r in rows:
        if "error" in r:
            print(f"{seq_len:7d}  {r['impl']:34} failed: {r['error']}")
        else:
            print(f"{seq_len:7d}  {r['impl']:34} {r['tokens_per_s_per_gpu']:10,.0f} "
                  f"{r['mfu']:6.3f} {r['peak_gib']:9.2f} {r['host_gib']:9.2f} "
                  f"step {r['step_s']:.2f} s, "
                  f"optimizer {r.get('optimizer_s', 0):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()

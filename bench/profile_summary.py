"""Where a profiled step's time goes: reads the Chrome trace that `train.py --profile N` writes
and prints GPU time by kind of work, GPU idle time, and the most expensive kernels.

    python bench/profile_summary.py runs/x/trace-rank0.json

Only the work the traced steps launched counts. GPU time of a kind is the sum of its kernels'
durations (on any stream); "busy" is the union of all kernel and copy intervals, and idle is
the time between the first one's start and the last one's end when none ran (waiting on the
host: a CPU optimizer, launches, host-to-device copies not yet issued).
"""

import argparse
import bisect
import collections
import json
import re
from pathlib import Path

# First match wins: cuDNN's attention kernels also name "wgmma", so attention comes before
# matmul. The longtune kernels are matched by the names of the @triton.jit functions.
KINDS = [
    ("attention", r"cudnn|flash|fmha|attention|sdpa|flex"),
    ("nccl", r"nccl"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|wgmma"),
    ("longtune kernels", r"_rms_norm_|_rope_|_glu_|_cross_entropy_kernel"),
    ("fp8 quantization", r"_quantize_|_amax_kernel"),
    ("optimizer", r"adam|foreach|multi_tensor"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other (elementwise, reductions, copies in kernels)"


def idle_gaps(work: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """The intervals between the first start and the last end that no GPU work covers, each
    as (start, end, the work that ended at its start, the work that started at its end)."""
    gaps, end, before = [], float("-inf"), None
    for e in sorted(work, key=lambda e: e["ts"]):
        if before is not None and e["ts"] > end:
            gaps.append((end, e["ts"], before, e))
        if e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e
    return gaps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=8, help="kernels to list by time")
    parser.add_argument("--gaps", type=int, default=5, help="longest GPU idle gaps to list")
    opts = parser.parse_args()
    events = json.loads(Path(opts.trace).read_text())["traceEvents"]
    # The trace records every kernel that ran while it was active, the tail of the step before
    # included (the host launches ahead of the GPU): GPU work counts only if its launch, the
    # runtime call of the same correlation id, is in the trace too.
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu_work = [
        e
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and e.get("args", {}).get("correlation") in launched
    ]
    kernels = [e for e in gpu_work if e["cat"] == "kernel"]
    copies = [e for e in gpu_work if e["cat"] != "kernel"]
    # The trace also holds the warm-up steps' annotations, whose kernels it does not record:
    # a step counts if it holds at least half as many kernel starts as the busiest one.
    starts = sorted(k["ts"] for k in kernels)
    steps = [
        e
        for e in events  # each step is annotated twice: on the CPU and on the GPU timeline
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")
    ]
    held = [
        bisect.bisect_right(starts, e["ts"] + e["dur"]) - bisect.bisect_left(starts, e["ts"])
        for e in steps
    ]
    if kernels and steps:
        steps = [e for e, n in zip(steps, held, strict=True) if n >= max(held) / 2]
    wall_us = sum(e["dur"] for e in steps)
    n_steps = max(len(steps), 1)
    print(f"{len(steps)} profiled step(s), {wall_us / n_steps / 1e6:.2f} s host wall each")
    if not kernels:
        print("no GPU kernels in the trace (a CPU run)")
        return
    first, last = min(e["ts"] for e in gpu_work), max(e["ts"] + e["dur"] for e in gpu_work)
    span = last - first
    print(f"their GPU work: {span / n_steps / 1e6:.2f} s from its first start to its last end")

    by_kind = collections.Counter()
    by_name = collections.Counter()
    calls = collections.Counter()
    for k in kernels:
        by_kind[kind_of(k["name"])] += k["dur"]
        by_name[k["name"][:90]] += k["dur"]
        calls[k["name"][:90]] += 1
    for c in copies:
        by_kind[" ".join(c["name"].split()[:2])] += c["dur"]
    gaps = idle_gaps(gpu_work)
    idle = sum(end - start for start, end, _, _ in gaps)

    def row(label: str, us: float, count: str = "") -> None:
        share = f"{us / span:6.1%}"
        print(f"  {label:52} {us / n_steps / 1e6:8.3f} s {share} {count}")

    print("GPU time per step by kind (kernels on all streams; shares of the GPU span)")
    for kind, us in by_kind.most_common():
        row(kind, us)
    row("GPU busy (union of all intervals)", span - idle)
    row("GPU idle within the span", idle)
    print(f"top {opts.top} kernels (time per step, share, calls per step)")
    for name, us in by_name.most_common(opts.top):
        row(name, us, f"{calls[name] / n_steps:g}")

    # A gap whose next kernel was launched just before it started is time the GPU waited on
    # the host; one launched long before waited on something else (a copy, an event).
    print(f"longest {opts.gaps} idle gaps (from the first start; the kernels around them)")
    for start, end, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[: opts.gaps]:
        waited = (after["ts"] - launched[after["args"]["correlation"]]) / 1e3
        print(
            f"  +{(start - first) / 1e6:7.3f} s  {(end - start) / 1e3:8.2f} ms  after "
            f"{before['name'][:40]}, before {after['name'][:40]} (launched {waited:.2f} ms "
            f"before it started)"
        )


if __name__ == "__main__":
    main()

"""Where a profiled step's time goes: reads the Chrome trace that `train.py --profile N` writes
and prints GPU time by kind of work, GPU idle time, and the most expensive kernels.

    python bench/profile_summary.py runs/x/trace-rank0.json

GPU time of a kind is the sum of its kernels' durations (on any stream); "busy" is the union
of all kernel and copy intervals, so idle = step wall time - busy is time no GPU work ran
(waiting on the host: a CPU optimizer, launches, host-to-device copies not yet issued).
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
    ("longtune kernels", r"_rms_norm_|_rope_|_swiglu_|_cross_entropy_kernel"),
    ("optimizer", r"adam|foreach|multi_tensor"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other (elementwise, reductions, copies in kernels)"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=8, help="kernels to list by time")
    opts = parser.parse_args()
    events = json.loads(Path(opts.trace).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
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
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    wall_us = sum(e["dur"] for e in steps)
    n_steps = max(len(steps), 1)
    print(f"{len(steps)} profiled step(s), {wall_us / n_steps / 1e6:.2f} s wall each")
    if not kernels:
        print("no GPU kernels in the trace (a CPU run)")
        return

    by_kind = collections.Counter()
    by_name = collections.Counter()
    for k in kernels:
        by_kind[kind_of(k["name"])] += k["dur"]
        by_name[k["name"][:90]] += k["dur"]
    for c in copies:
        by_kind[" ".join(c["name"].split()[:2])] += c["dur"]
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels + copies])

    def row(label: str, us: float) -> None:
        share = f"{us / wall_us:6.1%}" if wall_us else ""
        print(f"  {label:52} {us / n_steps / 1e6:8.3f} s {share}")

    print("GPU time per step by kind (kernels on all streams; shares of the wall time)")
    for kind, us in by_kind.most_common():
        row(kind, us)
    row("GPU busy (union of all intervals)", busy)
    row("GPU idle", wall_us - busy)
    print(f"top {opts.top} kernels")
    for name, us in by_name.most_common(opts.top):
        row(name, us)


if __name__ == "__main__":
    main()

"""What is live at the peak of a `--memory-snapshot` trace, grouped by the line of longtune
that allocated it (the first frame in model.py, offload.py, shard.py, train.py or kernels/).

    python3 bench/snapshot_peak.py runs/x/memory-snapshot-rank0.pickle [--top 30]

The trace is replayed in order: an allocation adds its block, `free_requested` removes it
(a block freed on one stream but still in use by another waits for `free_completed` before
the allocator reuses it; counting only that leaves side-stream copies alive that are not).
Blocks allocated before the recording began are not in the trace: those still allocated
when the snapshot was taken are added as "before recording" (the weights, mostly).
torch writes the snapshot as a pickle, which this reads as one: open only snapshots of your
own runs.
"""

import argparse
import collections
import pickle
import re

GiB = 2**30
OUR_FILES = ("/model.py", "/hf.py", "/offload.py", "/optim.py", "/shard.py", "/train.py")
OUR_KERNELS = "/kernels/"


def site(frames: list[dict]) -> str:
    """The first frame of ours; else the first Python frame (torch's); else, for what
    autograd's engine allocates in backward (no Python frames), the first ATen op."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    for frame in python:
        if frame["filename"].endswith(OUR_FILES) or OUR_KERNELS in frame["filename"]:
            return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
    if python:
        frame = python[0]
        return f"(torch) {frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
    for frame in frames:
        name = frame["name"]
        if "at::native::" in name and not re.search(r"empty|resize", name):
            return "(backward) " + name.split("(")[0]
    return "(unknown)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--device", type=int, default=0)
    a = parser.parse_args()
    with open(a.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    trace = snapshot["device_traces"][a.device]
    in_trace = {e["addr"] for e in trace if e["action"] == "alloc"}
    before = sum(
        block["size"]
        for segment in snapshot["segments"]
        if segment["device"] == a.device
        for block in segment["blocks"]
        if block["state"] == "active_allocated" and block.get("addr") not in in_trace
    )
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])
        if total > peak:
            peak, peak_at = total, i
    live = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], site(event.get("frames", [])))
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    by_site = collections.Counter()
    count = collections.Counter()
    for size, where in live.values():
        by_site[where] += size
        count[where] += 1
    print(
        f"peak {(before + peak) / GiB:.2f} GiB at event {peak_at} of {len(trace)}: "
        f"{before / GiB:.2f} before recording + {peak / GiB:.2f} in the trace"
    )
    print(f"the peak's event: {site(trace[peak_at].get('frames', []))}")
    for where, size in by_site.most_common(a.top):
        print(f"{size / GiB:8.3f} GiB {count[where]:5d} x  {where}")


if __name__ == "__main__":
    main()

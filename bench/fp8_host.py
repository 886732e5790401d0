"""The host's side of a projection group's forward + backward, bf16 against FP8.

    python bench/fp8_host.py [--models llama3.2-1b llama3.1-8b] [--tokens 8192]

Per projection group of a block (the weights that read one input: model.Attention's wq, wk,
wv; wo; the MLP's w1, w3; w2): the host's milliseconds a call (the loop's time before its one
torch.cuda.synchronize, so the host's own work while the GPU's queue is not full), the
milliseconds a call once the GPU has finished (the larger of the two sets the step's pace),
and the kernels one call runs on the GPU and its launch calls, counted by torch.profiler.
A projection at the model's shapes whose host time is above its GPU's waits on the host.
Results: bench/RESULTS.md.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402
from model import ModelArgs  # noqa: E402

# 20 calls of at most ~25 launches stay below the GPU's queue of pending launches, so the
# host never waits on the GPU inside the timed loop.
CALLS = 20


def projection_groups(args: ModelArgs) -> list[tuple[str, list[int], int]]:
    """(names, each weight's out_features, their in_features) of a block's projection groups."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return [
        ("wq,wk,wv", [q, kv, kv], args.dim),
        ("wo", [args.dim], q),
        ("w1,w3", [args.ffn_dim] * 2, args.dim),
        ("w2", [args.dim], args.ffn_dim),
    ]


def group_call(tokens: int, outs: list[int], k: int, fp8: bool):
    """A forward + backward of one group in bf16, by F.linear or fp8_linears."""
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in outs]
    weights = [w.div_(k**0.5).requires_grad_() for w in weights]
    dys = [torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for n in outs]

    def call():
        if fp8:
            ys = kernels.fp8_linears(x, weights, [None] * len(weights))
        else:
            ys = [torch.nn.functional.linear(x, w) for w in weights]
        # Gradients returned, not added into .grad: a block's input is no leaf in training.
        torch.autograd.grad(ys, [x, *weights], dys)

    return call


def host_and_wall_ms(call) -> tuple[float, float]:
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host * 1e3 / CALLS, (time.perf_counter() - start) * 1e3 / CALLS


def launches(call) -> tuple[int, int]:
    """The kernels (and memsets) one call runs on the GPU, and the host's launch calls."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.events()
    on_gpu = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
    launch_calls = sum("LaunchKernel" in e.name or "Memset" in e.name for e in events)
    return on_gpu, launch_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3.2-1b", "llama3.1-8b"])
    parser.add_argument("--tokens", type=int, default=8192)
    cli = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {cli.tokens} tokens")
    print("model        group      path  host ms  wall ms  GPU kernels  launch calls")
    for model in cli.models:
        for names, outs, k in projection_groups(ModelArgs.from_name(model)):
            for path in ("bf16", "fp8"):
                call = group_call(cli.tokens, outs, k, fp8=path == "fp8")
                host, wall = host_and_wall_ms(call)
                on_gpu, launch_calls = launches(call)
                print(
                    f"{model:12} {names:10} {path:4} {host:8.3f} {wall:8.3f}"
                    f" {on_gpu:12} {launch_calls:13}"
                )


if __name__ == "__main__":
    main()

"""FSDP2 sharding on 2 CPU ranks (gloo) against one unsharded process, sharded init and HF
loading, and the memory estimate.

The 2-rank half runs once per session (`torchrun ... tests/dist_worker.py`, see there);
the tests here compare what it wrote with plain `Llama` modules in this process.

Tolerances, all fp32 on CPU (param_dtype fp32 so both sides compute the same math, only
the order of the sums differs: per-rank partial sums reduced over ranks):
  losses and global gradient norms: relative 1e-5;
  the first step's clipped gradients: max |a - b| <= 1e-5 * max |b| per tensor;
  weights after 3 AdamW steps: max |a - b| <= 0.05 * lr (absolute, 5e-5), because AdamW's
  g / (sqrt(v) + eps) magnifies the rounding of gradients near eps (1e-8) by up to lr / eps:
  measured 6e-6, where a wrong update of one element would show as ~lr = 1e-3;
  init and HF loading: bitwise equal (copies, no arithmetic).
"""

import dataclasses
import errno
import functools
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import dist_worker as w
import pytest
import torch
import torch.distributed.checkpoint.filesystem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import kernels.fp8
import shard
from data import TokenDataset, attended_per_token
from files import UsageError
from hf import load_hf_checkpoint, save_hf_checkpoint
from lora import LoRAConfig, apply_lora
from model import Llama, ModelArgs
from offload import AC_MODES
from options import plan_of, technique_problems
from plan import (
    CPU_FLOPS,
    GPU_FLOPS,
    GPU_MARGIN,
    HOST_MARGIN,
    OVERHEAD_GIB,
    PLANNED,
    PROJECTIONS,
    STRATEGIES,
    Machine,
    Plan,
    block_bytes,
    block_params,
    choose_plan,
    count_weights,
    estimate_memory,
    fits,
    memory_needed,
    pinned_shard_bytes,
    plan_problems,
    step_seconds,
)
from shard import init_distributed

FP32_RTOL = 1e-5
# --fp8's losses and norms after a step: e4m3 rounds an element the other way where the ranks'
# order of summation moves a weight's last bits. One process with its embedding moved by 1e-7
# moved its norms by 1.3e-3 (issue #39: assert_close_to_e4m3s_rounding); 8.1e-4 was seen on
# another machine (issue #46); 2 GPUs under --context-parallel 2 about 2e-3 (bench/RESULTS.md,
# "Call 11: --context-parallel 2 with --fp8"). Below that, the test fails by machine.
FP8_RTOL = 3e-3
ADAMW_ATOL = 0.05 * w.LR
REPO = Path(__file__).resolve().parents[1]


def random_model(args: ModelArgs, seed: int) -> Llama:
    model = Llama(args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def dist_out(tmp_path_factory) -> Path:
    """Runs the 2-rank worker once; a hung rank fails the run at the timeout."""
    out = tmp_path_factory.mktemp("dist")
    save_hf_checkpoint(
        w.ODD, random_model(w.ODD, 5).named_parameters(), out / "hf_odd",
        dtype=torch.float32, max_shard_bytes=200_000,
    )  # fmt: skip
    other = dataclasses.replace(w.ODD, n_layers=3)
    save_hf_checkpoint(other, Llama(other).named_parameters(), out / "hf_mismatch")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "dist_worker.py"), str(out)]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def context_parallel_quantizers(n: int) -> tuple:
    """kernels/fp8.py's reference quantizers as n context-parallel ranks apply them to a
    micro-batch of whole rows: an activation's or output gradient's column copy scaled per
    column over each rank's slice of the rows (positions seq_len / n apart), which one scale
    per column cannot hold, so it comes dequantized (scales of 1); rows and weights as they
    are."""
    rows, columns, _ = kernels.fp8.REFERENCE_QUANTIZERS
    tokens = 2 * w.BATCH * w.SEQ  # a micro-batch's; no weight of the scenarios has as many rows
    rank = torch.arange(tokens) % w.SEQ // (w.SEQ // n)

    def by_rank(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] != tokens:
            return columns(x)
        dequantized = torch.empty(x.shape[1], tokens)
        for r in range(n):
            q, scale = columns(x[rank == r])
            dequantized[:, rank == r] = q.float() * scale[:, None]
        return dequantized, torch.ones(x.shape[1])

    return rows, by_rank, lambda x: by_rank(x) + rows(x)


def reference_run(scenario: w.Scenario) -> dict:
    """The same steps as dist_worker.train in one process, no FSDP: each step's whole
    global batch (whole rows), micro-batch by micro-batch, the sums divided by the global
    target count; each data-parallel rank's rows apart, as the ranks take them, and with
    --fp8 each context-parallel rank's columns apart where e4m3 scales by column."""
    quantizers = kernels.fp8.REFERENCE_QUANTIZERS
    if scenario.fp8 and scenario.context_parallel > 1:
        quantizers = context_parallel_quantizers(scenario.context_parallel)
    with unittest.mock.patch.object(kernels.fp8, "REFERENCE_QUANTIZERS", quantizers):
        return reference_steps(scenario)


def reference_steps(scenario: w.Scenario) -> dict:
    model = Llama(scenario.args, scenario.ops(), mask_documents=scenario.document_mask)
    if scenario.lora is not None:
        apply_lora(model, scenario.lora, torch.float32)
    model.init_weights(w.SEED)
    trained = [p for p in model.parameters() if p.requires_grad]
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    groups = [  # weight decay on the matrices, as optim.ShardedAdamW
        {"params": [p for p in trained if p.ndim >= 2], "weight_decay": w.WEIGHT_DECAY},
        {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=w.LR, fused=True)
    tokens, labels, positions = w.batches(scenario.args, 2, scenario.document_mask)
    data_rank_rows = torch.arange(2 * w.BATCH).chunk(2 // scenario.context_parallel)
    losses, norms = [], []
    for step in range(w.STEPS):
        n_targets = (labels[step] != -100).sum()
        step_loss = 0.0
        for mb, rows in itertools.product(range(w.MICRO_BATCHES), data_rank_rows):
            batch = (t[step, mb][rows] for t in (tokens, labels, positions))
            loss = model(*batch, "sum")
            (loss / n_targets).backward()
            step_loss += loss.item()
        losses.append(step_loss / n_targets.item())
        norms.append(torch.nn.utils.clip_grad_norm_(trained, w.MAX_NORM).item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {
        n: p.detach().view(torch.uint8) for n, p in model.named_parameters() if not p.requires_grad
    }
    return {"losses": losses, "norms": norms, "grads": grads, "weights": weights, "frozen": frozen,
            "initial": initial}  # fmt: skip


def assert_tensors_close(got: dict, want: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Per tensor: max |a - b| <= rtol * max |b| + atol."""
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = (got[name] - ref).abs().max()
        assert err <= rtol * ref.abs().max() + atol, f"{name}: max error {err:.2e}"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The references are tiny: with CI's 2 cores shared with the 2 ranks, OpenMP threads
    spin against each other (10 s instead of 0.1 s a run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", list(w.TRAIN_SCENARIOS))
def test_sharded_training_matches_one_process(dist_out, scenario):
    """Losses, global gradient norms (clipped: they exceed MAX_NORM) and the weights after
    3 steps of 2 accumulated micro-batches equal the unsharded run's; with context
    parallelism too, where each rank holds half of each row (and one packed document
    crosses the halves). With QLoRA: the adapters, and the 4-bit base that each rank
    quantized and kept its rows of, bit for bit. With --fp8 the projections' e4m3 copies."""
    got = torch.load(dist_out / f"{scenario}.pt")
    want = reference_run(w.TRAIN_SCENARIOS[scenario])
    assert min(want["norms"]) > w.MAX_NORM  # so clipping is exercised
    # In e4m3, weights that differ in their last bits after a step (the ranks sum gradients
    # in another order) may round an element to the next e4m3 value: a later step's loss and
    # norm agree to FP8_RTOL, and AdamW may move a weight whose gradient is near zero by up to
    # its lr the other way, so each weight's update is compared by its norm (0.2% off
    # measured). The first step's gradients, from equal weights, stay at fp32's.
    fp8 = w.TRAIN_SCENARIOS[scenario].fp8
    if fp8 and w.TRAIN_SCENARIOS[scenario].context_parallel > 1:
        assert_close_to_e4m3s_rounding(got, want)
    else:
        rtol = FP8_RTOL if fp8 else FP32_RTOL
        torch.testing.assert_close(got["losses"], want["losses"], rtol=rtol, atol=0)
        torch.testing.assert_close(got["norms"], want["norms"], rtol=rtol, atol=0)
        assert_tensors_close(got["grads"], want["grads"], rtol=FP32_RTOL)
        if fp8:
            assert_updates_close(got, want, rtol=0.02)
        else:
            assert_tensors_close(got["weights"], want["weights"], atol=ADAMW_ATOL)
    assert got["frozen"].keys() == want["frozen"].keys()
    for name, frozen in want["frozen"].items():
        assert torch.equal(got["frozen"][name], frozen), name


def assert_close_to_e4m3s_rounding(got: dict, want: dict) -> None:
    """--fp8 under context parallelism against one process. Attention runs by groups of
    heads there, so its outputs differ from one process's in fp32's last bits, and a few
    e4m3 elements round the other way from the first step. One process moved as far with
    its embedding moved by 1e-7: each step-1 gradient by up to 1.9% of its norm (here 0.9%),
    each weight's update over 3 steps by 11% (here 7%), the norms by 1.3e-3. The ranks
    without --fp8 would be 9.2% and 24% off, and with each column's scale over whole rows
    instead of each rank's half, 3.7% and 15%."""
    for name, grad in want["grads"].items():
        error = (got["grads"][name] - grad).norm() / grad.norm()
        assert error <= 0.03, f"{name}'s step-1 gradient: {error:.2e} of its norm off"
    assert_updates_close(got, want, rtol=0.2)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=FP8_RTOL, atol=0)
    torch.testing.assert_close(got["norms"], want["norms"], rtol=FP8_RTOL, atol=0)


def assert_updates_close(got: dict, want: dict, rtol: float) -> None:
    """Each trained weight's change over the steps within rtol of its norm (both runs start
    from the same weights)."""
    for name, weight in want["weights"].items():
        update = weight - want["initial"][name]
        error = (got["weights"][name] - weight).norm() / update.norm()
        assert error <= rtol, f"{name}'s update: {error:.2e} of its norm off"


def in_backward_reference() -> dict:
    """dist_worker.in_backward's steps in one process, no FSDP: torch.optim.AdamW."""
    model = Llama(w.TINY)
    model.init_weights(w.SEED)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": w.WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=w.LR)
    tokens, labels, positions = w.batches(w.TINY, 2)
    losses, norms = [], []
    for step in range(w.STEPS):
        loss = model(tokens[step, 0], labels[step, 0], positions[step, 0], "sum")
        n_targets = (labels[step, 0] != -100).sum()
        (loss / n_targets).backward()
        losses.append(loss.item() / n_targets.item())
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}  # fmt: skip


@pytest.mark.parametrize("processes", [1, 2])
def test_optimizer_in_backward_on_host_shards_takes_adamws_steps(dist_out, tmp_path, processes):
    """optim.ShardedOptimizerInBackward on FSDP with CPU offload, 1 process (here) and 2
    (dist_worker): the losses, gradient norms and weights of torch.optim.AdamW's steps,
    losses and norms within 1e-6 (fp32, measured 1e-7), weights within ADAMW_ATOL (the
    rounding of sums over 2 ranks, magnified by AdamW: measured 4e-7 with 1 process and
    1.7e-6 with 2)."""
    if processes == 1:
        w.in_backward(init_distributed(), tmp_path)
    got = torch.load((tmp_path if processes == 1 else dist_out) / f"in_backward.{processes}.pt")
    want = in_backward_reference()
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-6, atol=0)
    assert_tensors_close(got["weights"], want["weights"], atol=ADAMW_ATOL)


def test_context_parallel_model_takes_whole_rows_or_the_positions_of_its_slice(dist_out):
    """Whole rows without positions (generate's call): the logits one process computes, on
    every rank; a loss without the positions of the rank's slice is refused."""
    model = Llama(w.TINY)
    model.init_weights(w.SEED)
    tokens = torch.arange(2 * 13).reshape(2, 13) % w.TINY.vocab_size
    with torch.no_grad():
        want = model(tokens)
    for rank in range(2):
        got = torch.load(dist_out / f"cp_whole_rows.rank{rank}.pt")
        torch.testing.assert_close(got, want, rtol=FP32_RTOL, atol=1e-6)
        message = (dist_out / f"cp_without_positions.rank{rank}.txt").read_text()
        assert "pass the positions of the slice" in message


def test_two_nodes_shard_within_a_node_and_share_rows_within_it(tmp_path):
    """Two torchrun agents on this host (--nnodes 2, 2 processes each, c10d rendezvous):
    HYBRID_SHARD's shard group is a node's ranks, its replicate group one rank per node, the
    context-parallel group within a node; and training across them equals one process."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=longtune-test", str(REPO / "tests" / "dist_worker.py"), str(tmp_path),
             "nodes"],
            cwd=REPO, env={**env, "LONGTUNE_TEST_NODE": str(node)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in range(2)
    ]  # fmt: skip
    for agent in agents:
        output = agent.communicate(timeout=240)[0]
        assert agent.returncode == 0, output[-6000:]
    records = [json.loads((tmp_path / f"nodes.rank{r}.json").read_text()) for r in range(4)]
    node_of = [r["node"] for r in records]
    for rank, r in enumerate(records):
        same_node = [other for other in range(4) if node_of[other] == r["node"]]
        assert r["shard"] == same_node
        assert sorted(node_of[other] for other in r["replicate"]) == ["0", "1"]
        assert rank in r["context"] and set(r["context"]) <= set(same_node)
        assert len(r["context"]) == 2
    got = torch.load(tmp_path / "hybrid_context_parallel.pt")
    want = reference_run(w.TRAIN_SCENARIOS["hybrid_context_parallel"])
    torch.testing.assert_close(got["losses"], want["losses"], rtol=FP32_RTOL, atol=0)
    assert_tensors_close(got["grads"], want["grads"], rtol=FP32_RTOL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_sharded_init_equals_unsharded_init(dist_out, cpu_offload):
    """Uneven shards (201 and 321 rows over 2 ranks) included; on the host or not."""
    got = torch.load(dist_out / f"init_cpu_offload_{cpu_offload}.pt")
    model = Llama(w.ODD)
    model.init_weights(seed=7)
    for name, param in model.named_parameters():
        assert torch.equal(got[name], param.detach()), name


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_sharded_hf_load_equals_unsharded_load(dist_out, strategy):
    got = torch.load(dist_out / f"hf_{strategy}.pt")
    model = Llama(w.ODD)
    load_hf_checkpoint(model, dist_out / "hf_odd")
    for name, param in model.named_parameters():
        assert torch.equal(got[name], param.detach()), name


def test_a_full_disk_on_the_main_rank_is_said_on_every_rank(dist_out):
    """The main rank alone writes train_state.json: its error reaches the other rank, which
    would otherwise wait for it at the next collective (the worker would hang)."""
    messages = [(dist_out / f"full_disk.rank{r}.txt").read_text() for r in range(2)]
    for message in messages:
        assert message.startswith(f"no space left to write checkpoint {dist_out}/full_disk/step-0")
    assert not list((dist_out / "full_disk").iterdir())


def test_mismatched_checkpoint_fails_on_every_rank_alike(dist_out):
    messages = [(dist_out / f"hf_mismatch.rank{r}.txt").read_text() for r in range(2)]
    assert messages[0] == messages[1]
    assert "does not fit the model" in messages[0]
    assert "num_hidden_layers" in messages[0] or "n_layers" in messages[0]


# ----------------------------------------------------------------------------------------
# The memory estimate
# ----------------------------------------------------------------------------------------

PLAN = Plan(seq_len=4096, world_size=8, ac="full")


def estimate(args: ModelArgs, **changes):
    return estimate_memory(args, dataclasses.replace(PLAN, **changes))


@pytest.mark.parametrize(
    "preset", ["tiny", "llama3.2-1b", "llama3-8b", "qwen2.5-7b", "qwen3-8b", "mistral-7b"]
)
def test_estimate_counts_the_models_parameters(preset):
    args = ModelArgs.from_name(preset)
    with torch.device("meta"):
        model = Llama(args)
    est = estimate(args)
    assert est.num_params == sum(p.numel() for p in model.parameters())
    assert block_params(args) == sum(p.numel() for p in model.layers[0].parameters())
    # LoRA's frozen base counts every block parameter: Qwen2's q/k/v biases, Qwen3's QK-norm.
    lora = count_weights(args, LoRAConfig(rank=4, alpha=4.0), 2)
    assert lora.block_frozen_bytes == 2 * block_params(args)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("ac_mode", AC_MODES)
def test_estimate_parts_add_up(strategy, ac_mode):
    args = ModelArgs.from_name("llama3-8b")
    est = estimate(args, strategy=strategy, ac=ac_mode, nproc_per_node=4)
    parts = [est.parameters, est.gradients, est.optimizer, est.activations, est.loss]
    assert all(part >= 0 for part in parts)
    assert sum(parts) + est.overhead == pytest.approx(est.gpu_total)
    assert est.host_total == 0
    assert "GPU total" in est.format()


def test_pinned_host_memory_is_rounded_to_powers_of_two_per_tensor():
    args = ModelArgs.from_name("tiny")
    # tiny's tok_embeddings [320, 96] fp32 over 2 ranks: 160 x 96 x 4 = 61,440 -> 65,536.
    assert pinned_shard_bytes(args, 2) >= 65_536
    with torch.device("meta"):
        params = list(Llama(args).parameters())
    shards = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in params)
    assert shards < pinned_shard_bytes(args, 2) < 2 * shards


def test_estimate_orders_the_options_sensibly():
    args = ModelArgs.from_name("llama3-8b")
    est = functools.partial(estimate, args)
    # 8B on 8 ranks: 16 bytes of fp32 state per parameter / 8 = 2 bytes each ~ 15 GiB.
    fp32_state = 16 * args.num_params() / 8 / 2**30
    assert est().optimizer == pytest.approx(fp32_state / 2)  # AdamW: 8 of the 16 bytes
    assert est(ac="none").activations > est(ac="selective").activations
    assert est(ac="selective").activations > est(ac="full").activations
    assert est(activation_offload=True, ac="none").activations < est(
        ac="none").activations  # fmt: skip
    assert est(strategy="SHARD_GRAD_OP").parameters > est().parameters
    assert est(strategy="NO_SHARD").gpu_total > est().gpu_total + fp32_state
    offloaded = est(cpu_offload=True)
    assert offloaded.optimizer == 0
    # Host: AdamW's moments exactly, the pinned parameter and gradient shards rounded up to
    # powers of two by the caching host allocator (more, but less than twice as much).
    assert fp32_state < offloaded.host_total < fp32_state * 1.5
    assert est(kernels=False, seq_len=8192).loss > est(seq_len=8192).loss
    # Past a few thousand tokens the peak is the last block's backward, where activations
    # grow linearly with the sequence.
    assert est(seq_len=32768).phase == est(seq_len=65536).phase == "last block backward"
    assert est(seq_len=65536).activations == pytest.approx(2 * est(seq_len=32768).activations,
                                                           rel=0.05)  # fmt: skip
    with pytest.raises(ValueError, match="expected one of"):
        est(ac="some")
    with pytest.raises(ValueError, match="expected one of"):
        est(strategy="ZERO3")


def test_with_activation_offload_the_peak_is_near_the_first_blocks_backward():
    """Offloaded activations leave the GPU nearly empty of them, so the peak is where backward
    ends its blocks: the second block's, fetched with the first, beside every later block's
    fp32 gradient shard (measured on the H100: bench/RESULTS.md, issue #24, third session)."""
    args = ModelArgs.from_name("llama3.2-1b")
    kw = dict(world_size=1, seq_len=98304, ac="full", mlp_tile=0, kernels=True)
    offloaded, kept = estimate(args, **kw, activation_offload=True), estimate(args, **kw)
    assert offloaded.phase == "offloaded block backward"
    assert kept.phase == "last block backward"
    block = block_params(args)
    later_blocks = 4 * block * (args.n_layers - 2)  # llama3.2-1b is tied: no head's shard
    reduction = block * (4 + 4)  # its fp32 buffer, reduce-scattered into its fp32 shard
    assert offloaded.gradients == pytest.approx((later_blocks + reduction) / 2**30)
    # The measured peak was 27.60 GiB; the estimate without these moments said 25.42.
    assert offloaded.gpu_tensors == pytest.approx(27.60, rel=0.05)


@pytest.mark.parametrize(
    "preset, blocks, measured, fields",
    [
        ("llama3.1-70b", 6, 29.30, dict(seq_len=98304, mlp_tile=16384, offload_blocks=3)),
        ("llama3.1-8b", 6, 64.01, dict(seq_len=524288, mlp_tile=16384, offload_blocks=2)),
        ("llama3.2-1b", 4, 37.64, dict(seq_len=524288, ac="attention", mlp_tile=4096, lora=None)),
    ],
)
def test_estimate_within_5_percent_of_the_peaks_measured(preset, blocks, measured, fields):
    """Peaks allocated on one H100 by bench/few_blocks.py (bench/RESULTS.md, issue #24, "The
    block in backward"): QLoRA r16 in NF4 at 98,304 and 524,288 tokens, and full fine-tuning,
    with activation offload. The peak is inside cuDNN attention's backward, whose fp32
    workspace (8 bytes a query element) the estimate had not counted."""
    args = dataclasses.replace(ModelArgs.from_name(preset), n_layers=blocks)
    qlora = LoRAConfig(rank=16, alpha=16.0, quantize_base="nf4")
    plan = dict(world_size=1, ac="full", activation_offload=True, lora=qlora, long_documents=False)
    est = estimate(args, **{**plan, **fields})
    assert est.gpu_tensors == pytest.approx(measured, rel=0.05)


def test_context_parallel_divides_the_activations_not_the_state():
    args = ModelArgs.from_name("llama3.1-8b")
    kw = dict(world_size=2, seq_len=262144, ac="attention")
    whole, halves = estimate(args, **kw), estimate(args, **kw, context_parallel=2)
    assert halves.activations == pytest.approx(whole.activations / 2, rel=1e-6)
    assert (halves.parameters, halves.optimizer) == (whole.parameters, whole.optimizer)
    # Each rank holds 131072 tokens of the row: what one rank would need for a row of those.
    alone = estimate(args, **{**kw, "seq_len": 131072})
    assert halves.activations == pytest.approx(alone.activations, rel=1e-6)


def test_estimate_of_the_optimizer_in_backward():
    args = ModelArgs.from_name("llama3.1-8b")
    est = estimate(args, world_size=1, seq_len=131072, optimizer_in_backward=True)
    fsdp = estimate(args, world_size=1, seq_len=131072)
    total = args.num_params()
    # GPU: the bf16 weights, no fp32 state, a few gradients in flight (not a full set).
    assert est.parameters == pytest.approx(2 * total / 2**30)
    assert est.optimizer == 0
    assert est.gradients < 0.5 * est.parameters
    assert est.activations == fsdp.activations
    assert est.gpu_total < fsdp.gpu_total - 8 * total / 2**30
    # Host: 12 bytes per parameter (96 GB for 8B) and the staging buffers, under 128 GiB.
    assert 12 * total / 2**30 < est.host_total < 100


def test_estimate_of_the_optimizer_in_backward_on_host_shards():
    """With --cpu-offload the GPU keeps FSDP's gathered units only, not a bf16 copy of every
    weight; the host the fp32 shards and moments (12 bytes a parameter, plain memory) and
    the gradients whose updates wait (a block's and the embedding's: under 3 GiB for 8B)."""
    args = ModelArgs.from_name("llama3.1-8b")
    kw = dict(world_size=1, seq_len=131072, optimizer_in_backward=True)
    alone, on_shards = estimate(args, **kw), estimate(args, **kw, cpu_offload=True)
    state = 12 * args.num_params() / 2**30
    assert on_shards.parameters < alone.parameters - 10 and on_shards.optimizer == 0
    assert on_shards.activations == alone.activations
    assert state < on_shards.host_total < state + 3


def test_estimate_of_qlora_counts_adapters_state_and_a_4_bit_base():
    args = ModelArgs.from_name("llama3.1-8b")
    est = functools.partial(estimate, args, world_size=1)
    lora = LoRAConfig(rank=16, alpha=32.0)
    qlora = LoRAConfig(rank=16, alpha=32.0, quantize_base="nf4")
    # rank 16 on all seven projections of 32 blocks: 42M adapter parameters, AdamW's 8 bytes.
    adapters = 32 * 16 * (2 * (4096 + 4096) + 2 * (1024 + 4096) + 3 * (14336 + 4096))
    assert est(lora=qlora).optimizer == pytest.approx(8 * adapters / 2**30)
    # The frozen base: bf16 (2 bytes a weight) with LoRA, about half a byte with NF4.
    # (plus the gathered copies: embedding and output, kept from forward into backward,
    # and two blocks).
    bf16_base = 2 * args.num_params() / 2**30
    assert bf16_base < est(lora=lora).parameters < bf16_base + 3
    # The difference: the linears of the 32 stored blocks and of the 2 gathered ones, at
    # 2 - 33/64 bytes a weight, less the one weight that NF4 dequantizes at a time (w1).
    linears = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
    saved = (32 + 2) * linears * (2 - 33 / 64) - 2 * 14336 * 4096
    difference = est(lora=lora).parameters - est(lora=qlora).parameters
    assert difference == pytest.approx(saved / 2**30, rel=1e-3)
    assert est(lora=qlora).gradients < 0.1 < est().gradients
    # Accumulating keeps the adapters' gradients only (fp32, 4 bytes each).
    accumulating = est(lora=qlora, grad_accum=2).gradients - est(lora=qlora).gradients
    assert accumulating == pytest.approx(4 * adapters / 2**30, rel=1e-6)


# ----------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------

# The machines of bench/RESULTS.md: each GPU's free memory (its total less the ~0.5 GiB
# CUDA context) and the host's memory (the box's, less what the system keeps).
H100 = Machine(world_size=1, nproc_per_node=1, gpu_gib=78.7, host_gib=120.0)
H200 = Machine(world_size=1, nproc_per_node=1, gpu_gib=139.9, host_gib=120.0)
H200_X2 = Machine(world_size=2, nproc_per_node=2, gpu_gib=139.9, host_gib=240.0)

# Every recorded GPU run of bench/RESULTS.md with its tokens/s per GPU or s/step (one
# sequence per GPU per step, FULL_SHARD, bf16, the kernels): (preset, seq_len, machine,
# planned fields, measured peak GiB, tokens/s per GPU). The 1 x H200 rows are the
# "Sharding and offload" table (tokens/s from its step seconds).
TILED_SINCE = ("llama3.2-1b", 131072, H100,
               dict(ac="attention", cpu_offload=True, mlp_tile=16384), 22.52, 10628)  # fmt: skip
RECORDED = [
    ("llama3.2-1b", 8192, H100, dict(ac="none"), 24.55, 45386),
    ("llama3.2-1b", 8192, H100, dict(ac="full"), 19.49, 38484),
    ("llama3.2-1b", 8192, H100, dict(ac="attention"), 19.48, 39087),
    ("llama3.2-1b", 32768, H100, dict(ac="full"), 22.07, 25744),
    ("llama3.2-1b", 32768, H100, dict(ac="attention"), 22.45, 29270),
    ("llama3.2-1b", 65536, H100, dict(ac="attention"), 29.50, 19713),
    ("llama3.2-1b", 131072, H100, dict(ac="attention"), 44.00, 11657),
    ("llama3.2-1b", 131072, H100, dict(ac="full", activation_offload=True), 32.67, 9595),
    # tokens/s of these two: one call after checkpointed blocks stopped running their MLP
    # tiles again (#23); their peaks as first recorded.
    ("llama3.2-1b", 131072, H100, dict(ac="attention", cpu_offload=True), 30.19, 10568),
    TILED_SINCE,
    ("llama3.2-1b", 131072, H100, dict(ac="attention", cpu_offload=True, mlp_tile=16384,
                                       activation_offload=True), 15.24, 10368),
    ("llama3.2-1b", 262144, H100, dict(ac="attention", cpu_offload=True, mlp_tile=16384,
                                       activation_offload=True), 28.99, 5972),
    ("llama3.2-1b", 524288, H100, dict(ac="attention", cpu_offload=True, mlp_tile=16384,
                                       activation_offload=True), 56.51, 3204),
    ("llama3.2-3b", 131072, H100, dict(ac="full", cpu_offload=True), 37.78, 4088),
    ("llama3.1-8b", 131072, H100, dict(ac="full", mlp_tile=8192, optimizer_in_backward=True),
     58.05, 2507),
    ("llama3.1-8b", 8192, H200_X2, dict(ac="none"), 84.33, 9486),
    ("llama3.1-8b", 32768, H200_X2, dict(ac="full", cpu_offload=True), 17.92, 1972),
    ("llama3.1-8b", 131072, H200_X2, dict(ac="full", mlp_tile=16384), 93.06, 2485),
    ("llama3.1-8b", 131072, H200_X2, dict(ac="attention", mlp_tile=16384), 124.54, 3029),
    ("llama3.1-8b", 131072, H200_X2, dict(ac="full", cpu_offload=True), 59.94, 2183),
    ("llama3.1-8b", 131072, H200_X2, dict(ac="attention", activation_offload=True), 106.28,
     3165),
    ("llama3.2-1b", 4096, H200, dict(ac="none"), 19.94, 4096 / 0.116),
    ("llama3.2-1b", 4096, H200, dict(ac="full"), 19.46, 4096 / 0.115),
    ("llama3.2-1b", 16384, H200, dict(ac="none"), 34.09, 16384 / 0.388),
    ("llama3.2-1b", 16384, H200, dict(ac="selective"), 29.41, 16384 / 0.393),
    ("llama3.2-1b", 16384, H200, dict(ac="full"), 20.35, 16384 / 0.474),
    ("llama3.2-1b", 16384, H200, dict(ac="full", activation_offload=True), 20.35, 16384 / 0.476),
    ("llama3.2-1b", 16384, H200, dict(ac="full", cpu_offload=True), 4.01, 16384 / 1.468),
    ("llama3.2-1b", 32768, H200, dict(ac="none"), 53.19, 32768 / 1.018),
    ("llama3.2-1b", 32768, H200, dict(ac="full"), 22.07, 32768 / 1.253),
    ("llama3.2-1b", 32768, H200, dict(ac="full", activation_offload=True), 22.07, 32768 / 1.259),
]  # fmt: skip


def recorded_plan(seq_len: int, machine: Machine, fields: dict) -> Plan:
    base = Plan(seq_len, world_size=machine.world_size, nproc_per_node=machine.nproc_per_node)
    return dataclasses.replace(base, **fields)


def situation(run) -> tuple:
    return run[0], run[1], run[2]


@pytest.mark.parametrize("run", RECORDED, ids=lambda r: f"{r[0]}-{r[1]}-{r[3]}")
def test_the_estimate_of_each_recorded_run_is_within_5_percent(run):
    """The estimate against each recorded peak (one 4 GiB CPU-offload peak is 0.24 GiB over,
    6%: the tolerance is 5% or half a GiB)."""
    preset, seq_len, machine, fields, peak, _ = run
    est = estimate_memory(ModelArgs.from_name(preset), recorded_plan(seq_len, machine, fields))
    assert est.gpu_tensors == pytest.approx(peak, rel=0.05, abs=0.5)


def tiles_run_again(run) -> bool:
    """Whether a run's tokens/s were measured while a checkpointed block still ran its MLP
    tiles again in recomputation, which step_seconds no longer counts (the peaks hold)."""
    tiled = run[3].get("mlp_tile") and run[3]["ac"] in ("full", "attention")
    return tiled and run is not TILED_SINCE


def test_the_ranking_orders_recorded_runs_as_measured():
    """Runs of one model, sequence and machine: the faster by tokens/s (by more than 3%,
    the spread of one call's figures) is ranked first."""
    pairs = 0
    for a, b in itertools.combinations(RECORDED, 2):
        if situation(a) != situation(b) or abs(a[5] / b[5] - 1) < 0.03:
            continue
        if tiles_run_again(a) or tiles_run_again(b):
            continue
        args = ModelArgs.from_name(a[0])
        time_a = step_seconds(args, recorded_plan(a[1], a[2], a[3]))
        time_b = step_seconds(args, recorded_plan(b[1], b[2], b[3]))
        assert (a[5] > b[5]) == (time_a < time_b), (a, b)
        pairs += 1
    assert pairs >= 19


# Recorded steps beyond RECORDED's, dense causal rows: (preset, seq_len, machine, fields,
# seconds a step). CPU: the tiny preset, fp32, the reference ops.
CPU = Machine(world_size=1, nproc_per_node=1, gpu_gib=None, host_gib=16.0)
QLORA16 = LoRAConfig(rank=16, alpha=16.0, quantize_base="nf4")
STEPS = [
    # "Context parallelism (issue #11)": one row over the 2 GPUs
    ("llama3.1-8b", 262144, H200_X2, dict(context_parallel=2, ac="attention", mlp_tile=16384),
     75.6),
    ("llama3.2-1b", 524288, H200_X2, dict(context_parallel=2, ac="attention", mlp_tile=16384),
     82.2),
    # "Context parallelism, longer sequences (2026-11-23)"
    ("llama3.1-8b", 524288, H200_X2, dict(context_parallel=2, ac="attention", mlp_tile=16384,
     activation_offload=True, offload_blocks=22, cpu_offload=True), 304),
    ("llama3.2-1b", 1048576, H200_X2, dict(context_parallel=2, ac="attention", cpu_offload=True),
     329),
    # "llama3.1-8b at 1,048,576 tokens over 2 H200 (2026-11-23, second session)"
    ("llama3.1-8b", 1048576, H200_X2, dict(context_parallel=2, ac="full", mlp_tile=16384,
     activation_offload=True, offload_blocks=28), 1339),
    # "llama3.1-70b QLoRA on one H200 (issue #14)"
    ("llama3.1-70b", 32768, H200, dict(lora=dataclasses.replace(QLORA16, alpha=32.0), ac="full",
     mlp_tile=8192), 40.6),
    # "The first block's backward, SwiGLU in place, a 10% GPU margin: ..." (issue #24's runs)
    ("llama3.1-8b", 262144, H100, dict(ac="full", mlp_tile=16384, activation_offload=True,
     offload_blocks=12, cpu_offload=True, optimizer_in_backward=True), 247),
    ("llama3.1-70b", 98304, H100, dict(lora=QLORA16, ac="full", mlp_tile=16384,
     activation_offload=True, offload_blocks=77), 253),
    ("llama3.1-8b", 524288, H100, dict(lora=QLORA16, ac="full", mlp_tile=16384,
     activation_offload=True, offload_blocks=28), 683),
    ("llama3.2-1b", 524288, H100, dict(ac="attention", mlp_tile=4096, activation_offload=True),
     170),
    # "llama3.1-8b at 131072, packed sft rows against dense causal, at f70c413: 3.26x"
    ("llama3.1-8b", 131072, H100, dict(ac="full", mlp_tile=16384, optimizer_in_backward=True),
     49.52),
    # "Planner: CPU rate"
    ("tiny", 2048, CPU, dict(param_dtype="fp32", kernels=False), 0.17),
    ("tiny", 16384, CPU, dict(param_dtype="fp32", kernels=False), 6.64),
]  # fmt: skip


@pytest.mark.parametrize(
    "run",
    [(*r[:4], r[1] / r[5]) for r in RECORDED] + STEPS,
    ids=lambda r: f"{r[0]}-{r[1]}-{r[2].world_size}x-{r[3]}",
)
def test_the_step_time_guess_is_within_2x_of_each_recorded_step(run):
    """step_seconds, the plan's "a step takes about", against every recorded step of dense
    causal rows: RECORDED's (one sequence per GPU, from tokens/s per GPU) and STEPS'. Under
    context parallelism a rank computes its share of the row (the guess was 2.3x the 8B
    step at 262144 over 2 GPUs when it counted the whole row); a LoRA base computes no
    weight gradients. (Not the tiny preset on a GPU, whose steps are launch-bound; packed
    rows are the next test's.)"""
    preset, seq_len, machine, fields, seconds = run
    flops = GPU_FLOPS if machine.gpu_gib else CPU_FLOPS
    plan = recorded_plan(seq_len, machine, fields)
    guess = step_seconds(ModelArgs.from_name(preset), plan, flops)
    assert 0.5 < guess / seconds < 2, guess


# "Training on packed SFT rows" (H100, c1a2642): bench/sft_corpus.py --tokens 12000000
# (seed 0, the sft corpus), documents masked apart; (preset, seq_len, fields, tokens/s).
PACKED_STEPS = [
    ("llama3.2-1b", 131072, dict(ac="attention"), 43907),
    ("llama3.2-1b", 131072, dict(ac="full"), 40151),
    ("llama3.1-8b", 131072, dict(ac="full", mlp_tile=8192, optimizer_in_backward=True), 7214),
    ("llama3.2-1b", 1048576, dict(ac="full", activation_offload=True, cpu_offload=True,
                                  mlp_tile=16384), 32250),
]  # fmt: skip


@pytest.fixture(scope="module")
def sft_corpus(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from sft_corpus import write_corpus

    return TokenDataset(write_corpus(tmp_path_factory.mktemp("sft"), 12_000_000, seed=0))


@pytest.mark.parametrize("run", PACKED_STEPS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}")
def test_the_step_time_guess_of_packed_rows_counts_the_attention_within_documents(run, sft_corpus):
    """Packed rows with documents masked apart attend within their documents: the plan
    takes the data's pairs per token (data.attended_per_token), and the guess is within 2x
    of each recorded step (with a whole row's attention it was 24x the 1B's at 1,048,576)."""
    preset, seq_len, fields, tokens_per_s = run
    attended = attended_per_token(sft_corpus, seq_len)
    plan = recorded_plan(seq_len, H100, dict(fields, attended_per_token=attended))
    guess = step_seconds(ModelArgs.from_name(preset), plan)
    assert 0.5 < guess * tokens_per_s / seq_len < 2, guess


@pytest.mark.parametrize("preset, seq_len, machine", sorted({situation(r) for r in RECORDED},
                                                            key=str))  # fmt: skip
def test_the_plan_for_each_recorded_run_fits_and_is_no_slower(preset, seq_len, machine):
    """The planner, given the machine and sequence of recorded runs (one sequence per GPU per
    step), chooses a plan whose estimate fits with the margins; where it is a recorded run,
    that run trained and its measured peak was inside the margin; and it is ranked no
    slower than the fastest recorded run that fit the margin."""
    args = ModelArgs.from_name(preset)
    plan = choose_plan(args, machine, Plan(seq_len), {}, sequences=1, batch_is_fixed=True)
    assert fits(estimate_memory(args, plan), machine)
    runs = [r for r in RECORDED if situation(r) == (preset, seq_len, machine)]
    planned = {name: getattr(plan, name) for name in PLANNED}
    for _, _, _, fields, peak, _ in runs:
        if recorded_plan(seq_len, machine, fields) == plan:
            assert peak + OVERHEAD_GIB <= (1 - GPU_MARGIN) * machine.gpu_gib, planned
    inside = [r for r in runs if r[4] + OVERHEAD_GIB <= (1 - GPU_MARGIN) * machine.gpu_gib]
    fastest = min(step_seconds(args, recorded_plan(seq_len, machine, r[3])) for r in inside)
    assert step_seconds(args, plan) <= fastest * 1.001, planned


def test_a_host_that_cannot_hold_every_block_gets_the_first_blocks_it_can():
    """llama3.1-8b, one 1,048,576-token sequence over 2 x H200 (context parallel): every
    block's activations on the host need more than the node has, and fewer on the GPU more
    than a GPU has; the plan offloads the first N blocks, the most that fit the host."""
    args = ModelArgs.from_name("llama3.1-8b")
    base = Plan(1048576, context_parallel=2)
    plan = choose_plan(args, H200_X2, base, {}, sequences=1, batch_is_fixed=True)
    assert plan.activation_offload and 0 < plan.offload_blocks < args.n_layers - 1
    assert fits(estimate_memory(args, plan), H200_X2)
    for more in (plan.offload_blocks + 1, None):
        assert not fits(estimate_memory(args, dataclasses.replace(plan, offload_blocks=more)),
                        H200_X2)  # fmt: skip
    # A user's --offload-blocks is kept: 20 leaves too much on the GPU.
    with pytest.raises(ValueError, match="the planner's choice instead of --offload-blocks 20"):
        choose_plan(args, H200_X2, base, {"offload_blocks": 20, "activation_offload": True},
                    sequences=1, batch_is_fixed=True)  # fmt: skip


def test_the_estimate_stores_what_a_qlora_model_holds():
    """count_weights (the stored part of the parameter term) against the tensors of a built
    LoRA model with a 4-bit base: the NF4 rows and scales, the bf16 rest, fp32 adapters."""
    with torch.device("meta"):
        model = Llama(w.QLORA_ARGS)
    apply_lora(model, w.QLORA, torch.bfloat16)
    held = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    weights = count_weights(w.QLORA_ARGS, w.QLORA, param_bytes=2)
    assert 4 * weights.trained + weights.frozen_bytes == held


def test_fsdp_on_one_rank_gathers_into_a_copy():
    """Why the estimate counts a unit's gathered weights beside its stored ones even on one
    rank: FSDP2 gathers into a buffer of its own there too (a frozen bf16 unit here)."""
    init_distributed()
    module = torch.nn.Linear(64, 64, dtype=torch.bfloat16).requires_grad_(False)
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    module.unshard()
    for param in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
        stored = param._sharded_param_data.untyped_storage().data_ptr()
        assert param._unsharded_param.untyped_storage().data_ptr() != stored
    module.reshard()


def test_70b_qlora_at_96k_offloads_as_many_blocks_as_a_125_gib_host_holds():
    """Issue #24: llama3.1-70b with a 4-bit base, one 98,304-token sequence, one 80 GiB GPU
    and a 125 GiB host: every block but the last on the host is too much for it, and the
    exact count (not one of a few coarse steps) fits both."""
    args = ModelArgs.from_name("llama3.1-70b")
    machine = Machine(world_size=1, nproc_per_node=1, gpu_gib=80.0, host_gib=125.0)
    base = Plan(98304, lora=LoRAConfig(rank=16, alpha=16.0, quantize_base="nf4"))
    plan = choose_plan(args, machine, base, {}, sequences=1, batch_is_fixed=True)
    assert plan.activation_offload and plan.offload_blocks is not None
    assert fits(estimate_memory(args, plan), machine)
    one_more = dataclasses.replace(plan, offload_blocks=plan.offload_blocks + 1)
    host_usable = (1 - HOST_MARGIN) * machine.host_gib
    assert memory_needed(estimate_memory(args, one_more), machine)[1] > host_usable


def test_8b_at_128k_has_a_plan_inside_one_80_gib_gpu_and_a_128_gib_host():
    args = ModelArgs.from_name("llama3.1-8b")
    machine = Machine(world_size=1, nproc_per_node=1, gpu_gib=80.0, host_gib=128.0)
    plan = choose_plan(args, machine, Plan(131072), {}, sequences=4, batch_is_fixed=False)
    est = estimate_memory(args, plan)
    gpu, host = memory_needed(est, machine)
    assert gpu <= (1 - GPU_MARGIN) * 80 and host <= 0.95 * 128
    # Only the optimizer in backward fits (fp32 state on the host, 12 bytes a parameter),
    # and it cannot accumulate: the default batch becomes one sequence.
    assert plan.optimizer_in_backward and plan.grad_accum == 1 and plan.micro_batch == 1


@pytest.mark.parametrize(
    "wanted",
    [dict(ac="none"), dict(ac="full", mlp_tile=0), dict(activation_offload=False),
     dict(cpu_offload=True), dict(micro_batch=2), dict(grad_accum=2, ac="selective")],
)  # fmt: skip
def test_the_planner_keeps_what_the_user_set(wanted):
    args = ModelArgs.from_name("llama3.2-1b")
    plan = choose_plan(args, H100, Plan(16384), wanted, sequences=4, batch_is_fixed=False)
    assert {k: getattr(plan, k) for k in wanted} == wanted
    assert fits(estimate_memory(args, plan), H100)


def test_a_plan_that_cannot_fit_is_one_error_saying_what_would():
    args = ModelArgs.from_name("llama3.1-8b")
    with pytest.raises(ValueError) as error:
        choose_plan(args, H100, Plan(1048576), {}, sequences=1, batch_is_fixed=True)
    message = str(error.value)
    assert "no plan fits 1048576-token sequences on 1 x 78.7 GiB GPU" in message
    assert "activations" in message  # the largest term, by name and size
    # Data parallelism does not divide a sequence's activations: only a shorter one helps.
    assert "It would fit with: --seq-len 131072" in message
    # The 70B's parameters and AdamW's state are divided by more GPUs, or a 4-bit base
    # leaves them a few GiB.
    fits_with = "It would fit with: --lora-rank 16 --quantize-base nf4; or 32 GPUs"
    with pytest.raises(ValueError, match=fits_with):
        choose_plan(ModelArgs.from_name("llama3.1-70b"), H100, Plan(8192), {}, 1, True)
    # A flag the user set that rules every plan out is named.
    with pytest.raises(ValueError, match="instead of --ac none"):
        choose_plan(args, H100, Plan(131072), dict(ac="none"), sequences=1, batch_is_fixed=True)


def test_the_cpu_plan_chooses_only_the_micro_batch():
    args = ModelArgs.from_name("tiny")
    cpu = Machine(world_size=1, nproc_per_node=1, gpu_gib=None, host_gib=16.0)
    base = Plan(256, param_dtype="fp32", kernels=False)
    plan = choose_plan(args, cpu, base, {}, sequences=16, batch_is_fixed=False)
    assert (plan.ac, plan.mlp_tile, plan.micro_batch, plan.grad_accum) == ("none", 0, 16, 1)
    assert not (plan.activation_offload or plan.cpu_offload or plan.optimizer_in_backward)
    # A host too small for the model's fp32 state is refused before anything is loaded.
    small = dataclasses.replace(cpu, host_gib=8.0)
    with pytest.raises(ValueError, match="no plan fits"):
        choose_plan(ModelArgs.from_name("llama3.2-1b"), small, base, {}, 16, False)


def test_the_estimate_counts_what_document_masked_attention_keeps():
    """With --ac attention, the document-masked attention's kept output comes with q, k and v,
    and the outputs of long documents' causal prefixes (up to a row's): measured 61.05 GiB for
    llama3.2-1b at 131072 tokens on rows with a tail of long documents, 56.43 on rows without
    (bench/RESULTS.md, issue #23), against 44.00 dense; the estimate's tensors at most 5%
    above the first."""
    args = ModelArgs.from_name("llama3.2-1b")
    plan = Plan(131072, ac="attention", document_mask=True)
    assert 61.05 <= estimate_memory(args, plan).gpu_tensors <= 61.05 * 1.05
    # Data whose documents all stay under model.LONG_DOCUMENT has no heads: 55.27 GiB
    # measured on such rows before the heads existed (issue #10).
    short = dataclasses.replace(plan, long_documents=False)
    assert estimate_memory(args, short).gpu_tensors == pytest.approx(55.27, rel=0.03)
    full = dataclasses.replace(plan, ac="full")  # recomputes attention: keeps nothing more
    dense = dataclasses.replace(full, document_mask=False)
    assert estimate_memory(args, full) == estimate_memory(args, dense)


def test_fp8_adds_its_e4m3_copies_to_the_block_backward_as_measured():
    """llama3.2-1b at 131072, --ac selective --activation-offload on one H200: the measured
    peak rose by 1.5 GiB with --fp8 (120.8 to 122.3; bench/RESULTS.md, "FP8 matmuls")."""
    args = ModelArgs.from_name("llama3.2-1b")
    plan = Plan(131072, ac="selective", activation_offload=True)
    bf16, fp8 = (estimate_memory(args, dataclasses.replace(plan, fp8=f)) for f in (False, True))
    assert abs(fp8.gpu_total - bf16.gpu_total - 1.5) < 0.1


def options(**changes) -> SimpleNamespace:
    """Options' fields that the planner reads, at their defaults (shard imports
    nothing of train.py; test_train.py goes through train.main)."""
    defaults = dict(seq_len=256, batch_tokens=None, strategy="FULL_SHARD", ac_every=1,
                    param_dtype=None, kernels=None, offload_blocks=None, context_parallel=1,
                    grad_clip=None, lora_rank=0, lora_alpha=16.0, fp8=False)  # fmt: skip
    return SimpleNamespace(**{**defaults, **dict.fromkeys(PLANNED), **changes})


def test_the_options_are_refused_by_the_rules_the_planner_follows():
    """One statement of each rule: the options break it (technique_problems), and the
    planner never picks a plan that breaks it (the optimizer in backward with another
    strategy than FULL_SHARD, which it once did)."""
    tiny = ModelArgs.from_name("tiny")
    problems = technique_problems(options(context_parallel=3), tiny, 3, 3)
    assert "--context-parallel 3 must divide --seq-len 256" in problems[0]
    assert "must divide the 6 query heads" in problems[1] and len(problems) == 2
    asked = options(optimizer_in_backward=True, strategy="NO_SHARD", grad_clip=1.0,
                    lora_rank=8, cpu_offload=True, grad_accum=2)  # fmt: skip
    refused = technique_problems(asked, tiny, 2, 2)
    for what in ["--strategy NO_SHARD", "--grad-clip 1.0", "--grad-accum 2", "not --lora-rank"]:
        assert any(what in problem for problem in refused), what
    # More than one process only on FSDP's host shards (optim.ShardedOptimizerInBackward).
    assert not any("2 processes" in problem for problem in refused)
    alone = options(optimizer_in_backward=True, grad_clip=0.0, cpu_offload=False)
    assert technique_problems(alone, tiny, 1, 1) == []
    assert "2 processes without --cpu-offload" in technique_problems(alone, tiny, 2, 2)[0]
    args = ModelArgs.from_name("llama3.1-8b")
    machine = Machine(world_size=1, nproc_per_node=1, gpu_gib=80.0, host_gib=128.0)
    assert choose_plan(args, machine, Plan(131072), {}, 1, True).optimizer_in_backward
    with pytest.raises(ValueError, match="no plan fits"):
        choose_plan(args, machine, Plan(131072, strategy="NO_SHARD"), {}, 1, True)


def test_fp8_asks_for_the_multiples_of_16_of_cublas_e4m3_matmul():
    """Else the first backward would stop in cuBLAS: the tiny preset's ffn_dim 200, and a
    rank's tokens and MLP tiles (the weight gradient sums over them)."""
    problems = plan_problems(ModelArgs.from_name("tiny"), Plan(1000, fp8=True, mlp_tile=24))
    assert problems == [
        "--fp8 needs multiples of 16: ffn_dim 200, --seq-len / --context-parallel 1000, "
        "--mlp-tile 24"
    ]
    llama = ModelArgs.from_name("llama3.2-1b")
    assert plan_problems(llama, Plan(131072, fp8=True, mlp_tile=4096)) == []
    assert plan_problems(llama, Plan(1000, fp8=False)) == []


@pytest.mark.parametrize(
    ("preset", "micro_batch", "in_e4m3"),
    [("llama3.2-1b", 1, ()), ("llama3.2-1b", 8, PROJECTIONS), ("llama3.1-8b", 1, PROJECTIONS)],
)
def test_fp8_keeps_blocks_too_small_to_gain_in_bf16(preset, micro_batch, in_e4m3):
    """At 8,192 tokens a matmul (one sequence a GPU) --fp8 leaves llama3.2-1b's projections in
    bf16, where e4m3 made its step slower even with only the MLP's in e4m3, and multiplies
    llama3.1-8b's in e4m3, and the 1B's at 65,536 (bench/RESULTS.md, "--fp8 keeps small blocks
    in bf16"). The plan says which."""
    args = ModelArgs.from_name(preset)
    machine = Machine(world_size=4, nproc_per_node=4, gpu_gib=139.0, host_gib=500.0)
    fixed = options(seq_len=8192, fp8=True, micro_batch=micro_batch, grad_accum=1, mlp_tile=0)
    plan = plan_of(fixed, args, machine, document_mask=False)
    assert plan.fp8_projections == in_e4m3
    said = f"{', '.join(in_e4m3)} in e4m3" if in_e4m3 else "every projection stays in bf16"
    assert plan.format().splitlines()[-1].startswith(f"--fp8: {said}")


def test_a_plan_that_cannot_fit_names_every_route_that_would():
    """70B at 131072 tokens on 8 x 80 GiB with an 800 GiB host: neither context parallelism
    nor LoRA alone fits, both together do; with 1000 GiB context parallelism alone does
    (the optimizer in backward on FSDP's host shards: 12 bytes a parameter there). On the
    CPU the message speaks of the host only."""
    args = ModelArgs.from_name("llama3.1-70b")
    node = Machine(world_size=8, nproc_per_node=8, gpu_gib=80.0, host_gib=800.0)
    with pytest.raises(ValueError, match="It would fit with: --context-parallel 2 --lora-rank 16"):
        choose_plan(args, node, Plan(131072), {}, 1, True)
    larger = dataclasses.replace(node, host_gib=1000.0)
    with pytest.raises(ValueError, match="It would fit with: --context-parallel 4;"):
        choose_plan(args, larger, Plan(131072), {}, 1, True)
    cpu = Machine(world_size=1, nproc_per_node=1, gpu_gib=None, host_gib=2.0)
    with pytest.raises(ValueError) as error:
        choose_plan(ModelArgs.from_name("tiny"), cpu, Plan(256, kernels=False), {}, 1, True)
    assert "Neither LoRA or QLoRA nor a shorter sequence would make it fit in this host's" in (
        str(error.value))  # fmt: skip
    assert "GPU" not in str(error.value)


def test_the_plan_is_one_object_printed_and_saved_as_it_is():
    """A CPU plan at 131072 tokens of the tiny preset: planned at once, printed without GPU
    rows, in millions of parameters, with a step of minutes said so; plan.json's keys."""
    cpu = Machine(world_size=1, nproc_per_node=1, gpu_gib=None, host_gib=20.0)
    tiny = ModelArgs.from_name("tiny")
    start = time.perf_counter()
    plan = plan_of(options(seq_len=131072), tiny, cpu, document_mask=False)
    assert time.perf_counter() - start < 2
    assert plan.tokens_per_step == 131072 and plan.estimate == estimate_memory(tiny, plan)
    text = plan.format()
    assert "GPU" not in text and "(0.4M params" in text and "1 process:" in text
    assert "a step takes about" in text and "min (a rough guess" in text
    saved = json.loads(json.dumps(plan.to_json()))
    keys = ["flags", "planned", "tokens_per_step", "tokens_per_step_asked", "plan", "machine",
            "estimate", "gpu_needed_gib", "host_needed_gib_per_node", "margins",
            "host_per_process_gib"]  # fmt: skip
    assert list(saved) == keys
    assert saved["plan"]["seq_len"] == 131072 and "estimate" not in saved["plan"]
    assert saved["planned"] == list(PLANNED) and saved["tokens_per_step_asked"] == 4096
    pair = Machine(world_size=2, nproc_per_node=2, gpu_gib=80.0, host_gib=100.0)
    shared = plan_of(options(context_parallel=2), tiny, pair, document_mask=False)
    assert "x 1 group of 2 context-parallel ranks" in shared.format()


def test_the_planner_is_quick_at_a_million_tokens():
    """llama3.1-8b at 1,048,576 tokens on one GPU: nothing fits, and every route is tried."""
    args = ModelArgs.from_name("llama3.1-8b")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="It would fit with: --seq-len 131072"):
        choose_plan(args, H100, Plan(1048576), {}, 1, True)
    assert time.perf_counter() - start < 5


def test_the_saved_activations_follow_qs_width_and_the_qk_norms():
    """What one block saves for backward (counted through autograd's hooks, reference ops,
    fp32) against block_bytes' saved tensors, for a head dim apart from dim / heads and for Qwen3's
    q/k norms: the measured share of the estimate stays the Llama block's within 5% (q and
    attention's output are n_heads * head_dim wide, not dim; each q/k norm keeps its input
    and rstd)."""
    from model import REFERENCE_OPS, rope_frequencies

    llama = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=320,
                      ffn_dim=512, max_seq_len=256)  # fmt: skip
    variants = [dataclasses.replace(llama, head_dim=96),
                dataclasses.replace(llama, qk_norm=True, family="qwen3"),
                dataclasses.replace(llama, head_dim=96, qk_norm=True, family="qwen3")]  # fmt: skip
    bsz, seq = 2, 128

    def measured_share(args: ModelArgs) -> float:
        block = Llama(args, REFERENCE_OPS).layers[0].float()
        x = torch.randn(bsz, seq, args.dim, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            block(x, torch.arange(seq).expand(bsz, seq), rope_frequencies(args))
        plan = Plan(seq, micro_batch=bsz, param_dtype="fp32", kernels=False)
        return sum(saved) / block_bytes(args, plan, 4)[0]

    for args in variants:
        assert measured_share(args) == pytest.approx(measured_share(llama), rel=0.05), args


RUN_PLAN = json.dumps(dict.fromkeys(["flags", "planned", "plan", "machine", "estimate"]))
# What --run-dir holds -> whether a run may write there: only where a run made it, or where
# nothing of the user's would be written over (issue #47).
RUN_DIRS = {
    "a temporary name of the user's under checkpoints": ({"checkpoints/.tmp-mine/data": ""}, False),
    "the user's lock and notes": ({".lock": "mine", "notes.txt": ""}, False),
    "the user's metrics, plan and notes": (
        {"metrics.jsonl": "", "plan.json": "{}", "notes.txt": ""},
        False,
    ),
    "hidden files of the user's": ({".git/HEAD": "", ".env": ""}, False),
    "the lock of a run stopped before its plan": ({".lock": "pid 12 on node3\n"}, True),
    "a run's plan beside the user's notes": ({"plan.json": RUN_PLAN, "notes.txt": ""}, True),
    "a checkpoint beside the user's notes": (
        {"checkpoints/step-000010/train_state.json": "{}", "notes.txt": ""},
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(RUN_DIRS))
def test_a_run_writes_only_into_a_directory_a_run_made(case, tmp_path):
    files, accepted = RUN_DIRS[case]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if accepted:
        shard.check_run_dir(tmp_path)
    else:
        with pytest.raises(UsageError, match="and no plan.json or checkpoint of a run"):
            shard.check_run_dir(tmp_path)


# The optimizer and loader of a one-tensor run, for a Checkpointer.
ONE_TENSOR = SimpleNamespace(state_dict=lambda: {"model": {"w": torch.ones(3)}})
NO_DATA = SimpleNamespace(state_dict=dict)


def test_a_save_removes_only_its_own_temporary_directories(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".tmp-mine").mkdir(parents=True)
    (checkpoints / ".tmp-mine" / "data").write_text("the user's")
    (checkpoints / ".tmp-notes.txt").write_text("the user's")
    (checkpoints / ".tmp-step-000005").mkdir()  # a killed run's
    checkpointer = shard.Checkpointer(checkpoints, 10, 2, init_distributed(), record={})
    checkpointer.save(10, ONE_TENSOR, NO_DATA)
    held = sorted(p.name for p in checkpoints.iterdir())
    assert held == [".tmp-mine", ".tmp-notes.txt", "step-000010"]
    assert (checkpoints / ".tmp-mine" / "data").read_text() == "the user's"


@pytest.mark.parametrize("name", [".lock", "plan.json", ".tmp-plan.json", "metrics.jsonl"])
def test_a_run_never_writes_through_a_link_in_its_directory(name, tmp_path):
    """Anyone who may write into a shared run directory could point a run's file at another
    user's: refused before anything is written, and never followed when opened."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text(RUN_PLAN)
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).symlink_to(victim)
    with pytest.raises(UsageError, match=f"holds {re.escape(name)} as symbolic links"):
        shard.check_run_dir(run_dir)
    if name == ".lock":
        with pytest.raises(OSError, match="Too many levels of symbolic links"):
            shard.lock_run_dir(run_dir, init_distributed().is_main)
    assert victim.read_text() == "the user's"


def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", full)
    checkpointer = shard.Checkpointer(tmp_path, 10, 2, init_distributed(), record={})
    with pytest.raises(UsageError, match=f"no space left to write checkpoint {tmp_path}/step-0"):
        checkpointer.save(10, ONE_TENSOR, NO_DATA)
    assert list(tmp_path.iterdir()) == []


RUN = {"model": {}, "seq_len": 8, "tokens_per_step": 16, "max_steps": 1, "world_size": 1,
       "tokenizer": "bytes", "strategy": "FULL_SHARD", "lora": None}  # fmt: skip
LOADER = SimpleNamespace(state_dict=lambda: {"epoch": 0, "cursor": 0, "seed": 0, "num_samples": 4})
# A hand edit of a checkpoint's train_state.json -> a piece of the one line refusing it.
TRAIN_STATE_EDITS = {
    "the step a string": (lambda s: s | {"step": "6"}, 'step is "6", expected a count'),
    "rng of the wrong length": (
        lambda s: s | {"rng": {"cpu": s["rng"]["cpu"][:-1]}},
        f"..., expected a list of {len(torch.get_rng_state())} bytes",
    ),
    "an empty loader": (lambda s: s | {"loader": {}}, "loader.epoch is none, expected a count"),
    "tensors a list": (lambda s: s | {"tensors": []}, "tensors is [], expected an object of"),
    "no run.model": (
        lambda s: s | {"run": {k: v for k, v in s["run"].items() if k != "model"}},
        "run.model is none, expected an object",
    ),
    "no tokens per step": (
        lambda s: s | {"run": s["run"] | {"tokens_per_step": 0}},
        "run.tokens_per_step is 0, expected a count above 0",
    ),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    record = {"run": RUN, "options": {}}
    return shard.Checkpointer(checkpoints, 1, 1, init_distributed(), record).save(
        1, ONE_TENSOR, LOADER
    )


@pytest.mark.parametrize("case", sorted(TRAIN_STATE_EDITS))
def test_a_hand_edited_train_state_is_one_line_naming_the_field(case, checkpoint, tmp_path):
    shard.check_checkpoint(checkpoint)
    edited = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, edited)
    edit, expected = TRAIN_STATE_EDITS[case]
    saved = json.loads((edited / "train_state.json").read_text())
    (edited / "train_state.json").write_text(json.dumps(edit(saved)))
    with pytest.raises(UsageError, match=f"^{re.escape(str(edited))}/train_state.json: ") as e:
        shard.check_checkpoint(edited)
    assert expected in str(e.value)

"""FSDP2 sharding on 2 CPU ranks (gloo) against one unsharded process, sharded init and HF
loading, and the checkpoints' and run directory's checks (the plan: test_plan.py).

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
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import dist_worker as w
import pytest
import torch
import torch.distributed.checkpoint.filesystem

import kernels.fp8
import shard
from files import UsageError
from hf import load_hf_checkpoint, save_hf_checkpoint
from lora import apply_lora
from model import Llama, ModelArgs
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
    untied = random_model(w.ODD, 6)  # its head the embedding but for the last row
    with torch.no_grad():
        untied.output.weight.copy_(untied.tok_embeddings.weight)
        untied.output.weight[-1] += 1
    save_hf_checkpoint(w.ODD, untied.named_parameters(), out / "hf_untied_head", torch.float32)
    config = json.loads((out / "hf_untied_head" / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "hf_untied_head" / "config.json").write_text(json.dumps(config))
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
    are. The first two take a projection group's tensors together, as the kernels do."""
    rows, columns = kernels.fp8.quantize_rows_reference, kernels.fp8.quantize_columns_reference
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

    return (
        lambda tensors: [rows(t) for t in tensors],
        lambda tensors: [by_rank(t) for t in tensors],
        lambda x: by_rank(x) + rows(x),
    )


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
    model = Llama(scenario.args, scenario.ops(), document_mask=scenario.document_mask)
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


def test_a_tied_checkpoint_with_another_head_in_one_ranks_rows_fails_on_every_rank(dist_out):
    messages = [(dist_out / f"hf_untied_head.rank{r}.txt").read_text() for r in range(2)]
    assert messages[0] == messages[1]
    assert "lm_head.weight differs from model.embed_tokens.weight" in messages[0]


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
    checkpointer.save(10, 160, ONE_TENSOR, NO_DATA)
    held = sorted(p.name for p in checkpoints.iterdir())
    assert held == [".tmp-mine", ".tmp-notes.txt", "step-000010"]
    assert (checkpoints / ".tmp-mine" / "data").read_text() == "the user's"


@pytest.mark.parametrize("name", shard.RUN_FILES)
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
        checkpointer.save(10, 160, ONE_TENSOR, NO_DATA)
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
    "tokens trained negative": (lambda s: s | {"tokens": -1}, "tokens is -1, expected a count"),
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
        1, 16, ONE_TENSOR, LOADER
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

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
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import dist_worker as w
import pytest
import torch

from model import Llama, LoRAConfig, ModelArgs, apply_lora, load_hf_checkpoint, save_hf_checkpoint
from shard import STRATEGIES, Plan, block_params, estimate_memory, pinned_shard_bytes

FP32_RTOL = 1e-5
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


def reference_run(scenario: w.Scenario) -> dict:
    """The same steps as dist_worker.train in one process, no FSDP: each step's whole
    global batch (whole rows), micro-batch by micro-batch, the sums divided by the global
    target count."""
    model = Llama(scenario.args, mask_documents=scenario.document_mask)
    if scenario.lora is not None:
        apply_lora(model, scenario.lora, torch.float32)
    model.init_weights(w.SEED)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=w.LR, weight_decay=w.WEIGHT_DECAY, fused=True)
    tokens, labels, positions = w.batches(scenario.args, 2, scenario.document_mask)
    losses, norms = [], []
    for step in range(w.STEPS):
        n_targets = (labels[step] != -100).sum()
        step_loss = 0.0
        for mb in range(w.MICRO_BATCHES):
            loss = model(tokens[step, mb], labels[step, mb], positions[step, mb], "sum")
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
    return {"losses": losses, "norms": norms, "grads": grads, "weights": weights, "frozen": frozen}


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
    quantized and kept its rows of, bit for bit."""
    got = torch.load(dist_out / f"{scenario}.pt")
    want = reference_run(w.TRAIN_SCENARIOS[scenario])
    assert min(want["norms"]) > w.MAX_NORM  # so clipping is exercised
    torch.testing.assert_close(got["losses"], want["losses"], rtol=FP32_RTOL, atol=0)
    torch.testing.assert_close(got["norms"], want["norms"], rtol=FP32_RTOL, atol=0)
    assert_tensors_close(got["grads"], want["grads"], rtol=FP32_RTOL)
    assert_tensors_close(got["weights"], want["weights"], atol=ADAMW_ATOL)
    assert got["frozen"].keys() == want["frozen"].keys()
    for name, frozen in want["frozen"].items():
        assert torch.equal(got["frozen"][name], frozen), name


def test_context_parallel_model_needs_the_positions_of_its_slice(dist_out):
    for rank in range(2):
        message = (dist_out / f"cp_without_positions.rank{rank}.txt").read_text()
        assert "needs the positions of its slice of each row" in message


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


@pytest.mark.parametrize("preset", ["tiny", "llama3.2-1b", "llama3-8b"])
def test_estimate_counts_the_models_parameters(preset):
    args = ModelArgs.from_name(preset)
    with torch.device("meta"):
        model = Llama(args)
    est = estimate(args)
    assert est.num_params == sum(p.numel() for p in model.parameters())
    assert block_params(args) == sum(p.numel() for p in model.layers[0].parameters())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
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
    assert est(seq_len=32768).phase == est(seq_len=65536).phase == "block backward"
    assert est(seq_len=65536).activations == pytest.approx(2 * est(seq_len=32768).activations,
                                                           rel=0.05)  # fmt: skip
    with pytest.raises(ValueError, match="expected one of"):
        est(ac="some")
    with pytest.raises(ValueError, match="expected one of"):
        est(strategy="ZERO3")


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

"""The GPU path: CUDA picked automatically, nccl, the split held in GPU memory, bf16 autocast.

Runs where CUDA is present (marker `gpu`); CI has no GPU, so there it is skipped. One
process per GPU, so on a one-GPU machine the process group has a single rank.
"""

from __future__ import annotations

import pytest
import torch

from trainyard.checkpoint.snapshot import cpu_snapshot, snapshot_ready
from trainyard.checkpoint.writer import NullCheckpointWriter
from trainyard.config import TrainyardConfig
from trainyard.data.split import prepare_splits
from trainyard.data.tables import write_digits
from trainyard.data.tensors import load_split
from trainyard.dist import cleanup_distributed, init_distributed
from trainyard.engine.standalone import train_standalone as train
from trainyard.engine.tracking import NullTracker
from trainyard.engine.training import evaluate_split
from trainyard.objectives import Classification, TargetStats
from trainyard.util.daemons import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def gpu_group(monkeypatch):
    """What torchrun gives one worker per GPU, here for a single rank."""
    port = free_port("127.0.0.1")
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    ctx = init_distributed("auto", timeout_s=120)
    yield ctx
    cleanup_distributed()


@pytest.fixture
def digits(tmp_path):
    config = TrainyardConfig()
    write_digits(tmp_path / "digits.csv")
    schema = prepare_splits(config.data, config.split, tmp_path / "digits.csv", tmp_path / "p")
    return {name: load_split(tmp_path / "p", name, schema) for name in ("train", "val", "test")}


def test_auto_device_is_the_gpu_with_nccl(gpu_group):
    assert gpu_group.device.type == "cuda" and gpu_group.backend == "nccl"


def test_fp32_and_bf16_train_digits_on_the_gpu_into_the_same_band(gpu_group, digits):
    results = {}
    for precision in ("fp32", "bf16"):
        config = TrainyardConfig.model_validate(
            {"train": {"workers": 1, "epochs": 10, "precision": precision}}
        )
        outcome = train(
            gpu_group, config, digits["train"], digits["val"], Classification(TargetStats(10)),
            NullTracker(0), NullCheckpointWriter(), {},
        )  # fmt: skip
        weights = next(outcome.model.parameters())
        assert weights.device.type == "cuda" and weights.dtype == torch.float32  # master weights
        test = evaluate_split(outcome.model, digits["test"], gpu_group)
        results[precision] = (test["accuracy"], [row["train_loss"] for row in outcome.history])
    (acc32, loss32), (acc16, loss16) = results["fp32"], results["bf16"]
    assert acc32 >= 0.9 and acc16 >= 0.9, results
    assert abs(acc32 - acc16) <= 0.03, results
    assert loss16 != loss32  # autocast really ran in bf16 ...
    assert loss16[-1] == pytest.approx(loss32[-1], rel=0.5, abs=0.02)  # ... to the same end


def test_a_gpu_snapshot_is_queued_into_pinned_memory_and_holds_the_state_as_it_was(gpu_group):
    """The training thread only queues the copies; changes made after the snapshot, queued
    behind them on the stream, never reach it, and the next snapshot reuses its memory."""
    weights = torch.randn(4096, 1024, device=gpu_group.device)
    before = weights.cpu()
    snapshot = cpu_snapshot({"model": {"w": weights}, "step": 3})
    ready = snapshot_ready()
    weights.mul_(0).add_(1)  # the optimizer's next step, queued behind the copy
    assert ready is not None
    ready.synchronize()
    copied = snapshot["model"]["w"]
    assert copied.device.type == "cpu" and copied.is_pinned() and snapshot["step"] == 3
    assert torch.equal(copied, before)
    again = cpu_snapshot({"model": {"w": weights}, "step": 4}, reuse=snapshot)
    snapshot_ready().synchronize()
    assert again["model"]["w"].data_ptr() == copied.data_ptr()
    assert torch.equal(again["model"]["w"], torch.ones_like(before))


# Inductor's advice to turn on TF32 for fp32 matmuls: trainyard keeps fp32 exact unless asked.
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")
def test_a_compiled_model_trains_digits_on_the_gpu_as_the_eager_one_does(gpu_group, digits):
    """train.compile: the model goes through torch.compile (inductor, triton kernels) after
    DDP wraps it; it must learn what the eager model learns, in bf16 too."""
    results = {}
    for compiled in (False, True):
        config = TrainyardConfig.model_validate(
            {"train": {"workers": 1, "epochs": 10, "precision": "bf16", "compile": compiled}}
        )
        outcome = train(
            gpu_group, config, digits["train"], digits["val"], Classification(TargetStats(10)),
            NullTracker(0), NullCheckpointWriter(), {},
        )  # fmt: skip
        assert type(outcome.model).__name__ != "OptimizedModule"  # saved as the plain model
        test = evaluate_split(outcome.model, digits["test"], gpu_group)
        results[compiled] = (test["accuracy"], outcome.history[-1]["train_loss"])
    (eager_acc, eager_loss), (compiled_acc, compiled_loss) = results[False], results[True]
    assert compiled_acc >= 0.9 and abs(compiled_acc - eager_acc) <= 0.03, results
    assert compiled_loss == pytest.approx(eager_loss, rel=0.5, abs=0.02), results

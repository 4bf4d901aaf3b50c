"""Model parallelism through `trainyard run`'s job: the transformer split across two
workers by tensor (train.parallel.tensor) or cut into two pipeline stages
(train.parallel.pipeline) trains the very loss curve of one worker on the same global batch
(the gradient norm clipped at 1, over the whole model's gradients wherever they live),
alone, composed with data parallelism (ddp or fsdp between replicas), or both at once (a
pipeline's stages split by tensor, or sharded by FSDP); its checkpoint, saved
in parts, loads whole into one process, and a worker killed mid-epoch resumes to the very
same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainyard.checkpoint.loading import load_model
from trainyard.datasets.tokens import build_stdlib_corpus
from trainyard.project import ProjectPaths
from trainyard.runs.record import RunRecord

from conftest import make_project
from training_jobs import (
    committed_mid_epoch,
    kill_worker,
    module_store,
    save_split_run,
    train,
    train_to_end,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GPT: dict[str, dict[str, Any]] = {
    "task": {"name": "language_model"},
    "data": {"path": "data/raw/corpus.txt", "context": 32},
    "model": {"name": "transformer", "options": {"layers": 2, "heads": 4, "width": 32}},
    "train": {
        "epochs": 1, "lr": 0.003, "optimizer": "adamw", "batch_size": 32, "grad_clip_norm": 1.0,
        "timeout_s": 300, "hang_timeout_s": 60,
    },
    "checkpoint": {"every_n_epochs": 1, "max_overhead": None},
    "tracking": {"backend": "none", "log_every_n_steps": 1},
}  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "tensor-parallel")
    root = make_project(tmp_path_factory.mktemp("tp") / "project", store.settings)
    build_stdlib_corpus(root / "data/raw/corpus.txt", 60_000)
    return root, store


@pytest.fixture(scope="module")
def one_worker(env) -> dict:
    """The reference: one worker, the same global batch of 32."""
    root, store = env
    return train_to_end(ProjectPaths(root), store, save_run(env, "one-worker", workers=1))


def save_run(env, run_id: str, checkpoint: dict | None = None, **train: Any) -> RunRecord:
    root, store = env
    sections = {k: dict(v) for k, v in GPT.items()}
    sections["train"].update(train)
    sections["checkpoint"].update(checkpoint or {})
    return save_split_run(root, store, run_id, sections)


@pytest.fixture(scope="module")
def two_way(env) -> dict:
    """One replica split across two workers."""
    root, store = env
    record = save_run(env, "two-way", workers=2, parallel={"tensor": 2})
    return train_to_end(ProjectPaths(root), store, record)


def whole_weights(env, training: dict) -> dict[str, torch.Tensor]:
    """The final checkpoint's weights as one process loads them (a split one read whole)."""
    root, store = env
    return load_model(store, training["final_checkpoint"], root / "scratch").model.state_dict()


def test_two_way_tensor_parallel_trains_one_workers_curve_and_loads_whole(env, one_worker, two_way):
    _, store = env
    one, split = one_worker, two_way
    assert split["steps"] == one["steps"] > 10
    for theirs, ours in zip(one["history"], split["history"], strict=True):
        for key in ("train_loss", "val_loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    manifest = store.read_json(f"{store.key_of(split['final_checkpoint'])}/manifest.json")
    assert manifest["layout"] == split["layout"] == {"data": 1, "pipeline": 1, "tensor": 2}
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])  # each worker's part
    whole, reference = whole_weights(env, split), whole_weights(env, one)
    assert whole.keys() == reference.keys()
    for name, tensor in reference.items():
        # AdamW divides by the root of the squared gradients: a near-zero gradient summed in
        # another order moves its weight by up to lr x 1e-2.
        torch.testing.assert_close(whole[name], tensor, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_tensor_parallel_composed_with_data_parallel_trains_one_workers_curve(
    env, one_worker, strategy
):
    """Four workers: two replicas (ddp or fsdp between them) of a model split in two, each
    replica reading 16 rows of every global batch of 32."""
    root, store = env
    one, paths = one_worker, ProjectPaths(root)
    settings = {"workers": 4, "batch_size": 16, "strategy": strategy, "parallel": {"tensor": 2}}
    four = train_to_end(paths, store, save_run(env, f"tp-dp-{strategy}", **settings))
    assert four["steps"] == one["steps"]
    # val_loss: the whole split's (train_loss is rank 0's share of the epoch).
    for theirs, ours in zip(one["history"], four["history"], strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
    assert four["evaluation"]["metrics"] == pytest.approx(one["evaluation"]["metrics"], rel=1e-5)


@pytest.fixture(scope="module")
def two_stages(env) -> dict:
    """One replica cut into two pipeline stages, each batch run as four micro-batches."""
    root, store = env
    record = save_run(env, "two-stages", workers=2, parallel={"pipeline": 2})
    return train_to_end(ProjectPaths(root), store, record)


def test_two_pipeline_stages_train_one_workers_curve_and_load_whole(env, one_worker, two_stages):
    """1F1B over four micro-batches, the gradient norm clipped across the stages: the same
    losses (the last stage's, shown by every worker) and the same weights, under the whole
    model's names, read whole from the stages' parts."""
    _, store = env
    one, split = one_worker, two_stages
    assert split["steps"] == one["steps"] > 10
    for theirs, ours in zip(one["history"], split["history"], strict=True):
        for key in ("train_loss", "val_loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert split["evaluation"]["metrics"] == pytest.approx(one["evaluation"]["metrics"], rel=1e-5)
    manifest = store.read_json(f"{store.key_of(split['final_checkpoint'])}/manifest.json")
    assert manifest["layout"] == split["layout"] == {"data": 1, "pipeline": 2, "tensor": 1}
    whole, reference = whole_weights(env, split), whole_weights(env, one)
    assert whole.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(whole[name], tensor, rtol=1e-4, atol=1e-4, msg=name)


def test_interleaved_pipelines_composed_with_data_parallel_train_one_workers_curve(env, one_worker):
    """Four workers: two replicas of a pipeline whose two workers hold two stages each
    (interleaved 1F1B), each replica reading 16 rows of every global batch of 32; the
    replicas' gradients are summed stage by stage."""
    root, store = env
    settings = {
        "workers": 4, "batch_size": 16, "parallel": {"pipeline": 2},
        "pipeline_schedule": "interleaved_1f1b",
    }  # fmt: skip
    four = train_to_end(ProjectPaths(root), store, save_run(env, "pp-dp", **settings))
    assert four["steps"] == one_worker["steps"]
    assert four["layout"] == {"data": 2, "pipeline": 2, "tensor": 1}
    for theirs, ours in zip(one_worker["history"], four["history"], strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
    metrics = four["evaluation"]["metrics"]
    assert metrics == pytest.approx(one_worker["evaluation"]["metrics"], rel=1e-5)


@pytest.mark.parametrize(
    ("settings", "layout"),
    [
        ({"parallel": {"pipeline": 2, "tensor": 2}}, {"data": 1, "pipeline": 2, "tensor": 2}),
        (
            {"parallel": {"pipeline": 2}, "strategy": "fsdp", "batch_size": 16},
            {"data": 2, "pipeline": 2, "tensor": 1},
        ),
    ],
    ids=["pipeline-x-tensor", "pipeline-x-fsdp"],
)
def test_pipeline_stages_split_by_tensor_or_sharded_by_fsdp_train_one_workers_curve(
    env, one_worker, settings, layout
):
    """Four workers: one replica cut into two stages, each stage's layers split across two
    workers (a 3-D mesh: data 1, pipeline 2, tensor 2); or two replicas of a two-stage
    pipeline, each stage sharded across its two replicas by FSDP. The same validation
    losses and scores, and weights that load whole into one process."""
    root, store = env
    run_id = "-".join(f"{part}{degree}" for part, degree in layout.items())
    four = train_to_end(ProjectPaths(root), store, save_run(env, run_id, workers=4, **settings))
    assert four["steps"] == one_worker["steps"] > 10
    assert four["layout"] == layout
    for theirs, ours in zip(one_worker["history"], four["history"], strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
    metrics = four["evaluation"]["metrics"]
    assert metrics == pytest.approx(one_worker["evaluation"]["metrics"], rel=1e-5)
    whole, reference = whole_weights(env, four), whole_weights(env, one_worker)
    assert whole.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(whole[name], tensor, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("layout", "reference"), [("tensor", "two_way"), ("pipeline", "two_stages")]
)
def test_a_killed_worker_of_a_split_model_resumes_to_the_same_weights(
    env, layout, reference, request
):
    root, store = env
    record = save_run(
        env, f"{layout}-killed", checkpoint={"every_n_steps": 7}, workers=2, parallel={layout: 2}
    )
    job, thread = train(ProjectPaths(root), store, record, max_restarts=1)
    wait_for(lambda: committed_mid_epoch(store, record.run_id, 7), what="a mid-epoch checkpoint")
    kill_worker(record.run_id, rank=1)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    resumed = store.read_json(f"runs/{record.run_id}/training.json")
    assert resumed["restarts"] == 1 and resumed["resumes"][0]["from_step"] >= 7
    uninterrupted = request.getfixturevalue(reference)
    assert resumed["steps"] == uninterrupted["steps"]
    ours, theirs = whole_weights(env, resumed), whole_weights(env, uninterrupted)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name

"""Exact resume holds for images and text, not only tables: a worker killed mid-epoch is
restarted by torchrun, resumes from the last committed checkpoint, and ends with the very
weights of an uninterrupted run. The transformer also trains and resumes sharded (fsdp), and
gradient accumulation gives the update of the whole global batch at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainyard.checkpoint.loading import load_model
from trainyard.datasets.images import write_digits_images
from trainyard.datasets.tokens import build_stdlib_corpus
from trainyard.project import ProjectPaths
from trainyard.runs.record import RunRecord

from conftest import make_project
from training_jobs import (
    committed_mid_epoch,
    final_model_state,
    kill_worker,
    learning,
    module_store,
    save_split_run,
    train,
    train_to_end,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON: dict[str, dict[str, Any]] = {
    "train": {"workers": 2, "timeout_s": 300, "hang_timeout_s": 60, "optimizer": "adamw"},
    "checkpoint": {"every_n_epochs": 1, "every_n_steps": 7, "max_overhead": None},
    "tracking": {"backend": "none"},
}
WORKLOADS: dict[str, dict[str, dict[str, Any]]] = {
    "cnn": {
        "data": {"path": "data/raw/digits.npz"},
        "model": {"name": "cnn", "options": {"channels": [8, 16]}},
        "train": {"epochs": 3, "lr": 0.003},
    },
    "gpt": {
        "task": {"name": "language_model"},
        "data": {"path": "data/raw/corpus.txt", "context": 32},
        "model": {"name": "transformer", "options": {"layers": 2, "heads": 2, "width": 32}},
        "train": {"epochs": 2, "lr": 0.003},
    },
}


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "workload-resume")
    root = make_project(tmp_path_factory.mktemp("workloads") / "project", store.settings)
    write_digits_images(root / "data/raw/digits.npz")
    build_stdlib_corpus(root / "data/raw/corpus.txt", 150_000)
    return root, store


def save_run(env, run_id: str, workload: str, **train_settings) -> RunRecord:
    root, store = env
    sections = {k: dict(v) for k, v in COMMON.items()}
    for name, values in WORKLOADS[workload].items():
        sections.setdefault(name, {}).update(values)
    sections["train"].update(train_settings)
    return save_split_run(root, store, run_id, sections)


def same_weights(env, ours: dict, theirs: dict) -> None:
    """Final weights loaded as evaluation loads them (sharded ones resharded whole)."""
    root, store = env
    mine, reference = (
        load_model(store, training["final_checkpoint"], root / "scratch").model.state_dict()
        for training in (ours, theirs)
    )
    assert mine.keys() == reference.keys()
    for name in reference:
        assert torch.equal(mine[name], reference[name]), name


def killed_and_resumed(env, run_id: str, workload: str, min_step: int, **train_settings):
    """Train with one restart allowed, SIGKILL rank 1 after a mid-epoch checkpoint."""
    root, store = env
    record = save_run(env, run_id, workload, **train_settings)
    job, thread = train(ProjectPaths(root), store, record, max_restarts=1)
    wait_for(lambda: committed_mid_epoch(store, run_id, min_step), what="a mid-epoch checkpoint")
    kill_worker(run_id, rank=1)
    thread.join(timeout=600)
    assert job.error is None, "\n".join(job.lines[-80:])
    training = store.read_json(f"runs/{run_id}/training.json")
    assert training["restarts"] == 1 and training["resumes"][0]["from_step"] >= min_step
    return training


@pytest.mark.parametrize("workload", ["cnn", "gpt"])
def test_kill_and_resume_gives_the_uninterrupted_weights(env, workload):
    root, store = env
    reference = train_to_end(ProjectPaths(root), store, save_run(env, f"{workload}-ref", workload))
    resumed = killed_and_resumed(env, f"{workload}-killed", workload, min_step=14)
    assert resumed["steps"] == reference["steps"]
    same_weights(env, resumed, reference)
    assert learning(resumed["history"]) == learning(reference["history"])


def test_fsdp_trains_and_resumes_the_transformer_exactly(env):
    root, store = env
    reference = train_to_end(
        ProjectPaths(root), store, save_run(env, "gpt-fsdp-ref", "gpt", strategy="fsdp")
    )
    resumed = killed_and_resumed(env, "gpt-fsdp-killed", "gpt", min_step=14, strategy="fsdp")
    manifest = store.read_json(f"{store.key_of(resumed['final_checkpoint'])}/manifest.json")
    assert manifest["strategy"] == "fsdp" and manifest["model"]["data"]["kind"] == "tokens"
    same_weights(env, resumed, reference)
    first, last = reference["history"][0], reference["history"][-1]
    assert last["val_loss"] < first["val_loss"] < 4.0  # it learns, sharded


def test_gradient_accumulation_is_the_global_batchs_update(env):
    """Two micro-batches of 16 per worker update exactly as one batch of 32 does (same
    rows per step, same mean gradient): the same weights, up to float summation order."""
    root, store = env
    paths = ProjectPaths(root)
    whole = train_to_end(paths, store, save_run(env, "acc-1", "cnn", epochs=1, batch_size=32))
    accumulated = train_to_end(
        paths,
        store,
        save_run(env, "acc-2", "cnn", epochs=1, batch_size=16, grad_accum_steps=2),
    )
    assert accumulated["steps"] == whole["steps"]
    ours, theirs = final_model_state(store, accumulated), final_model_state(store, whole)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5)

"""A transformer too big for one worker's memory budget: its parameters, gradients and AdamW
state (16 bytes a parameter) do not fit beside what a worker needs anyway, so data
parallelism (each worker holding all of it) fails, while two pipeline stages, a 2-way
tensor split and FSDP (each worker holding half) train, by changing only settings. The budget is the
operating system's (RLIMIT_DATA on each worker, tests/worker_budget), set below what the
data-parallel worker was measured to need; each layout's per-worker peak in the run's
record shows the half it saved."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from trainyard.data.split import SplitSchema
from trainyard.datasets.tokens import build_stdlib_corpus
from trainyard.models.registry import build_model
from trainyard.project import ProjectPaths

from conftest import make_project
from training_jobs import module_store, save_split_run, train, train_to_end

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BUDGET_DIR = Path(__file__).parents[1] / "worker_budget"
BUDGET_ENV = "TRAINYARD_TEST_WORKER_MB"
BIG: dict[str, dict[str, Any]] = {
    "task": {"name": "language_model"},
    "data": {"path": "data/raw/corpus.txt", "context": 16},
    "model": {"name": "transformer", "options": {"layers": 12, "heads": 8, "width": 512}},
    "train": {
        "epochs": 1, "lr": 0.001, "optimizer": "adamw", "batch_size": 4, "workers": 2,
        "timeout_s": 300, "hang_timeout_s": 120,
    },
    "tracking": {"backend": "none"},
}  # fmt: skip
# The same global batch of 8 as data parallelism's two workers (a split model's one replica
# reads all of it).
LAYOUTS = {
    "pipeline": {"parallel": {"pipeline": 2}, "batch_size": 8, "microbatches": 2},
    "tensor": {"parallel": {"tensor": 2}, "batch_size": 8},
    "fsdp": {"strategy": "fsdp"},
}


@pytest.fixture(scope="module")
def env(tmp_path_factory, s3_server):
    store = module_store(s3_server, "too-big")
    root = make_project(tmp_path_factory.mktemp("big") / "project", store.settings)
    build_stdlib_corpus(root / "data/raw/corpus.txt", 1_200)
    return root, store


def run(env, run_id: str, **train: Any):
    root, store = env
    sections = {k: dict(v) for k, v in BIG.items()} | {"train": BIG["train"] | train}
    return ProjectPaths(root), store, save_split_run(root, store, run_id, sections)


def test_a_model_too_big_for_one_worker_trains_cut_in_two(env, monkeypatch):
    paths, store, record = run(env, "ddp-unbounded")
    ddp = train_to_end(paths, store, record)
    ddp_peak = max(ddp["peak_rss_mb_per_rank"])
    assert record.dataset is not None and record.dataset.split_key is not None
    spec = SplitSchema.read(paths.split_cache(record.dataset.split_key)).spec
    parameters = sum(p.numel() for p in build_model(record.config.model, spec).parameters())
    state_mb = 16 * parameters / 2**20  # weights, gradients, AdamW's two moments
    assert state_mb > 500, state_mb  # a large part of what a worker holds
    assert ddp["steps"] >= 3
    # Half the state below data parallelism's peak: the libraries' pages count in a peak
    # (resident memory) but not in the budget (data memory), and this leaves room for them.
    budget = int(ddp_peak - state_mb / 2)
    monkeypatch.setenv(BUDGET_ENV, str(budget))
    path = os.pathsep.join([str(BUDGET_DIR), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # the workers start with the budget

    job, thread = train(*run(env, "ddp-bounded"))
    thread.join(timeout=600)
    assert job.error is not None, "data parallelism fit the budget it was meant to exceed"
    assert "can't allocate memory" in "\n".join(job.lines), "\n".join(job.lines[-40:])

    for name, settings in LAYOUTS.items():
        cut = train_to_end(*run(env, f"{name}-bounded", **settings))
        assert cut["steps"] == ddp["steps"], name
        peaks = cut["peak_rss_mb_per_rank"]
        # Within the budget: at least half the state below data parallelism's peak.
        assert max(peaks) < budget, (name, peaks, budget, ddp_peak)

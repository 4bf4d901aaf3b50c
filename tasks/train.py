from __future__ import annotations

from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from tasks.storage import open_store
from trainyard.config import TrainyardConfig
from trainyard.jobs import evaluation_key, training_key
from trainyard.launch import run_worker
from trainyard.project import ProjectPaths


@task(name="train-distributed")
def train_task(run_id: str, config: TrainyardConfig, paths: ProjectPaths) -> dict[str, Any]:
    """torchrun with train.workers DDP processes; returns the workers' training summary."""
    logger = get_run_logger()
    store = open_store(config, paths)
    logger.info("launching torchrun: %d workers", config.train.workers)
    run_worker(
        paths.root,
        config.train,
        store.settings.worker_env(),
        ["train", "--run-id", run_id],
        logger.info,
    )
    return store.read_json(training_key(run_id))


@task(name="evaluate-model")
def evaluate_task(
    run_id: str, checkpoint: str, config: TrainyardConfig, paths: ProjectPaths
) -> dict[str, Any]:
    """Score a checkpoint on the test split, the rows spread across the workers."""
    logger = get_run_logger()
    store = open_store(config, paths)
    args = ["evaluate", "--run-id", run_id, "--checkpoint", checkpoint, "--split", "test"]
    run_worker(paths.root, config.train, store.settings.worker_env(), args, logger.info)
    return store.read_json(evaluation_key(run_id))

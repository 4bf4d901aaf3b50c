from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

from prefect import task
from prefect.logging import get_run_logger

from tasks.nodes import needs_launch, other_nodes
from tasks.storage import open_store
from trainyard.checkpoint.resume import ResumePlan, checkpoint_meta, plan_resume
from trainyard.config import TrainyardConfig
from trainyard.data.split import SplitSchema
from trainyard.project import ProjectPaths
from trainyard.runs.contracts import (
    EvaluationResult,
    TrainingResult,
    evaluation_key,
    training_key,
)
from trainyard.runs.lease import LEASE_TOKEN_ENV
from trainyard.runs.record import RunRecord
from trainyard.runtime.launch import run_worker
from trainyard.runtime.persistent import prestart_slots
from trainyard.runtime.worker_lines import WorkerLines
from trainyard.util.logs import NODE_LOG


@task(name="plan-resume")
def plan_resume_task(
    record: RunRecord, config: TrainyardConfig, paths: ProjectPaths, schema: SplitSchema
) -> ResumePlan | None:
    """The checkpoint training starts from; refuses one for other data or another model."""
    store = open_store(config, paths)
    meta = checkpoint_meta(record, schema, config.train.world_size)
    plan = plan_resume(
        store,
        record.run_id,
        meta,
        config.checkpoint.resume,
        resume_from=record.resume_from,
        warm_start=record.warm_start,
        warm_start_from=record.warm_start_from,
    )
    if plan is not None:
        get_run_logger().info(
            "%s from %s (step %d)",
            "warm start" if plan.warm_start else "resuming",
            plan.checkpoint,
            plan.step,
        )
    return plan


@task(name="train-distributed")
def train_task(
    run_id: str, config: TrainyardConfig, paths: ProjectPaths, lease_token: str | None = None
) -> TrainingResult:
    """torchrun with train.workers DDP processes; returns the workers' training summary.
    `lease_token`: the run's lease, which rank 0 checks before every checkpoint commit."""
    logger = get_run_logger()
    store = open_store(config, paths)
    logger.info(
        "training on %d workers x %s nodes (torchrun), up to %d restarts",
        config.train.workers,
        config.train.nnodes,
        config.train.max_restarts,
    )
    with ExitStack() as nodes:
        if needs_launch(config):  # node 0 starts the others as flow runs on other hosts
            config = nodes.enter_context(other_nodes(run_id, config, paths, logger))
        run_worker(
            paths.root,
            config.train,
            store.settings.worker_env(),
            ["train", "--run-id", run_id],
            # rank 0's lines, every rank's warnings and errors; all of them in the node's log
            WorkerLines(logger.log, log_file=paths.run_logs(run_id) / NODE_LOG.format(node=0)),
            max_restarts=config.train.max_restarts,
            rdzv_id=run_id,
            job_env={LEASE_TOKEN_ENV: lease_token} if lease_token else None,
        )
    return TrainingResult.model_validate(store.read_json(training_key(run_id)))


def prestart_training_workers(
    config: TrainyardConfig,
    paths: ProjectPaths,
    slot_gpus: Sequence[Sequence[int] | None] = (None,),
) -> None:
    """Start the workers `train_task` will run on now (inside a `persistent_workers` block,
    unless the command that runs the flow did), so that Python, torch and the process group
    start while the flow prepares the data: one group per entry of `slot_gpus` (a sweep's
    trial slots, each on its own GPUs; None: the settings' own)."""
    env = open_store(config, paths).settings.worker_env()
    started = prestart_slots(paths.root, config.train, env, slot_gpus)
    if started:
        get_run_logger().info(
            "started %d x %d training workers ahead of the job", started, config.train.workers
        )


@task(name="evaluate-model")
def evaluate_task(
    run_id: str, checkpoint: str, config: TrainyardConfig, paths: ProjectPaths
) -> EvaluationResult:
    """Score a checkpoint on the test split, the rows spread across the workers."""
    logger = get_run_logger()
    store = open_store(config, paths)
    args = ["evaluate", "--run-id", run_id, "--checkpoint", checkpoint, "--split", "test"]
    # Scoring is quick: node 0 does it alone, whatever nodes the training spanned.
    local = config.train.model_copy(update={"nnodes": 1, "node_rank": 0, "rdzv_endpoint": None})
    run_worker(paths.root, local, store.settings.worker_env(), args, WorkerLines(logger.log))
    return EvaluationResult.model_validate(store.read_json(evaluation_key(run_id)))

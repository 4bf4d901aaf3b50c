"""Prefect tasks of batch inference: plan the job, score it under torchrun, record it."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from tasks.storage import open_store
from trainyard.config import TrainyardConfig
from trainyard.inference.documents import (
    PredictionJob,
    PredictionManifest,
    PredictionRecord,
    job_key,
    record_key,
)
from trainyard.inference.plan import output_target, plan_prediction
from trainyard.inference.shards import export_parquet, read_output_manifest
from trainyard.project import ProjectPaths
from trainyard.runtime.launch import run_worker
from trainyard.runtime.worker_lines import WorkerLines


@task(name="plan-prediction")
def plan_prediction_task(
    config: TrainyardConfig,
    paths: ProjectPaths,
    model: str,
    input_file: str,
    prediction_id: str | None,
) -> PredictionJob:
    """Resolve the model (an alias once), check the input against its schema, convert it."""
    job = plan_prediction(
        open_store(config, paths), paths, config, model, input_file, prediction_id
    )
    get_run_logger().info(
        "prediction %s: %s (%s) on %s, %d rows",
        job.prediction_id,
        job.model.reference,
        job.model.checkpoint,
        job.input.path,
        job.input.rows,
    )
    return job


@task(name="predict-distributed")
def predict_task(
    job: PredictionJob, config: TrainyardConfig, paths: ProjectPaths
) -> PredictionManifest:
    """torchrun with inference.workers processes, each scoring a contiguous slice; a job
    whose output is committed already is not launched again."""
    logger = get_run_logger()
    store = open_store(config, paths)
    done = read_output_manifest(store, job.prediction_id)
    if done is not None:
        logger.info("prediction %s is committed already: nothing to score", job.prediction_id)
        return done.model_copy(
            update={"rows_scored": 0, "scoring_seconds": 0.0, "shards_reused": len(done.shards)}
        )
    store.write_json(job_key(job.prediction_id), job.model_dump(mode="json"))
    inference = config.inference
    local = config.train.model_copy(
        update={
            "workers": inference.workers,
            "nnodes": 1,
            "node_rank": 0,
            "rdzv_endpoint": None,
            "timeout_s": inference.timeout_s,
        }
    )
    logger.info("launching torchrun: %d workers, %d shards", inference.workers, job.num_shards)
    run_worker(
        paths.root,
        local,
        store.settings.worker_env(),
        ["predict", "--job", job_key(job.prediction_id)],
        # Every rank's lines (a prediction has no per-rank log files), one timestamp each.
        WorkerLines(logger.log, all_ranks=True),
        max_restarts=inference.max_restarts,
        rdzv_id=job.prediction_id,
    )
    manifest = read_output_manifest(store, job.prediction_id)
    if manifest is None:
        raise RuntimeError(f"prediction {job.prediction_id}: the job ended without a manifest")
    return manifest


@task(name="save-prediction-record", retries=3, retry_delay_seconds=1)
def save_prediction_record(
    record: PredictionRecord, config: TrainyardConfig, paths: ProjectPaths
) -> str:
    store = open_store(config, paths)
    return store.write_json(record_key(record.prediction_id), record.model_dump(mode="json"))


@task(name="export-predictions")
def export_task(
    manifest: PredictionManifest, output: str, config: TrainyardConfig, paths: ProjectPaths
) -> str:
    """The committed shards, verified, in input order, as one local Parquet file inside the
    project (checked again here: the folder may have changed while the job ran; a missing
    one is made now)."""
    target = output_target(paths, output, make_folder=True)
    dest = export_parquet(open_store(config, paths), manifest, target)
    get_run_logger().info("wrote %d rows to %s", manifest.rows, dest)
    return str(dest)

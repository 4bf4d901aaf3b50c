"""`batch_inference`: a model (registry alias or version, or a run) scores a table across
torchrun workers into committed Parquet shards in the store, recorded like a run."""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import ExternalSignal
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from flows.settings import flow_settings
from tasks.inference import (
    export_task,
    plan_prediction_task,
    predict_task,
    save_prediction_record,
)
from tasks.storage import check_store, open_store
from trainyard.inference.documents import PredictionManifest, PredictionRecord, manifest_key
from trainyard.inference.plan import output_target
from trainyard.runs.record import git_state, now
from trainyard.runtime.guardian import announce_flow_run


@flow(name="batch_inference")
def batch_inference(
    model: str,
    input: str,
    output: str | None = None,
    prediction_id: str | None = None,
    overrides: list[str] | None = None,
) -> PredictionRecord:
    """Score `input` (a table, an image array or folder, text, or what the model's
    data.dataset reads; inside the project) with `model`
    (NAME, NAME@ALIAS, NAME:VERSION or run:RUN_ID); with `output`, also write the rows,
    in input order, to that Parquet file inside the project. Rerun after a crash, it scores
    only the shards that were not committed. Settings: the params.yaml of the folder the
    flow runs in, with `overrides` (`section.key=value`, as `-S`)."""
    started = time.monotonic()
    paths, config = flow_settings(overrides)
    if output:  # before anything is scored: a long job must not fail at its last write
        output_target(paths, output)
    check_store(config, paths)
    announce_flow_run(PREFECT_API_URL.value(), flow_run.get_id())
    job = plan_prediction_task(config, paths, model, input, prediction_id)
    store = open_store(config, paths)
    record = PredictionRecord(
        prediction_id=job.prediction_id,
        status="running",
        created_at=now(),
        model=job.model,
        input=job.input,
        output=store.uri(manifest_key(job.prediction_id)),
        code=git_state(paths.root),
        seconds={"check": round(time.monotonic() - started, 3)},
    )
    save_prediction_record(record, config, paths)
    try:
        manifest = predict_task(job, config, paths)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt | SystemExit | ExternalSignal)
        record.status = "interrupted" if interrupted else "failed"
        record.error = None if interrupted else f"{type(exc).__name__}: {exc}"[-4000:]
        _finish(record, started)
        save_prediction_record(record, config, paths)
        raise
    _completed(record, manifest, started)
    save_prediction_record(record, config, paths)
    if output:
        export_task(manifest, output, config, paths)
    create_markdown_artifact(
        _summary(record), key=f"prediction-{job.prediction_id}".lower(), description="prediction"
    )
    return record


def _finish(record: PredictionRecord, started: float) -> None:
    record.finished_at = now()
    record.seconds["total"] = round(time.monotonic() - started, 3)


def _completed(record: PredictionRecord, manifest: PredictionManifest, started: float) -> None:
    record.status = "completed"
    record.rows = manifest.rows
    record.world_size, record.device = manifest.world_size, manifest.device
    record.shards, record.shards_reused = len(manifest.shards), manifest.shards_reused
    record.seconds["scoring"] = round(manifest.scoring_seconds, 3)
    if manifest.rows_scored and manifest.scoring_seconds > 0:
        record.rows_per_s = round(manifest.rows_scored / manifest.scoring_seconds, 1)
    _finish(record, started)


def _summary(record: PredictionRecord) -> str:
    source = record.model
    version = f"{source.name} version {source.version}" if source.name else f"run {source.run_id}"
    return "\n".join(
        [
            f"# Prediction {record.prediction_id}",
            "",
            f"- model: `{source.reference}` ({version})",
            f"- input: `{record.input.path}` (md5 {record.input.md5}, {record.input.rows} rows)",
            f"- output: `{record.output}` ({record.shards} shards, {record.shards_reused} reused)",
            f"- {record.world_size} workers, {record.rows_per_s or 0:,.0f} rows/s",
        ]
    )

"""From a model reference and an input file to a prediction job: everything checked, nothing
launched. The CLI calls this before Prefect starts (a mistake is one line, exit 2); the
flow calls it again, and finds the converted input in its cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.inference.documents import PredictionJob, job_key
from trainyard.inference.inputs import prepare_input
from trainyard.inference.reference import model_schema, resolve_model
from trainyard.project import ProjectPaths
from trainyard.runs import check_run_id
from trainyard.storage import Store


def plan_prediction(
    store: Store,
    paths: ProjectPaths,
    config: TrainyardConfig,
    model: str,
    input_file: str,
    prediction_id: str | None = None,
) -> PredictionJob:
    source = resolve_model(store, model, config.registry.model_name)
    schema = model_schema(store, source)
    table = prepare_input(paths.root / input_file, schema, paths.inputs, paths.root)
    job = PredictionJob(
        prediction_id="pending",
        model=source,
        input=table,
        shard_rows=config.inference.shard_rows,
        batch_size=config.inference.batch_size,
        device=config.train.device,
    )
    job.prediction_id = check_run_id(prediction_id) if prediction_id else default_id(job)
    _check_same_job(store, job)
    return job


def default_id(job: PredictionJob) -> str:
    """The same model, input bytes and shard size make the same id: a rerun of a command
    continues (or finds done) what an earlier one started, and never scores a row twice."""
    identity = [job.model.checkpoint, job.input.md5, job.input.columns, job.shard_rows]
    return "pred-" + hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


def _check_same_job(store: Store, job: PredictionJob) -> None:
    """A prediction id already in the store continues only the same job."""
    try:
        stored = PredictionJob.model_validate(store.read_json(job_key(job.prediction_id)))
    except FileNotFoundError:
        return
    for what, mine, theirs in (
        ("model", job.model.checkpoint, stored.model.checkpoint),
        ("input md5", job.input.md5, stored.input.md5),
        ("inference.shard_rows", job.shard_rows, stored.shard_rows),
    ):
        if mine != theirs:
            raise TrainyardError(
                f"prediction {job.prediction_id} was started with {what} {theirs}, this one has "
                f"{mine}; use another --prediction-id (or none: one is derived from the job)"
            )


def resolved_input(paths: ProjectPaths, input_file: str | Path) -> str:
    """The input as the flow is given it: relative to the project when inside it."""
    path = (Path.cwd() / input_file).resolve()
    try:
        return str(path.relative_to(paths.root))
    except ValueError:
        return str(path)

"""From a model reference and an input file to a prediction job: everything checked, nothing
launched. The CLI calls this before Prefect starts (a mistake is one line, exit 2); the
flow calls it again, and finds the converted input in its cache. The input and the output
are confined to the project here, whatever started the flow."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.inference.documents import PredictionJob, job_key
from trainyard.inference.inputs import prepare_input
from trainyard.inference.reference import model_schema, resolve_model
from trainyard.project import ProjectPaths
from trainyard.runs.confined import inside_project, make_folder_in_project, writable_in_project
from trainyard.runs.record import check_run_id
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
    path = inside_project(paths, input_file, "input")
    table = prepare_input(path, schema, paths.inputs, paths.root)
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
    """The input as the flow is given it: relative to the project, which must hold it."""
    path = inside_project(paths, Path.cwd() / input_file, "--input")
    return str(path.relative_to(paths.root.resolve()))


def output_target(
    paths: ProjectPaths, output: str | Path, what: str = "output", make_folder: bool = False
) -> Path:
    """Where the rows of a prediction are written: a .parquet file inside the project (not
    in its state folders), in a folder that exists or can be made there. Checked before
    anything runs, since a long job must not fail at its last write, and again just before
    that write, which asks for the missing folders (`make_folder`): a refused or failed job
    leaves none behind."""
    target = writable_in_project(paths, output, what)
    if target.suffix.lower() != ".parquet":
        raise TrainyardError(f"{what} {output}: name a .parquet file")
    if target.is_dir():
        raise TrainyardError(f"{what} {output}: is a folder; name a .parquet file in it")
    existing = next(folder for folder in target.parents if folder.exists())
    if not existing.is_dir():
        raise TrainyardError(f"{what} {output}: {existing} is a file, not a folder")
    if existing != target.parent and not os.access(existing, os.W_OK | os.X_OK):
        raise TrainyardError(f"{what} {output}: no permission to create a folder in {existing}")
    if make_folder and existing != target.parent:
        make_folder_in_project(paths, target.parent, f"{what} {output}")
    return target

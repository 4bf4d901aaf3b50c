"""What a torchrun worker does for each command, built from the run record in the store.

Results go back to the flow through the store (`runs/<id>/training.json`,
`runs/<id>/evaluation.json`), which works the same when workers span machines.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from trainyard.checkpoint import CheckpointWriter, NullCheckpointWriter, load_checkpoint
from trainyard.config import ModelConfig, config_from_dict
from trainyard.data.split import SplitSchema
from trainyard.data.tensors import load_split
from trainyard.dist import DistContext, all_gather_objects
from trainyard.models import build_model, describe
from trainyard.project import ProjectPaths
from trainyard.runs import RunRecord
from trainyard.storage import Store
from trainyard.tracking import start_tracker
from trainyard.training import evaluate_split, train

log = logging.getLogger(__name__)


def training_key(run_id: str) -> str:
    return f"runs/{run_id}/training.json"


def evaluation_key(run_id: str) -> str:
    return f"runs/{run_id}/evaluation.json"


def train_job(ctx: DistContext, store: Store, record: RunRecord, paths: ProjectPaths) -> None:
    started = time.monotonic()
    run_id = record.run_id
    config = config_from_dict(record.params)
    processed = paths.processed
    schema = SplitSchema.read(processed)
    train_split = load_split(processed, "train", schema)
    val_split = load_split(processed, "val", schema)
    in_features, num_classes = train_split.features.shape[1], len(schema.classes)

    tracker = start_tracker(config.tracking, run_id, ctx.rank, paths.comet / run_id)
    tracker.log_params({**_flatten(record.params), "world_size": ctx.world_size, "rank": ctx.rank})
    checkpointer = (
        CheckpointWriter(store, run_id, paths.staging) if ctx.is_main else NullCheckpointWriter()
    )
    meta = {
        "run_id": run_id,
        "model": describe(config.model, in_features, num_classes),
        "schema": dataclasses.asdict(schema),
        "dataset_md5": record.dataset.dvc_md5 if record.dataset else None,
        "world_size": ctx.world_size,
        "strategy": "ddp",
    }
    try:
        outcome = train(
            ctx, config, train_split, val_split, num_classes, tracker, checkpointer, meta
        )
    finally:
        experiment = tracker.end()
    experiments = all_gather_objects(dataclasses.asdict(experiment))
    throughput = all_gather_objects(outcome.samples_per_s)
    if ctx.is_main:
        store.write_json(
            training_key(run_id),
            {
                "world_size": ctx.world_size,
                "device": str(ctx.device),
                "backend": ctx.backend,
                "steps": outcome.steps,
                "history": outcome.history,
                "checkpoints": checkpointer.committed,
                "final_checkpoint": checkpointer.committed[-1],
                "experiments": experiments,
                "samples_per_s_per_rank": throughput,
                "first_step_at": outcome.first_step_at,
                "seconds": time.monotonic() - started,
            },
        )
        log.info(
            "training finished: %d steps, final checkpoint %s",
            outcome.steps,
            checkpointer.committed[-1],
        )


def evaluate_job(
    ctx: DistContext, store: Store, run_id: str, paths: ProjectPaths, checkpoint: str, split: str
) -> None:
    state, manifest = load_checkpoint(store, checkpoint)
    spec = manifest["model"]
    schema = SplitSchema(**manifest["schema"])
    model = build_model(
        ModelConfig(name=spec["name"], options=spec["options"]),
        spec["in_features"],
        spec["num_classes"],
    )
    model.load_state_dict(state["model"])
    model.to(ctx.device)
    data = load_split(paths.processed, split, schema)
    result = evaluate_split(model, data, ctx)
    log.info(
        "%s accuracy %.4f over %d rows (%s)", split, result["accuracy"], result["rows"], checkpoint
    )
    if ctx.is_main:
        store.write_json(
            evaluation_key(run_id), {"split": split, "checkpoint": checkpoint, **result}
        )


def _flatten(params: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat

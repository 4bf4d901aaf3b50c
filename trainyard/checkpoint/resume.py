"""Resuming: what a checkpoint must match, which one to continue from, and the RNG state.

Rules (`checkpoint.resume`, `trainyard run --resume-from RUN_ID [--warm-start]`):
- a run id that already has committed checkpoints continues from its latest one (`auto`),
  or is refused (`never`), so a checkpoint is never silently overwritten;
- `--resume-from` continues another run's latest committed checkpoint: model, optimizer,
  scheduler, RNG and position, so the result is the one that run would have reached;
- `--warm-start` takes the weights only and starts a fresh schedule, on purpose; so does a
  run given a checkpoint URI to start from (`warm_start_from`: `retrain.init: champion`
  passes the champion registry version's);
- a checkpoint made for another model architecture, or for other inputs and outputs (feature
  columns, classes, target), is refused. An exact resume also needs the same dataset version
  and strategy; a warm start may read a new dataset version: that is fine-tuning, and
  retraining warm-starts its challenger that way;
- an exact resume may change the world size (train.workers, train.nnodes, or an elastic
  restart with fewer or more nodes). The global batch stays the checkpoint's: each worker
  takes global batch / world size rows an update, read in as few micro-batches as keep each
  within train.batch_size (2 workers x 16 -> 1 worker x 16 x 2 micro-batches), unless the
  run's own settings already give that global batch at the new size (1 worker x 32). The
  sample order is the epoch's one permutation and a step reads the same rows of it at any
  world size (trainyard.data.sharding), so the run goes on at the very row it stopped at.
  A global batch that does not divide by the new world size becomes the nearest that does
  (trainyard.checkpoint.world_change), and the position is the step that has read at most the rows read
  before: the rest of that step's rows are read again, and the resume says so. At the same
  world size a different global batch is still refused: that is another training setting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from trainyard.checkpoint.reader import latest_committed, read_manifest
from trainyard.config import TrainyardConfig
from trainyard.data.split import SplitSchema
from trainyard.data_spec import DataSpec
from trainyard.errors import CheckpointError
from trainyard.models.registry import architecture_differences, describe
from trainyard.runs.continuation import settings_hash
from trainyard.runs.contracts import CheckpointManifest
from trainyard.runs.record import RunRecord
from trainyard.storage import Store


class ResumeRefused(CheckpointError):
    """The checkpoint to continue from does not fit this run."""


# What a refused warm start or resume can do instead, unless the caller knows better.
FROM_SCRATCH = "train from scratch (no --resume-from) or keep the model and data settings"
# What a model's inputs and outputs mean, beyond their sizes (which `describe` compares):
# SplitSchema fields, with the defaults of schemas written before they existed.
MEANING_FIELDS: dict[str, Any] = {
    "kind": "table",
    "target": "class",
    "feature_columns": [],
    "classes": [],
    "token_level": None,
    "token_chars": None,
}
# Fields older schemas did not record: absent there means unknown, not different.
RECORDED_SINCE_SPLIT_FORMAT_4 = {"token_chars"}


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: str  # URI of a committed, verified checkpoint
    source_run: str
    warm_start: bool
    step: int


def params_hash(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_meta(record: RunRecord, schema: SplitSchema, world_size: int) -> dict[str, Any]:
    """What every checkpoint's manifest says about the run that made it (and what a resume
    compares). Built here for both the flow's check and the workers' manifests."""
    dataset_md5 = record.dataset.dvc_md5 if record.dataset else None
    return {
        "run_id": record.run_id,
        **resume_meta(record.config, schema.spec, dataset_md5, world_size),
        "schema": dataclasses.asdict(schema),
        "params_hash": params_hash(record.params),
        # what a continuation of this run compares
        "settings_hash": settings_hash(record.params),
    }


def resume_meta(
    config: TrainyardConfig,
    data: DataSpec,
    dataset_md5: str | None,
    world_size: int,
) -> dict[str, Any]:
    """The part of a manifest `check_compatible` compares."""
    return {
        "model": describe(config.model, data),
        "dataset_md5": dataset_md5,
        "world_size": world_size,
        # The run's own global batch, at train.nnodes' most nodes: one that starts or goes on
        # with fewer (elastic) keeps it (trainyard.checkpoint.world_change).
        "global_batch_size": config.global_batch_size,
        "strategy": config.train.strategy,
        "sync": config.train.sync,
        "layout": {
            "data": world_size // config.train.parallel.model_workers,
            "pipeline": config.train.parallel.pipeline,
            "tensor": config.train.parallel.tensor,
        },
    }


def check_compatible(
    manifest: CheckpointManifest,
    meta: dict[str, Any],
    *,
    full: bool,
    source: str | None = None,
    fix: str = FROM_SCRATCH,
) -> None:
    """Raise ResumeRefused, naming what differs, unless `manifest` may seed a run with `meta`.

    A warm start (`full` False) takes weights only, so another dataset version is fine as
    long as the model and what its inputs and outputs mean are the same. `source` names the
    checkpoint in messages, `fix` says what to do instead of a warm start."""
    source = source or f"checkpoint of run {manifest.run_id}"
    if full and manifest.dataset_md5 != meta.get("dataset_md5"):
        raise ResumeRefused(
            f"{source} was trained on dataset md5 {manifest.dataset_md5}, this run uses "
            f"{meta.get('dataset_md5')}: an exact resume needs the same data; to fine-tune its "
            f"weights on this data start a new run with --resume-from {manifest.run_id} "
            "--warm-start, or restore that dataset version"
        )
    # The flow's meta holds the new split's schema; the CLI's early check has none yet.
    meaning = meaning_differences(manifest.split_schema, meta["schema"]) if "schema" in meta else []
    if meaning:
        raise ResumeRefused(
            f"{source} was trained for other inputs or outputs ({'; '.join(meaning)}); "
            f"its weights would mean other things here: {fix}"
        )
    differences = architecture_differences(manifest.model, meta.get("model") or {})
    if differences:
        raise ResumeRefused(
            f"{source} was made for another model ({'; '.join(differences)}); "
            f"its weights cannot be loaded: {fix}"
        )
    if not full:
        return
    _check_same_settings(manifest, meta)
    wanted = {k: v for k, v in (meta.get("layout") or {}).items() if k != "data"}
    if wanted and manifest.model_layout != wanted:
        raise ResumeRefused(
            f"{source} was cut into pipeline {manifest.model_layout['pipeline']} x tensor "
            f"{manifest.model_layout['tensor']}, this run {wanted.get('pipeline')} x "
            f"{wanted.get('tensor')}: an exact resume needs the same train.parallel; "
            "use --warm-start to take the weights only"
        )
    _check_own_replicas(manifest, meta, source)
    checked = [("strategy", "train.strategy")]
    if manifest.world_size == meta.get("world_size"):  # another world size adapts the batch
        checked.append(("global_batch_size", "train.batch_size x workers x grad_accum_steps"))
    for key, hint in checked:
        if getattr(manifest, key) != meta.get(key):
            raise ResumeRefused(
                f"{source} has {key} {getattr(manifest, key)}, this run "
                f"{meta.get(key)}: an exact resume needs the same {hint}; "
                "use --warm-start to take the weights only"
            )


# The sync modes whose checkpoints hold state of each worker's (local_sgd, diloco: its own
# weights and optimizer; parameter_server: its server's optimizer and counters).
PER_WORKER_SYNCS = ("local_sgd", "diloco", "parameter_server")


def _check_own_replicas(manifest: CheckpointManifest, meta: dict[str, Any], source: str) -> None:
    """Replicas that trained apart, or a parameter server's workers, saved state of each
    worker's own: they resume with as many workers under the same train.sync, no other."""
    sync, wanted = manifest.sync, meta.get("sync")
    # One of all-reducing replicas seeds any mode (its weights, alike on every worker).
    if sync in PER_WORKER_SYNCS and wanted is not None and sync != wanted:
        raise ResumeRefused(
            f"{source} was written under train.sync {sync}, this run has {wanted}: an exact "
            f"resume needs the same; set train.sync {sync}, or use --warm-start to take the "
            "weights only"
        )
    if sync in PER_WORKER_SYNCS and manifest.world_size != meta.get("world_size"):
        raise ResumeRefused(
            f"{source} holds state of each of its {manifest.world_size} workers (train.sync "
            f"{sync}), this run has {meta.get('world_size')}: resume it with "
            f"{manifest.world_size} workers (train.workers x train.nnodes), or use --warm-start "
            "to take the weights only"
        )


def meaning_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What differs between two split schemas in what a model reads and predicts (not in
    rows or statistics, which a new dataset version changes)."""
    differences = []
    for field, default in MEANING_FIELDS.items():
        there, here = saved.get(field, default), wanted.get(field, default)
        if there == here or (
            field in RECORDED_SINCE_SPLIT_FORMAT_4 and (there is None or here is None)
        ):
            continue
        if isinstance(there, list) and isinstance(here, list):
            differences.append(f"{field}: {_list_difference(there, here)}")
        else:
            differences.append(f"{field}={there!r} there, {here!r} here")
    return differences


def _list_difference(there: list, here: list, shown: int = 5) -> str:
    """'8' there only; '10' here only (a few of each), or: the same, in another order."""
    only_there = [x for x in there if x not in here]
    only_here = [x for x in here if x not in there]
    if not only_there and not only_here:
        return "the same, in another order"

    def few(items: list) -> str:
        more = f" and {len(items) - shown} more" if len(items) > shown else ""
        return ", ".join(repr(x) for x in items[:shown]) + more

    parts = [f"{few(only_there)} there only" if only_there else ""]
    parts.append(f"{few(only_here)} here only" if only_here else "")
    return "; ".join(p for p in parts if p)


def _check_same_settings(manifest: CheckpointManifest, meta: dict[str, Any]) -> None:
    """A run's own checkpoint must come from the settings the run continues with (older
    manifests carry no settings hash and are not compared)."""
    if manifest.run_id != meta.get("run_id") or manifest.settings_hash is None:
        return
    if "settings_hash" in meta and manifest.settings_hash != meta["settings_hash"]:
        raise ResumeRefused(
            f"checkpoint step {manifest.step} of run {manifest.run_id} was made with "
            "other settings than the run's record holds (settings hash "
            f"{manifest.settings_hash} there, {meta['settings_hash']} here); "
            "the record or the checkpoint was changed: start a new --run-id"
        )


def plan_resume(
    store: Store,
    run_id: str | None,
    meta: dict[str, Any],
    resume: str,
    resume_from: str | None = None,
    warm_start: bool = False,
    warm_start_from: str | None = None,
) -> ResumePlan | None:
    """Which checkpoint the training job starts from (checked now, before anything launches).
    `run_id` None: a new run, which has no checkpoints of its own. `warm_start_from`: the URI
    of a committed checkpoint (a registry version's) whose weights a new run starts from."""
    own = latest_committed(store, run_id) if run_id else None
    if own is not None:
        uri, _, manifest = own
        if resume == "never":
            raise ResumeRefused(
                f"run {run_id} already has committed checkpoints ({uri}) and "
                "checkpoint.resume is 'never'; use a new --run-id or checkpoint.resume=auto"
            )
        check_compatible(manifest, meta, full=True)
        assert run_id is not None  # only a named run has checkpoints of its own
        return ResumePlan(uri, run_id, warm_start=False, step=manifest.step)
    if warm_start_from is not None:
        return plan_warm_start(store, warm_start_from, meta)
    if resume_from is None:
        return None
    other = latest_committed(store, resume_from)
    if other is None:
        raise ResumeRefused(
            f"run {resume_from} has no committed checkpoint to resume from "
            "(see `trainyard runs show`)"
        )
    uri, _, manifest = other
    check_compatible(manifest, meta, full=not warm_start)
    return ResumePlan(uri, resume_from, warm_start=warm_start, step=manifest.step)


def plan_warm_start(
    store: Store,
    uri: str,
    meta: dict[str, Any],
    source: str | None = None,
    fix: str = FROM_SCRATCH,
) -> ResumePlan:
    """A new run's start from the weights of the committed checkpoint at `uri`, on any
    dataset version, for the same model and the same inputs and outputs. Its files are
    verified when the workers load it."""
    try:
        manifest = read_manifest(store, uri)
    except FileNotFoundError:
        raise ResumeRefused(f"{uri} holds no committed checkpoint to warm-start from") from None
    check_compatible(manifest, meta, full=False, source=source, fix=fix)
    return ResumePlan(uri, manifest.run_id, warm_start=True, step=manifest.step)


def warm_start_meta(
    config: TrainyardConfig, schema: SplitSchema, dataset_md5: str | None
) -> dict[str, Any]:
    """What a warm start onto `schema`'s data compares, before a run exists."""
    return {
        **resume_meta(config, schema.spec, dataset_md5, config.train.world_size),
        "schema": dataclasses.asdict(schema),
    }


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors and plain data (loadable with weights_only)."""
    # The legacy form, a tuple (typed as either form).
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    name, keys, pos, has_gauss, cached = legacy
    version, mt_state, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            n["name"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

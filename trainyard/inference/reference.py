"""Which model a prediction uses: `NAME`, `NAME@ALIAS`, `NAME:VERSION` (registry) or
`run:RUN_ID` (a completed run's final checkpoint), resolved once to an immutable checkpoint.
Reads documents only (no torch), so a mistake is refused before anything is launched."""

from __future__ import annotations

import re

from pydantic import ValidationError

from trainyard.checkpoint.signing import verify
from trainyard.data.split import SplitSchema
from trainyard.errors import CheckpointError, TrainyardError
from trainyard.inference.documents import ModelSource
from trainyard.registry import read_version, version_uri
from trainyard.registry.aliases import resolve
from trainyard.runs.contracts import CheckpointManifest
from trainyard.runs.record import check_run_id, load_record
from trainyard.storage import Store

DEFAULT_ALIAS = "champion"
_REGISTRY_REF = re.compile(r"(?P<name>[^@:]*)(?:@(?P<alias>[^@:]+)|:(?P<version>\d+))?")


def resolve_model(store: Store, reference: str, default_name: str) -> ModelSource:
    """The checkpoint `reference` names now (an alias is read once: a job started with
    digits@champion keeps that version even if the alias moves meanwhile)."""
    if reference.startswith("run:"):
        return _run_model(store, reference)
    parsed = _REGISTRY_REF.fullmatch(reference)
    if parsed is None:
        raise TrainyardError(
            f"--model {reference!r} is not a model reference: use NAME, NAME@ALIAS, "
            "NAME:VERSION or run:RUN_ID"
        )
    name = parsed["name"] or default_name
    alias: str | None = None
    if parsed["version"]:
        version = int(parsed["version"])
    else:
        alias = parsed["alias"] or DEFAULT_ALIAS
        version = resolve(store, name, alias)
    info = read_version(store, name, version)
    return ModelSource(
        reference=reference,
        checkpoint=version_uri(store, name, version),
        name=name,
        version=version,
        alias=alias,
        run_id=info.run_id,
        task=info.task,
    )


def _run_model(store: Store, reference: str) -> ModelSource:
    run_id = check_run_id(reference.removeprefix("run:"))
    record = load_record(store, run_id)
    if record.status != "completed" or not record.final_checkpoint:
        raise TrainyardError(
            f"run {run_id} is {record.status} and has no final checkpoint to predict with; "
            "use a completed run or a registered version (NAME@ALIAS)"
        )
    return ModelSource(
        reference=reference,
        checkpoint=record.final_checkpoint,
        run_id=run_id,
        task=record.params.get("task", {}),
    )


def model_schema(store: Store, source: ModelSource) -> SplitSchema:
    """What the model reads (feature columns, statistics, classes), from its manifest: one
    this project signed, so a planted checkpoint is refused before anything launches."""
    key = store.key_of(source.checkpoint.rstrip("/"))
    try:
        document = store.read_json(f"{key}/manifest.json")
        manifest = CheckpointManifest.model_validate(document)
    except FileNotFoundError:
        raise CheckpointError(
            f"{source.checkpoint} has no manifest.json: it was never committed"
        ) from None
    except (ValueError, ValidationError):
        raise CheckpointError(
            f"{source.checkpoint}/manifest.json is not a checkpoint manifest this trainyard reads"
        ) from None
    verify(source.checkpoint, key, document)
    return SplitSchema(**manifest.split_schema)

"""Versions: a completed run's final checkpoint copied (and verified) into the next claimed
version number, what a version records about itself, and its optional mirror in Comet."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from trainyard.checkpoint.signing import project_key, signed
from trainyard.config import TrackingConfig
from trainyard.errors import CheckpointError, TrainyardError
from trainyard.registry.documents import (
    CLAIM_FILE,
    MANIFEST_FILE,
    NAME,
    VERSION_FILE,
    VersionInfo,
    _root,
    _version_key,
    actor,
    check_name,
    now,
)
from trainyard.runs.contracts import CheckpointManifest
from trainyard.runs.record import load_record
from trainyard.storage import Store
from trainyard.util.comet import quiet_comet
from trainyard.util.documents import Skipped, read_each, read_model
from trainyard.util.hashing import file_digest

log = logging.getLogger(__name__)


def list_models(store: Store) -> list[str]:
    return [name for name in store.list_dirs("registry") if NAME.fullmatch(name)]


def version_numbers(store: Store, name: str) -> list[int]:
    """Committed versions (those with a manifest), ascending: one listing, no probes."""
    prefix = f"{_root(name)}/versions/"
    found = set()
    for key in store.list_files(prefix.rstrip("/")):
        number, _, rest = key[len(prefix) :].partition("/")
        if rest == MANIFEST_FILE and number.isdigit():
            found.add(int(number))
    return sorted(found)


def read_version(store: Store, name: str, version: int) -> VersionInfo:
    key = _version_key(name, version)
    if not store.exists(f"{key}/{MANIFEST_FILE}"):
        known = version_numbers(store, name)
        raise TrainyardError(
            f"model {name!r} has no version {version} "
            f"(versions: {', '.join(map(str, known)) or 'none'}); see `trainyard models show {name}`"
        )
    return read_model(store, f"{key}/{VERSION_FILE}", VersionInfo)


def list_versions(store: Store, name: str, skipped: Skipped | None = None) -> list[VersionInfo]:
    """Every committed version; with `skipped`, a damaged version.json is left out there
    (without, it raises `UnreadableDocument`)."""
    numbers = version_numbers(store, name)
    return read_each(numbers, lambda number: read_version(store, name, number), skipped)


def register(
    store: Store,
    run_id: str,
    name: str,
    by: str | None = None,
    tracking: TrackingConfig | None = None,
) -> VersionInfo:
    """Copy a completed run's final checkpoint into the next version of `name`.

    Every file is checked against the checkpoint's sha256 as it is copied; the copy's
    manifest is written last, so a version half-copied (a crash, a lost store) is never
    listed. Its number stays claimed: the next register takes the one after. The source's
    manifest must carry this project's signature; the copy is signed for its own key, so a
    version loads as its checkpoint does and neither can be replayed as the other."""
    check_name(name)
    record = load_record(store, run_id)
    if record.status != "completed" or not record.final_checkpoint:
        raise TrainyardError(
            f"run {run_id} is {record.status}"
            f"{'' if record.final_checkpoint else ' and has no final checkpoint'}: only a "
            "completed run's final checkpoint can be registered"
        )
    manifest = _source_manifest(store, run_id, record.final_checkpoint)
    for known in list_versions(store, name):
        if known.run_id == run_id and known.step == manifest.step:
            raise TrainyardError(
                f"run {run_id} is already version {known.version} of model {name!r}"
            )
    by = actor(by)
    signing_key = project_key()
    version = _claim_version(store, name, run_id, by)
    with tempfile.TemporaryDirectory(prefix="trainyard-register-") as scratch:
        _copy_verified(
            store, record.final_checkpoint, _version_key(name, version), manifest, Path(scratch)
        )
        info = _version_info(name, version, record, manifest, by)
        key = _version_key(name, version)
        store.write_json(f"{key}/{VERSION_FILE}", info.model_dump(mode="json"))
        document = signed(signing_key, key, manifest.model_dump(mode="json"))
        if not store.create_json(f"{key}/{MANIFEST_FILE}", document):
            raise AssertionError(f"{key} was committed by another writer despite its claim")
        if tracking is not None:
            log_to_comet(info, Path(scratch), tracking, record.tracking)
    log.info("run %s registered as version %d of %s", run_id, version, name)
    return info


def _source_manifest(store: Store, run_id: str, uri: str) -> CheckpointManifest:
    # Here, not at the top: the reader imports torch, which listing versions never needs.
    from trainyard.checkpoint.reader import read_manifest

    try:
        return read_manifest(store, uri)
    except FileNotFoundError:
        raise TrainyardError(
            f"run {run_id}'s final checkpoint {uri} is gone (deleted?); it cannot be registered"
        ) from None


def _claim_version(store: Store, name: str, run_id: str, by: str) -> int:
    """The next free version number, taken with a create-if-absent: two registers racing
    never get the same one (the loser moves on to the next number)."""
    taken = [int(d) for d in store.list_dirs(f"{_root(name)}/versions") if d.isdigit()]
    version = max(taken, default=0) + 1
    claim = {"run_id": run_id, "by": by, "at": now()}
    while not store.create_json(f"{_version_key(name, version)}/{CLAIM_FILE}", claim):
        version += 1
    return version


def _copy_verified(
    store: Store, src_uri: str, dst_key: str, manifest: CheckpointManifest, scratch: Path
) -> None:
    """Through a local file (a checkpoint may not fit in memory twice), hashed on the way."""
    src_key = store.key_of(src_uri.rstrip("/"))
    for file_name, expected in manifest.files.items():
        local = scratch / file_name
        try:
            store.get_file(f"{src_key}/{file_name}", local)
        except FileNotFoundError:
            raise CheckpointError(f"{src_uri}/{file_name} is missing; not registered") from None
        if local.stat().st_size != expected.size or file_digest(local) != expected.sha256:
            raise CheckpointError(
                f"{src_uri}/{file_name} does not match its manifest (truncated or tampered); "
                "not registered"
            )
        store.put_file(local, f"{dst_key}/{file_name}")


def _version_info(
    name: str, version: int, record: Any, manifest: CheckpointManifest, by: str
) -> VersionInfo:
    return VersionInfo(
        name=name,
        version=version,
        run_id=record.run_id,
        checkpoint=record.final_checkpoint,
        step=manifest.step,
        dataset_md5=manifest.dataset_md5
        or (record.dataset.dvc_md5 if record.dataset is not None else None),
        code=dict(record.code),
        metrics=dict(record.metrics),
        monitor=record.monitor,
        model=manifest.model,
        task=dict(record.params.get("task", {})),
        data=manifest.split_schema,
        files=dict(manifest.files),
        created_at=now(),
        registered_by=by,
    )


def log_to_comet(
    info: VersionInfo, folder: Path, tracking: TrackingConfig, experiments: list[Any]
) -> bool:
    """With COMET_API_KEY, also log the version to Comet's model registry, on the source
    run's rank-0 experiment when it was online; without a key, nothing. A Comet failure
    never fails a registration: the store holds the version either way."""
    if not os.environ.get("COMET_API_KEY"):
        return False
    key = next((e.key for e in experiments if e.rank == 0 and e.mode == "online"), None)
    quiet_comet()  # nothing reported to Comet's own Sentry
    try:
        import comet_ml

        experiment = comet_ml.start(
            project_name=tracking.project, workspace=tracking.workspace, experiment_key=key
        )
        try:
            if not experiment.alive:
                raise ConnectionError("Comet server unreachable")
            metadata = {"run_id": info.run_id, "version": info.version, "monitor": info.monitor}
            experiment.log_model(info.name, str(folder), metadata=metadata)
            experiment.register_model(
                info.name, version=f"{info.version}.0.0", metadata=metadata, sync=True
            )
        finally:  # a started experiment is ended whatever happened, unreachable server included
            experiment.end()
    except Exception as exc:  # noqa: BLE001 - optional mirror; the store is the registry
        log.warning(
            "version %d of %s not logged to Comet's model registry: %s",
            info.version,
            info.name,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return False
    return True

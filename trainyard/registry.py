"""The model registry, in the artifact store: immutable versions, aliases that point at them,
and an append-only history of every alias change.

    registry/<model>/versions/<n>/claim.json      <- n is taken (created only if absent)
    registry/<model>/versions/<n>/state.pt ...    the run's final checkpoint files, verified
    registry/<model>/versions/<n>/version.json    where it came from and how good it is
    registry/<model>/versions/<n>/manifest.json   <- commit marker, written last
    registry/<model>/history/<seq:08d>.json       one alias change each (created only if absent)
    registry/<model>/aliases.json                 a cache: what the history adds up to

A version is a copy, so deleting its run or the run's checkpoint retention never touches it.
Its manifest is the checkpoint's own, so `loading.load_model(store, version_uri(...))` loads
it exactly as it loads a run's checkpoint.

One writer without a lock: S3 conditional writes (a PUT with `If-None-Match: *` succeeds only
if the key is absent; AWS S3 since 2024, and measured on the embedded SeaweedFS 4.48: of 8
threads racing for one key, 1 wrote and 7 got 412) make "create if absent" atomic. Claiming a
version number and appending a history entry both use it: of two writers racing for the same
key exactly one wins; the other re-reads and decides again. The history is the truth;
aliases.json is rebuilt from it after each change and names the last entry it reflects, so a
reader can tell a stale cache (the next entry exists) and fold the history instead.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import logging
import os
import re
import secrets
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from trainyard.config import TrackingConfig
from trainyard.contracts import CheckpointManifest, FileEntry
from trainyard.errors import CheckpointError, TrainyardError
from trainyard.hashing import file_digest
from trainyard.runs import load_record
from trainyard.storage import Store

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # always fullmatch: "$" allows a "\n"
# checkpoint.MANIFEST_FILE, not imported from there: checkpoint imports torch, and
# `models list/show/history` should not wait seconds for it.
MANIFEST_FILE = "manifest.json"
VERSION_FILE = "version.json"
CLAIM_FILE = "claim.json"
DEFAULT_ALIAS = "champion"
APPEND_TRIES = 20  # re-decisions after losing a race; each loser re-reads, so few are needed


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VersionInfo(Document):
    """`versions/<n>/version.json`: everything needed to trust and use a version without its run."""

    schema_version: int = SCHEMA_VERSION
    name: str
    version: int
    run_id: str
    checkpoint: str  # the source checkpoint's URI (it may since have been deleted)
    step: int
    dataset_md5: str | None
    code: dict[str, Any]  # git commit and dirty flag of the code that trained it
    metrics: dict[str, float]  # the run's final metrics (test_* and val_*)
    monitor: dict[str, Any] | None  # {name, mode, value}: what promotion compares
    model: dict[str, Any]  # models.describe(): name, options, the data it was built for
    task: dict[str, Any]  # the run's task settings
    data: dict[str, Any]  # the split's schema: input schema, classes, preprocessing statistics
    files: dict[str, FileEntry]
    created_at: str
    registered_by: str


class Evidence(Document):
    """Why an alias moved: the rule that decided and the two versions' monitored values."""

    rule: str  # "manual", "rollback", or the rule an automatic promotion applied
    metric: str | None = None
    mode: str | None = None  # "max" | "min"
    from_value: float | None = None  # the version the alias left
    to_value: float | None = None  # the version it now points at
    detail: dict[str, Any] = Field(default_factory=dict)


class AliasChange(Document):
    """`history/<seq:08d>.json`: one change of one alias, never rewritten."""

    seq: int
    alias: str
    action: Literal["promote", "rollback"]
    from_version: int | None
    to_version: int
    at: str  # ISO UTC
    by: str  # a flow run (flow-run:<id>), or cli:<user>@<host>
    evidence: Evidence
    reverts: int | None = None  # a rollback: the seq of the change it undoes
    # The writer's own mark: a PUT retried after its reply was lost finds its entry (412).
    token: str


class AliasesDoc(Document):
    """`aliases.json`: alias -> version as of history entry `seq` (0: no history yet)."""

    name: str
    aliases: dict[str, int]
    seq: int
    updated_at: str


# --- names, keys, conditional writes ---------------------------------------------------


def check_name(name: str, what: str = "model name") -> str:
    if not NAME.fullmatch(name):
        raise TrainyardError(
            f"{what} {name!r} is not valid: use letters, digits, '-' and '_' (at most 64, "
            "starting with a letter or digit)"
        )
    return name


def _root(name: str) -> str:
    return f"registry/{check_name(name)}"


def _version_key(name: str, version: int) -> str:
    return f"{_root(name)}/versions/{version}"


def _history_key(name: str, seq: int) -> str:
    return f"{_root(name)}/history/{seq:08d}.json"


def version_uri(store: Store, name: str, version: int) -> str:
    """What `loading.load_model` and `checkpoint.load_checkpoint` take."""
    return store.uri(_version_key(name, version))


def create_json(store: Store, key: str, obj: Any) -> bool:
    """Write `key` only if it does not exist: True if this call created it, False if it was
    there already (someone else's, or ours from a retried request: callers check)."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    try:
        store.fs.pipe_file(store.uri(key), data, IfNoneMatch="*")
    except FileExistsError:  # s3fs's translation when AWS names the condition
        return False
    except OSError as exc:
        if _precondition_failed(exc):  # SeaweedFS: 412 without the condition's name
            return False
        raise
    return True


def _precondition_failed(exc: OSError) -> bool:
    cause = exc.__cause__
    if not isinstance(cause, ClientError):
        return False
    response = cause.response
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "PreconditionFailed" or status == 412


def now() -> str:
    # Milliseconds: two changes within a second must still order when asked "who at T".
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def actor(by: str | None = None) -> str:
    """Who makes a change: `by` if given, else the Prefect flow run we are inside, else
    user@host."""
    if by:
        return by
    flow_run = os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run:
        return f"flow-run:{flow_run}"
    return user_at_host()


def user_at_host() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


# --- versions ----------------------------------------------------------------------------


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
    return VersionInfo.model_validate(store.read_json(f"{key}/{VERSION_FILE}"))


def list_versions(store: Store, name: str) -> list[VersionInfo]:
    return [read_version(store, name, n) for n in version_numbers(store, name)]


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
    listed. Its number stays claimed: the next register takes the one after."""
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
    version = _claim_version(store, name, run_id, by)
    with tempfile.TemporaryDirectory(prefix="trainyard-register-") as scratch:
        _copy_verified(
            store, record.final_checkpoint, _version_key(name, version), manifest, Path(scratch)
        )
        info = _version_info(name, version, record, manifest, by)
        key = _version_key(name, version)
        store.write_json(f"{key}/{VERSION_FILE}", info.model_dump(mode="json"))
        if not create_json(store, f"{key}/{MANIFEST_FILE}", manifest.model_dump(mode="json")):
            raise AssertionError(f"{key} was committed by another writer despite its claim")
        if tracking is not None:
            log_to_comet(info, Path(scratch), tracking, record.tracking)
    log.info("run %s registered as version %d of %s", run_id, version, name)
    return info


def _source_manifest(store: Store, run_id: str, uri: str) -> CheckpointManifest:
    from trainyard.checkpoint import read_manifest

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
    while not create_json(store, f"{_version_key(name, version)}/{CLAIM_FILE}", claim):
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
    try:
        import comet_ml

        experiment = comet_ml.start(
            project_name=tracking.project, workspace=tracking.workspace, experiment_key=key
        )
        if not experiment.alive:
            raise ConnectionError("Comet server unreachable")
        metadata = {"run_id": info.run_id, "version": info.version, "monitor": info.monitor}
        experiment.log_model(info.name, str(folder), metadata=metadata)
        experiment.register_model(
            info.name, version=f"{info.version}.0.0", metadata=metadata, sync=True
        )
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


# --- aliases and their history -----------------------------------------------------------


def read_history(store: Store, name: str) -> list[AliasChange]:
    """Every alias change of `name`, in order: the truth that aliases.json caches."""
    prefix = f"{_root(name)}/history"
    keys = sorted(k for k in store.list_files(prefix) if k.endswith(".json"))
    entries = [AliasChange.model_validate(store.read_json(k)) for k in keys]
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1)), "history has a gap"
    return entries


def alias_stacks(entries: list[AliasChange]) -> dict[str, list[int]]:
    """alias -> the versions it was promoted through, still standing (the last is current):
    a promotion pushes, a rollback pops, so rollbacks walk back one promotion at a time."""
    stacks: dict[str, list[int]] = {}
    for entry in entries:
        stack = stacks.setdefault(entry.alias, [])
        if entry.action == "promote":
            stack.append(entry.to_version)
        else:
            stack.pop()
    return stacks


def aliases_of(entries: list[AliasChange]) -> dict[str, int]:
    return {alias: stack[-1] for alias, stack in alias_stacks(entries).items() if stack}


def alias_at(entries: list[AliasChange], alias: str, when: str) -> AliasChange | None:
    """The change that put `alias` where it was at ISO time `when` (None: not set yet)."""
    moment = parse_time(when)
    current = None
    for entry in entries:
        if entry.alias == alias and parse_time(entry.at) <= moment:
            current = entry
    return current


def parse_time(text: str) -> dt.datetime:
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise TrainyardError(
            f"{text!r} is not an ISO time; use e.g. 2026-11-23T10:00:00Z"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)  # naive means UTC


def promote(
    store: Store,
    name: str,
    version: int,
    alias: str = DEFAULT_ALIAS,
    by: str | None = None,
    evidence: Evidence | None = None,
) -> AliasChange:
    """Point `alias` at `version`. Without `evidence` the change is manual: the rule is
    "manual" and the two versions' monitored values are recorded beside it."""
    check_name(alias, "alias")
    target = read_version(store, name, version)

    def plan(entries: list[AliasChange]) -> dict[str, Any]:
        current = aliases_of(entries).get(alias)
        if current == version:
            raise TrainyardError(f"{name}:{alias} already points at version {version}")
        return {
            "action": "promote",
            "from_version": current,
            "to_version": version,
            "evidence": evidence or _evidence(store, name, "manual", current, target),
        }

    return _append(store, name, alias, plan, actor(by))


def rollback(
    store: Store, name: str, alias: str = DEFAULT_ALIAS, by: str | None = None
) -> AliasChange:
    """Point `alias` back at the version it pointed to before its latest promotion."""
    check_name(alias, "alias")

    def plan(entries: list[AliasChange]) -> dict[str, Any]:
        stack = alias_stacks(entries).get(alias, [])
        if len(stack) < 2:
            where = f"version {stack[-1]}" if stack else "no version"
            raise TrainyardError(
                f"{name}:{alias} points at {where} and has no earlier version to roll back to; "
                f"see `trainyard models history {name}`"
            )
        undone = next(
            e
            for e in reversed(entries)
            if e.alias == alias and e.action == "promote" and e.to_version == stack[-1]
        )
        target = read_version(store, name, stack[-2])
        return {
            "action": "rollback",
            "from_version": stack[-1],
            "to_version": stack[-2],
            "evidence": _evidence(store, name, "rollback", stack[-1], target),
            "reverts": undone.seq,
        }

    return _append(store, name, alias, plan, actor(by))


def _evidence(
    store: Store, name: str, rule: str, current: int | None, target: VersionInfo
) -> Evidence:
    monitor = target.monitor or {}
    before = read_version(store, name, current).monitor if current is not None else None
    return Evidence(
        rule=rule,
        metric=monitor.get("name"),
        mode=monitor.get("mode"),
        from_value=(before or {}).get("value"),
        to_value=monitor.get("value"),
    )


def _append(
    store: Store,
    name: str,
    alias: str,
    plan: Callable[[list[AliasChange]], dict[str, Any]],
    by: str,
) -> AliasChange:
    """Append one history entry, deciding (`plan`) on the history as it is at that moment.

    The entry's key is the next seq, created only if absent: of two writers racing, one
    creates it, the other sees the winner's entry when it re-reads and decides again (its
    `from_version` is then the winner's `to_version`)."""
    token = secrets.token_hex(8)
    for _ in range(APPEND_TRIES):
        entries = read_history(store, name)
        seq = len(entries) + 1
        entry = AliasChange(seq=seq, alias=alias, at=now(), by=by, token=token, **plan(entries))
        key = _history_key(name, seq)
        if create_json(store, key, entry.model_dump(mode="json")):
            refresh_aliases(store, name)
            return entry
        theirs = AliasChange.model_validate(store.read_json(key))
        if theirs.token == token:  # ours: the first reply was lost and the retry got 412
            refresh_aliases(store, name)
            return theirs
        log.info(
            "%s: history entry %d was written by %s first; deciding again", name, seq, theirs.by
        )
    raise TrainyardError(
        f"{name}:{alias} is changing too often to record this change ({APPEND_TRIES} tries); "
        "try again"
    )


def refresh_aliases(store: Store, name: str) -> AliasesDoc:
    """Rebuild aliases.json from the history, then re-read it: a slower writer may have
    put an older cache over ours, in which case it is written again."""
    key = f"{_root(name)}/aliases.json"
    for _ in range(5):
        entries = read_history(store, name)
        doc = AliasesDoc(name=name, aliases=aliases_of(entries), seq=len(entries), updated_at=now())
        store.write_json(key, doc.model_dump(mode="json"))
        back = AliasesDoc.model_validate(store.read_json(key))
        if back.seq >= doc.seq:
            return back
    return doc


def read_aliases(store: Store, name: str) -> dict[str, int]:
    """alias -> version: from aliases.json in one read when it is current (no history
    entry after the one it reflects), else folded from the history."""
    try:
        doc = AliasesDoc.model_validate(store.read_json(f"{_root(name)}/aliases.json"))
    except FileNotFoundError:
        doc = None
    if doc is not None and not store.exists(_history_key(name, doc.seq + 1)):
        return doc.aliases
    return aliases_of(read_history(store, name))


def resolve(store: Store, name: str, alias_or_version: str) -> int:
    """A version number from "3" or an alias such as "champion"."""
    if alias_or_version.isdigit():
        return read_version(store, name, int(alias_or_version)).version
    aliases = read_aliases(store, name)
    if alias_or_version not in aliases:
        raise TrainyardError(
            f"model {name!r} has no alias {alias_or_version!r} "
            f"(aliases: {', '.join(sorted(aliases)) or 'none'})"
        )
    return aliases[alias_or_version]

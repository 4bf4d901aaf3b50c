"""Checkpoints in the store: one folder per step, files first, manifest last.

    runs/<run_id>/checkpoints/step-<global_step:08d>/state.pt
    runs/<run_id>/checkpoints/step-<global_step:08d>/manifest.json   <- commit marker

Taking a checkpoint costs the training thread one copy of the state into CPU memory;
serializing, hashing and uploading it happen on the uploader thread.
A folder without a manifest, whose manifest is not signed with the project's key
(trainyard.checkpoint.signing), or whose files do not match it, is never loaded. Loading
uses `torch.load(weights_only=True)`, so a checkpoint can never run code. Resuming picks the
highest step that is committed and verifies (`latest_committed`), skipping broken ones.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import logging
import pickle
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.serialization as serialization
from botocore.exceptions import BotoCoreError
from pydantic import ValidationError

from trainyard.checkpoint.signing import project_key, signed, verify
from trainyard.config import CheckpointConfig
from trainyard.errors import CheckpointError, first_line
from trainyard.runs.contracts import CheckpointManifest, FileEntry
from trainyard.runs.lease import check_owner
from trainyard.storage import Store
from trainyard.storage.sender import FileSender
from trainyard.util.hashing import HashingWriter, file_digest

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
DISK_FULL = "disk full"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:08d}"


def step_of(uri: str) -> int | None:
    """The global step a checkpoint URI is for (None if it names no checkpoint folder)."""
    match = _STEP_DIR.match(uri.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def checkpoint_steps(store: Store, run_id: str) -> list[int]:
    """Steps with a checkpoint folder (committed or not), ascending."""
    names = store.list_dirs(f"runs/{run_id}/checkpoints")
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names) if m)


def committed_checkpoints(store: Store, run_id: str) -> list[str]:
    """URIs of the run's checkpoints that have a manifest, ascending (not verified: for
    records and listings; loading verifies)."""
    return [
        store.uri(checkpoint_key(run_id, step))
        for step in checkpoint_steps(store, run_id)
        if store.exists(f"{checkpoint_key(run_id, step)}/{MANIFEST_FILE}")
    ]


def strip_wrapper_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """DDP adds `module.`, torch.compile `_orig_mod.`; a bare model wants neither."""
    clean = {}
    for key, value in state_dict.items():
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, stripped = key[len(prefix) :], True
        clean[key] = value
    return clean


def save_without_gil(state: dict[str, Any], path: Path) -> FileEntry:
    """torch.save into an open file; returns the file's size and sha256. Given a path, torch
    writes the tensors' bytes from C++ while holding the GIL, which stalls the training
    thread for the whole write (measured: steps 2.1x slower while 100 MB is saved); through
    a Python file object the writes release it. Without the zip records' CRC-32 it takes
    half the time (81 ms against 165 per 100 MB): the manifest's sha256, verified at every
    load, already covers the file. The setting is the process's: a torch.save elsewhere
    meanwhile also skips the CRC, which torch.load does not need."""
    with open(path, "wb") as file, serialization.config.patch({"save.compute_crc32": False}):
        hashing = HashingWriter(file)
        torch.save(state, hashing)
    return FileEntry(size=hashing.size, sha256=hashing.digest.hexdigest())


def cpu_snapshot(value: Any, reuse: Any = None) -> Any:
    """A copy of a state the training loop may go on changing: every tensor copied into CPU
    memory, containers rebuilt. The only cost of a checkpoint on the training thread.

    `reuse`: an earlier snapshot of the same state that nothing reads any more. Its tensors
    are copied into where shape and dtype match: 15 ms per 100 MB instead of 77 ms for
    fresh memory, whose pages the kernel faults in as the copy first touches them.

    CUDA tensors are copied into pinned memory without waiting: the copies are queued on the
    stream before any later change to the state, and `snapshot_ready` marks when they land."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if _fits(reuse, value):
            return reuse.copy_(value, non_blocking=value.is_cuda and reuse.is_pinned())
        if value.is_cuda and value.layout == torch.strided:
            pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            return pinned.copy_(value, non_blocking=True)
        return value.to("cpu", copy=True)
    if isinstance(value, dict):
        spare = reuse if isinstance(reuse, dict) else {}
        return {key: cpu_snapshot(item, spare.get(key)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        same = isinstance(reuse, list | tuple) and len(reuse) == len(value)
        spares = reuse if same else [None] * len(value)
        return type(value)(
            cpu_snapshot(item, spare) for item, spare in zip(value, spares, strict=True)
        )
    return value  # numbers, strings, None: immutable


def snapshot_ready() -> torch.cuda.Event | None:
    """An event recorded after the snapshot's queued CUDA copies; None where there are none
    (CUDA unused in this process). Whoever reads the snapshot synchronizes on it first."""
    if not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _fits(buffer: Any, tensor: torch.Tensor) -> bool:
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.device.type == "cpu"
        and buffer.layout == tensor.layout == torch.strided
        and buffer.dtype == tensor.dtype
        and buffer.shape == tensor.shape
        and buffer.is_contiguous()
    )


@dataclass
class _Staged:
    step: int
    folder: Path
    manifest: CheckpointManifest  # its STATE_FILE entry is added once the state is written
    upload: list[str]  # files this writer uploads (other ranks upload their own shards)
    state: dict[str, Any] | None  # the snapshot until it is written to `folder`
    ready: torch.cuda.Event | None = None  # its CUDA copies have landed once this completes
    dropped: bool = False  # replaced by a newer one while uploads lagged (max_staged)
    taken_at: float = field(default_factory=time.monotonic)


class UploadQueue:
    """One background thread that works through staged items (each with a `step`) oldest
    first, retrying transient store errors with backoff for as long as the store is down.
    Subclasses set their own state, then call `super().__init__`, and say what processing
    an item means (`_process`, returning None when stopped) and what follows it."""

    def __init__(self, config: CheckpointConfig, thread_name: str):
        self.config = config
        self._pending: list[Any] = []  # oldest first; [0] may be in progress
        self._failure: str | None = None
        self._closing = False
        self._stop = threading.Event()  # the end: stop retrying
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _process(self, item: Any) -> Any:
        raise NotImplementedError

    def _describe(self, item: Any) -> str:
        return f"upload of step {item.step}"

    def _record(self, item: Any, result: Any) -> None:
        """Under the lock, once `item` is done and off the queue."""

    def _after(self, item: Any, result: Any) -> None:
        """Outside the lock, once `item` is done."""

    def _before_first(self) -> None:
        pass

    def _run(self) -> None:
        self._before_first()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return
                item = self._pending[0]
            what = self._describe(item)
            try:
                result = retry_transient(
                    what, functools.partial(self._process, item), self.config, self._stop
                )
                if result is None:  # stopped while the store was still unreachable
                    return
                with self._cond:
                    self._pending.pop(0)
                    self._record(item, result)
                    self._cond.notify_all()
                self._after(item, result)
            except Exception as exc:  # not transient: the run must fail, clearly, not hang
                full = str(exc).startswith(DISK_FULL)  # says all: nothing was uploaded
                if full:
                    log.error("%s", exc)
                else:
                    log.error("%s failed", what, exc_info=True)
                with self._cond:
                    self._failure = self._failure or (str(exc) if full else f"{what} failed: {exc}")
                    self._cond.notify_all()
                return

    def _drain(self, timeout_s: float) -> tuple[bool, list[int], str | None]:
        """Wait for the backlog, then stop: (all done, steps left, the failure if any)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._pending or self._failure, timeout_s)
            left = [item.step for item in self._pending]
        self._stop.set()
        self._thread.join(timeout=30)
        with self._cond:  # after the join: what followed the last commit may have failed
            return done, left, self._failure


class CheckpointWriter(UploadQueue):
    """Owned by rank 0: snapshots each checkpoint into CPU memory and hands it to one
    uploader thread, which writes it to local staging (atomically) and uploads it, so
    training waits neither for serialization nor for the store.

    The uploader commits checkpoints oldest first, retrying transient errors with
    exponential backoff and jitter for as long as the store is unreachable; then it applies
    retention (keep the last `keep_last`, the best by `keep_best_by`, any pinned) and
    deletes the rest, manifest first, so a half-deleted checkpoint is never "committed".
    While uploads lag, at most `max_staged` checkpoints wait (in memory or staged): the oldest (next to
    commit) always stays, a new one replaces the newest waiting one. `close()` waits for
    the backlog and fails clearly, keeping the local copies, if it cannot be uploaded.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        staging: Path,
        config: CheckpointConfig | None = None,
        lease_token: str | None = None,
        best_by: tuple[str, str] | None = ("val_accuracy", "max"),
    ):
        self.store = store
        self.run_id = run_id
        self.best_by = best_by  # (validation metric, "max" | "min"): the task's, from the job
        self.lease_token = lease_token  # commits only while this run's lease holds it
        self.staging = staging / run_id
        self._committed: dict[int, dict[str, float]] = {}  # step -> its validation metrics
        self._files: dict[int, list[str]] = {}  # step -> its files, for deleting without a listing
        self._write_lock = threading.Lock()  # one writer of staging folders at a time
        self._unwritten: list[_Staged] = []  # snapshots the staging thread has yet to write
        self._discarded: list[_Staged] = []  # dropped ones whose folders it removes
        self._spare: dict[str, Any] | None = None  # a written snapshot's memory, for the next
        self._sender = FileSender(store)  # large files upload from a child process
        self._key = project_key(create=True)  # read now: a bad key file fails the run at once
        # Seconds from the last committed checkpoint's snapshot to the end of its retention:
        # what one checkpoint costs the store and the uploader's CPU. Unknown until the
        # second: the first's also holds one-time work beside the run's start (122-127 ms
        # against 21-28 ms for the next ones of a digits run), which would space the
        # checkpoints after it 5x too far apart.
        self.last_absorb_s: float | None = None
        self._first_absorbed = False
        super().__init__(config or CheckpointConfig(), "checkpoint-uploader")
        # Snapshots go to disk as soon as they are taken, not when the uploader reaches
        # them: while uploads lag, memory holds at most the one being written.
        self._stager = threading.Thread(target=self._stage_loop, name="checkpoint-staging")
        self._stager.daemon = True
        self._stager.start()

    @property
    def committed(self) -> list[str]:
        """URIs of the retained committed checkpoints, ascending by step."""
        with self._cond:
            steps = sorted(self._committed)
        return [self.store.uri(checkpoint_key(self.run_id, step)) for step in steps]

    def folder(self, step: int) -> Path:
        return self.staging / f"step-{step:08d}"

    def staged_steps(self) -> list[int]:
        """Checkpoints staged and not yet committed (the ones other ranks' shards are for)."""
        with self._cond:
            return [p.step for p in self._pending]

    def keeps_up(self, since_last_s: float, max_overhead: float) -> bool:
        """Whether one more checkpoint now stays within `max_overhead` of the time: nothing
        still waits for the store, and the last one's absorb time is at most that share of
        the time since it was taken (true until the second is committed: the first's cost
        is not the steady one)."""
        with self._cond:
            if self._pending:
                return False
        cost = self.last_absorb_s
        return cost is None or cost <= max_overhead * since_last_s

    def save(
        self,
        step: int,
        state: dict[str, Any],
        meta: dict[str, Any],
        shards: dict[str, FileEntry] | None = None,
        uploaded: frozenset[str] = frozenset(),
    ) -> str:
        """Snapshot `state` for `step` and queue it; returns the URI it will commit to.

        `meta`: the manifest's run fields and position (a CheckpointManifest without step,
        torch_version and files). `shards`: more files of this checkpoint for the manifest;
        the ones in `uploaded` are already in the store, the others are in `folder(step)`."""
        with self._cond:
            if step in self._committed or any(p.step == step for p in self._pending):
                raise CheckpointError(
                    f"{self.store.uri(checkpoint_key(self.run_id, step))} is already committed; "
                    "checkpoints are never overwritten"
                )
            if self._failure:
                raise CheckpointError(self._failure)
        manifest = CheckpointManifest(
            **meta, step=step, torch_version=torch.__version__, files=dict(shards or {})
        )
        upload = [STATE_FILE, *sorted(set(shards or {}) - uploaded)]
        with self._cond:
            spare, self._spare = self._spare, None
        snapshot = cpu_snapshot(state, spare)
        staged = _Staged(step, self.folder(step), manifest, upload, snapshot, snapshot_ready())
        with self._cond:
            if len(self._pending) >= self.config.max_staged:
                dropped = self._pending.pop()  # never [0]: max_staged >= 2
                dropped.dropped = True
                self._discarded.append(dropped)
                log.warning(
                    "checkpoint step %d dropped before upload: %d checkpoints already wait for "
                    "the store (checkpoint.max_staged); step %d takes its place",
                    dropped.step,
                    len(self._pending) + 1,
                    step,
                )
            self._pending.append(staged)
            self._unwritten.append(staged)
            self._cond.notify_all()
        return self.store.uri(checkpoint_key(self.run_id, step))

    def _stage_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._unwritten or self._discarded or self._closing)
                if not (self._unwritten or self._discarded):
                    return
            try:
                self._stage_next()
            except CheckpointError as exc:  # the disk is full: fail the run now, not retry
                log.error("%s", exc)
                with self._cond:
                    self._failure = self._failure or str(exc)
                    self._cond.notify_all()
                return

    def _stage_next(self) -> None:
        """Remove a dropped checkpoint's folder, or write the oldest unwritten snapshot."""
        with self._cond:
            discarded = self._discarded.pop(0) if self._discarded else None
            item = self._unwritten.pop(0) if discarded is None and self._unwritten else None
        if discarded is not None:
            with self._write_lock:
                discarded.state = None
                shutil.rmtree(discarded.folder, ignore_errors=True)
        elif item is not None and not item.dropped:
            self._write_state(item)

    def _write_state(self, item: _Staged) -> None:
        """Serialize a snapshot into its staging folder (atomically) and list it in the
        manifest; the snapshot's memory is freed. Run by the staging thread, or by the
        uploader or `close` if they get to it first."""
        with self._write_lock:
            if item.state is None or item.dropped:
                return
            local, tmp = item.folder / STATE_FILE, item.folder / (STATE_FILE + ".tmp")
            if item.ready is not None:
                item.ready.synchronize()
            try:
                item.folder.mkdir(parents=True, exist_ok=True)
                entry = save_without_gil(item.state, tmp)
            except (OSError, RuntimeError) as exc:
                tmp.unlink(missing_ok=True)  # a partial file only holds space others need
                if disk_full(exc):
                    raise staging_full(item.step, self.staging) from None
                raise
            tmp.replace(local)
            item.manifest.files[STATE_FILE] = entry
            with self._cond:
                self._spare = item.state  # the next snapshot is copied into its memory
            item.state = None

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for every staged checkpoint to commit; raise CheckpointError if they cannot."""
        timeout_s = self.config.upload_timeout_s if timeout_s is None else timeout_s
        done, left, failure = self._drain(timeout_s)
        self._sender.close()
        self._spare = None
        self._stager.join(timeout=30)  # it ends once nothing is left to write
        while self._unwritten or self._discarded:  # if it could not: keep local copies
            self._stage_next()
        remove_empty_staging(self.staging)  # only empty folders: kept copies stay
        if failure and failure.startswith(DISK_FULL):
            raise CheckpointError(failure)
        if failure:
            raise CheckpointError(f"{failure}; local copies kept in {self.staging}")
        if not done:
            raise CheckpointError(
                f"checkpoint upload did not finish within checkpoint.upload_timeout_s="
                f"{timeout_s:g}s (steps {left} not committed to {self.store.settings.where}); "
                f"local copies kept in {self.staging}"
            )

    def _before_first(self) -> None:
        try:
            self._retry("listing committed checkpoints", self._discover)
        except Exception as exc:  # retention then only sees this attempt's checkpoints
            log.warning("could not list earlier checkpoints of run %s: %s", self.run_id, exc)

    def _record(self, item: _Staged, committed: bool) -> None:
        if committed:
            self._committed[item.step] = item.manifest.metrics
            self._files[item.step] = list(item.manifest.files)

    def _after(self, item: _Staged, committed: bool) -> None:
        shutil.rmtree(item.folder, ignore_errors=True)
        self._retain()
        absorb_s = time.monotonic() - item.taken_at
        if self._first_absorbed:
            self.last_absorb_s = absorb_s
        self._first_absorbed = True

    def _retry(self, what: str, action: Callable[[], Any]) -> Any:
        return retry_transient(what, action, self.config, self._stop)

    def _discover(self) -> bool:
        """Checkpoints this run committed before (an earlier attempt): retention counts them."""
        for step in checkpoint_steps(self.store, self.run_id):
            key = checkpoint_key(self.run_id, step)
            try:
                manifest = read_manifest(self.store, self.store.uri(key))
            except FileNotFoundError:
                continue  # never committed
            except CheckpointError as exc:
                log.warning("checkpoint step %d not retained: %s", step, exc)
                continue
            with self._cond:
                self._committed[step] = manifest.metrics
                self._files[step] = list(manifest.files)
        return True

    def _process(self, item: _Staged) -> bool | None:
        """Files first, manifest last. False if that step was committed before (kept as is);
        None if stopped while waiting for another rank's shard.

        Three requests when all goes well (check, file, manifest): on a small model that
        checkpoints every few seconds the uploader's CPU is the workers' CPU."""
        self._write_state(item)
        key = checkpoint_key(self.run_id, item.step)
        try:
            theirs = self.store.read_json(f"{key}/{MANIFEST_FILE}").get("files")
        except FileNotFoundError:
            theirs = None
        if theirs is not None:
            if theirs == item.manifest.model_dump(mode="json")["files"]:
                return True  # our own commit, whose reply was lost before a retry
            log.warning(
                "checkpoint step %d is already committed by an earlier attempt; "
                "committed checkpoints are never overwritten, so this one is not stored",
                item.step,
            )
            return False
        for name in item.upload:
            self._sender.send(item.folder / name, f"{key}/{name}")
        if not self._await_other_ranks(item, key):
            return None  # stopped before their shards arrived
        check_owner(self.store, self.run_id, self.lease_token)  # two trainers never commit
        document = signed(self._key, key, item.manifest.model_dump(mode="json"))
        self.store.write_json(f"{key}/{MANIFEST_FILE}", document)
        log.info("checkpoint step %d committed to %s", item.step, self.store.uri(key))
        return True

    def _await_other_ranks(self, item: _Staged, key: str) -> bool:
        """A sharded checkpoint commits once every other rank's shard is in the store, each
        uploaded by its own rank in the background (sharded.ShardUploader)."""
        theirs = {n: f for n, f in item.manifest.files.items() if n not in item.upload}
        delay = 0.1
        while True:
            missing = [n for n, f in theirs.items() if self.store.size(f"{key}/{n}") != f.size]
            if not missing:
                return True
            if self._stop.wait(delay):
                return False
            delay = min(delay * 2, 2.0)

    def _retain(self) -> None:
        with self._cond:
            committed = dict(self._committed)
        keep = set(sorted(committed)[-self.config.keep_last :]) | set(self.config.pinned_steps)
        if self.best_by is not None:
            metric, mode = self.best_by
            scored = {s: m[metric] for s, m in committed.items() if metric in m}
            if scored:
                keep.add((max if mode == "max" else min)(scored, key=scored.__getitem__))
        for step in sorted(set(committed) - keep):
            key = checkpoint_key(self.run_id, step)
            try:
                self.store.delete_files([f"{key}/{MANIFEST_FILE}"])  # uncommit first
            except Exception as exc:
                log.warning("could not delete checkpoint step %d (%s); will retry", step, exc)
                continue
            with self._cond:
                self._committed.pop(step, None)
                files = self._files.pop(step, None)
            try:
                if files is None:
                    self.store.delete(key, recursive=True)
                else:
                    self.store.delete_files([f"{key}/{name}" for name in files])
            except Exception as exc:
                log.warning("checkpoint step %d uncommitted but its files remain (%s)", step, exc)
            else:
                log.info("checkpoint step %d deleted (retention)", step)


def retry_transient(
    what: str,
    action: Callable[[], Any],
    config: CheckpointConfig,
    stop: threading.Event | None = None,
) -> Any:
    """Run `action`, retrying transient store errors with exponential backoff + jitter.
    Returns None if `stop` is set before it succeeded; other errors propagate."""
    stop = stop or threading.Event()
    delay = config.upload_backoff_s
    attempt = 0
    while True:
        try:
            return action()
        except Exception as exc:
            if not _transient(exc):
                raise
            attempt += 1
            wait = min(delay, config.upload_backoff_max_s) * random.uniform(0.5, 1.5)
            log.warning(
                "%s failed (attempt %d: %s); retrying in %.1fs",
                what,
                attempt,
                first_line(exc),
                wait,
            )
            if stop.wait(wait):
                return None
            delay *= 2


def fetch_files(store: Store, uri: str, manifest: CheckpointManifest, dest: Path) -> Path:
    """Download and verify every file of a committed checkpoint except state.pt (which
    `load_checkpoint` reads): the per-rank shards of a sharded checkpoint."""
    key = store.key_of(uri.rstrip("/"))
    dest.mkdir(parents=True, exist_ok=True)
    for name, expected in manifest.files.items():
        if name == STATE_FILE:
            continue
        data = _verified_bytes(store, key, uri, name, expected)
        tmp = dest / (name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(dest / name)
    return dest


def _verified_bytes(store: Store, key: str, uri: str, name: str, expected: FileEntry) -> bytes:
    """A checkpoint file's bytes, refused unless they match the manifest's size and sha256."""
    try:
        data = store.get_bytes(f"{key}/{name}")
    except FileNotFoundError:
        raise CheckpointError(f"{uri}/{name} is missing") from None
    if len(data) != expected.size or _sha256(data) != expected.sha256:
        raise CheckpointError(f"{uri}/{name} does not match its manifest (truncated or tampered)")
    return data


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` comes of a full disk (or quota). torch.save reports a failed write as a
    RuntimeError ("unexpected pos") whose context is the OSError; DCP's CheckpointException
    holds each rank's error in `failures`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(seen, "failures", None)
        if isinstance(failures, dict) and any(disk_full(e) for e, _ in failures.values()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def staging_full(step: int, staging: Path) -> CheckpointError:
    """What a run fails with when its checkpoint cannot be staged for lack of space: at once,
    instead of retrying as if the store were down."""
    return CheckpointError(
        f"{DISK_FULL}: checkpoint step {step} cannot be staged in {staging} (no space left "
        "on its disk); free space there, then run again with the same --run-id to resume"
    )


def file_info(path: Path) -> FileEntry:
    return FileEntry(size=path.stat().st_size, sha256=file_digest(path))


def remove_empty_staging(folder: Path) -> None:
    """Remove a run's empty `step-*` staging folders and emptied `restore-rank*` ones.

    A store outage or a dropped checkpoint can leave a folder whose files are gone. rmdir
    refuses a folder with files, so a copy still waiting for the store is never touched."""
    for restored in sorted(folder.glob("restore-rank*")):
        _remove_if_empty(restored.glob("step-*"))
    _remove_if_empty(folder.glob("step-*"))
    _remove_if_empty(folder.glob("restore-rank*"))


def _remove_if_empty(paths: Iterable[Path]) -> None:
    for path in list(paths):
        with contextlib.suppress(OSError):  # not empty, not a folder, or already gone
            path.rmdir()


class NullCheckpointWriter:
    """What ranks other than 0 hold: saving is rank 0's side effect."""

    def __init__(self) -> None:
        self.committed: list[str] = []

    def staged_steps(self) -> list[int]:
        return []

    def keeps_up(self, since_last_s: float, max_overhead: float) -> bool:
        return True  # rank 0's writer decides for every rank

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], **_: Any) -> None:
        return None

    def close(self, timeout_s: float | None = None) -> None:
        return None


def read_manifest(store: Store, uri: str) -> CheckpointManifest:
    """A checkpoint's manifest, its signature verified; FileNotFoundError if it was never
    committed, CheckpointError if it is not a manifest this trainyard can read or this
    project did not sign it."""
    key = store.key_of(uri.rstrip("/"))
    try:
        document = store.read_json(f"{key}/{MANIFEST_FILE}")
        manifest = CheckpointManifest.model_validate(document)
    except json.JSONDecodeError:
        raise CheckpointError(f"{uri}/{MANIFEST_FILE} is not valid JSON (tampered)") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the manifest"
        raise CheckpointError(
            f"{uri}/{MANIFEST_FILE} is not a checkpoint manifest ({where}: {error['msg']}); "
            "it was tampered with or written by another trainyard version"
        ) from None
    verify(uri, key, document)
    return manifest


def load_checkpoint(store: Store, uri: str) -> tuple[dict[str, Any], CheckpointManifest]:
    """(state, manifest) of a committed checkpoint, verified against its manifest."""
    key = store.key_of(uri.rstrip("/"))
    try:
        manifest = read_manifest(store, uri)
    except FileNotFoundError:
        raise CheckpointError(f"{uri} has no {MANIFEST_FILE}: it was never committed") from None
    if STATE_FILE not in manifest.files:
        raise CheckpointError(f"{uri}/{MANIFEST_FILE} does not list {STATE_FILE}")
    data = _verified_bytes(store, key, uri, STATE_FILE, manifest.files[STATE_FILE])
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{uri}/{STATE_FILE} holds objects other than tensors and plain data; "
            f"refusing to unpickle it ({str(exc).splitlines()[0]})"
        ) from None
    return state, manifest


def latest_committed(
    store: Store, run_id: str
) -> tuple[str, dict[str, Any], CheckpointManifest] | None:
    """(uri, state, manifest) of the highest committed checkpoint that verifies, or None.

    Folders without a manifest (an upload that never finished) and ones that fail
    verification are skipped with a warning, so a broken latest checkpoint costs only the
    steps since the previous one.
    """
    for step in reversed(checkpoint_steps(store, run_id)):
        uri = store.uri(checkpoint_key(run_id, step))
        try:
            state, manifest = load_checkpoint(store, uri)
        except CheckpointError as exc:
            log.warning("skipping checkpoint step %d: %s", step, exc)
            continue
        return uri, state, manifest
    return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _transient(exc: BaseException) -> bool:
    """Errors worth retrying: the store unreachable or failing, not refused or misused."""
    if isinstance(exc, PermissionError | FileNotFoundError | CheckpointError) or disk_full(exc):
        return False  # a full local disk does not empty itself while we wait
    return isinstance(exc, OSError | BotoCoreError | TimeoutError)

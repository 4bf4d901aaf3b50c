"""Rank 0's checkpoint writer: each checkpoint snapshotted, staged on local disk and
committed to the store in the background (files first, manifest signed and written last),
then retention deletes the ones no longer kept. Taking a checkpoint costs the training
thread one copy of the state into CPU memory; serializing, hashing and uploading happen on
the staging and uploader threads.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainyard.checkpoint.layout import (
    MANIFEST_FILE,
    STATE_FILE,
    checkpoint_key,
    checkpoint_steps,
)
from trainyard.checkpoint.reader import read_manifest
from trainyard.checkpoint.signing import project_key, signed
from trainyard.checkpoint.snapshot import cpu_snapshot, save_without_gil, snapshot_ready
from trainyard.checkpoint.uploads import (
    DISK_FULL,
    UploadQueue,
    disk_full,
    retry_transient,
    staging_full,
)
from trainyard.config import CheckpointConfig
from trainyard.errors import CheckpointError
from trainyard.runs.contracts import CheckpointManifest, FileEntry
from trainyard.runs.lease import check_owner
from trainyard.storage import Store
from trainyard.storage.sender import FileSender

log = logging.getLogger(__name__)


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

"""One owner per run id: a lease in the store, `runs/<run_id>/lease.json`, with a heartbeat.

Whoever runs a run's flow holds its lease and renews it every `HEARTBEAT_S`. Starting or
continuing a run whose lease is live is refused, naming the owner; a stale lease (its owner
died on this host, or stopped heartbeating for `STALE_AFTER_S`) is taken over, and the
takeover is returned so the record can say so. Rank 0 re-reads the lease before it commits a
checkpoint (`check_owner`), so a trainer that lost its run can never commit to it.

S3 has no compare-and-swap that every store offers, so acquiring checks, writes, waits
briefly and re-reads. Of two claimants racing, the last write stands: the other finds a
foreign token when it re-reads, at its next heartbeat, or at the latest before its first
commit, which it then refuses to make.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from pydantic import BaseModel

from trainyard.errors import TrainyardError
from trainyard.guardian import process_start_time
from trainyard.storage import Store

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0
SETTLE_S = 0.3  # between writing a lease and re-reading it
LEASE_TOKEN_ENV = "TRAINYARD_LEASE_TOKEN"


class RunOwned(TrainyardError):
    """Another live process owns the run."""


class Lease(BaseModel):
    run_id: str
    token: str
    host: str
    pid: int
    pid_started: str | None = None  # /proc start time: a recycled pid is not the owner
    since: float
    heartbeat_at: float

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {_iso(self.since)}"

    def is_live(self, now: float | None = None) -> bool:
        if self.host == socket.gethostname() and self.pid_started is not None:
            return process_start_time(self.pid) == self.pid_started
        return (now or time.time()) - self.heartbeat_at < STALE_AFTER_S


def lease_key(run_id: str) -> str:
    return f"runs/{run_id}/lease.json"


def read_lease(store: Store, run_id: str) -> Lease | None:
    try:
        return Lease.model_validate(store.read_json(lease_key(run_id)))
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("run %s has an unreadable lease; treating it as stale", run_id)
        return None


def check_not_owned(store: Store, run_id: str) -> Lease | None:
    """Refuse a run whose lease is live; return a stale lease (to be taken over) or None."""
    current = read_lease(store, run_id)
    if current is not None and current.is_live():
        raise RunOwned(
            f"run {run_id} is in use by {current.describe()}; wait for it to end, stop it "
            f"(kill {current.pid} on {current.host}), or use another --run-id"
        )
    return current


class RunLease:
    """The lease this process holds: acquired on entry, renewed by a thread, released on exit."""

    def __init__(self, store: Store, run_id: str):
        self.store = store
        self.run_id = run_id
        self.token = secrets.token_hex(16)
        self.taken_over: Lease | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        now = time.time()
        pid = os.getpid()
        self.lease = Lease(
            run_id=run_id,
            token=self.token,
            host=socket.gethostname(),
            pid=pid,
            pid_started=process_start_time(pid),
            since=now,
            heartbeat_at=now,
        )

    def __enter__(self) -> RunLease:
        self.taken_over = check_not_owned(self.store, self.run_id)
        self._write()
        time.sleep(SETTLE_S)
        holder = read_lease(self.store, self.run_id)
        if holder is None or holder.token != self.token:
            raise RunOwned(
                f"run {self.run_id} was claimed at the same moment by "
                f"{holder.describe() if holder else 'another process'}; use another --run-id"
            )
        if self.taken_over is not None:
            log.warning(
                "run %s: took over the stale lease of %s (last heartbeat %s)",
                self.run_id,
                self.taken_over.describe(),
                _iso(self.taken_over.heartbeat_at),
            )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        holder = read_lease(self.store, self.run_id)
        if holder is not None and holder.token == self.token:
            self.store.delete(lease_key(self.run_id))

    def takeover_note(self) -> dict[str, Any] | None:
        if self.taken_over is None:
            return None
        return {
            "host": self.taken_over.host,
            "pid": self.taken_over.pid,
            "since": _iso(self.taken_over.since),
            "last_heartbeat": _iso(self.taken_over.heartbeat_at),
            "at": _iso(time.time()),
        }

    def _write(self) -> None:
        self.lease = self.lease.model_copy(update={"heartbeat_at": time.time()})
        self.store.write_json(lease_key(self.run_id), self.lease.model_dump())

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                holder = read_lease(self.store, self.run_id)
                if holder is not None and holder.token != self.token:
                    log.error("run %s: lease taken by %s", self.run_id, holder.describe())
                    return
                self._write()
            except Exception as exc:  # the store may be down for a while; keep trying
                log.warning("run %s: lease heartbeat failed (%s)", self.run_id, exc)


def check_owner(store: Store, run_id: str, token: str | None) -> None:
    """Before a commit: refuse if the run's lease is not (or no longer) held by `token`."""
    if not token:
        return  # launched without a lease (engine tests, benchmarks)
    holder = read_lease(store, run_id)
    if holder is None or holder.token != token:
        owner = holder.describe() if holder else "nobody"
        raise RunOwned(f"run {run_id} is no longer owned by this trainer (owner: {owner})")


def last_heartbeat(store: Store, run_id: str) -> tuple[bool, float | None]:
    """(whether a live owner holds the run, the last heartbeat seen)."""
    lease = read_lease(store, run_id)
    if lease is None:
        return False, None
    return lease.is_live(), lease.heartbeat_at


def _iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="seconds")

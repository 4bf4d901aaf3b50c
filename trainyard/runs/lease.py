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

One clock judges staleness: the store's. Machines' clocks disagree (a claimant 45 s ahead
would take a live run; a heartbeat stamped a year ahead would lock one for good), so a
lease's age is the store's time now (the Last-Modified of a probe object this process
writes) less the store's time of the lease's last write (its Last-Modified); `heartbeat_at`
and `since` are only shown. Last-Modified has whole seconds (S3's HTTP dates; SeaweedFS keeps
no more, in listings too), so an age is off by about a second either way: nothing against a
heartbeat every 5 s and `STALE_AFTER_S` of 30. Both reads go to the store, never to s3fs's
caches (the lease's GET, the probe's HEAD), so a heartbeat is seen as soon as it is written.
`trainyard runs unlock` breaks a lease by deleting it; an owner that finds its lease gone
stops heartbeating, and its commits are refused.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Annotated, Any

from pydantic import BaseModel, Field, PrivateAttr

from trainyard.errors import TrainyardError
from trainyard.runtime.guardian import process_start_time
from trainyard.storage import Store

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0
SETTLE_S = 0.3  # between writing a lease and re-reading it
LEASE_TOKEN_ENV = "TRAINYARD_LEASE_TOKEN"
CLOCK_KEY = "store-clock"  # the probe object whose Last-Modified tells the store's time
CLOCK_REFRESH_S = 10.0  # how long one probe serves, advanced by this host's monotonic clock


class RunOwned(TrainyardError):
    """Another live process owns the run."""


class UnlockNeedsYes(TrainyardError):
    """`runs unlock` without --yes: it says whose the lease is and changes nothing."""


class StoreClock:
    """The store's time now, from a probe object's Last-Modified plus the time this process
    measured since (a duration on one host's monotonic clock, never a date compared across
    machines). Pairing the probe with the moment after it was read back makes `now` run at
    most a few seconds behind the store, never ahead: a lease looks younger, not older."""

    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()
        self._probe: tuple[float, float] | None = None  # (store time, monotonic time)

    def now(self) -> float:
        with self._lock:
            if self._probe is None or time.monotonic() - self._probe[1] > CLOCK_REFRESH_S:
                stamped = self.store.stamp(CLOCK_KEY)
                self._probe = (stamped, time.monotonic())
            stamped, at = self._probe
        return stamped + (time.monotonic() - at)


_clocks: weakref.WeakKeyDictionary[Store, StoreClock] = weakref.WeakKeyDictionary()
_clocks_lock = threading.Lock()


def store_clock(store: Store) -> StoreClock:
    """One clock per Store object: a listing of many leases writes one probe."""
    with _clocks_lock:
        clock = _clocks.get(store)
        if clock is None:
            clock = _clocks[store] = StoreClock(store)
        return clock


# A lease is anyone's to write who can write the store: what is shown from it carries no
# control characters, and its times are dates a message can print (else it is unreadable,
# and so stale).
Shown = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f-\x9f]+$")]
UnixTime = Annotated[float, Field(ge=0, lt=253402300800, allow_inf_nan=False)]  # before 10000


class Lease(BaseModel):
    run_id: str
    token: str
    host: Shown
    pid: int
    pid_started: str | None = None  # /proc start time: a recycled pid is not the owner
    since: UnixTime  # the owner's clock: shown, never compared
    heartbeat_at: UnixTime  # likewise
    # Set by `read_lease`: the store's time of the lease's last write, and the store's clock.
    _written_at: float | None = PrivateAttr(default=None)
    _clock: StoreClock | None = PrivateAttr(default=None)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {_iso(self.since)}"

    @property
    def written_at(self) -> float | None:
        return self._written_at

    def age_s(self) -> float | None:
        """Seconds since the store last saw this lease written, by the store's clock."""
        if self._written_at is None or self._clock is None:
            return None
        return self._clock.now() - self._written_at

    def is_live(self) -> bool:
        """An owner on this host is live while its process is; one elsewhere while the store
        has seen its heartbeat within `STALE_AFTER_S`. A lease not read from the store has
        no age and counts as live."""
        if self.host == socket.gethostname() and self.pid_started is not None:
            return process_start_time(self.pid) == self.pid_started
        age = self.age_s()
        return age is None or age < STALE_AFTER_S


def lease_key(run_id: str) -> str:
    return f"runs/{run_id}/lease.json"


def read_lease(store: Store, run_id: str) -> Lease | None:
    """The run's lease, with the store's time of its last write (one GET), or None."""
    try:
        data, written_at = store.get_bytes_and_time(lease_key(run_id))
        lease = Lease.model_validate_json(data)
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("run %s has an unreadable lease; treating it as stale", run_id)
        return None
    lease._written_at, lease._clock = written_at, store_clock(store)
    return lease


def check_not_owned(store: Store, run_id: str) -> Lease | None:
    """Refuse a run whose lease is live; return a stale lease (to be taken over) or None."""
    current = read_lease(store, run_id)
    if current is not None and current.is_live():
        raise RunOwned(
            f"run {run_id} is in use by {current.describe()}; wait for it to end, stop it "
            f"(kill {current.pid} on {current.host}), or use another --run-id; if that "
            f"process is gone for good, `trainyard runs unlock {run_id}` breaks its lease"
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
                _iso(self.taken_over.written_at or self.taken_over.heartbeat_at),
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
            "since": _iso(self.taken_over.since),  # the old owner's clock
            # The store's clock: when it last saw a heartbeat, and when it was taken over.
            "last_heartbeat": _iso(self.taken_over.written_at or self.taken_over.heartbeat_at),
            "at": _iso(store_clock(self.store).now()),
        }

    def _write(self) -> None:
        self.lease = self.lease.model_copy(update={"heartbeat_at": time.time()})
        self.store.write_json(lease_key(self.run_id), self.lease.model_dump())

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                holder = read_lease(self.store, self.run_id)
                if holder is None:  # broken with `runs unlock`: never write it back
                    log.error("run %s: lease broken; this process no longer owns it", self.run_id)
                    return
                if holder.token != self.token:
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
    """(whether a live owner holds the run, when the store last saw its heartbeat)."""
    lease = read_lease(store, run_id)
    if lease is None:
        return False, None
    return lease.is_live(), lease.written_at


def unlock(store: Store, run_id: str, yes: bool) -> str:
    """`trainyard runs unlock`: say whose the run's lease is; with `yes`, break it (a run with
    no lease is left as it is). Returns the line to print."""
    lease = read_lease(store, run_id)
    if lease is None and not store.exists(lease_key(run_id)):
        if not store.list_files(f"runs/{run_id}"):
            raise TrainyardError(
                f"no run {run_id!r} in {store.uri('runs')}; see `trainyard runs list`"
            )
        return f"run {run_id} has no lease: nothing to unlock"
    whose = f"leased by {_whose(lease)}" if lease else "has an unreadable lease"
    if not yes:
        raise UnlockNeedsYes(
            f"run {run_id} is {whose}; breaking the lease lets another process continue or "
            "delete the run, so first make sure that owner is gone, then add --yes"
        )
    _break(store, run_id, lease)
    return (
        f"unlocked run {run_id}, which was {whose}; `trainyard run --run-id {run_id}` "
        f"continues it, `trainyard runs delete {run_id}` deletes it"
    )


def _whose(lease: Lease) -> str:
    age = lease.age_s()
    heard = f"{max(age, 0):.0f} s ago by the store's clock" if age is not None else "unknown"
    state = "live" if lease.is_live() else "stale"
    return f"{lease.describe()}, last heartbeat {heard} ({state})"


def _break(store: Store, run_id: str, lease: Lease | None) -> None:
    """Delete the lease. A heartbeat under way at that moment may write it back; it is
    deleted again once that write has landed, until the owner's next heartbeat finds it gone
    (a few tries: each needs a heartbeat to straddle a delete)."""
    for _ in range(5):
        _delete_lease(store, run_id)
        time.sleep(SETTLE_S)
        again = read_lease(store, run_id)
        if again is None or lease is None or again.token != lease.token:
            return


def _delete_lease(store: Store, run_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # its owner ended meanwhile
        store.delete(lease_key(run_id))


def _iso(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="seconds")

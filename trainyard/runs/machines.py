"""Every machine's part in a run, as its record shows it: the nodes (which host each node
rank ran on, with how many workers, from when to when), each rank's host in every round of
workers, and every host change between rounds. Built from the rounds rank 0 gathered
(trainyard.runtime.hosts), after the job, by the process that writes the record."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from trainyard.runtime.hosts import recorded_rounds


class NodeSpan(BaseModel):
    """A node rank on one host for consecutive rounds: a node that a restart brought back
    on another host, or that left and joined again, has one entry per stay."""

    node_rank: int
    host: str
    workers: int  # its ranks
    started_at: str  # the start of its first round
    # When its last round ended: the start of the next round (a node that left, or a round
    # whose workers failed), else when the job ended; None if that is unknown.
    ended_at: str | None = None


class HostRound(BaseModel):
    """One round of workers (a launch, a restart): each rank's host and node rank."""

    round: int  # its place among the run's rounds, from 0
    launch: int  # which launch of the run (a continued run's next launch counts one more)
    attempt: int  # rank 0's attempt: 0 for a launch, then one more per restart it counts
    started_at: str
    hosts: list[str]  # indexed by rank
    node_ranks: list[int]  # indexed by rank


class HostChange(BaseModel):
    """A rank on another host than in the round before (None: the rank was not there)."""

    round: int  # the round it changed in (rank_hosts' `round`)
    at: str  # that round's start
    rank: int
    before: str | None
    after: str | None


def machines_seen(
    folder: Path, job_ended: float | None
) -> tuple[list[NodeSpan], list[HostRound], list[HostChange]]:
    """(nodes, rank_hosts, host_changes) from the rounds recorded in `folder` (the run's
    staging folder); `job_ended`: unix time the job ended (None: still unknown)."""
    read = [_round(found) for found in recorded_rounds(folder)]
    rounds = [found for found in read if found is not None]
    ends = [next_round["started_at"] for next_round in rounds[1:]] + [job_ended]
    ends = ends[: len(rounds)]  # none without rounds
    return (
        node_spans(rounds, ends),
        [
            HostRound(**{**r, "round": index, "started_at": _when(r["started_at"])})
            for index, r in enumerate(rounds)
        ],
        host_changes(rounds),
    )


def node_spans(rounds: list[dict[str, Any]], ends: list[float | None]) -> list[NodeSpan]:
    """A span per (node rank, host, workers) for as long as consecutive rounds of one launch
    have it; a new launch starts new spans."""
    spans: list[NodeSpan] = []
    open_spans: dict[tuple[str, int, int], NodeSpan] = {}
    for index, (found, ended) in enumerate(zip(rounds, ends, strict=True)):
        if index > 0 and found["launch"] != rounds[index - 1]["launch"]:
            open_spans = {}
        workers = Counter(zip(found["node_ranks"], found["hosts"], strict=True))
        still_open = {}
        for (node_rank, host), count in sorted(workers.items()):
            key = (host, node_rank, count)
            span = open_spans.get(key)
            if span is None:
                span = NodeSpan(
                    node_rank=node_rank,
                    host=host,
                    workers=count,
                    started_at=_when(found["started_at"]),
                )
                spans.append(span)
            span.ended_at = _when(ended) if ended is not None else None
            still_open[key] = span
        open_spans = still_open
    return spans


def host_changes(rounds: list[dict[str, Any]]) -> list[HostChange]:
    """Each rank whose host differs from the round before: moved, gone or new."""
    changes = []
    for index, (before, after) in enumerate(zip(rounds, rounds[1:], strict=False), start=1):
        old, new = before["hosts"], after["hosts"]
        for rank in range(max(len(old), len(new))):
            was = old[rank] if rank < len(old) else None
            now = new[rank] if rank < len(new) else None
            if was != now:
                at = _when(after["started_at"])
                changes.append(HostChange(round=index, at=at, rank=rank, before=was, after=now))
    return changes


def _round(found: Any) -> dict[str, Any] | None:
    """A round as rank 0 wrote it, or None if it is not one (a file from another version)."""
    try:
        hosts, node_ranks = [str(h) for h in found["hosts"]], [int(n) for n in found["node_ranks"]]
        attempt, started = int(found["attempt"]), float(found["started_at"])
        launch = int(found.get("launch", 0))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    if len(hosts) != len(node_ranks):
        return None
    return {
        "launch": launch,
        "attempt": attempt,
        "started_at": started,
        "hosts": hosts,
        "node_ranks": node_ranks,
    }


def _when(unix: float) -> str:
    """The record's way of writing a time (trainyard.runs.record.now)."""
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")

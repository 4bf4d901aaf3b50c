"""Which host each rank runs on, round after round: at the start of each worker group (a
torchrun launch, each restart, a persistent worker's job) every rank says its host name and
node rank in one small all_gather, and rank 0 appends that round to `hosts.json` in
`<staging>/<run_id>/`, beside its AttemptLog. The file survives a crash of the workers, so
the process that writes the run's record reads it after a failure as after a success
(trainyard.runs.machines turns the rounds into the record's nodes and host changes).

Rank 0 is always on node 0 (trainyard.runtime.nodes makes the node rank the group rank), the
node whose launcher writes the record: the file needs no store and no extra process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.util.attempts import RESTARTS_BEFORE_ENV
from trainyard.util.files import write_text_atomic

if TYPE_CHECKING:  # imported by gather_hosts: see there
    from trainyard.dist import DistContext

log = logging.getLogger(__name__)

HOSTS_FILE = "hosts.json"
# torchrun's group rank of this worker's node: trainyard's node_rank under its rendezvous
# (NODE_RANK_ENV says it where an elastic round lacks a node before it), 0 for a standalone
# launch.
GROUP_RANK_ENV = "GROUP_RANK"


def gather_hosts(ctx: DistContext, attempt: int, folder: Path) -> dict[str, Any]:
    """Every rank's host and node rank, gathered on every rank; rank 0 appends the round to
    `folder`/hosts.json. One all_gather of a few bytes per rank; a failed write is a warning,
    never the end of the run."""
    # Start-up cost: trainyard.dist brings torch (~2.5 s), which the commands that only read
    # hosts.json (the run record's machines: `trainyard runs`, `sweep list`) never need.
    from trainyard.dist import NODE_RANK_ENV, all_gather_objects

    clock = time.monotonic()
    node_rank = os.environ.get(NODE_RANK_ENV) or os.environ.get(GROUP_RANK_ENV, "0")
    mine = (socket.gethostname(), int(node_rank))
    ranks = all_gather_objects(mine)
    spent_ms = (time.monotonic() - clock) * 1000
    found = {
        "attempt": attempt,  # rank 0's (another node may count its restarts otherwise)
        "started_at": time.time(),
        "hosts": [host for host, _ in ranks],
        "node_ranks": [node for _, node in ranks],
    }
    if ctx.is_main:
        log.info("hosts of the %d ranks gathered in %.1f ms", len(ranks), spent_ms)
        try:
            rounds = recorded_rounds(folder)
            found |= _launch(rounds) | {"pid": os.getpid()}
            found["regrouped"] = _regrouped(rounds, found)
            write_text_atomic(folder / HOSTS_FILE, json.dumps([*rounds, found]))
        except OSError as exc:
            log.warning("hosts of this round not written to %s (%s)", folder, exc)
    return found


def _launch(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Which launch of the run this round belongs to, counted from 0, and its agent. A
    round's torchrun agent on node 0 (rank 0's parent) stays the same over the restarts of
    one launch, including those node 0 makes for another node's sake, which its restart
    count misses; a lost agent launched again carries the restarts before it."""
    agent = f"{socket.gethostname()}:{os.getppid()}"
    if not rounds:
        return {"launch": 0, "agent": agent}
    last = rounds[-1]
    same = last.get("agent") == agent or os.environ.get(RESTARTS_BEFORE_ENV, "0") != "0"
    launch = last.get("launch", 0) if isinstance(last.get("launch", 0), int) else 0
    return {"launch": launch if same else launch + 1, "agent": agent}


def _regrouped(rounds: list[dict[str, Any]], found: dict[str, Any]) -> bool:
    """Node 0's agent started this round's workers anew for another node's sake (one joined
    or left an elastic run), which torchrun counts as no restart: the last round had the
    same agent and attempt, but other worker processes (a persistent worker's next job is
    the same process)."""
    if not rounds:
        return False
    last = rounds[-1]
    same_agent = last.get("agent") == found["agent"] and last.get("attempt") == found["attempt"]
    return same_agent and last.get("pid") != found["pid"]


def recorded_rounds(folder: Path) -> list[dict[str, Any]]:
    """The rounds rank 0 wrote in `folder`, oldest first ([] if none could be read)."""
    try:
        rounds = json.loads((folder / HOSTS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return rounds if isinstance(rounds, list) else []

"""The flow runs a host's last worker left running when the host died (or its processes
were killed): its worker, started again, marks them crashed.

Node 0 finds a lost node by its host's worker going quiet. A worker started again before
the server missed three of its heartbeats (90 s with Prefect's default 30-s beat) hides the
loss: the node's flow run would show Running for good and never be replaced, and an
elastic run would never scale back. Prefect's process worker records each flow run's
process id (`infrastructure_pid`) and labels the run with its own name (the host's); the new
worker looks for those processes on this host before it polls for work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Crashed

WORKER_LABEL = "prefect.worker.name"  # Prefect's label: the worker that ran the flow run
FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"  # Prefect's: set in each flow run's process
# The name of the Crashed state given here: its host died under it, saying nothing, so
# the node's peers may wait on it in a collective (tasks/nodes.py restarts them).
ORPHANED = "Orphaned"


def crash_orphaned_runs(pool: str, worker: str) -> list[str]:
    """Mark crashed the flow runs of `pool` that the worker named `worker` (this host's)
    started, still Running, whose process is gone from this host: the lines said."""
    lines = []
    with get_client(sync_client=True) as client:
        for run in _running(client, pool):
            if run.labels.get(WORKER_LABEL) != worker:
                continue
            if run_process_lives(run.infrastructure_pid, str(run.id)):
                continue
            message = (
                f"host {worker} was lost: its worker started again and this flow run's "
                f"process (pid {run.infrastructure_pid}) is gone"
            )
            client.set_flow_run_state(run.id, Crashed(message=message, name=ORPHANED), force=True)
            lines.append(f"flow run {run.name} ({run.id}): {message}")
    return lines


def _running(client: Any, pool: str) -> list[Any]:
    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    return client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=running),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
    )


def run_process_lives(pid_text: str | None, flow_run_id: str) -> bool:
    """Whether this host has the flow run's process: its pid, with the flow run's id in its
    environment (a pid alone may have been given to another process since). When that
    cannot be read here (no /proc, another user's process), it counts as alive: a run is
    never marked crashed on a guess."""
    try:
        pid = int(pid_text or "")
    except ValueError:
        return True  # not a process id Prefect's process worker wrote
    if not Path("/proc/self/environ").exists():
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return f"{FLOW_RUN_ENV}={flow_run_id}".encode() in environ.split(b"\0")

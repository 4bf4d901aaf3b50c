"""The guardian's watcher: `python -m trainyard.cli.guardian PID STATE_FILE PROJECT_ROOT`.

Started by `trainyard.runtime.guardian.Guardian` for a command (or a deployment run's
process), it notes every process descended from that command while the command lives. When
its stdin closes without the word "exit" (the command died), it marks the Prefect flow runs
announced in STATE_FILE crashed through the API's REST endpoint, then stops the noted
processes, sparing the servers that outlive commands on purpose.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import urllib.request
from pathlib import Path

from trainyard.cli.prefect_server import home_of
from trainyard.project import ProjectPaths
from trainyard.runtime.guardian import EXIT_WORD, descendants, process_table, stop_all

SCAN_INTERVAL_S = 0.5


def lasting_servers(paths: ProjectPaths) -> list[Path]:
    """The state files of the servers that outlive commands on purpose: the embedded store
    and the project's Prefect server (in Prefect's home, which the user may have chosen)."""
    return [paths.s3_server / "server.json", home_of(paths) / "server.json"]


def watch(command_pid: int, state_file: Path, spare_files: list[Path]) -> int:
    """Until the command says "exit" (0 at once) or is gone: then crash its flow runs and
    stop what it started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    noted: dict[int, str] = {}
    me = os.getpid()
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], SCAN_INTERVAL_S)
        if ready:
            data = os.read(sys.stdin.fileno(), 64)
            if EXIT_WORD in data:
                return 0
            if not data:
                break  # the command is gone without saying goodbye
        table = process_table()
        noted.update(descendants(command_pid, table))
        noted.pop(me, None)
    crash_flow_runs(state_file)
    stop_all(noted, spare_files)
    state_file.unlink(missing_ok=True)
    return 0


def crash_flow_runs(state_file: Path) -> None:
    """Every flow run announced in `state_file`, marked crashed, subflows first."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return
    for flow_run_id in reversed(state["flow_run_ids"]):  # subflows first, like Prefect
        _crash(state["api_url"], flow_run_id)


def _crash(api_url: str, flow_run_id: str) -> None:
    body = {
        "state": {
            "type": "CRASHED",
            "name": "Crashed",
            "message": "the trainyard command was killed; its processes were stopped",
        },
        "force": True,
    }
    request = urllib.request.Request(
        f"{api_url.rstrip('/')}/flow_runs/{flow_run_id}/set_state",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with contextlib.suppress(OSError):  # the API is gone too: nothing left to tell
        urllib.request.urlopen(request, timeout=3).close()


if __name__ == "__main__":
    project = ProjectPaths(Path(sys.argv[3]))
    sys.exit(watch(int(sys.argv[1]), Path(sys.argv[2]), lasting_servers(project)))

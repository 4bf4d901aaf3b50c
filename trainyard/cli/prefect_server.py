"""The project's Prefect server: Prefect's own API and UI, started by the first command that
needs it and reused by later ones, until `trainyard down`.

It runs in a session of its own (a Ctrl-C to the terminal does not reach it), listens on
127.0.0.1 only, keeps its SQLite database in Prefect's home (the project's
`.trainyard/prefect` unless the user chose one), and is found again through `server.json`
there: its pid and port, trusted only while that pid is this server and `/api/health`
answers. A temporary server per command cost a short run half its wall time and took every
flow run's history with it. Importing this module imports no Prefect.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.errors import TrainyardError
from trainyard.util.daemons import free_port, port_reusable, spawn_detached
from trainyard.util.files import write_text_atomic
from trainyard.util.locks import file_lock

if TYPE_CHECKING:
    from trainyard.project import ProjectPaths

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0  # a fresh database's migrations took ~10 s on 2 idle cores
_APP = "prefect.server.api.server:create_app"
_NOT_PASSED = ("PREFECT_API_URL", "AWS_", "COMET_")


@dataclass(frozen=True)
class ServerState:
    pid: int
    port: int

    @property
    def ui_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.ui_url}/api"


class PrefectServer:
    def __init__(self, home: Path):
        self.home = Path(home).expanduser().absolute()

    @property
    def _state_file(self) -> Path:
        return self.home / "server.json"

    @property
    def log_file(self) -> Path:
        return self.home / "server.log"

    def status(self) -> ServerState | None:
        """The running server, or None."""
        state = self._recorded()
        if state and _is_server(state.pid) and healthy(state.api_url):
            return state
        return None

    def up(self) -> tuple[ServerState, bool]:
        """The running server, started now if there is none (then True); safe to race."""
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        with file_lock(self.home / "lock", waiting="waiting for the Prefect server to start"):
            state = self.status()
            if state:
                return state, False
            self._stop_recorded()  # one that stopped answering would hold the database
            return self._start(), True

    def down(self) -> bool:
        """Stop the server; True if one was running."""
        if not self.home.is_dir():
            return False
        with file_lock(self.home / "lock"):
            return self._stop_recorded()

    def _recorded(self) -> ServerState | None:
        try:
            return ServerState(**json.loads(self._state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _stop_recorded(self) -> bool:
        state = self._recorded()
        self._state_file.unlink(missing_ok=True)
        if state is None or not _is_server(state.pid):
            return False
        _terminate(state.pid)
        return True

    def _start(self) -> ServerState:
        port = self._port()
        proc = self._launch(port)
        state = ServerState(pid=proc.pid, port=port)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(state.api_url):
            if proc.poll() is not None:
                raise TrainyardError(
                    f"the project's Prefect server exited at start (code {proc.returncode}); "
                    f"see {self.log_file}"
                )
            if time.monotonic() > deadline:
                _terminate(proc.pid)
                raise TrainyardError(
                    f"the project's Prefect server did not start within "
                    f"{START_TIMEOUT_S:.0f}s; see {self.log_file}"
                )
            time.sleep(0.25)
        write_text_atomic(self._state_file, json.dumps(asdict(state)), private=True)
        write_text_atomic(self.home / "port", str(port), private=True)
        return state

    def _port(self) -> int:
        """The last start's port when it is free, so an open UI tab and an exported
        PREFECT_API_URL stay valid across `trainyard down`; otherwise any free one."""
        try:
            last = int((self.home / "port").read_text())
        except (OSError, ValueError):
            last = 0
        return last if last and port_reusable(HOST, last) else free_port(HOST)

    def _launch(self, port: int) -> subprocess.Popen:
        # Prefect's own `prefect server start --background` command line, with its settings
        # given here: this home, loopback, the UI on and talking to this port, no analytics.
        # A PREFECT_API_URL of the caller's must not reach the UI, and a server that outlives
        # the command holds none of its store or Comet credentials.
        env = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_PASSED)}
        env |= {
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_API_HOST": HOST,
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_SERVER_UI_ENABLED": "true",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT__SERVER_FINAL": "1",
        }
        command = [sys.executable, "-m", "uvicorn", "--factory", _APP, "--host", HOST]
        # Clients still connected at `down` would hold uvicorn's default shutdown for good.
        command += [
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--timeout-graceful-shutdown",
            "2",
        ]
        return spawn_detached(command, self.log_file, self.home, env)


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _is_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return _APP.encode() in cmdline and status != "Z"


def _terminate(pid: int) -> None:
    """SIGTERM (uvicorn stops Prefect's services and closes the database), SIGKILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _is_server(pid):
                _reap(pid)
                return
            time.sleep(0.1)


def _reap(pid: int) -> None:
    """Collect it if this process started it, so no zombie is left in the process table."""
    with suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def home_of(paths: ProjectPaths) -> Path:
    """Prefect's home for this project's commands: the user's PREFECT_HOME, else the project's."""
    return Path(os.environ.get("PREFECT_HOME") or paths.prefect_home).expanduser()


def start_for_project(home: Path) -> str:
    """The API URL of the Prefect server of `home`, started now (and its UI named) if none runs."""
    state, started = PrefectServer(home).up()
    if started:
        print(
            f"trainyard: started the project's Prefect server, UI at {state.ui_url} "
            "(it keeps running; `trainyard down` stops it)",
            file=sys.stderr,
            flush=True,
        )
    return state.api_url


@contextmanager
def prefect_api() -> Iterator[str]:
    """The API the flows in this block report to: the one Prefect's settings name (the
    user's, or the project's server that trainyard.cli.main set before Prefect was imported),
    else the project's server, set in Prefect's settings for the block (Prefect was
    imported earlier in this process)."""
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    url = os.environ.get("PREFECT_API_URL") or start_for_project(Path(PREFECT_HOME.value()))
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url

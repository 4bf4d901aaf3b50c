"""The project's Prefect server: the first command that needs it starts it, later commands
reuse it and its history, `trainyard down` stops it, a user's PREFECT_API_URL wins, and
`trainyard serve` reports to it and stops on one Ctrl-C.

These commands run with no PREFECT_HOME, as a user's do: the project's own server under
.trainyard/prefect, not the session's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainyard.cli.prefect_server import PrefectServer, healthy
from trainyard.runtime.guardian import descendants, process_table

from conftest import BIN, REPO, own_store_project, trainyard_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
CHEAP = ["-S", "train.epochs=1", "-S", "train.workers=1", "-S", "tracking.backend=none"]


@dataclass(frozen=True)
class Project:
    root: Path
    env: dict[str, str]

    @property
    def server(self) -> PrefectServer:
        return PrefectServer(self.root / ".trainyard" / "prefect")

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        done = trainyard_cli(*args, cwd=self.root, env=self.env | env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done


@pytest.fixture(scope="module")
def project(tmp_path_factory, s3_server) -> Iterator[Project]:
    with own_store_project(tmp_path_factory, s3_server, "prefect-server") as (root, _):
        (root / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
        made = Project(root, env)
        try:
            yield made
        finally:
            made.server.down()  # also where a test failed before its `trainyard down`


def flow_run_ids(api_url: str) -> set[str]:
    """The trainyard run ids of the flow runs the server at `api_url` holds."""
    request = urllib.request.Request(
        f"{api_url}/flow_runs/filter",
        data=json.dumps({"limit": 200}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        runs = json.load(response)
    return {run["parameters"].get("run_id") for run in runs} - {None}


def test_two_runs_report_to_one_project_server_that_keeps_their_history(project):
    first = project.cli("run", "--run-id", "first", *CHEAP)
    state = project.server.status()
    assert state is not None, "the first run should have left the project's server running"
    assert f"started the project's Prefect server, UI at {state.ui_url}" in first.stderr
    assert "temporary server" not in first.stdout + first.stderr
    environ = Path(f"/proc/{state.pid}/environ").read_bytes()  # it outlives the command:
    assert b"AWS_SECRET_ACCESS_KEY" not in environ  # it holds none of the store's secrets

    second = project.cli("run", "--run-id", "second", *CHEAP)
    assert project.server.status() == state  # the same process on the same port
    assert "started the project's Prefect server" not in second.stderr
    assert {"first", "second"} <= flow_run_ids(state.api_url)
    with urllib.request.urlopen(state.ui_url, timeout=30) as page:  # the UI is served
        assert b"<html" in page.read().lower()


def test_a_users_prefect_api_url_wins(project, tmp_path_factory, s3_server):
    """Another project, told where Prefect is, starts no server of its own."""
    state = project.server.up()[0]
    with own_store_project(tmp_path_factory, s3_server, "prefect-other") as (root, _):
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_HOME"}
        other = Project(root, env | {"PREFECT_API_URL": state.api_url})
        other.cli("run", "--run-id", "elsewhere", *CHEAP)
        assert not (root / ".trainyard" / "prefect" / "server.json").exists()
        assert other.server.status() is None
    assert "elsewhere" in flow_run_ids(state.api_url)


def test_serve_reports_to_the_project_server_and_stops_on_one_ctrl_c(project):
    state = project.server.up()[0]
    log = project.root / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [str(BIN / "trainyard"), "serve"],
            cwd=project.root,
            env=project.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
            # whose Ctrl-C is live: a test before this one may leave SIGINT ignored in this
            # process, and an ignored SIGINT is inherited (serve then never saw the Ctrl-C).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 180
        while "being served" not in log.read_text() and time.monotonic() < deadline:
            assert serve.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert f"serving 6 deployments on {state.api_url}" in log.read_text()
        family = descendants(serve.pid, process_table())
        os.killpg(serve.pid, signal.SIGINT)  # one Ctrl-C
        try:
            code = serve.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say what it was doing, not only that it hung
            pytest.fail(f"serve still running 60 s after one Ctrl-C:\n{log.read_text()[-3000:]}")
        assert code == 0, log.read_text()[-3000:]
    finally:
        if serve.poll() is None:
            serve.kill()
    output = log.read_text()
    assert "Traceback" not in output and "temporary server" not in output, output[-3000:]
    assert project.server.status() == state  # the one server, still up for the next command
    assert not set(family) & set(process_table()), "a process of serve outlived it"


def test_concurrent_first_commands_start_one_server(project):
    project.server.down()
    up = "from trainyard.cli.prefect_server import PrefectServer as S; print(S('.trainyard/prefect').up())"
    starts = [
        subprocess.Popen(
            [str(BIN / "python"), "-c", up],
            cwd=project.root,
            env=project.env,
            text=True,
            stdout=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    replies = [start.communicate(timeout=300)[0] for start in starts]
    state = project.server.status()
    assert state is not None and all(f"pid={state.pid}" in reply for reply in replies)
    assert sorted(reply.strip().endswith("True)") for reply in replies) == [False, True]


def test_a_killed_command_leaves_the_server_it_started_running(project):
    """The guardian stops what a SIGKILLed command started, except the project's servers."""
    project.server.down()
    run = subprocess.Popen(
        [str(BIN / "trainyard"), "run", "--run-id", "killed", *CHEAP],
        cwd=project.root, env=project.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while (state := project.server.status()) is None and time.monotonic() < deadline:
            assert run.poll() is None, "the run ended before starting the project's server"
            time.sleep(0.2)
        assert state is not None
        time.sleep(2)  # the guardian has noted the server among the command's children
        family = set(descendants(run.pid, process_table())) - {state.pid}
        assert family, "the run's guardian should be running"
        run.kill()
        run.wait(timeout=30)
        deadline = time.monotonic() + 60
        while family & set(process_table()) and time.monotonic() < deadline:
            time.sleep(0.2)  # the guardian stops the rest, then itself
        assert not family & set(process_table()), "the guardian left the command's processes"
    finally:
        if run.poll() is None:
            run.kill()
    assert project.server.status() == state


def test_down_stops_the_project_server(project):
    state = project.server.up()[0]
    status = project.cli("status")
    assert f"Prefect server running: UI {state.ui_url} (pid {state.pid}" in status.stdout
    assert f"  export PREFECT_API_URL={state.api_url}  # for Prefect's own CLI\n" in status.stdout
    down = project.cli("down")
    assert "Prefect server stopped" in down.stdout
    assert not healthy(state.api_url)
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", state.port)) != 0, "its port still answers"
    assert (
        not Path(f"/proc/{state.pid}").exists()
        or b"create_app" not in Path(f"/proc/{state.pid}/cmdline").read_bytes()
    )
    assert "Prefect server not running" in project.cli("status").stdout

"""Deployments on a real Prefect server: `trainyard deploy` registers prefect.yaml's
deployments, a `trainyard worker` runs them, Prefect's own CLI starts a run, and a new
dataset version from `trainyard data add` triggers a retrain."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from trainyard.registry import read_aliases

from conftest import BIN, REPO, trainyard_cli

DEPLOYMENTS = [
    "training_pipeline/manual",
    "retrain/nightly",
    "retrain/on-new-data",
    "hyperparameter_sweep/manual",
]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """A background process in its own process group, its output in `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_healthy(api_url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the Prefect server did not start:\n" + log.read_text()[-3000:])


def flow_runs(client, deployment_id) -> list[dict]:
    # Prefect 3.8.8's read_flow_runs sends `limit: null`, which its own server refuses.
    body = {"deployments": {"id": {"any_": [str(deployment_id)]}}, "limit": 20, "offset": 0}
    response = client.request("POST", "/flow_runs/filter", json=body)
    return response.json()


def wait_for_run(client, deployment_id, logs: list[Path], timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = flow_runs(client, deployment_id)
        if runs and runs[0]["state_type"] in TERMINAL:
            return runs[0]
        time.sleep(1)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    raise AssertionError(f"no finished run of {deployment_id}:\n{tails}")


def cheap_params(project: Path) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(epochs=2, workers=1)
    params["tracking"]["backend"] = "none"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
@pytest.mark.distributed
def test_deployments_run_on_a_schedule_by_hand_and_on_new_data(project, store, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    (project / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    cheap_params(project)
    api_url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
    }
    port = api_url.split(":")[-1].removesuffix("/api")
    logs = {name: tmp_path / f"{name}.log" for name in ("server", "worker")}
    started = [
        start(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", port],
            tmp_path,
            env,
            logs["server"],
        )
    ]
    begun = time.monotonic()
    try:
        wait_healthy(api_url, started[0], logs["server"])
        deployed = trainyard_cli("deploy", cwd=project, env=env)
        assert deployed.returncode == 0, deployed.stderr
        for name in DEPLOYMENTS:
            assert f"deployed {name}" in deployed.stdout

        with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as api:
            deployments = {name: api.read_deployment_by_name(name) for name in DEPLOYMENTS}
            assert {d.work_pool_name for d in deployments.values()} == {"trainyard"}
            assert api.read_work_pool("trainyard").type == "process"
            nightly = deployments["retrain/nightly"]
            assert [(s.schedule.cron, s.schedule.timezone) for s in nightly.schedules] == [
                ("0 3 * * *", "UTC")
            ]
            pull = nightly.pull_steps[0]["prefect.deployments.steps.set_working_directory"]
            assert pull == {"directory": "{{ $TRAINYARD_PROJECT_DIR }}"}  # no machine path
            assert nightly.job_variables["env"]["TRAINYARD_PROJECT_DIR"] == str(project)

            started.append(start([str(BIN / "trainyard"), "worker"], project, env, logs["worker"]))
            ran = subprocess.run(
                [str(BIN / "prefect"), "deployment", "run", "retrain/nightly", "--watch"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=400,
            )
            run = wait_for_run(api, nightly.id, list(logs.values()))
            assert run["state_type"] == "COMPLETED", ran.stdout + ran.stderr
            assert read_aliases(store, "trainyard")["challenger"] == 1

            lines = (project / "data/raw/digits.csv").read_text().splitlines(keepends=True)
            changed = tmp_path / "digits-v2.csv"
            changed.write_text("".join(lines[:-50]))
            added = trainyard_cli(
                "data", "add", str(changed), "--to", "data/raw/digits.csv", cwd=project, env=env
            )
            returned = datetime.now(UTC)
            assert added.returncode == 0, added.stderr
            assert "emitted trainyard.dataset.pushed" in added.stdout
            triggered = deployments["retrain/on-new-data"]
            run = wait_for_run(api, triggered.id, list(logs.values()))
            assert run["state_type"] == "COMPLETED", run["state"]
            latency = datetime.fromisoformat(run["start_time"]) - returned
            print(f"\nevent -> triggered run started: {latency.total_seconds():.1f} s")
            assert read_aliases(store, "trainyard")["challenger"] == 2
    finally:
        for process in reversed(started):
            stop(process)
        print(f"test wall time {time.monotonic() - begun:.0f} s")

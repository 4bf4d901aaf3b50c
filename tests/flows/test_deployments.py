"""Deployments on a real Prefect server: `trainyard deploy` registers prefect.yaml's
deployments, a `trainyard worker` runs them, Prefect's own CLI starts a run, a new dataset
version from `trainyard data add` triggers a retrain, and a cancelled or killed run leaves
no process behind.

One server, one deployed project and one worker serve the whole module."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainyard.checkpoint.layout import committed_checkpoints
from trainyard.registry import read_aliases
from trainyard.runs.record import find_record, load_record
from trainyard.runtime.forked import worker_rank
from trainyard.storage import Store
from trainyard.util.daemons import free_port

from conftest import BIN, REPO, own_store_project, trainyard_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parents[1])
DEPLOYMENTS = [
    "training_pipeline/manual",
    "retrain/nightly",
    "retrain/on-new-data",
    "hyperparameter_sweep/manual",
    "batch_inference/manual",
]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


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
    raise AssertionError(f"no finished run of {deployment_id}:\n{tails(logs)}")


def tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)


def cheap_params(project: Path) -> None:
    """Cheap settings; the model a test slows down through a run's overrides of its options
    (its code can only be chosen here, in params.yaml: trainyard.config.callers)."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(epochs=2, workers=1)
    params["model"] = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.0}}
    params["tracking"]["backend"] = "none"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@dataclass(frozen=True)
class Deployed:
    project: Path
    store: Store
    env: dict[str, str]
    api_url: str
    deploy_output: str
    logs: list[Path]


def prefect_env(tmp: Path, api_url: str) -> dict[str, str]:
    """The server's, the worker's and the CLI's environment. Module fixtures run before the
    autouse isolation fixture, so what it would remove or set is done here."""
    env = {**os.environ, "HOME": str(tmp / "home"), "DVC_NO_ANALYTICS": "1"}
    for name in ("COMET_API_KEY", "PREFECT_PROFILE"):
        env.pop(name, None)
    return env | {
        "PREFECT_HOME": str(tmp / "prefect"),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        # The scheduler's default loop is a minute; a schedule test should not wait for it.
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PYTHONPATH": TESTS,  # runs' workers import tests_support models
    }


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, s3_server) -> Iterator[Deployed]:
    """A Prefect server, prefect.yaml's deployments registered from a project with cheap
    settings, and a `trainyard worker` polling their pool."""
    tmp = tmp_path_factory.mktemp("deployments")
    with own_store_project(tmp_path_factory, s3_server, "deployments") as (project, settings):
        (project / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
        cheap_params(project)
        port = free_port("127.0.0.1")
        api_url = f"http://127.0.0.1:{port}/api"
        env = prefect_env(tmp, api_url)
        logs = [tmp / "server.log", tmp / "worker.log"]
        server_cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
        started = [start([*server_cmd, "--port", str(port)], tmp, env, logs[0])]
        begun = time.monotonic()
        try:
            wait_healthy(api_url, started[0], logs[0])
            deploy = trainyard_cli("deploy", cwd=project, env=env)
            assert deploy.returncode == 0, deploy.stderr
            started.append(start([str(BIN / "trainyard"), "worker"], project, env, logs[1]))
            yield Deployed(project, Store(settings), env, api_url, deploy.stdout, logs)
        finally:
            for process in reversed(started):
                stop(process)
            print(f"\ndeployments module wall time {time.monotonic() - begun:.0f} s")


def test_deployments_run_on_a_schedule_by_hand_and_on_new_data(deployed, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    project, store, env, logs = deployed.project, deployed.store, deployed.env, deployed.logs
    for name in DEPLOYMENTS:
        assert f"deployed {name}" in deployed.deploy_output
    # What starts runs by itself, said as it is deployed.
    assert (
        "deployed retrain/nightly (runs by itself: cron 0 3 * * * UTC)\n" in deployed.deploy_output
    )
    assert "retrain/on-new-data (runs by itself: on the event trainyard.dataset.pushed)\n" in (
        deployed.deploy_output
    )
    assert "deployed training_pipeline/manual\n" in deployed.deploy_output
    with (
        temporary_settings({PREFECT_API_URL: deployed.api_url}),
        get_client(sync_client=True) as api,
    ):
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

        ran = subprocess.run(
            [str(BIN / "prefect"), "deployment", "run", "retrain/nightly", "--watch"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        run = wait_for_run(api, nightly.id, logs)
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
        assert "next: git add data/raw/digits.csv.dvc data/raw/.gitignore" in added.stdout
        triggered = deployments["retrain/on-new-data"]
        run = wait_for_run(api, triggered.id, logs)
        assert run["state_type"] == "COMPLETED", run["state"]
        latency = datetime.fromisoformat(run["start_time"]) - returned
        print(f"\nevent -> triggered run started: {latency.total_seconds():.1f} s")
        assert read_aliases(store, "trainyard")["challenger"] == 2


def scheduled_runs(client, deployment_id) -> list[dict]:
    """A deployment's runs still waiting for their time, soonest first."""
    body = {
        "deployments": {"id": {"any_": [str(deployment_id)]}},
        "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
        "sort": "EXPECTED_START_TIME_ASC",
        "limit": 20,
        "offset": 0,
    }
    return client.request("POST", "/flow_runs/filter", json=body).json()


def test_a_schedule_fires_and_its_run_completes(deployed, api):
    """What a scheduled retraining needs from the server: its scheduler creates the runs
    (under SQLAlchemy 2.1 Prefect 3.8.8's scheduler created none, logging an error every
    minute), and the worker runs them. The nightly cron shows its next run, and a copy of the
    pipeline's deployment on an interval schedule that begins in 20 s runs to completion."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    nightly = api.read_deployment_by_name("retrain/nightly")
    wait_until(lambda: scheduled_runs(api, nightly.id), 60, lambda: tails(deployed.logs[:1]))
    upcoming = scheduled_runs(api, nightly.id)[0]
    assert upcoming["state_type"] == "SCHEDULED", upcoming
    assert datetime.fromisoformat(upcoming["expected_start_time"]).astimezone(UTC).hour == 3

    manual = api.read_deployment_by_name("training_pipeline/manual")
    # Times before the scheduler's pass are never scheduled: the first one is a little ahead.
    first = datetime.now(UTC) + timedelta(seconds=20)
    schedule = IntervalSchedule(interval=timedelta(days=1), anchor_date=first)
    interval_id = api.create_deployment(
        flow_id=manual.flow_id,
        name="every-day-from-now",
        entrypoint=manual.entrypoint,
        work_pool_name=manual.work_pool_name,
        pull_steps=manual.pull_steps,
        job_variables=manual.job_variables,
        schedules=[DeploymentScheduleCreate(schedule=schedule, active=True)],
    )

    # The scheduler also creates the next days' runs: the one that ran is the one that ended.
    def ended() -> list[dict]:
        return [r for r in flow_runs(api, interval_id) if r["state_type"] in TERMINAL]

    wait_until(ended, 300, lambda: tails(deployed.logs))
    [run] = ended()
    assert run["auto_scheduled"] and run["state_type"] == "COMPLETED", run["state"]
    assert len(scheduled_runs(api, interval_id)) >= 1  # tomorrow's is waiting


def prefect_cli(deployed: Deployed, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "prefect"), *args],
        cwd=deployed.project,
        env=deployed.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_prefects_own_cli_lists_and_inspects_against_the_server(deployed):
    listed = prefect_cli(deployed, "deployment", "ls")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "retrain/nightly" in listed.stdout.replace(" ", "")
    inspected = prefect_cli(deployed, "deployment", "inspect", "retrain/nightly")
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    assert "0 3 * * *" in inspected.stdout
    runs = prefect_cli(deployed, "flow-run", "ls")
    assert runs.returncode == 0, runs.stdout + runs.stderr


def run_processes(flow_run_id: str, run_id: str, project: Path) -> dict[int, str]:
    """pid -> command line of every live process of a deployment run, "rank N worker: "
    before a worker's (forked by torchrun's agent, it has the agent's command line, and
    its rank for a name: trainyard.runtime.forked). The flow-run process and all it starts
    inherit Prefect's flow-run id in their environment; torchrun and its workers also name
    the run and the project on their command line, should anything scrub the environment."""
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    names = f"--run-id\0{run_id}\0--project-dir\0{project}\0".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if not zombie and (marker in environ or names in cmdline):
            line = cmdline.replace(b"\0", b" ").decode(errors="replace")
            rank = worker_rank(int(entry.name))
            found[int(entry.name)] = line if rank is None else f"rank {rank} worker: {line}"
    return found


def wait_until(condition: Callable[[], object], timeout_s: float, explain: Callable[[], str]):
    """Poll `condition` (a few times a second: some conditions ask the server or the store)
    until it holds; `explain` says what was missing when it never does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, explain()
        time.sleep(0.2)


@dataclass
class LongRun:
    """A training_pipeline/manual run of 2 workers that would train for minutes (a slow
    model, many epochs), its settings passed as the deployment run's `overrides`."""

    api: Any  # Prefect's client
    deployed: Deployed
    run_id: str
    flow_run_id: str = ""

    def start(self) -> LongRun:
        overrides = ["model.options={seconds: 0.03}", "train.workers=2", "train.epochs=200"]
        deployment = self.api.read_deployment_by_name("training_pipeline/manual")
        parameters = {"overrides": overrides, "run_id": self.run_id}
        flow_run = self.api.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        self.flow_run_id = str(flow_run.id)
        return self

    def state(self) -> str:
        return self.api.request("GET", f"/flow_runs/{self.flow_run_id}").json()["state_type"]

    def subflow_states(self) -> list[str]:
        """The states of its subflow runs (train_and_evaluate)."""
        children = {"parent_flow_run_id": {"any_": [self.flow_run_id]}}
        body = {"flow_runs": children, "limit": 20, "offset": 0}
        runs = self.api.request("POST", "/flow_runs/filter", json=body).json()
        return [run["state_type"] for run in runs]

    def explain(self) -> str:
        return f"flow run {self.state()}\n{tails(self.deployed.logs)}"

    def processes(self) -> dict[int, str]:
        return run_processes(self.flow_run_id, self.run_id, self.deployed.project)

    def torchrun_jobs(self) -> list[str]:
        """Its torchrun agent and workers."""
        return [c for c in self.processes().values() if "-m trainyard.runtime.launch" in c]

    def wait_for_training(self) -> dict[int, str]:
        """Until a checkpoint is committed; then the run's processes, checked to be what the
        test means them to be (a scan that finds nothing would prove nothing)."""

        def training() -> bool:
            committed = committed_checkpoints(self.deployed.store, self.run_id)
            return bool(committed) or self.state() in TERMINAL

        wait_until(training, 300, self.explain)
        assert self.state() == "RUNNING", self.explain()
        found = self.processes()
        commands = list(found.values())
        assert sum("-m prefect.engine" in c for c in commands) == 1, found  # the flow run
        assert sum("-m trainyard.cli.guardian" in c for c in commands) == 1, found  # its guardian
        torchrun = f"{sys.executable} -m trainyard.runtime.launch "
        assert sum(c.startswith(torchrun) for c in commands) == 1, found  # its agent
        workers = [c for c in commands if re.match(f"rank [01] worker: {re.escape(torchrun)}", c)]
        assert len(workers) == 2, found
        return found

    def wait_until_gone(self, cancelled_at: float) -> tuple[float, float, str]:
        """Seconds until torchrun and its workers were gone, until the flow run ended (its
        final state) and until no process of the run was left (Prefect's own included)."""

        def alive() -> str:
            return f"still alive: {self.processes()}\n{self.explain()}"

        wait_until(lambda: not self.torchrun_jobs(), 60, alive)
        jobs_gone = time.monotonic() - cancelled_at
        wait_until(lambda: self.state() in TERMINAL, 120, self.explain)
        final = self.state()
        wait_until(lambda: not self.processes(), 60, alive)
        return jobs_gone, time.monotonic() - cancelled_at, final


@pytest.fixture
def api(deployed):
    """A Prefect client of the module's server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: deployed.api_url}),
        get_client(sync_client=True) as client,
    ):
        yield client


def test_cancelling_a_deployment_run_leaves_no_process_behind(deployed, api):
    store = deployed.store
    run = LongRun(api, deployed, "cancelled").start()
    run.wait_for_training()
    cancelled_at = time.monotonic()
    # What the UI's and the CLI's cancel do: ask for CANCELLING; the worker does the rest.
    body = {"state": {"type": "CANCELLING", "name": "Cancelling"}}
    response = api.request("POST", f"/flow_runs/{run.flow_run_id}/set_state", json=body)
    assert response.json()["status"] == "ACCEPT", response.text
    jobs_gone, all_gone, final = run.wait_until_gone(cancelled_at)
    print(f"\ncancel -> torchrun and workers gone {jobs_gone:.1f} s, no process {all_gone:.1f} s")
    assert final == "CANCELLED" and run.subflow_states() == ["CANCELLED"]
    record = load_record(store, "cancelled")
    assert record.status == "interrupted" and record.error is None, record.status
    assert record.final_checkpoint == committed_checkpoints(store, "cancelled")[-1]


def test_a_killed_deployment_run_is_crashed_and_leaves_no_process_behind(deployed, api):
    """SIGKILL to the flow-run process (the OOM killer, Prefect's own SIGKILL once its grace
    period is over): none of its clean-up runs, yet nothing may live on and the run may not
    look running for good."""
    run = LongRun(api, deployed, "killed").start()
    [engine] = [p for p, c in run.wait_for_training().items() if "-m prefect.engine" in c]
    killed_at = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    jobs_gone, all_gone, final = run.wait_until_gone(killed_at)
    print(f"\nkill -> torchrun and workers gone {jobs_gone:.1f} s, no process {all_gone:.1f} s")
    # Prefect's worker marks the flow run it started; the guardian marks the subflow.
    assert final == "CRASHED" and run.subflow_states() == ["CRASHED"]
    shown = trainyard_cli(
        "runs", "show", "killed", "--json", cwd=deployed.project, env=deployed.env
    )
    assert json.loads(shown.stdout)["status"] == "crashed", shown.stdout + shown.stderr


def test_a_deployment_run_cannot_point_a_flow_outside_the_project(deployed, api, tmp_path):
    """What anyone who can create a flow run may ask for, through the API: batch_inference
    writing its output outside the project fails with one line saying why, and nothing is
    written (a flow's folder is where it runs: no parameter names another, see below)."""
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"not predictions")
    deployment = api.read_deployment_by_name("batch_inference/manual")
    parameters = {"model": "trainyard", "input": "data/raw/digits.csv", "output": str(victim)}
    run_id = str(api.create_flow_run_from_deployment(deployment.id, parameters=parameters).id)
    state = wait_for_state(api, run_id, deployed.logs)
    assert state["type"] == "FAILED", state
    assert "is outside the project" in state["message"], state
    assert victim.read_bytes() == b"not predictions"


def wait_for_state(api, flow_run_id: str, logs: list[Path]) -> dict:
    """A flow run's final state."""

    def state() -> dict:
        return api.request("GET", f"/flow_runs/{flow_run_id}").json()["state"]

    wait_until(lambda: state()["type"] in TERMINAL, 300, lambda: tails(logs))
    return state()


def run_by_prefects_cli(deployed: Deployed, name: str, *parameters: str) -> str:
    """`prefect deployment run NAME -p KEY=VALUE ...`: the flow run's id."""
    args = [arg for parameter in parameters for arg in ("-p", parameter)]
    ran = prefect_cli(deployed, "deployment", "run", name, *args)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    found = re.search(r"UUID: ([0-9a-f-]{36})", ran.stdout)
    assert found, ran.stdout
    return found.group(1)


def test_a_deployment_runs_overrides_from_prefects_cli_tune_it_and_are_checked(deployed, api):
    """`prefect deployment run ... -p overrides=[...]` trains with those settings (the
    record's params show them). A bad override and one naming code each fail their flow run
    in one line, before any work: no run record, nothing trained. The parameters a flow no
    longer takes (`config`, `project_dir`) are refused by Prefect's CLI, and a run created
    with them through the API fails."""
    pipeline = "training_pipeline/manual"
    tuned = run_by_prefects_cli(
        deployed, pipeline, 'overrides=["train.epochs=1", "train.lr=0.05"]', "run_id=overridden"
    )
    refused = {
        "train.epochs": 'overrides=["train.epochs=many"]',
        "model.name chooses code to import": 'overrides=["model.name=tests_support:mlp"]',
    }
    runs = {
        expected: run_by_prefects_cli(deployed, pipeline, parameter, f"run_id=refused-{i}")
        for i, (expected, parameter) in enumerate(refused.items())
    }
    deployment = api.read_deployment_by_name(pipeline)
    unknown = {}
    for name in ["config", "project_dir"]:
        ran = prefect_cli(deployed, "deployment", "run", pipeline, "-p", f"{name}=/")
        assert ran.returncode != 0, ran.stdout + ran.stderr
        assert "not found on the deployment" in ran.stdout and f"'{name}'" in ran.stdout
        parameters = {name: {"train": {"epochs": 1}}, "run_id": f"unknown-{name}"}
        created = api.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        unknown[name] = str(created.id)
    state = wait_for_state(api, tuned, deployed.logs)
    assert state["type"] == "COMPLETED", state
    record = load_record(deployed.store, "overridden")
    assert (record.params["train"]["epochs"], record.params["train"]["lr"]) == (1, 0.05)
    assert len(record.history) == 1
    for i, (expected, flow_run_id) in enumerate(runs.items()):
        state = wait_for_state(api, flow_run_id, deployed.logs)
        message = state["message"]
        assert state["type"] == "FAILED" and expected in message, state
        assert len(message.splitlines()) == 1, message
        assert find_record(deployed.store, f"refused-{i}") is None
    for name, flow_run_id in unknown.items():
        # A parameter the flow does not take: Prefect's engine ends the run before the flow
        # begins (its process exits; the worker reports the run crashed), the worker's log
        # says which parameter.
        state = wait_for_state(api, flow_run_id, deployed.logs)
        assert state["type"] in {"FAILED", "CRASHED"}, state
        assert find_record(deployed.store, f"unknown-{name}") is None
        mismatches = [
            line
            for line in deployed.logs[1].read_text().splitlines()
            if line.startswith("prefect.exceptions.SignatureMismatchError")
        ]
        assert any(f"'{name}'" in line for line in mismatches), mismatches

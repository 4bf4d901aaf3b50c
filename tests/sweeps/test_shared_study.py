"""Sweeps across machines: sweep processes share one study in a real PostgreSQL server (a
throwaway one, tests/postgres.py), the budget is exact across them, a host that dies has its
trial retried on the other from its last checkpoint, and a storage URL that cannot be
reached is one line without the password. Real Optuna, real CLI, real store.

The machines are network namespaces (tests/hosts.py): PostgreSQL, the store and Prefect's
server on host A's address, host B with its own copy of the project at the same path."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
from hosts import Host, hosts
from postgres import Postgres, free_port, postgres_server
from test_sweep import SMALL, TESTS, sweep_id_of
from test_sweep_storage import one_line

from trainyard.checkpoint.layout import committed_checkpoints, step_of
from trainyard.config import load_config
from trainyard.data.bundled import BUNDLED
from trainyard.runs.record import find_record, load_record
from trainyard.storage import Store, StoreSettings
from trainyard.storage.store import ENDPOINT_ENV
from trainyard.sweeps.heartbeats import tries_before
from trainyard.sweeps.study import SweepStudy, create_study

from conftest import BIN, make_project, trainyard_cli
from tests_support import HOLD_ENV

N_TRIALS = 4


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def _ask_in_rounds(url: str, password: str, params: str, barrier, asked) -> None:
    """One process's share of the race below: round by round, the budget one more each
    time, 8 threads asking at once (as trial slots do) as soon as every process is ready."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    os.environ["PGPASSWORD"] = password
    config = load_config(Path(params))
    study = SweepStudy(url, "trainyard-race", config.sweep, config.train.epochs)
    got: list[Any] = []  # each ask's trial, or None past the budget
    with ThreadPoolExecutor(8) as pool:
        for budget in range(1, N_TRIALS + 1):
            barrier.wait(timeout=120)
            got += pool.map(lambda i, b=budget: study.ask(config.sweep.space, f"r{i}", b), range(8))
    asked.put([p.number for p in got if p is not None])


def test_processes_asking_at_once_create_exactly_the_budget(project, postgres, monkeypatch):
    """Each round, every process sees the study one trial short of the budget at the same
    moment: without one lock over the count and the new trial, several create it (measured
    here: 6 trials for a budget of 4, twice out of twice)."""
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    create_study(postgres.url(), "trainyard-race", "maximize", {})
    spawn = multiprocessing.get_context("spawn")
    barrier, asked = spawn.Barrier(3), spawn.Queue()
    args = (postgres.url(), postgres.password, str(project / "params.yaml"), barrier, asked)
    processes = [spawn.Process(target=_ask_in_rounds, args=args) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:  # what each puts in the queue is a few bytes: never blocks
        process.join(timeout=300)
        assert process.exitcode == 0
    numbers = sorted(n for _ in processes for n in asked.get(timeout=10))
    assert numbers == list(range(N_TRIALS))  # 96 asks in all, each trial created once
    study = optuna.load_study(study_name="trainyard-race", storage=postgres.url())
    assert len(study.trials) == N_TRIALS


def test_a_storage_that_cannot_be_reached_is_one_line_without_the_password(
    project, postgres, monkeypatch
):
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    for url, reason in (
        (postgres.url("no_such_db"), 'database "no_such_db" does not exist'),
        (f"postgresql://sweeper@127.0.0.1:{free_port('127.0.0.1')}/sweeps", "Connection refused"),
    ):
        done = trainyard_cli("sweep", "run", "-S", f"sweep.storage={url}", cwd=project)
        line = one_line(done)
        assert "cannot be reached" in line and reason in line, line
        assert postgres.password not in done.stdout + done.stderr
    monkeypatch.setenv("PGPASSWORD", "wrong")
    line = one_line(trainyard_cli("sweep", "run", "-S", f"sweep.storage={postgres.url()}",
                                  cwd=project))  # fmt: skip
    assert "password authentication failed" in line and "PGPASSWORD" in line, line


# What the hosts' commands must not inherit from this process: its store and Prefect.
NOT_PASSED = (ENDPOINT_ENV, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "PREFECT_API_URL",
              "PREFECT_PROFILE", "COMET_API_KEY")  # fmt: skip
PREFECT_PORT = 4200  # on host A, whose ports are all its own


@dataclass
class TwoHosts:
    """Host A (PostgreSQL, the store, Prefect's server) and host B, each with the project."""

    a: Host
    b: Host
    project: Path
    env: dict[str, str]
    postgres: Postgres
    store: Store
    tmp: Path

    def hold(self, host: Host) -> Path:
        """While this file exists, the host's trials wait after `after_steps` steps."""
        return self.tmp / f"hold-{host.name}"

    def sweep(self, host: Host, log: Path, *args: str) -> subprocess.Popen:
        """`trainyard sweep run ARGS` on the host, its output in `log`."""
        env = {**self.env, HOLD_ENV: str(self.hold(host))}
        with log.open("w") as out:
            return host.popen([str(BIN / "trainyard"), "sweep", "run", *args], cwd=self.project,
                              env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip

    def study(self, sweep_id: str) -> optuna.Study:
        return optuna.load_study(study_name=f"trainyard-{sweep_id}", storage=self.postgres.url())


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> Iterator[TwoHosts]:
    tmp = tmp_path_factory.mktemp("two-hosts")
    project = make_project(tmp / "project")
    data = load_config(project / "params.yaml").data.path
    BUNDLED[data](project / data)  # before host B's copy is made: both version the same data
    env = {k: v for k, v in os.environ.items() if k not in NOT_PASSED} | {
        "HOME": str(tmp / "home"), "PREFECT_HOME": str(tmp / "prefect"),
        "PREFECT_API_URL": "", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": TESTS,  # trials import tests_support:held_mlp
    }  # fmt: skip
    trainyard = str(BIN / "trainyard")
    with hosts(2, own_copy=project, shared=()) as net, pytest.MonkeyPatch.context() as mp:
        a, b = net
        env["PREFECT_API_URL"] = api = f"http://{a.address}:{PREFECT_PORT}/api"
        with (tmp / "prefect.log").open("wb") as log:  # starts while the rest is set up
            a.popen([str(BIN / "prefect"), "server", "start", "--host", a.address, "--port",
                     str(PREFECT_PORT)], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        with postgres_server(a.address, on=a.argv) as postgres:
            mp.setenv("PGPASSWORD", postgres.password)
            up = a.run([trainyard, "storage", "up", "--host", a.address], cwd=project, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
            assert up.returncode == 0, up.stdout + up.stderr
            try:
                exported = a.run([trainyard, "storage", "env"], cwd=project, env=env,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
                exports = dict(re.findall(r"^export (\w+)='?([^'\s]+)'?$", exported.stdout, re.M))
                env |= exports | {"PGPASSWORD": postgres.password}
                store = Store(StoreSettings("trainyard", "", exports[ENDPOINT_ENV],
                                            exports["AWS_ACCESS_KEY_ID"],
                                            exports["AWS_SECRET_ACCESS_KEY"]))  # fmt: skip
                _until(lambda: _healthy(api), 300, f"Prefect's server; see {tmp / 'prefect.log'}")
                yield TwoHosts(a, b, project, env, postgres, store, tmp)
            finally:
                a.run([trainyard, "storage", "down"], cwd=project, env=env, timeout=120)


def _healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _settings(site: TwoHosts, n_trials: int) -> list[str]:
    """Trials of 2 epochs of 10 steps (digits, batch 128); held after 15 steps while their
    host's hold file exists: after the first epoch's checkpoint, whatever the speed."""
    return [
        *SMALL,
        "-S", f"sweep.storage={site.postgres.url()}",
        "-S", f"sweep.n_trials={n_trials}",
        "-S", "sweep.max_concurrent_trials=1",
        "-S", "sweep.pruner=none",
        "-S", "sweep.heartbeat_s=3",
        "-S", "train.epochs=2",
        "-S", "train.batch_size=128",
        "-S", "tracking.backend=none",
        "-S", "model.name=tests_support:held_mlp",
        "-S", "model.options={after_steps: 15}",
        "-S", 'sweep.space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": true}}',
    ]  # fmt: skip


def _trial_started(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    """The first trial the sweep process started: its number and run id."""
    found: list[tuple[str, str]] = []

    def started() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        found[:] = re.findall(r"trial (\d+) \(run (\S+?)\)", log.read_text())
        return bool(found)

    _until(started, 300, f"a trial in {log.name}")
    return int(found[0][0]), found[0][1]


def _trials_logged(log: str) -> set[int]:
    return {int(n) for n in re.findall(r"trial (\d+) \(run", log)}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_sweep_processes_on_two_hosts_share_one_postgresql_study_and_end_with_n_trials(
    two_hosts,
):
    site, n_trials = two_hosts, 3
    logs = [site.tmp / "share-a.log", site.tmp / "share-b.log"]
    site.hold(site.a).touch()  # A's first trial waits until B has one: both take trials
    a = site.sweep(site.a, logs[0], *_settings(site, n_trials))
    _trial_started(a, logs[0])
    sweep_id = sweep_id_of(logs[0].read_text())
    b = site.sweep(site.b, logs[1], "--sweep-id", sweep_id, "-S", "sweep.max_concurrent_trials=1")
    _trial_started(b, logs[1])
    site.hold(site.a).unlink()  # the last trial goes to whichever asks first
    for proc, log in zip((a, b), logs, strict=True):
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]

    study = site.study(sweep_id)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * n_trials, study.trials
    ran = [_trials_logged(log.read_text()) for log in logs]
    assert ran[0] and ran[1] and not ran[0] & ran[1], ran  # both took trials, none twice
    assert ran[0] | ran[1] == set(range(n_trials))
    run_ids = [t.user_attrs["run_id"] for t in study.trials]
    assert len(set(run_ids)) == n_trials
    for trial in study.trials:  # each trial's run record, once, with its trial's number
        record = find_record(site.store, trial.user_attrs["run_id"])
        assert record is not None and record.status == "completed"
        assert record.sweep is not None and record.sweep.trial == trial.number
    shown = site.a.run([str(BIN / "trainyard"), "sweep", "show", sweep_id, "--json",
                        "-S", f"sweep.storage={site.postgres.url()}"],
                       cwd=site.project, env=site.env, capture_output=True, text=True)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["storage"] == site.postgres.url()
    assert sorted((t["number"], t["run_id"]) for t in summary["trials"]) == [
        (t.number, t.user_attrs["run_id"]) for t in study.trials
    ]
    written = [log.read_text() for log in logs] + [shown.stdout, shown.stderr, json.dumps(
        [find_record(site.store, r).model_dump(mode="json") for r in run_ids])]  # fmt: skip
    assert not any(site.postgres.password in text for text in written)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dead_hosts_trial_is_retried_on_the_other_from_its_last_checkpoint(two_hosts):
    """B dies mid-trial: its heartbeat stops, A fails the trial (Optuna's fail_stale_trials)
    and runs its retry (RetryHeartbeatStaleTrialCallback) from B's last checkpoint, in its
    place in the budget."""
    site = two_hosts
    logs = [site.tmp / "kill-a.log", site.tmp / "kill-b.log"]
    for host in (site.a, site.b):
        site.hold(host).touch()
    a = site.sweep(site.a, logs[0], *_settings(site, 2))
    _trial_started(a, logs[0])
    sweep_id = sweep_id_of(logs[0].read_text())
    b = site.sweep(site.b, logs[1], "--sweep-id", sweep_id, "-S", "sweep.max_concurrent_trials=1")
    number, run_b = _trial_started(b, logs[1])
    _until(lambda: committed_checkpoints(site.store, run_b), 300, "B's trial's first checkpoint")
    site.hold(site.a).unlink()  # A finishes its trial, has none to start, and watches B's
    _until(lambda: "no new trial" in logs[0].read_text(), 300, "A's trials to end")
    killed_at = datetime.datetime.now()  # Optuna's clock: naive local time
    site.b.kill_all()  # B is held mid-trial: it dies with its trial running
    assert a.wait(timeout=600) == 0, logs[0].read_text()[-3000:]

    trials = site.study(sweep_id).trials
    assert (number, [t.state.name for t in trials]) == (1, ["COMPLETE", "FAIL", "COMPLETE"])
    retry = trials[2]
    assert tries_before(retry) == [1] and trials[1].user_attrs["run_id"] == run_b
    assert retry.params == trials[1].params and retry.datetime_start is not None
    record = load_record(site.store, retry.user_attrs["run_id"])
    assert record.status == "completed" and record.sweep and record.sweep.trial == 2
    assert record.resume_from == run_b and not record.warm_start
    assert record.resume_checkpoint and f"/runs/{run_b}/" in record.resume_checkpoint
    assert (step_of(record.resume_checkpoint) or 0) > 0  # it went on, it did not start over
    print(f"\nkill -> retry started: {(retry.datetime_start - killed_at).total_seconds():.1f} s")

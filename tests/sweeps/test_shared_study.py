"""Sweeps across machines: sweep processes share one study in a real PostgreSQL server (a
throwaway one, tests/postgres.py), the budget is exact across them, and a storage URL that
cannot be reached is one line without the password. Real Optuna, real CLI, real store.

The two sweep processes run on this host and reach the server over TCP (127.0.0.1), as
processes on two machines would reach it over the network."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from postgres import Postgres, free_port, postgres_server
from test_sweep import SMALL, TESTS, sweep_id_of
from test_sweep_storage import one_line

from trainyard.config import load_config
from trainyard.runs.record import find_record
from trainyard.sweeps.study import SweepStudy, create_study

from conftest import BIN, trainyard_cli
from training_jobs import wait_for

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


@pytest.mark.slow
@pytest.mark.distributed
def test_two_sweep_processes_share_one_postgresql_study_and_end_with_exactly_n_trials(
    project, store, postgres, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    storage = f"sweep.storage={postgres.url()}"
    settings = [
        *SMALL,
        "-S", storage,
        "-S", f"sweep.n_trials={N_TRIALS}",
        "-S", "sweep.max_concurrent_trials=1",
        "-S", "sweep.pruner=none",
        "-S", "train.epochs=1",
        "-S", "tracking.backend=none",
        # Trials of several seconds whatever the machine's speed (each step sleeps 100 ms):
        # the first process, one trial at a time, is on its first or second when the second
        # joins (about 10 s after trial 0 here), which asks at once, so both take trials.
        "-S", "model.name=tests_support:slow_mlp",
        "-S", "model.options={seconds: 0.1}",
        "-S", 'sweep.space={"train.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": true}}',
    ]  # fmt: skip
    logs = [project / f"sweep{i}.log" for i in range(2)]
    handles = [log.open("w") for log in logs]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(
            [str(BIN / "trainyard"), "sweep", "run", *settings],
            cwd=project, stdout=handles[0], stderr=subprocess.STDOUT,
        ))  # fmt: skip
        wait_for(
            lambda: "trial 0 (run" in logs[0].read_text() or procs[0].poll() is not None,
            300,
            "trial 0",
        )
        sweep_id = sweep_id_of(logs[0].read_text())
        procs.append(subprocess.Popen(  # another machine, in real life
            [str(BIN / "trainyard"), "sweep", "run", "--sweep-id", sweep_id,
             "-S", "sweep.max_concurrent_trials=1"],
            cwd=project, stdout=handles[1], stderr=subprocess.STDOUT,
        ))  # fmt: skip
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for handle in handles:
            handle.close()

    study = optuna.load_study(study_name=f"trainyard-{sweep_id}", storage=postgres.url())
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * N_TRIALS, study.trials
    ran = [{int(n) for n in _trials_logged(log.read_text())} for log in logs]
    assert ran[0] and ran[1] and not ran[0] & ran[1], ran  # both took trials, none twice
    assert ran[0] | ran[1] == set(range(N_TRIALS))
    run_ids = [t.user_attrs["run_id"] for t in study.trials]
    assert len(set(run_ids)) == N_TRIALS
    for trial in study.trials:  # each trial's run record, once, with its trial's number
        record = find_record(store, trial.user_attrs["run_id"])
        assert record is not None and record.status == "completed"
        assert record.sweep is not None and record.sweep.trial == trial.number

    shown = trainyard_cli("sweep", "show", sweep_id, "--json", "-S", storage, cwd=project)
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["storage"] == postgres.url()
    assert sorted((t["number"], t["run_id"]) for t in summary["trials"]) == [
        (t.number, t.user_attrs["run_id"]) for t in study.trials
    ]
    written = [log.read_text() for log in logs] + [shown.stdout, shown.stderr, json.dumps(
        [find_record(store, r).model_dump(mode="json") for r in run_ids])]  # fmt: skip
    assert not any(postgres.password in text for text in written)


def _trials_logged(log: str) -> list[str]:
    import re

    return re.findall(r"trial (\d+) \(run", log)

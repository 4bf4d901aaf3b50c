"""Workers that hang, and flow runs that are terminated, never leave the run stuck or orphans."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from trainyard.errors import WorkerFailed
from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import BIN
from training_jobs import (
    params,
    prepare_project,
    run_processes,
    save_run,
    train,
    wait_for,
    worker_pids,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parents[1])


def test_a_worker_without_progress_fails_the_run_instead_of_hanging(
    tmp_path, monkeypatch, store_settings
):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:hanging_mlp
    store = Store(store_settings)
    paths = prepare_project(tmp_path / "project", store_settings)
    run_params = params(
        model={"name": "tests_support:hanging_mlp", "options": {}},
        train={"hang_timeout_s": 6, "timeout_s": 300},
    )
    record = save_run(store, "hangs", run_params)
    job, thread = train(paths, store, record, max_restarts=0)
    thread.join(timeout=300)
    assert isinstance(job.error, WorkerFailed)
    message = str(job.error)
    assert "exceeded train.timeout_s" not in message  # the watchdog, not the job timeout
    assert "made no training progress for" in message and "train.hang_timeout_s=6" in message
    assert "rank      :" in message and "time.sleep(3600)" in message  # where it hung


def _prefect_servers_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[3]) == parent and b"prefect.server.api.server:create_app" in cmdline:
            found.append(int(entry.name))
    return found


def test_terminating_the_flow_run_leaves_no_torchrun_or_worker_process(
    project, use_store, monkeypatch
):
    """Prefect cancels a flow run by sending its process SIGTERM (then SIGKILL after a grace
    period); the flow engine turns it into an exception, and the launcher kills the whole
    torchrun process group before the run is marked failed."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    log = open(project / "run.log", "w")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [
            str(BIN / "trainyard"),
            "run",
            "--run-id",
            "cancelled",
            "-S",
            "model.name=tests_support:slow_mlp",
            "-S",
            "model.options={}",
            "-S",
            "train.epochs=200",
            "-S",
            "tracking.backend=none",
        ],
        cwd=project,
        env=dict(os.environ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: len(worker_pids("cancelled")) == 2 or proc.poll() is not None,
            timeout_s=300,
            what="two training workers",
        )
        assert proc.poll() is None, (project / "run.log").read_text()[-3000:]
        assert len(list(run_processes("cancelled"))) == 3  # the torchrun agent and two workers
        # It reports to the session's Prefect server, which outlives it: none of its own.
        assert _prefect_servers_of(proc.pid) == []
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert list(run_processes("cancelled")) == [], "a torchrun process outlived its flow run"
    assert proc.returncode == 128 + signal.SIGTERM
    record = load_record(Store(use_store), "cancelled")
    assert record.status == "interrupted" and record.error is None

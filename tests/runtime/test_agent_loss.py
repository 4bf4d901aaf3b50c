"""A lost node: `kill -9` of a real `trainyard run`'s torchrun agent.

What a node loss looks like to that node is its torchrun agent dying without a word. The
launcher kills the agent's orphaned workers, launches torchrun again, and the new workers
resume from the last committed checkpoint. Relaunches count against train.max_restarts with
torchrun's restarts of its workers (tests/checkpoint/test_resume.py kills a worker), and the record
says which restart was which and how many steps each redid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from trainyard.checkpoint.layout import committed_checkpoints, step_of
from trainyard.errors import WorkerFailed
from trainyard.project import ProjectPaths
from trainyard.runs.record import load_record
from trainyard.runtime.guardian import descendants, process_table
from trainyard.runtime.progress import last_step
from trainyard.storage import Store

from conftest import BIN
from training_jobs import (
    module_store,
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
EVERY = 10  # checkpoint.every_n_steps
SLOW = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.04}}


def _start_run(project: Path, run_id: str, *settings: str) -> subprocess.Popen:
    overrides = [
        "model.name=tests_support:slow_mlp",
        "model.options={seconds: 0.04}",  # 8 epochs of 20 steps: seconds left after the kill
        "train.epochs=8",
        f"checkpoint.every_n_steps={EVERY}",
        "tracking.backend=none",
        *settings,
    ]
    return subprocess.Popen(
        [str(BIN / "trainyard"), "run", "--run-id", run_id]
        + [arg for setting in overrides for arg in ("-S", setting)],
        cwd=project,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _agents(command: subprocess.Popen) -> list[int]:
    """The live torchrun agents (`python -m trainyard.runtime.launch`) the command started;
    not their workers, which they fork (the same command line)."""
    table = process_table()
    launched = set()
    for pid in descendants(command.pid, table):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainyard.runtime.launch" in cmdline:
            launched.add(pid)
    return [pid for pid in launched if table[pid][0] not in launched]


def _commit_after(store: Store, run_id: str, step: int, command: subprocess.Popen) -> int:
    """Wait for a committed checkpoint past `step`; return the latest committed step."""

    def latest() -> int:
        steps = (step_of(uri) for uri in committed_checkpoints(store, run_id))
        return max((s for s in steps if s is not None), default=-1)  # each names its step

    wait_for(
        lambda: latest() > step or command.poll() is not None,
        timeout_s=300,
        what=f"a checkpoint of {run_id} past step {step}",
    )
    assert command.poll() is None, command.communicate()[1][-3000:]
    return latest()


def test_a_killed_agent_is_launched_again_and_its_run_resumes_from_the_last_commit(
    project, use_store, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store, staging = Store(use_store), ProjectPaths(project).staging / "lost"
    proc = _start_run(project, "lost")
    try:
        committed = _commit_after(store, "lost", 0, proc)
        [agent] = _agents(proc)
        os.kill(agent, signal.SIGKILL)  # what a node loss looks like to that node
        killed_at, reached = time.time(), last_step(staging)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert (
        "trainyard: torchrun's agent was killed by SIGKILL; launching it again to resume from "
        "the last committed checkpoint (restart 1 of 3)"
    ) in stdout + stderr
    record = load_record(store, "lost")
    assert record.status == "completed" and record.restarts == 1
    [event] = record.resumes
    assert event["after"] == "agent lost" and event["attempt"] == 1
    # The latest commit there was when the agent died (or one that landed between the
    # test's look and the kill); the steps past it, and only those, were redone.
    assert event["from_step"] >= committed and event["last_step_before"] >= reached
    assert event["checkpoint"].endswith(f"step-{event['from_step']:08d}")
    assert event["steps_redone"] == event["last_step_before"] - event["from_step"] >= 0
    assert record.steps_redone == event["steps_redone"]
    shown = subprocess.run(
        [str(BIN / "trainyard"), "runs", "show", "lost"],
        cwd=project,
        capture_output=True,
        text=True,
    ).stdout
    assert f"restarts    1: 1 agent lost ({record.steps_redone} steps redone)" in shown
    assert f"resumed     at step {event['from_step']} (agent lost)" in shown
    # The launch that resumed counted its own syncs: the line says since when.
    [sync] = [line for line in shown.splitlines() if line.startswith("sync ")]
    assert sync.endswith(f" (since the last resume, at step {event['from_step']})"), sync
    print(
        f"agent kill -> training again {event['resumed_at'] - killed_at:.1f}s, steps redone "
        f"{event['steps_redone']} at {EVERY}-step checkpoints"
    )


def test_an_agent_lost_with_no_restarts_left_fails_in_one_line_and_leaves_no_worker(
    tmp_path, s3_server, monkeypatch
):
    """torchrun launched as the flow launches it (no Prefect around it), train.max_restarts 0."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store = module_store(s3_server, "agent-loss")
    paths = prepare_project(tmp_path / "project", store.settings)
    record = save_run(store, "no-restarts", params(model=SLOW))
    job, thread = train(paths, store, record, max_restarts=0)
    wait_for(lambda: committed_checkpoints(store, "no-restarts"), what="a committed checkpoint")
    [agent] = [pid for pid, rank in run_processes("no-restarts").items() if rank is None]
    assert len(worker_pids("no-restarts")) == 2
    os.kill(agent, signal.SIGKILL)
    thread.join(timeout=120)
    assert isinstance(job.error, WorkerFailed)
    assert job.error.line() == (
        "torchrun's agent was killed by SIGKILL with all train.max_restarts=0 restarts used"
    )
    # Its workers were killed before it said so: none can commit a checkpoint of the run now.
    assert run_processes("no-restarts") == {}

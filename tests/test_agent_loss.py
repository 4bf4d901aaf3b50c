"""A lost node: `kill -9` of a real `trainyard run`'s torchrun agent, then of a worker.

What a node loss looks like to that node is its torchrun agent dying without a word. The
launcher kills the agent's orphaned workers, launches torchrun again, and the new workers
resume from the last committed checkpoint; a killed worker is torchrun's own restart. Both
count against train.max_restarts, and the record says which restart was which and how many
steps each redid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from trainyard.checkpoint import committed_checkpoints, step_of
from trainyard.guardian import descendants, process_table
from trainyard.progress import last_step
from trainyard.project import ProjectPaths
from trainyard.runs import load_record
from trainyard.storage import Store

from conftest import BIN
from training_jobs import wait_for, worker_pids

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parent)
EVERY = 10  # checkpoint.every_n_steps


def _start_run(project: Path, run_id: str, *settings: str) -> subprocess.Popen:
    overrides = [
        "model.name=tests_support:slow_mlp",
        "model.options={seconds: 0.04}",  # ~20 epochs of 20 steps: seconds left after each kill
        "train.epochs=20",
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
    """The live torchrun agents (`python -m trainyard.launch`) the command started."""
    found = []
    for pid in descendants(command.pid, process_table()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainyard.launch" in cmdline:
            found.append(pid)
    return found


def _commit_after(store: Store, run_id: str, step: int, command: subprocess.Popen) -> int:
    """Wait for a committed checkpoint past `step`; return the latest committed step."""

    def latest() -> int:
        return max((step_of(uri) for uri in committed_checkpoints(store, run_id)), default=-1)

    wait_for(
        lambda: latest() > step or command.poll() is not None,
        timeout_s=300,
        what=f"a checkpoint of {run_id} past step {step}",
    )
    assert command.poll() is None, command.communicate()[1][-3000:]
    return latest()


def test_a_killed_agent_is_launched_again_and_a_killed_worker_restarted_both_counted(
    project, use_store, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store, staging = Store(use_store), ProjectPaths(project).staging / "lost"
    proc = _start_run(project, "lost", "train.max_restarts=2")
    try:
        committed = _commit_after(store, "lost", 0, proc)
        [agent] = _agents(proc)
        os.kill(agent, signal.SIGKILL)  # what a node loss looks like to that node
        killed_at = time.time()
        # The relaunched job's own commit, then one of its workers dies: torchrun's restart.
        second = _commit_after(store, "lost", last_step(staging) or committed, proc)
        assert _agents(proc) and agent not in _agents(proc)
        os.kill(worker_pids("lost")[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "was killed by SIGKILL; launching it again" in stdout + stderr
    record = load_record(store, "lost")
    assert record.status == "completed" and record.restarts == 2
    agent_lost, worker_failed = record.resumes
    assert (agent_lost["after"], worker_failed["after"]) == ("agent lost", "worker failed")
    assert [agent_lost["attempt"], worker_failed["attempt"]] == [1, 2]
    # Each resumed from the latest commit there was when it was lost (or a later one, that
    # landed between the test's look and the kill), and redid only the steps past it.
    assert agent_lost["from_step"] >= committed and worker_failed["from_step"] >= second
    for event in record.resumes:
        assert event["checkpoint"].endswith(f"step-{event['from_step']:08d}")
        assert event["steps_redone"] == event["last_step_before"] - event["from_step"] >= 0
    assert record.steps_redone == agent_lost["steps_redone"] + worker_failed["steps_redone"]
    shown = subprocess.run(
        [str(BIN / "trainyard"), "runs", "show", "lost"],
        cwd=project,
        capture_output=True,
        text=True,
    ).stdout
    assert f"restarts    2: 1 agent lost, 1 worker failed ({record.steps_redone} steps" in shown
    print(
        f"agent kill -> training again {agent_lost['resumed_at'] - killed_at:.1f}s, "
        f"steps redone {agent_lost['steps_redone']} (agent) {worker_failed['steps_redone']} "
        f"(worker) at {EVERY}-step checkpoints"
    )

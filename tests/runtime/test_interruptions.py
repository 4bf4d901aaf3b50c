"""Interrupting a real `trainyard run`: Ctrl-C to its process group, `kill -9` of the command.

Nothing it started may outlive it (the temporary Prefect API, torchrun, the workers, the
guardian), its record must say where it stopped, and one owner at a time may continue it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from trainyard.checkpoint.layout import committed_checkpoints, step_of
from trainyard.project import ProjectPaths
from trainyard.runs.contracts import training_key
from trainyard.runs.record import load_record
from trainyard.runtime.guardian import descendants, process_table
from trainyard.runtime.progress import last_step
from trainyard.storage import Store

from conftest import BIN, trainyard_cli
from tests_support import HOLD_ENV
from training_jobs import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parents[1])
INTERRUPTED = re.compile(
    r"trainyard: interrupted; run (\S+) stopped at step (\d+), last committed checkpoint "
    r"step (\d+); continue with: trainyard run --run-id (\S+)"
)


def _start_run(
    project: Path,
    run_id: str,
    epochs: int,
    step_s: float,
    every_n_steps: int | None = 10,
    *settings: str,
) -> subprocess.Popen:
    """`trainyard run` in a process group of its own, as a terminal would start it
    (`every_n_steps` None: the default checkpoint cadence; `settings`: more -S ones)."""
    cadence = ["-S", f"checkpoint.every_n_steps={every_n_steps}"] if every_n_steps else []
    return subprocess.Popen(
        [
            str(BIN / "trainyard"),
            "run",
            "--run-id",
            run_id,
            "-S",
            "model.name=tests_support:slow_mlp",
            "-S",
            f"model.options={{seconds: {step_s}}}",
            "-S",
            f"train.epochs={epochs}",
            *cadence,
            "-S",
            "tracking.backend=none",
            *settings,
        ],
        cwd=project,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _family(pid: int) -> dict[int, str]:
    """Every process descended from `pid` now: (pid -> start time)."""
    return descendants(pid, process_table())


def _survivors(family: dict[int, str]) -> list[int]:
    table = process_table()
    return [pid for pid, started in family.items() if table.get(pid, (0, ""))[1] == started]


def _wait_for_commit(store: Store, run_id: str, proc: subprocess.Popen) -> None:
    wait_for(
        lambda: committed_checkpoints(store, run_id) or proc.poll() is not None,
        timeout_s=300,
        what=f"a committed checkpoint of {run_id}",
    )
    assert proc.poll() is None, proc.communicate()[1][-3000:]


def _step(uri: str) -> int:
    return int(uri.rstrip("/").rsplit("step-", 1)[1])


def _flow_run_states(run_id: str) -> set[str]:
    """The states Prefect's database holds for the flow runs of `run_id` (the pipeline and
    its train_and_evaluate subflow)."""
    database = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT parameters, state_type FROM flow_run").fetchall()
    states = [state for params, state in rows if json.loads(params).get("run_id") == run_id]
    assert len(states) == 2, f"flow runs of {run_id}: {states}"
    return set(states)


def test_ctrl_c_to_the_process_group_stops_everything_and_says_where_the_run_stopped(
    project, use_store, monkeypatch
):
    """Without checkpoint.on_interrupt: the workers stop at once, the run keeps the last
    checkpoint its cadence committed."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store = Store(use_store)
    proc = _start_run(project, "ctrl-c", 200, 0.02, 10, "-S", "checkpoint.on_interrupt=false")
    try:
        _wait_for_commit(store, "ctrl-c", proc)
        family = _family(proc.pid)
        assert len(family) >= 4  # guardian, Prefect's API, torchrun and its workers
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    last_line = stderr.strip().splitlines()[-1]
    match = INTERRUPTED.fullmatch(last_line)
    assert match, last_line
    assert "Traceback" not in stdout + stderr
    wait_for(lambda: not _survivors(family), timeout_s=10, what="every process to end")
    record = load_record(store, "ctrl-c")
    committed = committed_checkpoints(store, "ctrl-c")
    assert record.status == "interrupted" and record.final_checkpoint == committed[-1]
    stopped_at, last_commit = int(match[2]), int(match[3])
    assert last_commit == _step(committed[-1]) and stopped_at >= last_commit
    assert record.last_step == stopped_at and record.checkpoints == committed


def test_a_killed_command_leaves_nothing_and_its_run_is_taken_over_then_extended(
    project, use_store, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    # Held after its step-10 commit until the second command has been refused: a run that
    # finished first (a loaded machine's slow start-up) was refused as completed instead.
    hold = project.parent / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    store = Store(use_store)
    held = ["-S", "model.name=tests_support:held_mlp", "-S", "model.options={after_steps: 15}"]
    proc = _start_run(project, "owned", 10, 0.0, 10, *held)
    try:
        _wait_for_commit(store, "owned", proc)
        refused = trainyard_cli("run", "--run-id", "owned", cwd=project)
        family = _family(proc.pid)
        proc.kill()  # kill -9: no clean-up of its own can run
        proc.communicate(timeout=30)
    finally:
        hold.unlink()  # the run's continuation below trains freely
        if proc.poll() is None:
            proc.kill()
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert f"run owned is in use by pid {proc.pid} on " in refused.stderr
    wait_for(lambda: not _survivors(family), timeout_s=10, what="every orphan to end")

    shown = json.loads(trainyard_cli("runs", "show", "owned", "--json", cwd=project).stdout)
    assert shown["status"] == "crashed" and shown["last_heartbeat"]
    assert _flow_run_states("owned") == {"CRASHED"}
    created = shown["created_at"]
    last_commit = committed_checkpoints(store, "owned")[-1]
    text = trainyard_cli("runs", "show", "owned", cwd=project).stdout
    assert f"checkpoint  {last_commit} (latest commit so far)\n" in text, text

    resumed = trainyard_cli("run", "--run-id", "owned", cwd=project)  # the stored settings
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = load_record(store, "owned")
    assert record.status == "completed" and record.created_at == created
    assert record.resume_checkpoint == last_commit
    [takeover] = [e for e in record.resumes if e.get("kind") == "continue"]
    assert takeover["took_over"]["pid"] == proc.pid and takeover["previous_status"] == "crashed"
    assert record.checkpoints == committed_checkpoints(store, "owned")  # exactly these

    changed = trainyard_cli("run", "--run-id", "owned", "-S", "train.lr=0.5", cwd=project)
    assert changed.returncode == 2 and "train.lr cannot change on a resume" in changed.stderr
    again = trainyard_cli("run", "--run-id", "owned", cwd=project)
    assert again.returncode == 2 and "already completed (10 epochs)" in again.stderr

    _extend_by_one_epoch(project, store, created)


def _extend_by_one_epoch(project: Path, store: Store, created: str) -> None:
    """A completed 10-epoch run given 11: one more epoch, at the tail of its cosine."""
    extended = trainyard_cli("run", "--run-id", "owned", "-S", "train.epochs=11", cwd=project)
    assert extended.returncode == 0, extended.stderr[-3000:]
    record = load_record(store, "owned")
    assert record.status == "completed" and len(record.history) == 11
    assert record.params["train"]["epochs"] == 11 and record.created_at == created
    continuations = [e for e in record.resumes if e.get("kind") == "continue"]
    assert continuations[-1]["changes"] == {"train.epochs": [10, 11]}
    # Epoch 10 of 11 is the cosine's tail: 2% of the peak lr, which the log says, and how
    # to train on at a useful rate.
    said = re.search(
        r"resuming at step (\d+) of (\d+): lr \S+ there, ([\d.]+)% of its peak",
        extended.stdout + extended.stderr,
    )
    assert said, extended.stdout[-3000:]
    assert int(said[1]) * 11 == int(said[2]) * 10 and 1.5 < float(said[3]) < 2.5
    assert (
        "`trainyard run --resume-from RUN_ID --warm-start` trains on"
        in extended.stdout + extended.stderr
    )


JIT_INTERRUPTED = re.compile(
    r"trainyard: interrupted; run (\S+) stopped at step (\d+) and committed checkpoint step "
    r"(\d+) \(([\d.]+) s\); continue with: trainyard run --run-id (\S+)"
)


def _interrupt_at_default_cadence(
    project: Path, run_id: str, sig: int, to_group: bool
) -> tuple[subprocess.Popen, str, int]:
    """A run of 400 steps at the default checkpoint cadence, signalled once rank 0 is past
    step 300 (as its progress file says); returns the ended process, its stderr and the
    step seen then."""
    default_cadence = ("-S", "checkpoint.max_overhead=0.01")  # the tests' projects have null
    proc = _start_run(project, run_id, 20, 0.01, None, *default_cadence)
    progress = ProjectPaths(project).staging / run_id
    try:
        wait_for(
            lambda: (last_step(progress) or 0) >= 300 or proc.poll() is not None,
            timeout_s=300,
            what=f"step 300 of {run_id}",
        )
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        seen = last_step(progress) or 0
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, stderr, seen


def test_ctrl_c_commits_where_the_run_stops_and_the_resume_redoes_at_most_one_step(
    project, use_store, monkeypatch
):
    """checkpoint.on_interrupt (the default), at the default cadence: the workers finish
    their step, all stop at the same one and commit a checkpoint there; the interrupt line
    names it, and continuing the run starts from it."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store = Store(use_store)
    proc, stderr, seen = _interrupt_at_default_cadence(project, "jit", signal.SIGINT, True)
    assert proc.returncode == 130, stderr[-3000:]
    stopped_at, committed_at = _committed_where_it_stopped(store, "jit", stderr, seen)

    resumed = trainyard_cli("run", "--run-id", "jit", cwd=project)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = load_record(store, "jit")
    assert record.status == "completed" and step_of(record.resume_checkpoint) == committed_at
    [resume] = [e for e in record.resumes if e.get("kind") != "continue"]
    assert resume["last_step_before"] == stopped_at and resume["steps_redone"] <= 1
    assert record.steps_redone <= 1
    console = resumed.stdout + resumed.stderr  # its last epochs, at the default cadence
    # The cadence weighs a checkpoint's upload against the epochs' time: a loaded machine's
    # slow epochs may checkpoint every one. The console says so exactly when it skipped.
    cadence = re.search(r"checkpointed \d+ of \d+ epochs, about one every", console)
    if store.read_json(training_key("jit"))["skipped_checkpoint_epochs"]:
        assert cadence, console[-3000:]
        assert "an interrupt still commits a checkpoint where it stops" in console
    else:
        assert cadence is None, console[-3000:]


def test_sigterm_to_the_command_commits_where_the_run_stops(project, use_store, monkeypatch):
    """A cloud preemption or a cancelled flow run: SIGTERM to the command alone."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    store = Store(use_store)
    proc, stderr, seen = _interrupt_at_default_cadence(project, "term", signal.SIGTERM, False)
    assert proc.returncode == 143, stderr[-3000:]
    _committed_where_it_stopped(store, "term", stderr, seen)


def _committed_where_it_stopped(
    store: Store, run_id: str, stderr: str, seen: int
) -> tuple[int, int]:
    """(the step the run stopped at, the step of the checkpoint it committed there), from
    its last line, checked against its record and the store."""
    last_line = stderr.strip().splitlines()[-1]
    match = JIT_INTERRUPTED.fullmatch(last_line)
    assert match, last_line
    stopped_at, committed_at = int(match[2]), int(match[3])
    assert seen <= stopped_at and stopped_at - committed_at <= 1
    record = load_record(store, run_id)
    assert record.status == "interrupted" and record.last_step == stopped_at
    assert record.final_checkpoint == committed_checkpoints(store, run_id)[-1]
    assert step_of(record.final_checkpoint) == committed_at
    return stopped_at, committed_at

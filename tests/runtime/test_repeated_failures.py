"""A failure that repeats is not retried blindly, and a failed run's record reads as one line."""

from __future__ import annotations

import pickle
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainyard.checkpoint.layout import committed_checkpoints
from trainyard.errors import StoreError
from trainyard.runs.record import load_record
from trainyard.runtime.failures import FailureRecorder, fingerprint, repeated_line
from trainyard.runtime.job_output import worker_failed
from trainyard.storage import Store

from conftest import trainyard_cli

TESTS = str(Path(__file__).parents[1])


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_the_same_error_with_other_numbers_has_one_fingerprint_and_a_lost_peer_none():
    first = fingerprint(_raised(RuntimeError("shape [0, 64] on pid 101")))
    second = fingerprint(_raised(RuntimeError("shape [0, 64] on pid 202")))
    assert first is not None and first == second
    assert fingerprint(_raised(ValueError("shape [0, 64] on pid 101"))) != first
    assert fingerprint(_raised(ConnectionResetError("peer went away"))) is None
    assert fingerprint(_raised(StoreError("store unreachable"))) is None
    assert fingerprint(_raised(RuntimeError("Connection closed by peer [127.0.0.1]:1"))) is None
    try:
        try:
            raise TimeoutError("store read timed out")
        except TimeoutError as exc:
            raise RuntimeError("step failed") from exc
    except RuntimeError as caught:
        assert fingerprint(caught) is None  # caused by a transient one


def _torchrun_output(failures: dict[int, ProcessFailure], *before: str) -> list[str]:
    """A failed torchrun's last lines: what the agent printed, then torch's own summary."""
    summary = str(ChildFailedError("trainyard.engine.worker", failures))
    return [*before, *f"ChildFailedError: {summary}".splitlines()]


def test_a_worker_failure_reads_as_its_rank_and_error_with_its_traceback(tmp_path, monkeypatch):
    error_file = tmp_path / "attempt_2" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("cannot reshape tensor\nof 0 elements")
    except RuntimeError as exc:
        FailureRecorder().record_exception(exc)
    failed = ProcessFailure(1, 1001, 1, str(error_file))
    said = repeated_line(1, 1, "RuntimeError: cannot reshape tensor")
    failure = worker_failed(1, _torchrun_output({1: failed}, said))
    assert failure.line() == "rank 1: RuntimeError: cannot reshape tensor"
    assert failure.traceback.startswith("Traceback (most recent call last):")
    assert failure.restarts == 2 and failure.repeated == said.removeprefix("trainyard: ")
    assert "rank      : 1 (local_rank: 1)" in str(failure)  # the message as before
    copied = pickle.loads(pickle.dumps(failure))
    assert vars(copied) == vars(failure)  # Prefect may copy an exception between runs

    killed = ProcessFailure(0, 1000, -signal.SIGKILL, str(tmp_path / "none.json"))
    failure = worker_failed(-9, _torchrun_output({0: killed}))
    assert failure.line() == "rank 0: Signal 9 (SIGKILL) received by PID 1000"
    assert failure.restarts is None and failure.repeated is None


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failure_that_repeats_stops_after_one_restart_and_reads_as_one_line(
    project, use_store, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:fails_at_step
    done = trainyard_cli(
        "run", "--run-id", "repeats",
        "-S", "model.name=tests_support:fails_at_step", "-S", "model.options={step: 5}",
        "-S", "checkpoint.every_n_steps=2", "-S", "tracking.backend=none",
        cwd=project,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    # The last line of trainyard's own (Prefect may log its temporary server's stop after it).
    last = [line for line in done.stderr.splitlines() if line.startswith("trainyard:")][-1]
    assert last.startswith(
        "trainyard: run repeats failed: rank 1 failed twice with the same error: "
        "RuntimeError: cannot reshape tensor of 0 elements"
    ), last
    assert last.endswith("; not restarting (traceback: .trainyard/logs/repeats/error-rank1.txt)")
    assert output.count("with the same error: RuntimeError") == 2  # torchrun's agent, the CLI
    assert output.count("[rank 0/2] trainyard.worker: job 1: train run repeats") == 2

    record = load_record(Store(use_store), "repeats")
    assert record.status == "failed" and record.restarts == 1
    assert record.error.startswith("rank 1: RuntimeError: cannot reshape tensor of 0 elements")
    assert "\n" not in record.error
    trace = (project / record.error_file).read_text()
    assert trace.startswith("Traceback (most recent call last):")
    assert "tests_support.py" in trace and trace.rstrip().endswith(record.error[len("rank 1: ") :])
    # Rank 0 had done 4 steps when rank 1 failed in its 5th; the restart resumed from the
    # last checkpoint committed by then (every 2 steps) and redid the steps past it.
    [resume] = record.resumes
    committed = {
        int(uri.rstrip("/").rsplit("step-", 1)[1])
        for uri in committed_checkpoints(Store(use_store), "repeats")
    }
    assert resume["last_step_before"] == 4 and resume["from_step"] in committed & {2, 4}
    assert record.steps_redone == 4 - resume["from_step"]

    shown = trainyard_cli("runs", "show", "repeats", cwd=project).stdout.splitlines()
    assert f"error       {record.error}" in shown
    assert "traceback   .trainyard/logs/repeats/error-rank1.txt" in shown
    assert f"restarts    1: 1 worker failed ({record.steps_redone} steps redone)" in shown
    # Its training never reported its workers: the line says what was asked, not `- on -`.
    asked = "workers     - (asked for 2 per node on 1 node(s); none reported: training did not end)"
    assert asked in shown

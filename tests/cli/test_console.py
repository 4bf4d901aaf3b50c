"""What a piped `trainyard run` prints (real CLI, 2 workers): rank 0's lines once with one
timestamp each, the other ranks' in their log files, any rank's warnings, no Comet chatter
(a key set and its server unreachable: one line per rank, at once), and `completed in` as
the command's wall time with its parts. test_terminal runs with `--all-ranks`: every
rank's lines, each with its rank."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest

from conftest import own_store_project, trainyard_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STAMP = re.compile(r"\d\d:\d\d:\d\d\.\d{3}")
COMPLETED = re.compile(
    r"completed in (?P<total>[\d.]+)s \(start-up (?P<start_up>[\d.]+)s, data (?P<data>[\d.]+)s, "
    r"training (?P<training>[\d.]+)s, evaluation (?P<evaluation>[\d.]+)s, "
    r"shutdown (?P<shutdown>[\d.]+)s\)"
)
TINY = ["-S", "train.epochs=2", "-S", "model.options={hidden_sizes: [16]}"]


@pytest.fixture(scope="module")
def piped(tmp_path_factory, s3_server, prefect_api):
    """A run with a Comet key whose server cannot be reached (nothing listens on port 9),
    against the session's Prefect server (as with a user's PREFECT_API_URL), timed from
    outside."""
    from prefect.settings import PREFECT_API_URL

    with own_store_project(tmp_path_factory, s3_server, "console") as (root, _):
        env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())
        env["COMET_API_KEY"] = "dummy-key-for-the-fallback"
        env["COMET_URL_OVERRIDE"] = "http://127.0.0.1:9/clientlib/"
        started = time.monotonic()
        done = trainyard_cli("run", "--run-id", "ranks", *TINY, cwd=root, env=env)
        wall = time.monotonic() - started
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        yield {"root": root, "output": done.stdout + done.stderr, "wall": wall}


def test_the_console_shows_rank_0s_lines_once_with_one_timestamp(piped):
    output = piped["output"]
    epochs = re.findall(r"\] trainyard\.engine\.training: epoch (\d)/2 ", output)
    assert epochs == ["1", "2"], output[-3000:]
    assert "[rank 0/2] trainyard.engine.training: epoch 1/2" in output
    for line in output.splitlines():
        assert len(STAMP.findall(line)) <= 1, line
    others = [line for line in output.splitlines() if "[rank 1/2]" in line]
    assert others and all("| WARNING |" in line for line in others), others


def test_the_other_ranks_lines_are_in_the_log_file_named_at_the_start(piped):
    assert ".trainyard/logs/ranks/rank-N.log" in piped["output"]
    rank_1 = (piped["root"] / ".trainyard/logs/ranks/rank-1.log").read_text()
    assert re.search(r"\[rank 1/2\] INFO trainyard\.engine\.training: epoch 2/2 ", rank_1), rank_1
    assert "[rank 0/2]" not in rank_1
    rank_0 = (piped["root"] / ".trainyard/logs/ranks/rank-0.log").read_text()
    assert "[rank 0/2] INFO trainyard.engine.training: epoch 2/2 " in rank_0


def test_any_ranks_warning_is_shown_and_comets_chatter_is_not(piped):
    """The fallback is one warning per rank, decided before Comet is asked: asked, it
    retried for about 30 s and printed some 15 warnings and errors of its own."""
    output = piped["output"]
    fallback = re.findall(
        r"\[rank (\d)/2\] trainyard\.engine\.tracking: Comet server unreachable", output
    )
    assert sorted(fallback) == ["0", "1"], output[-3000:]
    assert "COMET " not in output and "urllib3" not in output and "comet upload" not in output
    assert "upload later with `trainyard tracking upload ranks`" in output


def test_completed_in_is_the_commands_wall_time_and_where_it_went(piped):
    summary = COMPLETED.search(piped["output"])
    assert summary, piped["output"][-2000:]
    total = float(summary["total"])
    # Measured from the process's start to the summary: only the exit after it is missing.
    assert piped["wall"] - 3.0 <= total <= piped["wall"] + 0.1, (total, piped["wall"])
    parts = [float(summary[name]) for name in ("start_up", "data", "training", "evaluation")]
    assert abs(sum(parts) + float(summary["shutdown"]) - total) <= 0.3  # each rounded to 0.1
    assert parts[0] > 0 and parts[2] > 0


def _fed(lines: list[str], all_ranks: bool, log_file: Path | None = None) -> list[tuple[int, str]]:
    """(level, text) of each line WorkerLines showed when fed `lines`."""
    from trainyard.runtime.worker_lines import WorkerLines

    shown: list[tuple[int, str]] = []
    feed = WorkerLines(lambda *line: shown.append(line), all_ranks=all_ranks, log_file=log_file)
    for line in lines:
        feed(line)
    return shown


def test_another_ranks_traceback_stays_in_its_file_unless_all_ranks_are_asked_for():
    lines = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "worker.py", line 9, in main',
        "[rank0]: Traceback (most recent call last):",
        "W1126 13:45:01.123000 2563 torch/distributed/run.py:719] a warning",
        "[W1128 04:33:29.988174618 socket.cpp:207] [c10d] a warning from C++",
        "[W1129 04:11:27.380000000 socket.cpp:207] [c10d] The hostname of the client socket "
        "cannot be retrieved. err=-3",
        "torchrun's own line",
    ]
    shown = _fed(lines, all_ranks=False)
    assert [text for _, text in shown] == [
        "[rank0]: Traceback (most recent call last):",
        "torch/distributed/run.py:719: a warning",
        "socket.cpp:207: [c10d] a warning from C++",
        "socket.cpp:207: [c10d] The hostname of the client socket cannot be retrieved. err=-3",
        "torchrun's own line",
    ]
    # The last warning says nothing is wrong (a host without a DNS name): DEBUG.
    levels = [level for level, _ in shown][1:4]
    assert levels == [logging.WARNING, logging.WARNING, logging.DEBUG]
    assert len(_fed(lines, all_ranks=True)) == len(lines)


def test_with_a_log_file_torchruns_own_stacks_are_one_line_each_and_all_in_the_file(
    tmp_path, monkeypatch
):
    """A lost node 0, as node 1's agent printed it: a c10d warning with its C++ frames, then a
    chained Python traceback. The console keeps the warning and each exception's line."""
    lines = [
        "[W1128 15:27:43.491000000 TCPStore.cpp:115] [c10d] recvVector failed",
        "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)",
        "<omitting python frames>",
        "",
        "Traceback (most recent call last):",
        '  File "c10d_rendezvous_backend.py", line 114, in _call_store',
        "    return getattr(self._store, store_op)(*args, **kwargs)",
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        "[rank0]: a worker's own line, landed mid-stack",
        '  File "dynamic_rendezvous.py", line 1170, in next_rendezvous',
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: store failed.",
        "13:37:26.985 [rank 0/2] INFO trainyard.engine.training: epoch 1/2",
    ]
    monkeypatch.chdir(tmp_path)
    log_file = tmp_path / "logs" / "node-1.log"
    shown = _fed(lines, all_ranks=False, log_file=log_file)
    where = "(its traceback: logs/node-1.log)"
    assert shown == [
        (logging.WARNING, "TCPStore.cpp:115: [c10d] recvVector failed"),
        (
            logging.ERROR,
            f"torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. {where}",
        ),
        (logging.INFO, "[rank0]: a worker's own line, landed mid-stack"),
        (
            logging.ERROR,
            "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: store failed. "
            + where,
        ),
        (logging.INFO, "[rank 0/2] trainyard.engine.training: epoch 1/2"),
    ]
    assert log_file.read_text().splitlines() == lines
    assert log_file.stat().st_mode & 0o777 == 0o600
    assert len(_fed(lines, all_ranks=True, log_file=log_file)) == len(lines)


def test_with_a_log_file_rank_0s_traceback_is_its_exception_line_and_all_in_the_file(
    tmp_path, monkeypatch
):
    """Node 0's rank 0 as it printed a peer's host lost mid-backward (chained, as a failure
    inside a failure's handler is): each exception's line shown once, a warning (torchrun
    restarts the worker), the stack only in the node's log file."""
    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:17048."
    lines = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "trainyard/engine/training.py", line 351, in _forward_backward',
        "[rank0]:     loss_sum.backward(torch.full_like(loss_sum, scale))",
        "[rank0]:     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        f"[rank0]: {closed}",
        "[rank0]: ",
        "[rank0]: During handling of the above exception, another exception occurred:",
        "[rank0]: ",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "trainyard/engine/worker.py", line 80, in main',
        "[rank0]: SystemExit: 1",
        "[rank0]:/torch/utils/data.py:9: UserWarning: a warning printed, not logged",
        "13:37:26.985 [rank 0/2] INFO trainyard.engine.training: epoch 1/2",
    ]
    monkeypatch.chdir(tmp_path)
    log_file = tmp_path / "logs" / "node-0.log"
    shown = _fed(lines, all_ranks=False, log_file=log_file)
    where = "(its traceback: logs/node-0.log)"
    assert shown == [
        (logging.WARNING, f"[rank0]: {closed} {where}"),
        (logging.WARNING, f"[rank0]: SystemExit: 1 {where}"),
        (
            logging.INFO,
            "[rank0]:/torch/utils/data.py:9: UserWarning: a warning printed, not logged",
        ),
        (logging.INFO, "[rank 0/2] trainyard.engine.training: epoch 1/2"),
    ]
    assert log_file.read_text().splitlines() == lines


def test_with_a_log_file_a_failed_jobs_summary_box_is_its_exception_line(tmp_path, monkeypatch):
    """torchrun's ChildFailedError, as its agent prints it: the exception line, then a box of
    the failed ranks between two rules of "=". The console keeps one line; the file, all."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failed = ProcessFailure(1, 1001, 1, str(tmp_path / "error.json"))
    summary = ChildFailedError("trainyard.engine.worker", {1: failed})
    box = f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {summary}"
    lines = [
        "Traceback (most recent call last):",
        '  File "torch/distributed/launcher/api.py", line 383, in launch_agent',
        "    raise ChildFailedError(",
        *box.splitlines(),
        "13:37:27.001 [rank 0/2] INFO trainyard.engine.training: a line after it",
    ]
    assert len(lines) > 15 and "exitcode  : 1 (pid: 1001)" in "\n".join(lines)
    monkeypatch.chdir(tmp_path)
    log_file = tmp_path / "node-0.log"
    shown = [text for _, text in _fed(lines, all_ranks=False, log_file=log_file)]
    assert shown == [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError "
        "(its summary and traceback: node-0.log)",
        "[rank 0/2] trainyard.engine.training: a line after it",
    ]
    assert log_file.read_text().splitlines() == lines

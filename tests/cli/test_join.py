"""`trainyard join` without its node 0: before it started, and when node 0 is lost mid-run.

Node 0 serves the rendezvous store. Without it, node 1's torchrun waited out its own timeouts
(300 s), printed its agent's stack (~150 lines of C++ frames and Python traceback a try) and
the command ended in a Python traceback of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from trainyard.runtime.network import endpoint_host_port, unanswered

from conftest import BIN, trainyard_cli
from tests_support import loopback_endpoint
from training_jobs import wait_for, worker_pids

TESTS = str(Path(__file__).parents[1])


def _node_settings(endpoint: str, node_rank: int) -> list[str]:
    """Two nodes of one worker, at 0.05 s a step: 30 epochs outlast any start-up."""
    settings = {"train.nnodes": 2, "train.workers": 1, "train.rdzv_endpoint": endpoint}
    settings |= {"model.name": "tests_support:slow_mlp", "model.options": "{seconds: 0.05}"}
    settings |= {"train.epochs": 30, "tracking.backend": "none"}
    if node_rank:
        settings["train.node_rank"] = node_rank
    return [arg for key, value in settings.items() for arg in ("-S", f"{key}={value}")]


def _node(endpoint: str, node_rank: int, **popen: Any) -> subprocess.Popen:
    """Node `node_rank` of run lost-0: `trainyard run` for node 0, `join` for the others."""
    command = "join" if node_rank else "run"
    argv = [str(BIN / "trainyard"), command, "--run-id", "lost-0"]
    return subprocess.Popen([*argv, *_node_settings(endpoint, node_rank)], env=dict(os.environ),
                            **popen)  # fmt: skip


def test_endpoints_in_torchruns_forms_and_whether_anything_answers_there():
    assert endpoint_host_port("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert endpoint_host_port("node-a") == ("node-a", 29400)
    assert endpoint_host_port("[fd00::1]:29401") == ("fd00::1", 29401)
    assert endpoint_host_port("fd00::1:29401") == ("fd00::1", 29401)  # as torchrun reads it
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        endpoint = f"127.0.0.1:{listening.getsockname()[1]}"
        assert unanswered(endpoint, 0) is None
    started = time.monotonic()
    assert unanswered(endpoint, 0.5, poll_s=0.2) == "Connection refused"
    assert time.monotonic() - started >= 0.5  # tried for the whole wait it was given


def test_a_join_without_node_0_waits_node_timeout_s_then_says_so_in_one_line(project, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    endpoint = loopback_endpoint()
    settings = [*_node_settings(endpoint, 1), "-S", "train.node_timeout_s=2"]
    done = trainyard_cli("join", "--run-id", "alone-1", *settings, cwd=project)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        f"trainyard: error: node 0's rendezvous at {endpoint} did not answer within 2 s "
        "(Connection refused): start node 0 first (`trainyard run --run-id alone-1 -S "
        f"train.nnodes=2 -S train.rdzv_endpoint={endpoint}`), or set train.rdzv_endpoint to "
        "the address node 0 serves it on"
    )
    assert f"node 1: waiting up to 2 s for node 0's rendezvous at {endpoint}" in done.stdout
    assert worker_pids("alone-1") == {}


@pytest.mark.slow
@pytest.mark.distributed
def test_node_1_stops_in_one_line_when_node_0_is_lost_mid_run(project, monkeypatch):
    """Node 0's whole process group is killed once both ranks train: node 1's command ends
    with one line saying so, its console shows no stack, its node log keeps it."""
    monkeypatch.setenv("PYTHONPATH", TESTS)  # workers import tests_support:slow_mlp
    endpoint = loopback_endpoint()
    # Node 0 in a session of its own, whose group is killed below; node 1's lines are read.
    node_0 = _node(endpoint, 0, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   start_new_session=True)  # fmt: skip
    node_1 = _node(endpoint, 1, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(worker_pids("lost-0")) == 2, timeout_s=300, what="both ranks")
        os.killpg(node_0.pid, signal.SIGKILL)  # the machine of node 0, gone at once
        out, err = node_1.communicate(timeout=300)
    finally:
        for proc in (node_0, node_1):
            if proc.poll() is None:
                proc.kill()
    assert node_1.returncode == 1, err[-3000:]
    assert err.strip() == (
        f"trainyard: node 1 of run lost-0 stopped: node 0's rendezvous at {endpoint} no longer "
        "answers (Connection refused): node 0 ended (its console says why) or its machine was "
        "lost; once node 0 runs again with --run-id lost-0, join again"
    )
    stack = [line for line in out.splitlines() if "frame #" in line or '  File "' in line]
    assert stack == [], "\n".join(stack[:20])
    node_log = project / ".trainyard" / "logs" / "lost-0" / "node-1.log"
    assert "Traceback (most recent call last):" in node_log.read_text()
    assert f"(its traceback: {node_log.relative_to(project)})" in out
    wait_for(lambda: worker_pids("lost-0") == {}, timeout_s=30, what="no worker left")

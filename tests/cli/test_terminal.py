"""Live progress in a real terminal, under tmux (its own server, 160-column panes):
`trainyard run` shows the epoch, the step of the total, samples/s, the loss, the monitored
metric and an ETA while it trains; `predict` the shards committed; `sweep run` the trials
finished, running, pruned and failed, and the best value. Piped, a command prints plain log
lines with the rank and no bar: test_pipeline checks that on its own piped run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TESTS = str(Path(__file__).resolve().parents[1])
RUN = [
    "-S", "tracking.backend=none", "-S", "train.epochs=4", "-S", "train.batch_size=16",
    "-S", "model.name=tests_support:slow_mlp", "-S", "model.options={seconds: 0.02}",
]  # fmt: skip
# "live epoch 2/4 ━━━━━━╸━━━━ 171/316 1,432 samples/s  loss 0.5321  val_accuracy 0.9370 eta 0:00:03"
BAR = re.compile(
    r"live epoch (?P<epoch>\d)/4 .*?(?P<step>\d+)/(?P<total>\d+) +(?P<rate>[\d,]+) samples/s"
    r"  loss (?P<loss>\d+\.\d{4})(?:  val_accuracy (?P<metric>0\.\d{4}|1\.0000))?"
    r" eta (?P<eta>-:--:--|\d:\d\d:\d\d)"
)


@pytest.fixture
def tmux(tmp_path):
    """tmux on a server of its own. The server starts with the first command, and its
    sessions inherit its environment: the test's (credentials stay off command lines),
    with the test package importable and no COLUMNS, so a pane's width is its own."""
    socket = f"trainyard-test-{os.getpid()}"

    def command(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env["PYTHONPATH"] = TESTS
        done = subprocess.run(
            ["tmux", "-L", socket, *args], capture_output=True, text=True, check=True, env=env
        )
        return done.stdout

    yield command
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)


def in_terminal(tmux, project, args: list[str], name: str) -> list[str]:
    """`trainyard ARGS` in a new 160 x 50 tmux window; every screen seen until it exits."""
    line = f"{BIN / 'trainyard'} {shlex.join(args)}; echo exit-code-$?; sleep 600"
    tmux("new-session", "-d", "-s", name, "-x", "160", "-y", "50", "-c", str(project),
         f"bash --norc -c {shlex.quote(line)}")  # fmt: skip
    frames: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        frames.append(tmux("capture-pane", "-p", "-J", "-S", "-300", "-t", name))
        if "exit-code-" in frames[-1]:
            break
        time.sleep(0.2)
    assert "exit-code-0" in frames[-1], frames[-1][-3000:]
    return frames


def test_run_and_predict_in_a_terminal_show_live_bars(project, tmux):
    frames = in_terminal(tmux, project, ["run", "--run-id", "live", "--all-ranks", *RUN], "run")
    final = frames[-1]
    bars = [m for frame in frames for m in BAR.finditer(frame)]
    assert bars, "no progress bar was drawn:\n" + final[-3000:]
    total = {int(m["total"]) for m in bars}
    assert len(total) == 1 and total.pop() > 100  # epochs x steps per epoch, from the start
    moving = [m for m in bars if 0 < int(m["step"]) < int(m["total"])]
    assert moving, "the bar never showed training under way"
    assert any(m["eta"] != "-:--:--" for m in moving), "no ETA while training"
    last = list(BAR.finditer(final))[-1]
    assert last["epoch"] == "4" and last["step"] == last["total"], last.group(0)
    assert last["metric"] is not None and float(last["metric"]) > 0.5
    assert float(last["loss"]) < 2.3  # below chance's 2.30 nats for ten classes
    assert "test accuracy" in final, "the summary prints below the bar"
    # --all-ranks: each rank's epoch lines print above the bar once each, with their rank
    # (rich's markup took "[rank 0/2]" for a style and dropped it: the lines looked doubled).
    for rank in (0, 1):
        epochs = re.findall(rf"\[rank {rank}/2\] trainyard\.engine\.training: epoch (\d)/4 ", final)
        assert epochs == ["1", "2", "3", "4"], final[-3000:]

    predict = ["predict", "--model", "run:live", "--input", "data/raw/digits.csv",
               "-S", "inference.shard_rows=200"]  # fmt: skip
    screens = in_terminal(tmux, project, predict, "predict")
    shards = re.findall(r"prediction pred-\w+ .*? (\d+)/9 shards committed", screens[-1])
    assert shards and shards[-1] == "9", screens[-1][-3000:]
    assert "prediction pred-" in screens[-1] and "1797 rows" in screens[-1]


def test_a_sweep_in_a_terminal_shows_its_trials(project, tmux):
    args = ["sweep", "run", "-S", "sweep.n_trials=2", "-S", "sweep.max_concurrent_trials=1",
            "-S", "sweep.pruner=none", "-S", "train.epochs=2", "-S", "train.workers=1",
            "-S", "tracking.backend=none"]  # fmt: skip
    frames = in_terminal(tmux, project, args, "sweep")
    seen = [
        m.groups()
        for frame in frames
        for m in re.finditer(
            r"sweep \S+ trials .*? (\d)/2 +(\d) running  (\d) pruned  (\d) failed", frame
        )
    ]
    assert ("0", "1", "0", "0") in seen, "the first trial running, none done"
    assert seen[-1] == ("2", "0", "0", "0"), seen[-5:]
    assert re.search(r"2/2 +0 running  0 pruned  0 failed  best 0\.\d{4}", frames[-1])

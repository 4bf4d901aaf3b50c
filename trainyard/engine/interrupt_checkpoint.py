"""An interrupted training job keeps its work: on SIGTERM or SIGINT (checkpoint.on_interrupt)
the workers finish their step, stop at the same step on every rank, commit a checkpoint
there through the usual signed commit, and exit, within checkpoint.interrupt_grace_s.

How the signal gets here: a Ctrl-C reaches the `trainyard` command only (torchrun and its
workers run in sessions of their own); the command SIGTERMs torchrun's agent, which sends
every worker the signal it got and waits for them (trainyard.runtime.agent_shutdown). Each worker
sees it at its own point of its own step, so the ranks agree on where to stop: every
`interval` steps they all-reduce (MAX, on a gloo group of their own) their "asked to stop"
flags, and all stop at that step if any rank was asked. One such collective cost 0.5 ms
on a busy 2-core machine, 20-90% of a digits MLP step: so the ranks check about every
CHECK_EVERY_S of training, not every step, and agree on the interval in the same
collective (each proposes one from its own step time, the smallest wins). A run stops at
most that long after the signal, at a step every rank checks at, and commits there.
A second signal, or the grace running out, ends the worker at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from trainyard.checkpoint.layout import step_of
from trainyard.checkpoint.writer import CheckpointWriter, NullCheckpointWriter
from trainyard.errors import CheckpointError
from trainyard.runtime.agent_shutdown import SIGNALS
from trainyard.util.files import write_text_atomic

if TYPE_CHECKING:
    from trainyard.checkpoint.sharded import ShardStager
    from trainyard.config import TrainyardConfig

log = logging.getLogger(__name__)

INTERRUPT_FILE = "interrupt.json"  # in the run's staging folder: what the interrupt kept
CHECK_EVERY_S = 0.1  # of training between the ranks' checks: ~0.5% of it at 0.5 ms a check
# Under a parameter server: each check is a collective every rank waits at, which would hold
# the workers to the slowest one's pace every 0.1 s; 2 s leaves them apart for tens of steps.
ASYNC_CHECK_EVERY_S = 2.0
MAX_INTERVAL = 1000  # steps


class StopTraining(Exception):  # not an error: the interrupt's way out of the loop
    """Raised by the checkpoint hook at the step every rank agreed to stop at, once that
    step's checkpoint is queued."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


class StopRequest:
    """This worker's signal handlers while it trains, and the ranks' agreement on when to stop."""

    def __init__(self, grace_s: float, world_size: int, check_every_s: float = CHECK_EVERY_S):
        self.grace_s, self.check_every_s = grace_s, check_every_s
        self.signum: int | None = None
        self.received_at: float | None = None  # time.monotonic()
        self._interval = self._countdown = 1  # steps between checks; the first step checks
        self._checked_at = time.perf_counter()
        self._group = None
        if world_size > 1 and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # every rank creates it, here
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    @property
    def received(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """Whether every rank stops at this step boundary (some rank was asked to by the
        last check). Called by every rank at every boundary; the ranks check together."""
        if self._group is None:
            return self.received
        self._countdown -= 1
        if self._countdown > 0:
            return False
        now = time.perf_counter()
        step_s = (now - self._checked_at) / self._interval  # this rank's, since the last check
        propose = max(1, min(MAX_INTERVAL, int(self.check_every_s / max(step_s, 1e-9))))
        flags = torch.tensor([int(self.received), -propose], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        self._interval = self._countdown = -int(flags[1])  # the smallest proposal
        self._checked_at = time.perf_counter()
        return bool(flags[0])

    def close(self) -> None:
        """Training is over: signals end the worker at once again (as before it trained)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def training_over(self, step: int) -> None:
        """After the last step: signals end the worker at once again; one that came as
        training ended still commits (the last checkpoint is queued) before exiting."""
        self.close()
        if self.received:
            raise StopTraining(step)

    def seconds_left(self) -> float:
        assert self.received_at is not None
        return max(0.0, self.grace_s - (time.monotonic() - self.received_at))

    def _handle(self, signum: int, frame: object) -> None:
        if self.received:  # a second one: stop now, as without on_interrupt
            die(signum)
        self.signum, self.received_at = signum, time.monotonic()
        log.info(
            "%s: stopping at the next step and committing a checkpoint there "
            "(checkpoint.interrupt_grace_s=%gs)",
            signal.Signals(signum).name,
            self.grace_s,
        )
        timer = threading.Timer(self.grace_s, _out_of_time, (signum, self.grace_s))
        timer.daemon = True
        timer.start()


def stop_request(config: TrainyardConfig, world_size: int) -> StopRequest | None:
    """Every rank's, before training starts (with checkpoint.on_interrupt)."""
    if not config.checkpoint.on_interrupt:
        return None
    grace_s = config.checkpoint.interrupt_grace_s
    check_every_s = CHECK_EVERY_S
    if config.train.sync == "parameter_server":  # and well inside the grace
        check_every_s = min(ASYNC_CHECK_EVERY_S, max(grace_s / 4, CHECK_EVERY_S))
    return StopRequest(grace_s, world_size, check_every_s)


def keep_interrupted_work(
    is_main: bool,
    writers: tuple[CheckpointWriter | NullCheckpointWriter, ShardStager | None],
    stop: StopRequest,
    step: int,
    folder: Path,
) -> NoReturn:
    """Commit what the interrupt queued, in the grace left, say how it went (rank 0, in
    `folder`), and exit as the signal would have."""
    checkpointer, shard_stager = writers
    assert stop.received_at is not None and stop.signum is not None
    if is_main:  # what stays said if the grace runs out (_out_of_time) before the commit
        write_outcome(folder, step, False, stop.grace_s, stop.grace_s)
    committed = True
    try:
        if shard_stager is not None:
            shard_stager.close()
        checkpointer.close(timeout_s=stop.seconds_left())
    except CheckpointError as exc:
        log.error("interrupted at step %d; its checkpoint was not committed: %s", step, exc)
        committed = False
    seconds = time.monotonic() - stop.received_at
    if is_main:
        committed = committed and any(step_of(uri) == step for uri in checkpointer.committed)
        write_outcome(folder, step, committed, seconds, stop.grace_s)
        if committed:
            log.info(
                "interrupted: checkpoint step %d committed %.2fs after the signal", step, seconds
            )
    raise SystemExit(128 + stop.signum)


def die(signum: int) -> None:
    """End this process by `signum`'s default action, now (main thread only)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _out_of_time(signum: int, grace_s: float) -> None:
    log.error("no checkpoint committed within checkpoint.interrupt_grace_s=%gs; exiting", grace_s)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(128 + signum)  # from a timer thread: the main thread may be stuck anywhere


def write_outcome(folder: Path, step: int, committed: bool, seconds: float, grace_s: float) -> None:
    """What the command's interrupt line says: the step the run stopped at, whether its
    checkpoint was committed, and how long after the signal."""
    outcome = {"step": step, "committed": committed, "seconds": seconds, "grace_s": grace_s}
    write_text_atomic(folder / INTERRUPT_FILE, json.dumps(outcome))


def read_outcome(folder: Path, step: int | None) -> dict | None:
    """The outcome rank 0 wrote for an interrupt at `step` (None: none, or an older one's)."""
    try:
        outcome = json.loads((folder / INTERRUPT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return outcome if isinstance(outcome, dict) and outcome.get("step") == step else None

"""What a `trainyard run` says and does when it is interrupted (Ctrl-C, SIGTERM).

With checkpoint.on_interrupt the workers commit a checkpoint where they stop
(trainyard.engine.interrupt_checkpoint): the command SIGTERMs its torchrun jobs and waits up to
checkpoint.interrupt_grace_s (and a little for them to exit) before it kills what is left.
A second Ctrl-C kills them at once.
"""

from __future__ import annotations

import logging
import signal

from trainyard.checkpoint.layout import committed_checkpoints, step_of
from trainyard.config import CheckpointConfig
from trainyard.engine.interrupt_checkpoint import read_outcome
from trainyard.project import ProjectPaths
from trainyard.runtime.processes import allow_stop_grace, stop_all_jobs
from trainyard.runtime.progress import last_step
from trainyard.storage import Store

# Past the grace: the workers' own deadline has passed, their agent needs a moment to exit.
EXIT_MARGIN_S = 5.0


def stop_on_first_interrupt(config: CheckpointConfig | None = None) -> None:
    """The first Ctrl-C stops the run: its jobs get `config.interrupt_grace_s` to commit
    where they stop; a second kills them at once. Neither interrupts the clean-up (stopping
    the workers, recording where the run stopped) any further."""
    if config is not None and config.on_interrupt:
        allow_stop_grace(config.interrupt_grace_s + EXIT_MARGIN_S)

    def again(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all_jobs(now=True)

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, again)
        quiet()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


def quiet() -> None:
    """From here on the command only unwinds: every torchrun job it runs is stopped (a
    sweep's trial threads never see the signal themselves), and logging is off, since the
    workers' dying words and Prefect's crash reports would bury the one line that says
    where the run stopped."""
    logging.disable(logging.ERROR)
    stop_all_jobs()


def interrupted_line(store: Store, paths: ProjectPaths, run_id: str) -> str:
    """Where the run stopped and what it kept: the checkpoint committed at that step (and
    how long after the signal), or, if that could not be done in time, the last one."""
    step = last_step(paths.staging / run_id)
    committed = committed_checkpoints(store, run_id)
    last = step_of(committed[-1]) if committed else None
    resume = f"continue with: trainyard run --run-id {run_id}"
    outcome = read_outcome(paths.staging / run_id, step)
    if outcome is not None and outcome["committed"] and last == step:
        return (
            f"trainyard: interrupted; run {run_id} stopped at step {step} and committed "
            f"checkpoint step {step} ({outcome['seconds']:.1f} s); {resume}"
        )
    where = f"stopped at step {step}" if step is not None else "stopped before training"
    if outcome is not None:
        where += (
            f"; its checkpoint could not be committed within checkpoint.interrupt_grace_s="
            f"{outcome['grace_s']:g}s"
        )
    saved = (
        f"last committed checkpoint step {last}" if last is not None else "no committed checkpoint"
    )
    return f"trainyard: interrupted; run {run_id} {where}, {saved}; {resume}"

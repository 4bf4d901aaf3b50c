"""What a `trainyard run` says and does when it is interrupted (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import logging
import signal

from trainyard.checkpoint import committed_checkpoints
from trainyard.launch import stop_all_jobs
from trainyard.progress import last_step
from trainyard.project import ProjectPaths
from trainyard.storage import Store


def stop_on_first_interrupt() -> None:
    """The first Ctrl-C stops the run; later ones are ignored, so clean-up (killing the
    workers, recording where the run stopped) is not itself interrupted."""

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    step = last_step(paths.staging / run_id)
    committed = committed_checkpoints(store, run_id)
    where = f"stopped at step {step}" if step is not None else "stopped before training"
    last = int(committed[-1].rsplit("step-", 1)[1]) if committed else None
    saved = (
        f"last committed checkpoint step {last}" if last is not None else "no committed checkpoint"
    )
    return (
        f"trainyard: interrupted; run {run_id} {where}, {saved}; "
        f"continue with: trainyard run --run-id {run_id}"
    )

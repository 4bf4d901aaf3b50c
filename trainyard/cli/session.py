"""A command that runs a Prefect flow, from one place: Prefect's settings, the guardian, the
first Ctrl-C, the API the flow reports to, and the exit code an interruption ends with.

Importing this module imports neither Prefect nor the engine: `trainyard --help` and a
refused command stay fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from trainyard.cli.prefect_server import home_of, prefect_api, start_for_project
from trainyard.project import ProjectPaths
from trainyard.runtime.guardian import Guardian

if TYPE_CHECKING:
    from trainyard.config import CheckpointConfig

T = TypeVar("T")


class FlowInterrupted(Exception):
    """A flow run stopped by Ctrl-C or SIGTERM, its line printed: the command exits with
    `code` (130 or 143)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def run_flow(
    paths: ProjectPaths,
    load: Callable[[], Callable[[], T]],
    *,
    interrupted: Callable[[], str],
    progress: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    checkpoint: CheckpointConfig | None = None,
    workers: AbstractContextManager[object] | None = None,
    prestart: Callable[[], object] | None = None,
) -> T:
    """Run a flow under a guardian (nothing outlives the command) and return what it returns.

    In this order: Prefect's settings (`use_local_prefect`), the guardian, the first Ctrl-C
    (`checkpoint`: the grace the workers get to commit where they stop); then, inside
    `workers` (a `persistent_workers` block), `prestart` (workers that start while Prefect
    is imported); then `load`, which imports the flow, and so Prefect, and returns the call
    that runs it; the call runs with the API open and `progress` drawn. An interruption
    prints `interrupted()` (how to continue) and raises FlowInterrupted with its exit code;
    any other exception passes through.
    """
    use_local_prefect(paths)
    guard(paths)
    # Imported here: the engine's interruption handling (torch's launcher) costs start-up time.
    from trainyard.cli.interrupts import stop_on_first_interrupt

    stop_on_first_interrupt(checkpoint)
    with workers or contextlib.nullcontext():
        if prestart is not None:
            prestart()
        call = load()
        try:
            # The user's PREFECT_API_URL, else the project's Prefect server, started by the
            # first command that needs it and kept running for the next ones.
            with prefect_api(), progress():
                return call()
        except BaseException as exc:
            code = interruption_code(exc)
            if code is None:
                raise
            print(interrupted(), file=sys.stderr)
            raise FlowInterrupted(code) from None


def use_local_prefect(paths: ProjectPaths, server: bool = True) -> None:
    """Keep Prefect's home in the project (not the user's profile) unless they chose one, and
    (`server`) report to the user's PREFECT_API_URL, else to the project's Prefect server,
    started now if none runs. Set before Prefect is imported, which reads its settings once:
    Prefect's own clients, flushing logs at exit included, then use it."""
    os.environ.setdefault("PREFECT_HOME", str(paths.prefect_home))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if server and not os.environ.get("PREFECT_API_URL"):
        os.environ["PREFECT_API_URL"] = start_for_project(home_of(paths))


def guard(paths: ProjectPaths) -> None:
    """Nothing this command starts may outlive it, even when it is SIGKILLed."""
    Guardian.for_this_process(paths)


def interruption_code(exc: BaseException) -> int | None:
    """130 for Ctrl-C, 143 for SIGTERM (Prefect's TerminationSignal or our own exit)."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
        return exc.code
    from prefect.exceptions import TerminationSignal  # imported by the flow already

    if isinstance(exc, TerminationSignal):
        return 128 + signal.SIGTERM
    return None

"""A training run's plan: its settings checked against the data and the machine, made once
per flow run, by the command that starts the flow or else by the flow itself.

`trainyard run` (and `trainyard sweep run`) plans before it starts anything, so that bad
input is one line and leaves no server behind, then runs the flow inside
`handed_over(plan)`. The flow calls `plan_run` with the settings it was given: it gets the
plan handed over for exactly those settings (the same object, passed in this process), and
checks for itself only when nothing was handed over, as when a deployment or the API starts
it. Nothing is remembered beyond the block: a second run in the same process is checked
again, and a plan never stands in for another run's settings.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainyard.config import TrainyardConfig
from trainyard.runs.preflight import PreflightReport, preflight

Check = Callable[[TrainyardConfig, Path], PreflightReport]


@dataclass(frozen=True)
class RunPlan:
    """The settings a run trains with, and what the checks found in its data and model."""

    config: TrainyardConfig
    report: PreflightReport


# The plan of the flow call this command is making; a context variable, so that a flow in
# another thread (a sweep's trials) never sees another call's plan.
_handed: contextvars.ContextVar[RunPlan | None] = contextvars.ContextVar(
    "trainyard_run_plan", default=None
)


def plan_run(config: TrainyardConfig, root: Path, check: Check = preflight) -> RunPlan:
    """The plan handed over for these very settings, else `check` (the run's preflight, or a
    sweep's, which also checks the space) run now."""
    handed = _handed.get()
    if handed is not None and handed.config is config:
        return handed
    return RunPlan(config, check(config, root))


@contextmanager
def handed_over(plan: RunPlan) -> Iterator[RunPlan]:
    """Inside this block, the flow planning for `plan.config` takes `plan` as it is."""
    token = _handed.set(plan)
    try:
        yield plan
    finally:
        _handed.reset(token)

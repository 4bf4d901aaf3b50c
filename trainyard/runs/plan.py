"""A training run's plan: its settings checked against the data and the machine, made once
per flow run, by the command that starts the flow or else by the flow itself.

`trainyard run` (and `trainyard sweep run`) plans before it starts anything, so that bad
input is one line and leaves no server behind, then runs the flow inside
`handed_over(plan, overrides)`. A flow's parameters carry only `overrides` (never a whole
config): the flow takes the settings handed over with those very overrides
(`handed_settings`), and its `plan_run` gets the plan made for exactly those settings (the
same object, passed in this process). Only when nothing was handed over, as when a
deployment or the API starts it, does the flow read params.yaml and check for itself.
In-process callers with typed settings and no plan (`trainyard predict`, notebooks, tests)
hand over settings alone with `settings_handed_over`. Nothing is remembered beyond the
block: a second run in the same process is checked again, and a plan never stands in for
another run's settings.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError

if TYPE_CHECKING:  # imported by plan_run: see there
    from trainyard.runs.preflight import PreflightReport

Check = Callable[[TrainyardConfig, Path], "PreflightReport"]


@dataclass(frozen=True)
class RunPlan:
    """The settings a run trains with, and what the checks found in its data and model."""

    config: TrainyardConfig
    report: PreflightReport


@dataclass(frozen=True)
class _Handover:
    config: TrainyardConfig
    plan: RunPlan | None
    overrides: tuple[str, ...]


# The settings (and plan) of the flow call this command is making; a context variable, so
# that a flow in another thread (a sweep's trials) never sees another call's.
_handed: contextvars.ContextVar[_Handover | None] = contextvars.ContextVar(
    "trainyard_run_plan", default=None
)


def plan_run(config: TrainyardConfig, root: Path, check: Check | None = None) -> RunPlan:
    """The plan handed over for these very settings, else `check` (the run's preflight, or a
    sweep's, which also checks the space) run now."""
    handed = _handed.get()
    if handed is not None and handed.plan is not None and handed.plan.config is config:
        return handed.plan
    if check is None:
        # Start-up cost: the preflight builds the model, so it brings torch (~2.5 s of CPU),
        # which a node's flow run, importing this module, never needs.
        from trainyard.runs.preflight import preflight

        check = preflight
    return RunPlan(config, check(config, root))


def handed_settings(overrides: Sequence[str]) -> TrainyardConfig | None:
    """The settings handed over to the flow being called, None when nothing was (a
    deployment's or the API's run). Its `overrides` parameter must be the ones they were
    made with: a call may not say one thing in Prefect's API and train with another."""
    handed = _handed.get()
    if handed is None:
        return None
    if tuple(overrides) != handed.overrides:
        raise TrainyardError(
            f"overrides {list(overrides)} differ from the {list(handed.overrides)} the "
            "settings handed over were made with; pass the same list"
        )
    return handed.config


@contextmanager
def handed_over(plan: RunPlan, overrides: Sequence[str] = ()) -> Iterator[RunPlan]:
    """Inside this block, the flow called with `overrides` trains with `plan.config` and
    takes `plan` as it is instead of checking again."""
    token = _handed.set(_Handover(plan.config, plan, tuple(overrides)))
    try:
        yield plan
    finally:
        _handed.reset(token)


@contextmanager
def settings_handed_over(
    config: TrainyardConfig, overrides: Sequence[str] = ()
) -> Iterator[TrainyardConfig]:
    """Inside this block, the flow called with `overrides` runs with `config` (checked by
    the flow itself, as nothing was planned)."""
    token = _handed.set(_Handover(config, None, tuple(overrides)))
    try:
        yield config
    finally:
        _handed.reset(token)

"""The settings a flow run works with: those handed over in this process (the CLI's plan, a
notebook's or a test's typed settings), else the project's params.yaml with the run's
`overrides`, refused in one line where an override is the project owner's choice
(`trainyard.config.callers`). A flow's parameters never carry a whole config."""

from __future__ import annotations

from trainyard.config import TrainyardConfig
from trainyard.config.callers import load_caller_config
from trainyard.project import ProjectPaths
from trainyard.runs.confined import flow_project
from trainyard.runs.plan import handed_settings


def flow_settings(overrides: list[str] | None) -> tuple[ProjectPaths, TrainyardConfig]:
    """The project the flow runs in (the current folder: a deployment's pull step or the
    CLI puts it there) and the settings to run with."""
    paths = flow_project(".")
    given = handed_settings(overrides or [])
    if given is not None:
        return paths, given
    return paths, load_caller_config(paths.params, overrides or [])

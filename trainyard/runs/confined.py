"""Paths that flow parameters name, kept inside the project.

A flow may be started by the CLI, by a deployment's worker, or by anyone who can create a
flow run through Prefect's API, so each flow checks its own parameters with these functions
(the CLI calls the same ones earlier, to refuse a mistake before Prefect starts).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths

# The project's own state: a file written there by a flow parameter (an output named
# .trainyard/splits/<key>/train.parquet) would rewrite what later runs train on.
STATE_FOLDERS = (".trainyard", ".dvc", ".git")


def flow_project(project_dir: str | Path) -> ProjectPaths:
    """The project a flow run works in. `project_dir` must be the folder the flow's process
    runs in: the CLI runs flows from the project folder and a deployment's run starts in
    it (prefect.yaml's pull step, `trainyard serve`), so a flow run's parameters cannot
    point a flow at another folder to read settings from or write state into."""
    here = Path.cwd().resolve()
    root = (here / project_dir).resolve()
    if root != here:
        raise TrainyardError(
            f"project_dir {str(project_dir)!r} is not the project this flow runs in ({here}); "
            "leave it out, or start the flow from that project's folder"
        )
    return ProjectPaths(root)


def inside_project(paths: ProjectPaths, path: str | Path, what: str) -> Path:
    """`path` (relative to the project, or absolute) with every symlink and `..` resolved;
    refused in one line unless it lies inside the project."""
    root = paths.root.resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise TrainyardError(
            f"{what} {str(path)!r} is outside the project ({root}); name a path inside it"
        )
    return target


def writable_in_project(paths: ProjectPaths, path: str | Path, what: str) -> Path:
    """As `inside_project`, and not inside the project's own state folders."""
    target = inside_project(paths, path, what)
    top = target.relative_to(paths.root.resolve()).parts[:1]
    if top and top[0] in STATE_FOLDERS:
        raise TrainyardError(
            f"{what} {str(path)!r} is inside {top[0]}/, which holds the project's own state; "
            "name a path outside it"
        )
    return target


def make_folder_in_project(paths: ProjectPaths, folder: Path, what: str) -> None:
    """Create `folder` (resolved, inside the project) and its missing parents, one at a time
    from the project root and never through a symlink: one planted on the way since it was
    checked makes this fail in one line instead of creating a folder elsewhere."""
    root = paths.root.resolve()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in folder.relative_to(root).parts:
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise TrainyardError(
                    f"{what}: cannot create folder {folder} ({exc.strerror} at {part!r})"
                ) from None
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)

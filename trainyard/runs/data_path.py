"""Where a run's dataset lies in its project, refusing links that lead out of the data folder.
No torch here: a node's flow run checks its dataset before its torchrun starts."""

from __future__ import annotations

import os
from pathlib import Path

from trainyard.config import DATA_DIR, TrainyardConfig
from trainyard.errors import ConfigError


def dataset_path(config: TrainyardConfig, root: Path) -> Path:
    """The dataset file or folder, refusing symlinks that lead outside the project's data
    folder: the path itself, and any link inside a folder (DVC would read and push what a
    file link points to, and an image folder follows folder links too)."""
    path = root / config.data.path
    data_dir = (root / DATA_DIR).resolve()
    if path.exists() and not path.resolve().is_relative_to(data_dir):
        raise ConfigError(
            f"data.path = {config.data.path!r}: resolves to {path.resolve()}, outside {data_dir}; "
            "copy the file into the data folder"
        )
    if path.is_dir():
        refuse_links_out(path, data_dir, root)
    return path


def refuse_links_out(folder: Path, data_dir: Path, root: Path, seen: set | None = None) -> None:
    """A ConfigError naming the first symlink under `folder`, to a file or a folder, that
    resolves outside `data_dir`. A folder link inside data/ is checked where it leads (an
    image folder follows it), each real folder once, so a link cycle ends."""
    seen = set() if seen is None else seen
    if folder.resolve() in seen:
        return
    seen.add(folder.resolve())
    for parent, folders, files in os.walk(folder):
        for name in sorted(folders + files):
            link = Path(parent, name)
            if not link.is_symlink():
                continue
            target = link.resolve()
            if not target.is_relative_to(data_dir):
                shown = link.relative_to(root) if link.is_relative_to(root) else link
                raise ConfigError(
                    f"{shown}: a symlink to {target}, outside {data_dir}; copy what it "
                    "points to into the data folder instead of linking to it"
                )
            if target.is_dir():
                refuse_links_out(target, data_dir, root, seen)

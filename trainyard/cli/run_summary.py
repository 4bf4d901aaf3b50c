"""What `trainyard run` prints when its run is done: where the run's parts are, and what
to type next."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.cli.console import command_seconds, where_time_went
from trainyard.project import ProjectPaths

if TYPE_CHECKING:
    from trainyard.runs.record import RunRecord
    from trainyard.storage import Store


def print_summary(record: RunRecord, store: Store, paths: ProjectPaths, returned_at: float) -> None:
    """`returned_at`: when the flow returned (unix time), before the workers' stop."""
    comet = ", ".join(sorted({e.mode for e in record.tracking})) or "none"
    archives = [e.archive for e in record.tracking if e.archive]
    where = (
        f"offline archives in {Path(archives[0]).parent.relative_to(paths.root)}/ "
        f"({len(archives)} worker{'s' if len(archives) != 1 else ''}; upload later with "
        f"`trainyard tracking upload {record.run_id}`)"
        if archives
        else comet
    )
    assert record.monitor is not None and record.dataset is not None  # a completed run has both
    wall, now = command_seconds(), time.time()
    parts = where_time_went(now - wall, returned_at, now, record.timings_s, record.first_step_at)
    print(
        f"\ntrainyard run {record.run_id} {record.status} in {wall:.1f}s ({parts})\n"
        f"  test {record.monitor['name']:<9} {record.monitor['value']:.4f}\n"
        f"  checkpoint     {record.final_checkpoint}\n"
        f"  run record     {store.uri(f'runs/{record.run_id}/run.json')}\n"
        f"  dataset        {record.dataset.path} (DVC md5 {record.dataset.dvc_md5})\n"
        f"  comet          {where}\n"
        f"  store          {store.settings.where}\n"
        "\nnext:\n"
        # `make run` puts the venv on its own PATH, not on the user's shell's.
        + ("" if os.environ.get("VIRTUAL_ENV") == sys.prefix else "  source .venv/bin/activate\n")
        + f"  trainyard runs show {record.run_id}\n"
        "  trainyard runs list\n"
        "  trainyard run -S train.workers=1 -S train.epochs=10\n"
        "  dvc repro            # split and train again where params, data or code changed\n"
    )

"""Sweeps of the project's once shared journal file (`.trainyard/sweeps/optuna-journal.log`):
still read there, and moved to a journal of their own when resumed."""

from __future__ import annotations

from pathlib import Path

import optuna

from trainyard.errors import first_line
from trainyard.project import ProjectPaths
from trainyard.storage import Store
from trainyard.sweeps.journal import JournalError, repair_journal
from trainyard.sweeps.record import SweepRecord, save_sweep
from trainyard.sweeps.study import SHARED_JOURNAL, journal_path, open_storage


def own_journal(store: Store, record: SweepRecord, paths: ProjectPaths) -> SweepRecord:
    """A sweep of the project's once shared journal file, resumed: its study is copied into
    a journal of its own (trial numbers, states and attributes kept) and its record points
    there, so that no other sweep's damage reaches it again. The shared file is repaired
    first if a torn record made it unreadable (a copy kept); the other sweeps in it stay
    readable there."""
    shared = (paths.state / SHARED_JOURNAL).resolve()
    if "://" in record.storage or Path(record.storage).resolve() != shared:
        return record
    url = str(journal_path(paths, record.sweep_id))
    copy = Path(url).with_name("journal.copying")
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.unlink(missing_ok=True)  # a copy an earlier resume left half made
    repair_journal(shared)  # what appending after a torn record did to the shared file
    try:
        optuna.copy_study(
            from_study_name=record.study_name,
            from_storage=open_storage(record.storage, create_tables=False),
            to_storage=open_storage(str(copy)),
        )
    except (KeyError, ValueError) as exc:  # gone from it, or a record broken before the last
        raise JournalError(
            f"sweep {record.sweep_id}: its study in {record.storage} cannot be read "
            f"({first_line(exc)}); it cannot be resumed"
        ) from None
    copy.replace(url)
    moved = record.model_copy(update={"storage": url})
    save_sweep(store, moved)
    return moved

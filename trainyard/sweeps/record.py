"""A sweep's record, `sweeps/<sweep_id>/sweep.json` in the store: its settings, the study's
name and storage, and the data and code it was started on. The trials live in the study;
each trial's run has its own run record, tagged with the sweep id and trial number."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from trainyard.errors import TrainyardError
from trainyard.runs.record import RUN_ID, check_run_id
from trainyard.storage import Store
from trainyard.util.documents import Skipped, UnreadableDocument, read_model


class SweepRecord(BaseModel):
    sweep_id: str
    study_name: str
    storage: str  # what `optuna ... --storage` and optuna-dashboard accept
    direction: Literal["maximize", "minimize"]
    objective: str  # the history key each trial reports and is scored by, e.g. val_accuracy
    created_at: str
    dataset_path: str
    dataset_md5: str
    code: dict[str, Any]  # git commit and dirty flag
    params: dict[str, Any]  # the sweep's settings, the sweep section included


def sweep_key(sweep_id: str) -> str:
    return f"sweeps/{check_run_id(sweep_id)}/sweep.json"


def save_sweep(store: Store, record: SweepRecord) -> None:
    store.write_json(sweep_key(record.sweep_id), record.model_dump(mode="json"))


def find_sweep(store: Store, sweep_id: str) -> SweepRecord | None:
    """None if there is no such sweep; a damaged record raises `UnreadableDocument`."""
    try:
        return read_model(store, sweep_key(sweep_id), SweepRecord)
    except FileNotFoundError:
        return None


def load_sweep(store: Store, sweep_id: str) -> SweepRecord:
    record = find_sweep(store, sweep_id)
    if record is None:
        raise TrainyardError(
            f"no sweep {sweep_id!r} in {store.uri('sweeps')}; see `trainyard sweep list`"
        )
    return record


def list_sweeps(store: Store, skipped: Skipped | None = None) -> list[SweepRecord]:
    """Every readable sweep record, newest first; with `skipped`, a damaged one is left out
    there (without, it raises `UnreadableDocument`)."""
    found = []
    for name in (n for n in store.list_dirs("sweeps") if RUN_ID.fullmatch(n)):
        try:
            found.append(find_sweep(store, name))
        except UnreadableDocument as exc:
            if skipped is None:
                raise
            skipped.add(exc)
    return sorted((r for r in found if r), key=lambda r: r.created_at, reverse=True)


def check_same_data(record: SweepRecord, dataset_md5: str) -> None:
    """A sweep's trials are only comparable on one dataset version."""
    if dataset_md5 != record.dataset_md5:
        raise TrainyardError(
            f"sweep {record.sweep_id} ran on {record.dataset_path} with DVC md5 "
            f"{record.dataset_md5}, which is now {dataset_md5}; restore that version "
            "(`git checkout` + `dvc checkout`) to resume it, or start a new sweep"
        )

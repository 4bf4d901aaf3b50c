"""Where checkpoints are in the store: one folder per step, files first, manifest last.

    runs/<run_id>/checkpoints/step-<global_step:08d>/state.pt
    runs/<run_id>/checkpoints/step-<global_step:08d>/manifest.json   <- commit marker

A folder without a manifest was never committed; listing it is not loading it
(trainyard.checkpoint.reader verifies).
"""

from __future__ import annotations

import re

from trainyard.storage import Store

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:08d}"


def step_of(uri: str) -> int | None:
    """The global step a checkpoint URI is for (None if it names no checkpoint folder)."""
    match = _STEP_DIR.match(uri.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def checkpoint_steps(store: Store, run_id: str) -> list[int]:
    """Steps with a checkpoint folder (committed or not), ascending."""
    names = store.list_dirs(f"runs/{run_id}/checkpoints")
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names) if m)


def committed_checkpoints(store: Store, run_id: str) -> list[str]:
    """URIs of the run's checkpoints that have a manifest, ascending (not verified: for
    records and listings; loading verifies)."""
    return [
        store.uri(checkpoint_key(run_id, step))
        for step in checkpoint_steps(store, run_id)
        if _committed(store, run_id, step)
    ]


def newest_committed(store: Store, run_id: str) -> str | None:
    """URI of the run's newest checkpoint with a manifest (not verified), read newest
    first: one look per folder down to it, not one per folder of the run."""
    for step in reversed(checkpoint_steps(store, run_id)):
        if _committed(store, run_id, step):
            return store.uri(checkpoint_key(run_id, step))
    return None


def _committed(store: Store, run_id: str, step: int) -> bool:
    return store.exists(f"{checkpoint_key(run_id, step)}/{MANIFEST_FILE}")

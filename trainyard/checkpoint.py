"""Checkpoints in the store: one folder per step, files first, manifest last.

    runs/<run_id>/checkpoints/step-<global_step:08d>/state.pt
    runs/<run_id>/checkpoints/step-<global_step:08d>/manifest.json   <- commit marker

A folder without a manifest, or whose files do not match it, is never loaded. Loading
uses `torch.load(weights_only=True)`, so a checkpoint can never run code.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from trainyard.errors import CheckpointError
from trainyard.storage import Store

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:08d}"


def strip_wrapper_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """DDP adds `module.`, torch.compile `_orig_mod.`; a bare model wants neither."""
    clean = {}
    for key, value in state_dict.items():
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, stripped = key[len(prefix) :], True
        clean[key] = value
    return clean


class CheckpointWriter:
    """Owned by rank 0: stages a checkpoint locally (atomically), uploads, commits."""

    def __init__(self, store: Store, run_id: str, staging: Path):
        self.store = store
        self.run_id = run_id
        self.staging = staging / run_id
        self.committed: list[str] = []

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> str:
        folder = self.staging / f"step-{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        local = folder / STATE_FILE
        tmp = folder / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(local)
        key = checkpoint_key(self.run_id, step)
        if self.store.exists(f"{key}/{MANIFEST_FILE}"):
            raise CheckpointError(
                f"{self.store.uri(key)} is already committed; checkpoints are never overwritten"
            )
        self.store.put_file(local, f"{key}/{STATE_FILE}")
        manifest = {
            **meta,
            "step": step,
            "torch_version": torch.__version__,
            "files": {
                STATE_FILE: {"size": local.stat().st_size, "sha256": _sha256(local.read_bytes())}
            },
        }
        self.store.write_json(f"{key}/{MANIFEST_FILE}", manifest)
        uri = self.store.uri(key)
        self.committed.append(uri)
        log.info("checkpoint step %d committed to %s", step, uri)
        return uri


class NullCheckpointWriter:
    """What ranks other than 0 hold: saving is rank 0's side effect."""

    def __init__(self) -> None:
        self.committed: list[str] = []

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        return None


def load_checkpoint(store: Store, uri: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, manifest) of a committed checkpoint, verified against its manifest."""
    key = store.key_of(uri.rstrip("/"))
    try:
        manifest = store.read_json(f"{key}/{MANIFEST_FILE}")
    except FileNotFoundError:
        raise CheckpointError(f"{uri} has no {MANIFEST_FILE}: it was never committed") from None
    expected = manifest["files"][STATE_FILE]
    data = store.get_bytes(f"{key}/{STATE_FILE}")
    if len(data) != expected["size"] or _sha256(data) != expected["sha256"]:
        raise CheckpointError(
            f"{uri}/{STATE_FILE} does not match its manifest (truncated or tampered)"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{uri}/{STATE_FILE} holds objects other than tensors and plain data; "
            f"refusing to unpickle it ({str(exc).splitlines()[0]})"
        ) from None
    return state, manifest


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

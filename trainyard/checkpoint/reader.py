"""Reading committed checkpoints back, verified. A folder without a manifest, whose manifest
is not signed with the project's key (trainyard.checkpoint.signing), or whose files do not
match it, is never loaded. Loading uses `torch.load(weights_only=True)`, so a checkpoint can
never run code. Resuming picks the highest step that is committed and verifies
(`latest_committed`), skipping broken ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from trainyard.checkpoint.layout import MANIFEST_FILE, STATE_FILE, checkpoint_key, checkpoint_steps
from trainyard.checkpoint.signing import verify
from trainyard.errors import CheckpointError
from trainyard.runs.contracts import CheckpointManifest, FileEntry
from trainyard.storage import Store

log = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def read_manifest(store: Store, uri: str) -> CheckpointManifest:
    """A checkpoint's manifest, its signature verified; FileNotFoundError if it was never
    committed, CheckpointError if it is not a manifest this trainyard can read or this
    project did not sign it."""
    key = store.key_of(uri.rstrip("/"))
    try:
        document = store.read_json(f"{key}/{MANIFEST_FILE}")
        manifest = CheckpointManifest.model_validate(document)
    except json.JSONDecodeError:
        raise CheckpointError(f"{uri}/{MANIFEST_FILE} is not valid JSON (tampered)") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the manifest"
        raise CheckpointError(
            f"{uri}/{MANIFEST_FILE} is not a checkpoint manifest ({where}: {error['msg']}); "
            "it was tampered with or written by another trainyard version"
        ) from None
    verify(uri, key, document)
    return manifest


def load_checkpoint(store: Store, uri: str) -> tuple[dict[str, Any], CheckpointManifest]:
    """(state, manifest) of a committed checkpoint, verified against its manifest."""
    key = store.key_of(uri.rstrip("/"))
    try:
        manifest = read_manifest(store, uri)
    except FileNotFoundError:
        raise CheckpointError(f"{uri} has no {MANIFEST_FILE}: it was never committed") from None
    if STATE_FILE not in manifest.files:
        raise CheckpointError(f"{uri}/{MANIFEST_FILE} does not list {STATE_FILE}")
    data = _verified_bytes(store, key, uri, STATE_FILE, manifest.files[STATE_FILE])
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{uri}/{STATE_FILE} holds objects other than tensors and plain data; "
            f"refusing to unpickle it ({str(exc).splitlines()[0]})"
        ) from None
    return state, manifest


def latest_committed(
    store: Store, run_id: str
) -> tuple[str, dict[str, Any], CheckpointManifest] | None:
    """(uri, state, manifest) of the highest committed checkpoint that verifies, or None.

    Folders without a manifest (an upload that never finished) and ones that fail
    verification are skipped with a warning, so a broken latest checkpoint costs only the
    steps since the previous one.
    """
    for step in reversed(checkpoint_steps(store, run_id)):
        uri = store.uri(checkpoint_key(run_id, step))
        try:
            state, manifest = load_checkpoint(store, uri)
        except CheckpointError as exc:
            log.warning("skipping checkpoint step %d: %s", step, exc)
            continue
        return uri, state, manifest
    return None


def fetch_files(store: Store, uri: str, manifest: CheckpointManifest, dest: Path) -> Path:
    """Download and verify every file of a committed checkpoint except state.pt (which
    `load_checkpoint` reads): the per-rank shards of a sharded checkpoint."""
    key = store.key_of(uri.rstrip("/"))
    dest.mkdir(parents=True, exist_ok=True)
    for name, expected in manifest.files.items():
        if name == STATE_FILE:
            continue
        data = _verified_bytes(store, key, uri, name, expected)
        tmp = dest / (name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(dest / name)
    return dest


def _verified_bytes(store: Store, key: str, uri: str, name: str, expected: FileEntry) -> bytes:
    """A checkpoint file's bytes, refused unless they match the manifest's size and sha256."""
    try:
        data = store.get_bytes(f"{key}/{name}")
    except FileNotFoundError:
        raise CheckpointError(f"{uri}/{name} is missing") from None
    if len(data) != expected.size or _sha256(data) != expected.sha256:
        raise CheckpointError(f"{uri}/{name} does not match its manifest (truncated or tampered)")
    return data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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

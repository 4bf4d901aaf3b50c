"""Checkpoint manifests signed with the project's own key.

Whoever can write to the bucket can rewrite `state.pt` and `manifest.json` together, with
matching sha256 values: the digests alone prove nothing about who wrote them. So each
manifest also carries an HMAC-SHA256 over its content and the key it is committed under
(`runs/<id>/checkpoints/step-<n>`, `registry/<model>/versions/<n>`), so a signed manifest
cannot be replayed under another run, step or version. The HMAC key is 32 random bytes in
the project's local state (`.trainyard/signing.key`, mode 0600), made by the first
checkpoint the project writes; the store never holds it, and it is never logged.

Every trainyard process of a project runs from the project folder (the CLI, flows,
deployments and torchrun workers), so they all find the key there. A process elsewhere,
or another machine, names it with TRAINYARD_SIGNING_KEY_FILE: a path, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from trainyard.errors import CheckpointError
from trainyard.project import ProjectPaths

SIGNING_KEY_ENV = "TRAINYARD_SIGNING_KEY_FILE"
SIGNATURE_FIELD = "signature"
_SCHEME = "hmac-sha256:"
_KEY_BYTES = 32


def key_file() -> Path:
    """Where this process's project key is: TRAINYARD_SIGNING_KEY_FILE, else the project in
    the working folder."""
    named = os.environ.get(SIGNING_KEY_ENV)
    return Path(named) if named else ProjectPaths.here().signing_key


def project_key(create: bool = False) -> bytes:
    """The project's signing key; with `create`, made (once, whoever races) if absent."""
    path = key_file()
    if create and not path.exists():
        _create_key(path)
    try:
        info = path.stat()
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(
            f"this project's checkpoint signing key {path} is missing, so no checkpoint can be "
            f"trusted; copy signing.key from the machine that wrote the checkpoints to {path} "
            f"(mode 0600) or set {SIGNING_KEY_ENV} to its path"
        ) from None
    if info.st_mode & 0o077:
        raise CheckpointError(
            f"checkpoint signing key {path} can be read or changed by other users "
            f"(mode {stat.filemode(info.st_mode)}); run `chmod 600 {path}`"
        )
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < _KEY_BYTES:
        raise CheckpointError(
            f"{path} is not a checkpoint signing key ({_KEY_BYTES * 2}+ hex digits); restore "
            "the project's own key file"
        )
    return key


def key_id(key: bytes) -> str:
    """A name for the key that tells nothing of it (an HMAC of a fixed text under it): two
    machines compare names to learn whether they hold the same key."""
    return hmac.new(key, b"trainyard signing key id", hashlib.sha256).hexdigest()[:16]


def check_same_key(expected_id: str) -> None:
    """Refuse, in one line, a machine whose project key is not the one named `expected_id`
    (node 0's of a multi-node run): node 0's checkpoints would not load here. A missing key
    is not made: one made here would be another key."""
    path = key_file()
    fix = (
        f"copy .trainyard/signing.key from node 0's machine to {path} (mode 0600); "
        "`trainyard storage env` on the store's machine says where it is"
    )
    if not path.exists():
        raise CheckpointError(f"this machine has no checkpoint signing key ({path}): {fix}")
    mine = key_id(project_key())
    if mine != expected_id:
        raise CheckpointError(
            f"this machine's checkpoint signing key {path} (key id {mine}) is not node 0's "
            f"(key id {expected_id}): {fix}"
        )


def _create_key(path: Path) -> None:
    """Written whole into a private temporary file, then linked into place: a link never
    replaces an existing file, so of two processes racing the first one's key stays."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(_KEY_BYTES) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: its key is the project's
    finally:
        tmp.unlink(missing_ok=True)


def signature(key: bytes, location: str, document: dict[str, Any]) -> str:
    """The HMAC of a manifest (its JSON form, without its signature) committed at `location`
    (a store key). Canonical JSON: sorted keys, no spaces, so writer and reader agree."""
    body = {name: value for name, value in document.items() if name != SIGNATURE_FIELD}
    body = json.loads(json.dumps(body))  # as a reader sees it: tuples as lists, keys as text
    message = json.dumps(
        {"location": location.strip("/"), "manifest": body},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return _SCHEME + hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def signed(key: bytes, location: str, document: dict[str, Any]) -> dict[str, Any]:
    """`document` with its signature for `location`."""
    return {**document, SIGNATURE_FIELD: signature(key, location, document)}


def verify(uri: str, location: str, document: dict[str, Any]) -> None:
    """Refuse (CheckpointError) a manifest not signed by this project's key for `location`."""
    path = key_file()
    given = document.get(SIGNATURE_FIELD)
    if not given:
        raise CheckpointError(
            f"checkpoint {uri} is not signed, so it is not loaded: it was tampered with or "
            "written before checkpoints were signed; load only checkpoints this project wrote "
            "(or retrain it)"
        )
    expected = signature(project_key(), location, document)
    if not hmac.compare_digest(str(given).encode(), expected.encode()):
        raise CheckpointError(
            f"checkpoint {uri} is not signed by this project's key ({path}), so it is not "
            "loaded: it was written elsewhere or tampered with; load only checkpoints this "
            f"project wrote, or use the writing project's key file ({SIGNING_KEY_ENV})"
        )

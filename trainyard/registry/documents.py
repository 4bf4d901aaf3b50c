"""The registry's documents and where they live: the pydantic models written to the store,
model and alias names, the keys built from them, and who and when a change is stamped with.
Every writer creates its keys with `Store.create_json` (a conditional create)."""

from __future__ import annotations

import datetime as dt
import getpass
import os
import re
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainyard.errors import TrainyardError
from trainyard.runs.contracts import FileEntry
from trainyard.storage import Store

SCHEMA_VERSION = 1
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # always fullmatch: "$" allows a "\n"
# checkpoint.MANIFEST_FILE, not imported from there: checkpoint imports torch, and
# `models list/show/history` should not wait seconds for it.
MANIFEST_FILE = "manifest.json"
VERSION_FILE = "version.json"
CLAIM_FILE = "claim.json"


class Document(BaseModel):
    # A field a newer trainyard added is ignored, not refused: an older reader still lists
    # and loads that version (fields are only ever added, as in the run record).
    model_config = ConfigDict(extra="ignore")


class VersionInfo(Document):
    """`versions/<n>/version.json`: everything needed to trust and use a version without its run."""

    schema_version: int = SCHEMA_VERSION
    name: str
    version: int
    run_id: str
    checkpoint: str  # the source checkpoint's URI (it may since have been deleted)
    step: int
    dataset_md5: str | None
    code: dict[str, Any]  # git commit and dirty flag of the code that trained it
    metrics: dict[str, float]  # the run's final metrics (test_* and val_*)
    monitor: dict[str, Any] | None  # {name, mode, value}: what promotion compares
    model: dict[str, Any]  # models.describe(): name, options, the data it was built for
    task: dict[str, Any]  # the run's task settings
    data: dict[str, Any]  # the split's schema: input schema, classes, preprocessing statistics
    files: dict[str, FileEntry]
    created_at: str
    registered_by: str


class Evidence(Document):
    """Why an alias moved: the rule that decided and the two versions' monitored values."""

    rule: str  # "manual", "rollback", or the rule an automatic promotion applied
    metric: str | None = None
    mode: str | None = None  # "max" | "min"
    from_value: float | None = None  # the version the alias left
    to_value: float | None = None  # the version it now points at
    detail: dict[str, Any] = Field(default_factory=dict)


class AliasChange(Document):
    """`history/<seq:08d>.json`: one change of one alias, never rewritten."""

    seq: int
    alias: str
    action: Literal["promote", "rollback"]
    from_version: int | None
    to_version: int
    at: str  # ISO UTC
    by: str  # a flow run (flow-run:<id>), or cli:<user>@<host>
    evidence: Evidence
    reverts: int | None = None  # a rollback: the seq of the change it undoes
    # The writer's own mark: a PUT retried after its reply was lost finds its entry (412).
    token: str


class AliasesDoc(Document):
    """`aliases.json`: alias -> version as of history entry `seq` (0: no history yet)."""

    name: str
    aliases: dict[str, int]
    seq: int
    updated_at: str


# --- names and keys ---------------------------------------------------


def check_name(name: str, what: str = "model name") -> str:
    if not NAME.fullmatch(name):
        raise TrainyardError(
            f"{what} {name!r} is not valid: use letters, digits, '-' and '_' (at most 64, "
            "starting with a letter or digit)"
        )
    return name


def _root(name: str) -> str:
    return f"registry/{check_name(name)}"


def _version_key(name: str, version: int) -> str:
    return f"{_root(name)}/versions/{version}"


def _history_key(name: str, seq: int) -> str:
    return f"{_root(name)}/history/{seq:08d}.json"


def version_uri(store: Store, name: str, version: int) -> str:
    """What `loading.load_model` and `checkpoint.load_checkpoint` take."""
    return store.uri(_version_key(name, version))


def now() -> str:
    # Milliseconds: two changes within a second must still order when asked "who at T".
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def actor(by: str | None = None) -> str:
    """Who makes a change: `by` if given, else the Prefect flow run we are inside, else
    user@host."""
    if by:
        return by
    flow_run = os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run:
        return f"flow-run:{flow_run}"
    return user_at_host()


def user_at_host() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"

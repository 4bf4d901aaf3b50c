"""Continuing a run id: the run keeps the settings it was started with.

`trainyard run --run-id ID` on a run that has a record builds its settings from that record,
not from params.yaml. A few keys may change on a resume because they change how long or
how watchfully the run goes on, not what it learns: `train.epochs` (only upwards, to extend
the run), the timeouts and restart budget, tracking, straggler detection, and where the
store is. Any other change is refused in one line; the allowed ones are returned so the
record can list them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from trainyard.config import TrainyardConfig, apply_override, config_from_dict
from trainyard.errors import ConfigError
from trainyard.runs.record import RunRecord

RESUMABLE_KEYS = (
    "train.epochs",
    "train.timeout_s",
    "train.hang_timeout_s",
    "train.max_restarts",
    "train.gpus",  # which GPUs, not what runs on them: a resumed sweep trial may get others
    "checkpoint.upload_timeout_s",
    "checkpoint.on_interrupt",  # what an interrupt keeps, not what the run learns
    "checkpoint.interrupt_grace_s",
)
# Whole sections that never change what a run learns: how it is watched (tracking,
# stragglers), where it is stored, the sweep it may belong to, the registry it may be
# published to and how.
RESUMABLE_SECTIONS = (
    "tracking",
    "stragglers",
    "storage",
    "sweep",
    "registry",
    "promote",
    "retrain",
    "inference",
)


def resumable(key: str) -> bool:
    return key in RESUMABLE_KEYS or key.split(".", 1)[0] in RESUMABLE_SECTIONS


def flatten(
    params: dict[str, Any], prefix: str = "", whole: tuple[str, ...] = ("options",)
) -> dict[str, Any]:
    """`section.key -> value`; mappings named in `whole` (a model's options) stay one value."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict) and value and key not in whole:
            flat |= flatten(value, f"{prefix}{key}.", whole)
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_hash(params: dict[str, Any]) -> str:
    """A hash of the settings a resume may not change: checkpoints carry it in their
    manifest, and continuing a run compares it."""
    fixed = {k: v for k, v in flatten(params).items() if not resumable(k)}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def continued_config(
    run_id: str, stored: dict[str, Any], overrides: list[str], storage: dict[str, Any]
) -> TrainyardConfig:
    """The stored settings with `-S` overrides, refusing any a resume may not change.
    `storage` (where the record was found) always comes from the caller."""
    raw = json.loads(json.dumps(stored))
    raw["storage"] = storage
    for override in overrides:
        key = override.partition("=")[0]
        if not resumable(key):
            raise ConfigError(_refusal(run_id, key))
        apply_override(raw, override)
    config = config_from_dict(raw, source=f"run {run_id}")
    changes(run_id, stored, config)  # epochs only upwards
    return config


def changes(run_id: str, stored: dict[str, Any], config: TrainyardConfig) -> dict[str, list[Any]]:
    """{key: [stored, now]} for every setting that differs; refuses the ones that may not."""
    before = flatten(stored)
    after = flatten(config.model_dump(mode="json"))
    differ: dict[str, list[Any]] = {
        k: [before.get(k), after.get(k)]
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k) and not k.startswith("storage.")
    }
    for key in differ:
        if not resumable(key):
            raise ConfigError(_refusal(run_id, key))
    epochs = differ.get("train.epochs")
    if epochs and epochs[1] < epochs[0]:
        raise ConfigError(
            f"train.epochs = {epochs[1]}: run {run_id} was set to {epochs[0]} epochs; "
            "a resume may extend a run but not shorten it; start a new --run-id instead"
        )
    return differ


def _refusal(run_id: str, key: str) -> str:
    return (
        f"-S {key}: run {run_id} continues with the settings stored in its record, and "
        f"{key} cannot change on a resume (allowed: {', '.join(RESUMABLE_KEYS)}, "
        f"{', '.join(s + '.*' for s in RESUMABLE_SECTIONS)}); to change it start a new "
        f"--run-id, e.g. with --resume-from {run_id} --warm-start"
    )


def check_work_left(previous: RunRecord, changed: dict[str, list[Any]]) -> None:
    """A completed run continued without more epochs would train nothing; say so instead of
    marking it completed again."""
    if previous.status == "completed" and "train.epochs" not in changed:
        epochs = previous.params.get("train", {}).get("epochs")
        raise ConfigError(
            f"run {previous.run_id} is already completed ({epochs} epochs); nothing is left to "
            f"train: extend it with -S train.epochs=N (more than {epochs}) or start a new --run-id"
        )

"""Aliases and their history: each change is one entry appended with a create-if-absent,
decided on the history as it stands; aliases.json caches what the history adds up to."""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Callable
from typing import Any

from trainyard.errors import TrainyardError
from trainyard.registry.documents import (
    AliasChange,
    AliasesDoc,
    Evidence,
    VersionInfo,
    _history_key,
    _root,
    actor,
    check_name,
    now,
)
from trainyard.registry.versions import read_version
from trainyard.storage import Store
from trainyard.util.documents import Skipped, UnreadableDocument, read_each, read_model

log = logging.getLogger(__name__)

DEFAULT_ALIAS = "champion"
APPEND_TRIES = 20  # re-decisions after losing a race; each loser re-reads, so few are needed


def read_history(store: Store, name: str, skipped: Skipped | None = None) -> list[AliasChange]:
    """Every alias change of `name`, in order: the truth that aliases.json caches. A damaged
    entry raises `UnreadableDocument` (a writer must never decide on a partial history);
    a reader that passes `skipped` gets the readable entries and the damaged ones there."""
    prefix = f"{_root(name)}/history"
    keys = sorted(k for k in store.list_files(prefix) if k.endswith(".json"))
    entries = read_each(keys, lambda key: read_model(store, key, AliasChange), skipped)
    if skipped is None:
        assert [e.seq for e in entries] == list(range(1, len(entries) + 1)), "history has a gap"
    return entries


def alias_stacks(entries: list[AliasChange]) -> dict[str, list[int]]:
    """alias -> the versions it was promoted through, still standing (the last is current):
    a promotion pushes, a rollback pops, so rollbacks walk back one promotion at a time."""
    stacks: dict[str, list[int]] = {}
    for entry in entries:
        stack = stacks.setdefault(entry.alias, [])
        if entry.action == "promote":
            stack.append(entry.to_version)
        elif stack:  # a reader may have skipped the damaged promotion this one undoes
            stack.pop()
    return stacks


def aliases_of(entries: list[AliasChange]) -> dict[str, int]:
    return {alias: stack[-1] for alias, stack in alias_stacks(entries).items() if stack}


def alias_at(entries: list[AliasChange], alias: str, when: str) -> AliasChange | None:
    """The change that put `alias` where it was at ISO time `when` (None: not set yet)."""
    moment = parse_time(when)
    current = None
    for entry in entries:
        if entry.alias == alias and parse_time(entry.at) <= moment:
            current = entry
    return current


def parse_time(text: str) -> dt.datetime:
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise TrainyardError(
            f"{text!r} is not an ISO time; use e.g. 2026-11-23T10:00:00Z"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)  # naive means UTC


def promote(
    store: Store,
    name: str,
    version: int,
    alias: str = DEFAULT_ALIAS,
    by: str | None = None,
    evidence: Evidence | None = None,
) -> AliasChange:
    """Point `alias` at `version`. Without `evidence` the change is manual: the rule is
    "manual" and the two versions' monitored values are recorded beside it."""
    check_name(alias, "alias")
    target = read_version(store, name, version)

    def plan(entries: list[AliasChange]) -> dict[str, Any]:
        current = aliases_of(entries).get(alias)
        if current == version:
            raise TrainyardError(f"{name}:{alias} already points at version {version}")
        return {
            "action": "promote",
            "from_version": current,
            "to_version": version,
            "evidence": evidence or _evidence(store, name, "manual", current, target),
        }

    return _append(store, name, alias, plan, actor(by))


def rollback(
    store: Store, name: str, alias: str = DEFAULT_ALIAS, by: str | None = None
) -> AliasChange:
    """Point `alias` back at the version it pointed to before its latest promotion."""
    check_name(alias, "alias")

    def plan(entries: list[AliasChange]) -> dict[str, Any]:
        stack = alias_stacks(entries).get(alias, [])
        if len(stack) < 2:
            where = f"version {stack[-1]}" if stack else "no version"
            raise TrainyardError(
                f"{name}:{alias} points at {where} and has no earlier version to roll back to; "
                f"see `trainyard models history {name}`"
            )
        undone = next(
            e
            for e in reversed(entries)
            if e.alias == alias and e.action == "promote" and e.to_version == stack[-1]
        )
        target = read_version(store, name, stack[-2])
        return {
            "action": "rollback",
            "from_version": stack[-1],
            "to_version": stack[-2],
            "evidence": _evidence(store, name, "rollback", stack[-1], target),
            "reverts": undone.seq,
        }

    return _append(store, name, alias, plan, actor(by))


def _evidence(
    store: Store, name: str, rule: str, current: int | None, target: VersionInfo
) -> Evidence:
    monitor = target.monitor or {}
    before = read_version(store, name, current).monitor if current is not None else None
    return Evidence(
        rule=rule,
        metric=monitor.get("name"),
        mode=monitor.get("mode"),
        from_value=(before or {}).get("value"),
        to_value=monitor.get("value"),
    )


def _append(
    store: Store,
    name: str,
    alias: str,
    plan: Callable[[list[AliasChange]], dict[str, Any]],
    by: str,
) -> AliasChange:
    """Append one history entry, deciding (`plan`) on the history as it is at that moment.

    The entry's key is the next seq, created only if absent: of two writers racing, one
    creates it, the other sees the winner's entry when it re-reads and decides again (its
    `from_version` is then the winner's `to_version`)."""
    token = secrets.token_hex(8)
    for _ in range(APPEND_TRIES):
        entries = read_history(store, name)
        seq = len(entries) + 1
        entry = AliasChange(seq=seq, alias=alias, at=now(), by=by, token=token, **plan(entries))
        key = _history_key(name, seq)
        if store.create_json(key, entry.model_dump(mode="json")):
            refresh_aliases(store, name)
            return entry
        theirs = AliasChange.model_validate(store.read_json(key))
        if theirs.token == token:  # ours: the first reply was lost and the retry got 412
            refresh_aliases(store, name)
            return theirs
        log.info(
            "%s: history entry %d was written by %s first; deciding again", name, seq, theirs.by
        )
    raise TrainyardError(
        f"{name}:{alias} is changing too often to record this change ({APPEND_TRIES} tries); "
        "try again"
    )


def refresh_aliases(store: Store, name: str) -> AliasesDoc:
    """Rebuild aliases.json from the history, then re-read it: a slower writer may have
    put an older cache over ours, in which case it is written again."""
    key = f"{_root(name)}/aliases.json"
    for _ in range(5):
        entries = read_history(store, name)
        doc = AliasesDoc(name=name, aliases=aliases_of(entries), seq=len(entries), updated_at=now())
        store.write_json(key, doc.model_dump(mode="json"))
        back = AliasesDoc.model_validate(store.read_json(key))
        if back.seq >= doc.seq:
            return back
    return doc


def read_aliases(store: Store, name: str, skipped: Skipped | None = None) -> dict[str, int]:
    """alias -> version: from aliases.json in one read when it is current (no history
    entry after the one it reflects), else folded from the history. A damaged aliases.json
    is only a cache: the history answers (with `skipped`, the damage is reported there)."""
    try:
        doc = read_model(store, f"{_root(name)}/aliases.json", AliasesDoc)
    except FileNotFoundError:
        doc = None
    except UnreadableDocument as exc:
        if skipped is None:
            log.warning("%s", exc)
        else:
            skipped.add(exc)
        doc = None
    if doc is not None and not store.exists(_history_key(name, doc.seq + 1)):
        return doc.aliases
    return aliases_of(read_history(store, name, skipped))


def resolve(store: Store, name: str, alias_or_version: str) -> int:
    """A version number from "3" or an alias such as "champion"."""
    if alias_or_version.isdigit():
        return read_version(store, name, int(alias_or_version)).version
    aliases = read_aliases(store, name)
    if alias_or_version not in aliases:
        raise TrainyardError(
            f"model {name!r} has no alias {alias_or_version!r} "
            f"(aliases: {', '.join(sorted(aliases)) or 'none'})"
        )
    return aliases[alias_or_version]

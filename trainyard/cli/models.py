"""`trainyard models list | show | register | promote | rollback | history`: the model
registry's command line (the registry itself is trainyard.registry)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.util.documents import Skipped, printable

if TYPE_CHECKING:
    from trainyard.registry import AliasChange
    from trainyard.storage import Store

NAME_HELP = "the model (default: registry.model_name)"


def add_models_commands(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser(
        "models", help="the model registry: versions, aliases (champion, ...) and their history"
    )
    actions = models.add_subparsers(dest="models_command", required=True)
    listing = actions.add_parser("list", help="registered models, their versions and aliases")
    listing.add_argument("--json", action="store_true")
    show = actions.add_parser("show", help="a model's versions, aliases and alias history")
    show.add_argument("name", nargs="?", help=NAME_HELP)
    show.add_argument("--json", action="store_true")
    register = actions.add_parser(
        "register", help="copy a completed run's final checkpoint into a new version"
    )
    register.add_argument("run_id")
    register.add_argument("--name", help=NAME_HELP)
    promote = actions.add_parser("promote", help="point an alias at a version")
    promote.add_argument("name")
    promote.add_argument("version", type=int)
    promote.add_argument("--alias", default="champion")
    rollback = actions.add_parser(
        "rollback", help="point an alias back at the version it pointed to before"
    )
    rollback.add_argument("name", nargs="?", help=NAME_HELP)
    rollback.add_argument("--alias", default="champion")
    history = actions.add_parser(
        "history", help="every alias change: from, to, when, by whom, and why"
    )
    history.add_argument("name", nargs="?", help=NAME_HELP)
    history.add_argument(
        "--at", metavar="ISO_TIME", help="only where each alias pointed at that time, and why"
    )
    history.add_argument("--json", action="store_true")


def cmd_models(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard import registry
    from trainyard.storage import connect

    store = connect(config.storage, paths)
    name = registry.check_name(getattr(args, "name", None) or config.registry.model_name)
    by = f"cli:{registry.user_at_host()}"
    command = args.models_command
    skipped = Skipped()  # damaged documents the listings leave out: one warning each
    if command == "list":
        rows = [_summary(store, model, skipped) for model in registry.list_models(store)]
        print(json.dumps(rows, indent=2) if args.json else _list_text(rows))
    elif command == "show":
        shown = show(store, name, skipped)
        print(json.dumps(shown, indent=2) if args.json else _show_text(shown))
    elif command == "register":
        info = registry.register(store, args.run_id, name, by=by, tracking=config.tracking)
        uri = registry.version_uri(store, name, info.version)
        print(f"run {info.run_id} registered as {name} version {info.version} ({uri})")
    elif command in ("promote", "rollback"):
        if command == "promote":
            change = registry.promote(store, name, args.version, args.alias, by=by)
        else:
            change = registry.rollback(store, name, args.alias, by=by)
        print(_change_text(name, change))
    else:
        _history(store, name, args.at, args.json, skipped)
    for line in skipped.lines():
        print(f"trainyard: warning: {line}", file=sys.stderr)
    return 0


def show(store: Store, name: str, skipped: Skipped | None = None) -> dict[str, Any]:
    """What `models show --json` prints; damaged documents are left out into `skipped`."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.registry import aliases_of, list_versions, read_history

    skipped = Skipped() if skipped is None else skipped
    versions = list_versions(store, name, skipped)
    history = read_history(store, name, skipped)
    if not versions and not history and not skipped:
        raise TrainyardError(
            f"no model {name!r} in {store.uri('registry')}; register a run with "
            f"`trainyard models register RUN_ID --name {name}`"
        )
    return {
        "name": name,
        "versions": [
            {
                "version": v.version,
                "run_id": v.run_id,
                "dataset_md5": v.dataset_md5,
                "metrics": v.metrics,
                "monitor": v.monitor,
                "created_at": v.created_at,
            }
            for v in versions
        ],
        "aliases": aliases_of(history),
        "history": [_public(entry) for entry in history],
    }


def _summary(store: Store, name: str, skipped: Skipped) -> dict[str, Any]:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.registry import read_aliases, version_numbers

    return {
        "name": name,
        "versions": version_numbers(store, name),
        "aliases": read_aliases(store, name, skipped),
    }


def _history(store: Store, name: str, at: str | None, as_json: bool, skipped: Skipped) -> None:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.registry import alias_at, parse_time, read_history

    if at is not None:
        parse_time(at)  # refused before anything is read
    entries = read_history(store, name, skipped)
    if at is not None:
        aliases = sorted({e.alias for e in entries})
        entries = [e for e in (alias_at(entries, a, at) for a in aliases) if e is not None]
    if as_json:
        print(json.dumps([_public(e) for e in entries], indent=2))
    elif not entries:
        print(f"{name}: no alias {'was set at ' + at if at else 'has been set yet'}")
    else:
        print("\n".join(_change_text(name, e) for e in entries))


def _public(entry: AliasChange) -> dict[str, Any]:
    return entry.model_dump(mode="json", exclude={"token"})


def _change_text(name: str, change: AliasChange) -> str:
    ev = change.evidence
    before = "(none)" if change.from_version is None else f"v{change.from_version}"
    why = ev.rule
    if ev.metric:
        why += f", {ev.metric} {_num(ev.from_value)} -> {_num(ev.to_value)}"
    return printable(  # a document's text never drives the terminal
        f"#{change.seq} {change.at} {name}:{change.alias} {before} -> v{change.to_version} "
        f"({change.action} by {change.by}; {why})"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _list_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no models registered; see `trainyard models register RUN_ID`"
    lines = []
    for row in rows:
        aliases = ", ".join(f"{a}=v{v}" for a, v in sorted(row["aliases"].items())) or "-"
        lines.append(f"{row['name']:<24} {len(row['versions']):>3} versions  aliases: {aliases}")
    return "\n".join(map(printable, lines))


def _show_text(shown: dict[str, Any]) -> str:
    by_version: dict[int, list[str]] = {}
    for alias, version in shown["aliases"].items():
        by_version.setdefault(version, []).append(alias)
    lines = [f"model {shown['name']}"]
    for v in shown["versions"]:
        monitor = v["monitor"] or {}
        value = f"{monitor.get('name')}={_num(monitor.get('value'))}" if monitor else "-"
        tags = ", ".join(sorted(by_version.get(v["version"], [])))
        lines.append(
            f"  v{v['version']:<4} run {v['run_id']:<24} {value:<24} {v['created_at']}"
            + (f"  [{tags}]" if tags else "")
        )
    if shown["history"]:
        lines.append(f"  {len(shown['history'])} alias changes; see `trainyard models history`")
    return "\n".join(map(printable, lines))

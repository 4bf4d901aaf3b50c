"""`trainyard report` and `trainyard ui`: the comparison page, as a file or served locally."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.report.links import UI_HOST, UI_PORT
from trainyard.util.files import write_text_atomic

if TYPE_CHECKING:
    from trainyard.report.data import ReportData
    from trainyard.storage import Store

REPORT_COMMANDS = ("report", "ui")


def add_report_commands(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="write the comparison page (runs, curves, differences, registry, sweeps) as one "
        "self-contained HTML file that opens offline",
    )
    report.add_argument(
        "run_ids", nargs="*", metavar="RUN_ID", help="default: every run; the page opens on these"
    )
    report.add_argument("--sweep", metavar="ID", help="only this sweep's trials")
    report.add_argument("-o", "--output", required=True, type=Path, metavar="FILE.html")
    ui = commands.add_parser(
        "ui",
        help="serve the comparison page at http://HOST:PORT/ until Ctrl-C; it follows running runs",
    )
    ui.add_argument(
        "run_ids",
        nargs="*",
        metavar="RUN_ID",
        help="ticked when the page opens (every run is shown)",
    )
    ui.add_argument("--host", default=UI_HOST, help=f"default {UI_HOST} (this machine only)")
    ui.add_argument(
        "--port", type=int, default=UI_PORT, help=f"default {UI_PORT}; 0 picks a free one"
    )


def cmd_report(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.report.data import RecordCache, build_report_data
    from trainyard.report.page import render_page
    from trainyard.report.server import make_server
    from trainyard.storage import connect
    from trainyard.sweeps.study import ReadableStorages

    target = _html_target(args.output) if args.command == "report" else None
    store = connect(config.storage, paths)
    # A sweep record names its study's storage, and anyone who can write to the store can
    # plant one: only the storages this project configures are opened, read-only.
    storages = ReadableStorages.of_project(config.sweep, paths)
    live = paths.staging  # a running run's curves so far, when it trains on this machine
    if target is not None:
        data = build_report_data(
            store, args.run_ids or None, args.sweep, storages=storages, staging=live
        )
        warn_skipped(data, set())
        page = render_page(data)
        write_text_atomic(target, page)  # a browser open on the old file never reads half
        print(f"wrote {args.output}: {len(data.runs)} runs, {len(page) / 1e6:.1f} MB")
        return 0
    selected = _known_runs(store, args.run_ids)
    cache = RecordCache(store)  # each request reads only the records written since
    warned: set[str] = set()

    def build() -> ReportData:
        data = build_report_data(
            store, cache=cache, storages=storages, staging=live, selected=selected
        )
        warn_skipped(data, warned)
        return data

    try:
        server = make_server(args.host, args.port, build)
    except OSError as exc:
        raise TrainyardError(f"cannot serve on {args.host}:{args.port}: {exc.strerror}") from None
    host, port = cast(tuple[str, int], server.server_address[:2])  # an AF_INET server
    print(f"serving the comparison page at http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0


def _known_runs(store: Store, run_ids: list[str]) -> list[str]:
    """The runs `ui` opens on, checked before it serves: a mistyped id is one clear line."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import check_run_id, load_record

    for run_id in run_ids:
        load_record(store, check_run_id(run_id))
    return list(dict.fromkeys(run_ids))


def warn_skipped(data: ReportData, warned: set[str]) -> None:
    """One warning per damaged document, not one per request of a page left open."""
    for doc in data.skipped:
        if doc.uri not in warned:
            warned.add(doc.uri)
            print(f"trainyard: warning: skipped {doc.uri}: {doc.reason}", file=sys.stderr)


def _html_target(output: Path) -> Path:
    """Checked before the store is read: a mistake costs nothing."""
    target = output.resolve()
    if target.suffix.lower() not in (".html", ".htm"):
        raise TrainyardError(f"-o {output}: name an .html file")
    if target.is_dir() or not target.parent.is_dir():
        raise TrainyardError(f"-o {output}: folder {target.parent} does not exist")
    return target

"""`trainyard tracking upload [RUN_ID]`: the offline Comet archives of a run (or of every
run) sent to the Comet server once it is reachable, each at most once.

An archive that uploads moves to `uploaded/` beside it, so running the command again sends
only what is left; one that fails stays where it was, and the command says so and exits 1."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths

UPLOADED = "uploaded"


def add_tracking_commands(commands: argparse._SubParsersAction) -> None:
    tracking = commands.add_parser("tracking", help="Comet experiments the runs logged offline")
    actions = tracking.add_subparsers(dest="tracking_command", required=True)
    upload = actions.add_parser(
        "upload",
        help="upload offline archives (.trainyard/comet/RUN_ID/*.zip) with COMET_API_KEY",
    )
    upload.add_argument("run_id", nargs="?", metavar="RUN_ID", help="default: every run")


def cmd_tracking(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    archives = pending_archives(paths, args.run_id)
    api_key = os.environ.get("COMET_API_KEY")
    if not api_key:
        raise TrainyardError(
            f"COMET_API_KEY is not set: set it to upload the {len(archives)} offline archive(s) "
            "(they stay where they are until then)"
        )
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.util.comet import quiet_comet

    quiet_comet()  # a user's upload reports nothing to Comet's Sentry either
    from comet_ml.exceptions import InvalidAPIKey
    from comet_ml.offline import upload_single_offline_experiment

    logging.getLogger("comet_ml").setLevel(logging.CRITICAL)  # our own line per archive
    failed = 0
    for archive in archives:
        try:
            uploaded = upload_single_offline_experiment(
                str(archive), api_key, force_upload=False, display_level="error"
            )
        except InvalidAPIKey:
            raise TrainyardError(
                "COMET_API_KEY was refused by the Comet server; set a valid key"
            ) from None
        except Exception as exc:  # unreachable server, refused upload: keep it, go on
            uploaded, reason = False, _reason(exc).replace(api_key, "***")
        else:
            reason = "the server did not accept it (uploaded before? see Comet's project)"
        if uploaded:
            done = archive.parent / UPLOADED
            done.mkdir(exist_ok=True)
            archive.rename(done / archive.name)
            print(f"uploaded {archive.parent.name}/{archive.name}")
        else:
            failed += 1
            print(f"not uploaded {archive.parent.name}/{archive.name}: {reason}", file=sys.stderr)
    print(f"{len(archives) - failed} of {len(archives)} archive(s) uploaded")
    return 1 if failed else 0


def pending_archives(paths: ProjectPaths, run_id: str | None) -> list[Path]:
    """The archives not uploaded yet, oldest run first; a run with none is refused."""
    from trainyard.runs.record import check_run_id  # imports the store's client: not at start-up

    if run_id is not None:
        folders = [paths.comet / check_run_id(run_id)]
    else:
        folders = sorted(p for p in paths.comet.glob("*") if p.is_dir())
    archives = [zip_ for folder in folders for zip_ in sorted(folder.glob("*.zip"))]
    if not archives:
        whose = f"run {run_id}" if run_id else "any run"
        raise TrainyardError(
            f"no offline Comet archives of {whose} left to upload in {paths.comet} "
            f"(uploaded ones are in <run>/{UPLOADED}/)"
        )
    return archives


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__

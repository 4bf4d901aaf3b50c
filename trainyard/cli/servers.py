"""`trainyard storage up | down | status`, `trainyard down`, `trainyard status`: the servers
that outlive commands, the embedded store and the project's Prefect server."""

from __future__ import annotations

import argparse
import os

from trainyard.config import TrainyardConfig
from trainyard.project import ProjectPaths

SERVER_COMMANDS = ("down", "status")


def add_storage_command(commands: argparse._SubParsersAction) -> None:
    storage = commands.add_parser("storage", help="the embedded S3 artifact store")
    storage.add_argument("action", choices=["up", "down", "status"])


def add_server_commands(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("down", help="stop the project's servers: the store and Prefect's")
    commands.add_parser("status", help="the project's servers: the store and Prefect's")


def cmd_storage(paths: ProjectPaths, config: TrainyardConfig | None, action: str) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.storage.embedded import EmbeddedS3

    server = EmbeddedS3(paths.s3_server)
    if action == "up":
        # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
        from trainyard.storage import connect

        assert config is not None  # read for `up`, the one action that starts the store
        store = connect(config.storage, paths)
        print(f"artifact store up: {store.settings.where}")
    elif action == "down":
        print("embedded store stopped" if server.down() else "embedded store was not running")
    else:
        state = server.status()
        if state:
            print(
                f"embedded store running: {state.endpoint} (pid {state.pid}, data in {server.home / 'data'})"
            )
        else:
            print("embedded store not running (`trainyard storage up` starts it)")
            return 3
    return 0


def cmd_servers(paths: ProjectPaths, action: str) -> int:
    """`down` stops, `status` shows, the servers that outlive commands: the embedded store
    and the project's Prefect server."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.cli.prefect_server import PrefectServer, home_of

    prefect = PrefectServer(home_of(paths))
    if action == "down":
        print("Prefect server stopped" if prefect.down() else "Prefect server was not running")
        return cmd_storage(paths, None, "down")
    state = prefect.status()
    if os.environ.get("PREFECT_API_URL"):
        print(f"Prefect API set by PREFECT_API_URL: {os.environ['PREFECT_API_URL']}")
    elif state:
        print(f"Prefect server running: UI {state.ui_url} (pid {state.pid}, home {prefect.home})")
    else:
        print("Prefect server not running (the next command that needs it starts it)")
    cmd_storage(paths, None, "status")
    return 0

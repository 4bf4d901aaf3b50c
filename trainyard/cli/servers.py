"""`trainyard storage up | down | status | env`, `trainyard down`, `trainyard status`: the servers
that outlive commands, the embedded store and the project's Prefect server."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from trainyard.config import TrainyardConfig
from trainyard.errors import ConfigError
from trainyard.project import ProjectPaths

if TYPE_CHECKING:
    from trainyard.storage.embedded import EmbeddedS3

SERVER_COMMANDS = ("down", "status")


def add_storage_command(commands: argparse._SubParsersAction) -> None:
    storage = commands.add_parser(
        "storage",
        help="the embedded S3 artifact store",
        description="up: start the embedded store (on loopback, or on --host ADDR for other "
        "machines); down: stop it; status: show it; env: print the lines another machine "
        "exports to reach it. `env` prints the store's secret key to stdout, on purpose and "
        "only there (never to a log or record): pipe it to the other machine, do not "
        "commit or paste it.",
    )
    storage.add_argument("action", choices=["up", "down", "status", "env"])
    storage.add_argument(
        "--host",
        metavar="ADDR",
        help="with `up`: serve the store on ADDR, an IPv4 address of this machine that other "
        "machines reach (default: loopback only); the store's credentials are required as on "
        "loopback",
    )


def add_server_commands(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("down", help="stop the project's servers: the store and Prefect's")
    commands.add_parser("status", help="the project's servers: the store and Prefect's")


def cmd_storage(
    paths: ProjectPaths, config: TrainyardConfig | None, action: str, host: str | None = None
) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.storage.embedded import EmbeddedS3

    if host is not None and action != "up":
        raise ConfigError(f"--host is for `trainyard storage up`, not `storage {action}`")
    server = EmbeddedS3(paths.s3_server)
    if action == "up":
        # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
        from trainyard.storage import connect

        assert config is not None  # read for `up`, the one action that starts the store
        store = connect(config.storage, paths, serve_on=host)
        print(f"artifact store up: {store.settings.where}")
    elif action == "env":
        _print_env(server)
    elif action == "down":
        print("embedded store stopped" if server.down() else "embedded store was not running")
    else:
        state = server.status()
        if state:
            print(
                f"embedded store running: {state.endpoint} (pid {state.pid}, data in {server.home / 'data'})"
            )
        elif (silent := server.recorded()) is not None:
            print(
                f"embedded store (pid {silent.pid}) runs but does not answer at "
                f"{silent.endpoint}; `trainyard storage down` stops it"
            )
            return 3
        else:
            print("embedded store not running (`trainyard storage up` starts it)")
            return 3
    return 0


def _print_env(server: EmbeddedS3) -> None:
    """The other machine's environment lines, secret included, to stdout alone; the
    project's checkpoint signing key made if it is not yet, and where it is, to stderr."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.checkpoint.signing import key_file, project_key
    from trainyard.storage.sharing import export_lines, loopback_only, other_machine_env

    env = other_machine_env(server)
    project_key(create=True)  # the other machines' nodes check they hold this same key
    print(
        f"note: copy {key_file()} to the same place in the project on every other machine "
        "(mode 0600): checkpoints are signed and checked with it",
        file=sys.stderr,
    )
    if loopback_only(server):
        print(
            "note: the store serves loopback only, so other machines cannot reach it: "
            "`trainyard storage down`, then `trainyard storage up --host ADDR`",
            file=sys.stderr,
        )
    print("\n".join(export_lines(env)))


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
        # Prefect's own CLI, in a shell without it, starts a throwaway server of its own.
        print(f"  export PREFECT_API_URL={state.api_url}  # for Prefect's own CLI")
    else:
        print("Prefect server not running (the next command that needs it starts it)")
    cmd_storage(paths, None, "status")
    return 0

"""The `trainyard` command. Imports flows (and so Prefect) only for commands that run them."""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import sys
import threading

from trainyard import __version__
from trainyard.cli.console import ERROR_LINE_MAX, error_line
from trainyard.cli.deploy import DEPLOY_COMMANDS, add_deploy_commands, cmd_deploy
from trainyard.cli.join import add_join_command, cmd_join
from trainyard.cli.models import add_models_commands, cmd_models
from trainyard.cli.predict import add_predict_command, cmd_predict
from trainyard.cli.report import REPORT_COMMANDS, add_report_commands, cmd_report
from trainyard.cli.run import add_prepare_command, add_run_command, cmd_prepare, cmd_run
from trainyard.cli.runs import add_runs_commands, cmd_runs
from trainyard.cli.servers import (
    SERVER_COMMANDS,
    add_server_commands,
    add_storage_command,
    cmd_servers,
    cmd_storage,
)
from trainyard.cli.session import FlowInterrupted
from trainyard.cli.sweep import add_sweep_commands, cmd_sweep
from trainyard.cli.tracking import add_tracking_commands, cmd_tracking
from trainyard.config import TrainyardConfig, load_config
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.runtime.worker_lines import ALL_RANKS_ENV

__all__ = ["ERROR_LINE_MAX", "build_parser", "error_line", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"trainyard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_command(commands)
    add_join_command(commands)
    add_runs_commands(commands)
    add_storage_command(commands)
    add_server_commands(commands)
    add_prepare_command(commands)
    add_sweep_commands(commands)
    add_models_commands(commands)
    add_predict_command(commands)
    add_deploy_commands(commands)
    add_report_commands(commands)
    add_tracking_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Registered first, so it runs last: the interpreter's final garbage collection over
    # torch, Prefect and pydantic objects took 3 s at the end of every command.
    atexit.register(gc.freeze)
    try:
        try:
            return _command(argv)
        finally:
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
    except BrokenPipeError:
        return _stdout_closed()


def _command(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    paths = ProjectPaths.here()
    _exit_cleanly_on_sigterm()
    try:
        paths.make_state_private()  # before anything is written there, and again after
        config = None
        if args.command not in ("storage", *SERVER_COMMANDS) or getattr(args, "action", "") == "up":
            # Settings first, before a command imports the engine (torch alone takes seconds).
            config = load_config(paths.params, getattr(args, "overrides", None))
        return _dispatch(paths, args, config)
    except TrainyardError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except FlowInterrupted as stopped:  # its line, saying how to continue, is printed
        return stopped.code
    except KeyboardInterrupt:
        print("trainyard: interrupted", file=sys.stderr)
        return 130
    finally:
        paths.make_state_private()  # the first command of a project made it just now


def _dispatch(paths: ProjectPaths, args: argparse.Namespace, config: TrainyardConfig | None) -> int:
    if getattr(args, "all_ranks", False):
        os.environ[ALL_RANKS_ENV] = "1"  # read where the workers' lines reach the console
    if args.command in ("storage", *SERVER_COMMANDS):
        if args.command == "storage":
            return cmd_storage(paths, config, args.action, args.host)
        return cmd_servers(paths, args.command)
    assert config is not None  # read for every other command
    if args.command == "run":
        return cmd_run(
            paths,
            config,
            args.overrides,
            args.run_id,
            args.resume_from,
            args.warm_start,
            args.metrics_file,
        )
    if args.command == "join":
        return cmd_join(paths, config, args.run_id)
    if args.command == "runs":
        return cmd_runs(paths, config, args)
    if args.command == "prepare":
        return cmd_prepare(paths, config, args.overrides)
    if args.command == "sweep":
        return cmd_sweep(paths, config, args)
    if args.command == "models":
        return cmd_models(paths, config, args)
    if args.command == "predict":
        return cmd_predict(paths, config, args)
    if args.command in DEPLOY_COMMANDS:
        return cmd_deploy(paths, config, args)
    if args.command in REPORT_COMMANDS:
        return cmd_report(paths, config, args)
    if args.command == "tracking":
        return cmd_tracking(paths, config, args)
    raise AssertionError(f"unhandled command {args.command}")


def _stdout_closed() -> int:
    """The reader of stdout went away (`trainyard runs list | head -1`): stop quietly, as
    other tools do. stdout is pointed at devnull so Python's flush at exit cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE  # 141, what a shell reports for a command SIGPIPE ended


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM (a cancelled deployment, `kill`) ends the command through a normal interpreter
    exit, so clean-up runs: the torchrun tree is killed and the flow run reports how it
    ended. Prefect re-sends SIGTERM to the handler it found; with the default one the
    process died at once."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Imported here: the interruption handling imports the engine's launcher (start-up cost).
    from trainyard.cli.interrupts import quiet

    quiet()
    sys.exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())

"""The `trainyard` command. Imports flows (and so Prefect) only for commands that run them."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard import __version__
from trainyard.cli.console import ALL_RANKS_ENV, WorkerLines, command_seconds, print_stamped
from trainyard.cli.deploy import DEPLOY_COMMANDS, add_deploy_commands, cmd_deploy
from trainyard.cli.models import add_models_commands, cmd_models
from trainyard.cli.predict import add_predict_command, cmd_predict
from trainyard.cli.report import REPORT_COMMANDS, add_report_commands, cmd_report
from trainyard.cli.sweep import add_sweep_commands, cmd_sweep
from trainyard.cli.tracking import add_tracking_commands, cmd_tracking
from trainyard.config import TrainyardConfig, load_config
from trainyard.errors import TrainyardError, WorkerFailed
from trainyard.project import ProjectPaths
from trainyard.storage.documents import Skipped, printable
from trainyard.util.files import write_text_atomic

if TYPE_CHECKING:
    from trainyard.storage import Store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description=__doc__)
    parser.add_argument("--version", action="version", version=f"trainyard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="run the training pipeline (Prefect flow training_pipeline)"
    )
    _add_overrides(run, "override a params.yaml value, e.g. -S train.workers=1 (repeatable)")
    run.add_argument(
        "--run-id",
        help="id for the run (default: timestamp + random suffix); an existing run with "
        "committed checkpoints continues from its latest (checkpoint.resume=auto)",
    )
    run.add_argument(
        "--resume-from",
        metavar="RUN_ID",
        help="continue another run's latest committed checkpoint (same data and model)",
    )
    run.add_argument(
        "--warm-start",
        action="store_true",
        help="with --resume-from: load its weights only (fresh optimizer and schedule)",
    )
    run.add_argument(
        "--metrics-file",
        metavar="PATH",
        type=Path,
        help="also write the finished run's metrics (and the monitored value as `monitor`) "
        "to PATH as JSON; the dvc.yaml train stage writes metrics.json this way",
    )
    _add_all_ranks(run)

    join = commands.add_parser(
        "join",
        help="on another machine: add this node's workers to a multi-node run that node 0 "
        "started with `trainyard run -S train.nnodes=N -S train.rdzv_endpoint=HOST:PORT`",
    )
    join.add_argument("--run-id", required=True, help="the run id node 0 was started with")
    _add_overrides(join, "as for run; at least -S train.node_rank=K")
    _add_all_ranks(join)

    _add_runs_commands(commands)
    storage = commands.add_parser("storage", help="the embedded S3 artifact store")
    storage.add_argument("action", choices=["up", "down", "status"])
    commands.add_parser("down", help="stop the project's servers: the store and Prefect's")
    commands.add_parser("status", help="the project's servers: the store and Prefect's")

    commands.add_parser(
        "prepare", help="split the dataset into data/processed (the dvc.yaml stage)"
    )
    add_sweep_commands(commands, _add_overrides)
    add_models_commands(commands)
    add_predict_command(commands, _add_overrides)
    add_deploy_commands(commands)
    add_report_commands(commands)
    add_tracking_commands(commands)
    return parser


def _add_runs_commands(commands: argparse._SubParsersAction) -> None:
    runs = commands.add_parser("runs", help="list or show recorded runs")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True)
    listing = runs_commands.add_parser("list", help="all runs, newest first")
    listing.add_argument("--json", action="store_true")
    show = runs_commands.add_parser("show", help="one run's record")
    show.add_argument("run_id")
    show.add_argument("--json", action="store_true")
    delete = runs_commands.add_parser(
        "delete", help="delete a run: its record, checkpoints, staging and Comet archives"
    )
    delete.add_argument("run_id")
    unlock = runs_commands.add_parser(
        "unlock",
        help="break a run's lease when its owner is gone for good: says whose it is; "
        "--yes breaks it",
    )
    unlock.add_argument("run_id")
    unlock.add_argument("--yes", action="store_true", help="break the lease")


def _add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def _add_all_ranks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--all-ranks",
        action="store_true",
        help="print every rank's lines (default: rank 0's, and any rank's warnings and errors; "
        "each rank's are in .trainyard/logs/RUN_ID/rank-N.log)",
    )


ERROR_LINE_MAX = 500  # characters; a refusal is one readable line, whatever it quotes
# A trainyard error that ended a worker, as its traceback's last line in torchrun's summary.
_WORKER_ERROR = re.compile(r"^\s*trainyard\.errors\.\w+Error: (.+)$", re.MULTILINE)


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
        if args.command not in ("storage", "down", "status") or getattr(args, "action", "") == "up":
            # Settings first, before a command imports the engine (torch alone takes seconds).
            config = load_config(paths.params, getattr(args, "overrides", None))
        return _dispatch(paths, args, config)
    except TrainyardError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainyard: interrupted", file=sys.stderr)
        return 130
    finally:
        paths.make_state_private()  # the first command of a project made it just now


def _dispatch(paths: ProjectPaths, args: argparse.Namespace, config: TrainyardConfig | None) -> int:
    if getattr(args, "all_ranks", False):
        os.environ[ALL_RANKS_ENV] = "1"  # read where the workers' lines reach the console
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
    if args.command == "storage":
        return cmd_storage(paths, config, args.action)
    if args.command == "prepare":
        return cmd_prepare(paths, config)
    if args.command in ("down", "status"):
        return cmd_servers(paths, args.command)
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


def error_line(exc: Exception) -> str:
    """`trainyard: error: ...` as one line of at most ERROR_LINE_MAX characters."""
    line = " ".join(part.strip() for part in f"trainyard: error: {exc}".splitlines())
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 1] + "…"


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
    from trainyard.cli.interrupts import quiet

    quiet()
    sys.exit(128 + signum)


def cmd_run(
    paths: ProjectPaths,
    config: TrainyardConfig,
    overrides: list[str],
    run_id: str | None,
    resume_from: str | None = None,
    warm_start: bool = False,
    metrics_file: Path | None = None,
) -> int:
    from trainyard.checkpoint.resume import plan_resume, resume_meta
    from trainyard.runs.continuation import changes, check_work_left, continued_config
    from trainyard.runs.lease import check_not_owned
    from trainyard.runs.preflight import preflight
    from trainyard.runs.record import check_run_id, find_record, new_run_id
    from trainyard.storage import connect_shared
    from trainyard.storage.versioning import content_md5

    if run_id:
        check_run_id(run_id)
    if warm_start and not resume_from:
        raise TrainyardError(
            "--warm-start needs --resume-from RUN_ID (the run to take weights from)"
        )
    if resume_from:
        check_run_id(resume_from)
    if metrics_file is not None:
        metrics_file = _metrics_target(paths, metrics_file)
    # A new run's settings and data are checked before the store is started: bad input
    # leaves no server behind. A named run may continue, with the settings in its record.
    report = None if run_id else preflight(config, paths.root)
    store = connect_shared(config.storage, paths)  # the flow's tasks reuse it
    previous = find_record(store, run_id) if run_id else None
    if previous is not None:  # continuing: the run's own settings, not params.yaml's
        check_not_owned(store, previous.run_id)
        storage = config.storage.model_dump(mode="json")
        config = continued_config(previous.run_id, previous.params, overrides, storage)
        check_work_left(previous, changes(previous.run_id, previous.params, config))
    report = report or preflight(config, paths.root)
    if run_id or resume_from:
        # The flow checks this again; here a checkpoint that does not fit is refused in one
        # line, before Prefect starts (and logs the failure its own way).
        dataset_md5 = content_md5(paths.root / config.data.path)
        meta = resume_meta(config, report.spec, dataset_md5, config.train.world_size)
        plan_resume(store, run_id, meta, config.checkpoint.resume, resume_from, warm_start)
    return _run_pipeline(
        paths, store, config, run_id or new_run_id(), resume_from, warm_start, metrics_file
    )


def _run_pipeline(
    paths: ProjectPaths,
    store: Store,
    config: TrainyardConfig,
    run_id: str,
    resume_from: str | None,
    warm_start: bool,
    metrics_file: Path | None = None,
) -> int:
    """The flow, under a guardian (nothing outlives this command) and with interruptions
    (Ctrl-C, SIGTERM) ending in one line that says how to continue."""
    from trainyard.cli.interrupts import interrupted_line, stop_on_first_interrupt
    from trainyard.cli.terminal import run_progress
    from trainyard.engine.live import live_path
    from trainyard.runtime.persistent import persistent_workers, prestart_training

    _use_local_prefect(paths)
    _guard(paths)
    stop_on_first_interrupt(config.checkpoint)
    with persistent_workers():
        # The training workers start now, while Prefect is imported and the flow run set
        # up: the flow finds them idle, and their start is off the way to the first step.
        prestart_training(paths.root, config.train, store.settings.worker_env())
        from flows.pipeline import training_pipeline  # Prefect is imported only here

        try:
            with _prefect_api(), run_progress(live_path(paths.staging, run_id), run_id):
                record = training_pipeline(
                    config=config,
                    project_dir=str(paths.root),
                    run_id=run_id,
                    resume_from=resume_from,
                    warm_start=warm_start,
                )
                returned_at = time.time()
        except BaseException as exc:
            refusal = _worker_refusal(exc)
            if refusal is not None:
                print(error_line(TrainyardError(refusal)), file=sys.stderr)
                return 2
            if isinstance(exc, WorkerFailed):  # the traceback is in the run's logs
                print(_failure_line(exc, store, run_id), file=sys.stderr)
                return 1
            code = _interruption_code(exc)
            if code is None:
                raise
            print(interrupted_line(store, paths, run_id), file=sys.stderr)
            return code
        if metrics_file is not None:
            _write_metrics_file(metrics_file, record)
    # Once the workers have stopped: `completed in` is the command's time, all of it.
    _print_summary(record, store, paths, returned_at)
    return 0


def _worker_refusal(exc: BaseException) -> str | None:
    """The message of a trainyard error that ended the workers (a full staging disk, a
    checkpoint this project did not sign): the user's to fix, so one line, as on the host."""
    found = _WORKER_ERROR.findall(str(exc)) if isinstance(exc, WorkerFailed) else []
    return found[-1] if found else None


def _failure_line(exc: WorkerFailed, store: Store, run_id: str) -> str:
    """`trainyard: run ID failed: rank 1: RuntimeError: ... (traceback: FILE)`, one line."""
    from trainyard.runs.record import find_record

    record = find_record(store, run_id)
    where = f" (traceback: {record.error_file})" if record and record.error_file else ""
    what = exc.repeated or exc.line()  # repeated: what torchrun's agent said when it stopped
    line = printable(" ".join(f"trainyard: run {run_id} failed: {what}".split()))
    if len(line) > ERROR_LINE_MAX:
        line = line[: ERROR_LINE_MAX - 1] + "…"
    return line + where


def _prefect_api() -> contextlib.AbstractContextManager[object]:
    """The user's PREFECT_API_URL, else the project's Prefect server (trainyard.cli.prefect_server),
    started by the first command that needs it and kept running for the next ones."""
    from trainyard.cli.prefect_server import prefect_api

    return prefect_api()


def _metrics_target(paths: ProjectPaths, path: Path) -> Path:
    """Where --metrics-file goes, checked before anything is launched: a run that trains
    for an hour must not fail at its last write."""
    target = paths.root / path
    if target.is_dir():
        raise TrainyardError(f"--metrics-file {path}: is a folder; name a file, e.g. metrics.json")
    if not target.parent.is_dir():
        raise TrainyardError(
            f"--metrics-file {path}: folder {target.parent} does not exist; create it first"
        )
    return target


def _write_metrics_file(path: Path, record) -> None:
    """The run's metrics and the monitored value, as DVC metrics. Written to a temporary
    file and renamed, so a reader (`dvc metrics show`) never sees half a file."""
    metrics = {**record.metrics, "monitor": record.monitor["value"]}
    write_text_atomic(path, json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def _guard(paths: ProjectPaths) -> None:
    """Nothing this command starts may outlive it, even when it is SIGKILLed."""
    from trainyard.runtime.guardian import Guardian, lasting_servers

    guardian = Guardian(paths.state / "guard" / f"{os.getpid()}.json", lasting_servers(paths))
    atexit.register(guardian.release)


def _interruption_code(exc: BaseException) -> int | None:
    """130 for Ctrl-C, 143 for SIGTERM (Prefect's TerminationSignal or our own exit)."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
        return exc.code
    from prefect.exceptions import TerminationSignal  # imported by the flow already

    if isinstance(exc, TerminationSignal):
        return 128 + signal.SIGTERM
    return None


def cmd_join(paths: ProjectPaths, config: TrainyardConfig, run_id: str) -> int:
    """Run this machine's share of a multi-node training job; node 0's flow does the rest."""
    from trainyard.data.split import prepare_cached_splits
    from trainyard.objectives import target_kind
    from trainyard.runs.preflight import preflight
    from trainyard.runs.record import check_run_id
    from trainyard.runtime.launch import run_worker
    from trainyard.storage import connect
    from trainyard.storage.versioning import content_md5
    from trainyard.util.logs import RANK_LOG

    check_run_id(run_id)
    if config.train.nnodes < 2 or config.train.node_rank == 0:
        raise TrainyardError(
            "join is for nodes 1..nnodes-1 (set -S train.nnodes=N -S train.node_rank=K); "
            "node 0 runs `trainyard run`"
        )
    preflight(config, paths.root)
    store = connect(config.storage, paths)
    # The same seeded split as node 0, in the same content-addressed folder (the record's
    # dataset.split_key); DVC's md5 of a file is the md5 of its bytes.
    dataset_md5 = content_md5(paths.root / config.data.path)
    target = target_kind(config.task.name)
    prepare_cached_splits(paths, config.data, config.split, dataset_md5, target)
    _guard(paths)  # this node's workers die with this command, as node 0's with its own
    logs = (paths.run_logs(run_id) / RANK_LOG.format(rank="N")).relative_to(paths.root)
    print(f"node {config.train.node_rank}: each worker's lines go to {logs}", flush=True)
    try:
        run_worker(
            paths.root,
            config.train,
            store.settings.worker_env(),
            ["train", "--run-id", run_id],
            WorkerLines(print_stamped),  # warnings and errors only: rank 0 is on node 0
            max_restarts=config.train.max_restarts,
            rdzv_id=run_id,
        )
    except WorkerFailed as exc:  # the user's to fix (two nodes with one node_rank): one line
        refusal = _worker_refusal(exc)
        if refusal is None:
            raise
        raise TrainyardError(refusal) from None
    print(f"node {config.train.node_rank}: run {run_id} finished its training")
    return 0


def cmd_runs(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    from trainyard.runs.record import check_run_id, delete_run, load_record, shown_status
    from trainyard.storage import connect

    store = connect(config.storage, paths)
    if args.runs_command == "unlock":
        from trainyard.runs.lease import unlock

        print(unlock(store, check_run_id(args.run_id), args.yes))
        return 0
    if args.runs_command == "delete":
        run_id = check_run_id(args.run_id)
        local = [paths.staging / run_id, paths.comet / run_id]
        freed = delete_run(store, local, run_id)
        print(
            f"deleted run {run_id}: {freed.objects} objects ({freed.store_bytes / 1e6:.1f} MB) "
            f"from {store.uri('runs/' + run_id)}, {freed.local_bytes / 1e6:.1f} MB of local files"
        )
        return 0
    if args.runs_command == "show":
        record = load_record(store, args.run_id)
        status, heartbeat = shown_status(store, record)
        if args.json:
            shown = record.model_dump(mode="json") | {"status": status}
            print(
                json.dumps(shown | ({"last_heartbeat": heartbeat} if heartbeat else {}), indent=2)
            )
        else:
            _print_record(record, _status_text(status, heartbeat))
        return 0
    return _list_runs(store, args.json, paths.run_summaries)


def _list_runs(store, as_json: bool, cache: Path) -> int:
    """A summary per run (`runs show` has the rest); a damaged record is one warning."""
    from trainyard.runs.record import list_summaries

    skipped = Skipped()
    summaries = list_summaries(store, skipped, cache)
    for line in skipped.lines():
        print(f"trainyard: warning: {line}", file=sys.stderr)
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in summaries], indent=2))
        return 0
    print(f"{'RUN ID':<26} {'STATUS':<11} {'WORKERS':>7} {'TEST MONITOR':>16}  CREATED")
    for s in summaries:
        m = s.monitor
        score = f"{m['name']} {m['value']:.4f}" if m and m["value"] is not None else "-"
        line = f"{s.run_id:<26} {s.status:<11} {s.world_size or '-':>7} {score:>16}  {s.created_at}"
        print(printable(line))
    return 0


def _status_text(status: str, heartbeat: str | None) -> str:
    if status != "crashed":
        return status
    return f"crashed (owner gone; last heartbeat {heartbeat or 'never'})"


def cmd_storage(paths: ProjectPaths, config: TrainyardConfig | None, action: str) -> int:
    from trainyard.storage.embedded import EmbeddedS3

    server = EmbeddedS3(paths.s3_server)
    if action == "up":
        from trainyard.storage import connect

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


def cmd_prepare(paths: ProjectPaths, config: TrainyardConfig) -> int:
    from trainyard.data.split import prepare_splits
    from trainyard.objectives import target_kind

    target = target_kind(config.task.name)
    schema = prepare_splits(
        config.data, config.split, paths.root / config.data.path, paths.processed, target
    )
    print(f"wrote {paths.processed.relative_to(paths.root)}: {schema.rows}")
    return 0


def _use_local_prefect(paths: ProjectPaths, server: bool = True) -> None:
    """Keep Prefect's home in the project (not the user's profile) unless they chose one, and
    (`server`) report to the user's PREFECT_API_URL, else to the project's Prefect server,
    started now if none runs. Set before Prefect is imported, which reads its settings once:
    Prefect's own clients, flushing logs at exit included, then use it."""
    os.environ.setdefault("PREFECT_HOME", str(paths.prefect_home))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if server and not os.environ.get("PREFECT_API_URL"):
        from trainyard.cli.prefect_server import home_of, start_for_project

        os.environ["PREFECT_API_URL"] = start_for_project(home_of(paths))


def _print_record(record, status: str) -> None:
    dataset = record.dataset
    rows = [
        ("run", f"{record.run_id}  {status}  created {record.created_at}"),
        (
            "dataset",
            f"{dataset.path} md5 {dataset.dvc_md5} ({dataset.rows} rows)" if dataset else "-",
        ),
        (
            "code",
            f"{record.code.get('git_commit') or '-'}{' (dirty)' if record.code.get('git_dirty') else ''}",
        ),
        (
            "workers",
            f"{record.world_size or '-'} on {record.device or '-'} ({record.backend or '-'})",
        ),
        ("metrics", "  ".join(f"{k} {v:.4g}" for k, v in sorted(record.metrics.items())) or "-"),
        ("timings", "  ".join(f"{k} {v:.1f}s" for k, v in record.timings_s.items()) or "-"),
        ("checkpoint", record.final_checkpoint or "-"),
        ("resumed", _resumed(record)),
        ("restarts", _restarts(record)),
        ("comet", "  ".join(f"rank{e.rank}:{e.mode}:{e.key}" for e in record.tracking) or "-"),
    ]
    if record.error:
        rows.append(("error", record.error.splitlines()[0]))
    if record.error_file:
        rows.append(("traceback", record.error_file))
    for label, value in rows:
        print(f"{label:<11} {printable(value)}")  # a record's text never drives the terminal


def _resumed(record) -> str:
    """Another run's checkpoint it started from, then each time it resumed its own:
    `from s3://.../step-00000040; at step 40 (agent lost)`."""
    parts = []
    if record.resume_checkpoint:
        weights = " (weights only)" if record.warm_start else ""
        parts.append(f"from {record.resume_checkpoint}{weights}")
    for event in record.resumes:
        if "from_step" in event:
            after = f" ({event['after']})" if event.get("after") else ""
            parts.append(f"at step {event['from_step']}{after}")
    return "; ".join(parts) or "-"


def _restarts(record) -> str:
    """`2: 1 agent lost, 1 worker failed (14 steps redone)`: the kinds the resumes name."""
    kinds = Counter(event["after"] for event in record.resumes if event.get("after"))
    why = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return f"{record.restarts}{': ' + why if why else ''} ({record.steps_redone} steps redone)"


def _print_summary(record, store, paths: ProjectPaths, returned_at: float) -> None:
    """`returned_at`: when the flow returned (unix time), before the workers' stop."""
    from trainyard.cli.console import where_time_went

    comet = ", ".join(sorted({e.mode for e in record.tracking})) or "none"
    archives = [e.archive for e in record.tracking if e.archive]
    where = (
        f"offline archives in {Path(archives[0]).parent.relative_to(paths.root)}/ "
        f"({len(archives)} worker{'s' if len(archives) != 1 else ''}; upload later with "
        f"`trainyard tracking upload {record.run_id}`)"
        if archives
        else comet
    )
    wall, now = command_seconds(), time.time()
    parts = where_time_went(now - wall, returned_at, now, record.timings_s, record.first_step_at)
    print(
        f"\ntrainyard run {record.run_id} {record.status} in {wall:.1f}s ({parts})\n"
        f"  test {record.monitor['name']:<9} {record.monitor['value']:.4f}\n"
        f"  checkpoint     {record.final_checkpoint}\n"
        f"  run record     {store.uri(f'runs/{record.run_id}/run.json')}\n"
        f"  dataset        {record.dataset.path} (DVC md5 {record.dataset.dvc_md5})\n"
        f"  comet          {where}\n"
        f"  store          {store.settings.where}\n"
        "\nnext:\n"
        # `make run` puts the venv on its own PATH, not on the user's shell's.
        + ("" if os.environ.get("VIRTUAL_ENV") == sys.prefix else "  source .venv/bin/activate\n")
        + f"  trainyard runs show {record.run_id}\n"
        "  trainyard runs list\n"
        "  trainyard run -S train.workers=1 -S train.epochs=10\n"
        "  dvc repro            # split and train again where params, data or code changed\n"
    )


if __name__ == "__main__":
    sys.exit(main())

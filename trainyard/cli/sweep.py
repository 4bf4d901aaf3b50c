"""`trainyard sweep run | list | show | best`: the hyperparameter sweep's command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from trainyard.cli.options import add_overrides
from trainyard.cli.session import run_flow
from trainyard.config import TrainyardConfig, apply_override, config_from_dict
from trainyard.errors import ConfigError, TrainyardError
from trainyard.project import ProjectPaths
from trainyard.util.documents import Skipped, printable

if TYPE_CHECKING:
    from trainyard.runs.plan import RunPlan
    from trainyard.storage import Store
    from trainyard.sweeps.record import SweepRecord

# What a resumed sweep may change: its budget and packing, never what its trials train.
RESUMABLE_KEYS = (
    "sweep.n_trials",
    "sweep.timeout_s",
    "sweep.max_concurrent_trials",
    "sweep.max_failed_trials",
    "sweep.cores",
)


class SweepStopped(TrainyardError):
    """A sweep stopped because of where it ran; its message says how to continue it."""


def add_sweep_commands(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser("sweep", help="hyperparameter sweeps (Optuna studies)")
    actions = sweep.add_subparsers(dest="sweep_command", required=True)
    run = actions.add_parser(
        "run", help="run a sweep (Prefect flow hyperparameter_sweep); prints its id"
    )
    run.add_argument(
        "--sweep-id",
        help="continue this sweep: finished trials stay, trials left running resume from "
        "their last checkpoint, the budget counts what was done",
    )
    add_overrides(run, "override a params.yaml value, e.g. -S sweep.n_trials=4 (repeatable)")
    listing = actions.add_parser("list", help="all sweeps, newest first")
    listing.add_argument("--json", action="store_true")
    show = actions.add_parser("show", help="a sweep's trials, best trial and importances")
    show.add_argument("sweep_id")
    show.add_argument("--json", action="store_true")
    best = actions.add_parser("best", help="a sweep's best run and its checkpoint")
    best.add_argument("sweep_id")
    for reader in (listing, show, best):  # studies are read only from storages set here
        add_overrides(reader, "e.g. -S sweep.storage=grpc://HOST:PORT: also read studies there")
    serve = actions.add_parser(
        "serve-storage",
        help="serve this project's sweep journal to other machines (Optuna's gRPC storage "
        "proxy); they set sweep.storage=grpc://HOST:PORT",
    )
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    serve.add_argument("--port", type=int, default=13000)


def cmd_sweep(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.storage import connect

    if args.sweep_command == "serve-storage":
        return _serve_storage(paths, config, args.host, args.port)
    store = connect(config.storage, paths)
    if args.sweep_command == "run":
        return _run(paths, store, config, args.overrides, args.sweep_id)
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.sweeps.record import list_sweeps, load_sweep
    from trainyard.sweeps.report import list_rows, load_study, summary
    from trainyard.sweeps.study import ReadableStorages

    # Only storages this project configures are opened, read-only: a sweep record is a
    # document anyone who can write to the store could plant.
    storages = ReadableStorages.of_project(config.sweep, paths)
    if args.sweep_command == "list":
        skipped = Skipped()  # a damaged sweep record is one warning, the others listed
        rows = list_rows(list_sweeps(store, skipped), storages, _warn)
        for line in skipped.lines():
            _warn(line)
        print(json.dumps(rows, indent=2) if args.json else _list_text(rows))
        return 0
    record = load_sweep(store, args.sweep_id)
    shown = summary(record, load_study(record, storages))
    if args.sweep_command == "show":
        _add_run_status(store, shown)
        print(json.dumps(shown, indent=2) if args.json else _show_text(shown))
        return 0
    return _best(store, record, shown)


def _warn(message: str) -> None:
    print(f"trainyard: warning: {printable(message)}", file=sys.stderr)


def _run(
    paths: ProjectPaths,
    store: Store,
    config: TrainyardConfig,
    overrides: list[str],
    sweep_id: str | None,
) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.plan import plan_run
    from trainyard.runs.record import check_run_id, new_run_id
    from trainyard.runtime.persistent import persistent_workers, prestart_slots
    from trainyard.storage.versioning import content_md5
    from trainyard.sweeps.checks import preflight_sweep, slot_gpus, trial_slots
    from trainyard.sweeps.record import check_same_data, load_sweep
    from trainyard.sweeps.space import touches_workers

    resume = sweep_id is not None
    if sweep_id is not None:
        record = load_sweep(store, check_run_id(sweep_id))
        config = _resumed_config(record, overrides)
    sweep_id = sweep_id or new_run_id()
    plan = plan_run(config, paths.root, preflight_sweep)  # refused in one line, before Prefect
    if resume:  # the flow checks again, after versioning the data
        check_same_data(record, content_md5(paths.root / config.data.path))
    slots = trial_slots(config)
    print(f"sweep {sweep_id}", flush=True)  # its id, for `--sweep-id` should it stop

    def prestart() -> None:
        # Each trial slot's workers start now, while Prefect starts and the study opens.
        if not touches_workers(config.sweep.space):
            env = store.settings.worker_env()
            prestart_slots(paths.root, config.train, env, slot_gpus(config, slots))

    shown = run_flow(
        paths,
        lambda: _sweep_call(plan, overrides, sweep_id, resume),
        interrupted=lambda: (
            f"trainyard: interrupted; sweep {sweep_id} stopped; its finished trials stay. "
            f"continue with: trainyard sweep run --sweep-id {sweep_id}"
        ),
        progress=lambda: _progress(paths, config, sweep_id),
        checkpoint=config.checkpoint,
        workers=persistent_workers(max_idle=slots),
        prestart=prestart,
    )
    print(_show_text(shown))
    return 0


def _sweep_call(
    plan: RunPlan, overrides: list[str], sweep_id: str, resume: bool
) -> Callable[[], dict[str, Any]]:
    """The flow's call, with the sweep's plan handed over (the flow run's parameters show
    the command's -S list); imports the flow, and Prefect."""
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect.exceptions import FailedRun

    from flows.sweep import hyperparameter_sweep
    from trainyard.runs.plan import handed_over

    def call() -> dict[str, Any]:
        try:
            with handed_over(plan, overrides):  # the flow takes this plan, unchecked again
                # Called, a flow raises the Failed state it returns: a dict comes back.
                return cast(
                    dict[str, Any],
                    hyperparameter_sweep(
                        overrides=overrides,
                        sweep_id=sweep_id,
                        resume=resume,
                    ),
                )
        except FailedRun as exc:  # stopped by its environment (a full disk, the store down)
            raise SweepStopped(str(exc)) from None

    return call


def _progress(
    paths: ProjectPaths, config: TrainyardConfig, sweep_id: str
) -> AbstractContextManager[None]:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.cli.terminal import sweep_progress
    from trainyard.sweeps.study import storage_url

    storage = storage_url(config.sweep, paths, sweep_id)
    return sweep_progress(storage, f"trainyard-{sweep_id}", config.sweep.n_trials)


def _serve_storage(paths: ProjectPaths, config: TrainyardConfig, host: str, port: int) -> int:
    """Until interrupted: the study storage `sweep.storage` names here, served over gRPC."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from optuna.storages import run_grpc_proxy_server

    from trainyard.sweeps.study import open_storage, served_journal, storage_url

    url = storage_url(config.sweep, paths, "any") if config.sweep.storage else None
    url = url or str(served_journal(paths))
    print(f"serving {url} on grpc://{host}:{port} (Ctrl-C stops)", flush=True)
    run_grpc_proxy_server(open_storage(url), host=host, port=port)
    return 0


def _resumed_config(record: SweepRecord, overrides: list[str]) -> TrainyardConfig:
    """The sweep's stored settings, with only its budget and packing overridable."""
    raw = json.loads(json.dumps(record.params))
    for override in overrides:
        key = override.partition("=")[0]
        if key not in RESUMABLE_KEYS:
            raise ConfigError(
                f"-S {override!r}: a resumed sweep keeps its settings (its trials must stay "
                f"comparable); only {', '.join(RESUMABLE_KEYS)} may change"
            )
        apply_override(raw, override)
    return config_from_dict(raw, source=f"sweep {record.sweep_id}")


def _best(store: Store, record: SweepRecord, shown: dict[str, Any]) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import load_record

    best = shown["best"]
    if best is None:
        print(f"sweep {record.sweep_id} has no completed trial yet", file=sys.stderr)
        return 3
    run = load_record(store, best["run_id"])
    assert run.monitor is not None  # a sweep's best trial is a completed run
    print_text(
        f"sweep {record.sweep_id} best trial {best['trial']}: {record.objective} "
        f"{best['value']:.4f}\n"
        f"  run            {run.run_id}\n"
        f"  checkpoint     {run.final_checkpoint}\n"
        f"  params         {_params_text(best['params'])}\n"
        f"  test           {run.monitor['name']} {run.monitor['value']:.4f}\n"
        "next:\n"
        f"  trainyard runs show {run.run_id}\n"
        f"  trainyard run --resume-from {run.run_id} --warm-start   # fine-tune from it"
    )
    return 0


def _params_text(params: dict[str, Any]) -> str:
    return "  ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


def _value_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _list_text(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'SWEEP ID':<26} {'TRIALS':>6} {'BEST':>22}  CREATED"]
    for row in rows:
        best = row["best"]
        score = f"{row['objective']} {_value_text(best['value'])}" if best else "-"
        lines.append(f"{row['sweep_id']:<26} {row['trials']:>6} {score:>22}  {row['created_at']}")
    return "\n".join(map(printable, lines))


def _add_run_status(store: Store, shown: dict[str, Any]) -> None:
    """Each RUNNING trial's run as its record says (`run_status`): the study keeps a trial
    RUNNING until a sweep finishes it, also while no sweep runs (interrupted, killed), so
    that `sweep run --sweep-id` resumes it."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import load_record, shown_status

    for trial in shown["trials"]:
        if trial["state"] != "RUNNING" or not trial["run_id"]:
            continue
        try:
            trial["run_status"] = shown_status(store, load_record(store, trial["run_id"]))[0]
        except TrainyardError:  # no record yet: the trial had not started its run
            trial["run_status"] = None


def _shown_state(trial: dict[str, Any]) -> str:
    """The study's state, but STOPPED for a RUNNING trial whose run no sweep runs now (its
    run was interrupted or crashed)."""
    if trial["state"] == "RUNNING" and trial.get("run_status") not in (None, "running"):
        return "STOPPED"
    return str(trial["state"])


def _show_text(shown: dict[str, Any]) -> str:
    states = [_shown_state(t) for t in shown["trials"]]
    counts = "  ".join(
        f"{state.lower()} {states.count(state)}"
        for state in [*shown["counts"], "STOPPED"]
        if state in states
    )
    lines = [
        f"sweep {shown['sweep_id']}: {shown['direction']} {shown['objective']}  ({counts})",
        f"storage {shown['storage']}  study {shown['study_name']}",
        "",
        f"{'#':>3} {'STATE':<9} {'VALUE':>8} {'EPOCH':>5} {'SECONDS':>7}  {'RUN ID':<26} PARAMS",
    ]
    for t, state in zip(shown["trials"], states, strict=True):
        lines.append(
            f"{t['number']:>3} {state:<9} {_value_text(t['value']):>8} "
            f"{t['last_epoch'] if t['last_epoch'] is not None else '-':>5} "
            f"{t['duration_s'] if t['duration_s'] is not None else '-':>7}  "
            f"{t['run_id'] or '-':<26} {_params_text(t['params'])}"
        )
    stopped = [
        f"{t['number']} ({t['run_status']})"
        for t, state in zip(shown["trials"], states, strict=True)
        if state == "STOPPED"
    ]
    if stopped:
        lines += [
            "",
            f"stopped before finishing: trial {', '.join(stopped)}; `trainyard sweep run "
            f"--sweep-id {shown['sweep_id']}` resumes them from their checkpoints",
        ]
    best = shown["best"]
    if best:
        lines += [
            "",
            f"best: trial {best['trial']} {_value_text(best['value'])} run {best['run_id']}",
        ]
    if shown["importances"]:
        lines.append(
            "importances: " + "  ".join(f"{k} {v:.2f}" for k, v in shown["importances"].items())
        )
    return "\n".join(map(printable, lines))


def print_text(text: str) -> None:
    """Text made of a sweep's or a run's fields, each line printable: a planted record's
    escape sequences never reach the terminal."""
    print("\n".join(map(printable, text.split("\n"))))

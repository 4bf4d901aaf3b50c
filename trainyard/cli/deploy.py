"""`trainyard deploy | worker | serve | data add`: the deployments of prefect.yaml on a Prefect
server, the process worker that runs them, and new dataset versions that trigger a retrain.

prefect.yaml is the one description of the deployments. `deploy` reads it and registers each
one through Prefect's Python API (`RunnerDeployment.apply`, as `prefect deploy` does; that
command fails on Prefect 3.8.8 once a deployment is saved, reading the pool's workers with
`limit: null`). `serve` builds the same deployments without a work pool and serves them."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, cast

import yaml

from trainyard.cli.session import use_local_prefect
from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.util.files import replacing

WORK_POOL = "trainyard"
DATASET_EVENT = "trainyard.dataset.pushed"
PROJECT_DIR_ENV = "TRAINYARD_PROJECT_DIR"  # read by prefect.yaml's pull step
DEPLOY_COMMANDS = ("deploy", "worker", "serve", "data")


def add_deploy_commands(commands: argparse._SubParsersAction) -> None:
    commands.add_parser(
        "deploy",
        help="register prefect.yaml's deployments with the Prefect server at PREFECT_API_URL "
        "(none set: start a local one that keeps running)",
    )
    commands.add_parser(
        "worker", help=f"run a process worker on the work pool {WORK_POOL!r} (blocks)"
    )
    commands.add_parser(
        "serve", help="serve every deployment from this one process, no worker (blocks)"
    )
    data = commands.add_parser("data", help="dataset versions (DVC)")
    actions = data.add_subparsers(dest="data_command", required=True)
    add = actions.add_parser(
        "add",
        help=f"copy FILE into data/, `dvc add` and push it, and emit {DATASET_EVENT} "
        "(which triggers the deployment retrain/on-new-data)",
    )
    add.add_argument("file", type=Path)
    add.add_argument(
        "--to", metavar="data/raw/NAME", help="where in the project (default: data/raw/<name>)"
    )


def cmd_deploy(paths: ProjectPaths, config: TrainyardConfig, args: argparse.Namespace) -> int:
    use_local_prefect(paths, server=False)  # started by the commands that need it
    if args.command == "deploy":
        return _deploy(paths)
    if args.command == "worker":
        return _worker(paths)
    if args.command == "serve":
        return _serve(paths)
    return _data_add(paths, config, args.file, args.to)


# --- the Prefect server -------------------------------------------------------------------


def _api_url(paths: ProjectPaths, start: bool = False) -> str | None:
    """PREFECT_API_URL, else the project's Prefect server (started now if `start`)."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.cli.prefect_server import PrefectServer, home_of, start_for_project

    url = os.environ.get("PREFECT_API_URL")
    if not url:
        state = PrefectServer(home_of(paths)).status()
        url = state.api_url if state else start_for_project(home_of(paths)) if start else None
    if url:
        os.environ["PREFECT_API_URL"] = url  # for Prefect, imported after this, and `prefect`
    return url


def _prefect_exe() -> str:
    exe = Path(sys.executable).parent / "prefect"
    return str(exe) if exe.exists() else "prefect"


# --- deployments --------------------------------------------------------------------------


class _PullSteps:
    """Pull steps for a RunnerDeployment (the storage shim `prefect deploy` uses)."""

    def __init__(self, steps: list[dict[str, Any]], root: Path) -> None:
        self.pull_steps = steps
        self._base_path = root

    def set_base_path(self, path: Path) -> None:
        self._base_path = path

    @property
    def destination(self) -> Path:
        return self._base_path

    @property
    def pull_interval(self) -> int:
        return 60

    async def pull_code(self) -> None:
        pass

    def to_pull_step(self) -> list[dict[str, Any]]:
        return self.pull_steps


def read_prefect_yaml(paths: ProjectPaths) -> dict[str, Any]:
    """prefect.yaml with `{{ $VAR }}` filled from the environment and TRAINYARD_PROJECT_DIR
    set to this project, except in the pull steps: a run resolves those itself."""
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect.utilities.templating import apply_values

    file = paths.root / "prefect.yaml"
    if not file.is_file():
        raise TrainyardError(
            f"{file} not found: run this in the project folder (copy prefect.yaml from the "
            "trainyard repository if the project has none)"
        )
    spec = yaml.safe_load(file.read_text()) or {}
    pull = spec.pop("pull", None) or []
    os.environ[PROJECT_DIR_ENV] = str(paths.root)  # apply_values reads os.environ itself
    # A dict in is a dict out (NotSet comes back only for a NotSet value).
    spec = cast(dict[str, Any], apply_values(spec, {}, remove_notset=False))
    spec["pull"] = pull
    return spec


def build_deployments(paths: ProjectPaths, for_worker: bool) -> list[Any]:
    """prefect.yaml's deployments as RunnerDeployments: for a work pool (with the pull
    steps) or, for `serve`, without one."""
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect.deployments.runner import EntrypointType
    from prefect.events import DeploymentTriggerTypes
    from prefect.flows import load_flow_from_entrypoint
    from prefect.schedules import Cron
    from pydantic import TypeAdapter

    spec = read_prefect_yaml(paths)
    triggers_adapter = TypeAdapter(DeploymentTriggerTypes)
    deployments = []
    for entry in spec.get("deployments") or []:
        entrypoint = entry["entrypoint"]
        # Any: Prefect types to_deployment as sync-or-coroutine; called here it is sync.
        flow: Any = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
        name = entry["name"]
        triggers = [
            triggers_adapter.validate_python(
                {"name": f"{flow.name}/{name}__trigger_{i}", **trigger}
            )
            for i, trigger in enumerate(entry.get("triggers") or [], start=1)
        ]
        schedules = [
            Cron(s["cron"], timezone=s.get("timezone")) for s in entry.get("schedules") or []
        ]
        pool = entry.get("work_pool") or {}
        deployment = flow.to_deployment(
            name=name,
            description=entry.get("description"),
            parameters=entry.get("parameters"),
            schedules=schedules or None,
            triggers=triggers or None,
            tags=entry.get("tags"),
            work_pool_name=pool.get("name", WORK_POOL) if for_worker else None,
            job_variables=pool.get("job_variables") if for_worker else None,
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
        deployment.entrypoint = entrypoint
        if for_worker:
            deployment.storage = _PullSteps(entry.get("pull", spec["pull"]), paths.root)
        deployments.append(deployment)
    return deployments


def _ensure_work_pool(name: str, queues: list[str] | None = None) -> None:
    """The process work pool `name`, and its `queues` (a worker's own host queue): a worker
    that polls a queue the server does not know is refused."""
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            print(f"created work pool {name!r} (process)")
        for queue in queues or []:
            # Made already: by another worker of this host, or an earlier one.
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_queue(name=queue, work_pool_name=name)


def _deploy(paths: ProjectPaths) -> int:
    url = _api_url(paths, start=True)
    deployments = build_deployments(paths, for_worker=True)
    for pool in {d.work_pool_name for d in deployments}:
        _ensure_work_pool(pool)
    for deployment in deployments:
        deployment.apply()
        print(f"deployed {deployment.flow_name}/{deployment.name}{_runs_by_itself(deployment)}")
    print(
        f"{len(deployments)} deployments on {url}, work pool {WORK_POOL!r}, runs in {paths.root}\n"
        "next:\n"
        "  trainyard worker                          # here; on other machines the same\n"
        f"  export PREFECT_API_URL={url}  # for Prefect's own CLI in this shell\n"
        "  prefect deployment run 'retrain/nightly'  # a run now"
    )
    return 0


def _runs_by_itself(deployment: Any) -> str:
    """What starts the deployment's runs without anyone asking (prefect.yaml's schedules and
    event triggers), so that `trainyard deploy` says it: ` (runs by itself: cron 0 3 * * *
    UTC)`; empty where nothing does."""
    when = [
        _schedule_text(schedule.schedule)
        for schedule in deployment.schedules or []
        if getattr(schedule, "active", True)
    ]
    when += [
        f"on the event {', '.join(sorted(trigger.expect))}"
        for trigger in deployment.triggers or []
        if getattr(trigger, "expect", None)
    ]
    return f" (runs by itself: {'; '.join(when)})" if when else ""


def _schedule_text(schedule: Any) -> str:
    """Prefect's cron, interval or rrule schedule, as prefect.yaml wrote it."""
    if getattr(schedule, "cron", None):
        return f"cron {schedule.cron} {schedule.timezone or 'UTC'}"
    if getattr(schedule, "interval", None):
        return f"every {schedule.interval.total_seconds():g} s"
    return f"rrule {getattr(schedule, 'rrule', schedule)}"


def _worker(paths: ProjectPaths) -> int:
    """Prefect's own process worker, in this process (exec), named after this host and
    polling the pool's default queue and this host's own (where node 0 places a node)."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from tasks.node_share import DEFAULT_QUEUE, host_queue
    from tasks.orphaned_runs import crash_orphaned_runs

    url = _api_url(paths, start=True)
    host = socket.gethostname()
    queues = [DEFAULT_QUEUE, host_queue(host)]
    print(f"worker {host!r} on pool {WORK_POOL!r} of {url} (queues {queues}), in {paths.root}")
    assert url is not None, "start=True starts the project's server when no URL is set"
    _ensure_work_pool(WORK_POOL, queues[1:])
    # Before it polls: the runs this host's last worker left behind, should the host have
    # died, are called crashed now (node 0 replaces a node that was), not Running for good.
    try:
        orphaned = crash_orphaned_runs(WORK_POOL, host)
    except Exception as error:  # the worker starts all the same: node 0 still sees beats
        print(f"warning: could not read the runs this host's last worker left: {error}")
        orphaned = []
    for line in orphaned:
        print(f"marked crashed: {line}")
    env = {**os.environ, "PREFECT_API_URL": url, PROJECT_DIR_ENV: str(paths.root)}
    exe = _prefect_exe()
    os.chdir(paths.root)
    sys.stdout.flush()
    start = [exe, "worker", "start", "--pool", WORK_POOL, "--type", "process", "--name", host]
    os.execve(
        shutil.which(exe) or exe,
        [*start, *(arg for queue in queues for arg in ("--work-queue", queue))],
        env,
    )
    return 0  # not reached


def _serve(paths: ProjectPaths) -> int:
    """Prefect's `serve` against the project's server (or the user's PREFECT_API_URL), which
    its flow runs report to as well. Prefect reads its settings once, when imported: with
    the URL set after that, it started a temporary server of its own, which the first
    Ctrl-C stopped under the runner."""
    url = _api_url(paths, start=True)  # before Prefect is imported
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect import serve

    os.environ[PROJECT_DIR_ENV] = str(paths.root)
    os.chdir(paths.root)
    deployments = build_deployments(paths, for_worker=False)
    print(f"serving {len(deployments)} deployments on {url} (Ctrl-C stops)", flush=True)
    serve(*deployments)
    return 0


# --- datasets -----------------------------------------------------------------------------


def _data_add(paths: ProjectPaths, config: TrainyardConfig, file: Path, to: str | None) -> int:
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.storage import connect
    from trainyard.storage.versioning import configure_remote, version_dataset

    source = file.expanduser().resolve()
    if not source.is_file():
        raise TrainyardError(f"{file}: no such file")
    target = _target(paths, to or f"data/raw/{source.name}")
    relative = target.relative_to(paths.root).as_posix()
    store = connect(config.storage, paths)
    configure_remote(paths.root, store)
    if source != target:
        with replacing(target) as staged:
            shutil.copyfile(source, staged)
    version = version_dataset(paths.root, relative)
    print(f"{relative}: version md5 {version.dvc_md5} ({version.size} bytes), pushed")
    if relative != config.data.path:
        print(f"note: params.yaml's data.path is {config.data.path}; runs train on that")
    url = _api_url(paths)
    if url is None:
        print(f"no Prefect server (PREFECT_API_URL unset): {DATASET_EVENT} not emitted")
    else:
        _emit_pushed(relative, version.dvc_md5, version.size)
        print(f"emitted {DATASET_EVENT} to {url}")
    ignore = Path(relative).parent / ".gitignore"  # DVC's, which keeps the data out of git
    tracked = [f"{relative}.dvc", *([str(ignore)] if (paths.root / ignore).exists() else [])]
    print(f"next: git add {' '.join(tracked)} && git commit (other machines: git pull, dvc pull)")
    return 0


def _target(paths: ProjectPaths, to: str) -> Path:
    data = paths.root / "data"
    target = (paths.root / to).resolve()
    if not target.is_relative_to(data.resolve()) or target == data.resolve():
        raise TrainyardError(f"--to {to}: must be a file inside data/, e.g. data/raw/NAME.csv")
    if target.is_dir():
        raise TrainyardError(f"--to {to}: is a folder; name the file, e.g. data/raw/NAME.csv")
    return target


def _emit_pushed(path: str, md5: str, size: int) -> None:
    """The event the deployment retrain/on-new-data waits for, sent before returning."""
    # Prefect is imported only by the commands that run it (start-up cost).
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    event = emit_event(
        event=DATASET_EVENT,
        resource={"prefect.resource.id": f"trainyard.dataset.{path}", "trainyard.path": path},
        payload={"path": path, "md5": md5, "size": size},
    )
    if event is None:
        raise TrainyardError(f"{DATASET_EVENT} could not be emitted; see the log above")
    EventsWorker.drain_all()

"""14. Host loss: a `train.nnodes=1:2` run on two hosts (1 worker each) loses host B right
after a mid-epoch commit, against the same world size on one host (2 workers) losing one
worker at the same point (torchrun restarts both, as `recovery` measures); seconds from the
kill until training moves again, steps redone, and for the lost host how long after its
`trainyard join` it trains again, when node 0 scales back to two.

The hosts are network namespaces on this machine (tests/hosts.py, as `nodes` uses them): A
runs `trainyard run` and the store, B `trainyard join`. B dies with every process in its
namespace SIGKILLed at once (`Host.kill_all`: the launcher, its torchrun agent and worker);
the one-host arm SIGKILLs rank 1's worker alone. The kill comes as soon as the store holds
the run's first checkpoint committed inside an epoch at world size 2 (polled every 20 ms).
Every figure is read off rank 0's resume log (`progress.json` in node 0's staging folder):
a resume's `resumed_at` is the wall-clock time rank 0 finished its first step after the
restart, and `steps_redone` the steps rank 0 had done past the checkpoint it resumed from.
Each run is stopped once its figures are in: the training after that measures nothing.

Needs root and `ip netns` (`skipped` says why where either is missing), and minutes: run it by
name (`python -m benchmarks.run --only host_loss`), like `nodes`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import _env as environment
from benchmarks.common import interleaved, paired_ratio, ratio, summary
from benchmarks.nodes import Cluster, hosts_env, hosts_project, hosts_unavailable, namespace_hosts
from trainyard.checkpoint.layout import checkpoint_steps
from trainyard.checkpoint.signing import SIGNING_KEY_ENV, project_key
from trainyard.config import load_config
from trainyard.project import ProjectPaths
from trainyard.runtime.forked import worker_rank
from trainyard.runtime.progress import recorded_resumes
from trainyard.storage import Store, resolve_settings

TWO_HOSTS = "2 hosts x 1 worker (1:2), host B killed"
ONE_HOST = "1 host x 2 workers, rank 1 killed"
MOVING = "kill -> training moving again s"
REDONE = "steps redone"
REJOIN = "join -> the returning host training again s"
OVERRIDES = (
    "model.options.hidden_sizes=[512, 512]",  # recovery's model and checkpoint interval
    "checkpoint.every_n_steps=7",
    "tracking.backend=none",
)
EPOCHS = 400  # never reached: each run is stopped once measured, so node 0 outlasts a rejoin
DEADLINE_S = 300
# Where the seconds from the kill to the first step go (see _Losses._where).
WHERE = (
    "kill -> restarted rank 0 began s (noticed, rendezvous, the survivors stopped)",
    "restarted rank 0: start and imports s",
    "restarted rank 0: run record and process group s",
    "restarted rank 0: process group -> checkpoint read begins s",
    "restarted rank 0: checkpoint load and first step s",
)
# A persistent worker (one host's `trainyard run` starts them ahead) says "process group".
_WORKER_UP = re.compile(
    r"worker up: start and imports ([\d.]+)s, (?:run record and )?process group ([\d.]+)s"
)
_RANK_LINES = re.compile(r"trainyard\.worker: each rank's lines")
_RESUMING = re.compile(
    r"trainyard\.engine\.job_setup: resuming from "
)  # for each thing awaited: minutes on the loaded 2-core VM, never hours


def run(project: object, quick: bool) -> dict:
    """`project` is unused: the hosts need a project of their own, copied to each."""
    missing = hosts_unavailable()
    if missing:
        return {"figures": {}, "ratios": {}, "skipped": missing}
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-host-loss-") as tmp:
        root = hosts_project(Path(tmp) / "project")
        _signing_key(root)
        with namespace_hosts().hosts(
            2, own_copy=root, shared=(), workdir=Path(tmp) / "copies"
        ) as net:
            cluster = Cluster(net, root, hosts_env(Path(tmp)), EPOCHS)
            cluster.start_store()
            try:
                return _measure(_Losses(cluster, Path(tmp) / "logs"), 1 if quick else 3)
            finally:
                cluster.stop_store()


def _signing_key(root: Path) -> None:
    """The project's checkpoint signing key, made before the hosts copy the project: the
    returning host loads node 0's checkpoints, as docs/multi-node.md has a user copy it."""
    with environment({SIGNING_KEY_ENV: str(ProjectPaths(root).signing_key)}):
        project_key(create=True)


def _measure(losses: _Losses, reps: int) -> dict:
    contenders: dict[str, Callable[[], dict[str, float]]] = {
        TWO_HOSTS: losses.host_lost,
        ONE_HOST: losses.worker_lost,
    }
    measured = interleaved(reps, contenders)
    figures = {
        f"{arm}, {figure}": summary([r[figure] for r in runs])
        for arm, runs in measured.items()
        for figure in set.intersection(*(set(r) for r in runs))
    }
    two = [r[MOVING] for r in measured[TWO_HOSTS]]
    one = [r[MOVING] for r in measured[ONE_HOST]]
    ratios = {
        f"{TWO_HOSTS} / {ONE_HOST}, {MOVING}": ratio(two, one),
        f"{TWO_HOSTS} / {ONE_HOST}, {MOVING}, median of per-repetition ratios": paired_ratio(
            two, one
        ),
    }
    return {"figures": figures, "ratios": ratios}


class _Losses:
    """One run of each arm on the cluster's hosts, its kill, and its figures."""

    def __init__(self, cluster: Cluster, logs: Path) -> None:
        self.cluster, self.logs = cluster, logs
        logs.mkdir()
        self.staging = ProjectPaths(cluster.root).staging  # node 0's, on host A
        storage = load_config(cluster.root / "params.yaml").storage
        with environment(cluster.env):  # the endpoint and credentials `storage env` gave
            self.store = Store(resolve_settings(storage, ProjectPaths(cluster.root)))

    def host_lost(self) -> dict[str, float]:
        a, b = self.cluster.a, self.cluster.b
        run_id = next(self.cluster.run_ids)
        endpoint = f"train.rdzv_endpoint={a.address}:{self.cluster._free_port_on_a()}"
        nodes = ("train.workers=1", "train.nnodes=1:2", endpoint)
        node_0 = self._start(a, "run", "--run-id", run_id, *nodes)
        joining = ("join", "--run-id", run_id, *nodes, "train.node_rank=1")
        self._start(b, *joining)
        try:
            self._wait(lambda: self._committed_mid_epoch(run_id), f"{run_id}: a commit at 2")
            seen, killed_at = self._resumes(run_id), time.time()
            b.kill_all()  # the host dies: its launcher, agent and worker at once
            alone = self._wait(lambda: self._resumed(run_id, seen, 2, 1), f"{run_id}: alone")
            seen, joined_at = self._resumes(run_id), time.time()
            self._start(b, *joining)
            back = self._wait(lambda: self._resumed(run_id, seen, 1, 2), f"{run_id}: back")
        finally:
            b.kill_all()
            self._stop(node_0)
        return {
            MOVING: alone["resumed_at"] - killed_at,
            REDONE: float(alone["steps_redone"]),
            REJOIN: back["resumed_at"] - joined_at,
            **self._where(run_id, killed_at, alone["resumed_at"]),
        }

    def worker_lost(self) -> dict[str, float]:
        run_id = next(self.cluster.run_ids)
        node_0 = self._start(self.cluster.a, "run", "--run-id", run_id, "train.workers=2")
        try:
            self._wait(lambda: self._committed_mid_epoch(run_id), f"{run_id}: a commit")
            pid = _worker(node_0.pid, rank=1)
            seen, killed_at = self._resumes(run_id), time.time()
            os.kill(pid, signal.SIGKILL)
            again = self._wait(lambda: self._resumed(run_id, seen, 2, 2), f"{run_id}: again")
        finally:
            self._stop(node_0)
        return {
            MOVING: again["resumed_at"] - killed_at,
            REDONE: float(again["steps_redone"]),
            **self._where(run_id, killed_at, again["resumed_at"]),
        }

    def _where(self, run_id: str, killed_at: float, resumed_at: float) -> dict[str, float]:
        """Where the seconds from the kill to the first step go, from the first lines of
        rank 0's restarted worker after the kill: its own `worker up` line (start and
        imports, then the run record and process group, as the worker times them; node 0's
        command prints it) and, in rank 0's log, its next line (when the process began is
        that line's time less both) and its `resuming from` line (the checkpoint's read
        begins). The five parts add up to the kill -> moving time."""
        try:
            return self._parts(run_id, killed_at, resumed_at)
        except RuntimeError:  # a line not found: the total stands, without its parts
            return {}

    def _parts(self, run_id: str, killed_at: float, resumed_at: float) -> dict[str, float]:
        up = _after(killed_at, _WORKER_UP, self._command_lines(run_id), _time_of_day)
        rank_0 = (ProjectPaths(self.cluster.root).run_logs(run_id) / "rank-0.log").read_text()
        lines = rank_0.splitlines()
        logging_at = _after(killed_at, _RANK_LINES, lines, _timestamp)[0]
        reading_at = _after(killed_at, _RESUMING, lines, _timestamp)[0]
        imports, group = float(up[1].group(1)), float(up[1].group(2))
        return {
            WHERE[0]: logging_at - imports - group - killed_at,
            WHERE[1]: imports,
            WHERE[2]: group,
            WHERE[3]: reading_at - logging_at,
            WHERE[4]: resumed_at - reading_at,
        }

    def _command_lines(self, run_id: str) -> list[str]:
        (log,) = self.logs.glob(f"{run_id}-{self.cluster.a.name}-*.log")
        return log.read_text().splitlines()

    def _start(self, host: Any, command: str, *args: str) -> subprocess.Popen[bytes]:
        settings = self.cluster._settings(*OVERRIDES, *args[2:])
        argv = self.cluster._argv(command, *args[:2], *settings)
        with (self.logs / f"{args[1]}-{host.name}-{time.time_ns()}.log").open("wb") as out:
            return host.popen(argv, cwd=self.cluster.root, env=self.cluster.env, stdout=out,
                              stderr=subprocess.STDOUT)  # fmt: skip

    def _stop(self, node_0: subprocess.Popen[bytes]) -> None:
        """End the run on host A: its command, torchrun agent and workers (each in a
        session of its own), so the next run has the cores to itself."""
        for pid in [node_0.pid, *_descendants(node_0.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        node_0.wait()

    def _committed_mid_epoch(self, run_id: str) -> bool:
        """The store holds a checkpoint committed inside an epoch at world size 2."""
        for step in reversed(checkpoint_steps(self.store, run_id)):
            key = f"runs/{run_id}/checkpoints/step-{step:08d}/manifest.json"
            manifest = self.store.read_json(key) if self.store.exists(key) else {}
            if manifest.get("world_size") == 2 and manifest.get("step_in_epoch", 0) > 0:
                return True
        return False

    def _resumes(self, run_id: str) -> int:
        return len(recorded_resumes(self.staging / run_id))

    def _resumed(self, run_id: str, seen: int, before: int, after: int) -> dict | None:
        """The latest resume from world size `before` to `after` after the first `seen`
        (a start on node 0 alone, scaled up when B came, is one), once its first step is done."""
        for entry in reversed(recorded_resumes(self.staging / run_id)[seen:]):
            if (entry.get("world_size_before"), entry.get("world_size_after")) == (before, after):
                return entry if entry["resumed_at"] is not None else None
        return None

    def _wait(self, condition: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + DEADLINE_S
        while not (found := condition()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {DEADLINE_S} s\n{self._tails()}")
            time.sleep(0.02)  # the figures' resolution
        return found

    def _tails(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.logs.iterdir())
        )


def _after(
    moment: float, pattern: re.Pattern[str], lines: list[str], when: Callable[[str], float]
) -> tuple[float, re.Match[str]]:
    """The first line matching `pattern` stamped at or after `moment`: its time and match."""
    for line in lines:
        found = pattern.search(line)
        if found and when(line) >= moment:
            return when(line), found
    raise RuntimeError(f"no line matching {pattern.pattern!r} after the kill")


def _timestamp(line: str) -> float:
    """A rank log line's time (`2026-11-27 00:40:11.490 [rank 0/2] ...`, local time)."""
    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _time_of_day(line: str) -> float:
    """A command's line (`00:40:10.949 | INFO | ...`, local time) as a time today. The
    measurements of a run take minutes, so a run across midnight is the only one misread."""
    clock = dt.datetime.strptime(line[:12], "%H:%M:%S.%f").time()
    return dt.datetime.combine(dt.date.today(), clock).timestamp()


def _descendants(pid: int) -> list[int]:
    """The live processes under `pid` (children, theirs, ...): a command's torchrun agent
    and workers, which a `trainyard run` on one host starts ahead as persistent workers,
    whose command lines do not name the run."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _worker(command: int, rank: int) -> int:
    """The live worker of `rank` under the command `command`."""
    for pid in _descendants(command):
        if worker_rank(pid) == rank:  # a worker forked by its torchrun agent, by its name
            return pid
    raise RuntimeError(f"no live worker of rank {rank} under process {command}")

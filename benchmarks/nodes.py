"""13. Nodes: the same digits run as 1 host x 2 workers (`trainyard run`), as 2 hosts x 1
worker (`trainyard run -S train.nnodes=2 -S train.rdzv_endpoint=A:PORT` on host A, `trainyard
join` on host B) and as the same with the link between the hosts at 50 Mbit/s; wall time from
the command to the record, time to the first step, steady samples/s, and the ratios of the
two-host arms to the one-host arm.

The hosts are network namespaces on this machine (tests/hosts.py): each has its own address,
hostname and copy of a throw-away project; the store serves from host A's address, as on two
machines (`trainyard storage up --host`), and both hosts share the same cores, so the ratios
show what the rendezvous, the second launcher and the network cost, not what a second
machine's cores would add. Every run starts on host A, so the one-host arm talks to the same
store and the same Prefect server (the project's own, on host A's loopback) as the others.

Needs root and `ip netns` (`skipped` says why where either is missing), and minutes: run it by
name (`python -m benchmarks.run --only nodes`); it is left out of the default list and of the
test suite's quick run.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import BIN, REPO, interleaved, paired_ratio, ratio, summary
from tests.hosts import Host, HostNet, hosts

WORKERS = 2  # the world size of every arm
RATE = "50mbit"
ONE_HOST = "1 host x 2 workers"
TWO_HOSTS = "2 hosts x 1 worker"
SLOW = f"2 hosts x 1 worker, {RATE} link"
DROPPED = ("TRAINYARD_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_HOME", "COMET_API_KEY")  # fmt: skip
TIMEOUT_S = 900  # one run's deadline: minutes on the loaded 2-core VM, never hours


def run(project: object, quick: bool) -> dict:
    """`project` is unused: the hosts need a project of their own, copied to each."""
    missing = _unavailable()
    if missing:
        return {"figures": {}, "ratios": {}, "skipped": missing}
    epochs, reps = (2, 1) if quick else (8, 5)
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-nodes-") as tmp:
        root = _project(Path(tmp) / "project")
        with hosts(2, own_copy=root, shared=(), workdir=Path(tmp) / "copies") as net:
            cluster = _Cluster(net, root, _env(Path(tmp)), epochs)
            cluster.start_store()
            try:
                return _measure(cluster, reps, quick)
            finally:
                cluster.stop_store()


def _measure(cluster: _Cluster, reps: int, quick: bool) -> dict:
    contenders: dict[str, Callable[[], dict[str, float]]] = {
        ONE_HOST: cluster.one_host,
        TWO_HOSTS: cluster.two_hosts,
    }
    if not quick:  # a smoke test needs no second two-host arm
        contenders[SLOW] = cluster.slow_two_hosts
        # Unmeasured: the Prefect server's start, the dataset's versioning and each host's
        # split are a project's first run's costs, no arm's.
        cluster.one_host()
        cluster.two_hosts()
    measured = interleaved(reps, contenders)
    figures, ratios = {}, {}
    for figure in ("wall s", "time to first step s", "steady samples/s"):
        for arm, runs in measured.items():
            figures[f"{arm}, {figure}"] = summary([r[figure] for r in runs])
        one = [r[figure] for r in measured[ONE_HOST]]
        for arm in (TWO_HOSTS, SLOW) if not quick else (TWO_HOSTS,):
            theirs = [r[figure] for r in measured[arm]]
            ratios[f"{arm} / {ONE_HOST}, {figure}"] = ratio(theirs, one)
            ratios[f"{arm} / {ONE_HOST}, {figure}, median of per-repetition ratios"] = paired_ratio(
                theirs, one
            )
    result: dict[str, Any] = {"figures": figures, "ratios": ratios}
    if quick:
        result["left_out"] = f"the {RATE} arm and the warm-up runs (quick mode)"
    return result


class _Cluster:
    """Hosts A and B with the project, the store on A; runs one arm and reads its record."""

    def __init__(self, net: HostNet, root: Path, env: dict[str, str], epochs: int) -> None:
        self.a, self.b = net[0], net[1]
        self.root, self.env, self.epochs = root, env, epochs
        self.run_ids = (f"bench-nodes-{n}" for n in itertools.count())

    def start_store(self) -> None:
        self._on(self.a, "storage", "up", "--host", self.a.address)
        exports = self._on(self.a, "storage", "env").stdout
        for line in exports.splitlines():
            if line.startswith("export ") and "=" in line:
                name, value = line[len("export ") :].split("=", 1)
                self.env[name] = value.strip("'")

    def stop_store(self) -> None:
        self.a.run([str(BIN / "trainyard"), "storage", "down"], cwd=self.root, env=self.env,
                   capture_output=True, timeout=300)  # fmt: skip

    def one_host(self) -> dict[str, float]:
        run_id = next(self.run_ids)
        started = time.time()
        self._on(self.a, "run", "--run-id", run_id, *self._settings(f"train.workers={WORKERS}"))
        return self._figures(run_id, started, time.time())

    def two_hosts(self) -> dict[str, float]:
        run_id = next(self.run_ids)
        nodes = ["train.workers=1", "train.nnodes=2",
                 f"train.rdzv_endpoint={self.a.address}:{self._free_port_on_a()}"]  # fmt: skip
        started = time.time()
        node_0 = self.a.popen(self._argv("run", "--run-id", run_id, *self._settings(*nodes)),
                              cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
        node_1 = self._on(self.b, "join", "--run-id", run_id,
                          *self._settings(*nodes, "train.node_rank=1"))  # fmt: skip
        output, _ = node_0.communicate(timeout=TIMEOUT_S)
        if node_0.returncode != 0:
            raise RuntimeError(f"node 0 of {run_id} failed:\n{output[-3000:]}\n{node_1.stdout}")
        return self._figures(run_id, started, time.time())

    def slow_two_hosts(self) -> dict[str, float]:
        """Host B's link shaped both ways: everything between A and B crosses it."""
        self.b.slow_link(RATE)
        try:
            return self.two_hosts()
        finally:
            self.b.fast_link()

    def _figures(self, run_id: str, started: float, ended: float) -> dict[str, float]:
        record = json.loads(self._on(self.a, "runs", "show", run_id, "--json").stdout)
        history = record["history"][1:]  # the first epoch pays for warming up
        rows = sum(h["rows"] for h in history) * WORKERS  # rank 0's share x world size
        return {
            "wall s": ended - started,
            "time to first step s": record["first_step_at"] - started,
            "steady samples/s": rows / sum(h["train_s"] for h in history),
        }

    def _settings(self, *overrides: str) -> list[str]:
        return [arg for o in (f"train.epochs={self.epochs}", *overrides) for arg in ("-S", o)]

    def _argv(self, *args: str) -> list[str]:
        return [str(BIN / "trainyard"), *args]

    def _on(self, host: Host, *args: str) -> subprocess.CompletedProcess[str]:
        done = host.run(self._argv(*args), cwd=self.root, env=self.env, capture_output=True,
                        text=True, timeout=TIMEOUT_S)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"trainyard {' '.join(args)} on {host.name} failed:\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")  # fmt: skip
        return done

    def _free_port_on_a(self) -> int:
        """A port free on host A for node 0's rendezvous (A's own network namespace)."""
        probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        done = self.a.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)  # fmt: skip
        return int(done.stdout)


def _unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    for tool in ("ip", "unshare", "tc", "hostname", "mount"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` to make network namespaces"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`ip netns` is unavailable: {probe.stderr.strip()}"


def _project(root: Path) -> Path:
    """A throw-away project (params, DVC, git, the bundled digits written), copied to each
    host before anything runs, as each machine has its own checkout and dataset."""
    from trainyard.config import load_config
    from trainyard.runs.preflight import preflight

    root.mkdir(parents=True)
    for name in ("params.yaml", "dvc.yaml", ".dvcignore"):
        shutil.copy(REPO / name, root / name)
    ignore = shutil.ignore_patterns("config.local", "cache", "tmp")
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=ignore)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    preflight(load_config(root / "params.yaml"), root)
    return root


def _env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    (scratch / "home").mkdir()
    return env | {
        "HOME": str(scratch / "home"),
        "PATH": f"{BIN}:{env['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }

"""13. Nodes: the same digits run as 1 host x 2 workers (`trainyard run`), as 2 hosts x 1
worker (`trainyard run -S train.nnodes=2 -S train.rdzv_endpoint=A:PORT` on host A, `trainyard
join` on host B), as the same with the link between the hosts at 50 Mbit/s, and as a
`training_pipeline/manual` deployment run with train.nnodes=2 (node 0 starts node 1 on the
other host's worker); wall time from the command to the record, time to the first step, steady
samples/s, the ratios of the two-host arms to the one-host arm, and the launcher's own cost
(the deployment run's wall time minus the run started by hand).

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

import datetime as dt
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import BIN, REPO, interleaved, paired_ratio, ratio, summary

WORKERS = 2  # the world size of every arm
RATE = "50mbit"
ONE_HOST = "1 host x 2 workers"
TWO_HOSTS = "2 hosts x 1 worker"
SLOW = f"2 hosts x 1 worker, {RATE} link"
LAUNCHED = "2 hosts x 1 worker, a deployment run"
PREFECT_PORT = 4200  # on host A's address: free, each host being a network namespace of its own
DROPPED = ("TRAINYARD_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_HOME", "COMET_API_KEY")  # fmt: skip
TIMEOUT_S = 900  # one run's deadline: minutes on the loaded 2-core VM, never hours


def run(project: object, quick: bool) -> dict:
    """`project` is unused: the hosts need a project of their own, copied to each."""
    missing = hosts_unavailable()
    if missing:
        return {"figures": {}, "ratios": {}, "skipped": missing}
    epochs, reps = (2, 1) if quick else (8, 5)
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-nodes-") as tmp:
        root = hosts_project(Path(tmp) / "project")
        with namespace_hosts().hosts(
            2, own_copy=root, shared=(), workdir=Path(tmp) / "copies"
        ) as net:
            cluster = Cluster(net, root, hosts_env(Path(tmp)), epochs)
            cluster.start_store()
            try:
                launcher = None if quick else _Launcher(cluster, Path(tmp))
                return _measure(cluster, launcher, reps)
            finally:
                cluster.stop_store()


def _measure(cluster: Cluster, launcher: _Launcher | None, reps: int) -> dict:
    """Every arm `reps` times, interleaved; without a launcher (quick mode) only the one-host
    and the two-host arms, once each and cold."""
    contenders: dict[str, Callable[[], dict[str, float]]] = {
        ONE_HOST: cluster.one_host,
        TWO_HOSTS: cluster.two_hosts,
    }
    if launcher is not None:
        contenders[SLOW] = cluster.slow_two_hosts
        launcher.up()
        contenders[LAUNCHED] = launcher.run
        # Unmeasured: the Prefect server's start, the dataset's versioning, each host's split
        # and each worker's first flow run are a project's first run's costs, no arm's.
        cluster.one_host()
        cluster.two_hosts()
        launcher.run()
    measured = interleaved(reps, contenders)
    figures, ratios = {}, {}
    for arm, runs in measured.items():
        for figure in runs[0]:
            figures[f"{arm}, {figure}"] = summary([r[figure] for r in runs])
    for figure in ("wall s", "time to first step s", "steady samples/s"):
        one = [r[figure] for r in measured[ONE_HOST]]
        for arm in (name for name in measured if name != ONE_HOST):
            theirs = [r[figure] for r in measured[arm]]
            ratios[f"{arm} / {ONE_HOST}, {figure}"] = ratio(theirs, one)
            ratios[f"{arm} / {ONE_HOST}, {figure}, median of per-repetition ratios"] = paired_ratio(
                theirs, one
            )
    if launcher is not None:
        launched = [r["wall s"] for r in measured[LAUNCHED]]
        by_hand = [r["wall s"] for r in measured[TWO_HOSTS]]
        ratios[f"{LAUNCHED} - {TWO_HOSTS}, wall s (the launcher's own cost)"] = statistics.median(
            launched
        ) - statistics.median(by_hand)
    result: dict[str, Any] = {"figures": figures, "ratios": ratios}
    if launcher is None:
        result["left_out"] = f"the {RATE} and launcher arms and the warm-up runs (quick mode)"
    return result


class Cluster:
    """Hosts A and B with the project, the store on A; runs one arm and reads its record."""

    def __init__(self, net: Any, root: Path, env: dict[str, str], epochs: int) -> None:
        self.a, self.b = net[0], net[1]
        self.root, self.env, self.epochs = root, env, epochs
        self.run_ids = (f"bench-nodes-{n}" for n in itertools.count())
        self.last_run_id = ""  # the last two-host run's

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
        return self.figures(run_id, started, time.time())

    def two_hosts(self, *extra: str) -> dict[str, float]:
        """`extra`: more `-S` settings, for both nodes."""
        run_id = self.last_run_id = next(self.run_ids)
        nodes = ["train.workers=1", "train.nnodes=2", *extra,
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
        return self.figures(run_id, started, time.time())

    def slow_two_hosts(self, rate: str = RATE, *extra: str) -> dict[str, float]:
        """Host B's link shaped to `rate` both ways: everything between A and B crosses it."""
        self.b.slow_link(rate)
        try:
            return self.two_hosts(*extra)
        finally:
            self.b.fast_link()

    def record(self, run_id: str) -> dict[str, Any]:
        return json.loads(self._on(self.a, "runs", "show", run_id, "--json").stdout)

    def figures(self, run_id: str, started: float, ended: float) -> dict[str, float]:
        record = self.record(run_id)
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

    def _on(self, host: Any, *args: str) -> subprocess.CompletedProcess[str]:
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


class _Launcher:
    """The launcher's path, as docs/multi-node.md sets it up: Prefect's server on host A's
    address, the deployments, a `trainyard worker` on each host (Prefect's polling settings
    left at their defaults, as a user has them); a deployment run with train.nnodes=2, whose
    node 0 starts node 1 as a training_node flow run on the other host's worker."""

    def __init__(self, cluster: Cluster, scratch: Path) -> None:
        self.cluster, self.a = cluster, cluster.a
        self.api_url = f"http://{self.a.address}:{PREFECT_PORT}/api"
        self.logs = scratch / "launcher-logs"
        self.env = cluster.env | {
            "PREFECT_HOME": str(scratch / "prefect-server"),
            "PREFECT_API_URL": self.api_url,
        }

    def up(self) -> None:
        self.logs.mkdir()
        prefect, trainyard = str(BIN / "prefect"), str(BIN / "trainyard")
        serve = ["server", "start", "--host", self.a.address, "--port", str(PREFECT_PORT)]
        self._start(self.a, [prefect, *serve], "server")
        self._wait(self._healthy, "Prefect's server answering")
        deploy = self.a.run([trainyard, "deploy"], cwd=self.cluster.root, env=self.env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
        if deploy.returncode != 0:
            raise RuntimeError(f"trainyard deploy failed:\n{deploy.stdout}\n{deploy.stderr}")
        for host in (self.a, self.cluster.b):
            self._start(host, [trainyard, "worker"], f"worker-{host.name}")
        self._wait(lambda: len(self._online()) == 2, "a worker online on each host")

    def run(self) -> dict[str, float]:
        run_id = next(self.cluster.run_ids)
        overrides = ["train.nnodes=2", "train.workers=1", f"train.epochs={self.cluster.epochs}"]
        started = time.time()
        ran = self.a.run([str(BIN / "prefect"), "deployment", "run", "training_pipeline/manual",
                          "-p", f"overrides={json.dumps(overrides)}", "-p", f"run_id={run_id}"],
                         cwd=self.cluster.root, env=self.env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)  # fmt: skip
        found = re.search(r"UUID: ([0-9a-f-]{36})", ran.stdout)
        if ran.returncode != 0 or found is None:
            raise RuntimeError(f"prefect deployment run failed:\n{ran.stdout}\n{ran.stderr}")
        state = self._wait(lambda: self._terminal(found.group(1)), f"flow run of {run_id} ended")
        ended = time.time()
        if state["type"] != "COMPLETED":
            raise RuntimeError(
                f"{run_id}: {state['type']}: {state.get('message')}\n{self._tails()}"
            )
        return self.cluster.figures(run_id, started, ended) | self._starts(
            found.group(1), run_id, started
        )

    def _starts(self, flow_run_id: str, run_id: str, started: float) -> dict[str, float]:
        """When node 0's flow run (a worker polled the default queue, then its process
        started) and node 1's (node 0 placed it on B's queue, B's worker polled it) began."""
        parent = self._api("GET", f"/flow_runs/{flow_run_id}")
        body = {"flow_runs": {"name": {"like_": f"{run_id}-node-"}}, "limit": 5}
        (node_1,) = self._api("POST", "/flow_runs/filter", body)
        return {
            "launch -> node 0's flow run started s": _unix(parent["start_time"]) - started,
            "launch -> node 1's flow run started s": _unix(node_1["start_time"]) - started,
        }

    def _start(self, host: Any, argv: list[str], log: str) -> None:
        with (self.logs / f"{log}.log").open("wb") as out:
            host.popen(argv, cwd=self.cluster.root, env=self.env, stdout=out,
                       stderr=subprocess.STDOUT)  # fmt: skip

    def _wait(self, condition: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + TIMEOUT_S
        while not (found := condition()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {TIMEOUT_S} s\n{self._tails()}")
            time.sleep(0.2)  # the wall time's resolution
        return found

    def _api(self, method: str, path: str, body: dict | None = None) -> Any:
        reply = httpx.request(method, f"{self.api_url}{path}", json=body, timeout=30)
        reply.raise_for_status()
        return reply.json()

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _online(self) -> set[str]:
        workers = self._api("POST", "/work_pools/trainyard/workers/filter", {"limit": 50})
        return {w["name"] for w in workers if w["status"] == "ONLINE"}

    def _terminal(self, flow_run_id: str) -> dict | None:
        state = self._api("GET", f"/flow_runs/{flow_run_id}")["state"]
        return state if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    def _tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.logs.iterdir())


def namespace_hosts() -> Any:
    """tests/hosts.py, the test suite's namespace "machines", loaded from its file: tests/ is
    no package (pytest puts the folder on sys.path), and importing it as `tests.hosts` would
    give mypy one file under two module names. Registered as `hosts`, its name in the tests."""
    spec = importlib.util.spec_from_file_location("hosts", REPO / "tests" / "hosts.py")
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hosts", module)
    spec.loader.exec_module(module)
    return module


def _unix(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()


def hosts_unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    for tool in ("ip", "unshare", "tc", "hostname", "mount"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` to make network namespaces"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`ip netns` is unavailable: {probe.stderr.strip()}"


def hosts_project(root: Path) -> Path:
    """A throw-away project (params, DVC, git, the bundled digits written), copied to each
    host before anything runs, as each machine has its own checkout and dataset."""
    from trainyard.config import load_config
    from trainyard.runs.preflight import preflight

    root.mkdir(parents=True)
    for name in ("params.yaml", "dvc.yaml", ".dvcignore", "prefect.yaml"):
        shutil.copy(REPO / name, root / name)
    ignore = shutil.ignore_patterns("config.local", "cache", "tmp")
    shutil.copytree(REPO / ".dvc", root / ".dvc", ignore=ignore)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    preflight(load_config(root / "params.yaml"), root)
    return root


def hosts_env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    (scratch / "home").mkdir()
    return env | {
        "HOME": str(scratch / "home"),
        "PATH": f"{BIN}:{env['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }

"""One command, many machines: a training_pipeline deployment run with train.nnodes=2, started
by Prefect's own CLI, trains on two hosts (network namespaces with their own hostnames and
project copies): node 0 picks the rendezvous and starts node 1 as a training_node/manual
child flow run on the other host's `trainyard worker`. Cancelling the parent leaves no
process on either host; too few hosts fail the run in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from hosts import Host, hosts

from trainyard.checkpoint.layout import committed_checkpoints
from trainyard.checkpoint.reader import load_checkpoint
from trainyard.data.bundled import BUNDLED
from trainyard.runs.record import load_record
from trainyard.runtime.forked import worker_rank
from trainyard.storage import Store
from trainyard.storage.store import ENDPOINT_ENV, StoreSettings

from conftest import BIN, REPO, make_project

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parents[1])
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
PORT = 4200
# A log line that tells why a run went as it did (test failures show these first).
TELLING = re.compile(r"Error|error:|trainyard:|meeting again|restart|lost|Crashed|Failed|exited")


@dataclass
class Cluster:
    a: Host
    b: Host
    project: Path
    env: dict[str, str]
    api_url: str
    store: Store
    logs: list[Path]

    def api(self, method: str, path: str, body: dict | None = None) -> object:
        """Prefect's REST API, tried again while the server answers 503 or not in time: its
        SQLite database is locked a while on a busy machine (Prefect's own client retries)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                reply = httpx.request(method, f"{self.api_url}{path}", json=body, timeout=30)
            except httpx.TimeoutException:
                reads = method == "GET" or path.endswith("/filter")  # made nothing, if it ran
                if not reads or time.monotonic() > deadline:
                    raise
                continue
            if reply.status_code != 503 or time.monotonic() > deadline:
                reply.raise_for_status()
                return reply.json()
            time.sleep(0.5)

    def tails(self) -> str:
        """Each log's telling lines (errors, restarts, rounds met again), then its end: a
        failure's cause is often well before the traceback its end shows."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace")
            telling = [line for line in text.splitlines() if TELLING.search(line)][-20:]
            parts.append(f"--- {log.name}, telling lines:\n" + "\n".join(telling))
            parts.append(f"--- {log.name}, its end:\n{text[-2500:]}")
        return "\n".join(parts)

    def prefect(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Prefect's own CLI, run on host A."""
        return self.a.run([str(BIN / "prefect"), *args], cwd=self.project, env=self.env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip

    def run_pipeline(self, run_id: str, overrides: list[str]) -> str:
        """`prefect deployment run 'training_pipeline/manual' -p ...`: the flow run's id."""
        ran = self.prefect("deployment", "run", "training_pipeline/manual",
                           "-p", f"overrides={json.dumps(overrides)}", "-p", f"run_id={run_id}")  # fmt: skip
        assert ran.returncode == 0, ran.stdout + ran.stderr
        found = re.search(r"UUID: ([0-9a-f-]{36})", ran.stdout)
        assert found, ran.stdout
        return found.group(1)

    def run_on_a(self, run_id: str, overrides: list[str]) -> str:
        """A training_pipeline/manual flow run sent to host A's own queue (node 0 on A, with
        the server and the store), so that host B is node 1's: the flow run's id."""
        deployment = self.api("GET", "/deployments/name/training_pipeline/manual")
        assert isinstance(deployment, dict)
        body = {
            "parameters": {"overrides": overrides, "run_id": run_id},
            "work_queue_name": f"host-{self.a.name}",
        }
        run = self.api("POST", f"/deployments/{deployment['id']}/create_flow_run", body)
        assert isinstance(run, dict)
        return run["id"]

    def state(self, flow_run_id: str) -> dict:
        run = self.api("GET", f"/flow_runs/{flow_run_id}")
        assert isinstance(run, dict)
        return run["state"]

    def node_runs(self, run_id: str) -> list[dict]:
        body = {"flow_runs": {"name": {"like_": f"{run_id}-node-"}}, "limit": 50}
        found = self.api("POST", "/flow_runs/filter", body)
        assert isinstance(found, list)
        return found


def wait_until(condition: Callable[[], object], timeout_s: float, explain: Callable[[], str]):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, explain()
        time.sleep(0.5)


def _exports(text: str) -> dict[str, str]:
    found = re.findall(r"^export (\w+)=(\S+)$", text, re.M)
    return {name: value.strip("'") for name, value in found}


def _project(root: Path) -> Path:
    project = make_project(root)
    (project / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(epochs=2, workers=1)
    params["model"] = {"name": "tests_support:slow_mlp", "options": {"seconds": 0.0}}
    params["tracking"]["backend"] = "none"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # The dataset every node splits alike: in each host's copy before the copies are made.
    BUNDLED[params["data"]["path"]](project / params["data"]["path"])
    return project


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """Hosts A and B, each with its own copy of the project at the same path; on A the
    Prefect server and the store, on their address; `trainyard deploy` once; a
    `trainyard worker` on each host."""
    tmp = tmp_path_factory.mktemp("nodes")
    project = _project(tmp / "project")
    drop = (ENDPOINT_ENV, *SECRET_NAMES, "PREFECT_API_URL", "PREFECT_PROFILE", "COMET_API_KEY")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    with hosts(2, own_copy=project, shared=()) as net:
        a, b = net
        api_url = f"http://{a.address}:{PORT}/api"
        env = base | {
            "HOME": str(tmp / "home"),
            "DVC_NO_ANALYTICS": "1",
            "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_API_URL": api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_LOOP_SECONDS": "2",
            "PYTHONPATH": TESTS,  # runs' workers import tests_support models
        }
        trainyard = str(BIN / "trainyard")
        logs = [tmp / "server.log", tmp / "worker-a.log", tmp / "worker-b.log"]

        def start(host: Host, argv: list[str], log: Path) -> subprocess.Popen:
            with log.open("wb") as out:
                return host.popen(argv, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT)

        up = a.run([trainyard, "storage", "up", "--host", a.address], cwd=project, env=env,
                   capture_output=True, text=True, timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            exported = a.run([trainyard, "storage", "env"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
            exports = _exports(exported.stdout)
            env.update(exports)
            server = start(a, [str(BIN / "prefect"), "server", "start", "--host", a.address,
                               "--port", str(PORT)], logs[0])  # fmt: skip
            cluster = Cluster(a, b, project, env, api_url, _store(exports), logs)
            wait_until(lambda: _healthy(api_url), 180, cluster.tails)
            assert server.poll() is None
            deploy = a.run([trainyard, "deploy"], cwd=project, env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
            assert deploy.returncode == 0, deploy.stdout + deploy.stderr
            assert "deployed training_node/manual" in deploy.stdout
            start(a, [trainyard, "worker"], logs[1])
            start(b, [trainyard, "worker"], logs[2])
            wait_until(lambda: _online(cluster) == {"host-a", "host-b"}, 180, cluster.tails)
            yield cluster
        finally:
            a.run([trainyard, "storage", "down"], cwd=project, env=env, timeout=120)


def _store(exports: dict[str, str]) -> Store:
    settings = StoreSettings(
        "trainyard", "", exports[ENDPOINT_ENV], exports[SECRET_NAMES[0]], exports[SECRET_NAMES[1]]
    )
    return Store(settings)


def _healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _online(cluster: Cluster) -> set[str]:
    workers = cluster.api("POST", "/work_pools/trainyard/workers/filter", {"limit": 50})
    assert isinstance(workers, list)
    return {w["name"] for w in workers if w["status"] == "ONLINE"}


def _final_model(store: Store, run_id: str) -> dict[str, torch.Tensor]:
    record = load_record(store, run_id)
    assert record.final_checkpoint, record
    state, _ = load_checkpoint(store, record.final_checkpoint)
    return state["model"]


def test_a_deployment_run_trains_on_two_hosts_as_one_host_with_two_workers(cluster):
    begun = time.monotonic()
    flow_run_id = cluster.run_pipeline("two-hosts", ["train.nnodes=2", "train.workers=1"])
    wait_until(lambda: cluster.state(flow_run_id)["type"] in TERMINAL, 600, cluster.tails)
    print(f"\ntwo-host run: {time.monotonic() - begun:.0f} s to the end")
    assert cluster.state(flow_run_id)["type"] == "COMPLETED", cluster.tails()
    record = load_record(cluster.store, "two-hosts")
    hosts = {n.node_rank: n.host for n in record.nodes}
    assert sorted(hosts) == [0, 1] and {hosts[0], hosts[1]} == {"host-a", "host-b"}, hosts
    # Node 1 is a child flow run, sent to its host's own queue (node 0 runs wherever a
    # worker took the parent from the default queue).
    (node,) = cluster.node_runs("two-hosts")
    assert node["state_type"] == "COMPLETED" and node["parameters"]["node_rank"] == 1
    assert node["work_queue_name"] == f"host-{hosts[1]}" and node["parent_task_run_id"]
    # The same training on one host with two workers: the same weights, bit for bit.
    reference = cluster.a.run([str(BIN / "trainyard"), "run", "-S", "train.workers=2",
                               "--run-id", "one-host"], cwd=cluster.project, env=cluster.env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    ours, theirs = _final_model(cluster.store, "two-hosts"), _final_model(cluster.store, "one-host")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_too_few_hosts_fail_the_run_in_one_line_naming_the_node(cluster):
    overrides = ["train.nnodes=3", "train.workers=1", "train.node_timeout_s=20"]
    flow_run_id = cluster.run_pipeline("three-nodes", overrides)
    wait_until(lambda: cluster.state(flow_run_id)["type"] in TERMINAL, 300, cluster.tails)
    state = cluster.state(flow_run_id)
    assert state["type"] == "FAILED"
    line = (
        "node 2 did not start within 20 s: the pool 'trainyard' has workers on 2 host(s) "
        "(host-a, host-b); start `trainyard worker` on another machine"
    )
    assert line in state["message"] and "\n" not in state["message"], state["message"]
    assert cluster.node_runs("three-nodes") == []  # none started: no half a run


def _run_processes(host: Host, run_id: str, flow_run_ids: list[str]) -> list[str]:
    """The command lines of the run's processes in `host`'s namespace: its torchrun and
    workers (named by the run id; "rank N worker: " before a worker's, which is its torchrun
    agent's: trainyard.runtime.forked) and the flow-run processes."""
    pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                          text=True, check=True).stdout.split()  # fmt: skip
    markers = [f"PREFECT__FLOW_RUN_ID={i}".encode() for i in flow_run_ids]
    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if not zombie and (f"\0{run_id}\0".encode() in cmdline or set(markers) & set(environ)):
            line = cmdline.replace(b"\0", b" ").decode(errors="replace")
            rank = worker_rank(int(pid))
            found.append(line if rank is None else f"rank {rank} worker: {line}")
    return found


def _is_worker(line: str) -> bool:
    """A line of _run_processes' for a worker."""
    return re.match(r"rank \d+ worker: ", line) is not None


def test_cancelling_the_parent_run_leaves_no_process_on_either_host(cluster):
    overrides = ["train.nnodes=2", "train.workers=1", "train.epochs=500",
                 "model.options={seconds: 0.05}"]  # fmt: skip
    parent = cluster.run_pipeline("cancelled", overrides)

    def both_training() -> bool:
        nodes = cluster.node_runs("cancelled")
        ids = [parent, *(n["id"] for n in nodes)]
        return all(
            any(_is_worker(c) for c in _run_processes(h, "cancelled", ids))
            for h in (cluster.a, cluster.b)
        )

    wait_until(both_training, 600, cluster.tails)
    (node,) = cluster.node_runs("cancelled")
    cancel = cluster.prefect("flow-run", "cancel", parent)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    ids = [parent, node["id"]]

    def left() -> list[str]:
        return [*_run_processes(cluster.a, "cancelled", ids),
                *_run_processes(cluster.b, "cancelled", ids)]  # fmt: skip

    wait_until(lambda: not left(), 180, lambda: "\n".join(left()) + cluster.tails())
    wait_until(lambda: cluster.state(node["id"])["type"] in TERMINAL, 120, cluster.tails)
    assert cluster.state(node["id"])["type"] == "CANCELLED"


def test_ctrl_c_on_node_0s_command_commits_and_leaves_no_process_on_either_host(cluster, tmp_path):
    """`trainyard run` with train.nnodes=2 on host A, then Ctrl-C (SIGINT to its process
    group, as a terminal sends it): the workers of both hosts stop at one step and commit
    it, the command exits 130 on the line naming that commit, and node 1's flow run ends
    with no process of the run left on host B."""
    argv = [str(BIN / "trainyard"), "run", "--run-id", "ctrl-c", "-S", "train.nnodes=2",
            "-S", "train.workers=1", "-S", "train.epochs=500",
            "-S", "model.options={seconds: 0.05}", "-S", "checkpoint.every_n_steps=10"]  # fmt: skip
    console = tmp_path / "console.log"
    with console.open("wb") as out:
        proc = cluster.a.popen(argv, cwd=cluster.project, env=cluster.env, stdout=out,
                               stderr=subprocess.STDOUT)  # fmt: skip
    try:

        def both_trained() -> bool:  # a commit: steps made on both hosts
            return bool(committed_checkpoints(cluster.store, "ctrl-c")) or proc.poll() is not None

        wait_until(both_trained, 600, lambda: console.read_text()[-3000:] + cluster.tails())
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = console.read_text()
    assert proc.returncode == 130, text[-3000:]
    stopped = re.search(r"trainyard: interrupted; run ctrl-c stopped at step (\d+) and "
                        r"committed checkpoint step (\d+)", text)  # fmt: skip
    assert stopped, text[-3000:]
    (node,) = cluster.node_runs("ctrl-c")

    def left() -> list[str]:
        return _run_processes(cluster.b, "ctrl-c", [node["id"]])

    wait_until(lambda: not left(), 180, lambda: "\n".join(left()) + cluster.tails())
    wait_until(lambda: cluster.state(node["id"])["type"] in TERMINAL, 120, cluster.tails)
    print(f"\nnode 1 after Ctrl-C on node 0: {cluster.state(node['id'])}")
    assert cluster.state(node["id"])["type"] in {"CANCELLED", "COMPLETED"}, cluster.tails()


def test_every_trial_of_a_sweep_trains_on_both_hosts(cluster):
    """A sweep started on host A whose trials are two-node runs: each trial launches its own
    node 1 on host B (a child of the trial's flow run) and meets it at a new rendezvous."""
    space = 'sweep.space={"train.lr": {"type": "categorical", "choices": [0.01, 0.1]}}'
    settings = ["train.nnodes=2", "train.workers=1", "train.epochs=1", space, "sweep.sampler=grid",
                "sweep.n_trials=2", "sweep.max_concurrent_trials=1", "sweep.pruner=none"]  # fmt: skip
    trainyard = str(BIN / "trainyard")
    argv = [trainyard, "sweep", "run", *(a for s in settings for a in ("-S", s))]
    done = cluster.a.run(argv, cwd=cluster.project, env=cluster.env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + cluster.tails()
    sweep_id = done.stdout.splitlines()[0].removeprefix("sweep ").strip()
    show = cluster.a.run([trainyard, "sweep", "show", sweep_id, "--json"], cwd=cluster.project,
                         env=cluster.env, capture_output=True, text=True, timeout=120)  # fmt: skip
    trials = json.loads(show.stdout)["trials"]
    assert sorted(t["params"]["train.lr"] for t in trials) == [0.01, 0.1], (trials, done.stdout)
    for trial in trials:
        assert trial["state"] == "COMPLETE", trial
        record = load_record(cluster.store, trial["run_id"])
        hosts = {n.node_rank: n.host for n in record.nodes}
        assert hosts == {0: "host-a", 1: "host-b"}, (trial, hosts)
        (node,) = cluster.node_runs(trial["run_id"])
        assert node["state_type"] == "COMPLETED" and node["parent_task_run_id"], node


def test_a_node_failing_by_its_own_error_fails_the_run_in_its_line_unreplaced(cluster):
    """Host B lacks the run's dataset (the user's own, never pulled there): node 1 stops in
    one line saying so, and node 0 fails the run with that line, naming node 1. No
    replacement is asked for: on another host it would fail alike."""
    bundled = yaml.safe_load((cluster.project / "params.yaml").read_text())["data"]["path"]
    own = "data/own.csv"
    copied = cluster.a.run(["cp", bundled, own], cwd=cluster.project)  # in A's copy only
    assert copied.returncode == 0
    overrides = ["train.nnodes=2", "train.workers=1", f"data.path={own}"]
    flow_run_id = cluster.run_on_a("unpulled", overrides)
    wait_until(lambda: cluster.state(flow_run_id)["type"] in TERMINAL, 300, cluster.tails)
    state = cluster.state(flow_run_id)
    assert state["type"] == "FAILED", cluster.tails()
    message = state["message"]
    assert "node 1 (host host-b, flow run" in message, message
    assert f"failed: data.path {own} is not on this machine" in message, message
    assert "dvc pull" in message and "\n" not in message, message
    (node,) = cluster.node_runs("unpulled")
    assert node["state_type"] == "FAILED", node

"""A lost host costs at most one checkpoint interval: a two-host run (network namespaces, as in
test_nodes) whose second host is lost mid-run: cut off (its processes live on), or dead
(every process of it killed, its Prefect worker too). Node 0's launcher sees that host's
worker miss its heartbeats, marks the node's flow run crashed and asks the pool for a
replacement: with the host back the run finishes on it from the last commit (the cut-off
old node stopping itself); with the host gone for good a fixed-size run fails in one line
naming the node; an elastic 1:2 run trains on alone and scales back to 2 when the host
returns. A host holding another signing key fails the run in its node's line."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
import test_nodes as two_hosts
import yaml
from hosts import Host, hosts
from node_loss_support import GATE_ENV, HOLD_ENV
from test_nodes import TERMINAL, Cluster, wait_until

from trainyard.checkpoint.layout import MANIFEST_FILE, committed_checkpoints
from trainyard.checkpoint.signing import SIGNING_KEY_ENV
from trainyard.runs.record import load_record
from trainyard.storage.store import ENDPOINT_ENV

from conftest import BIN

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TESTS = str(Path(__file__).parents[1])
# Prefect's server calls a worker offline after 3 missed heartbeats: 9 s here (90 s by default).
HEARTBEAT_S = 3
EVERY = 10  # checkpoint.every_n_steps: a commit every half epoch
TRAINING = [
    "train.workers=1",
    "train.epochs=4",
    f"checkpoint.every_n_steps={EVERY}",
    "model.options={seconds: 0.04}",  # seconds of training left after the first commit
]
HELD = {"name": "node_loss_support:alone_held_mlp", "options": {"seconds": 0.04}}


@dataclass
class LossyCluster(Cluster):
    """The two hosts of test_nodes, with a worker per host that a test may kill and start."""

    workers: dict[str, subprocess.Popen] = field(default_factory=dict)  # by host name

    def start_worker(self, host: Host, **env: str) -> None:
        """`env`: on top of the cluster's environment, for this worker's flow runs."""
        log = self.logs[1 + host.index]
        with log.open("ab") as out:
            self.workers[host.name] = host.popen(
                [str(BIN / "trainyard"), "worker"], cwd=self.project, env=self.env | env,
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def worker_lives(self, host: Host) -> bool:
        """By its process: the server calls a killed worker online for a while yet."""
        worker = self.workers.get(host.name)
        return worker is not None and worker.poll() is None

    def online(self) -> set[str]:
        return two_hosts._online(self)

    def run_held(self, run_id: str, overrides: list[str]) -> str:
        """run_on_a, its training across the two hosts held before its first step until
        _kill_b_after_commits lets it go on."""
        self.let_train_across(0)
        return self.run_on_a(run_id, overrides)

    def let_train_across(self, batches: int | None) -> None:
        """Each worker of a run spanning the hosts trains `batches` micro-batches (None: any
        number) from its start (node_loss_support)."""
        gate = Path(self.env[GATE_ENV])
        if batches is None:
            gate.unlink(missing_ok=True)
            return
        written = gate.with_suffix(".new")
        written.write_text(str(batches))
        written.replace(gate)  # whole, never half-written

    def children(self, run_id: str) -> list[dict]:
        """The run's node flow runs, oldest first."""
        return sorted(self.node_runs(run_id), key=lambda run: run["created"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LossyCluster]:
    """As test_nodes' cluster, the workers' heartbeats every HEARTBEAT_S."""
    tmp = tmp_path_factory.mktemp("node-loss")
    project = two_hosts._project(tmp / "project")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["model"] = HELD  # a flow run's overrides may not name code to import
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    drop = (ENDPOINT_ENV, *two_hosts.SECRET_NAMES, "PREFECT_API_URL", "PREFECT_PROFILE",
            "COMET_API_KEY")  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in drop}
    with hosts(2, own_copy=project, shared=()) as net:
        a, b = net
        api_url = f"http://{a.address}:{two_hosts.PORT}/api"
        env = base | {
            "HOME": str(tmp / "home"),
            "DVC_NO_ANALYTICS": "1",
            "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_API_URL": api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "PREFECT_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
            "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_LOOP_SECONDS": "2",
            "PYTHONPATH": TESTS,  # runs' workers import node_loss_support's model
            HOLD_ENV: str(tmp / "hold-alone"),
            GATE_ENV: str(tmp / "gate-across"),  # outside the project: both hosts read it
        }
        trainyard = str(BIN / "trainyard")
        logs = [tmp / "server.log", tmp / "worker-a.log", tmp / "worker-b.log"]
        up = a.run([trainyard, "storage", "up", "--host", a.address], cwd=project, env=env,
                   capture_output=True, text=True, timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            exported = a.run([trainyard, "storage", "env"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
            exports = two_hosts._exports(exported.stdout)
            env.update(exports)
            store = two_hosts._store(exports)
            cluster = LossyCluster(a, b, project, env, api_url, store, logs)
            with logs[0].open("wb") as out:
                a.popen([str(BIN / "prefect"), "server", "start", "--host", a.address,
                         "--port", str(two_hosts.PORT)], cwd=project, env=env, stdout=out,
                        stderr=subprocess.STDOUT)  # fmt: skip
            wait_until(lambda: two_hosts._healthy(api_url), 180, cluster.tails)
            deploy = a.run([trainyard, "deploy"], cwd=project, env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
            assert deploy.returncode == 0, deploy.stdout + deploy.stderr
            cluster.start_worker(a)
            cluster.start_worker(b)
            wait_until(lambda: cluster.online() == {a.name, b.name}, 180, cluster.tails)
            yield cluster
        finally:
            a.run([trainyard, "storage", "down"], cwd=project, env=env, timeout=120)


def _kill_b_after_commits(
    cluster: LossyCluster, run_id: str, parent: str, commits: int, loss: str = "kill"
) -> float:
    """Wait until node 1 trains on host B and the run commits `commits` checkpoints across
    the two hosts (an elastic run may have begun, and committed, on node 0 alone), then lose
    host B (`loss`: "kill" every process of it, "cut" its network, or "power" it off and on
    again): when. The run (started by run_held) trains on the two hosts no further than
    those commits until host B is lost: the loss comes mid-run however fast the steps go,
    or however slowly the test sees them."""

    def ended() -> bool:
        return cluster.state(parent)["type"] in TERMINAL

    def b_trains() -> bool:
        ids = [parent, *(run["id"] for run in cluster.children(run_id))]
        found = two_hosts._run_processes(cluster.b, run_id, ids)
        return any(two_hosts._is_worker(line) for line in found) or ended()

    wait_until(b_trains, 600, cluster.tails)
    # Resumed from a commit (every EVERY steps) or from step 0, a step a micro-batch each.
    cluster.let_train_across(commits * EVERY)

    def committed() -> bool:  # by both hosts: node 0 alone may still commit as B joins
        return len(_commits_across(cluster, run_id)) >= commits or ended()

    wait_until(committed, 600, cluster.tails)
    assert cluster.state(parent)["type"] == "RUNNING", cluster.tails()
    (node,) = cluster.children(run_id)
    assert node["work_queue_name"] == f"host-{cluster.b.name}", node
    if loss == "cut":  # unplugged: its processes live on, cut off from everything
        cluster.b.cut_network()
    elif loss == "power":  # off and on again: nothing left running, nobody told
        cluster.b.power_cycle()
    else:
        cluster.b.kill_all()
    lost_at = time.time()
    cluster.let_train_across(None)  # node 0's next step meets the loss
    return lost_at


def _commits_across(cluster: LossyCluster, run_id: str) -> list[str]:
    """The run's commits made across the two hosts (a manifest of world size 2)."""
    store = cluster.store
    uris = committed_checkpoints(store, run_id)
    return [
        u for u in uris if store.read_json(f"{store.key_of(u)}/{MANIFEST_FILE}")["world_size"] == 2
    ]


def _crashed_since(cluster: LossyCluster, flow_run_id: str) -> float:
    """Wait until the launcher marks the lost node's flow run crashed: when it did."""
    wait_until(lambda: cluster.state(flow_run_id)["type"] != "RUNNING", 180, cluster.tails)
    state = cluster.state(flow_run_id)
    assert state["type"] == "CRASHED", state
    # Node 0 marks it so; or, where the kill reached host B's guardian a moment after its
    # flow run's process, the guardian did first.
    lost = f"host {cluster.b.name} was lost"
    assert lost in state["message"] or "command was killed" in state["message"], state
    return time.time()


def _when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _replacement_running(cluster: LossyCluster, run_id: str) -> float:
    def running() -> bool:
        runs = cluster.children(run_id)
        return len(runs) == 2 and runs[1]["start_time"] is not None

    wait_until(running, 300, cluster.tails)
    return _when(cluster.children(run_id)[1]["start_time"])


def test_a_host_cut_off_is_replaced_and_its_old_node_leaves_once_it_is_back(cluster):
    """Host B's network is cut mid-run (its processes live on, unreachable): node 0 sees its
    worker miss its heartbeats and marks the node crashed. Plugged back in, B's worker is
    online again and takes the replacement node 1; the cut-off node reads that it was
    marked lost and stops (tasks/node_fence.py) rather than train on beside it, and the run
    finishes from its last commit as two nodes would."""
    _b_worker_online(cluster)
    begun = time.monotonic()
    parent = cluster.run_held("cut", ["train.nnodes=2", *TRAINING])
    cut_at = _kill_b_after_commits(cluster, "cut", parent, 1, loss="cut")
    (lost,) = cluster.children("cut")
    seen = _crashed_since(cluster, lost["id"])
    cluster.b.restore_network()
    joined = _replacement_running(cluster, "cut")
    wait_until(lambda: cluster.state(parent)["type"] in TERMINAL, 600, cluster.tails)
    assert cluster.state(parent)["type"] == "COMPLETED", cluster.tails()
    old, new = cluster.children("cut")
    assert old["id"] == lost["id"], old
    assert new["parameters"]["node_rank"] == 1 and new["state_type"] == "COMPLETED", new
    assert new["work_queue_name"] == f"host-{cluster.b.name}" and new["parent_task_run_id"]
    record = load_record(cluster.store, "cut")
    after = [e for e in record.resumes if e["resumed_at"] and e["resumed_at"] > cut_at]
    assert after and all(e["world_size_after"] == 2 for e in after), record.resumes
    assert all(e["samples_skipped"] == 0 and e["samples_repeated"] == 0 for e in after)
    left = lambda: two_hosts._run_processes(cluster.b, "cut", [lost["id"]])  # noqa: E731
    wait_until(lambda: not left(), 300, lambda: "\n".join(left()) + cluster.tails())
    # The old node ends its own flow run before its process exits; the run may have finished
    # on the replacement before the old node read that it was marked lost.
    state = cluster.state(lost["id"])
    assert state["type"] == "FAILED", state
    message = state["message"]
    assert "this node's flow run was marked Crashed (host host-b was lost" in message, message
    assert "it stopped rather than train beside its replacement" in message, message
    print(
        f"\nhost cut off -> loss seen {seen - cut_at:.1f} s -> (plugged back in) replacement "
        f"running {joined - cut_at:.1f} s -> training again {after[0]['resumed_at'] - cut_at:.1f}"
        f" s; steps redone {after[0]['steps_redone']}; test {time.monotonic() - begun:.0f} s"
    )


def test_a_lost_host_never_back_fails_a_fixed_run_in_one_line(cluster):
    _b_worker_online(cluster)
    # The first rendezvous waits this long too, while host B's worker takes node 1's flow run
    # and starts torch: 20 s fell short on a slow, busy machine.
    timeout_s = 60
    overrides = ["train.nnodes=2", f"train.node_timeout_s={timeout_s}", *TRAINING,
                 "train.epochs=50"]  # fmt: skip
    parent = cluster.run_held("never-back", overrides)
    _kill_b_after_commits(cluster, "never-back", parent, 1)
    (lost,) = cluster.children("never-back")
    seen = _crashed_since(cluster, lost["id"])
    wait_until(lambda: cluster.state(parent)["type"] in TERMINAL, 300, cluster.tails)
    ended = time.time()
    state = cluster.state(parent)
    assert state["type"] == "FAILED", state
    message = state["message"]
    assert f"node 1 (host {cluster.b.name}) was lost" in message, message
    assert f"no replacement joined within {timeout_s} s" in message, message
    assert "\n" not in message, message
    assert [run["id"] for run in cluster.children("never-back")] == [lost["id"]]
    print(f"\nnever back: failed {ended - seen:.1f} s after the loss was seen")


def test_a_host_with_another_signing_key_fails_the_run_in_its_line(cluster, tmp_path):
    """Host B's project holds a checkpoint signing key of its own (never copied from A): its
    node stops before it trains, and the run fails in that line, naming node 1."""
    if cluster.worker_lives(cluster.b):
        cluster.b.kill_all()
    own_key = tmp_path / "b-signing.key"
    own_key.write_text("ab" * 32 + "\n")
    own_key.chmod(0o600)
    cluster.start_worker(cluster.b, **{SIGNING_KEY_ENV: str(own_key)})
    try:
        wait_until(lambda: cluster.worker_lives(cluster.b) and cluster.b.name in cluster.online(),
                   180, cluster.tails)  # fmt: skip
        parent = cluster.run_on_a("other-key", ["train.nnodes=2", *TRAINING])
        wait_until(lambda: cluster.state(parent)["type"] in TERMINAL, 300, cluster.tails)
    finally:
        cluster.b.kill_all()  # the next test starts host B's worker with the cluster's key
    state = cluster.state(parent)
    assert state["type"] == "FAILED", cluster.tails()
    message = state["message"]
    assert "node 1 (host host-b, flow run" in message and "\n" not in message, message
    assert f"failed: this machine's checkpoint signing key {own_key}" in message, message
    assert "is not node 0's (key id " in message and "ab" * 32 not in message, message
    (node,) = cluster.children("other-key")
    assert node["state_type"] == "FAILED", node  # not replaced: another host would fail alike


def test_a_host_back_before_its_worker_was_missed_has_its_old_node_replaced(cluster):
    """Host B loses power mid-run and its worker is started again at once, with Prefect's
    default 30-s heartbeat: the server never misses a beat of it (three are allowed), so
    node 0 cannot tell the loss by B's worker. The new worker finds the old node's process
    gone and marks its flow run crashed (tasks/orphaned_runs.py); node 0 replaces the node
    on B and the run finishes from its last commit as two nodes."""
    default_beats = {"PREFECT_WORKER_HEARTBEAT_SECONDS": "30"}
    if cluster.worker_lives(cluster.b):
        cluster.b.kill_all()
    cluster.start_worker(cluster.b, **default_beats)
    try:
        wait_until(lambda: cluster.b.name in cluster.online(), 180, cluster.tails)
        parent = cluster.run_held("back-at-once", ["train.nnodes=2", *TRAINING])
        lost_at = _kill_b_after_commits(cluster, "back-at-once", parent, 1, loss="power")
        cluster.start_worker(cluster.b, **default_beats)
        (lost,) = cluster.children("back-at-once")
        wait_until(lambda: cluster.state(lost["id"])["type"] != "RUNNING", 180, cluster.tails)
        seen = time.time()
        state = cluster.state(lost["id"])
        assert state["type"] == "CRASHED", state
        assert f"host {cluster.b.name} was lost: its worker started again" in state["message"]
        wait_until(lambda: cluster.state(parent)["type"] in TERMINAL, 600, cluster.tails)
    finally:
        cluster.b.kill_all()  # the next test starts host B's worker with 3-s heartbeats
    assert cluster.state(parent)["type"] == "COMPLETED", cluster.tails()
    old, new = cluster.children("back-at-once")
    assert old["id"] == lost["id"] and old["state_type"] == "CRASHED", old
    assert new["parameters"]["node_rank"] == 1 and new["state_type"] == "COMPLETED", new
    assert new["work_queue_name"] == f"host-{cluster.b.name}", new
    record = load_record(cluster.store, "back-at-once")
    after = [e for e in record.resumes if e["resumed_at"] and e["resumed_at"] > lost_at]
    assert after and all(e["world_size_after"] == 2 for e in after), record.resumes
    assert all(e["samples_skipped"] == 0 and e["samples_repeated"] == 0 for e in after)
    print(f"\nhost back at once -> old node crashed by its new worker {seen - lost_at:.1f} s")


def _b_worker_online(cluster: LossyCluster) -> None:
    if not cluster.worker_lives(cluster.b):  # an earlier test left host B dead
        cluster.start_worker(cluster.b)
    wait_until(lambda: cluster.b.name in cluster.online(), 180, cluster.tails)


def test_an_elastic_run_trains_on_alone_and_scales_back_when_the_host_returns(cluster):
    _b_worker_online(cluster)
    # The undisturbed run trains beside the elastic one (it is read at the end).
    reference_log = cluster.project.parent / "undisturbed.log"
    with reference_log.open("wb") as out:
        reference = cluster.a.popen([str(BIN / "trainyard"), "run", "-S", "train.workers=2",
                                     "-S", "train.epochs=4", "--run-id", "undisturbed"],
                                    cwd=cluster.project, env=cluster.env, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
    hold = Path(cluster.env[HOLD_ENV])
    hold.touch()  # alone, node 0 trains a few steps, then waits for host B's return
    try:
        assert reference.poll() in (None, 0), reference_log.read_text()[-3000:]
        parent = cluster.run_held("elastic", ["train.nnodes=1:2", *TRAINING])
        killed_at = _kill_b_after_commits(cluster, "elastic", parent, 2)
        at_kill = set(committed_checkpoints(cluster.store, "elastic"))
        (lost,) = cluster.children("elastic")
        _crashed_since(cluster, lost["id"])

        def committed_alone() -> bool:  # a commit made while host B was dead
            return bool(set(committed_checkpoints(cluster.store, "elastic")) - at_kill) or (
                cluster.state(parent)["type"] in TERMINAL
            )

        wait_until(committed_alone, 300, cluster.tails)
        assert cluster.state(parent)["type"] == "RUNNING", cluster.tails()
        cluster.start_worker(cluster.b)  # the host is back: the run scales up again
        wait_until(lambda: cluster.state(parent)["type"] in TERMINAL, 600, cluster.tails)
        assert reference.wait(timeout=600) == 0, reference_log.read_text()[-3000:]
    finally:
        hold.unlink(missing_ok=True)
        if reference.poll() is None:  # the test failed on the way: its whole group goes
            os.killpg(reference.pid, signal.SIGKILL)
    assert cluster.state(parent)["type"] == "COMPLETED", cluster.tails()
    old, new = cluster.children("elastic")
    assert old["state_type"] == "CRASHED" and new["state_type"] == "COMPLETED", new
    assert new["parameters"]["node_rank"] == 1 and new["parent_task_run_id"]
    record = load_record(cluster.store, "elastic")
    changes = [(e["world_size_before"], e["world_size_after"]) for e in record.resumes
               if e["resumed_at"] and e["resumed_at"] > killed_at]  # fmt: skip
    assert changes[:1] == [(2, 1)] and (1, 2) in changes, record.resumes
    causes = {(e["world_size_before"], e["world_size_after"]): e["after"] for e in record.resumes}
    assert causes[2, 1] == "node left" and causes[1, 2] == "node joined", record.resumes
    # B's first join too, which node 0's torchrun counted as no restart (it began alone).
    assert all(e["after"] for e in record.resumes), record.resumes
    assert record.restarts == len(record.resumes), "each a restart, as runs show counts them"
    assert all(e["samples_skipped"] == 0 and e["samples_repeated"] == 0 for e in record.resumes)
    undisturbed = load_record(cluster.store, "undisturbed").metrics["test_accuracy"]
    accuracy = record.metrics["test_accuracy"]
    assert abs(accuracy - undisturbed) <= 0.01, (accuracy, undisturbed)


def test_an_elastic_run_cut_off_from_its_host_trains_on_alone_and_scales_back_plugged_in(cluster):
    """Host B's network is cut (its processes live on, unreachable) under a 1:2 run: node 0's
    launcher sees B's worker miss its heartbeats and restarts node 0's workers, stuck in a
    collective with B (else they would wait out train.hang_timeout_s, 300 s); the rendezvous
    drops B and node 0 trains alone from the last commit. Plugged back in, the cut-off node
    stops (fenced) and the replacement scales the run back to 2, nothing skipped or
    repeated."""
    _b_worker_online(cluster)
    hold = Path(cluster.env[HOLD_ENV])
    hold.touch()  # alone, node 0 trains a few steps, then waits for host B's return
    try:
        parent = cluster.run_held("elastic-cut", ["train.nnodes=1:2", *TRAINING])
        cut_at = _kill_b_after_commits(cluster, "elastic-cut", parent, 1, loss="cut")
        at_cut = set(committed_checkpoints(cluster.store, "elastic-cut"))
        (lost,) = cluster.children("elastic-cut")
        seen = _crashed_since(cluster, lost["id"])

        def committed_alone() -> bool:  # a commit made while host B was cut off
            return bool(set(committed_checkpoints(cluster.store, "elastic-cut")) - at_cut) or (
                cluster.state(parent)["type"] in TERMINAL
            )

        wait_until(committed_alone, 300, cluster.tails)
        alone = time.time()
        assert cluster.state(parent)["type"] == "RUNNING", cluster.tails()
        cluster.b.restore_network()  # node 0 holds until the run is two nodes again
        wait_until(lambda: cluster.state(parent)["type"] in TERMINAL, 600, cluster.tails)
    finally:
        hold.unlink(missing_ok=True)
    assert cluster.state(parent)["type"] == "COMPLETED", cluster.tails()
    record = load_record(cluster.store, "elastic-cut")
    after = [e for e in record.resumes if e["resumed_at"] and e["resumed_at"] > cut_at]
    changes = [(e["world_size_before"], e["world_size_after"], e["after"]) for e in after]
    assert changes[:1] == [(2, 1, "node left")] and (1, 2, "node joined") in changes, changes
    assert all(e["samples_skipped"] == 0 and e["samples_repeated"] == 0 for e in record.resumes)
    left = lambda: two_hosts._run_processes(cluster.b, "elastic-cut", [lost["id"]])  # noqa: E731
    wait_until(lambda: not left(), 300, lambda: "\n".join(left()) + cluster.tails())
    print(
        f"\nelastic, host cut off -> loss seen {seen - cut_at:.1f} s -> training alone again "
        f"{after[0]['resumed_at'] - cut_at:.1f} s (a commit alone {alone - cut_at:.1f} s); "
        f"steps redone {after[0]['steps_redone']}"
    )

"""Node 0's side of a multi-node run (train.nnodes > 1, no train.rdzv_endpoint): it picks the
rendezvous address, finds a host for every other node among the work pool's online workers
(one node per host other than its own), starts each node as a `training_node/manual` flow
run on that host's work queue, a child of this run's flow run, and watches them while its
own torchrun trains. A node whose flow run crashes, or whose host's worker goes offline
(the host died), is lost: its flow run is marked crashed and the pool is asked for a
replacement with the same node_rank on a free host, which joins node 0's restarted torchrun
(it resumes from the last commit). With a fixed train.nnodes a replacement that does not come
within train.node_timeout_s fails the run in one line naming the node; with an elastic
MIN:MAX the others train on meanwhile and the replacement scales the run back up. A node
that fails (its own error: another host would fail alike), is cancelled, or never starts,
stops node 0 with one line naming it. The nodes meet in torchrun's c10d rendezvous, ranked
by node_rank."""

from __future__ import annotations

import contextvars
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast
from urllib.parse import urlsplit
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State, WorkerStatus
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelled, Cancelling, Crashed

from tasks.node_fence import state_line
from tasks.node_share import host_queue
from tasks.orphaned_runs import ORPHANED
from trainyard.checkpoint.signing import key_id, project_key
from trainyard.config import TrainConfig, TrainyardConfig, load_config
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.runtime.network import address_towards
from trainyard.runtime.processes import ScopedJobs, job_scope
from trainyard.util.daemons import free_port

NODE_DEPLOYMENT = "training_node/manual"
POLL_S = 2.0  # how often the pool's workers and the nodes' flow runs are read
WAITING = {"SCHEDULED", "PENDING", "LATE", "AWAITINGRETRY"}
STARTED = {"PENDING", "RUNNING"}  # a worker took the flow run: its host runs it
MISSED_BEATS = 3  # a worker this many heartbeats late is offline, as Prefect's server has it
DEFAULT_HEARTBEAT_S = 30.0  # PREFECT_WORKER_HEARTBEAT_SECONDS' default


@dataclass
class Node:
    rank: int
    host: str
    flow_run_id: UUID
    asked_at: float = field(default_factory=time.monotonic)  # when its flow run was made


@dataclass
class LostNode:
    """A node whose host is gone, not yet replaced."""

    rank: int
    host: str
    why: str
    since: float = field(default_factory=time.monotonic)
    given_up: bool = False  # no replacements left (an elastic run trains on without it)


def needs_launch(config: TrainyardConfig) -> bool:
    """Node 0 of more than one node, its rendezvous left to it: it starts the others."""
    train = config.train
    return train.max_nodes > 1 and train.node_rank == 0 and not train.rdzv_endpoint


@contextmanager
def other_nodes(
    run_id: str, config: TrainyardConfig, paths: ProjectPaths, log: Any
) -> Iterator[TrainyardConfig]:
    """Start nodes 1..nnodes-1 on other hosts; yields node 0's settings with the chosen
    rendezvous. Inside the block node 0 trains; a node that fails stops its torchrun
    (KeyboardInterrupt out of the job, this run's only: a sweep's other trials train on),
    which leaves here as one line naming that node.
    On any way out but success the nodes still running are cancelled."""
    train = config.train
    endpoint = rendezvous_endpoint(PREFECT_API_URL.value() or "")
    with get_client(sync_client=True) as client:
        deployment = node_deployment(client)
        pool = deployment.work_pool_name or "default"
        hosts = wait_for_hosts(client, pool, train.max_nodes - 1, train.node_timeout_s)
    overrides = settings_overrides(config, load_config(paths.params))
    log.info("rendezvous at %s; nodes 1..%d on %s", endpoint, train.max_nodes - 1, hosts)
    # Made now if this is the project's first run: every node checks it holds the same.
    signing = key_id(project_key(create=True))
    start = partial(_start_node, run_id, endpoint, overrides, signing)
    nodes = [start(rank, host) for rank, host in enumerate(hosts, 1)]
    with job_scope() as node_0:  # this run's torchrun, not a sweep's other trials'
        watch = _NodeWatch(nodes, start, pool, train, log, node_0)
        watch.start()
        done = False
        try:
            yield config.model_copy(
                update={"train": train.model_copy(update={"rdzv_endpoint": endpoint})}
            )
            done = True
        except BaseException as error:
            # Stopped by the watcher (KeyboardInterrupt out of the job): its line. Failed by
            # itself: a lost node is the reason rather than torchrun's rendezvous timeout.
            why = watch.settle() if isinstance(error, Exception) else watch.failure
            if why is not None:
                raise TrainyardError(why) from None
            raise
        finally:
            watch.stop()
            # Done: a replacement that never got to start has nothing left to join.
            _cancel_unfinished(watch.nodes, waiting_only=done)
            if done:
                try:
                    watch.crash_silent_nodes()
                except Exception as error:  # the run trained: a server gone now fails nothing
                    log.warning("could not check the nodes' hosts at the end: %s", error)


def node_deployment(client: Any) -> Any:
    """The deployment every other node runs as, or one line saying how to register it."""
    try:
        return client.read_deployment_by_name(NODE_DEPLOYMENT)
    except ObjectNotFound:
        raise TrainyardError(
            f"train.nnodes > 1 starts the other nodes as the deployment {NODE_DEPLOYMENT}, "
            f"which the Prefect server at {PREFECT_API_URL.value()} does not have: run "
            "`trainyard deploy` with PREFECT_API_URL set to a server every machine reaches "
            "(docs/multi-node.md), or give -S train.rdzv_endpoint=HOST:PORT and start the "
            "other nodes with `trainyard join`"
        ) from None


def rendezvous_endpoint(api_url: str) -> str:
    """host:port on this machine that the other nodes reach: the source address of the
    route toward the Prefect server's host (which every worker reaches), and a free port."""
    address = address_towards(urlsplit(api_url).hostname or "127.0.0.1")
    port = free_port(address)  # out of the ephemeral range: torchrun binds it seconds later
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class HostBeats:
    """Which hosts' workers are alive, judged by when this process last saw each worker's
    heartbeat change, by its own clock (the machines' clocks need not agree with the
    server's). Prefect's server calls a worker offline after 3 missed heartbeats too, but
    only on its foreman's next pass, up to 15 s later: by then node 0's own rendezvous may
    have given up on the lost host, and the run would fail on a timeout naming nobody."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Any, float, float]] = {}  # beat, seen at, interval

    def alive(self, client: Any, pool: str) -> list[str]:
        now = time.monotonic()
        found = set()
        workers = client.read_workers_for_work_pool(pool, limit=200)
        freshest = max((w.last_heartbeat_time for w in workers if w.last_heartbeat_time),
                       default=None)  # fmt: skip
        for worker in workers:
            beat, seen_at, _ = self._seen.get(worker.name, (None, now, 0.0))
            if worker.name not in self._seen and freshest and worker.last_heartbeat_time:
                # First sight: its beat as far back as the server has it behind the pool's
                # freshest (both by the server's clock), so that a host dead since before
                # this run does not count as alive for three more of its heartbeats.
                seen_at = now - (freshest - worker.last_heartbeat_time).total_seconds()
            elif worker.last_heartbeat_time != beat:
                seen_at = now
            interval = worker.heartbeat_interval_seconds or DEFAULT_HEARTBEAT_S
            self._seen[worker.name] = (worker.last_heartbeat_time, seen_at, interval)
            if worker.status == WorkerStatus.ONLINE and now - seen_at <= MISSED_BEATS * interval:
                found.add(worker.name)
        return sorted(found)

    def last_beat(self, host: str) -> float:
        """When the host's worker last beat as this process saw it, in seconds since boot
        (as /proc counts a process's start); now if never seen."""
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        seen = self._seen.get(host)
        return now - (time.monotonic() - seen[1]) if seen else now

    def late(self, host: str) -> bool:
        """The host's worker missed a heartbeat (two polls' grace): lost, or slow."""
        if host not in self._seen:
            return False
        _, seen_at, interval = self._seen[host]
        return time.monotonic() - seen_at > interval + 2 * POLL_S

    def window_s(self) -> float:
        """How long a lost host's worker may still count as alive here."""
        intervals = [interval for _, _, interval in self._seen.values()]
        return MISSED_BEATS * max(intervals, default=DEFAULT_HEARTBEAT_S) + 2 * POLL_S


def wait_for_hosts(client: Any, pool: str, needed: int, timeout_s: float) -> list[str]:
    """`needed` hosts other than this one, waiting up to `timeout_s` for their workers: those
    whose last heartbeat is on time (the server calls a dead host's worker online for three
    of its heartbeats and up to a foreman pass more)."""
    here = socket.gethostname()
    deadline = time.monotonic() + timeout_s
    beats = HostBeats()
    while True:
        hosts = [host for host in beats.alive(client, pool) if not beats.late(host)]
        others = [host for host in hosts if host != here]
        if len(others) >= needed:
            return others[:needed]
        if time.monotonic() >= deadline:
            listed = ", ".join(hosts) or "none"
            raise TrainyardError(
                f"node {len(others) + 1} did not start within {timeout_s:g} s: the pool "
                f"{pool!r} has workers on {len(hosts)} host(s) ({listed}); start "
                "`trainyard worker` on another machine (train.node_timeout_s sets the wait)"
            )
        time.sleep(POLL_S)


def settings_overrides(config: TrainyardConfig, base: TrainyardConfig) -> list[str]:
    """`section.key=value` strings that turn the project's params.yaml (`base`) into
    `config`: what the other nodes, in their copy of the project, load as node 0 has it."""
    found: list[str] = []

    def walk(key: str, mine: Any, theirs: Any) -> None:
        # A mapping keyed by dotted names (sweep.space's "train.lr") goes whole: an
        # override's key splits at every dot.
        if isinstance(mine, dict) and isinstance(theirs, dict) and "." not in "".join(mine):
            for name, value in mine.items():
                walk(f"{key}.{name}" if key else name, value, theirs.get(name))
        elif mine != theirs:
            found.append(f"{key}={json.dumps(mine)}")  # JSON is YAML, as overrides read it

    walk("", config.model_dump(mode="json"), base.model_dump(mode="json"))
    return found


def _start_node(
    run_id: str, endpoint: str, overrides: list[str], signing: str, rank: int, host: str
) -> Node:
    parameters = {
        "run_id": run_id,
        "node_rank": rank,
        "rdzv_endpoint": endpoint,
        "overrides": overrides,
        "signing_key_id": signing,
    }
    # Called from sync code: the FlowRun itself (async_dispatch types the coroutine too).
    run = cast(
        FlowRun,
        run_deployment(
            NODE_DEPLOYMENT,
            parameters=parameters,
            flow_run_name=f"{run_id}-node-{rank}",
            timeout=0,  # started, not waited for: node 0 trains beside it
            as_subflow=True,  # shown under this run's flow run, and cancelled with it
            work_queue_name=host_queue(host),
        ),
    )
    return Node(rank, host, run.id)


class _NodeWatch(threading.Thread):
    """Reads the pool's workers and the nodes' flow runs while node 0 trains. A lost node
    (its flow run crashed, or its host's worker went offline under it) is marked
    crashed and replaced on a free host; node 0's torchrun, which saw its workers' peers go,
    waits for the replacement in its rendezvous. `failure`, once set, has stopped node 0's
    torchrun: a node failed, cancelled or never started, or a fixed-size run short of a node."""

    def __init__(
        self,
        nodes: list[Node],
        start: Callable[[int, str], Node],
        pool: str,
        train: TrainConfig,
        log: Any,
        node_0: ScopedJobs,
    ) -> None:
        super().__init__(name="node-watch", daemon=True)
        self.nodes = nodes
        self.lost: list[LostNode] = []
        self.failure: str | None = None
        self.failed_node: str | None = None  # a failure that is a node's own error
        self._node_0 = node_0
        self._start = start
        self._pool = pool
        self._timeout_s = train.node_timeout_s
        self._elastic = train.elastic
        # Each loss costs node 0's torchrun a restart of its own, so no more are worth it.
        self._replacements_left = train.max_restarts
        self._log = log
        # run_deployment links a child to the flow run in this context (the task's).
        self._context = contextvars.copy_context()
        self._ended = threading.Event()
        self._beats = HostBeats()

    def stop(self) -> None:
        self._ended.set()
        self.join(timeout=30)

    def missing(self) -> str | None:
        """Why the run is short of a node now, if it is."""
        return self._short_line(self.lost[0]) if self.lost else None

    def settle(self) -> str | None:
        """Node 0's torchrun failed by itself. While a node's host is late with its
        heartbeat, wait (at most as long as a lost host may look alive) to learn whether it
        is lost: the line to fail the run with, if a node explains the failure."""
        deadline = time.monotonic() + self._beats.window_s()
        while self.is_alive() and time.monotonic() < deadline:
            if self.failure or self.lost:
                break
            if not any(self._beats.late(node.host) for node in list(self.nodes)):
                break
            time.sleep(POLL_S / 4)
        # A node failing after node 0 did may only echo node 0's own error: that one stands.
        return self.missing() or (self.failure if self.failure != self.failed_node else None)

    def crash_silent_nodes(self) -> None:
        """Node 0 is done. A node still running on a host whose worker stopped beating (lost
        too late for the run to notice) has nobody left to end its flow run, which would
        show Running for good: wait, at most as long as a lost host may look alive, for the
        running nodes to finish, then mark crashed those still running on a host that looks
        lost. Not at first sight: a worker's beats can lag while its node finishes (a
        server too busy to store them, a beat stuck on a link that just came back)."""
        deadline = time.monotonic() + self._beats.window_s() + POLL_S
        with get_client(sync_client=True) as client:
            running = self._running(client)
            while running and time.monotonic() < deadline:
                time.sleep(POLL_S)
                running = self._running(client)
            alive = self._beats.alive(client, self._pool) if running else []
            for node in running:
                if node.host in alive:
                    continue  # its host is there: it ends its flow run itself
                message = f"host {node.host} was lost: its worker stopped beating"
                client.set_flow_run_state(node.flow_run_id, Crashed(message=message), force=True)
                self.nodes.remove(node)
                self._log.warning("node %d (host %s): %s", node.rank, node.host, message)

    def _running(self, client: Any) -> list[Node]:
        """The nodes whose flow run is running (not ended, nor cancelled before starting)."""
        running = []
        for node in self.nodes:
            state = client.read_flow_run(node.flow_run_id).state
            if state is not None and state.type.value == "RUNNING":
                running.append(node)
        return running

    def run(self) -> None:
        with get_client(sync_client=True) as client:
            while not self._ended.wait(POLL_S):
                try:
                    self.failure = self._check(client)
                except Exception as error:  # the server busy a moment: read again next poll
                    self._log.warning("reading the nodes' state failed: %s", error)
                    continue
                if self.failure is not None:
                    self._node_0.stop()
                    return

    def _check(self, client: Any) -> str | None:
        online = self._beats.alive(client, self._pool)
        for node in list(self.nodes):
            state = client.read_flow_run(node.flow_run_id).state
            if state is None:
                continue
            failure = self._failure(node, state)
            if failure is not None:
                return failure
            why = _lost_because(node, state, online)
            if why is not None:
                # Orphaned: its host died and came back, its sockets gone without a word.
                host_gone = node.host not in online or state.name == ORPHANED
                self._lose(client, node, state, why, host_gone=host_gone)
        return self._replace(online)

    def _failure(self, node: Node, state: State) -> str | None:
        name = state.type.value
        what = f"node {node.rank} (host {node.host}, flow run {node.flow_run_id})"
        if name in {"CANCELLED", "CANCELLING"}:
            return f"{what} is {state.name}: {state.message or 'no message'}"
        if name == "FAILED":  # its own error (settings, data, code): a new host fails alike
            self.failed_node = f"{what} failed: {state_line(state)}"
            return self.failed_node
        if name in WAITING and time.monotonic() - node.asked_at > self._timeout_s:
            return (
                f"{what} did not start within {self._timeout_s:g} s (still {state.name}): is "
                f"`trainyard worker` running on {node.host}?"
            )
        return None

    def _lose(self, client: Any, node: Node, state: State, why: str, host_gone: bool) -> None:
        if not state.is_final():  # nobody is left on that host to end it
            message = f"host {node.host} was lost: {why}"
            client.set_flow_run_state(node.flow_run_id, Crashed(message=message), force=True)
        # Node 0's workers of a round with a host gone quiet may wait on it in a collective
        # (cut off rather than dead, its sockets never close): restart them, so that they
        # meet the replacement, or go on without it, rather than wait out the hang timeout
        # and then go on with the old node should its host come back. (A crashed node's
        # sockets closed: its peers failed by themselves.)
        if host_gone:
            last_beat = self._beats.last_beat(node.host)
            restarted = self._node_0.restart_workers_started_before(last_beat)
            ago = time.clock_gettime(time.CLOCK_BOOTTIME) - last_beat
            self._log.info(
                "restarted %d of node 0's worker process(es): those started before host %s's "
                "last heartbeat, %.0f s ago (later ones met in a round without it)",
                restarted, node.host, ago,
            )  # fmt: skip
        self.nodes.remove(node)
        self.lost.append(LostNode(node.rank, node.host, why))
        self._log.warning(
            "node %d (host %s, flow run %s) is lost: %s; asking the pool %r for a replacement",
            node.rank, node.host, node.flow_run_id, why, self._pool,
        )  # fmt: skip

    def _replace(self, online: list[str]) -> str | None:
        """Start a replacement for each lost node that has a free host: another host first,
        its own once its worker is back."""
        busy = {socket.gethostname(), *(node.host for node in self.nodes)}
        for lost in list(self.lost):
            free = sorted((host for host in online if host not in busy), key=lost.host.__eq__)
            if free and self._replacements_left == 0:
                line = (
                    f"node {lost.rank} (host {lost.host}) is lost ({lost.why}) and "
                    "train.max_restarts allows no more replacements"
                )
                if not self._elastic:
                    return line
                if not lost.given_up:  # an elastic run trains on with the nodes it has
                    self._log.warning("%s: training on without it", line)
                    lost.given_up = True
                continue
            if free:
                self._replacements_left -= 1
                node = self._context.copy().run(self._start, lost.rank, free[0])
                self.nodes.append(node)
                self.lost.remove(lost)
                busy.add(node.host)
                self._log.info(
                    "node %d: replacement on host %s (flow run %s)",
                    node.rank, node.host, node.flow_run_id,
                )  # fmt: skip
            elif not self._elastic and time.monotonic() - lost.since > self._timeout_s:
                return self._short_line(lost)
        return None

    def _short_line(self, lost: LostNode) -> str:
        return (
            f"node {lost.rank} (host {lost.host}) was lost ({lost.why}) and no replacement "
            f"joined within {self._timeout_s:g} s: the pool {self._pool!r} has no free host; "
            f"start `trainyard worker` on {lost.host} or another machine "
            "(train.node_timeout_s sets the wait)"
        )


def _lost_because(node: Node, state: State, online: list[str]) -> str | None:
    """Why `node` is lost, or None while it lives (or has finished)."""
    if state.type.value == "CRASHED":  # its process died under it
        return f"its flow run is {state.name}: {state_line(state)}"
    if state.type.value in STARTED and node.host not in online:
        return f"the worker of host {node.host} went offline"
    return None


def _cancel_unfinished(nodes: list[Node], waiting_only: bool = False) -> None:
    """Cancel the nodes still running (`waiting_only`: those not started yet): their
    workers kill their torchrun (the guardian)."""
    with get_client(sync_client=True) as client:
        for node in nodes:
            state = client.read_flow_run(node.flow_run_id).state
            if state is None or state.is_final():
                continue
            # Not started yet: nothing to stop. Running: its worker stops the process.
            waiting = state.type.value in WAITING
            if waiting_only and not waiting:
                continue
            new_state: State = Cancelled() if waiting else Cancelling()
            client.set_flow_run_state(node.flow_run_id, new_state, force=True)

"""Node 0's side of a multi-node run (train.nnodes > 1, no train.rdzv_endpoint): it picks the
rendezvous address, finds a host for every other node among the work pool's online workers
(one node per host other than its own), starts each node as a `training_node/manual` flow
run on that host's work queue, a child of this run's flow run, and watches them while its
own torchrun trains: a node that fails, crashes or never starts stops node 0 with one line
naming it. The nodes meet in torchrun's c10d rendezvous, ranked by node_rank."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State, WorkerStatus
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelled, Cancelling

from tasks.node_share import host_queue
from trainyard.config import TrainyardConfig, load_config
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.runtime.processes import stop_all_jobs

NODE_DEPLOYMENT = "training_node/manual"
POLL_S = 2.0  # how often the pool's workers and the nodes' flow runs are read
WAITING = {"SCHEDULED", "PENDING", "LATE", "AWAITINGRETRY"}


@dataclass
class Node:
    rank: int
    host: str
    flow_run_id: UUID


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
    (KeyboardInterrupt out of the job), which leaves here as one line naming that node.
    On any way out but success the nodes still running are cancelled."""
    train = config.train
    endpoint = rendezvous_endpoint(PREFECT_API_URL.value() or "")
    with get_client(sync_client=True) as client:
        deployment = node_deployment(client)
        pool = deployment.work_pool_name or "default"
        hosts = wait_for_hosts(client, pool, train.max_nodes - 1, train.node_timeout_s)
    overrides = settings_overrides(config, load_config(paths.params))
    log.info("rendezvous at %s; nodes 1..%d on %s", endpoint, train.max_nodes - 1, hosts)
    nodes = [
        _start_node(run_id, rank, host, endpoint, overrides) for rank, host in enumerate(hosts, 1)
    ]
    watch = _NodeWatch(nodes, train.node_timeout_s)
    watch.start()
    done = False
    try:
        yield config.model_copy(
            update={"train": train.model_copy(update={"rdzv_endpoint": endpoint})}
        )
        done = True
    except BaseException:
        if watch.failure is not None:
            raise TrainyardError(watch.failure) from None
        raise
    finally:
        watch.stop()
        if not done:
            _cancel_unfinished(nodes)


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
    server = urlsplit(api_url).hostname or "127.0.0.1"
    family, _, _, _, target = socket.getaddrinfo(server, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)  # a UDP connect sends nothing: it only picks the route
        address = probe.getsockname()[0]
    with socket.socket(family, socket.SOCK_STREAM) as free:
        free.bind((address, 0))
        port = free.getsockname()[1]
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def online_hosts(client: Any, pool: str) -> list[str]:
    """The hosts with an online worker in `pool` (`trainyard worker` names its worker
    after its host)."""
    workers = client.read_workers_for_work_pool(pool, limit=200)
    return sorted({w.name for w in workers if w.status == WorkerStatus.ONLINE})


def wait_for_hosts(client: Any, pool: str, needed: int, timeout_s: float) -> list[str]:
    """`needed` hosts other than this one, waiting up to `timeout_s` for their workers."""
    here = socket.gethostname()
    deadline = time.monotonic() + timeout_s
    while True:
        hosts = online_hosts(client, pool)
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
        if isinstance(mine, dict) and isinstance(theirs, dict):
            for name, value in mine.items():
                walk(f"{key}.{name}" if key else name, value, theirs.get(name))
        elif mine != theirs:
            found.append(f"{key}={json.dumps(mine)}")  # JSON is YAML, as overrides read it

    walk("", config.model_dump(mode="json"), base.model_dump(mode="json"))
    return found


def _start_node(run_id: str, rank: int, host: str, endpoint: str, overrides: list[str]) -> Node:
    parameters = {
        "run_id": run_id,
        "node_rank": rank,
        "rdzv_endpoint": endpoint,
        "overrides": overrides,
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
    """Reads the nodes' flow runs while node 0 trains; the first that ends other than
    completed, or is not running after `timeout_s`, stops node 0's torchrun: the
    rendezvous and the collectives would wait for it."""

    def __init__(self, nodes: list[Node], timeout_s: float) -> None:
        super().__init__(name="node-watch", daemon=True)
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self._ended = threading.Event()

    def stop(self) -> None:
        self._ended.set()
        self.join(timeout=30)

    def run(self) -> None:
        started = time.monotonic()
        with get_client(sync_client=True) as client:
            while not self._ended.wait(POLL_S):
                for node in self.nodes:
                    self.failure = self._failure(client, node, time.monotonic() - started)
                    if self.failure is not None:
                        stop_all_jobs()
                        return

    def _failure(self, client: Any, node: Node, waited_s: float) -> str | None:
        state = client.read_flow_run(node.flow_run_id).state
        if state is None:
            return None
        name = state.type.value
        what = f"node {node.rank} (host {node.host}, flow run {node.flow_run_id})"
        if name in {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}:
            return f"{what} is {state.name}: {state.message or 'no message'}"
        if name in WAITING and waited_s > self.timeout_s:
            return (
                f"{what} did not start within {self.timeout_s:g} s (still {state.name}): is "
                f"`trainyard worker` running on {node.host}?"
            )
        return None


def _cancel_unfinished(nodes: list[Node]) -> None:
    """Cancel the nodes still running: their workers kill their torchrun (the guardian)."""
    with get_client(sync_client=True) as client:
        for node in nodes:
            state = client.read_flow_run(node.flow_run_id).state
            if state is None or state.is_final():
                continue
            # Not started yet: nothing to stop. Running: its worker stops the process.
            waiting = state.type.value in WAITING
            new_state: State = Cancelled() if waiting else Cancelling()
            client.set_flow_run_state(node.flow_run_id, new_state, force=True)

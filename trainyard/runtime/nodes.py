"""The nodes of a multi-machine run meet at torchrun's c10d rendezvous, ranked by node_rank.

torchrun's c10d rendezvous numbers the nodes in the order of their descriptors (host name,
then the agent's process id) and ignores --node-rank, which only its static rendezvous reads
("node_rank is only used for static rdzv_backend"). So the node that joined on the host that
sorts first, or with the lower process id, became group rank 0: its first worker was global
rank 0 and wrote every commit. The static rendezvous honours --node-rank but has no rounds:
an agent that is started again cannot rejoin, and the others are not told to restart.

This backend is the c10d rendezvous, with its store, rounds and heartbeats, and one step
more: after each round every node writes its node_rank under its c10d rank in the round's
store, reads the others', and takes its place among their node ranks as its group rank: its
node_rank when every node is there. torchrun's agent then numbers the workers by group rank
(each node's first global rank is the sum of the nproc of the nodes before it), so node 0's
first worker is global rank 0 in any joining order.

An elastic run (--nnodes=MIN:MAX) meets with any MIN to MAX of its nodes, node 0 among
them: node 0 serves the rendezvous store, which is also the one its workers meet in, and
its first worker writes every commit. Nodes 1, 3 make group ranks 1, 2.

Node 0 also names the round (trainyard.dist.RENDEZVOUS_ENV), so that the workers of every
node key their process group's store alike: torchrun's restart count is no name they agree
on, as a node that restarts its workers for another node's sake does not count a restart.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from datetime import timedelta
from typing import cast

from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from trainyard.dist import NODE_RANK_ENV, RENDEZVOUS_ENV
from trainyard.errors import ConfigError, TrainyardError

NODE_RANK_KEY = "trainyard/node_rank/"  # + the c10d rank, in the round's store
ROUND_KEY = "trainyard/round"  # node 0's name for the round, in the round's store
VERDICT_KEY = "trainyard/named"  # whether the round's nodes all named their node ranks
KEEP, AGAIN = "keep", "again"


def register(backend: str) -> None:
    """Make this rendezvous torchrun's `--rdzv-backend=<backend>`, its node rank given as
    `--rdzv-conf=node_rank=K` (in torchrun's process, before its launcher starts). A second
    call registers the same creator again, which the registry allows."""
    rendezvous_handler_registry.register(backend, _create)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    node_rank = params.get_as_int("node_rank")
    if node_rank is None:
        raise ValueError(f"the {params.backend} rendezvous needs --rdzv-conf=node_rank=K")
    c10d_backend, store = create_backend(params)
    # torch's handler publishes the workers' store in its first round only: a node that
    # joins a later round (a lost node's replacement, a returning elastic node) waited for
    # keys nobody wrote (DistStoreError on MASTER_ADDR after 60 s). Unshared, every round
    # publishes them; the workers meet in node 0's rendezvous store anyway (node_zero_store).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    c10d = create_handler(store, c10d_backend, params)
    # join_timeout, as torch's handler reads it (600 s unless given)
    join_timeout_s = params.get_as_int("join_timeout", 600) or 600
    # Every multi-node run's workers bootstrap from node 0's rendezvous store.
    workers_store = node_zero_store(params.endpoint)
    return NodeRankRendezvous(
        c10d,
        node_rank,
        params.backend,
        params.max_nodes,
        join_timeout_s,
        workers_store,
        named_within_s=_named_within_s(params),
    )


def _named_within_s(params: RendezvousParameters) -> float:
    """How long the nodes of a round wait for each other's node rank: twice the silence
    after which the rendezvous itself calls a node dead (keep_alive_max_attempt missed
    heartbeats, keep_alive_interval apart; torch's defaults 3 x 5 s), and 10 s at least. A
    live node names its rank the moment its round completes, and a process starved that long
    would have missed its heartbeats too."""
    interval = params.get_as_int("keep_alive_interval", 5) or 5
    attempts = params.get_as_int("keep_alive_max_attempt", 3) or 3
    return max(10.0, 2.0 * interval * attempts)


def node_zero_store(endpoint: str) -> RendezvousStoreInfo:
    """The store a multi-node run's workers meet in: node 0's rendezvous store (is_host, see
    trainyard.runtime.torchrun), at the endpoint every node reaches. torch's c10d handler
    would have them meet in a store its rank-0 node serves, chosen in the first round and
    kept: a node that returned as that rank would serve another one, and a lost one takes
    its store away. Each round's keys are private to it (trainyard.dist)."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    return RendezvousStoreInfo(host, port)


def _rank_keys(nodes: int) -> list[str]:
    """The keys a round's `nodes` nodes name their node ranks under, by c10d rank."""
    return [f"{NODE_RANK_KEY}{rank}" for rank in range(nodes)]


class NodeRankRendezvous(RendezvousHandler):
    """A rendezvous handler whose group rank is the node's place among the node ranks that
    met: node 0 is group rank 0, and with every node there the group rank is the node rank."""

    def __init__(
        self,
        c10d: RendezvousHandler,
        node_rank: int,
        backend: str,
        max_nodes: int,
        join_timeout_s: float,
        workers_store: RendezvousStoreInfo | None = None,
        named_within_s: float = 30.0,
    ) -> None:
        self._c10d = c10d
        self._node_rank = node_rank
        self._backend = backend
        self._max_nodes = max_nodes
        self._join_timeout_s = join_timeout_s
        self._workers_store = workers_store
        self._named_within_s = named_within_s  # see _named_within_s

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._join_timeout_s
        met, node_ranks = self._meet(deadline)
        # An elastic round can complete without node 0 (it met the fewest nodes before node
        # 0 came): node 0 serves the store and writes every commit, so meet again with it.
        while 0 not in node_ranks:
            if time.monotonic() > deadline:
                raise TrainyardError(
                    f"nodes {node_ranks} met without node 0 for {self._join_timeout_s:g}s "
                    "(train.node_timeout_s): start node 0 (`trainyard run`) first"
                )
            met, node_ranks = self._meet(deadline)
        store = met.store
        if self._node_rank == 0:
            store.set(ROUND_KEY, uuid.uuid4().hex)
        # The agent starts this round's workers next, with its own environment and theirs.
        os.environ[RENDEZVOUS_ENV] = store.get(ROUND_KEY).decode()
        os.environ[NODE_RANK_ENV] = str(self._node_rank)
        # Typed optional by torch's property, never None from its c10d handler (it builds one).
        bootstrap = self._workers_store or cast(RendezvousStoreInfo, met.bootstrap_store_info)
        group_rank = node_ranks.index(self._node_rank)
        return RendezvousInfo(store, group_rank, len(node_ranks), bootstrap)

    def _meet(self, deadline: float) -> tuple[RendezvousInfo, list[int]]:
        """The next c10d round whose every node named its node rank, and those node ranks,
        sorted."""
        # A node can meet and die before it names its rank: a lost node's old agent, back on
        # the network a moment before its fence stops it, joins the round its replacement
        # was waiting for. The others meet again without it, once the rendezvous has seen
        # its heartbeats stop, rather than wait on its key until the store's timeout fails
        # the run.
        while (met := self._named_round()) is None:
            if time.monotonic() > deadline:
                raise TrainyardError(
                    f"the nodes met for {self._join_timeout_s:g}s (train.node_timeout_s) "
                    "and one of them left each time before naming its node rank: see the "
                    "other nodes' consoles for why they stop"
                )
            print(
                "a node of the round did not name its node rank within "
                f"{self._named_within_s:g}s (it left, or was stalled): meeting again",
                file=sys.stderr,
                flush=True,
            )
        nodes = met.world_size
        node_ranks = sorted(int(value) for value in met.store.multi_get(_rank_keys(nodes)))
        if len(set(node_ranks)) != nodes:  # the CLI shows a trainyard error as one line
            raise ConfigError(
                f"the {nodes} nodes that met have node ranks {node_ranks}: give each node its "
                f"own -S train.node_rank, 0 to {self._max_nodes - 1} (0 for `trainyard run`)"
            )
        return met, node_ranks

    def _named_round(self) -> RendezvousInfo | None:
        """The next c10d round, this node's rank named in it; None where the round's verdict
        (the first node's to judge it) is that a node did not name its own within
        named_within_s."""
        met = self._c10d.next_rendezvous()
        met.store.set(f"{NODE_RANK_KEY}{met.rank}", str(self._node_rank))
        try:
            met.store.wait(_rank_keys(met.world_size), timedelta(seconds=self._named_within_s))
            verdict = KEEP
        except DistStoreError:
            verdict = AGAIN
        # Each node waits from its own moment: one can see every key while another's wait
        # has run out (a node starved a while). The first verdict written is the round's,
        # and every node follows it: none starts workers in a round another has left.
        # compare_set writes only where the key is missing, and returns what is there.
        agreed = met.store.compare_set(VERDICT_KEY, "", verdict).decode()
        return met if agreed == KEEP else None

    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        # node 0's agent serves the workers' store: they connect to it, none serves one
        return self._workers_store is not None or self._c10d.use_agent_store

    def is_closed(self) -> bool:
        return self._c10d.is_closed()

    def set_closed(self) -> None:
        self._c10d.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._c10d.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._c10d.get_run_id()

    def shutdown(self) -> bool:
        return self._c10d.shutdown()

"""The nodes of a multi-machine run meet at torchrun's c10d rendezvous, ranked by node_rank.

torchrun's c10d rendezvous numbers the nodes in the order of their descriptors (host name,
then the agent's process id) and ignores --node-rank, which only its static rendezvous reads
("node_rank is only used for static rdzv_backend"). So the node that joined on the host that
sorts first, or with the lower process id, became group rank 0: its first worker was global
rank 0 and wrote every commit. The static rendezvous honours --node-rank but has no rounds:
an agent that is started again cannot rejoin, and the others are not told to restart.

This backend is the c10d rendezvous, with its store, rounds and heartbeats, and one step
more: after each round every node writes its node_rank under its c10d rank in the round's
store, reads the others', and takes its node_rank as its group rank. torchrun's agent then
numbers the workers by group rank (each node's first global rank is the sum of the nproc of
the nodes before it), so node 0's first worker is global rank 0 in any joining order.

Node 0 also names the round (trainyard.dist.RENDEZVOUS_ENV), so that the workers of every
node key their process group's store alike: torchrun's restart count is no name they agree
on, as a node that restarts its workers for another node's sake does not count a restart.
"""

from __future__ import annotations

import os
import uuid
from typing import cast

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from trainyard.dist import RENDEZVOUS_ENV
from trainyard.errors import ConfigError

NODE_RANK_KEY = "trainyard/node_rank/"  # + the c10d rank, in the round's store
ROUND_KEY = "trainyard/round"  # node 0's name for the round, in the round's store


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
    c10d = create_handler(store, c10d_backend, params)
    return NodeRankRendezvous(c10d, node_rank, params.backend)


class NodeRankRendezvous(RendezvousHandler):
    """A rendezvous handler whose group rank is the node's node_rank."""

    def __init__(self, c10d: RendezvousHandler, node_rank: int, backend: str) -> None:
        self._c10d = c10d
        self._node_rank = node_rank
        self._backend = backend

    def next_rendezvous(self) -> RendezvousInfo:
        met = self._c10d.next_rendezvous()
        store, nodes = met.store, met.world_size
        store.set(f"{NODE_RANK_KEY}{met.rank}", str(self._node_rank))
        keys = [f"{NODE_RANK_KEY}{rank}" for rank in range(nodes)]
        node_ranks = sorted(int(value) for value in store.multi_get(keys))
        if node_ranks != list(range(nodes)):  # the CLI shows a trainyard error as one line
            raise ConfigError(
                f"the {nodes} nodes that met have node ranks {node_ranks}: give each node its "
                f"own -S train.node_rank, 0 to {nodes - 1} (0 for `trainyard run`)"
            )
        if self._node_rank == 0:
            store.set(ROUND_KEY, uuid.uuid4().hex)
        # The agent starts this round's workers next, with its own environment and theirs.
        os.environ[RENDEZVOUS_ENV] = store.get(ROUND_KEY).decode()
        # Typed optional by torch's property, never None from its c10d handler (it builds one).
        bootstrap = cast(RendezvousStoreInfo, met.bootstrap_store_info)
        return RendezvousInfo(store, self._node_rank, nodes, bootstrap)

    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        return self._c10d.use_agent_store

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

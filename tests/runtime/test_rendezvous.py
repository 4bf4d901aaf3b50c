"""The nodes' rendezvous (trainyard.runtime.nodes) on loopback, each node its own process as
torchrun's agents are: real c10d rounds in a real TCPStore, served by node 0."""

from __future__ import annotations

import json
import subprocess
import sys

from postgres import free_port

from trainyard.runtime.torchrun import ELASTIC_RENDEZVOUS

# One node's rendezvous, as torchrun's agent makes it: it prints what its round gave it.
NODE = """
import json, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from trainyard.runtime.nodes import _create
params = RendezvousParameters(**json.loads(sys.argv[1]))
info = _create(params).next_rendezvous()
print(json.dumps({"group_rank": info.rank, "world_size": info.world_size}), flush=True)
"""

# A node that meets and dies before it names its node rank: torch's own c10d handler, as a
# lost node's old agent is at that moment (back on the network, about to be stopped).
GHOST = """
import json, os, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
params = RendezvousParameters(**json.loads(sys.argv[1]))
backend, store = create_backend(params)
create_handler(store, backend, params).next_rendezvous()
print("met", flush=True)
os._exit(0)
"""


def _node(script: str, port: int, node_rank: int) -> subprocess.Popen[str]:
    conf = {
        "backend": "trainyard-c10d",
        "endpoint": f"127.0.0.1:{port}",
        "run_id": "ghost",
        "min_nodes": 2,
        "max_nodes": 2,
        "node_rank": node_rank,
        "is_host": node_rank == 0,
        "join_timeout": 120,
        **ELASTIC_RENDEZVOUS,
    }
    return subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(conf)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_node_that_met_and_died_before_naming_its_rank_is_met_again_without():
    """Node 0 meets a node that dies before naming its rank (the round has two nodes, one
    key is never written); node 1 comes meanwhile. Node 0 meets again with node 1 rather
    than wait on the missing key until the store's 60 s timeout fails it."""
    port = free_port("127.0.0.1")
    nodes = [_node(NODE, port, 0), _node(GHOST, port, 1)]
    zero, ghost = nodes
    try:
        ghost_out, ghost_err = ghost.communicate(timeout=60)
        assert ghost_out.strip() == "met", ghost_err
        nodes.append(one := _node(NODE, port, 1))
        zero_out, zero_err = zero.communicate(timeout=50)
        one_out, one_err = one.communicate(timeout=20)
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
    assert json.loads(zero_out) == {"group_rank": 0, "world_size": 2}, zero_err
    assert json.loads(one_out) == {"group_rank": 1, "world_size": 2}, one_err
    assert "a node met and left before naming its node rank (10s)" in zero_err

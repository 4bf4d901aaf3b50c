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
import json, os, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from trainyard.dist import RENDEZVOUS_ENV
from trainyard.runtime.nodes import _create
params = RendezvousParameters(**json.loads(sys.argv[1]))
info = _create(params).next_rendezvous()
met = {"group_rank": info.rank, "world_size": info.world_size,
       "round": os.environ[RENDEZVOUS_ENV]}
print(json.dumps(met), flush=True)
"""

# A node starved for a while right after its first round completes (its agent's process
# descheduled): it names its node rank only after the other node's wait ran out.
LATE = NODE.replace(
    "info = _create(params).next_rendezvous()",
    """import time
handler = _create(params)
meet = handler._c10d.next_rendezvous
def starved_once():
    met = meet()
    if not starved_once.done:
        starved_once.done = True
        time.sleep(13)
    return met
starved_once.done = False
handler._c10d.next_rendezvous = starved_once
info = handler.next_rendezvous()""",
)

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
    zero_met, one_met = json.loads(zero_out), json.loads(one_out)
    assert (zero_met["group_rank"], zero_met["world_size"]) == (0, 2), zero_err
    assert (one_met["group_rank"], one_met["world_size"]) == (1, 2), one_err
    assert zero_met["round"] == one_met["round"], (zero_err, one_err)
    assert "did not name its node rank within 10s (it left, or was stalled)" in zero_err


def test_a_node_that_names_its_rank_after_the_others_wait_ran_out_meets_again_with_them():
    """Node 1 names its node rank 13 s into the round, after node 0 waited its 10 s: it
    sees both ranks named, yet node 0 has left the round. Both follow the first verdict
    written (meet again) and start their workers in the same round: had node 1 kept the
    first, it would wait for node 0's workers there while node 0 waits for it in the next."""
    port = free_port("127.0.0.1")
    nodes = [_node(NODE, port, 0), _node(LATE, port, 1)]
    try:
        (zero_out, zero_err), (one_out, one_err) = (n.communicate(timeout=90) for n in nodes)
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
    zero_met, one_met = json.loads(zero_out), json.loads(one_out)
    assert (zero_met["group_rank"], one_met["group_rank"]) == (0, 1), (zero_err, one_err)
    assert zero_met["round"] == one_met["round"], (zero_err, one_err)
    said = "a node of the round did not name its node rank within 10s (it left, or was stalled)"
    assert said in zero_err and said in one_err, (zero_err, one_err)

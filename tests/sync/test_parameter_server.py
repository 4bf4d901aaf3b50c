"""The parameter server's arithmetic and its bounded staleness, on real gloo and RPC workers:
every push is committed once (plain SGD's sum of them all, whatever their order), a worker
more than max_staleness updates ahead of the slowest waits for it, and the bytes counted are
the ones sent to other ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainyard.sync.parameter_server import (
    ParameterServerSync,
    ServerSettings,
    Shard,
    _transports_and_channels,
    ignore_scheduler_order_warning,
    split_by_size,
)
from trainyard.util.daemons import free_port

LR, STEPS, WORLD = 0.3, 5, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _sgd(part: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(part, lr=99.0)  # the push's lr replaces it


def _worker(rank: int, port: int, init_file: str, servers: int, staleness: int, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # RPC's rendezvous
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    sync = ParameterServerSync(model, ServerSettings(servers, staleness), _sgd)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * WORLD)  # the run's, before /replicas
    versions = []
    for _ in range(STEPS):
        if rank == WORLD - 1:
            time.sleep(0.2)  # the slow worker
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        sync.step(optimizer)
        versions.append(list(sync.pulled))
    norm = model[1]
    assert isinstance(norm, nn.BatchNorm1d) and norm.running_mean is not None
    with torch.no_grad():
        norm.running_mean.fill_(float(rank))
    sync.sync()
    torch.save(
        {
            "start": start,
            "end": [p.detach().clone() for p in model.parameters()],
            "running_mean": norm.running_mean.clone(),
            "versions": versions,
            "communication": sync.counted(),
            "parts": sync.parts,
        },
        f"{out}/rank{rank}.pt",
    )
    sync.close(graceful=True)
    dist.destroy_process_group()


def _free_port() -> int:
    return free_port("127.0.0.1")


def _run(tmp_path, servers: int, staleness: int) -> list[dict]:
    mp.start_processes(
        _worker,
        args=(_free_port(), str(tmp_path / "init"), servers, staleness, str(tmp_path)),
        nprocs=WORLD,
        start_method="spawn",
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.distributed
def test_every_push_is_committed_once_and_nobody_runs_ahead_at_staleness_0(tmp_path):
    ranks = _run(tmp_path, servers=2, staleness=0)
    # SGD without momentum adds up every push, in any order: lr / replicas x each gradient.
    pushed = LR * STEPS * sum(range(1, WORLD + 1))
    for result in ranks:
        for start, end in zip(result["start"], result["end"], strict=True):
            torch.testing.assert_close(end, start - pushed, rtol=0, atol=1e-5)
        # The mean of the workers' running statistics: they met.
        assert torch.allclose(result["running_mean"], torch.full((3,), 1.0))
        # At staleness 0 a worker's t-th reply waits for every worker's t-th push.
        for t, pulled in enumerate(result["versions"], 1):
            assert all(version >= WORLD * t for version in pulled), (t, pulled)
        communication = result["communication"]
        assert communication.syncs == STEPS
        assert sum(communication.staleness.values()) == STEPS  # one per push
    parts = ranks[0]["parts"]
    assert sorted(i for part in parts for i in part) == [0, 1, 2, 3, 4, 5] and all(parts)
    sizes = [p.numel() * 4 for p in _model().parameters() if p.requires_grad]
    for rank, result in enumerate(ranks):
        # Its pushes to the other rank's server, and (ranks 0 and 1 serve) its replies to
        # the other ranks' pushes and to their pulls when they met.
        pushed_bytes = sum(sizes[i] for s, part in enumerate(parts) if s != rank for i in part)
        part_bytes = sum(sizes[i] for i in parts[rank]) if rank < 2 else 0
        replied = part_bytes * (STEPS + 1) * (WORLD - 1)
        assert result["communication"].bytes_sent == pushed_bytes * STEPS + replied


@pytest.mark.distributed
def test_fast_workers_run_at_most_max_staleness_updates_ahead_of_a_slow_one(tmp_path):
    ranks = _run(tmp_path, servers=0, staleness=2)
    for rank, result in enumerate(ranks[:-1]):  # the fast ones
        steps = enumerate(result["versions"], 1)
        # They ran ahead: a reply before every worker's t-th push (the slow one sleeps 0.2 s
        # between pushes, which take milliseconds).
        assert any(version < WORLD * t for t, [version] in steps), (rank, result["versions"])
    # The fast pushes applied between the slow one's reply and its next push made that push
    # stale: a fast worker's push is applied at once and its reply held while it is more
    # than 2 ahead, so at most 2 + 2 of them each (without the bound, 5 each by then).
    assert 0 < max(ranks[-1]["communication"].staleness) <= 2 * (2 + 2)
    for start, end in zip(ranks[0]["start"], ranks[0]["end"], strict=True):
        torch.testing.assert_close(end, start - LR * STEPS * 6, rtol=0, atol=1e-5)


def _node_worker(rank: int, port: int, init_file: str, nodes: int, out: str) -> None:
    """One of two workers, told by LOCAL_WORLD_SIZE that they are on `nodes` nodes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_WORLD_SIZE=str(2 // nodes))  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 256 KB of weights on rank 0's server, the bias on rank 1's
    sync = ParameterServerSync(model, ServerSettings(2, 4), _sgd)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(20):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        sync.step(optimizer)
    sync.sync()
    Path(out, f"rank{rank}.bytes").write_text(str(sync.counted().bytes_sent))
    sync.close(graceful=True)
    dist.destroy_process_group()


# Run in a network namespace of its own, where loopback carries this run's traffic alone.
_NODES_RUN = """
import json, sys
import torch.multiprocessing as mp
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_parameter_server import _free_port, _node_worker

def loopback_sent():
    line = next(l for l in open("/proc/net/dev") if l.strip().startswith("lo:"))
    return int(line.split(":")[1].split()[8])

out, nodes = sys.argv[2], int(sys.argv[3])
before = loopback_sent()
mp.start_processes(_node_worker, args=(_free_port(), out + "/init", nodes, out), nprocs=2,
                   start_method="spawn")
counted = sum(int(Path(out, f"rank{r}.bytes").read_text()) for r in range(2))
print(json.dumps({"loopback": loopback_sent() - before, "counted": counted}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="a network namespace of its own needs root, unshare and ip",
)
@pytest.mark.distributed
def test_workers_on_two_nodes_send_the_servers_bytes_through_the_network(tmp_path):
    """Nodes that share a kernel (containers, network namespaces) could hand tensors over by
    reading each other's memory, past the link between them: across nodes every byte the
    record counts goes through the network."""
    command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "run",
               sys.executable, "-c", _NODES_RUN, str(Path(__file__).parent), str(tmp_path), "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sent = json.loads(done.stdout.strip().splitlines()[-1])
    assert sent["counted"] > 20 * 256 * 256 * 4  # the weights' replies alone
    assert sent["loopback"] >= sent["counted"], sent


def test_only_workers_on_more_than_one_node_leave_tensorpipes_memory_channels_out(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _transports_and_channels(4) == (None, None)  # not under torchrun: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _transports_and_channels(4) == (None, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    transports, channels = _transports_and_channels(4)
    assert transports == ["uv"] and channels is not None and "cma" not in channels


def test_a_held_reply_is_sent_once_the_slowest_worker_catches_up():
    weight = torch.zeros(2)
    shard = Shard([weight], _sgd, workers=2, max_staleness=1)
    first = shard.push(0, 0, 1.0, [torch.ones(2)])
    second = shard.push(0, 1, 1.0, [torch.ones(2)])  # two ahead of worker 1
    assert first.done() and not second.done()
    shard.push(1, 0, 0.5, [torch.ones(2)])
    assert second.done()
    weights, version, staleness = second.wait()
    assert torch.equal(weights[0], torch.full((2,), -2.5)) and version == 3 and staleness == 0


def test_a_workers_scheduler_stepping_an_optimizer_that_never_steps_warns_nobody():
    """Under a parameter server the run's own optimizer never steps, its scheduler does:
    torch's warning about that order reached every run's log while the filter's message
    went unescaped."""
    weight = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ignore_scheduler_order_warning()
        scheduler.step()
    assert [str(w.message) for w in seen] == []


def test_parts_hold_about_as_many_bytes_each():
    assert split_by_size([10, 1, 6, 5], 2) == [[0, 1], [2, 3]]  # 11 bytes each


def test_a_servers_checkpointed_state_continues_as_the_server_would_have():
    """Optimizer moments, each worker's pushes and the updates applied survive a
    checkpoint: a server restarted from the loaded weights and its state takes the next
    push to the very weights the first one reaches, and the snapshot is a copy."""

    def adamw(part: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(part, lr=99.0, weight_decay=0.1)

    torch.manual_seed(0)
    start = [torch.randn(3, 2), torch.randn(2)]
    first = Shard(start, adamw, workers=2, max_staleness=4)
    for worker in (0, 1, 0):
        first.push(worker, 0, 0.01, [torch.randn(3, 2), None])  # the bias reached by no batch
    saved, weights = first.state_dict(), [w.clone() for w in first.weights]
    assert torch.equal(first.weights[1], start[1])  # no gradient: left alone, decay included
    resumed = Shard([torch.zeros(3, 2), torch.zeros(2)], adamw, workers=2, max_staleness=4)
    resumed.restart(weights)
    resumed.load_state_dict(saved)
    assert resumed.clocks == [2, 1] and resumed.version == 3
    grad = torch.randn(3, 2)
    first.push(1, 3, 0.01, [grad, None])
    assert not torch.equal(saved["optimizer"]["state"][0]["exp_avg"],
                           first.optimizer.state_dict()["state"][0]["exp_avg"])  # fmt: skip
    resumed.push(1, 3, 0.01, [grad, None])
    for ours, theirs in zip(resumed.weights, first.weights, strict=True):
        assert torch.equal(ours, theirs)

"""A thin layer over torch.distributed: paired init/cleanup, and helpers that are no-ops at
world size 1."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainyard.util.attempts import attempt_number

# The name of the rendezvous round a multi-node job's workers were started in, the same on
# every node (trainyard.runtime.nodes sets it in torchrun's agent).
RENDEZVOUS_ENV = "TRAINYARD_RENDEZVOUS"
# The train.node_rank of this worker's node, where it is not its group rank (torchrun's
# GROUP_RANK): an elastic round without every node (trainyard.runtime.nodes sets it).
NODE_RANK_ENV = "TRAINYARD_NODE_RANK"


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # Workers that hold one model replica between them (train.parallel: pipeline x tensor),
    # neighbouring ranks: the data is sharded across the replicas, not across every rank.
    model_workers: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's replica: which share of the data it reads."""
        return self.rank // self.model_workers

    @property
    def data_size(self) -> int:
        """The data-parallel degree: the replicas the data is sharded across."""
        return self.world_size // self.model_workers


def init_distributed(device_preference: str = "auto", timeout_s: float = 600) -> DistContext:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR in the env)."""
    if "RANK" not in os.environ:
        raise RuntimeError("trainyard.engine.worker must be started by torchrun (RANK is not set)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = device_preference == "cuda" or (
        device_preference == "auto" and torch.cuda.is_available()
    )
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    global _GROUP_STORE
    _GROUP_STORE = attempt_store(rank, world, timeout)
    dist.init_process_group(
        backend,
        store=_GROUP_STORE,
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    return DistContext(rank, world, local_rank, device, backend)


# The store the process group met in (init_distributed's), for others that meet beside it.
_GROUP_STORE: dist.Store | None = None


def side_store(name: str, timeout: datetime.timedelta) -> dist.Store:
    """Keys private to `name` in the store the process group met in: a second TCPStore
    would bind rank 0's port again where torchrun shares no store of its own. A process
    group joined some other way (a test's file://) gets this attempt's store."""
    base = _GROUP_STORE
    if base is None:
        base = attempt_store(dist.get_rank(), dist.get_world_size(), timeout)
    return dist.PrefixStore(f"{name}/", base)


def attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this torchrun attempt.

    After a restart torchrun hands the new workers the same agent store, which still holds
    the previous attempt's peer addresses under the same keys; a worker that reads one before
    its peer rewrites it fails with "Gloo connectFullMesh failed ... Connection refused"
    (seen here in about one restart in three). A per-attempt prefix makes stale keys invisible.
    On more than one node the attempt is the rendezvous round's name: the nodes' restart
    counts differ once one restarted its workers for another's sake, which counts none.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    # The run's attempt, not torchrun's count: a node whose lost agent was launched again
    # counts from 0, the nodes that restarted their workers meanwhile do not.
    attempt = os.environ.get(RENDEZVOUS_ENV) or attempt_number()
    return dist.PrefixStore(f"trainyard/attempt-{attempt}/", store)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_sum_started(tensor: torch.Tensor) -> Callable[[], object]:
    """`all_reduce_sum` without waiting for it: returns what waits for it (`tensor` holds
    the sums after that). Every rank must start it at the same point of its collectives."""
    if not _active():
        return lambda: None
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    return work.wait


def all_gather_objects(obj: Any) -> list[Any]:
    if not _active():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, on rank 0 (None on the others): what only rank 0 writes."""
    if not _active():
        return [obj]
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def on_cpu(obj: Any) -> Any:
    """`obj` with every tensor in it (in dicts, lists and tuples) copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: on_cpu(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(on_cpu(value) for value in obj)
    return obj


def rank0_decides(flag: bool, rank: int, device: torch.device) -> bool:
    """Rank 0's `flag`, on every rank: one tiny collective, so decisions that depend on a
    clock (which differs per rank) are taken by all ranks together."""
    if not _active():
        return flag
    decided = torch.tensor([int(flag) if rank == 0 else 0], device=device)
    dist.all_reduce(decided, op=dist.ReduceOp.SUM)
    return bool(decided.item())


def barrier() -> None:
    if _active():
        dist.barrier()

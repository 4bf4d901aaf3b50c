"""What syncing the replicas cost each worker: bytes handed to the collectives, seconds
waited in them, how many (the record's `communication` entry)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Communication:
    """One worker's, over the updates this process ran: the bytes it handed to the
    collectives that sync the replicas (a ring all-reduce puts about twice as many on the
    wire), the seconds it waited in them, and how many syncs there were. Under a parameter
    server: its pushes and its server's replies to other ranks, the seconds its pushes took,
    one sync per push, and how many of its pushes came at each staleness (updates other
    workers' pushes applied between its last reply and this push)."""

    bytes_sent: int = 0
    wait_s: float = 0.0
    syncs: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    # The checkpoints' gathers, apart from the syncs: the bytes of the tensors this rank
    # handed to them (its RNG state; under local_sgd, diloco and a parameter server its own
    # weights and optimizer too) and the seconds it spent in them.
    checkpoint_bytes: int = 0
    checkpoint_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def ddp_communication(model: nn.Module, updates: int) -> Communication | None:
    """DDP's all-reduces over `updates` updates (None: not a DDP model). Every update
    all-reduces every gradient once, in buckets: the bytes are counted, not estimated.
    The wait is DDP's own timers' (on its first 10 updates and every 100th after): the part
    of a backward's communication its computation did not hide, per update."""
    if not isinstance(model, DistributedDataParallel):
        return None
    if dist.get_world_size(model.process_group) == 1:  # no other replica: nothing crossed
        return Communication()
    payload = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if updates == 0:
        return Communication()
    # DDP's logger's data: torch shows its reducer's timers no other way (a private method).
    timers = model._get_ddp_logging_data()
    exposed_ns = timers.get("avg_backward_comm_time", 0)
    exposed_ns -= timers.get("avg_backward_compute_comm_overlap_time", 0)
    wait_s = max(float(exposed_ns), 0.0) * 1e-9 * updates
    return Communication(bytes_sent=payload * updates, wait_s=wait_s, syncs=updates)


def tensor_bytes(obj: object) -> int:
    """The bytes of the tensors and arrays in `obj` (in dicts, lists and tuples): what a
    gather of it carries, its pickled framing aside."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(value) for value in obj)
    return 0

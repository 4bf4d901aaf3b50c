"""Replicas that train apart and agree every few steps: local SGD and DiLoCo.

Each worker steps its own copy of the model on its own rows for `train.sync_every` updates,
with no collective, then the copies are brought together in one all-reduce:
- local SGD (Lin et al., "Don't use large mini-batches, use local SGD") sets every copy to
  their mean;
- DiLoCo (Douillard et al., 2023) takes the mean change since the last sync as a gradient
  (the pseudo-gradient) of the weights every copy started the interval from, and steps
  those with an outer Nesterov SGD (`train.outer_lr`, `train.outer_momentum`).

Local SGD is DiLoCo's outer SGD at learning rate 1 without momentum; it is computed as the
plain mean, so it holds no outer state. Each worker's inner optimizer (its momentum, Adam's
moments) stays its own, as in both papers: a checkpoint holds every worker's.

Between syncs the one model the replicas share is the one they last agreed on (DiLoCo's
outer model): validation scores it and checkpoints hold it as the run's model, so neither
costs a sync of its own, and a run sends one all-reduce per `train.sync_every` updates
however short its epochs are. It costs a copy of the weights (DiLoCo keeps one anyway).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from trainyard.sync.communication import Communication


@dataclass(frozen=True)
class OuterSettings:
    """DiLoCo's outer optimizer: Nesterov SGD on the pseudo-gradient."""

    lr: float
    momentum: float


class PeriodicSync:
    """Averages the replicas (local SGD) or steps them with an outer optimizer (DiLoCo)
    every `every` updates, over `group` (None: the whole world)."""

    def __init__(
        self,
        model: nn.Module,
        every: int,
        outer: OuterSettings | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.every = every
        self.group = group
        # One process without a process group (an in-process run) is one replica.
        self.replicas = dist.get_world_size(group) if dist.is_initialized() else 1
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        # Floating buffers (batch norm's running statistics) are averaged too; counters
        # such as num_batches_tracked are the same on every replica.
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        # Each state-dict name's place in parameters + buffers; a tied weight has two names.
        place = {id(t): i for i, t in enumerate(self._tensors())}
        named = [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        self.places = {name: place[id(t)] for name, t in named if id(t) in place}
        self.communication = Communication()
        self.since_sync = 0  # updates since the replicas last agreed
        # Whether they agreed in the epoch under way (the loop resets it at an epoch's
        # start): an epoch without a sync of its own syncs at its end, so validation never
        # scores weights older than the epoch (sync_every longer than an epoch).
        self.synced_in_epoch = False
        self.settings = outer
        self.outer: torch.optim.SGD | None = None
        # The weights the replicas last agreed on, which the interval began from (DiLoCo's
        # anchors, stepped by the outer optimizer), and the buffers that went with them.
        self.anchors: list[torch.Tensor] = []
        self.agreed_buffers: list[torch.Tensor] = []
        self.restart()

    @torch.no_grad()
    def restart(self) -> None:
        """Begin an interval from the replica's weights as they are now, with no outer
        momentum: at the start, and after loading weights from elsewhere (a warm start, a
        checkpoint of replicas that all-reduced) that every replica then holds alike."""
        self.since_sync = 0
        self.anchors = [p.detach().clone() for p in self.parameters]
        self.agreed_buffers = [b.detach().clone() for b in self.buffers]
        if self.settings is None:
            return
        self.outer = torch.optim.SGD(
            self.anchors,
            lr=self.settings.lr,
            momentum=self.settings.momentum,
            nesterov=self.settings.momentum > 0,
        )

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update: this replica's own optimizer step, then a sync when one is due."""
        optimizer.step()
        self.after_update()

    def due_at_epoch_end(self, last: bool) -> bool:
        """Sync at the run's last epoch's end, so the run's model holds its last updates,
        and at the end of an epoch without a sync of its own (sync_every longer than an
        epoch), so validation, early stopping and pruning never judge older weights."""
        return last or not self.synced_in_epoch

    def counted(self) -> Communication:
        return self.communication

    def after_update(self) -> None:
        """Count an inner update; sync when `every` of them are done."""
        self.since_sync += 1
        if self.since_sync >= self.every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Bring the replicas together now (every worker at once), unless they already are:
        the loop also calls it before the last validation, so the run's model holds every
        update."""
        if self.since_sync == 0:
            return
        means = self._means(self._tensors())
        if self.outer is None:
            for anchor, mean in zip(self.anchors, means[: len(self.parameters)], strict=True):
                anchor.copy_(mean)
        else:
            self._outer_step(means[: len(self.parameters)])
        for agreed, mean in zip(self.agreed_buffers, means[len(self.parameters) :], strict=True):
            agreed.copy_(mean)
        self._adopt_agreed()
        self.since_sync = 0
        self.synced_in_epoch = True

    @torch.no_grad()
    def _adopt_agreed(self) -> None:
        """Every replica takes the weights the replicas last agreed on."""
        for tensor, agreed in zip(self._tensors(), self._agreed(), strict=True):
            tensor.copy_(agreed)

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.parameters, *self.buffers]

    def _agreed(self) -> list[torch.Tensor]:
        return [*self.anchors, *self.agreed_buffers]

    @contextmanager
    def agreed_weights(self) -> Iterator[None]:
        """Inside the block the model holds the weights the replicas last agreed on (what
        validation scores); after it, this replica's own again."""
        if self.since_sync == 0:  # they are its own
            yield
            return
        with torch.no_grad():
            own = [t.clone() for t in self._tensors()]
            self._adopt_agreed()
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, saved in zip(self._tensors(), own, strict=True):
                    tensor.copy_(saved)

    def agreed_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's `state` dict with the weights the replicas last agreed on in place of
        this replica's own (what a checkpoint holds as the run's model)."""
        agreed = self._agreed()
        return {
            name: agreed[self.places[name]] if name in self.places else tensor
            for name, tensor in state.items()
        }

    def settle(self) -> None:
        """End training on the weights the replicas last agreed on (what was last validated)
        rather than this replica's own updates since."""
        if self.since_sync:
            self._adopt_agreed()
            self.since_sync = 0

    def close(self, graceful: bool) -> None:
        """Nothing to stop: its all-reduces use the process group, which outlives the job."""

    def _means(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        means = replica_means(tensors, self.replicas, self.group, self.communication)
        self.communication.syncs += 1
        return means

    def _outer_step(self, means: list[torch.Tensor]) -> None:
        """DiLoCo's outer update: the pseudo-gradient is how far the replicas' mean moved
        from the anchors; the outer step moves the anchors, and every replica starts the
        next interval from them."""
        assert self.outer is not None
        for anchor, mean in zip(self.anchors, means, strict=True):
            anchor.grad = anchor - mean
        self.outer.step()
        for anchor in self.anchors:
            anchor.grad = None

    def state_dict(self) -> dict[str, Any]:
        """What every replica shares: where in the interval they are and the outer state.
        The agreed weights are the checkpoint's model (`agreed_state_dict`)."""
        state: dict[str, Any] = {
            "since_sync": self.since_sync,
            "synced_in_epoch": self.synced_in_epoch,
        }
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's sync state, loaded after `restart` took the agreed weights from
        the checkpoint's model. One without DiLoCo's (written under local_sgd) starts the
        outer momentum afresh."""
        self.since_sync = int(state["since_sync"])
        self.synced_in_epoch = bool(state.get("synced_in_epoch", True))  # before: every epoch
        if "anchors" in state:  # written when the checkpoint's model was rank 0's own
            for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
                anchor.copy_(saved)
        if self.outer is not None and "outer" in state:
            self.outer.load_state_dict(state["outer"])


def replica_means(
    tensors: list[torch.Tensor],
    replicas: int,
    group: dist.ProcessGroup | None = None,
    communication: Communication | None = None,
) -> list[torch.Tensor]:
    """Every replica's mean of each tensor, in one all-reduce per dtype (its bytes and wait
    added to `communication`)."""
    means: dict[int, torch.Tensor] = {}
    # In the tensors' order, the same on every rank (a set's order may differ by process).
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = _flatten_dense_tensors([tensors[i] for i in same])
        if replicas > 1:
            started = _synchronized(flat)
            dist.all_reduce(flat, group=group)
            if communication is not None:
                communication.wait_s += _synchronized(flat) - started
                communication.bytes_sent += flat.numel() * flat.element_size()
            flat.div_(replicas)
        unflat = _unflatten_dense_tensors(flat, [tensors[i] for i in same])
        means.update(zip(same, unflat, strict=True))
    return [means[i] for i in range(len(tensors))]


def _synchronized(tensor: torch.Tensor) -> float:
    """The time once `tensor`'s device has done its queued work: NCCL's all_reduce returns
    once queued, so timing it alone would show no wait on a GPU."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()

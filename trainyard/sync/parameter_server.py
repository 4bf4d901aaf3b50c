"""An asynchronous parameter server (`train.sync: parameter_server`) on torch.distributed.rpc.

Servers hold the model's parameters, split by key (each whole tensor on one server, the
largest first onto the least loaded). After its backward each worker pushes its gradients to
every server and gets back that server's current weights; the server steps them with the
run's optimizer (SGD or AdamW) at once, one update per push. No worker waits for another,
except one more than `train.max_staleness` updates ahead of the slowest: its reply is held
until the slowest catches up (stale synchronous parallel, Ho et al. 2013). 0 makes every
worker wait for every other at each update, which is still not all-reduce: the updates are
applied one by one, each on its own worker's batch.

The servers are ranks 0..S-1 (`train.parameter_servers` S; 0: rank 0 alone), which train
too: a server is RPC threads in a worker's process, answering while its main thread trains.
RPC shares torchrun's store for its rendezvous, as the process group does.

Each push is one worker's batch, not the global batch linear scaling sized the learning rate
for: the server steps at the worker's learning rate divided by the replicas.

The workers meet (a barrier, with every update committed) at each epoch's end and each
checkpoint: they take the servers' weights and the mean of their floating buffers, so
validation scores one model and a checkpoint holds one, with the servers' optimizer state
and update counters. A resume continues from exactly that state and loses no committed
update. Between meetings the order in which a server applies the pushes depends on timing:
two runs of more than one worker end on different weights (one worker's is plain SGD).
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.rendezvous import register_rendezvous_handler
from torch.futures import Future

from trainyard.dist import side_store
from trainyard.sync.communication import Communication
from trainyard.sync.periodic import replica_means

MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
# What a server answers a push or pull with: its part's weights, its update count, and
# (a push) how many updates it applied between the worker's last reply and this push.
Reply = tuple[list[torch.Tensor], int, int]


@dataclass(frozen=True)
class ServerSettings:
    servers: int  # train.parameter_servers (0: rank 0 serves)
    max_staleness: int  # updates a worker may be ahead of the slowest


class Shard:
    """One server's part of the parameters, its optimizer, and each worker's update count.
    RPC threads call it concurrently: one lock orders the updates."""

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        make_optimizer: MakeOptimizer,
        workers: int,
        max_staleness: int,
        host: int = 0,
    ) -> None:
        # On the CPU whatever device trains: RPC sends CPU tensors (CUDA ones would need a
        # device map between every pair of ranks), and the server's step is small.
        self.weights = [w.detach().to("cpu", copy=True) for w in weights]
        self.make_optimizer = make_optimizer
        self.optimizer = make_optimizer(self.weights)
        self.workers, self.max_staleness = workers, max_staleness
        self.host = host  # the rank it runs on: its replies to that rank's worker stay local
        self.clocks = [0] * workers  # updates each worker has pushed
        self.version = 0  # updates applied
        self.bytes_replied = 0  # weights sent back to workers on other ranks
        # (worker, its clock, its reply, its push's staleness), until the slowest catches up
        self._held: list[tuple[int, int, Future[Reply], int]] = []
        self._lock = threading.Lock()

    def restart(self, weights: Sequence[torch.Tensor]) -> None:
        """Serve `weights` (loaded from a checkpoint or a warm start) with a fresh optimizer."""
        with self._lock, torch.no_grad():
            for own, loaded in zip(self.weights, weights, strict=True):
                own.copy_(loaded)
            self.optimizer = self.make_optimizer(self.weights)
            self.clocks, self.version = [0] * self.workers, 0

    def push(self, worker: int, pulled: int, lr: float, grads: list[torch.Tensor | None]) -> Future:
        """Apply `worker`'s gradients (None: a parameter its batch did not reach, which the
        step leaves alone, as the run's own optimizer would); the reply waits while the
        worker is more than max_staleness pushes ahead of the slowest."""
        reply: Future[Reply] = Future()
        with self._lock:
            for weight, grad in zip(self.weights, grads, strict=True):
                weight.grad = grad
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            with torch.no_grad():
                self.optimizer.step()
            for weight in self.weights:
                weight.grad = None
            self._held.append((worker, self.clocks[worker] + 1, reply, self.version - pulled))
            self.clocks[worker] += 1
            self.version += 1
            ready = self._ready()
        for future, answer in ready:  # outside the lock: setting a result sends the reply
            future.set_result(answer)
        return reply

    def _ready(self) -> list[tuple[Future[Reply], Reply]]:
        """The held replies whose worker is no more than max_staleness ahead of the slowest."""
        slowest = min(self.clocks)
        ready = [h for h in self._held if h[1] - slowest <= self.max_staleness]
        if not ready:
            return []
        self._held = [h for h in self._held if h[1] - slowest > self.max_staleness]
        weights = [w.detach().clone() for w in self.weights]  # the reply is sent after the lock
        remote = sum(worker != self.host for worker, *_ in ready)
        self.bytes_replied += sum(w.numel() * w.element_size() for w in weights) * remote
        return [(future, (weights, self.version, staleness)) for *_, future, staleness in ready]

    def pull(self, worker: int) -> Reply:
        with self._lock:
            weights = [w.detach().clone() for w in self.weights]
            if worker != self.host:
                self.bytes_replied += sum(w.numel() * w.element_size() for w in weights)
            return weights, self.version, 0

    def state_dict(self) -> dict[str, Any]:
        """A copy: the optimizer's own state dict holds its live tensors."""
        with self._lock:
            return {
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "clocks": list(self.clocks),
                "version": self.version,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.optimizer.load_state_dict(state["optimizer"])
            self.clocks, self.version = list(state["clocks"]), int(state["version"])


# The part this process serves: RPC runs a call's function in the callee's process, which
# finds its shard here.
_SHARD: Shard | None = None


def _hosted() -> Shard:
    assert _SHARD is not None, "this rank serves no part of the parameters"
    return _SHARD


@rpc.functions.async_execution
def _push(worker: int, pulled: int, lr: float, grads: list[torch.Tensor | None]) -> Future:
    return _hosted().push(worker, pulled, lr, grads)


def _pull(worker: int) -> Reply:
    return _hosted().pull(worker)


def _name(rank: int) -> str:
    return f"trainyard-{rank}"


def split_by_size(sizes: list[int], servers: int) -> list[list[int]]:
    """Each tensor's index (`sizes` in bytes) onto a server: the largest first onto the
    least loaded, so the servers hold about as many bytes each."""
    parts: list[list[int]] = [[] for _ in range(servers)]
    loads = [0] * servers
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        least = min(range(servers), key=lambda s: (loads[s], s))
        parts[least].append(index)
        loads[least] += sizes[index]
    return [sorted(part) for part in parts]


def _start_rpc(rank: int, world: int) -> None:
    """Join the RPC world through keys of this job's own in the store the process group
    met in: torchrun's env:// store would hand a restarted worker the killed attempt's
    peer addresses, and a worker process that runs job after job its last job's."""
    nonce = [uuid.uuid4().hex if rank == 0 else ""]
    dist.broadcast_object_list(nonce, src=0)
    global _RPC_STORE
    _RPC_STORE = side_store(f"rpc-{nonce[0]}", timedelta(seconds=_RPC_TIMEOUT_S))
    with suppress(RuntimeError):  # registered by an earlier job in this process
        register_rendezvous_handler(_RENDEZVOUS, _job_rendezvous)
    transports, channels = _transports_and_channels(world)
    options = rpc.TensorPipeRpcBackendOptions(
        rpc_timeout=_RPC_TIMEOUT_S,
        init_method=f"{_RENDEZVOUS}://",
        _transports=transports,
        _channels=channels,
    )
    with warnings.catch_warnings():  # RPC's own gloo group uses a deprecated form
        warnings.simplefilter("ignore", UserWarning)
        rpc.init_rpc(_name(rank), rank=rank, world_size=world, rpc_backend_options=options)


def _transports_and_channels(world: int) -> tuple[list[str] | None, list[str] | None]:
    """Over the network alone when the workers span nodes (None: TensorPipe chooses).
    TensorPipe's cma channel reads the other process's memory wherever both run on one
    kernel in one PID namespace and may ptrace each other, as nodes in network namespaces
    on one machine do (and containers sharing a PID namespace): the tensors then never
    cross the link between the nodes. Between machines TensorPipe picks mpt_uv (a tensor
    over several TCP connections) or basic anyway; cma alone is left out."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) >= world:
        return None, None  # one node: shared memory and cma are its fast paths
    return ["uv"], ["mpt_uv", "basic"]


_RENDEZVOUS = "trainyard-job"
_RPC_TIMEOUT_S = 600  # joining, and any call but a push or pull (those wait without end)
_RPC_STORE: dist.Store | None = None  # the keys the job's RPC world meets under


def _job_rendezvous(url: str, **_: Any) -> Iterator[tuple[dist.Store, int, int]]:
    assert _RPC_STORE is not None
    yield _RPC_STORE, dist.get_rank(), dist.get_world_size()


def ignore_scheduler_order_warning() -> None:
    """The run's own optimizer never steps (the servers' do) while its scheduler still sets
    the learning rate each push takes: torch's warning about that order is moot. (The
    message is a regular expression: its brackets escaped, or it matches nothing.)"""
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))


class ParameterServerSync:
    """A worker's side: push gradients and take the weights back each update; meet the
    other workers at epoch ends and checkpoints. Every rank of the world is a worker."""

    def __init__(
        self, model: nn.Module, settings: ServerSettings, make_optimizer: MakeOptimizer
    ) -> None:
        global _SHARD
        self.rank, self.replicas = dist.get_rank(), dist.get_world_size()
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        # No more servers than tensors: each holds whole ones.
        servers = min(max(settings.servers, 1), self.replicas, len(self.parameters))
        sizes = [p.numel() * p.element_size() for p in self.parameters]
        self.parts = split_by_size(sizes, servers)
        self.pulled = [0] * servers  # each server's update count at this worker's last reply
        self.communication = Communication()
        self.staleness: Counter[int] = Counter()
        self._met_since_start = False
        self._snapshot: dict[str, Any] | None = None
        self.shard: Shard | None = None
        if self.rank < servers:
            part = [self.parameters[i] for i in self.parts[self.rank]]
            self.shard = Shard(
                part, make_optimizer, self.replicas, settings.max_staleness, self.rank
            )
        _SHARD = self.shard
        _start_rpc(self.rank, self.replicas)
        ignore_scheduler_order_warning()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update: this worker's gradients to the servers, their weights back."""
        if not self._met_since_start:  # no push before every server holds its loaded part
            dist.barrier()
            self._met_since_start = True
        lr = optimizer.param_groups[0]["lr"] / self.replicas
        started = time.perf_counter()
        replies = []
        # The other ranks' servers first: this rank's own applies the push in this thread.
        order = sorted(range(len(self.parts)), key=lambda server: server == self.rank)
        for server in order:
            grads = [self._grad(self.parameters[i]) for i in self.parts[server]]
            if server != self.rank:
                self.communication.bytes_sent += sum(
                    g.numel() * g.element_size() for g in grads if g is not None
                )
            args = (self.rank, self.pulled[server], lr, grads)
            replies.append((server, self._call(server, _push, args)))
        # One push, however many servers took a part: its staleness is the largest.
        self.staleness[max(self._take(server, reply.wait()) for server, reply in replies)] += 1
        self.communication.wait_s += time.perf_counter() - started
        self.communication.syncs += 1

    def _call(self, server: int, function: Callable[..., Any], args: tuple) -> Future:
        """`function` (`_push` or `_pull`) on `server`'s shard: through RPC, or (this rank's
        own) in this process, where a round trip through RPC's threads cost more than the
        update. `_push` answers with a future already, `_pull` with its reply."""
        if server != self.rank:
            return rpc.rpc_async(_name(server), function, args=args, timeout=0)
        answer = function(*args)
        if isinstance(answer, Future):
            return answer
        done: Future[Reply] = Future()
        done.set_result(answer)
        return done

    @staticmethod
    def _grad(parameter: torch.Tensor) -> torch.Tensor | None:
        grad = parameter.grad  # None: a parameter this batch did not reach
        return None if grad is None else grad.detach().cpu()

    @torch.no_grad()
    def _take(self, server: int, reply: Reply) -> int:
        weights, version, staleness = reply
        for i, weight in zip(self.parts[server], weights, strict=True):
            self.parameters[i].copy_(weight)
        self.pulled[server] = version
        return staleness

    def due_at_epoch_end(self, last: bool) -> bool:
        return True  # validation scores one model: the workers meet at every epoch's end

    def sync(self) -> None:
        self._meet(snapshot=False)

    @torch.no_grad()
    def _meet(self, snapshot: bool) -> None:
        """Every worker waits for every other's updates to be committed, then takes the
        servers' weights and the mean of the floating buffers; none pushes again before
        the servers' state is snapshotted (a checkpoint)."""
        started = time.perf_counter()
        dist.barrier()
        for server in range(len(self.parts)):
            self._take(server, self._call(server, _pull, (self.rank,)).wait())
        self._average_buffers()
        if snapshot:
            self._snapshot = None if self.shard is None else self.shard.state_dict()
        dist.barrier()
        self.communication.wait_s += time.perf_counter() - started

    @torch.no_grad()
    def _average_buffers(self) -> None:
        """Batch norm's running statistics are each worker's own: they meet at their mean."""
        if not self.buffers:
            return
        means = replica_means(self.buffers, self.replicas)
        for buffer, mean in zip(self.buffers, means, strict=True):
            buffer.copy_(mean)

    @contextmanager
    def agreed_weights(self) -> Iterator[None]:
        yield  # validation runs right after the workers met: the model holds the servers'

    def counted(self) -> Communication:
        """This rank's communication: its pushes to other ranks' servers and its server's
        replies to other ranks' workers."""
        replied = 0 if self.shard is None else self.shard.bytes_replied
        return Communication(
            bytes_sent=self.communication.bytes_sent + replied,
            wait_s=self.communication.wait_s,
            syncs=self.communication.syncs,
            staleness=dict(sorted(self.staleness.items())),
        )

    def state_dict(self) -> dict[str, Any]:
        """Called by every rank at a checkpoint: the workers meet, so the checkpoint's model
        holds every committed update and nothing else."""
        self._meet(snapshot=True)
        return {"pulled": list(self.pulled)}

    def own_state(self) -> dict[str, Any]:
        """What this rank's checkpoint entry holds: its server's optimizer and counters."""
        return {"server": self._snapshot}

    def restart(self) -> None:
        """Serve the model's weights as loaded (every rank loaded the same)."""
        if self.shard is not None:
            self.shard.restart([self.parameters[i] for i in self.parts[self.rank]])
        self.pulled = [0] * len(self.parts)

    def load_state_dict(self, state: dict[str, Any], own: dict[str, Any]) -> None:
        """A checkpoint's counters and this rank's server state, after `restart`."""
        self.pulled = list(state["pulled"])
        if self.shard is not None and own.get("server") is not None:
            self.shard.load_state_dict(own["server"])

    def agreed_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state  # the model holds the servers' weights: the workers just met

    def settle(self) -> None:
        """Training ended on the servers' weights: the workers met at its last epoch."""

    def close(self, graceful: bool) -> None:
        """Stop serving: once every worker is done (graceful, at training's end), or at
        once (training failed or was interrupted, and the process may run another job)."""
        global _SHARD
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            rpc.shutdown(graceful=graceful)
        _SHARD = None

"""The torchrun command line a job is launched with, and its workers' environment."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainyard.runtime.network import endpoint_host_port

# The one module torchrun starts, and its file, which torchrun's --run-path runs in each
# worker it forks (trainyard.runtime.forked).
WORKER_MODULE = "trainyard.engine.worker"
WORKER_SCRIPT = str(Path(__file__).parents[1] / "engine" / "worker.py")
FORKS_WORKERS = ["--run-path", "--start-method=fork"]  # before WORKER_SCRIPT

if TYPE_CHECKING:  # not at run time: the torchrun agent imports this module, see launch.torchrun
    from trainyard.config import TrainConfig


def torchrun_command(
    train: TrainConfig, worker_args: Sequence[str], max_restarts: int = 0, rdzv_id: str = "job"
) -> list[str]:
    """`python -m trainyard.runtime.launch ... --run-path --start-method=fork WORKER_SCRIPT
    worker_args`: torchrun's agent forks each worker, which runs trainyard.engine.worker."""
    return [
        sys.executable,
        "-m",
        # torchrun (torch.distributed.run), started cheaper: see trainyard.runtime.launch.torchrun
        "trainyard.runtime.launch",
        *rendezvous_args(train, rdzv_id),
        f"--nproc_per_node={train.workers}",
        # When a worker dies torchrun restarts the whole group, which resumes from the
        # latest committed checkpoint (jobs.train_job).
        f"--max-restarts={max_restarts}",
        # Forked from torchrun's agent, which has imported torch and the worker's modules
        # (trainyard.runtime.launch.torchrun): a worker is up in milliseconds, where a new
        # interpreter spent ~5 s of CPU importing them, at every start and restart.
        *FORKS_WORKERS,
        WORKER_SCRIPT,
        *worker_args,
    ]


def new_interpreters(command: list[str]) -> list[str]:
    """A torchrun_command with each worker started as a new interpreter (torchrun's `-m`
    WORKER_MODULE) instead of forked from the agent."""
    at = command.index(FORKS_WORKERS[0])
    return [*command[:at], "-m", WORKER_MODULE, *command[at + len(FORKS_WORKERS) + 1 :]]


# torchrun's c10d rendezvous with each node's group rank its node_rank (trainyard.runtime.nodes,
# registered under this name in torchrun's process: see trainyard.runtime.launch.torchrun).
NODE_RANKED_C10D = "trainyard-c10d"
LOOPBACK = "127.0.0.1"


def rendezvous_args(train: TrainConfig, rdzv_id: str) -> list[str]:
    if train.max_nodes == 1 and not train.rdzv_endpoint:
        # c10d rendezvous on a free local port: jobs never collide on 29500. The workers
        # meet at the loopback address, not at this host's name: a name that resolves to
        # nothing (a container's, a namespace's) left them retrying it forever.
        return ["--standalone", f"--local-addr={LOOPBACK}"]
    # Every node runs this with its own node_rank; node 0's host serves the rendezvous store
    # at rdzv_endpoint, and the run id keeps concurrent runs apart. torchrun's c10d ignores
    # --node-rank; NODE_RANKED_C10D makes the node rank the node's group rank. An elastic
    # run's --nnodes=MIN:MAX lets torchrun train on any MIN to MAX of the nodes.
    return [
        f"--nnodes={train.nnodes}",
        f"--rdzv-backend={NODE_RANKED_C10D}",
        f"--rdzv-conf={_rendezvous_conf(train)}",
        f"--rdzv-endpoint={train.rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


def _rendezvous_conf(train: TrainConfig) -> str:
    """A node that never comes fails the rendezvous after train.node_timeout_s. Who serves
    the rendezvous store is said outright (node 0) where torch would guess it from this
    host's name, which a machine (a container) may not resolve; on loopback every node is
    on one machine, and the first to start serves it, except in an elastic run, where node 0
    serves it always: the nodes that come and go must find it where it was."""
    conf = f"node_rank={train.node_rank},join_timeout={math.ceil(train.node_timeout_s)}"
    host = endpoint_host_port(train.rdzv_endpoint)[0] if train.rdzv_endpoint else ""
    if train.elastic or host not in ("localhost", "127.0.0.1", "::1"):
        conf += f",is_host={str(train.node_rank == 0).lower()}"
    if train.elastic:
        conf += "," + ",".join(f"{key}={value}" for key, value in ELASTIC_RENDEZVOUS.items())
    return conf


# An elastic run's rendezvous: how soon a lost node is noticed and the others meet again.
# torch's defaults take about a minute: a node is dead after keep_alive_max_attempt missed
# heartbeats every keep_alive_interval (3 x 5 s), and once the fewest nodes (MIN) have met
# the rendezvous waits last_call_timeout (30 s) for more. A lost node's peers fail their
# next collective at once (or after train.hang_timeout_s on a cut network) and their agent
# restarts them (one of train.max_restarts); here they meet again within ~7 s of the loss:
# the dead node's heartbeat is 5 s old, and the round waits 2 s more for stragglers. A
# heartbeat a second is one small write to node 0's store per node, and 5 missed ones in a
# row is a stall no live agent shows. The round a returning node waits for is the next
# one: the others' agents see it waiting and restart their workers for it, which costs no
# restart, and the workers, signalled, commit where they stopped (checkpoint.on_interrupt).
ELASTIC_RENDEZVOUS = {
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
    "last_call_timeout": 2,
}


# glibc's malloc hands memory blocks over 128 KiB back to the kernel when they are freed, so
# a step that frees its gradients and activations faults every page of them in again the
# next step (~1000 faults per 4 MiB; with them the MLP 1024-1024 trained 0.8x as fast).
# Blocks up to 32 MiB (glibc's largest threshold) stay in the heap, and up to 1 GiB of free
# heap is kept: peaks recur every step. Set either variable yourself to choose otherwise.
KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}
# Under fsdp each layer's gathered weights and gradients come and go every step: kept, they
# grew a 38M-parameter transformer's worker to 1353 MB (DDP's: 1400), so sharding saved
# nothing. glibc's default threshold, held fixed (left alone, glibc raises it to the largest
# block freed, the same 12 MB a layer), gave 724 MB.
RETURN_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(128 * 2**10),
    "MALLOC_TRIM_THRESHOLD_": str(128 * 2**10),
}
# A pipeline stage's kept heap fragments: a 38M-parameter transformer cut in two grew by
# 0.5-1 MB a step and without end (one process training it whole held level). Blocks over
# 1 MiB handed back, its workers held level under 750 MB through a 219-step epoch (kept:
# 802 and 813 MB, still growing) at 1.29x the epoch's time; glibc's 128 KiB held lowest, at
# 1.6-1.7x the step time.
BOUND_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}
FreedMemory = Literal["kept", "bounded", "returned"]
FREED_MEMORY: dict[FreedMemory, dict[str, str]] = {
    "kept": KEEP_FREED_MEMORY,
    "bounded": BOUND_FREED_MEMORY,
    "returned": RETURN_FREED_MEMORY,
}


def freed_memory(train: TrainConfig) -> FreedMemory:
    """What a job's workers do with the memory a step frees (a key of FREED_MEMORY)."""
    if train.strategy == "fsdp":
        return "returned"
    return "bounded" if train.parallel.pipeline > 1 else "kept"


def worker_env(
    extra: dict[str, str],
    threads: int,
    gpus: Sequence[int] | None = None,
    freed: FreedMemory = "kept",
) -> dict[str, str]:
    """`freed`: a key of FREED_MEMORY (glibc's settings a user set win)."""
    env = FREED_MEMORY[freed] | dict(os.environ)
    env.update(extra)
    env["OMP_NUM_THREADS"] = str(threads)
    if gpus is not None:  # local rank r then trains on the r-th of them
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    env["PYTHONUNBUFFERED"] = "1"
    return env

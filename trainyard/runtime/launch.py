"""Launching a worker job: under a torchrun of its own, or on persistent workers inside a
`persistent_workers` block; a lost torchrun agent is launched again while restarts are left.

`python -m trainyard.runtime.launch` is also how every job starts torchrun itself
(`torchrun`, below), so this module imports little at its top.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.errors import WorkerFailed
from trainyard.runtime.guardian import exit_with_parent
from trainyard.runtime.job_output import AgentLost
from trainyard.runtime.network import interface_env, listening_interface
from trainyard.runtime.processes import run_job
from trainyard.runtime.torchrun import (
    FORKS_WORKERS,
    NODE_RANKED_C10D,
    WORKER_MODULE,
    freed_memory,
    new_interpreters,
    torchrun_command,
    worker_env,
)
from trainyard.util.attempts import RESTARTS_BEFORE_ENV

if TYPE_CHECKING:  # not at run time: `python -m trainyard.runtime.launch` starts torchrun
    from trainyard.config import TrainConfig


def run_worker(
    root: Path,
    train: TrainConfig,
    store_env: dict[str, str],
    worker_args: Sequence[str],
    on_line: Callable[[str], None] = print,
    max_restarts: int = 0,
    rdzv_id: str = "job",
    job_env: dict[str, str] | None = None,
) -> None:
    """Launch `trainyard.engine.worker` under torchrun for this project and wait for it; inside a
    `trainyard.runtime.persistent.persistent_workers` block, a single node's job runs on persistent
    workers. `job_env`: the job's own environment (the run's lease token), on top of
    `store_env`. torchrun restarts failed workers; when its agent itself is lost, this
    launches it again, and the new workers resume from the last committed checkpoint. Both
    kinds of restart share `max_restarts`."""
    used = 0  # restarts so far, the agents' of their workers and the relaunches
    while True:
        env = (job_env or {}) | {RESTARTS_BEFORE_ENV: str(used)}
        try:
            _launch(root, train, store_env, worker_args, on_line, max_restarts - used, rdzv_id, env)
            return
        except AgentLost as lost:
            used += lost.restarts + 1
            if used > max_restarts:
                line = f"{lost} with all train.max_restarts={max_restarts} restarts used"
                raise WorkerFailed(line, summary=line, restarts=used - 1) from None
            on_line(
                f"trainyard: {lost}; launching it again to resume from the last committed "
                f"checkpoint (restart {used} of {max_restarts})"
            )
        except WorkerFailed as failed:
            if failed.restarts is not None:  # counted within the last launch
                failed.restarts += used
            raise


def _launch(
    root: Path,
    train: TrainConfig,
    store_env: dict[str, str],
    worker_args: Sequence[str],
    on_line: Callable[[str], None],
    max_restarts: int,
    rdzv_id: str,
    job_env: dict[str, str],
) -> None:
    # Imported here for start-up cost: torchrun's agent runs this module and never needs the
    # pool, whose module (pydantic) took it ~0.27 s longer to start.
    from trainyard.runtime.persistent import active_pool, serves

    args = [*worker_args, "--project-dir", str(root)]
    pool = active_pool()
    if pool is not None and serves(train):
        pool.run(root, train, store_env, max_restarts, args, job_env, on_line)
        return
    cmd = torchrun_command(train, args, max_restarts, rdzv_id)
    freed = freed_memory(train)
    job_env = job_env | _listening_interface(train, on_line)
    env = worker_env(store_env | job_env, train.threads_per_worker, train.gpus, freed)
    run_job(cmd, env, root, train.timeout_s, on_line)


def _listening_interface(train: TrainConfig, on_line: Callable[[str], None]) -> dict[str, str]:
    """Across machines, the interface the workers listen on where the host's name would
    have them on loopback (trainyard.runtime.network)."""
    found = listening_interface(train.rdzv_endpoint) if train.max_nodes > 1 else None
    if found is None:
        return {}
    interface, address = found
    on_line(
        f"trainyard: this host's name ({socket.gethostname()}) does not resolve to its "
        f"address; the workers listen on {interface} ({address}), the interface towards the "
        "rendezvous (set GLOO_SOCKET_IFNAME and TP_SOCKET_IFNAME to choose another)"
    )
    return interface_env(interface)


def torchrun() -> None:
    """`python -m torch.distributed.run`, the same main with the same arguments, minus two
    pauses every job waited for: collections during its imports (torch), and the final one
    over their objects at exit, which took ~0.5 s after the workers had finished. Its agent
    stops restarting a worker group that failed the same way twice (trainyard.runtime.failures).
    It imports what the workers import, once, before forking them (trainyard.runtime.forked)."""
    gc.disable()
    try:
        # imported here, with collections off: the start-up cost the docstring explains
        import torch
        from torch.distributed.launcher import api
        from torch.distributed.run import main

        from trainyard.runtime import nodes
        from trainyard.runtime.agent_shutdown import agent_waits_for_commits
        from trainyard.runtime.failures import StopsOnRepeat, report_every_failure
    finally:
        gc.enable()
    if FORKS_WORKERS[-1] in sys.argv:
        # Named, not imported by name: the launcher knows the engine only as what it starts.
        importlib.import_module(WORKER_MODULE).import_engine()
        if torch.cuda.is_initialized():  # a forked child could not use CUDA: start them anew
            sys.argv = new_interpreters(sys.argv)
    agent_waits_for_commits()  # told to stop, it lets its workers commit first
    nodes.register(NODE_RANKED_C10D)  # rendezvous_args' rendezvous for more than one node
    # The agent torchrun's launcher builds: one that does not restart a failure that repeats.
    setattr(api, "LocalElasticAgent", StopsOnRepeat)  # noqa: B010 (a class: mypy refuses `=`)
    report_every_failure()  # of the workers it forks, as of those it started
    gc.freeze()
    atexit.register(gc.freeze)  # at exit, after every handler registered later
    # Its launcher killed outright (SIGKILL, the OOM killer) runs no clean-up: without this
    # the job trains on, orphaned, for as long as it would have run.
    exit_with_parent(signum=signal.SIGTERM)
    main()


if __name__ == "__main__":
    torchrun()

"""torchrun's agent, told to stop, lets its workers commit a checkpoint first.

The `trainyard` command SIGTERMs the agent on a Ctrl-C; the agent passes the signal on to
every worker once and waits for them, which then stop at a step they agree on and commit
there (trainyard.engine.interrupt_checkpoint) within checkpoint.interrupt_grace_s.
"""

from __future__ import annotations

import signal
from types import FrameType

# What a worker takes for "stop and keep your work", and the agent passes on.
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long torchrun's agent waits for its workers to exit once it is told to stop (its own
# default is 30 s): longer than any checkpoint.interrupt_grace_s, which the workers keep.
SHUTDOWN_S = 630


def agent_waits_for_commits() -> None:
    """torchrun's agent, told to stop, passes the signal on to its workers once and waits
    SHUTDOWN_S for them instead of 30 s. A second signal to it would end it mid-wait,
    and its workers with it (they exit with their parent), before they commit."""
    # Imported here for start-up cost: the workers import SIGNALS, only the agent needs these.
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    handler = api._terminate_process_handler

    def once(signum: int, frame: FrameType | None) -> None:
        for sig in (*SIGNALS, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)
        handler(signum, frame)

    api._terminate_process_handler = once
    shutdown = LocalElasticAgent._shutdown

    def patient(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        shutdown(self, death_sig, max(timeout, SHUTDOWN_S))

    setattr(LocalElasticAgent, "_shutdown", patient)  # noqa: B010 (a method: mypy refuses `=`)

"""A node's fence. Node 0 marks a node lost (its flow run Crashed) when its host's worker goes
quiet, and starts a replacement with the same node rank. A host that was only cut off lives
on, and when it reaches the others again its old node must not train beside the replacement:
two nodes with one node rank stop every node's rendezvous, and node 0's workers, blocked in a
collective with it, would go on with the old node as if nothing had happened. So while a node
trains, a thread reads its own flow run's state and, once someone else has ended it, stops the
node's torchrun (`trainyard.runtime.processes.job_scope`)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State

from trainyard.errors import TrainyardError
from trainyard.runtime.processes import job_scope

POLL_S = 2.0  # as node 0's watcher reads the nodes
# A read sent as the host was cut off waits on TCP's retransmissions, which back off to a
# minute and more, once the host is back: Prefect's own timeout (60 s) would let the old node
# train on beside its replacement that long. A short one sends a fresh read instead.
READ_TIMEOUT_S = 10.0

# The prefixes a flow run's message carries before trainyard's own line: Prefect's wrapping of
# an exception, and the class name of trainyard's errors (the line itself says what is wrong).
_WRAPPING = "Flow run encountered an exception: "
_ERROR_NAMES = [TrainyardError.__name__, *(c.__name__ for c in TrainyardError.__subclasses__())]
_ERROR_CLASS = re.compile(f"^({'|'.join(_ERROR_NAMES)}): ")


def state_line(state: State) -> str:
    """A flow run state's message as trainyard's one line, without Prefect's wrapping of it."""
    line = (state.message or "no message").splitlines()[0].removeprefix(_WRAPPING)
    return _ERROR_CLASS.sub("", line)


@contextmanager
def fenced(flow_run_id: UUID | str | None, log: Any) -> Iterator[Callable[[], str | None]]:
    """Inside the block this thread's torchrun jobs stop once the flow run `flow_run_id` is
    ended by someone else (Crashed by node 0, Cancelled): yields a function saying why, or
    None while it was not. Outside a flow run (None) there is nothing to watch."""
    if flow_run_id is None:
        yield lambda: None
        return
    with (
        job_scope() as scoped,
        get_client(httpx_settings={"timeout": READ_TIMEOUT_S}, sync_client=True) as client,
    ):
        ended = threading.Event()
        why: list[str] = []

        def watch() -> None:
            while not ended.wait(POLL_S):
                try:
                    state = client.read_flow_run(UUID(str(flow_run_id))).state
                except Exception:  # cut off from the server, or it is busy: read again
                    continue
                if state is not None and state.is_final():
                    why.append(
                        f"this node's flow run was marked {state.name} ({state_line(state)})"
                    )
                    log.warning("%s: stopping this node's torchrun", why[0])
                    scoped.stop()
                    return

        thread = threading.Thread(target=watch, name="node-fence", daemon=True)
        thread.start()
        try:
            yield lambda: why[0] if why else None
        finally:
            ended.set()
            thread.join(timeout=30)

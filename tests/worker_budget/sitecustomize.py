"""Imported at start-up by every Python process with this folder on its PYTHONPATH (the
memory-budget test's): a torchrun worker gets at most TRAINYARD_TEST_WORKER_MB of data memory
(RLIMIT_DATA: its heap and private writable mappings, where tensors on the CPU live), like a
machine with that much per worker. A worker started as a new interpreter has RANK set here;
one forked by its torchrun agent (trainyard.runtime.forked) gets the limit as it is forked:
the agent forks nothing else (its other children are exec'd, which run no fork handlers)."""

import os
import resource

_budget = os.environ.get("TRAINYARD_TEST_WORKER_MB")
_bytes = int(_budget) * 2**20 if _budget else 0


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (_bytes, _bytes))


if _bytes and "RANK" in os.environ:
    _limit()
elif _bytes:
    os.register_at_fork(after_in_child=_limit)

"""Imported at start-up by every Python process with this folder on its PYTHONPATH (the
memory-budget test's): a torchrun worker (RANK set; not its agent) gets at most
TRAINYARD_TEST_WORKER_MB of data memory (RLIMIT_DATA: its heap and private writable
mappings, where tensors on the CPU live), like a machine with that much per worker."""

import os
import resource

_budget = os.environ.get("TRAINYARD_TEST_WORKER_MB")
if _budget and "RANK" in os.environ:
    _bytes = int(_budget) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (_bytes, _bytes))

"""Which attempt of a run's training job this process belongs to: torchrun's restarts of its
workers, plus the relaunches of a lost agent before this torchrun launch. No torch here:
the launcher sets the count, the workers read it."""

from __future__ import annotations

import os

# The restarts a run made before this torchrun launch (trainyard.runtime.launch.run_worker sets it
# when it launches a lost agent again): torchrun's own count starts again from 0.
RESTARTS_BEFORE_ENV = "TRAINYARD_RESTARTS_BEFORE"


def attempt_number() -> int:
    """This attempt's number within the run's training job: 0 for the first, then one more
    per restart, torchrun's of its workers and a lost agent's relaunch alike."""
    return int(os.environ.get(RESTARTS_BEFORE_ENV, "0")) + torchrun_restarts()


def torchrun_restarts() -> int:
    """How many times this torchrun launch restarted its workers before this attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

"""A worker started again on a host marks crashed the flow runs its host's last worker left
Running only where their process is gone: a process counts as the run's while it carries
the run's id in its environment (tasks/orphaned_runs.py; the whole story, a host powered off
and on mid-run, is in test_node_loss)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from tasks.orphaned_runs import FLOW_RUN_ENV, run_process_lives


def test_a_flow_runs_process_lives_while_a_process_carries_the_runs_id():
    run_id = str(uuid.uuid4())
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    live = os.environ | {FLOW_RUN_ENV: run_id}
    with subprocess.Popen(sleeper, env=live, stdout=subprocess.PIPE, text=True) as proc:
        try:
            # Popen returns once the child's exec has begun; the kernel sets up the new
            # program's environment after that (/proc/PID/environ read empty in CI): wait
            # until the program runs.
            assert proc.stdout is not None and proc.stdout.readline() == "up\n"
            assert run_process_lives(str(proc.pid), run_id)
            # The pid given to a process of another run (or none): not this run's process.
            assert not run_process_lives(str(proc.pid), str(uuid.uuid4()))
        finally:
            proc.kill()  # the with closes its pipe and waits for it
    assert not run_process_lives(str(proc.pid), run_id)
    # No process id Prefect's process worker wrote: never judged, never crashed.
    assert run_process_lives(None, run_id) and run_process_lives("host:12", run_id)

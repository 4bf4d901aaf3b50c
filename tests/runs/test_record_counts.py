"""What a run record counts of its last launch: restarts and steps redone, from its resumes."""

from __future__ import annotations

from trainyard.runs.record import DatasetInfo, RunRecord, now


def _record(restarts: int) -> RunRecord:
    dataset = DatasetInfo(path="data/raw/digits.csv", dvc_md5="md5", rows=10)
    return RunRecord(run_id="r", status="completed", created_at=now(), params={},
                     dataset=dataset, code={}, restarts=restarts)  # fmt: skip


def test_a_node_that_joined_or_left_is_a_restart_though_torchrun_counted_none():
    """An elastic run regroups its workers without torchrun counting a restart: the record's
    count is its resumes', the one `runs show` prints (it said 2 where run.json said 1)."""
    resumes = [
        {"from_step": 40, "steps_redone": 3, "after": "node left"},
        {"from_step": 80, "steps_redone": 0, "after": "node joined"},
    ]
    record = _record(restarts=1)
    record.take_launch_resumes(resumes)
    assert (record.restarts, record.steps_redone) == (2, 3)


def test_a_launch_that_resumed_another_runs_checkpoint_counts_no_restart():
    record = _record(restarts=0)
    record.take_launch_resumes([{"from_step": 40, "steps_redone": 0, "after": None}])
    assert record.restarts == 0

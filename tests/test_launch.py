"""torchrun jobs: a failing worker's rank and traceback reach the caller; timeouts kill the tree."""

import sys
import textwrap

import pytest
from pydantic import ValidationError

from trainyard.config import TrainConfig
from trainyard.errors import WorkerFailed
from trainyard.launch import run_job, torchrun_command

pytestmark = pytest.mark.distributed


def torchrun(script, nproc=2):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
    ]


def test_failing_rank_and_its_traceback_are_in_the_error(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("rank one exploded on purpose")

        main()
    """)
    )
    lines = []
    with pytest.raises(WorkerFailed) as info:
        run_job(
            torchrun(script),
            {"PATH": "/usr/bin:/bin"},
            tmp_path,
            timeout_s=120,
            on_line=lines.append,
        )
    message = str(info.value)
    assert "rank      : 1" in message
    assert "ValueError: rank one exploded on purpose" in message and "Traceback" in message
    assert "error_file: <N/A>" not in message


def test_timeout_kills_every_worker(tmp_path):
    script = tmp_path / "hang.py"
    pids = tmp_path / "pids"
    script.write_text(
        f"import os, time\nopen({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(600)\n"
    )
    with pytest.raises(WorkerFailed, match=r"exceeded train\.timeout_s=8s"):
        run_job(
            torchrun(script),
            {"PATH": "/usr/bin:/bin"},
            tmp_path,
            timeout_s=8,
            on_line=lambda _: None,
        )
    worker_pids = [int(p) for p in pids.read_text().split()]
    assert len(worker_pids) == 2
    for pid in worker_pids:
        assert not _alive(pid), f"worker {pid} outlived its job"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_single_node_is_standalone_and_multi_node_uses_a_c10d_rendezvous():
    single = torchrun_command(TrainConfig(workers=2), ["train"])
    assert "--standalone" in single and "--max-restarts=0" in single
    node = TrainConfig(workers=4, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    cmd = torchrun_command(node, ["train"], max_restarts=3, rdzv_id="run-7")
    assert "--standalone" not in cmd
    for flag in (
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=run-7",
        "--nproc_per_node=4",
        "--max-restarts=3",
    ):
        assert flag in cmd
    assert node.world_size == 8


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nnodes": 2}, "nnodes > 1 needs rdzv_endpoint"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node_rank 2 must be below"),
        ({"nnodes": 2, "rdzv_endpoint": "no-port"}, "must be host:port"),
    ],
)
def test_multi_node_settings_are_validated(settings, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**settings)

"""torchrun jobs: a failing worker's rank and traceback reach the caller; timeouts kill the tree;
workers keep the memory a step frees for the next one."""

import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from pydantic import ValidationError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from trainyard.config import TrainConfig
from trainyard.errors import WorkerFailed
from trainyard.runtime.job_output import ROOT_CAUSE, root_cause
from trainyard.runtime.processes import run_job
from trainyard.runtime.torchrun import (
    WORKER_SCRIPT,
    freed_memory,
    new_interpreters,
    rendezvous_args,
    torchrun_command,
    worker_env,
)

from tests_support import loopback_endpoint

pytestmark = pytest.mark.distributed


# Steps of an MLP 64-1024-1024-10 that free their gradients (zero_grad(set_to_none=True), as
# trainyard's loop does); prints the page faults of 100 steps after 10 warm-up ones.
STEPS_FAULTS = textwrap.dedent(
    """
    import resource, torch
    torch.set_num_threads(1)
    layers = [torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)]
    model = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for _ in range(10):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def page_faults_of_steps(env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", STEPS_FAULTS], env=env, capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_a_worker_reuses_the_memory_its_last_step_freed_instead_of_faulting_it_in_again():
    # glibc's defaults faulted ~256 pages in per step: 29,185 and 30,753 in 100 steps (and
    # once 1,953, when its adaptive threshold happened to settle). With the workers'
    # settings, 0-2,049 in 30 runs: a 4 MiB block faulted in again now and then.
    faults = page_faults_of_steps(worker_env({}, threads=1))
    assert faults < 5_000, f"{faults} page faults in 100 steps"


def test_malloc_settings_a_user_chose_are_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert worker_env({}, threads=1)["MALLOC_MMAP_THRESHOLD_"] == "131072"


def test_fsdp_and_pipeline_workers_hand_freed_memory_back(monkeypatch):
    """FSDP's gathered layers would grow a kept heap past what sharding saves
    (tests/engine/test_too_big_for_one_worker.py trains within a budget because of it); a
    pipeline stage's kept heap fragments and grows every step, so blocks over 1 MiB go back."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    thresholds = {
        TrainConfig(workers=2): ("33554432", "1073741824"),
        TrainConfig(workers=2, strategy="fsdp"): ("131072", "131072"),
        TrainConfig(workers=2, parallel={"pipeline": 2}): ("1048576", "1073741824"),
    }
    for train, expected in thresholds.items():
        env = worker_env({}, threads=1, freed=freed_memory(train))
        assert (env["MALLOC_MMAP_THRESHOLD_"], env["MALLOC_TRIM_THRESHOLD_"]) == expected, train


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
    with pytest.raises(WorkerFailed, match=r"exceeded train\.timeout_s=20s"):
        run_job(
            torchrun(script),
            {"PATH": "/usr/bin:/bin"},
            tmp_path,
            timeout_s=20,  # both workers are up in 2-5 s here: room for a far slower machine
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


def test_workers_are_forked_from_the_agent_unless_they_must_start_anew():
    forked = torchrun_command(TrainConfig(workers=2), ["train", "--run-id", "r"])
    at = forked.index(WORKER_SCRIPT)
    assert forked[at - 2 : at] == ["--run-path", "--start-method=fork"]
    assert forked[at + 1 :] == ["train", "--run-id", "r"]
    anew = new_interpreters(forked)
    assert anew == [*forked[: at - 2], "-m", "trainyard.engine.worker", "train", "--run-id", "r"]


# Two gloo workers all-reduce their ranks and write the sum.
ALL_REDUCE = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        open(sys.argv[1], "w").write(str(int(total.item())))
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="a UTS namespace of its own: Linux")
def test_a_single_node_job_runs_where_the_hosts_name_resolves_to_nothing(tmp_path):
    """A container's or a namespace's name that no resolver knows: the workers meet at the
    loopback address (torchrun's --local-addr), where they once retried the name forever."""
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --uts` (root; CI runs as root)")
    script, out = tmp_path / "all_reduce.py", tmp_path / "sum"
    script.write_text(ALL_REDUCE)
    rendezvous = rendezvous_args(TrainConfig(workers=2), "job")
    job = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2"]
    unnamed = "trainyard-test-no-such-host.invalid"  # .invalid: never resolves (RFC 6761)
    done = subprocess.run(
        ["unshare", "--uts", "sh", "-c", f'hostname {unnamed} && exec "$@"', "sh",
         *job, str(script), str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_text() == "3"


def test_single_node_is_standalone_and_multi_node_uses_a_c10d_rendezvous():
    single = torchrun_command(TrainConfig(workers=2), ["train"])
    assert "--standalone" in single and "--max-restarts=0" in single
    node = TrainConfig(
        workers=4, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400", node_timeout_s=90
    )
    cmd = torchrun_command(node, ["train"], max_restarts=3, rdzv_id="run-7")
    assert "--standalone" not in cmd
    for flag in (
        "--nnodes=2",
        "--rdzv-backend=trainyard-c10d",  # c10d, ranked by node_rank (trainyard.runtime.nodes)
        # node 0 serves the rendezvous store; a node missing after node_timeout_s fails it
        "--rdzv-conf=node_rank=1,join_timeout=90,is_host=false",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=run-7",
        "--nproc_per_node=4",
        "--max-restarts=3",
    ):
        assert flag in cmd
    assert node.world_size == 8
    # Every node on this machine (a loopback endpoint, IPv6's too): the first to start serves
    # the store; elsewhere node 0 does, said outright.
    for endpoint, serves in (("[::1]:29400", ""), ("fd00::1:29400", ",is_host=false")):
        on = TrainConfig(nnodes=2, node_rank=1, rdzv_endpoint=endpoint, node_timeout_s=90)
        flags = [flag for flag in torchrun_command(on, ["train"]) if "rdzv-conf" in flag]
        assert flags == [f"--rdzv-conf=node_rank=1,join_timeout=90{serves}"], endpoint


# Node 1's first worker fails once node 0's has spoken; node 0's waits until its agent
# restarts it for node 1's sake, which torchrun counts as no restart. Each says who it is.
ROUNDS = textwrap.dedent(
    """
    import os, sys, time
    node, count = os.environ["NODE"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print("worker", node, os.environ["RANK"], count, os.environ["TRAINYARD_RENDEZVOUS"])
    sys.stdout.flush()
    if node == "0" and not os.path.exists("node-0-spoke"):
        open("node-0-spoke", "w").close()
        time.sleep(120)
    elif node == "1" and count == "0":
        while not os.path.exists("node-0-spoke"):
            time.sleep(0.05)
        sys.exit(3)
    """
)


def test_nodes_keep_their_node_rank_and_share_a_name_for_each_round(tmp_path):
    """After node 1's worker failed, node 1 counts restart 1 and node 0 none: the workers of
    a round share its name (their store's key prefix), which no other round has."""
    (tmp_path / "rounds.py").write_text(ROUNDS)
    endpoint = loopback_endpoint()
    lines: dict[int, list[str]] = {0: [], 1: []}

    def launch(node_rank: int) -> None:
        node = TrainConfig(workers=1, nnodes=2, node_rank=node_rank, rdzv_endpoint=endpoint)
        cmd = [sys.executable, "-m", "trainyard.runtime.launch", *rendezvous_args(node, "rounds")]
        cmd += ["--nproc_per_node=1", "--max-restarts=1", "rounds.py"]
        env = worker_env({"NODE": str(node_rank)}, 1)
        run_job(cmd, env, tmp_path, 150, lines[node_rank].append)

    nodes = [threading.Thread(target=launch, args=(rank,)) for rank in (1, 0)]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join(timeout=180)
    said = {
        rank: [line.split()[1:] for line in lines[rank] if line.startswith("worker ")]
        for rank in (0, 1)
    }
    assert [(rank, count) for _, rank, count, _ in said[0]] == [("0", "0"), ("0", "0")]
    assert [(rank, count) for _, rank, count, _ in said[1]] == [("1", "0"), ("1", "1")]
    names = [[name for *_, name in said[rank]] for rank in (0, 1)]
    assert names[0] == names[1] and names[0][0] != names[0][1], names


def test_two_nodes_with_one_node_rank_are_refused_with_a_trainyard_error(tmp_path):
    """The agents fail at the rendezvous, before any worker starts, with the error that the
    CLI prints as one line (cli._worker_refusal)."""
    endpoint = loopback_endpoint()
    node = TrainConfig(workers=1, nnodes=2, node_rank=1, rdzv_endpoint=endpoint)
    failures: list[BaseException] = []

    def launch() -> None:
        try:
            run_job(torchrun_command(node, ["train"]), worker_env({}, 1), tmp_path, 120, print)
        except BaseException as exc:  # reported to the test below
            failures.append(exc)

    nodes = [threading.Thread(target=launch) for _ in range(2)]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join(timeout=180)
    refusal = (
        "trainyard.errors.ConfigError: the 2 nodes that met have node ranks [1, 1]: give each "
        "node its own -S train.node_rank, 0 to 1 (0 for `trainyard run`)"
    )
    assert len(failures) == 2
    for failure in failures:
        assert isinstance(failure, WorkerFailed) and refusal in str(failure), failure


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nnodes": 2, "node_rank": 1}, "node_rank 1 needs rdzv_endpoint"),
        ({"nnodes": 2, "node_timeout_s": 0}, "node_timeout_s"),
        ({"nnodes": 2, "node_timeout_s": -5}, "node_timeout_s"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node_rank 2 must be below"),
        ({"nnodes": 2, "rdzv_endpoint": "no-port"}, "must be host:port"),
    ],
)
def test_multi_node_settings_are_validated(settings, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**settings)


PEER_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:22228. This is typically caused by a remote worker crashing."
)


def _failed(tmp_path, monkeypatch, rank: int, error: Exception | None) -> ProcessFailure:
    """Rank `rank` as torchrun's agent sees it: its error file written as @record writes it,
    or none when torchrun stopped it with SIGTERM."""
    error_file = tmp_path / f"{rank}" / "error.json"
    error_file.parent.mkdir()
    if error is None:
        return ProcessFailure(rank, 1000 + rank, -signal.SIGTERM, str(error_file))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise error
    except RuntimeError as exc:
        ErrorHandler().record_exception(exc)
    return ProcessFailure(rank, 1000 + rank, 1, str(error_file))


def _torchrun_output(failures: dict[int, ProcessFailure]) -> list[str]:
    """The end of a failed torchrun's output: the agent's traceback, then the summary that
    torch itself formats (failures first, then the one it names the root cause)."""
    error = ChildFailedError("trainyard.engine.worker", failures)
    return [
        "[rank1]: RuntimeError: rank 1 exploded",
        "Traceback (most recent call last):",
        '  File "torch/distributed/launcher/api.py", line 383, in launch_agent',
        "    raise ChildFailedError(",
        f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {error}",
    ]


def test_root_cause_names_the_rank_that_failed_on_its_own_not_one_that_lost_it(
    tmp_path, monkeypatch
):
    # Written first, so its timestamp is never later: torchrun names rank 0, as it does
    # when both fail within one second (the lowest rank on a tie).
    lost = _failed(tmp_path, monkeypatch, 0, RuntimeError(PEER_CLOSED))
    failures = {
        0: lost,
        1: _failed(tmp_path, monkeypatch, 1, RuntimeError("rank 1 exploded")),
        2: _failed(tmp_path, monkeypatch, 2, None),
    }
    lines = "\n".join(_torchrun_output(failures)).splitlines()
    torchruns = "\n".join(lines[lines.index(ROOT_CAUSE) :])
    assert "rank      : 0" in torchruns and "closed by peer" in torchruns

    cause = root_cause(lines)
    assert "rank      : 1 (local_rank: 1)" in cause and "exitcode  : 1" in cause
    assert "RuntimeError: rank 1 exploded" in cause and "Traceback" in cause
    assert "closed by peer" not in cause and "rank      : 2" not in cause

    # No rank failed on its own here (the one lost may be on another node): torchrun's pick.
    lines = "\n".join(_torchrun_output({0: lost, 2: failures[2]})).splitlines()
    cause = root_cause(lines)
    assert cause.startswith(ROOT_CAUSE) and "rank      : 0" in cause and "closed by peer" in cause

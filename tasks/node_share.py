"""One node's share of a multi-node run that node 0 started: the same seeded split as node 0,
then this node's torchrun in the run's rendezvous. `trainyard join` and the flow
`training_node` both run it; it imports no Prefect, so `trainyard join` starts without it."""

from __future__ import annotations

from collections.abc import Callable

from trainyard.config import TrainConfig, TrainyardConfig
from trainyard.errors import TrainyardError
from trainyard.project import ProjectPaths
from trainyard.runs.data_path import dataset_path
from trainyard.runtime.network import unanswered

DEFAULT_QUEUE = "default"  # every work pool's own queue


def host_queue(hostname: str) -> str:
    """The work queue only the workers of host `hostname` poll (`trainyard worker`): node 0
    sends another node's flow run there to place it on that host."""
    return f"host-{hostname}"


def check_joining_node(config: TrainyardConfig) -> None:
    """Refuse, in one line, settings that do not make this machine node 1..nnodes-1."""
    train = config.train
    if train.max_nodes < 2 or train.node_rank == 0:
        raise TrainyardError(
            "join is for nodes 1..nnodes-1 (set -S train.nnodes=N -S train.node_rank=K); "
            "node 0 runs `trainyard run`"
        )


def run_node_share(
    paths: ProjectPaths,
    config: TrainyardConfig,
    run_id: str,
    on_line: Callable[[str], None],
    signing_key_id: str | None = None,
) -> None:
    """Prepare the run's split as node 0 does and run this node's workers until the run
    ends; a failure comes back as torchrun's WorkerFailed. `signing_key_id`: node 0's
    checkpoint key's id, which this machine's key must match (checked first)."""
    # Imported when a node joins, so `trainyard --help` stays fast (start-up cost).
    from trainyard.checkpoint.signing import check_same_key
    from trainyard.data.split import prepare_cached_splits
    from trainyard.objectives import target_kind
    from trainyard.runs.record import check_run_id
    from trainyard.runtime.launch import run_worker
    from trainyard.storage import connect
    from trainyard.storage.versioning import content_md5

    check_run_id(run_id)
    check_joining_node(config)
    if signing_key_id is not None:
        check_same_key(signing_key_id)
    dataset_on_this_machine(paths, config)
    store = connect(config.storage, paths)
    # The same seeded split as node 0, in the same content-addressed folder (the record's
    # dataset.split_key); DVC's md5 of a file is the md5 of its bytes.
    dataset_md5 = content_md5(paths.root / config.data.path)
    target = target_kind(config.task.name)
    prepare_cached_splits(paths, config.data, config.split, dataset_md5, target)
    wait_for_node_zero(config.train, run_id, on_line)
    run_worker(
        paths.root,
        config.train,
        store.settings.worker_env(),
        ["train", "--run-id", run_id],
        on_line,
        max_restarts=config.train.max_restarts,
        rdzv_id=run_id,
    )


def dataset_on_this_machine(paths: ProjectPaths, config: TrainyardConfig) -> None:
    """A bundled example is written here as node 0 writes it (the same bytes, from installed
    packages); a dataset of the user's own must already be here: one line saying how."""
    dataset = dataset_path(config, paths.root)
    if dataset.exists():
        return
    # Start-up cost: the bundled examples' writers bring torch (~2.5 s), which a node's
    # flow run needs only to write one.
    from trainyard.data.bundled import BUNDLED

    if config.data.path in BUNDLED:
        BUNDLED[config.data.path](dataset)
        return
    raise TrainyardError(
        f"data.path {config.data.path} is not on this machine ({paths.root}): every node "
        "splits its own copy of the same bytes; `dvc pull` it (or copy it) here first"
    )


def wait_for_node_zero(train: TrainConfig, run_id: str, on_line: Callable[[str], None]) -> None:
    """Wait up to train.node_timeout_s for node 0's rendezvous store to listen, then refuse
    in one line: without it this node's torchrun waited out its own timeouts, then printed
    its stack, for every restart."""
    endpoint = train.rdzv_endpoint
    if endpoint is None or unanswered(endpoint, 0) is None:
        return
    wait_s = train.node_timeout_s
    on_line(
        f"node {train.node_rank}: waiting up to {wait_s:g} s for node 0's rendezvous at "
        f"{endpoint} (train.node_timeout_s)"
    )
    why = unanswered(endpoint, wait_s)
    if why is not None:
        raise TrainyardError(
            f"node 0's rendezvous at {endpoint} did not answer within {wait_s:g} s ({why}): "
            f"start node 0 first (`trainyard run --run-id {run_id} -S train.nnodes="
            f"{train.nnodes} -S train.rdzv_endpoint={endpoint}`), or set train.rdzv_endpoint "
            "to the address node 0 serves it on"
        )

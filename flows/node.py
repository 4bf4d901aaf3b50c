"""`training_node`: node `node_rank`'s share of a multi-node run that node 0's flow started
(tasks.nodes): the same seeded split, then this node's torchrun in the run's rendezvous. The
deployment `training_node/manual` runs it on a chosen host's work queue."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from flows.settings import flow_settings
from tasks.node_fence import fenced
from tasks.node_share import run_node_share
from trainyard.errors import TrainyardError, WorkerFailed
from trainyard.runtime.guardian import announce_flow_run
from trainyard.runtime.worker_lines import WorkerLines
from trainyard.util.logs import NODE_LOG


@flow(name="training_node")
def training_node(
    run_id: str,
    node_rank: int,
    rdzv_endpoint: str,
    overrides: list[str] | None = None,
    signing_key_id: str | None = None,
) -> None:
    """Run node `node_rank` of run `run_id`, meeting the other nodes at `rdzv_endpoint`
    (host:port, node 0's choice). `overrides`: the run's `section.key=value` settings, as
    node 0 has them (train.nnodes among them). `signing_key_id`: the id (not the key) of
    node 0's checkpoint signing key, which this machine's must be."""
    node = [f"train.node_rank={node_rank}", f"train.rdzv_endpoint={rdzv_endpoint}"]
    paths, config = flow_settings([*(overrides or []), *node])
    # The worker's run has no trainyard command above it: a guardian of its own stops this
    # node's torchrun when the run is cancelled or its process dies.
    announce_flow_run(PREFECT_API_URL.value(), flow_run.get_id())
    logger = get_run_logger()
    logger.info("node %d of run %s: rendezvous at %s", node_rank, run_id, rdzv_endpoint)
    # warnings and errors only: rank 0, on node 0, logs the run's progress
    with fenced(flow_run.get_id(), logger) as fenced_out:
        try:
            log_file = paths.run_logs(run_id) / NODE_LOG.format(node=node_rank)
            lines = WorkerLines(logger.log, log_file=log_file)
            run_node_share(paths, config, run_id, lines, signing_key_id)
        except WorkerFailed as failed:  # the failing rank's error (logged above) as the
            raise TrainyardError(failed.line()) from None  # state's line, node 0 names it by
        except KeyboardInterrupt:
            if fenced_out() is None:
                raise
            line = f"{fenced_out()}: it stopped rather than train beside its replacement"
            raise TrainyardError(line) from None
    logger.info("node %d: run %s finished its training", node_rank, run_id)

"""`trainyard join`: another machine's share of a multi-node run that node 0 started."""

from __future__ import annotations

import argparse
import sys

from tasks.node_share import check_joining_node, dataset_on_this_machine, run_node_share
from trainyard.cli.console import capped, print_stamped
from trainyard.cli.options import add_all_ranks, add_overrides
from trainyard.cli.run import checked_plan, worker_refusal
from trainyard.cli.session import guard
from trainyard.config import TrainyardConfig
from trainyard.errors import TrainyardError, WorkerFailed
from trainyard.project import ProjectPaths
from trainyard.runtime.network import unanswered
from trainyard.runtime.worker_lines import WorkerLines
from trainyard.util.documents import printable


def add_join_command(commands: argparse._SubParsersAction) -> None:
    join = commands.add_parser(
        "join",
        help="on another machine: add this node's workers to a multi-node run that node 0 "
        "started with `trainyard run -S train.nnodes=N -S train.rdzv_endpoint=HOST:PORT`",
    )
    join.add_argument("--run-id", required=True, help="the run id node 0 was started with")
    add_overrides(join, "as for run; at least -S train.node_rank=K")
    add_all_ranks(join)


def cmd_join(paths: ProjectPaths, config: TrainyardConfig, run_id: str) -> int:
    """Run this machine's share of a multi-node training job; node 0's flow does the rest."""
    # Imported when the command runs, so `trainyard --help` stays fast (start-up cost).
    from trainyard.runs.record import check_run_id
    from trainyard.util.logs import NODE_LOG, RANK_LOG

    check_run_id(run_id)
    check_joining_node(config)
    dataset_on_this_machine(paths, config)  # before the checks read it: says how to get it
    checked_plan(config, paths)
    guard(paths)  # this node's workers die with this command, as node 0's with its own
    node = config.train.node_rank
    logs = (paths.run_logs(run_id) / RANK_LOG.format(rank="N")).relative_to(paths.root)
    print(f"node {node}: each worker's lines go to {logs}", flush=True)
    node_log = paths.run_logs(run_id) / NODE_LOG.format(node=node)
    try:
        # warnings and errors only: rank 0 is on node 0
        run_node_share(paths, config, run_id, WorkerLines(print_stamped, log_file=node_log))
    except WorkerFailed as exc:  # the user's to fix (two nodes with one node_rank): one line
        refusal = worker_refusal(exc)
        if refusal is not None:
            raise TrainyardError(refusal) from None
        shown = node_log.relative_to(paths.root)
        print(_failure_line(config, run_id, exc, str(shown)), file=sys.stderr)
        return 1
    print(f"node {node}: run {run_id} finished its training")
    return 0


def _failure_line(config: TrainyardConfig, run_id: str, exc: WorkerFailed, log: str) -> str:
    """Why this node stopped, in one line: node 0 gone (its rendezvous no longer answers),
    or the error torchrun's summary names; `log`: where this node's whole output is."""
    node, endpoint = config.train.node_rank, config.train.rdzv_endpoint
    gone = unanswered(endpoint, 0) if endpoint else None
    if gone is not None:
        return (
            f"trainyard: node {node} of run {run_id} stopped: node 0's rendezvous at {endpoint} "
            f"no longer answers ({gone}): node 0 ended (its console says why) or its machine "
            f"was lost; once node 0 runs again with --run-id {run_id}, join again"
        )
    what = exc.repeated or exc.line()  # repeated: what torchrun's agent said when it stopped
    line = printable(" ".join(f"trainyard: node {node} of run {run_id} failed: {what}".split()))
    return f"{capped(line)} (its output: {log})"

"""A multi-node run's refusals before anything starts, on node 0's command line.

Node 0 of a run with train.nnodes > 1 and no train.rdzv_endpoint starts the other nodes as
flow runs of the Prefect deployment training_node/manual and hands them its -S settings as
their overrides (tasks.nodes). A -S that a flow run's overrides may not carry
(trainyard.config.callers) would fail on another host once the run had begun, and a Prefect
server without that deployment after Prefect's own traceback: both are one line here.
Importing this module imports no Prefect.
"""

from __future__ import annotations

from trainyard.cli.session import use_local_prefect
from trainyard.config import TrainyardConfig
from trainyard.config.callers import load_caller_config
from trainyard.errors import ConfigError
from trainyard.project import ProjectPaths


def starts_other_nodes(config: TrainyardConfig) -> bool:
    """Node 0 of more than one node, its rendezvous left to it (tasks.nodes.needs_launch),
    read without importing Prefect: a node other than 0 has a train.rdzv_endpoint."""
    train = config.train
    return train.nnodes != 1 and not train.rdzv_endpoint


def check_node_overrides(
    config: TrainyardConfig, paths: ProjectPaths, overrides: list[str]
) -> None:
    """The -S list as the other nodes' flow runs will take it, refused in one line where a
    flow run's overrides may not set a key (code to import, where credentials go)."""
    if not starts_other_nodes(config):
        return
    try:
        load_caller_config(paths.params, overrides)
    except ConfigError as exc:
        raise ConfigError(
            f"train.nnodes={config.train.nnodes} hands -S to the other nodes' flow runs as "
            f"their {exc}"
        ) from None


def check_node_deployment(config: TrainyardConfig, paths: ProjectPaths) -> None:
    """The Prefect server this run reports to has the deployment the other nodes run as, or
    one line saying how to register it. Starts the project's Prefect server if none runs,
    as the run itself would next."""
    if not starts_other_nodes(config):
        return
    use_local_prefect(paths)  # before Prefect's import, which reads its settings once
    # Imported here: Prefect's import costs seconds, and only a multi-node run needs it now.
    from prefect.client.orchestration import get_client

    from tasks.nodes import node_deployment

    with get_client(sync_client=True) as client:
        node_deployment(client)

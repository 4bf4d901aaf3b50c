"""Prefect flows: pipeline, node, sweep, retrain, inference.

Every flow module imports this package first, in the CLI's process and in a deployment's
flow-run process alike: a trainyard error ends the flow run in one line there (flows.one_line)."""

from flows.one_line import trainyard_errors_in_one_line

trainyard_errors_in_one_line()

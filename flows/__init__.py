"""Prefect flows: pipeline (and, as they come, sweep, retrain, inference)."""

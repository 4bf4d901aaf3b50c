"""Measured comparisons of trainyard with the alternatives a user would pick (never part of the tests' assertions)."""

"""Thin Prefect tasks: each calls one engine function (or launches torchrun) and adds
retries, logging and artifacts. No ML logic lives here."""

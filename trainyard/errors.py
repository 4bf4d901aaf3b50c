"""Errors a user can fix. The CLI prints their message as one line and exits with code 2."""


class TrainyardError(Exception):
    """A mistake in settings, data, checkpoints or credentials; the message says how to fix it."""


class ConfigError(TrainyardError):
    """params.yaml or a -S override is invalid."""


class DataError(TrainyardError):
    """The dataset cannot be used as given."""


class StoreError(TrainyardError):
    """The artifact store cannot be reached or used."""


class CheckpointError(TrainyardError):
    """A checkpoint is missing, incomplete, tampered with or unsafe to load."""


class WorkerFailed(RuntimeError):
    """A torchrun job exited non-zero; the message carries the failing rank's traceback."""


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a log line or a reply between processes."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

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
    """A torchrun job exited non-zero; the message carries the failing rank's traceback.

    Where torchrun's summary names it: `rank`, its error as one line (`summary`), its full
    `traceback`, the restarts before the last attempt, and, when torchrun's agent stopped
    restarting because the same error came twice, the line it said so with (`repeated`)."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        summary: str | None = None,
        traceback: str | None = None,
        restarts: int | None = None,
        repeated: str | None = None,
    ):
        super().__init__(message)
        self.rank, self.summary, self.traceback = rank, summary, traceback
        self.restarts, self.repeated = restarts, repeated

    def __reduce__(self):  # keeps the fields when Prefect copies or pickles the exception
        fields = (self.rank, self.summary, self.traceback, self.restarts, self.repeated)
        return type(self), (str(self), *fields)

    def line(self) -> str:
        """`rank 1: RuntimeError: ...`, or the message's first line if no rank is known."""
        if self.summary is None:
            return first_line(self)
        return f"rank {self.rank}: {self.summary}" if self.rank is not None else self.summary


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a log line or a reply between processes."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

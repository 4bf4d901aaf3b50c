"""A trainyard error ends a flow run in one line.

Prefect's engine logs every exception a flow or task raises with its traceback. A
`TrainyardError` is the user's fault, named in its message (a bad override, data missing on
this machine, a node that never joined): the traceback says nothing more and buried the line
in a deployment run's log (twice: the flow run's logger, then the engine's). The engine's
lines keep their text, the error's message added where they lack it; other exceptions keep
their tracebacks."""

from __future__ import annotations

import logging

from trainyard.errors import TrainyardError

# The loggers of Prefect's flow and task engines and of its flow-run process (prefect.engine)
ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.engine")


class _TrainyardErrorInOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, TrainyardError):
            line = record.getMessage()
            if str(error) not in line:
                line = f"{line}: {error}"
            record.msg, record.args = line, ()
            record.exc_info, record.exc_text = None, None
        return True


def trainyard_errors_in_one_line() -> None:
    """Installs the filter on the engine's loggers, once per process."""
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TrainyardErrorInOneLine) for f in logger.filters):
            logger.addFilter(_TrainyardErrorInOneLine())

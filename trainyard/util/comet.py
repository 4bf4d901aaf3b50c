"""How comet_ml is to behave in trainyard's processes, set before it is first imported."""

from __future__ import annotations

import logging
import os


def quiet_comet() -> None:
    """Before comet_ml is imported: no patching of ML libraries (we log explicitly), no
    reports of its own errors to Comet's Sentry, which nothing here asked for (its set-up
    also read every installed package's metadata, ~0.2 s of CPU beside the first steps),
    and only its warnings and errors on the console: its INFO lines (about 8 a run, one of
    them a `comet upload` command) say what trainyard's summary says once."""
    os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
    os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")
    os.environ.setdefault("COMET_LOGGING_CONSOLE", "WARNING")
    # Its advice to import it before torch is for the automatic logging turned off above;
    # every rank printed it as a warning, and any rank's warning reaches the console.
    logging.getLogger("comet_ml.experiment").addFilter(_not_late_import_advice)


def _not_late_import_advice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("To get all data logged automatically")

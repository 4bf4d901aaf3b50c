"""The base every settings section shares, and the bounds the sections agree on."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

# A URL's password: refused in settings that are written to run records, masked in errors.
URL_PASSWORD = re.compile(r"(\w[\w+.-]*://[^/@\s:]*:)[^/@\s]*@")
# Bounds of the settings in seconds. 1e308 passes `gt=0` and then overflows timedelta,
# threading's TIMEOUT_MAX (~292 years) and c10d's millisecond timeouts inside the workers,
# after everything has started. A wait or a retry is bounded by a week; a whole job by 30 days.
MAX_WAIT_S = 7 * 24 * 3600
# torchrun's agent gives interrupted workers this long (runtime.agent_shutdown.SHUTDOWN_S).
MAX_INTERRUPT_GRACE_S = 600
MAX_JOB_S = 30 * 24 * 3600


class Section(BaseModel):
    """One settings section: unknown keys refused, values frozen once validated."""

    # allow_inf_nan=False: every float setting of every section, today's and tomorrow's, is
    # finite. inf and nan pass range checks such as gt=0 (nan compares false) and only fail
    # after launch.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False
    )

"""Links into the comparison page served by `trainyard ui` (its default address): a run's
and a sweep's Prefect artifacts point there, and say how to write the same view to a file."""

from __future__ import annotations

import hashlib
import re
from urllib.parse import quote

UI_HOST, UI_PORT = "127.0.0.1", 8765


def page_link(run_ids: list[str] | None = None, sweep_id: str | None = None) -> str:
    """#runs=ID,ID selects those runs and draws their curves; #sweep=ID opens that sweep."""
    fragment = (
        f"sweep={quote(sweep_id)}" if sweep_id else "runs=" + ",".join(map(quote, run_ids or []))
    )
    return f"http://{UI_HOST}:{UI_PORT}/#{fragment}"


def artifact_key(prefix: str, name: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes only; a name that had
    to change gets a short hash of itself, so Run_1 and run-1 keep keys of their own."""
    key = re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{name}".lower()).strip("-")
    if key != f"{prefix}-{name}":
        key += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return key


def report_markdown(what: str, link: str, command: str) -> str:
    return (
        f"**See {what} in the comparison page:** start `trainyard ui` in the project, then open "
        f"[{link}]({link}). Or write the same view as one file that opens offline: `{command}`.\n"
    )

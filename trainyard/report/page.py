"""The page: the template with its style, plotly's JavaScript (from the installed wheel), the
page's own script and the data document inlined, so one file opens from file:// offline."""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from trainyard.report.data import ReportData

_SLOT = re.compile(r"/\*@(csp|style|plotly|script|data)@\*/")


@functools.cache
def _asset(name: str) -> str:
    return resources.files("trainyard.report").joinpath(name).read_text(encoding="utf-8")


@functools.cache
def _script() -> str:
    """The page's own script: page.js, then the charts it draws (function declarations,
    so their order does not matter; page.js's "use strict" stays first)."""
    return _asset("page.js") + "\n" + _asset("charts.js")


@functools.cache
def _plotly_js() -> str:
    # Imported here: only a command that renders a page pays for plotly's import.
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


@functools.cache
def content_policy() -> str:
    """The page's Content-Security-Policy: only its own two scripts run (the page's and
    plotly's, by hash), so markup that slipped into the page could not run an inline handler
    or a script of its own; nothing is fetched but /data.json. Plotly's parcoords compiles its
    WebGL code with Function(), hence 'unsafe-eval'; its styles are inline."""
    hashes = " ".join(f"'sha256-{_digest(text)}'" for text in (_script(), _plotly_js()))
    return (
        f"default-src 'none'; script-src {hashes} 'unsafe-eval'; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:; connect-src 'self'; base-uri 'none'; "
        "form-action 'none'"
    )


def _digest(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def data_json(data: ReportData) -> str:
    """The document as JSON that is safe inside a <script> element: no '<' can close it."""
    return data.model_dump_json().replace("<", "\\u003c")


def render_page(data: ReportData) -> str:
    slots = {
        "csp": content_policy(),
        "style": _asset("page.css"),
        "plotly": _plotly_js(),
        "script": _script(),
        "data": data_json(data),
    }
    # One pass: text put into a slot is never searched for slots again.
    return _SLOT.sub(lambda m: slots[m.group(1)], _asset("page.html"))

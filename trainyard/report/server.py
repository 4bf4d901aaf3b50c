"""`trainyard ui`: the comparison page served from the store, built fresh on each request, so
a page left open (it fetches /data.json every few seconds) follows running runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainyard.report.data import ReportData
from trainyard.report.page import data_json, render_page

log = logging.getLogger(__name__)


def make_server(host: str, port: int, build: Callable[[], ReportData]) -> ThreadingHTTPServer:
    """A server on host:port (port 0: a free one, see `server.server_address`) whose handler
    calls `build` per request. Nothing else is served: no files, no directory listing."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            path = self.path.split("?", 1)[0]
            if path not in ("/", "/data.json"):
                self.send_error(404, "the page is at /, its data at /data.json")
                return
            try:
                data = build()
            except Exception as exc:  # noqa: BLE001 - the store is down: say so, keep serving
                log.warning("building the page failed: %s", exc)
                self.send_error(503, f"cannot read the store: {exc}".splitlines()[0][:300])
                return
            if path == "/":
                self._send(render_page(data), "text/html; charset=utf-8")
            else:
                self._send(data_json(data), "application/json")

        def _send(self, body: str, content_type: str) -> None:
            payload = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True  # a browser's open connection never holds up Ctrl-C
    return server

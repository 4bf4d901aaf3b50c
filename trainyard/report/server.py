"""`trainyard ui`: the comparison page served from the store, built fresh on each request, so
a page left open follows running runs (it fetches /data.json every 2 s while one runs, and
again whenever it comes back into view)."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainyard.report.data import ReportData
from trainyard.report.page import data_json, render_page

log = logging.getLogger(__name__)

# Sent with every answer: the page is never framed, never sniffed as another type, and a
# link out of it carries no address back.
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def make_server(host: str, port: int, build: Callable[[], ReportData]) -> ThreadingHTTPServer:
    """A server on host:port (port 0: a free one, see `server.server_address`) whose handler
    calls `build` per request. Nothing else is served: no files, no directory listing, and
    nothing to a request addressed to another host name (see `own_hosts`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            if not _host_allowed(self.headers.get("Host"), allowed):
                # A DNS-rebinding page reaches this server under its own domain name: the
                # Host header is the one thing it cannot forge. No data, and why, in one line.
                self.send_error(421, "this server answers only to " + " or ".join(sorted(allowed)))
                return
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

        def end_headers(self) -> None:
            for name, value in SECURITY_HEADERS.items():  # errors too
                self.send_header(name, value)
            super().end_headers()

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True  # a browser's open connection never holds up Ctrl-C
    allowed = own_hosts(host, server.server_address[1])
    return server


def own_hosts(host: str, port: int) -> set[str]:
    """The Host header values a browser sends for this server: host:port as served, and
    localhost's names when it listens on loopback. On a wildcard address (0.0.0.0, ::) the
    machine's own names; IP literals are checked in `_host_allowed`."""
    names = {host}
    address = _ip(host)
    if address is not None and address.is_loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    if address is not None and address.is_unspecified:
        names |= {"localhost", socket.gethostname(), socket.getfqdn()}
    return {f"[{n}]:{port}" if ":" in n else f"{n}:{port}" for n in names}


def _host_allowed(header: str | None, allowed: set[str]) -> bool:
    if not header:
        return False
    header = header.strip().lower()
    if header in {a.lower() for a in allowed}:
        return True
    # Listening on every address: any IP literal of this server's port is its own (a
    # rebinding attack needs a domain name, never a bare address).
    wildcard = any(a.startswith(("0.0.0.0:", "[::]:")) for a in allowed)
    name, _, port = header.rpartition(":")
    return (
        wildcard
        and _ip(name.strip("[]")) is not None
        and any(a.endswith(f":{port}") for a in allowed)
    )


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None

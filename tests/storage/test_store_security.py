"""Only holders of the key pair reach the embedded store's data: every port it opens is tried
without credentials (plain HTTP, HTTPS without a client certificate, gRPC in plaintext and
over TLS without one), and everything under its home is its owner's alone."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import ssl
import stat
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest

from trainyard.storage import Store, StoreSettings
from trainyard.storage.embedded import HOST, PORT_FLAGS, EmbeddedS3
from trainyard.util.daemons import free_port, port_free

from conftest import trainyard_cli

SECRET = b'{"run": "the record only key holders may read"}'
FOLDER, NAME = "/buckets/trainyard/runs/r1", "run.json"
KEY = "runs/r1/run.json"
OLD_ADMIN_RANGE = range(55536, 65536)  # older installs drew admin ports here; +10000 overflows
# A TLS client that takes any server certificate and has none of its own to show.
_ANY_SERVER = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
_ANY_SERVER.check_hostname = False
_ANY_SERVER.verify_mode = ssl.CERT_NONE


@pytest.fixture(scope="module")
def secured():
    """A store started over an older install's home (0755 folders, 0644 files, an admin port
    above 55535), holding one object written through S3 with the key pair."""
    # The parent is open to everyone, so only the home's own modes can keep others out.
    parent = Path(tempfile.mkdtemp(prefix="trainyard-store-"))
    parent.chmod(0o755)
    home = parent / "s3"
    saved_ports = _an_older_install(home)
    server = EmbeddedS3(home)
    try:
        state = server.up()
        creds = server.credentials()
        settings = StoreSettings(
            "trainyard", "", state.endpoint, creds.access_key, creds.secret_key
        )
        fs = Store(settings).fs
        fs.mkdir("trainyard")
        fs.pipe(f"trainyard/{KEY}", SECRET)
        yield server, state, fs, saved_ports
    finally:
        server.down()
        shutil.rmtree(parent, ignore_errors=True)


def _an_older_install(home: Path) -> dict[str, int]:
    for folder in (home, home / "data", home / "logs"):
        folder.mkdir(parents=True)
        folder.chmod(0o755)
    (home / "weed.log").write_text("")
    (home / "weed.log").chmod(0o644)
    free = _free_ports(len(PORT_FLAGS) - 1)
    admin = next(p for p in OLD_ADMIN_RANGE if p not in free and port_free(HOST, p))
    ports = dict(zip(PORT_FLAGS[:-2], free, strict=False))
    ports |= {"admin.port": admin, "admin.port.grpc": free[-1]}
    (home / "ports.json").write_text(json.dumps(ports))
    (home / "ports.json").chmod(0o644)
    return ports


def test_no_port_answers_http_without_credentials(secured):
    server, state, fs, _ = secured
    fid = _chunk_file_id(state, server.home)  # the volume server's own name for the bytes
    for flag, port in state.ports.items():
        for tls in (False, True):
            tried = {
                "filer GET": _http(port, "GET", f"{FOLDER}/{NAME}", tls=tls),
                "S3 GET": _http(port, "GET", f"/trainyard/{KEY}", tls=tls),
                "volume GET": _http(port, "GET", f"/{fid}", tls=tls),
                "filer PUT": _http(port, "PUT", f"{FOLDER}/planted", b"planted", tls=tls),
                "S3 PUT": _http(port, "PUT", "/trainyard/runs/r1/planted", b"planted", tls=tls),
                "filer DELETE": _http(port, "DELETE", f"{FOLDER}/{NAME}", tls=tls),
                "S3 DELETE": _http(port, "DELETE", f"/trainyard/{KEY}", tls=tls),
                "volume DELETE": _http(port, "DELETE", f"/{fid}", tls=tls),
                "master assign": _http(port, "GET", "/dir/assign", tls=tls),
                "master collection delete": _http(
                    port, "GET", "/col/delete?collection=trainyard", tls=tls
                ),
            }
            for what, (status, body) in tried.items():
                assert status is None or not 200 <= status < 300, (flag, tls, what, status, body)
                assert SECRET not in body, (flag, tls, what)
    fs.invalidate_cache()
    assert fs.cat(f"trainyard/{KEY}") == SECRET
    assert fs.ls("trainyard/runs/r1", detail=False) == [f"trainyard/{KEY}"]


def test_no_grpc_port_serves_the_filer_without_the_store_certificate(secured):
    server, state, fs, _ = secured
    lookup = _message((1, FOLDER), (2, NAME))
    for tls in (False, True):
        # Over TLS, the client trusts the store's CA but shows no certificate of its own.
        credentials = grpc.ssl_channel_credentials(_ca(server)) if tls else None
        for flag, port in state.ports.items():
            for method in ("LookupDirectoryEntry", "DeleteEntry"):
                with pytest.raises(grpc.RpcError) as refused:
                    _filer_call(port, method, lookup, credentials)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (flag, tls, method)
    # The same request with the store's certificate is answered: the refusals above are
    # the certificate's doing, not a malformed probe.
    assert NAME.encode() in _filer_call(
        state.ports["filer.port.grpc"], "LookupDirectoryEntry", lookup, _store_tls(server.home)
    )
    fs.invalidate_cache()
    assert fs.cat(f"trainyard/{KEY}") == SECRET


def test_everything_under_the_home_is_the_owners_alone(secured):
    server, state, _, _ = secured
    home = server.home
    for folder, dirs, files in os.walk(home):
        for name in [".", *dirs]:
            assert _mode(Path(folder, name)) & 0o077 == 0, Path(folder, name)
        for name in files:
            path = Path(folder, name)
            # weed writes its small volume-info files 0644 whatever the umask; no data is in
            # them, and their 0700 folders keep them from others all the same.
            if not path.is_symlink() and path.suffix != ".vif":
                assert _mode(path) & 0o077 == 0, path
    assert list(home.glob("data/*.dat")), "the object's volume is under the home"
    for flag, port in state.ports.items():
        # weed's in-process gRPC sockets, named after their ports.
        for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
            assert _mode(sock) & 0o077 == 0, (flag, sock)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_account_cannot_read_the_store_files(secured):
    server, _, _, _ = secured
    control = server.home.parent / "readable.txt"
    control.write_text("anyone may read this")
    control.chmod(0o644)
    assert _as_nobody("cat", control).returncode == 0  # the probe itself works
    volume = next(server.home.glob("data/*.dat"))
    for target in (volume, server.home / "credentials.json", server.home / "security/key.pem"):
        assert _as_nobody("cat", target).returncode != 0, target
    assert _as_nobody("ls", server.home / "data").returncode != 0


def test_admin_ports_follow_weeds_plus_10000_rule_and_other_ports_are_kept(secured):
    _, state, _, saved = secured
    ports = state.ports
    assert ports["admin.port"] <= 55535
    assert ports["admin.port.grpc"] == ports["admin.port"] + 10000
    # The S3 endpoint (and every other saved port) stays, so .dvc/config.local stays valid.
    assert {f: p for f, p in ports.items() if not f.startswith("admin.")} == {
        f: p for f, p in saved.items() if not f.startswith("admin.")
    }


def _http(port: int, method: str, path: str, body: bytes | None = None, tls: bool = False):
    """(status, body) of one request without credentials; (None, b"") if refused outright.
    With `tls`, HTTPS that accepts any server certificate but offers none of its own."""
    conn: http.client.HTTPConnection
    if tls:
        conn = http.client.HTTPSConnection(HOST, port, timeout=5, context=_ANY_SERVER)
    else:
        conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


def _filer_call(port: int, method: str, request: bytes, credentials) -> bytes:
    target = f"{HOST}:{port}"
    with (
        grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    ) as channel:
        call = channel.unary_unary(f"/filer_pb.SeaweedFiler/{method}")
        return call(request, timeout=10)


def _chunk_file_id(state, home: Path) -> str:
    entry = _filer_call(
        state.ports["filer.port.grpc"],
        "LookupDirectoryEntry",
        _message((1, FOLDER), (2, NAME)),
        _store_tls(home),
    )
    found = re.search(rb"\d+,[0-9a-f]{8,}", entry)
    assert found, entry
    return found.group().decode()


def _message(*fields: tuple[int, str]) -> bytes:
    """A protobuf message of string fields (filer_pb's requests need nothing else)."""
    out = b""
    for number, text in fields:
        data = text.encode()
        out += bytes([number << 3 | 2, len(data)]) + data
    return out


def _store_tls(home: Path):
    """The client certificate the store's own components present (written at its start)."""
    folder = home / "security"
    return grpc.ssl_channel_credentials(
        (folder / "ca.pem").read_bytes(),
        (folder / "key.pem").read_bytes(),
        (folder / "cert.pem").read_bytes(),
    )


def _ca(server: EmbeddedS3) -> bytes:
    return (server.home / "security" / "ca.pem").read_bytes()


def _as_nobody(*command) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command], user="nobody", capture_output=True, check=False, timeout=30
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _free_ports(count: int) -> list[int]:
    """Ports an older install saved, out of the ephemeral range: the ones a start keeps."""
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port(HOST, taken=ports))
    return ports


def test_a_command_makes_the_projects_local_state_the_owners_alone(project):
    """Staged checkpoints, split copies of the data, the signing key and Prefect's database
    live under .trainyard/: a command closes it, also when an older one left it open."""
    state = project / ".trainyard"
    state.mkdir(exist_ok=True)
    state.chmod(0o755)
    shown = trainyard_cli("storage", "status", cwd=project)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700, shown.stdout + shown.stderr

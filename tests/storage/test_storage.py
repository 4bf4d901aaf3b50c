"""The embedded store is a real S3 server that refuses anyone without the installation's key."""

import shutil
import stat
from pathlib import Path

import pytest
import s3fs

from trainyard.config import StorageConfig, TrainyardConfig
from trainyard.errors import StoreError
from trainyard.project import ProjectPaths
from trainyard.storage import Store, StoreSettings
from trainyard.storage.embedded import EmbeddedS3
from trainyard.storage.store import ENDPOINT_ENV


def test_round_trip_and_listing(store):
    store.write_json("runs/a/run.json", {"x": 1})
    store.put_bytes("runs/b/run.json", b"{}")
    assert store.read_json("runs/a/run.json") == {"x": 1}
    assert store.list_dirs("runs") == ["a", "b"]
    assert store.uri("runs/a") == f"s3://trainyard/{store.settings.prefix}/runs/a"
    assert store.key_of(store.uri("runs/a/run.json")) == "runs/a/run.json"


@pytest.mark.parametrize("who", ["anonymous", "wrong secret"])
def test_requests_without_the_installation_key_are_refused(s3_server, store, who):
    store.put_bytes("private.txt", b"secret data")
    _, state = s3_server
    kwargs = (
        {"anon": True}
        if who == "anonymous"
        else {"key": s3_server[0].credentials().access_key, "secret": "nope"}
    )
    outsider = s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": state.endpoint}, skip_instance_cache=True, **kwargs
    )
    with pytest.raises(PermissionError):
        outsider.cat_file(f"trainyard/{store.settings.prefix}/private.txt")


def test_credentials_are_private_and_server_listens_on_loopback_only(s3_server):
    server, state = s3_server
    assert stat.S_IMODE((server.home / "credentials.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((server.home / "identities.json").stat().st_mode) == 0o600
    listening = {
        line.split()[1]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if line.split()[3] == "0A"
    }
    ports = {f"{p:04X}" for p in state.ports.values()}
    ours = {addr for addr in listening if addr.split(":")[1] in ports}
    assert ours and all(addr.startswith("0100007F:") for addr in ours), ours  # 127.0.0.1


def test_up_is_idempotent_and_down_stops(tmp_path):
    server = EmbeddedS3(tmp_path / "s3")
    first = server.up()
    try:
        assert server.up() == first
        assert server.status() == first
    finally:
        assert server.down() is True
    assert server.status() is None
    assert server.down() is False


def test_a_flow_process_connects_once_and_again_after_the_store_was_wiped(tmp_path, monkeypatch):
    from tasks.storage import open_store

    monkeypatch.delenv(ENDPOINT_ENV, raising=False)  # the project's own embedded store
    paths = ProjectPaths(tmp_path)
    config = TrainyardConfig()
    server = EmbeddedS3(paths.s3_server)
    try:
        first = open_store(config, paths)
        assert open_store(config, paths) is first
        server.down()  # `trainyard storage down`, then up
        same_ports = server.up().endpoint == first.settings.endpoint_url  # reused when free
        restarted = open_store(config, paths)
        assert (restarted is first) == same_ports
        restarted.write_json("k.json", {})
        server.down()
        shutil.rmtree(paths.s3_server / "data")  # the bucket is gone: connect again, create it
        again = open_store(config, paths)
        assert again is not restarted and not again.exists("k.json")
    finally:
        server.down()


def test_wrong_credentials_fail_with_a_clear_line_without_the_secret(s3_server):
    _, state = s3_server
    bad = Store(StoreSettings("trainyard", "", state.endpoint, "AKWRONG", "sentinel-secret-123"))
    with pytest.raises(
        StoreError, match=r"access to bucket 'trainyard' at http://127\.0\.0\.1:\d+ was denied"
    ) as info:
        bad.check()
    assert "sentinel-secret-123" not in str(info.value)
    assert "sentinel-secret-123" not in repr(bad.settings)


def test_missing_bucket_and_unreachable_endpoint(s3_server):
    server, state = s3_server
    creds = server.credentials()
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' not found"):
        Store(
            StoreSettings("no-such-bucket", "", state.endpoint, creds.access_key, creds.secret_key)
        ).check()
    with pytest.raises(
        StoreError, match=r"cannot reach the artifact store at http://127\.0\.0\.1:9"
    ):
        Store(StoreSettings("trainyard", "", "http://127.0.0.1:9", "a", "b")).check()


def test_storage_config_rejects_bucket_names_s3_would(monkeypatch):
    with pytest.raises(ValueError, match="S3 bucket name"):
        StorageConfig(bucket="UPPER")


def test_recent_keeps_only_the_most_recently_put_values():
    from trainyard.util.recent import Recent

    recent: Recent[str, int] = Recent(keep=2)
    recent.put("a", 1)
    recent.put("b", 2)
    recent.put("a", 3)  # put again: now the most recent
    recent.put("c", 4)
    assert (recent.get("a"), recent.get("b"), recent.get("c")) == (3, None, 4)

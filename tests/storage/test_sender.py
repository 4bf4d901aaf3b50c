"""Large checkpoint files upload from a child process (trainyard.storage.sender), against the
real store: same bytes, the same errors an in-process upload raises, a dead child replaced."""

import os
import signal
import socket
import sys
import threading

import pytest
import torch

from trainyard.checkpoint.layout import STATE_FILE
from trainyard.checkpoint.reader import load_checkpoint
from trainyard.checkpoint.writer import CheckpointWriter
from trainyard.errors import StoreError
from trainyard.storage import Store, StoreSettings
from trainyard.storage.sender import SENDER_MIN_BYTES, FileSender

from tests_support import manifest_fields


@pytest.fixture
def sender(store_settings):
    sender = FileSender(Store(store_settings))
    yield sender
    sender.close()


def test_a_file_sent_from_the_child_process_arrives_byte_for_byte(store, sender, tmp_path):
    local = tmp_path / "blob"
    local.write_bytes(os.urandom(SENDER_MIN_BYTES + 123))
    sender.put_file(local, "sent/blob")
    assert store.get_bytes("sent/blob") == local.read_bytes()
    child = sender._process
    assert child is not None and child.pid != os.getpid() and child.poll() is None
    sender.close()
    assert child.poll() is not None  # closed: the child ended with its input


def test_small_files_are_put_in_process_and_large_ones_from_the_child(store, sender, tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(b"s" * 1000)
    large.write_bytes(os.urandom(SENDER_MIN_BYTES))
    sender.send(small, "routed/small")
    assert sender._process is None and store.get_bytes("routed/small") == small.read_bytes()
    sender.send(large, "routed/large")
    assert sender._process is not None and store.get_bytes("routed/large") == large.read_bytes()


def test_a_refused_upload_raises_permission_error_and_a_down_store_os_error(
    store_settings, tmp_path
):
    local = tmp_path / "blob"
    local.write_bytes(b"x" * 1000)
    wrong = StoreSettings(
        store_settings.bucket, "p", store_settings.endpoint_url, "nobody", "wrong-secret"
    )
    refused = FileSender(Store(wrong))
    with socket.socket() as s:  # a loopback port nobody listens on: the store is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = FileSender(Store(StoreSettings("trainyard", "p", f"http://127.0.0.1:{port}", "k", "s")))
    try:
        with pytest.raises(PermissionError, match="PermissionError") as refusal:
            refused.put_file(local, "refused/blob")
        assert "wrong-secret" not in str(refusal.value)
        with pytest.raises(OSError) as raised:  # retried by the writer, as a transient error
            down.put_file(local, "down/blob")
        assert not isinstance(raised.value, PermissionError | FileNotFoundError)
    finally:
        refused.close()
        down.close()


def test_an_upload_process_killed_mid_upload_is_an_os_error(tmp_path):
    """The child hangs on a store that accepts the connection and never answers; killed
    there, its owner gets an OSError (transient: the writer retries) instead of waiting."""
    local = tmp_path / "blob"
    local.write_bytes(b"x" * 1000)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)  # the test fails, not hangs, if the child never connects
        port = silent.getsockname()[1]
        sender = FileSender(
            Store(StoreSettings("trainyard", "p", f"http://127.0.0.1:{port}", "k", "s"))
        )

        def kill_once_connected():
            connection, _ = silent.accept()  # the child is inside its upload
            sender._process.send_signal(signal.SIGKILL)
            connection.close()

        killer = threading.Thread(target=kill_once_connected)
        killer.start()
        with pytest.raises(OSError, match="upload process exited"):
            sender.put_file(local, "k/blob")
        killer.join()
        sender.close()


def test_an_upload_process_that_cannot_start_fails_the_upload_instead_of_retrying(
    store_settings, tmp_path, monkeypatch
):
    local = tmp_path / "blob"
    local.write_bytes(b"x")
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a child that exits at once
    sender = FileSender(Store(store_settings))
    with pytest.raises(StoreError, match=r"exited \(code 1\) before its first reply"):
        sender.put_file(local, "k/blob")
    sender.close()
    with pytest.raises(OSError, match="closed"):  # and a closed sender starts none again
        sender.put_file(local, "k/blob")


def test_a_dead_upload_process_is_replaced_at_the_next_upload(store, sender, tmp_path):
    local = tmp_path / "blob"
    local.write_bytes(b"first")
    sender.put_file(local, "k/first")
    first = sender._process
    first.kill()
    first.wait()
    local.write_bytes(b"second")
    sender.put_file(local, "k/second")
    assert sender._process.pid != first.pid and store.get_bytes("k/second") == b"second"


def test_a_large_checkpoint_commits_through_the_upload_process_and_loads_verified(store, tmp_path):
    writer = CheckpointWriter(store, "big", tmp_path / "staging")
    weights = torch.randn(SENDER_MIN_BYTES // 4 + 1024)
    uri = writer.save(3, {"model": {"w": weights}}, manifest_fields())
    child = None
    while writer.staged_steps():
        child = writer._sender._process or child
        threading.Event().wait(0.01)
    writer.close()
    loaded, manifest = load_checkpoint(store, uri)
    assert torch.equal(loaded["model"]["w"], weights)
    assert manifest.files[STATE_FILE].size > SENDER_MIN_BYTES
    assert child is not None and child.poll() is not None  # it uploaded, and close() ended it

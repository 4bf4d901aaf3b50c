"""Shared fixtures: a real SeaweedFS server for the session, isolated projects, Comet offline."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from file_order import Durations, longest_first

from trainyard.cli.prefect_server import PrefectServer
from trainyard.storage import Store, StoreSettings
from trainyard.storage.embedded import EmbeddedS3
from trainyard.storage.store import ENDPOINT_ENV

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pytest_configure(config):
    """Prefect reads its home when first imported: give the session its own, before collection."""
    home = Path(tempfile.mkdtemp(prefix="trainyard-prefect-"))
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    # One checkpoint signing key for the session: checkpoints written by a project's CLI
    # are loaded by tests running elsewhere (trainyard.checkpoint.signing).
    keys = Path(tempfile.mkdtemp(prefix="trainyard-keys-"))
    os.environ["TRAINYARD_SIGNING_KEY_FILE"] = str(keys / "signing.key")
    out = os.environ.get("TRAINYARD_FILE_DURATIONS")
    if out and not hasattr(config, "workerinput"):  # xdist's controller: every report
        _recorded.append(Durations(Path(out)))


_recorded: list[Durations] = []  # one, where the session records its files' seconds


def pytest_collection_modifyitems(items):
    longest_first(items)


def pytest_runtest_logreport(report):
    for durations in _recorded:
        durations.add(report)


def pytest_sessionfinish():
    for durations in _recorded:
        durations.write()


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No test may reach Comet's servers or the developer's own store and Prefect profile."""
    for name in (
        "COMET_API_KEY",
        "PREFECT_API_URL",
        ENDPOINT_ENV,
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session", autouse=True)
def session_prefect_server() -> Iterator[Callable[[], str]]:
    """The session's Prefect server, the one a project's commands start and reuse, with its
    home the session's PREFECT_HOME: every `trainyard` command of the session finds it
    there. Started in the background at once (a command that needs it meanwhile waits on
    its lock, and finds it up); stopped at the end. Yields a function returning its API URL."""
    server = PrefectServer(Path(os.environ["PREFECT_HOME"]))
    started: list[str] = []
    starting = threading.Thread(target=lambda: started.append(server.up()[0].api_url))
    starting.start()

    def api_url() -> str:
        starting.join()
        assert started, f"the session's Prefect server did not start; see {server.log_file}"
        return started[0]

    yield api_url
    starting.join()
    server.down()


@pytest.fixture(scope="session")
def prefect_api(session_prefect_server):
    """Flows run in this process report to the session's Prefect server."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: session_prefect_server()}),
        # Threads (a sweep's trials) see the global context, not the calling one's.
        prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
    ):
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real embedded S3 server (SeaweedFS) for the whole session, on free loopback ports."""
    server = EmbeddedS3(tmp_path_factory.mktemp("s3"))
    state = server.up()
    creds = server.credentials()
    settings = StoreSettings("trainyard", "", state.endpoint, creds.access_key, creds.secret_key)
    Store(settings).fs.mkdir("trainyard")  # the bucket a user's store already has
    yield server, state
    server.down()


@contextlib.contextmanager
def own_store_project(
    tmp_path_factory, s3_server, prefix: str
) -> Iterator[tuple[Path, StoreSettings]]:
    """A project with its own prefix in the session's store, and the store's credentials (and
    no Comet key) in the environment while the context lasts: for module-scoped fixtures,
    which cannot use the function-scoped `project`."""
    server, state = s3_server
    creds = server.credentials()
    settings = StoreSettings(
        "trainyard", prefix, state.endpoint, creds.access_key, creds.secret_key
    )
    root = make_project(tmp_path_factory.mktemp(prefix) / "project", settings)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in settings.worker_env().items():
            mp.setenv(name, value)
        mp.delenv("COMET_API_KEY", raising=False)
        yield root, settings


@pytest.fixture
def store_settings(s3_server) -> StoreSettings:
    server, state = s3_server
    creds = server.credentials()
    settings = StoreSettings(
        "trainyard",
        f"test-{uuid.uuid4().hex[:8]}",
        state.endpoint,
        creds.access_key,
        creds.secret_key,
    )
    return settings


@pytest.fixture
def store(store_settings) -> Store:
    return Store(store_settings)


@pytest.fixture
def use_store(monkeypatch, store_settings):
    """Point trainyard (and DVC) at the session's server, as a user points it at real S3."""
    for name, value in store_settings.worker_env().items():
        monkeypatch.setenv(name, value)
    return store_settings


def make_project(root: Path, settings: StoreSettings | None = None) -> Path:
    """A fresh project checkout: git repo, DVC repo, the repo's params.yaml and dvc.yaml."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("params.yaml", "dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    # dvc.yaml names engine sources as stage dependencies.
    shutil.copytree(
        REPO / "trainyard", root / "trainyard", ignore=shutil.ignore_patterns("__pycache__")
    )
    (root / ".dvc").mkdir()
    shutil.copy(REPO / ".dvc" / "config", root / ".dvc" / "config")
    shutil.copy(REPO / ".dvc" / ".gitignore", root / ".dvc" / ".gitignore")
    # Every epoch's checkpoint, whatever the machine's speed: tests count them. The
    # default's skipping of epochs the store cannot keep up with has its own test.
    text = re.sub(r"max_overhead: [\d.]+", "max_overhead: null", (root / "params.yaml").read_text())
    if settings is not None and settings.prefix:
        text = text.replace('prefix: ""', f'prefix: "{settings.prefix}"')
    (root / "params.yaml").write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=root, check=True)
    return root


@pytest.fixture
def project(tmp_path, monkeypatch, use_store) -> Path:
    root = make_project(tmp_path / "project", use_store)
    monkeypatch.chdir(root)
    return root


def trainyard_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainyard"), *args],
        cwd=cwd,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )


def prefect_artifacts(key: str) -> list[dict]:
    """Every version of the Prefect artifact `key`, newest first, through the REST API (the
    sync client sends nulls the server refuses)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        response = client._client.post(
            "/artifacts/filter",
            json={"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 50},
        )
    response.raise_for_status()
    return response.json()


@contextlib.contextmanager
def headless_chromium(host_rules: str, *flags: str, browser_log: bool = False):
    """Debian's headless chromium (`make browser` installs it) driven by selenium, resolving
    host names by `host_rules` and through no proxy; skips the test where it is missing."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip("needs Debian's chromium and chromium-driver: run `make browser`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--host-resolver-rules={host_rules}",
        "--no-proxy-server",
        *flags,
    ):
        options.add_argument(flag)
    if browser_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        yield driver
    finally:
        driver.quit()

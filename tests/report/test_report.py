"""The comparison page on the real store: the data document, the self-contained file, the
`trainyard ui` server, and the page itself in a real (headless, offline) chromium."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from fake_runs import fake_run

from trainyard import registry
from trainyard.config import TrainyardConfig
from trainyard.report.data import RecordCache, build_report_data
from trainyard.report.page import render_page
from trainyard.runs.record import (
    RankLanes,
    RunRecord,
    Straggler,
    SweepTrial,
    load_record,
    save_record,
)
from trainyard.storage import Store
from trainyard.sweeps.record import SweepRecord, save_sweep

from conftest import BIN, headless_chromium, trainyard_cli

TESTS = str(Path(__file__).parents[1])
SECRET_KEY = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYSECRETKEY"
ACCESS_KEY = "AKIAREPORTTESTACCESS"
REMOTE_REF = re.compile(
    r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=\s*['\"]?(https?:)?//", re.I
)


def history(epochs: int, start: float) -> list[dict[str, float]]:
    """Per-epoch rows as the training loop writes them (timings and rows included)."""
    return [
        {
            "epoch": e,
            "train_loss": start / e,
            "val_loss": start / e + 0.05,
            "val_accuracy": 1 - start / (e + 1),
            "rows": 100,
            "train_s": 0.5,
            "data_wait_s": 0.01,
        }
        for e in range(1, epochs + 1)
    ]


def params(lr: float) -> dict:
    """A run's params as the flows record them: the whole validated config."""
    config = TrainyardConfig().model_dump(mode="json")
    config["train"]["lr"] = lr
    return config


def enrich(store: Store, record: RunRecord, lr: float, start: float, **extra) -> RunRecord:
    """A fake run made realistic: full params, a per-epoch history, timings."""
    record = record.model_copy(
        update={
            "params": params(lr),
            "history": history(5, start),
            "timings_s": {"train": 12.5},
            "world_size": 2,
            **extra,
        }
    )
    save_record(store, record)
    return record


def make_sweep(store: Store, tmp_path: Path, run_ids: list[str]) -> SweepRecord:
    """A sweep whose study (a journal file) has one completed trial per run, and one pruned."""
    journal = str(tmp_path / "optuna-journal.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
    study = optuna.create_study(study_name="trainyard-sw1", storage=storage, direction="maximize")
    for n, run_id in enumerate([*run_ids, None]):
        trial = study.ask(
            {
                "train.lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True),
                "model.name": optuna.distributions.CategoricalDistribution(["mlp", "linear"]),
            }
        )
        trial.set_user_attr("run_id", run_id)
        if run_id is None:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, 0.8 + n / 100)
    record = SweepRecord(
        sweep_id="sw1",
        study_name="trainyard-sw1",
        storage=journal,
        direction="maximize",
        objective="val_accuracy",
        created_at="2026-11-20T10:00:00+00:00",
        dataset_path="data/raw/digits.csv",
        dataset_md5="md5-digits",
        code={"git_commit": "c0ffee", "git_dirty": False},
        params=params(0.01),
    )
    save_sweep(store, record)
    return record


def two_rank_lanes(windows: int) -> dict:
    """A 2-worker run's lanes in windows of 10 steps, rank 1 three times as slow from step 500
    to 1000, and a restart at step 700, in the record's fields (made by hand: a real restart's
    lanes would start at 700, the last launch's)."""
    steps = [10 * (w + 1) for w in range(windows)]
    return {
        "rank_lanes": RankLanes(
            window_steps=10,
            steps=steps,
            own_step_ms=[[2.0, 6.0 if 500 <= s <= 1000 else 2.0] for s in steps],
            data_wait_ms=[[0.1, 0.2] for _ in steps],
        ),
        "stragglers": [
            Straggler(
                rank=1,
                first_step=491,
                last_step=1000,
                windows=51,
                median_step_ms=6.0,
                ranks_median_step_ms=2.0,
                slowdown=3.0,
            )
        ],  # fmt: skip
        "resumes": [{"attempt": 1, "from_step": 700, "steps_redone": 3, "resumed_at": 1.0}],
    }


@pytest.fixture
def filled(store, tmp_path) -> Store:
    """Three runs with curves (two of them a sweep's trials, the third trained on two ranks
    with a straggler and a restart), model "digits" with two versions, champion promoted twice
    and rolled back once."""
    for n, (lr, start) in enumerate(((0.01, 1.0), (0.05, 0.8), (0.1, 1.2)), start=1):
        trial = SweepTrial(sweep_id="sw1", study_name="trainyard-sw1", trial=n - 1)
        record = fake_run(store, f"run-{n}", 0.90 + n / 100)
        when = f"2026-11-2{n}T10:00:00+00:00"
        ranks = two_rank_lanes(200) if n == 3 else {}
        enrich(store, record, lr, start, sweep=trial if n < 3 else None, created_at=when, **ranks)
    make_sweep(store, tmp_path, ["run-1", "run-2"])
    for n in (1, 2):
        registry.register(store, f"run-{n}", "digits", by="tester")
    registry.promote(store, "digits", 1, by="tester")
    registry.promote(store, "digits", 2, by="tester")
    registry.rollback(store, "digits", by="tester")
    registry.promote(store, "digits", 2, alias="challenger", by="tester")
    return store


def test_the_report_holds_every_run_curves_registry_and_sweeps_and_nothing_remote(
    filled, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    data = build_report_data(filled)
    page = render_page(data)

    assert [r.run_id for r in data.runs] == ["run-3", "run-2", "run-1"]  # newest first
    for run_id in ("run-1", "run-2", "run-3"):
        assert run_id in page
    run1 = data.runs[2]
    assert run1.curves["epoch"] == [1, 2, 3, 4, 5]
    assert set(run1.curves) == {"epoch", "train_loss", "val_loss", "val_accuracy"}  # no timings
    assert run1.params["train.lr"] == 0.01 and run1.sweep_id == "sw1" and run1.trial == 0
    assert not any(key.startswith("storage.") for key in run1.params)  # where, not what
    embedded = json.loads(re.search(r'id="trainyard-data"[^>]*>(.*?)</script>', page, re.S)[1])
    assert embedded["runs"][2]["curves"]["val_loss"] == pytest.approx(
        [1.05, 0.55, 0.3833, 0.3, 0.25], abs=1e-3
    )
    assert embedded["runs"][1]["curves"]["train_loss"][0] == 0.8
    run3 = data.runs[0]  # 200 lanes windows of 10 steps: coarser, twice, in the page
    assert run3.lanes.window_steps == 40 and len(run3.lanes.steps) == 50
    assert run3.lanes.steps[-1] == 2000 and run3.lanes.own_step_ms[20] == [2.0, 6.0]
    assert [s.rank for s in run3.stragglers] == [1]
    assert run3.resumes == [{"step": 700, "label": "resumed from step 700 (restart 1)"}]
    assert run1.lanes is None and run1.stragglers == [] and run1.resumes == []

    (model,) = data.models
    assert model.aliases == {"champion": 1, "challenger": 2}
    assert [v.version for v in model.versions] == [1, 2]
    assert [(h.action, h.to_version) for h in model.history] == [
        ("promote", 1),
        ("promote", 2),
        ("rollback", 1),
        ("promote", 2),
    ]
    assert model.history[1].evidence["from_value"] == pytest.approx(0.91)

    (sweep,) = data.sweeps
    assert [t.state for t in sweep.trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert sweep.best["run_id"] == "run-2" and "storage" not in sweep.model_dump()

    assert not REMOTE_REF.search(page), REMOTE_REF.search(page)
    for secret in (SECRET_KEY, ACCESS_KEY, filled.settings.secret_key, filled.settings.access_key):
        assert secret not in page


def test_a_url_password_in_the_params_never_reaches_the_page(store):
    record = fake_run(store, "run-pw", 0.9)
    config = params(0.01)
    config["tracking"]["note"] = "see https://bob:hunter2@example.invalid/x"
    save_record(store, record.model_copy(update={"params": config}))
    row = build_report_data(store).runs[0]
    assert row.params["tracking.note"] == "see https://example.invalid/x"
    assert "hunter2" not in render_page(build_report_data(store))


def test_report_command_writes_the_named_runs_and_refuses_unknown_ones(project, store, tmp_path):
    for n in (1, 2):
        enrich(store, fake_run(store, f"run-{n}", 0.9), 0.01, 1.0)
    done = trainyard_cli("report", "run-1", "-o", str(tmp_path / "one.html"), cwd=project)
    assert done.returncode == 0, done.stderr
    data = json.loads(
        re.search(
            r'id="trainyard-data"[^>]*>(.*?)</script>', (tmp_path / "one.html").read_text(), re.S
        )[1]
    )
    assert [r["run_id"] for r in data["runs"]] == ["run-1"]

    done = trainyard_cli("report", "run-1", "nope-7", "-o", str(tmp_path / "x.html"), cwd=project)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "no run 'nope-7'" in done.stderr and not (tmp_path / "x.html").exists()
    done = trainyard_cli(
        "report", "--sweep", "nosweep", "-o", str(tmp_path / "x.html"), cwd=project
    )
    assert done.returncode == 2 and "no sweep 'nosweep'" in done.stderr
    done = trainyard_cli("report", "-o", str(tmp_path / "x.txt"), cwd=project)
    assert done.returncode == 2 and "name an .html file" in done.stderr
    done = trainyard_cli("ui", "--port", "0", "run-1", "nope-7", cwd=project)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "no run 'nope-7'" in done.stderr


def test_the_ui_reads_again_only_the_records_written_since(store):
    for n in (1, 2, 3):
        enrich(store, fake_run(store, f"run-c{n}", 0.9), 0.01, 1.0, created_at=f"2026-11-2{n}")
    cache = RecordCache(store)
    first = build_report_data(store, cache=cache)
    assert [r.run_id for r in first.runs] == ["run-c3", "run-c2", "run-c1"]
    assert cache.last_reads == 3
    assert build_report_data(store, cache=cache).runs == first.runs and cache.last_reads == 0

    changed = load_record(store, "run-c2")
    changed.metrics["test_accuracy"] = 0.5
    save_record(store, changed)
    store.delete("runs/run-c3", recursive=True)
    enrich(store, fake_run(store, "run-c4", 0.9), 0.01, 1.0, created_at="2026-11-24")
    third = build_report_data(store, cache=cache)
    assert cache.last_reads == 2  # run-c2 written again, run-c4 new
    assert [r.run_id for r in third.runs] == ["run-c4", "run-c2", "run-c1"]
    assert third.runs[1].metrics["test_accuracy"] == 0.5
    assert third.runs == build_report_data(store).runs  # what a fresh read finds


@contextlib.contextmanager
def served_ui(project: Path, *run_ids: str) -> Iterator[str]:
    """`trainyard ui --port 0 [RUN_ID...]` until the block ends (then Ctrl-C, which must stop
    it cleanly): its URL."""
    # Started as a terminal starts it, whatever this process inherited: a shell starts a
    # background job with SIGINT ignored, the children keep ignoring it, and Python then
    # installs no KeyboardInterrupt (a fresh-clone suite run as one never stopped the ui).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [str(BIN / "trainyard"), "ui", "--port", "0", *run_ids],
            cwd=project,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert proc.stdout is not None and proc.stderr is not None  # both piped
    try:
        line = proc.stdout.readline()  # "serving the comparison page at http://127.0.0.1:P/"
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        yield url[0]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # reading its output while it stops
        assert proc.returncode == 0, err[-3000:]


def test_ui_serves_the_page_and_its_data_until_stopped(project, store):
    enrich(store, fake_run(store, "run-ui-1", 0.9), 0.01, 1.0)
    with served_ui(project) as url:
        with urllib.request.urlopen(url, timeout=30) as reply:
            page = reply.read().decode()
        assert "run-ui-1" in page and "Plotly" in page
        with urllib.request.urlopen(url + "data.json", timeout=30) as reply:
            assert reply.headers["Content-Type"] == "application/json"
            assert [r["run_id"] for r in json.loads(reply.read())["runs"]] == ["run-ui-1"]
        enrich(store, fake_run(store, "run-ui-2", 0.9), 0.01, 1.0)  # built fresh per request
        with urllib.request.urlopen(url + "data.json", timeout=30) as reply:
            assert {r["run_id"] for r in json.loads(reply.read())["runs"]} == {
                "run-ui-1",
                "run-ui-2",
            }
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "etc/passwd", timeout=30)


@pytest.fixture
def offline_chromium():
    """Debian's headless chromium with no way to the network: every host name resolves to
    nothing, no proxy, and the network emulated as offline."""
    with headless_chromium(
        "MAP * ~NOTFOUND", "--window-size=1400,1000", browser_log=True
    ) as driver:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.emulateNetworkConditions",
            {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
        )
        yield driver


def screenshot(driver, name: str) -> None:
    folder = os.environ.get("TRAINYARD_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def check_rank_lanes(driver) -> None:
    """run-3 trained on two ranks: its lanes, the straggler shaded, the restart dashed."""
    from selenium.webdriver.common.by import By

    pick = driver.find_element(By.CSS_SELECTOR, "input.pick[data-run='run-3']")
    # Clear of the table's sticky header, wherever the page was scrolled to.
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", pick)
    pick.click()
    lanes = driver.execute_script(
        "const el = document.querySelector('#lanes-plots .lane-plot[data-run=\"run-3\"]');"
        "return {names: el.data.map((t) => t.name), shapes: el.layout.shapes.map((s) => "
        "[s.type, s.x0, s.x1]), notes: el.layout.annotations.map((a) => a.text)}"
    )
    assert set(lanes["names"]) == {"rank 0", "rank 1"}
    assert lanes["shapes"] == [["rect", 491, 1000], ["line", 700, 700]]
    assert lanes["notes"] == [
        "straggler: rank 1, 3× the others",
        "resumed from step 700 (restart 1)",
    ]
    driver.execute_script("document.getElementById('lanes-panel').scrollIntoView()")
    screenshot(driver, "2b-ranks")


def test_the_page_works_offline_in_a_real_browser(filled, tmp_path, offline_chromium):
    from selenium.webdriver.common.by import By

    driver = offline_chromium
    target = tmp_path / "report.html"
    target.write_text(render_page(build_report_data(filled)))
    driver.get(target.as_uri())
    table_ids = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#runs-table td.run-id")]
    assert table_ids == ["run-3", "run-2", "run-1"]
    paint = driver.execute_script(
        "return performance.getEntriesByName('trainyard-first-render')[0].startTime"
    )
    print(f"\nfirst render of 3 runs: {paint:.0f} ms after navigation start")

    for run_id in ("run-1", "run-2"):
        driver.find_element(By.CSS_SELECTOR, f"input.pick[data-run='{run_id}']").click()
    names = driver.execute_script(
        "return document.getElementById('curves-plot').data.map((t) => t.name)"
    )
    assert len(names) >= 2
    assert any("run-1" in n for n in names) and any("run-2" in n for n in names)
    assert "run-1 val_loss" in names and "run-2 train_loss" in names
    screenshot(driver, "1-runs")
    driver.execute_script("document.getElementById('curves-panel').scrollIntoView()")
    screenshot(driver, "2-curves")

    check_rank_lanes(driver)

    driver.find_element(By.CSS_SELECTOR, "#tabs button[data-view='compare']").click()
    differing = driver.find_elements(By.CSS_SELECTOR, "#compare-table tr.diff td:first-child")
    assert {"train.lr", "test_accuracy"} <= {e.text for e in differing}
    screenshot(driver, "3-compare")
    driver.find_element(By.CSS_SELECTOR, "#tabs button[data-view='registry']").click()
    assert "champion → v1" in driver.find_element(By.ID, "view-registry").text
    screenshot(driver, "4-registry")
    driver.find_element(By.CSS_SELECTOR, "#tabs button[data-view='sweeps']").click()
    assert (
        driver.execute_script("return document.getElementById('sweep-parcoords').data[0].type")
        == "parcoords"
    )
    screenshot(driver, "5-sweeps")

    remote = driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
        ".filter((n) => !n.startsWith('file:') && !n.startsWith('data:'))"
    )
    assert remote == []
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []


def test_a_link_opens_the_page_on_its_runs_or_its_sweep(filled, tmp_path, offline_chromium):
    """What a run's and a sweep's Prefect artifacts link to: #runs=... selects those runs
    (an unknown id is left out) and draws their curves; #sweep=ID opens that sweep."""
    from selenium.webdriver.common.by import By

    driver = offline_chromium
    target = tmp_path / "report.html"
    target.write_text(render_page(build_report_data(filled)))
    driver.get(target.as_uri() + "#runs=run-1,run-3,no-such-run")
    assert driver.find_element(By.ID, "selection").text.startswith("2 selected: run-1, run-3")
    names = driver.execute_script(
        "return document.getElementById('curves-plot').data.map((t) => t.name)"
    )
    assert any("run-1" in n for n in names) and any("run-3" in n for n in names)
    assert not any("run-2" in n for n in names)
    ticked = driver.find_elements(By.CSS_SELECTOR, "input.pick:checked")
    assert sorted(e.get_attribute("data-run") for e in ticked) == ["run-1", "run-3"]

    driver.get("about:blank")
    driver.get(target.as_uri() + "#sweep=sw1")
    assert driver.find_element(By.ID, "view-sweeps").is_displayed()
    assert not driver.find_element(By.ID, "view-runs").is_displayed()
    assert driver.execute_script("return document.getElementById('sweep-select').value") == "sw1"
    assert "2 complete, 1 pruned" in driver.find_element(By.ID, "sweep-summary").text


@pytest.fixture
def local_chromium():
    """Headless chromium that reaches 127.0.0.1 (`trainyard ui`) and no other address."""
    with headless_chromium(
        "MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--window-size=1400,1000", browser_log=True
    ) as driver:
        yield driver


def _start_slow_run(project: Path, run_id: str) -> subprocess.Popen:
    """A real `trainyard run` that takes minutes (0.01 s a step, 400 epochs), one worker, in
    a process group of its own, as a terminal would start it."""
    settings = {
        "model.name": "tests_support:slow_mlp",
        "model.options": "{seconds: 0.01}",
        "train.epochs": "400",
        "train.workers": "1",
        "tracking.backend": "none",
    }
    return subprocess.Popen(
        [str(BIN / "trainyard"), "run", "--run-id", run_id]
        + [arg for name, value in settings.items() for arg in ("-S", f"{name}={value}")],
        cwd=project,
        env=dict(os.environ, PYTHONPATH=TESTS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _points(driver, trace: str) -> int:
    """How many epochs the curves plot draws for `trace` (0: not drawn)."""
    return driver.execute_script(
        "const el = document.getElementById('curves-plot');"
        "const t = (el.data || []).find((t) => t.name === arguments[0]);"
        "return t ? t.x.length : 0",
        trace,
    )


def _loss_axis(driver) -> str:
    """The type of the y axis the train_loss curve is drawn on."""
    return driver.execute_script(
        "const el = document.getElementById('curves-plot');"
        "const t = el.data.find((t) => t.name.endsWith(' train_loss'));"
        "return el._fullLayout['yaxis' + t.yaxis.slice(1)].type"
    )


def test_the_ui_follows_a_running_run_and_draws_losses_on_a_log_axis(
    project, store, local_chromium
):
    """A real run, ticked in `trainyard ui` while it trains: its curve grows as its epochs
    end, losses on a log axis that a tick switches off (and the page remembers); once the
    run stops, the page stops fetching."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = local_chromium
    run = _start_slow_run(project, "live-1")
    try:
        with served_ui(project) as url:  # started while the run starts
            wait = WebDriverWait(driver, 300, poll_frequency=0.2)
            wait.until(lambda _: run.poll() is not None or store.exists("runs/live-1/run.json"))
            assert run.poll() is None, run.communicate()[1][-3000:]
            driver.get(url)
            # Clicked in the page's own task: a refresh cannot redraw the table mid-click.
            driver.execute_script("document.querySelector('input.pick[data-run=live-1]').click()")
            assert driver.find_element(By.ID, "selection").text.startswith("1 selected: live-1")
            wait.until(lambda d: _points(d, "live-1 train_loss") >= 1 or run.poll() is not None)
            first = _points(driver, "live-1 train_loss")
            assert first >= 1, run.communicate()[1][-3000:]
            status = driver.find_element(By.CSS_SELECTOR, "tr[data-run='live-1'] td:nth-child(3)")
            assert re.fullmatch(r"running epoch \d+/400", status.text), status.text
            wait.until(lambda d: _points(d, "live-1 train_loss") > first)
            screenshot(driver, "6-live-curves")

            assert _loss_axis(driver) == "log"  # the default
            driver.find_element(By.ID, "log-losses").click()
            assert _loss_axis(driver) == "linear"
            driver.get(url + "#runs=live-1")
            assert not driver.find_element(By.ID, "log-losses").is_selected()
            assert _loss_axis(driver) == "linear"

            run.send_signal(signal.SIGINT)  # Ctrl-C: the run stops, its record says so
            wait.until(lambda d: d.execute_script("return DATA.runs[0].status") != "running")
            assert driver.execute_script("return live.timer") is None  # no more fetches
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.communicate(timeout=60)


def test_report_of_two_runs_opens_with_both_ticked(project, store, tmp_path, offline_chromium):
    from selenium.webdriver.common.by import By

    for n in (1, 2, 3):
        enrich(store, fake_run(store, f"run-{n}", 0.9), 0.01, 1.0 + n / 10)
    done = trainyard_cli("report", "run-2", "run-1", "-o", str(tmp_path / "two.html"), cwd=project)
    assert done.returncode == 0, done.stderr
    offline_chromium.get((tmp_path / "two.html").as_uri())
    assert offline_chromium.find_element(By.ID, "selection").text.startswith(
        "2 selected: run-2, run-1"
    )
    ticked = offline_chromium.find_elements(By.CSS_SELECTOR, "input.pick:checked")
    assert sorted(e.get_attribute("data-run") for e in ticked) == ["run-1", "run-2"]
    assert _points(offline_chromium, "run-1 val_loss") == 5
    assert _points(offline_chromium, "run-2 val_loss") == 5

"""The comparison page never runs data as code, and `trainyard ui` answers only its own host:
payloads planted in every string field the page shows (through the product's own writers,
then edited in the store) rendered in a real Chromium, and requests under a foreign Host."""

from __future__ import annotations

import http.client
import threading

import optuna
import pytest
from fake_runs import fake_run
from selenium.webdriver.support.ui import WebDriverWait
from test_report import enrich, two_rank_lanes

from trainyard import registry
from trainyard.report.data import build_report_data
from trainyard.report.page import render_page
from trainyard.report.server import make_server
from trainyard.runs.record import DatasetInfo, SweepTrial, load_record, save_record
from trainyard.storage import Store
from trainyard.sweeps.record import SweepRecord, save_sweep, sweep_key

from conftest import headless_chromium

# Every way out of a text node, an attribute and the data's <script> element at once.
PAYLOAD = "</script>\"'><img src=x onerror=window.__pwned=1><b id=pwn-{0}>{0}</b>"
FIELDS: list[str] = []  # every field whose payload the page must show as text


def bad(field: str, shown: bool = True) -> str:
    """The payload for `field`; `shown`: the page shows it whole (others are kept out of
    the page's views, or cut to 8 characters as an md5 or a commit is)."""
    if shown:
        FIELDS.append(field)
    return PAYLOAD.format(field)


def plant_runs(store: Store) -> None:
    """Two runs (the Compare view needs two), with payloads in every string of the record
    that the runs table, the curves, the rank lanes and the comparison show."""
    for n in (1, 2):
        record = enrich(store, fake_run(store, f"run-{n}", 0.9), 0.01, 1.0, **two_rank_lanes(8))
        params = record.params | {
            "task": {"name": bad(f"task{n}")},
            "model": {"name": bad(f"model{n}"), bad(f"paramkey{n}"): bad(f"paramvalue{n}")},
        }
        curve = f"val_{bad(f'curve{n}')}"  # drawn as a curve: it starts with val_
        history = [row | {curve: 0.5} for row in record.history]
        save_record(
            store,
            record.model_copy(
                update={
                    "params": params,
                    "history": history,
                    "created_at": bad(f"created{n}"),
                    "finished_at": bad(f"finished{n}", shown=False),
                    "dataset": DatasetInfo(
                        path=bad(f"datapath{n}"), dvc_md5=bad(f"md5{n}"), rows=1
                    ),
                    "code": {"git_commit": bad(f"commit{n}"), "git_dirty": True},
                    "monitor": {"name": bad(f"monitor{n}"), "mode": "max", "value": 0.9},
                    "metrics": {bad(f"metric{n}"): 0.5},
                    "error": bad(f"error{n}", shown=False),
                    "sweep": SweepTrial(sweep_id=bad(f"sweepid{n}"), study_name="s", trial=0),
                    "resumes": [{"attempt": 1, "from_step": bad(f"resume{n}")}],
                }
            ),
        )


def plant_sweep(store: Store, journal: str) -> None:
    """A sweep whose study has a trial with payloads in its parameter name, its categorical
    value and its run id; the sweep record carries them in its objective, time and md5."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
    study = optuna.create_study(study_name="trainyard-sw1", storage=storage, direction="maximize")
    trial = study.ask(
        {bad("trialparam"): optuna.distributions.CategoricalDistribution([bad("trialvalue")])}
    )
    trial.set_user_attr("run_id", bad("trialrun"))
    study.tell(trial, 0.8)
    save_sweep(
        store,
        SweepRecord(
            sweep_id="sw1",
            study_name="trainyard-sw1",
            storage=journal,
            direction="maximize",
            objective=bad("objective"),
            created_at=bad("sweepcreated", shown=False),
            dataset_path="data/raw/digits.csv",
            dataset_md5=bad("sweepmd5", shown=False),
            code={},
            params={},
        ),
    )
    assert store.read_json(sweep_key("sw1"))["objective"] == PAYLOAD.format("objective")


def plant_registry(store: Store) -> None:
    """Model "digits" registered and promoted by the registry itself, then its version and
    history documents edited as someone with write access to the bucket could."""
    registry.register(store, "run-1", "digits", by="tester")
    registry.promote(store, "digits", 1, by="tester")
    key = "registry/digits/versions/1/version.json"
    version = store.read_json(key) | {
        "run_id": bad("versionrun"),
        "dataset_md5": bad("versionmd5", shown=False),
        "code": {"git_commit": bad("versioncommit", shown=False)},
        "monitor": {"name": bad("versionmonitor"), "value": 0.9},
        "created_at": bad("versioncreated"),
        "registered_by": bad("registeredby"),
    }
    store.write_json(key, version)
    key = "registry/digits/history/00000001.json"
    entry = store.read_json(key)
    entry |= {"alias": bad("alias"), "at": bad("at"), "by": bad("by")}
    entry["evidence"] |= {"rule": bad("rule"), "metric": bad("evidencemetric")}
    entry["evidence"]["detail"] = {bad("detailkey"): bad("detailvalue")}
    store.write_json(key, entry)


@pytest.fixture
def planted(store, tmp_path) -> Store:
    FIELDS.clear()
    plant_runs(store)
    plant_sweep(store, str(tmp_path / "journal.log"))
    plant_registry(store)
    assert (load_record(store, "run-1").monitor or {})["name"] == PAYLOAD.format("monitor1")
    return store


def visit_every_view(driver, tick: bool = True) -> str:
    """Both runs ticked (curves, rank lanes), then every view in turn: the text the page
    shows (and its tooltips), scripts left out."""
    from selenium.webdriver.common.by import By

    for run_id in ("run-1", "run-2") if tick else ():
        driver.find_element(By.CSS_SELECTOR, f"input.pick[data-run='{run_id}']").click()
    for view in ("runs", "compare", "registry", "sweeps"):
        driver.find_element(By.CSS_SELECTOR, f"#tabs button[data-view='{view}']").click()
    return driver.execute_script(
        "return [...document.querySelectorAll('header, main')].map((e) => e.textContent).join(' ')"
        " + [...document.querySelectorAll('[title]')].map((e) => e.title).join(' ')"
    )


def assert_nothing_ran(driver, shown: str) -> None:
    created = driver.execute_script(
        'return [...document.querySelectorAll(\'[id^="pwn-"], img[src="x"]\')]'
        ".map((e) => e.outerHTML)"
    )
    assert created == []
    assert driver.execute_script("return window.__pwned") is None
    # Each payload is on the page as text: the test looked where the field is drawn.
    missing = [f for f in FIELDS if f"id=pwn-{f}>" not in shown]
    assert missing == [], " ".join(missing)


def test_payloads_in_every_field_stay_text_in_the_report_file(planted, tmp_path, local_chromium):
    target = tmp_path / "report.html"
    target.write_text(render_page(build_report_data(planted)))
    local_chromium.get(target.as_uri())
    assert_nothing_ran(local_chromium, visit_every_view(local_chromium))
    assert_markup_could_not_run_either(local_chromium)


def assert_markup_could_not_run_either(driver) -> None:
    """The second wall: markup put into the page by any other way is refused by its
    Content-Security-Policy (only the page's and plotly's own scripts run)."""
    driver.execute_script(
        "window.__refused = [];"
        "document.addEventListener('securitypolicyviolation',"
        " (e) => window.__refused.push(e.violatedDirective));"
        "document.body.insertAdjacentHTML('beforeend',"
        " '<img src=x onerror=window.__ran=1><script>window.__ran=2</script>');"
        "const s = document.createElement('script'); s.textContent = 'window.__ran=3';"
        "document.body.appendChild(s);"
    )
    WebDriverWait(driver, 30).until(lambda d: len(d.execute_script("return window.__refused")) >= 2)
    assert driver.execute_script("return window.__ran") is None


@pytest.fixture
def local_chromium():
    """Headless chromium that reaches 127.0.0.1 (`trainyard ui`) and no other address."""
    with headless_chromium("MAP * ~NOTFOUND, EXCLUDE 127.0.0.1") as driver:
        yield driver


def test_payloads_stay_text_in_the_served_page_after_a_refresh(planted, local_chromium):
    server = make_server("127.0.0.1", 0, lambda: build_report_data(planted))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = local_chromium
    try:
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        assert_nothing_ran(driver, visit_every_view(driver))
        # A new run: the page's next fetch of /data.json replaces its data, and every view
        # is drawn again from what was fetched.
        enrich(planted, fake_run(planted, "run-3", 0.9), 0.01, 1.0)
        # Nothing runs, so the page fetches again when it comes back into view.
        driver.execute_script("window.dispatchEvent(new Event('focus'))")
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return DATA.runs.length") == 3)
        assert_nothing_ran(driver, visit_every_view(driver, tick=False))
    finally:
        server.shutdown()
        server.server_close()


def get(port: int, host: str | None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.putrequest("GET", "/data.json", skip_host=True)
        if host is not None:
            connection.putheader("Host", host)
        connection.endheaders()
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def test_the_ui_answers_only_its_own_host(store):
    save_record(store, fake_run(store, "secret-run", 0.9))
    server = make_server("127.0.0.1", 0, lambda: build_report_data(store))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        for host in ("evil.example.com", f"evil.example.com:{port}", "127.0.0.1:1", None, ""):
            status, body = get(port, host)
            assert status == 421 and b"secret-run" not in body, (host, status)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
            status, body = get(port, host)
            assert status == 200 and b"secret-run" in body, (host, status)
    finally:
        server.shutdown()
        server.server_close()

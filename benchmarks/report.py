"""10. The comparison page at scale: 2,000 run records read from the store and rendered, the
page's size, and when its runs table is painted in headless chromium (issue 13: first paint
within 2 s).

Baseline in the same run: the same page with 20 runs. The table is painted at the later of
the page's own `trainyard-first-render` mark and the first contentful paint, read from
`performance` after loading the page from file://.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import BenchProject, _env, interleaved, ratio, summary
from trainyard.config import TrainyardConfig
from trainyard.report.data import RecordCache, build_report_data
from trainyard.report.page import render_page
from trainyard.runs.record import DatasetInfo, RunRecord, save_record
from trainyard.storage import Store, StoreSettings


def run(project: BenchProject, quick: bool) -> dict:
    runs, reps = (200, 1) if quick else (2000, 3)
    with _env(project.env()):  # a prefix of its own: the other benchmarks' runs stay out
        store = Store(dataclasses.replace(StoreSettings.from_worker_env(), prefix="bench-report"))
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: save_record(store, _record(n)), range(runs)))
    figures = {f"write {runs:,} run records, s": summary([time.perf_counter() - started])}

    built, rendered, pages = [], [], []
    for _ in range(reps):
        started = time.perf_counter()
        data = build_report_data(store)
        built.append(time.perf_counter() - started)
        started = time.perf_counter()
        pages.append(render_page(data))
        rendered.append(time.perf_counter() - started)
    assert len(data.runs) == runs, len(data.runs)
    figures[f"{runs:,} runs: read + build the data, s"] = summary(built)
    cache = RecordCache(store)  # what `trainyard ui` keeps between requests
    build_report_data(store, cache=cache)
    cached = []
    for _ in range(reps):
        started = time.perf_counter()
        build_report_data(store, cache=cache)
        cached.append(time.perf_counter() - started)
    figures[f"{runs:,} runs: build again through the ui's record cache, s"] = summary(cached)
    figures[f"{runs:,} runs: render the page, s"] = summary(rendered)
    figures[f"{runs:,} runs: page size, MB"] = summary([len(pages[-1]) / 1e6])
    ratios = {"build again through the record cache / read + build": ratio(cached, built)}
    browser = _table_painted_ms(pages[-1], render_page(build_report_data(store, _ids(20))), reps)
    if browser:
        figures[f"{runs:,} runs: runs table painted in chromium, ms"] = summary(browser["many"])
        figures["20 runs: runs table painted in chromium, ms"] = summary(browser["few"])
        ratios[f"runs table painted, {runs:,} runs / 20 runs"] = ratio(
            browser["many"], browser["few"]
        )
    return {"figures": figures, "ratios": ratios}


def _ids(count: int) -> list[str]:
    return [f"bench-report-{n:05d}" for n in range(count)]


def _record(n: int) -> RunRecord:
    """A completed run as the pipeline records it: the full params and 20 epochs of curves."""
    params = TrainyardConfig().model_dump(mode="json")
    params["train"]["lr"] = 0.001 * (1 + n % 50)
    history = [
        {
            "epoch": e,
            "train_loss": (1 + n / 1000) / e,
            "val_loss": (1 + n / 1000) / e + 0.05,
            "val_accuracy": 1 - 1 / (e + 1),
            "rows": 1257,
            "train_s": 0.5,
            "data_wait_s": 0.01,
        }
        for e in range(1, 21)
    ]
    return RunRecord(
        run_id=_ids(n + 1)[-1],
        status="completed",
        created_at=f"2026-11-20T{n // 3600 % 24:02d}:{n // 60 % 60:02d}:{n % 60:02d}+00:00",
        params=params,
        dataset=DatasetInfo(path="data/raw/digits.csv", dvc_md5="md5-digits", rows=1797),
        code={"git_commit": "c0ffee", "git_dirty": False},
        history=history,
        metrics={"test_accuracy": 0.9 + n % 10 / 100, "test_loss": 0.2},
        timings_s={"train": 12.5},
        world_size=2,
    )


def _table_painted_ms(many: str, few: str, reps: int) -> dict[str, list[float]] | None:
    """Each page opened from file:// in a fresh headless chromium tab; None without one."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            files = {"many": Path(tmp) / "many.html", "few": Path(tmp) / "few.html"}
            files["many"].write_text(many)
            files["few"].write_text(few)

            def measure(path: Path) -> float:
                driver.get("about:blank")
                driver.get(path.as_uri())
                # The runs table is on screen at the later of the page's own mark (table
                # rendered, before plotly is compiled) and the first contentful paint.
                return driver.execute_script(
                    "return Math.max(...['trainyard-first-render', 'first-contentful-paint']"
                    ".map((name) => performance.getEntriesByName(name)[0].startTime))"
                )

            return interleaved(
                reps, {name: functools.partial(measure, p) for name, p in files.items()}
            )
    finally:
        driver.quit()

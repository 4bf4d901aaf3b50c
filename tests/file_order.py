"""The order the test files run in: the longest first. `make test` runs two files at a time
(`-n 2 --dist loadfile`), each worker taking the next file when it is done; xdist's own
order (the files with the most tests first) left a few long files with one or two tests for
the end, where one worker ran a 140 s file alone. Longest first, the short files even out
the end.

A file's length is its seconds in tests/file_durations.json, the per-file total of a full
run on the 2-core machine (setup, call and teardown). A file not listed there yet counts as
long, so it starts early. To refresh the list after adding or changing slow tests:
`TRAINYARD_FILE_DURATIONS=tests/file_durations.json make test`."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

LISTED = Path(__file__).with_name("file_durations.json")
UNLISTED_S = 60.0  # a file not measured yet: placed among the long ones


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place, whole files at a time, each file's tests in their order."""
    seconds = json.loads(LISTED.read_text())
    position = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(_file(item), UNLISTED_S), _file(item),
                                 position[id(item)]))  # fmt: skip


class Durations:
    """Adds up each file's seconds as the reports come in; writes them at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::")[0].removeprefix("tests/")] += report.duration

    def write(self) -> None:
        """Into what `out` lists already: a run of some files updates theirs only."""
        known = json.loads(self.out.read_text()) if self.out.exists() else {}
        ranked = sorted((known | self.seconds).items(), key=lambda entry: -entry[1])
        self.out.write_text(json.dumps({f: round(s) for f, s in ranked}, indent=1) + "\n")


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0].removeprefix("tests/")

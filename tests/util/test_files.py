"""Local files written whole or not at all."""

from __future__ import annotations

import stat

import pytest

from trainyard.util.files import replacing, write_text_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "deep" / "status.json"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer died")
    assert path.read_text() == "old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["status.json"]


def test_a_private_file_is_readable_by_its_owner_only(tmp_path):
    write_text_atomic(tmp_path / "credentials.json", "{}", private=True)
    write_text_atomic(tmp_path / "page.html", "é")
    assert stat.S_IMODE((tmp_path / "credentials.json").stat().st_mode) == 0o600
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == "é"

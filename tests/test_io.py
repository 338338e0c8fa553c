"""Atomic writes: all or nothing, and ordinary file modes."""

from __future__ import annotations

import os
import stat

import pytest

from loupe.io import DIR_MODE, FILE_MODE, atomic_directory, atomic_write_json, atomic_write_text


def test_atomic_files_get_ordinary_modes_and_leave_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "out.json"
    atomic_write_json(target, {"a": 1})
    assert stat.S_IMODE(os.stat(target).st_mode) == FILE_MODE and FILE_MODE & 0o044  # others can read
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]


def test_atomic_directory_swaps_in_whole_or_not_at_all(tmp_path):
    final = tmp_path / "dataset"
    with atomic_directory(final) as building:
        (building / "a.txt").write_text("one")
    assert (final / "a.txt").read_text() == "one" and stat.S_IMODE(os.stat(final).st_mode) == DIR_MODE
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as building:
            (building / "a.txt").write_text("two")
            raise RuntimeError("killed midway")
    assert (final / "a.txt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]


def test_a_failed_text_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "t.txt"
    atomic_write_text(target, "old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.txt"]

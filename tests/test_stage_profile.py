"""benchmarks/stage_profile.py's split of a profile into parts, on a profile whose answer is known."""

from __future__ import annotations

import cProfile
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import stage_profile  # noqa: E402


def inner() -> None:
    time.sleep(0.05)


def outer() -> None:
    inner()
    inner()  # called twice from within the part: counted once, through outer
    time.sleep(0.1)


def elsewhere() -> None:
    time.sleep(0.08)


def test_parts_count_time_where_it_enters_them(tmp_path):
    profiler = cProfile.Profile()
    profiler.enable()
    outer()
    inner()  # entered from outside `outer`: counted in `inner` only
    elsewhere()
    profiler.disable()
    profiler.dump_stats(tmp_path / "p.prof")
    here = Path(__file__).name
    parts = [("outer", 0, [(here, "outer")]), ("inner", 1, [(here, "inner")]),
             ("outer or inner", 0, [(here, "outer"), (here, "inner")])]
    seconds = stage_profile.split(tmp_path / "p.prof", parts)
    assert seconds["outer"] == pytest.approx(0.2, abs=0.03)
    assert seconds["inner"] == pytest.approx(0.15, abs=0.03)  # its three calls, wherever they came from
    assert seconds["outer or inner"] == pytest.approx(0.25, abs=0.03)  # inner's calls inside outer not twice
    table = stage_profile.table("x", 1.0, 5, "step", parts, seconds)
    other = 1.0 - seconds["outer"] - seconds["outer or inner"]  # level-0 parts only: inner is a detail of outer
    assert "other" in table.splitlines()[-1] and table.splitlines()[-1].split()[-3] == f"{other:.1f}"

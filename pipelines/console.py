"""What a stage's output shows on the terminal, and where all of it goes: the stage's log file.

The flow runs each stage through `dvc repro`, whose output mixes the stage's own lines (its progress bar, its
summary) with the libraries' logging: DVC's notes about its lock file, Ray's driver and worker lines,
transformers' and LLaMA-Factory's `[INFO|file.py:N]` records. Every line goes to `work/logs/<stage>.log` (a
progress bar as a line of its state every 30 s, then its last state); the terminal gets the stage's lines and its
progress bars, without the libraries' records, so `make run` stays a few screens long. The sft stage already keeps LLaMA-Factory's own output out of its console
(stages/sft/runner.py); this filter is the net for whatever else a library prints.

Written by hand because the choice is line by line on text that several processes have already formatted
(DVC prints its notes with `print`, Ray forwards worker output with a `(pid=...)` prefix): no logging
configuration in this process reaches them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import TextIO

NOISE = (
    # transformers' and LLaMA-Factory's logging format, and transformers' deprecation notes.
    re.compile(r"^\[(INFO|WARNING|DEBUG)\|"),
    re.compile(r"^\[transformers\] "),
    # transformers' bars around loading and saving a model (seconds, and several per stage).
    re.compile(r"^(Loading weights|Loading checkpoint shards|Writing model shards): "),
    # Ray's driver logging ("2026-11-24 01:15:39,951\tINFO worker.py:2038 -- Started a local Ray instance.").
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING|DEBUG)\s"),
    # Ray's worker output forwarded to the driver ("(RolloutWorker pid=123) ...", "(raylet) ...").
    re.compile(r"^\((\w+ )?pid=\d+(, ip=[\d.]+)?\)|^\(raylet\)"),
    # DVC's notes around a stage: its read-write lock, the lock file, git and push hints.
    re.compile(r"^WARNING: Process '.*' with \(Pid \d+\), in RWLock-file"),
    re.compile(r"^(Updating lock file 'dvc.lock'|To track the changes with git, run:|To enable auto staging, run:"
               r"|Use `dvc push` to send your updates to remote storage\.)$"),
    re.compile(r"^\s*(git add dvc\.lock|dvc config core\.autostage true)$"),
)
"""Lines that belong in the log file only."""


def is_noise(line: str) -> bool:
    """Whether a line (its last carriage-return segment, no newline) is a library's record, not the stage's."""
    return any(pattern.search(line) for pattern in NOISE)


class ConsoleFilter:
    """Writes a stream of output chunks to `out`, dropping NOISE lines (unless `keep_noise`) and runs of blank
    lines. A progress bar's carriage-return updates are shown as they come (`\\r` + its latest state) on a
    terminal (`live`); written to a file or a CI log, where each redraw would pile onto one line thousands of
    states long, a bar becomes a line of its state at most every `bar_every_s` seconds, then its last state."""

    def __init__(self, out: TextIO, live: bool | None = None, bar_every_s: float = 30.0, keep_noise: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.out = out
        self.live = out.isatty() if live is None else live
        self.bar_every_s = bar_every_s
        self.keep_noise = keep_noise
        self.clock = clock
        self.pending = ""  # the current line, not yet ended by a newline
        self.shown = ""  # what of the current line is on the terminal now (live), or was last written (not live)
        self.shown_at = -math.inf  # when a bar state was last written as a line (not live)
        self.blank = True  # the last line written was blank (or nothing was written yet)

    def _noise(self, line: str) -> bool:
        return not self.keep_noise and is_noise(line)

    def write(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self._end_line(line.rsplit("\r", 1)[-1].rstrip())
        if "\r" in self.pending:
            latest = [segment for segment in self.pending.split("\r") if segment.strip()]
            if latest and latest[-1] != self.shown and not self._noise(latest[-1]):
                if self.live:
                    self.out.write("\r" + latest[-1])
                    self.shown = latest[-1]
                elif self.clock() - self.shown_at >= self.bar_every_s:
                    self.out.write(latest[-1].rstrip() + "\n")
                    self.shown, self.shown_at = latest[-1], self.clock()
                    self.blank = False
            # Only the latest state (and what follows it) can matter from here on.
            cut = self.pending.rfind("\r" + latest[-1]) if latest else -1
            if cut > 0:
                self.pending = self.pending[cut:]
        self.out.flush()

    def close(self) -> None:
        if self.pending or self.shown:
            self._end_line(self.pending.rsplit("\r", 1)[-1].rstrip())
        self.pending = ""
        self.out.flush()

    def _end_line(self, line: str) -> None:
        if self._noise(line) or (not line.strip() and self.blank):
            if self.shown and self.live:  # a bar was shown and the line ended as noise: keep its last state
                self.out.write("\n")
            self.shown, self.shown_at = "", -math.inf
            return
        if self.live:
            self.out.write(("\r" if self.shown else "") + line + "\n")
        elif line != self.shown.rstrip():  # a bar's last state, unless that line was just written
            self.out.write(line + "\n")
        self.shown, self.shown_at = "", -math.inf
        self.blank = not line.strip()

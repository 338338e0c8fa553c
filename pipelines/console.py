"""What a stage's output shows on the terminal, and where all of it goes: the stage's log file.

The flow runs each stage through `dvc repro`, whose output mixes the stage's own lines (its progress bar, its
summary) with the libraries' logging: DVC's notes about its lock file, Ray's driver and worker lines,
transformers' and LLaMA-Factory's `[INFO|file.py:N]` records. Every byte goes to `work/logs/<stage>.log`; the
terminal gets the stage's lines and its progress bars, without the libraries' records, so `make run` stays a
few screens long. The sft stage already keeps LLaMA-Factory's own output out of its console
(stages/sft/runner.py); this filter is the net for whatever else a library prints.

Written by hand because the choice is line by line on text that several processes have already formatted
(DVC prints its notes with `print`, Ray forwards worker output with a `(pid=...)` prefix): no logging
configuration in this process reaches them.
"""

from __future__ import annotations

import re
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
    """Writes a stream of output chunks to `out`, dropping NOISE lines and runs of blank lines, and showing a
    progress bar's carriage-return updates as they come (each as `\\r` + its latest state)."""

    def __init__(self, out: TextIO):
        self.out = out
        self.pending = ""  # the current line, not yet ended by a newline
        self.shown = ""  # what of the current line is on the terminal now
        self.blank = True  # the last line written was blank (or nothing was written yet)

    def write(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self._end_line(line.rsplit("\r", 1)[-1].rstrip())
        if "\r" in self.pending:
            latest = [segment for segment in self.pending.split("\r") if segment.strip()]
            if latest and latest[-1] != self.shown and not is_noise(latest[-1]):
                self.out.write("\r" + latest[-1])
                self.shown = latest[-1]
        self.out.flush()

    def close(self) -> None:
        if self.pending or self.shown:
            self._end_line(self.pending.rsplit("\r", 1)[-1].rstrip())
        self.pending = ""
        self.out.flush()

    def _end_line(self, line: str) -> None:
        if is_noise(line) or (not line.strip() and self.blank):
            if self.shown:  # a bar was shown and the line ended as noise: keep its last state
                self.out.write("\n")
            self.shown = ""
            return
        self.out.write(("\r" if self.shown else "") + line + "\n")
        self.shown = ""
        self.blank = not line.strip()

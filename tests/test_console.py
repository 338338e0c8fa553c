"""The terminal shows a stage's own lines and progress bars; libraries' records go to the log file only."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from pipelines.console import ConsoleFilter, is_noise
from pipelines.dvc_runner import stream_output
from stages.sft.runner import TrainerProgress

# Lines as the libraries print them (from a `make run` log).
LIBRARY_LINES = [
    "[INFO|configuration_utils.py:769] 2026-11-24 01:10:00,204 >> loading configuration file /x/config.json",
    "[WARNING|logging.py:340] 2026-11-24 01:10:00,227 >> The `use_fast` parameter is deprecated",
    "[transformers] warmup_ratio is deprecated and will be removed in v5.2. Use `warmup_steps` instead.",
    "2026-11-24 01:15:39,951\tINFO worker.py:2038 -- Started a local Ray instance.",
    "2026-11-24 01:15:36,199\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled",
    "(RolloutWorker pid=4242) loading the model",
    "(pid=77, ip=10.0.0.2) warming up",
    "WARNING: Process '/x/dvc/__main__.py repro sft --single-item' with (Pid 21198), in RWLock-file 'work/sft/model'",
    "Updating lock file 'dvc.lock'",
    "To track the changes with git, run:",
    "\tgit add dvc.lock",
    "To enable auto staging, run:",
    "\tdvc config core.autostage true",
    "Use `dvc push` to send your updates to remote storage.",
    "Loading weights: 100%|██████████| 80/80 [00:00<00:00, 20211.08it/s]",
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 100.57it/s]",
]
STAGE_LINES = [
    "Running stage 'sft':",
    "> loupe stage sft --params params.yaml --model work/models/tiny --dataset work/synth/dataset --out work/sft",
    "sft: 630 samples, 1119 assistant turns, 1119 images; tokens per sample: mean 389, max 426 (cutoff 4096)",
    "synthetic (200 questions x 2 samples; chance rate 0.250)",
    "model  accuracy [95% CI]     pass@2  valid  turns",
    "tiny model: perception: 100%|██████████| 600/600 [00:30<00:00, 19.86step/s]",
]


def test_library_records_are_noise_and_stage_lines_are_not():
    assert all(is_noise(line) for line in LIBRARY_LINES)
    assert not any(is_noise(line) for line in STAGE_LINES)


def test_the_filter_keeps_stage_lines_and_the_last_state_of_a_bar():
    out = io.StringIO()
    console = ConsoleFilter(out, live=True)
    text = "\n".join([STAGE_LINES[0], *LIBRARY_LINES[:3], "", "", STAGE_LINES[2]]) + "\n"
    for i in range(0, len(text), 7):  # output arrives in arbitrary chunks
        console.write(text[i:i + 7])
    console.write("rl:   0%|   | 0/16\r")
    console.write("rl:  50%|#  | 8/16\r")
    console.write("rl: 100%|## | 16/16\n")
    console.write("rl: 16 steps")
    console.close()
    shown = out.getvalue()
    assert not any(line.strip() in shown for line in LIBRARY_LINES)
    assert STAGE_LINES[0] in shown and STAGE_LINES[2] in shown
    assert "\n\n\n" not in shown  # runs of blank lines fold to one
    assert "\rrl:  50%|#  | 8/16" in shown and shown.rstrip().endswith("rl: 16 steps")
    assert [line.rsplit("\r", 1)[-1] for line in shown.splitlines()][-2:] == ["rl: 100%|## | 16/16", "rl: 16 steps"]


def test_written_to_a_file_a_bar_is_a_line_every_interval_and_its_last_state():
    out, now = io.StringIO(), [0.0]
    console = ConsoleFilter(out, bar_every_s=30.0, clock=lambda: now[0])
    assert not console.live  # a StringIO is no terminal
    console.write("rl: starting\n")
    for step in range(1, 401):  # 400 redraws over 100 s
        now[0] = step / 4
        console.write(f"\rtiny model: perception: {step}/400")
    console.write("\ndone\n")
    console.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == ["rl: starting", "tiny model: perception: 1/400", "tiny model: perception: 121/400",
                     "tiny model: perception: 241/400", "tiny model: perception: 361/400",
                     "tiny model: perception: 400/400", "done"]


def test_stream_output_logs_every_byte_and_shows_the_filtered_view(tmp_path, capsys):
    lines = [LIBRARY_LINES[0], STAGE_LINES[2], LIBRARY_LINES[3]]
    script = "import sys\n" + "".join(f"print({line!r})\n" for line in lines)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[str] = []
    log = tmp_path / "logs" / "sft.log"
    output = stream_output(process, seen.append, echo=True, log_path=log)
    process.wait()
    assert log.read_text() == output == "\n".join(lines) + "\n"
    assert seen == lines  # the Prefect API still gets every line
    assert capsys.readouterr().out == STAGE_LINES[2] + "\n"


def test_the_sft_bar_follows_llamafactorys_trainer_log(tmp_path):
    log = tmp_path / "trainer_log.jsonl"
    log.write_text(json.dumps({"current_steps": 10, "total_steps": 1580, "loss": 3.0}) + "\n")  # an earlier run's
    progress = TrainerProgress(log, disable=True)
    assert progress.step == 0  # a resumed run's old lines are not counted again
    with log.open("a") as handle:
        handle.write(json.dumps({"current_steps": 20, "total_steps": 1580, "loss": 2.5}) + "\n")
        handle.write('{"current_steps": 30, "total_')  # still being written
    progress.poll()
    assert (progress.step, progress.total, progress.loss) == (20, 1580, 2.5)
    with log.open("a") as handle:
        handle.write('steps": 1580, "loss": 1.25}\n')
    progress.close()
    assert (progress.step, progress.loss) == (30, 1.25)

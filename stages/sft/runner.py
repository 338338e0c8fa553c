"""Running `llamafactory-cli` in a subprocess: its output streamed, its failure explained, its run resumable.

- `launch` starts `python -m llamafactory.cli <command> <yaml>` (or LLaMA-Factory's launcher under torchrun,
  `llamafactory_command`) with the interpreter running this stage (so the stage's environment is
  LLaMA-Factory's), writes its output to a log file and either streams it byte for
  byte to our console or, by default in the stage, shows one progress bar instead (`TrainerProgress`, fed by
  the trainer's own log); on failure it raises `TrainingFailed` holding the end of that output: the traceback
  when there is one.
- The child dies with us: a wrapper sets Linux's parent-death signal before exec'ing the command, so a stage
  killed by a scheduler does not leave a trainer writing checkpoints behind it.
- MLflow: the child reports through LLaMA-Factory's own `report_to: mlflow` (transformers' MLflowCallback),
  into the stage's run, by `MLFLOW_TRACKING_URI` and `MLFLOW_RUN_ID` in its environment.
- Resume: LLaMA-Factory resumes by itself from the last `checkpoint-N` in its output folder.
  `prepare_train_dir` makes that safe: it keeps the folder only when it was written for the same config,
  dataset and base model (a fingerprint file), removes a checkpoint cut off while being saved (the trainer
  writes `trainer_state.json` last), and says whether there is anything left to train.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

FINGERPRINT_FILE = "loupe_fingerprint.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WEIGHT_SAMPLE = 1 << 20
"""Bytes of a base model's weight file read at each of its three sampled places (`fingerprint`)."""
TAIL_BYTES = 64 * 1024
_LAUNCHER_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")

# Sets the parent-death signal, then becomes the real command (the setting survives exec). Written as a
# wrapper rather than a preexec_fn because forking a process with threads (MLflow, tokenizers) and running
# Python code before exec can deadlock.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() == int(sys.argv[1]):\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class TrainingFailed(RuntimeError):
    """`llamafactory-cli` exited non-zero; the message holds the end of its output."""

    def __init__(self, command: str, returncode: int, tail: str, log_path: Path):
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"failed (exit code {returncode})"
        super().__init__(f"llamafactory-cli {command} {how}; its last output:\n{tail}\nfull log: {log_path}")
        self.returncode = returncode
        self.tail = tail


def error_tail(output: bytes, max_lines: int = 30) -> str:
    """The informative end of a run's output: from the last traceback on, else the last lines.

    Progress bars redraw with carriage returns; only the last state of each line is kept.
    """
    text = ANSI.sub(b"", output).decode("utf-8", errors="replace")
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    lines = [line for line in lines if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    # Under torchrun the rank's traceback comes first and torchrun's own (ChildFailedError) last: keep the rank's.
    blocks = list(zip(starts, starts[1:] + [len(lines)]))
    own = [(i, end) for i, end in blocks if not any(_LAUNCHER_FAILED in line for line in lines[i:end])]
    if blocks:
        start, end = (own or blocks)[-1]
        lines = lines[start:end] if own else lines[start:]
        if len(lines) > max_lines:  # keep the head of the traceback and its final error
            lines = lines[:5] + ["  ..."] + lines[-(max_lines - 6) :]
        return "\n".join(lines)
    return "\n".join(lines[-max_lines:])


def llamafactory_command(command: str, config: Path, overrides: dict[str, Any] | None = None,
                         processes: int = 1) -> list[str]:
    """`python -m llamafactory.cli <command> <yaml> key=value...` with this interpreter; with `processes` > 1,
    training under torchrun as LLaMA-Factory itself starts it, `torchrun ... llamafactory/launcher.py <yaml>`
    (llamafactory/launcher.py, `launch`), but called directly: through `llamafactory-cli` the parent process
    imports transformers before torchrun does it again in each rank (15 s on 2 cores). `--standalone` picks a
    free local port."""
    extra = [f"{key}={value}" for key, value in (overrides or {}).items()]
    if processes > 1 and command == "train":
        spec = importlib.util.find_spec("llamafactory")  # found, not imported: the stage need not load it
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"LLaMA-Factory is not installed for {sys.executable} (pip install llamafactory)")
        launcher = Path(spec.submodule_search_locations[0]) / "launcher.py"
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                str(launcher), str(config), *extra]
    return [sys.executable, "-m", "llamafactory.cli", command, str(config), *extra]


def by_hand(args: list[str], env: dict[str, str] | None = None) -> str:
    """The shell line a user types to repeat `args` (llamafactory_command's) with `env`'s variables."""
    tool = {"llamafactory.cli": "llamafactory-cli", "torch.distributed.run": "torchrun"}[args[2]]
    words = [tool, *args[3:]]
    return "".join(f"{k}={v} " for k, v in (env or {}).items()) + " ".join(words)


def child_environment(run_id: str | None, tracking_uri: str | None, force_torchrun: bool = False,
                      launch: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocess's environment: ours, plus unbuffered output, MLflow's run, torchrun when asked, and
    `launch`'s variables (llamafactory_config.launch_environment)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torchrun (multi-GPU or DeepSpeed) must be found beside this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for key in ("MLFLOW_RUN_ID", "MLFLOW_NESTED_RUN", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(key, None)
    if run_id is not None:
        env["MLFLOW_RUN_ID"] = run_id
        if tracking_uri:
            env["MLFLOW_TRACKING_URI"] = tracking_uri
    if force_torchrun:
        env["FORCE_TORCHRUN"] = "1"
    env.update(launch or {})
    return env


class TrainerProgress:
    """One progress bar for a LLaMA-Factory run, fed by its `trainer_log.jsonl` rather than its console.

    LLaMA-Factory's LogCallback (llamafactory/train/callbacks.py, `on_log`) appends a JSON line to
    `<output_dir>/trainer_log.jsonl` every `logging_steps` with `current_steps`, `total_steps` and `loss`; that
    file is the trainer's own account of its progress, so the bar needs no parsing of console text. `poll`
    reads the lines added since the last call (a resumed run appends to the same file)."""

    def __init__(self, trainer_log: Path, desc: str = "sft: train", disable: bool = False):
        from tqdm import tqdm

        self.path, self.offset = trainer_log, trainer_log.stat().st_size if trainer_log.is_file() else 0
        # Kept here as well as on the bar: a disabled bar counts nothing.
        self.step: int = 0
        self.total: int | None = None
        self.loss: float | None = None
        self.bar = tqdm(total=None, desc=desc, unit="step", disable=disable, dynamic_ncols=True)

    def poll(self) -> None:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
                step, total = int(entry["current_steps"]), int(entry["total_steps"])
            except (ValueError, KeyError, TypeError):
                continue
            if self.total != total:
                self.total = total
                self.bar.reset(total=total)
            self.bar.update(step - self.step)
            self.step = step
            if entry.get("loss") is not None:
                self.loss = float(entry["loss"])
                self.bar.set_postfix(loss=f"{self.loss:.4f}", refresh=False)

    def close(self) -> None:
        self.poll()
        self.bar.close()


def launch(args: list[str], env: dict[str, str], log_path: Path, console: BinaryIO | None = None,
           progress: TrainerProgress | None = None) -> None:
    """Run `args`, appending its output to `log_path`; raise on failure. Without `progress` the output is also
    streamed to `console` byte for byte; with it the console shows only that bar (the log keeps everything)."""
    console = console if console is not None else sys.stdout.buffer
    log_path.parent.mkdir(parents=True, exist_ok=True)
    wrapped = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]
    tail = b""
    with log_path.open("ab") as log:
        log.write(("$ " + " ".join(args) + "\n").encode())
        process = subprocess.Popen(wrapped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            assert process.stdout is not None
            while chunk := process.stdout.read1(65536):
                if progress is None:
                    console.write(chunk)
                    console.flush()
                else:
                    progress.poll()
                log.write(chunk)
                tail = (tail + chunk)[-TAIL_BYTES:]
            returncode = process.wait()
        except BaseException:  # Ctrl-C or a stage time-out: stop the trainer too, then let it propagate
            _stop(process)
            raise
        finally:
            if progress is not None:
                progress.close()
    if returncode != 0:
        command = args[3] if args[1:3] == ["-m", "llamafactory.cli"] else "train"
        raise TrainingFailed(command, returncode, error_tail(tail), log_path)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- the training folder: resume or start over --------------------------------------------------------------


def _file_digest(path: Path, hasher: Any) -> None:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hasher.update(block)


def fingerprint(config: dict[str, Any], dataset_files: list[Path], image_files: list[Path], model_dir: Path) -> str:
    """What a training folder was made from: the train config, the dataset's bytes, its images' names and
    sizes, and the base model's config and weight files: each one's size and three 1 MiB samples of its bytes
    (start, middle, end). Hashing a 7B model's 15 GB every run would cost minutes; sizes alone missed a base
    model retrained at the same shape (new perception pretraining), whose SFT then resumed the old run's
    finished checkpoints. Retrained weights differ everywhere, so the samples see it."""
    hasher = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for path in dataset_files:
        _file_digest(path, hasher)
    for path in sorted(set(image_files)):
        hasher.update(f"{path}:{path.stat().st_size}\n".encode())
    model_dir = Path(model_dir)
    _file_digest(model_dir / "config.json", hasher)
    for path in sorted(model_dir.iterdir()):
        if path.suffix in WEIGHT_SUFFIXES:
            size = path.stat().st_size
            hasher.update(f"{path.name}:{size}\n".encode())
            with path.open("rb") as f:
                for offset in sorted({0, max(0, size // 2 - WEIGHT_SAMPLE // 2), max(0, size - WEIGHT_SAMPLE)}):
                    f.seek(offset)
                    hasher.update(f.read(WEIGHT_SAMPLE))
    return hasher.hexdigest()


@dataclass(frozen=True)
class TrainDirState:
    """What `prepare_train_dir` found: `fresh` (train from step 0), `resume` (from `step`) or `done`."""

    kind: str
    step: int = 0
    note: str = ""


def complete_checkpoints(train_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints the trainer finished writing, by step."""
    found = []
    for path in Path(train_dir).glob("checkpoint-*"):
        match = CHECKPOINT.match(path.name)
        if match and path.is_dir() and (path / "trainer_state.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_complete(train_dir: Path) -> bool:
    """The trainer finished: its final results and weights are at the top of the folder."""
    train_dir = Path(train_dir)
    return (train_dir / "train_results.json").is_file() and any(
        p.suffix in WEIGHT_SUFFIXES and p.is_file() for p in train_dir.iterdir()
    )


def prepare_train_dir(train_dir: Path, digest: str) -> TrainDirState:
    """Make `train_dir` safe for LLaMA-Factory's automatic resume, and say what it holds."""
    train_dir = Path(train_dir)
    marker = train_dir / FINGERPRINT_FILE
    note = ""
    if train_dir.exists():
        recorded = json.loads(marker.read_text()).get("fingerprint") if marker.is_file() else None
        if recorded != digest:
            note = "the training folder was written for another config, dataset or base model; starting over"
            shutil.rmtree(train_dir)
        elif is_complete(train_dir):
            return TrainDirState("done", note="training already finished for this config; exporting its model")
    if train_dir.exists():
        for path in train_dir.glob("checkpoint-*"):
            if path.is_dir() and not (path / "trainer_state.json").is_file():
                shutil.rmtree(path)  # cut off while being saved: resuming from it would crash
        checkpoints = complete_checkpoints(train_dir)
        if checkpoints:
            step, path = checkpoints[-1]
            return TrainDirState("resume", step, f"resuming from {path.name}")
        # Nothing to resume from: clear leftovers (a final save cut off, old logs) so the run starts clean.
        shutil.rmtree(train_dir)
    train_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"fingerprint": digest}) + "\n")
    return TrainDirState("fresh", note=note)


def remove_checkpoints(train_dir: Path) -> None:
    """Delete the checkpoints (optimiser state included) once the model is exported."""
    for _, path in complete_checkpoints(train_dir):
        shutil.rmtree(path, ignore_errors=True)
    for path in Path(train_dir).glob("checkpoint-*"):
        shutil.rmtree(path, ignore_errors=True)

"""Run one DVC stage as a child process, stream its log, and say whether DVC ran, skipped or restored it.

The Prefect tasks in pipelines/flow.py are thin wrappers around `repro_stage`; keeping the work here means it
is tested without a Prefect server. DVC is driven through its command line (not its Python API) on purpose:
the stage then runs exactly as `dvc repro` runs it for a user, in its own process with its own lock handling,
and a crash in a stage can never take the flow down with it.

    result = repro_stage("eval", root=Path("."), env=stage_environment(), on_line=print)
    result.status  # "ran", "skipped" (nothing changed), "restored" (DVC's run cache had the outputs) or "failed"
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from loupe.tracking import PARENT_RUN_ENV, tracking_enabled, tracking_uri
from pipelines.console import ConsoleFilter

RAN, SKIPPED, RESTORED, FAILED = "ran", "skipped", "restored", "failed"
_TAIL_CHARS = 4000


@dataclass
class StageResult:
    """What happened to one stage in one flow run."""

    stage: str
    status: str
    seconds: float
    returncode: int
    exit_status: int | None = None
    """The stage command's own exit status when DVC reports one (2: bad input, not worth a retry)."""
    log_tail: str = ""
    attempts: int = 1
    metrics: dict = field(default_factory=dict)


class StageFailed(RuntimeError):
    """`dvc repro` of a stage failed; carries the result (exit status, log tail) for retry decisions."""

    def __init__(self, result: StageResult):
        self.result = result
        where = f", the stage exited with {result.exit_status}" if result.exit_status is not None else ""
        super().__init__(f"stage {result.stage} failed (dvc exit {result.returncode}{where}):\n{result.log_tail[-1500:]}")


def dvc_command(*args: str) -> list[str]:
    """`dvc ...` from the running interpreter's environment, whatever PATH says."""
    return [sys.executable, "-m", "dvc", *args]


PINNED_CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The CPU kernel set every stage computes with: torch's own kernels, MKL's and oneDNN's at AVX2, which every x86
CPU here has. The embedded default trains a tiny model from scratch, and its outcome follows the last bits of
each matmul: on an Intel Xeon with AVX-512 and AMX the unpinned default ended at SFT 0.512 where an AMD EPYC gave
0.925, and pinned at AVX2 that Xeon gives SFT 0.940 (docs/learning.md, "CPU kernel sets"). A variable the caller
set is kept (`ATEN_CPU_CAPABILITY=avx512` runs the machine's own); GPU compute is not affected."""


def stage_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every stage process gets: this interpreter's scripts first on PATH (dvc.yaml's
    `python -m ...` must find the same environment), no analytics, unbuffered output, an absolute MLflow store
    (a `dvc exp` temporary workspace or a container writes to the same runs), the parent run's id, and the CPU
    kernel set pinned (`PINNED_CPU_KERNELS`, where the caller has not set its own)."""
    env = dict(os.environ if base is None else base)
    for name, value in PINNED_CPU_KERNELS.items():
        env.setdefault(name, value)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, *[p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]])
    env["DVC_NO_ANALYTICS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if tracking_enabled():
        env["MLFLOW_TRACKING_URI"] = tracking_uri()
    if os.environ.get(PARENT_RUN_ENV):
        env[PARENT_RUN_ENV] = os.environ[PARENT_RUN_ENV]
    return env


def stage_names(root: Path) -> list[str]:
    """The stages of dvc.yaml in file order (which dvc.yaml keeps topological: each after its inputs)."""
    spec = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
    return list((spec.get("stages") or {}).keys())


def stage_spec(root: Path, stage: str) -> dict:
    return (yaml.safe_load((root / "dvc.yaml").read_text()).get("stages") or {})[stage]


def _status_of(stage: str, output: str) -> str:
    if re.search(rf"Running stage '{re.escape(stage)}'", output):
        return RAN
    if re.search(rf"Stage '{re.escape(stage)}' is cached - skipping run", output):
        return RESTORED
    return SKIPPED


def stream_output(process: subprocess.Popen, on_line: Callable[[str], None] | None, echo: bool,
                  log_path: Path | None = None) -> str:
    """Copy the process's output to our stdout as it comes, through pipelines.console's filter (the stage's
    lines and progress bars, not the libraries' records), append every line to `log_path`, and hand complete
    lines, carriage-return updates collapsed to their last state, to `on_line`; returns the whole output."""
    chunks: list[str] = []
    pending = ""
    console = ConsoleFilter(sys.stdout) if echo else None
    assert process.stdout is not None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    with (log_path.open("a", encoding="utf-8") if log_path is not None else nullcontext()) as log_file:
        # Every line, the libraries' records too; a bar as a line every 30 s, not thousands of redraws on one.
        log = ConsoleFilter(log_file, live=False, keep_noise=True) if log_file is not None else None
        while True:
            data = os.read(process.stdout.fileno(), 65536)
            if not data:
                break
            text = data.decode("utf-8", errors="replace")
            chunks.append(text)
            if log is not None:
                log.write(text)
            if console is not None:
                console.write(text)
            pending += text
            *lines, pending = pending.split("\n")
            for line in lines:
                line = line.rsplit("\r", 1)[-1].rstrip()
                if line and on_line:
                    on_line(line)
        if log is not None:
            log.close()
    if console is not None:
        console.close()
    if pending.strip() and on_line:
        on_line(pending.rsplit("\r", 1)[-1].rstrip())
    return "".join(chunks)


def repro_stage(stage: str, root: Path, env: dict[str, str] | None = None,
                on_line: Callable[[str], None] | None = None, single_item: bool = True,
                force: bool = False, echo: bool = True, log_path: Path | None = None) -> StageResult:
    """`dvc repro [--single-item] <stage>` in `root`; raises StageFailed when DVC or the stage fails. Its whole
    output is appended to `log_path` when given (the flow's `work/logs/<stage>.log`)."""
    args = ["repro", stage] + (["--single-item"] if single_item else []) + (["--force"] if force else [])
    started = time.perf_counter()
    process = subprocess.Popen(dvc_command(*args), cwd=root, env=env if env is not None else stage_environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        output = stream_output(process, on_line, echo, log_path)
    finally:
        returncode = process.wait()
    seconds = time.perf_counter() - started
    exited = re.search(r"exited with (-?\d+)", output)
    result = StageResult(stage, _status_of(stage, output) if returncode == 0 else FAILED, round(seconds, 2),
                         returncode, int(exited.group(1)) if exited else None, output[-_TAIL_CHARS:])
    if returncode != 0:
        raise StageFailed(result)
    return result


def dvc_text(root: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Output of a quick DVC command (`remote default`, `push`); raises CalledProcessError on failure."""
    done = subprocess.run(dvc_command(*args), cwd=root, env=env if env is not None else stage_environment(),
                          capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    return done.stdout


def default_remote(root: Path) -> str | None:
    """The name of the default DVC remote, or None when there is none."""
    try:
        name = dvc_text(root, "remote", "default").strip()
    except subprocess.CalledProcessError:
        return None
    return name or None


def configure_remote_from_env(root: Path, name: str = "storage") -> str | None:
    """Make LOUPE_DVC_REMOTE (e.g. s3://bucket/loupe/dvc) the default remote, in `.dvc/config.local`.

    Only the URL (and AWS_ENDPOINT_URL's endpoint when set, so plain DVC commands reach the same store) go
    into the git-ignored local config; credentials stay in the environment (AWS_ACCESS_KEY_ID, a profile, an
    instance role), where boto3 finds them. Returns the remote's URL, or None when the variable is unset.
    """
    url = os.environ.get("LOUPE_DVC_REMOTE")
    if not url:
        return None
    dvc_text(root, "remote", "add", "--local", "--force", "--default", name, url)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and url.startswith("s3://"):
        dvc_text(root, "remote", "modify", "--local", name, "endpointurl", endpoint)
    return url

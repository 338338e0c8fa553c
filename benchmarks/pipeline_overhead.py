"""Pipeline overhead: what share of `loupe run`'s wall time goes to orchestration rather than stage work.

Two runs of the whole chain on the same params.yaml, each in a fresh scratch copy of this checkout (so
neither reuses the other's outputs, DVC cache or stores):

1. baseline: each stage's dvc.yaml command run directly, one after the other, tracking off: the stage work
   plus each process's start-up and imports, and nothing else;
2. the flow: `python -m pipelines.flow` (ephemeral Prefect, DVC, MLflow tracking with lineage), where each
   stage also reports the seconds spent inside its own `stage_run` block (LOUPE_STAGE_TIMINGS).

It prints, against the flow's wall time W:
- orchestration share = (W - sum of in-stage work) / W: Prefect, DVC, MLflow, process start and imports
  (the issue's definition; target under 15 %);
- flow vs baseline = (W - baseline wall) / W: what Prefect, DVC and MLflow add to bare stage processes;
- each stage's in-stage seconds and the flow's per-stage task seconds.

    python benchmarks/pipeline_overhead.py [--params params.yaml] [--skip-baseline] [--keep DIR]

Not a test: a measurement. It takes as long as two pipeline runs (about 20 minutes on the embedded defaults
on 2 cores, sft most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def scratch_copy(dest: Path, params: Path) -> Path:
    """This checkout's files (tracked and untracked, not ignored) in a new git repository at `dest`."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    shutil.copy2(params, dest / "params.yaml")
    (dest / "dvc.lock").unlink(missing_ok=True)  # start from nothing: every stage runs
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "bench",
           "GIT_COMMITTER_EMAIL": "b@b"}
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "scratch"]):
        subprocess.run(command, cwd=dest, check=True, env=env)
    return dest


def stage_commands(repo: Path) -> list[tuple[str, str]]:
    """(stage, command) in dvc.yaml's order, `${model.path}`-style templates filled from params.yaml."""
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    commands = []
    for name, spec in stages.items():
        cmd = spec["cmd"]
        while "${" in cmd:
            start = cmd.index("${")
            end = cmd.index("}", start)
            value: object = params
            for part in cmd[start + 2:end].split("."):
                value = value[part]  # type: ignore[index]
            cmd = cmd[:start] + str(value) + cmd[end + 1:]
        commands.append((name, cmd))
    return commands


def environment(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **extra}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for name in ("MLFLOW_TRACKING_URI", "LOUPE_PARENT_RUN_ID", "PREFECT_API_URL", "PREFECT_HOME"):
        env.pop(name, None)
    return env


def run_baseline(repo: Path) -> tuple[float, dict[str, float]]:
    env = environment({"LOUPE_TRACKING": "off"})
    per_stage = {}
    started = time.perf_counter()
    for name, cmd in stage_commands(repo):
        t0 = time.perf_counter()
        subprocess.run(shlex.split(cmd), cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
        per_stage[name] = time.perf_counter() - t0
        print(f"  baseline {name}: {per_stage[name]:.1f} s", flush=True)
    return time.perf_counter() - started, per_stage


def run_flow(repo: Path) -> tuple[float, dict[str, float], str]:
    timings = repo / "stage_timings.jsonl"
    env = environment({"LOUPE_TRACKING": "on", "LOUPE_STAGE_TIMINGS": str(timings)})
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.flow"], cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the flow failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    work: dict[str, float] = {}
    for line in timings.read_text().splitlines():
        row = json.loads(line)
        work[row["stage"]] = work.get(row["stage"], 0.0) + row["seconds"]
    table = done.stdout[done.stdout.index("stage  status"):] if "stage  status" in done.stdout else ""
    return wall, work, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--skip-baseline", action="store_true", help="only the flow (no bare-process baseline)")
    parser.add_argument("--keep", type=Path, help="keep the scratch copies under this folder")
    args = parser.parse_args()
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="loupe-overhead-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        baseline_wall, baseline = None, {}
        if not args.skip_baseline:
            print("baseline: the stage commands run directly, tracking off")
            baseline_wall, baseline = run_baseline(scratch_copy(scratch / "baseline", args.params))
        print("flow: python -m pipelines.flow (ephemeral Prefect, DVC, MLflow)")
        wall, work, table = run_flow(scratch_copy(scratch / "flow", args.params))
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    in_stage = sum(work.values())
    print(f"\n{table}\n")
    print(f"flow wall time                   {wall:8.1f} s")
    print(f"inside the stages' own blocks    {in_stage:8.1f} s  ({', '.join(f'{k} {v:.1f}' for k, v in work.items())})")
    print(f"orchestration share              {(wall - in_stage) / wall:8.1%}  "
          f"(Prefect, DVC, MLflow, process start and imports; target < 15%)")
    if baseline_wall is not None:
        print(f"baseline wall time (bare stages) {baseline_wall:8.1f} s  "
              f"({', '.join(f'{k} {v:.1f}' for k, v in baseline.items())})")
        print(f"flow vs baseline                 {(wall - baseline_wall) / wall:8.1%}  "
              f"of the flow's time added by Prefect, DVC and MLflow")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MLflow tracking for every stage: one run per stage, nested under the pipeline's run when there is one.

    with stage_run("eval", params={"eval": eval_params.model_dump()}) as run:
        run.log_metrics({"accuracy": 0.5}, step=3)
        run.log_artifact(out_dir / "metrics.json")

Where runs go:
- `MLFLOW_TRACKING_URI` when set (a server, `sqlite:///...`, S3-backed artefacts through the usual variables);
- else a SQLite store in the workspace, `sqlite:///<LOUPE_WORK or work>/mlflow.db`;
- `LOUPE_TRACKING=off` turns tracking off: `stage_run` then yields a stand-in whose methods do nothing, so
  stage code never needs an `if` around a logging call (nanochat's DummyWandb idea).

A stage launched by the pipeline (or by `dvc repro` under it, or inside a container) finds the parent run's id
in `LOUPE_PARENT_RUN_ID` and opens its run as a child of it. Every run is tagged with the stage name, the git
commit and whether the tree was dirty.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

PARENT_RUN_ENV = "LOUPE_PARENT_RUN_ID"
EXPERIMENT_ENV = "LOUPE_EXPERIMENT"
DEFAULT_EXPERIMENT = "loupe"


def tracking_enabled() -> bool:
    return os.environ.get("LOUPE_TRACKING", "on").lower() not in ("off", "0", "false", "no")


def tracking_uri() -> str:
    """The MLflow store: MLFLOW_TRACKING_URI, else SQLite in the workspace."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    work = Path(os.environ.get("LOUPE_WORK", "work")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{work / 'mlflow.db'}"


def git_state(cwd: str | Path = ".") -> dict[str, str]:
    """The commit and dirty flag of the code that ran ('unknown' outside a git checkout)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, check=True)
        return {"git_commit": commit.stdout.strip(), "git_dirty": str(bool(status.stdout.strip())).lower()}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": os.environ.get("LOUPE_GIT_COMMIT", "unknown"), "git_dirty": "unknown"}


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


class StageRun:
    """An open MLflow run of one stage."""

    def __init__(self, mlflow: Any, run: Any):
        self._mlflow = mlflow
        self.run = run
        self.run_id: str | None = run.info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        flat: dict[str, Any] = {}
        _flatten("", params, flat)
        # MLflow caps a value's length; long lists (benchmark specs) are kept readable, not rejected.
        self._mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        flat: dict[str, Any] = {}
        _flatten("", metrics, flat)
        numeric = {k.replace("@", "_at_"): float(v) for k, v in flat.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numeric:
            self._mlflow.log_metrics(numeric, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():  # keep the folder's name, as a file keeps its own
            self._mlflow.log_artifacts(str(path), artifact_path or path.name)
        elif path.is_file():
            self._mlflow.log_artifact(str(path), artifact_path)


class NullRun:
    """The stand-in when tracking is off: same methods, no effect."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...


def artifact_root() -> str | None:
    """Where a new experiment keeps artefacts: LOUPE_ARTIFACT_ROOT, else beside a SQLite store.

    MLflow's default for a database store is `./mlruns` under whatever folder the process started in, which
    scatters artefacts across working directories; beside the database they stay with the runs they belong to.
    """
    if os.environ.get("LOUPE_ARTIFACT_ROOT"):
        return os.environ["LOUPE_ARTIFACT_ROOT"]
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def _use_experiment(mlflow: Any, name: str) -> None:
    if mlflow.get_experiment_by_name(name) is None:
        mlflow.create_experiment(name, artifact_location=artifact_root())
    mlflow.set_experiment(name)


@contextmanager
def stage_run(stage: str, params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> Iterator[StageRun | NullRun]:
    """Open the stage's MLflow run (a child of LOUPE_PARENT_RUN_ID when set); yields a NullRun when off."""
    if not tracking_enabled():
        yield NullRun()
        return
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    _use_experiment(mlflow, os.environ.get(EXPERIMENT_ENV, DEFAULT_EXPERIMENT))
    parent = os.environ.get(PARENT_RUN_ENV)
    run_tags = {"loupe.stage": stage, **git_state(), **(tags or {})}
    if parent:
        run_tags["mlflow.parentRunId"] = parent
    with mlflow.start_run(run_name=stage, tags={k: str(v) for k, v in run_tags.items()}) as run:
        tracked = StageRun(mlflow, run)
        if params:
            tracked.log_params(params)
        yield tracked

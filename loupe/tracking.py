"""MLflow tracking for every stage: one run per stage, nested under the pipeline's run when there is one.

    with stage_run("eval", params={"eval": eval_params.model_dump()}) as run:
        run.log_metrics({"accuracy": 0.5}, step=3)
        run.log_artifact(out_dir / "metrics.json")

Where runs go:
- `MLFLOW_TRACKING_URI` when set (a server, `sqlite:///...`, S3-backed artefacts through the usual variables);
- else a SQLite store in the workspace, `sqlite:///<LOUPE_WORK or work>/mlflow.db`;
- artefacts of a new experiment go to `LOUPE_ARTIFACT_ROOT` (e.g. `s3://bucket/mlflow`, credentials and
  endpoint from the usual AWS variables) or beside the SQLite store;
- `LOUPE_TRACKING=off` turns tracking off: `stage_run` then yields a stand-in whose methods do nothing, so
  stage code never needs an `if` around a logging call (nanochat's DummyWandb idea).

The pipeline (`pipelines/flow.py`) opens a parent run with `pipeline_run` and hands its id to every stage in
`LOUPE_PARENT_RUN_ID`; a stage launched by it, by `dvc repro` alone or inside a container opens its run as a
child of that id when set. Every stage run is tagged with the stage name, the git commit and dirty flag, and,
when DVC launched it (DVC sets `DVC_STAGE` for every command), its lineage: the DVC md5 of each dependency and
output (the same hashes `dvc.lock` records, computed by DVC's own code), the md5 of its params sections, and
the task and SFT data sets it read as MLflow dataset inputs. So any number in MLflow traces back to its data,
model, code and parameters. `register_model` puts the final model in the model registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loupe.io import file_digest

PARENT_RUN_ENV = "LOUPE_PARENT_RUN_ID"
EXPERIMENT_ENV = "LOUPE_EXPERIMENT"
DEFAULT_EXPERIMENT = "loupe"
# A file the overhead benchmark names: each stage appends {"stage", "seconds"} of its own work (the time
# inside its `stage_run` block) to it.
STAGE_TIMINGS_ENV = "LOUPE_STAGE_TIMINGS"
# Outputs the pipeline writes itself; they make no difference to the code that ran.
_NOT_CODE = (":(exclude)dvc.lock", ":(exclude)work")


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
    """The commit and dirty flag of the code that ran ('unknown' outside a git checkout).

    Dirty means code or configuration differs from the commit; `dvc.lock` and the workspace's outputs do not
    count, or every run after the first would call itself dirty.
    """
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--", ".", *_NOT_CODE], cwd=cwd,
                                capture_output=True, text=True, check=True)
        return {"git_commit": commit.stdout.strip(), "git_dirty": str(bool(status.stdout.strip())).lower()}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": os.environ.get("LOUPE_GIT_COMMIT", "unknown"), "git_dirty": "unknown"}


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def digest(mapping: Any) -> str:
    """md5 of a JSON-able value (keys sorted): one hash naming a set of paths and their hashes, or params."""
    return hashlib.md5(json.dumps(mapping, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Lineage: what DVC knows about the running stage.


@dataclass
class DvcLineage:
    """A DVC stage's dependencies, params and outputs as `dvc.lock` records them (path -> md5)."""

    stage: str
    deps: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    outs: dict[str, str] = field(default_factory=dict)
    dep_files: dict[str, Path] = field(default_factory=dict, repr=False)
    """Where each dependency lies on disk (absolute), for reading the data sets among them."""

    def dep_tags(self) -> dict[str, str]:
        tags = {f"dvc.dep.{path}": md5 for path, md5 in self.deps.items()}
        return {"dvc.stage": self.stage, **tags, "dvc.deps_md5": digest(self.deps),
                "dvc.params_md5": digest(self.params)}

    def out_tags(self) -> dict[str, str]:
        return {**{f"dvc.out.{path}": md5 for path, md5 in self.outs.items()}, "dvc.outs_md5": digest(self.outs)}


def _dvc_stage(name: str, root: str | Path | None = None) -> tuple[Any, Any]:
    """The DVC repository around `root` (the working directory) and its stage `name`; close the repo after."""
    from dvc.repo import Repo

    repo = Repo(Repo.find_root(str(root or os.getcwd())))
    return repo, repo.stage.collect(name)[0]


def _hashes(items: Any) -> dict[str, str]:
    from dvc.dependency.param import ParamsDependency

    hashes = {}
    for item in items:
        if not isinstance(item, ParamsDependency):
            info = item.get_hash()
            hashes[item.def_path] = info.value if info else "missing"
    return hashes


def dvc_lineage(stage: str | None = None, root: str | Path | None = None, outs: bool = True) -> DvcLineage | None:
    """Hash the stage's dependencies (and outputs) with DVC's own code; None when DVC did not launch us.

    Uses DVC's Python API rather than re-deriving its directory-hash format, so the hashes are exactly those of
    `dvc.lock` (`.dvcignore` honoured, templated paths resolved). Reading needs no repository lock, so this
    works inside a command that `dvc repro` is running.
    """
    stage = stage or os.environ.get("DVC_STAGE")
    if not stage:
        return None
    from dvc.dependency.param import ParamsDependency

    repo, dvc_stage = _dvc_stage(stage, root)
    try:
        lineage = DvcLineage(stage=dvc_stage.addressing, deps=_hashes(dvc_stage.deps))
        for dep in dvc_stage.deps:
            if isinstance(dep, ParamsDependency):
                lineage.params.update(dep.read_params())
            else:
                lineage.dep_files[dep.def_path] = Path(dep.fs_path)
        if outs:
            lineage.outs = _hashes(dvc_stage.outs)
        return lineage
    finally:
        repo.close()


def lock_lineage(stage: str, lock_path: str | Path = "dvc.lock") -> DvcLineage | None:
    """The stage's entry in dvc.lock (what DVC recorded after its last run); None when absent."""
    import yaml

    lock_path = Path(lock_path)
    if not lock_path.is_file():
        return None
    entry = (yaml.safe_load(lock_path.read_text()) or {}).get("stages", {}).get(stage)
    if not entry:
        return None
    lineage = DvcLineage(stage=stage)
    lineage.deps = {d["path"]: d.get("md5", "missing") for d in entry.get("deps", [])}
    lineage.outs = {o["path"]: o.get("md5", "missing") for o in entry.get("outs", [])}
    for values in (entry.get("params") or {}).values():
        lineage.params.update(values)
    return lineage


# ---------------------------------------------------------------------------------------------------------
# Datasets as MLflow run inputs.


def _dataset_files(path: Path) -> list[tuple[str, Path, str]]:
    """(name, file, format) of the data sets a dependency holds: LLaMA-Factory sharegpt sets and task JSONL."""
    if path.is_dir() and (path / "dataset_info.json").is_file():
        info = json.loads((path / "dataset_info.json").read_text(encoding="utf-8"))
        return [(name, path / spec["file_name"], spec.get("formatting", "alpaca"))
                for name, spec in info.items() if isinstance(spec, dict) and "file_name" in spec]
    if path.is_dir() and not (path / "__init__.py").exists() and not (path / "config.json").exists():
        return [(f"{path.name}/{f.stem}", f, "tasks") for f in sorted(path.glob("*.jsonl"))]
    if path.is_file() and path.suffix == ".jsonl":
        return [(path.stem, path, "tasks")]
    return []


def _records(file: Path, fmt: str) -> int:
    if fmt == "tasks" or file.suffix == ".jsonl":
        with file.open("rb") as f:
            return sum(1 for line in f if line.strip())
    data = json.loads(file.read_text(encoding="utf-8"))
    return len(data) if isinstance(data, list) else 1


# ---------------------------------------------------------------------------------------------------------
# Runs.


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

    def log_dataset(self, path: str | Path, context: str, name: str | None = None, digest: str | None = None) -> None:
        """Record a data file (task JSONL, sharegpt JSON) as an input of this run, with its md5 as digest."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource

        path = Path(path).resolve()
        fmt = "tasks" if path.suffix == ".jsonl" else "sharegpt"
        dataset = MetaDataset(LocalArtifactDatasetSource(str(path)), name=name or path.stem,
                              digest=(digest or file_digest(path, "md5"))[:32])
        self._mlflow.log_input(dataset, context=context,
                               tags={"format": fmt, "records": str(_records(path, fmt))})


class NullRun:
    """The stand-in when tracking is off: same methods, no effect."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_dataset(self, path: str | Path, context: str, name: str | None = None, digest: str | None = None) -> None: ...


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


def _mlflow() -> Any:
    # MLflow 3 sends usage telemetry by default; a pipeline run should not phone home.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    _use_experiment(mlflow, os.environ.get(EXPERIMENT_ENV, DEFAULT_EXPERIMENT))
    return mlflow


def _record_timing(stage: str, seconds: float) -> None:
    path = os.environ.get(STAGE_TIMINGS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"stage": stage, "seconds": round(seconds, 3)}) + "\n")


def _log_lineage_inputs(tracked: StageRun, lineage: DvcLineage) -> None:
    tracked.set_tags(lineage.dep_tags())
    flat: dict[str, Any] = {}
    _flatten("", lineage.params, flat)
    # Under a prefix of their own: a stage logging its section itself must not clash with these keys.
    tracked.log_params({f"dvc.params.{k}": v for k, v in flat.items()})
    for path in lineage.dep_files.values():
        for name, file, _fmt in _dataset_files(path):
            tracked.log_dataset(file, context=lineage.stage, name=name)


@contextmanager
def stage_run(stage: str, params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> Iterator[StageRun | NullRun]:
    """Open the stage's MLflow run (a child of LOUPE_PARENT_RUN_ID when set); yields a NullRun when off.

    Under DVC the run also gets the lineage tags and data set inputs at its start, and its outputs' hashes at
    a successful end (the outputs are complete once the stage's block has returned).
    """
    if not tracking_enabled():
        started = time.perf_counter()
        yield NullRun()
        _record_timing(stage, time.perf_counter() - started)
        return
    mlflow = _mlflow()
    parent = os.environ.get(PARENT_RUN_ENV)
    run_tags = {"loupe.stage": stage, **git_state(), **(tags or {})}
    if os.environ.get("LOUPE_PARAMS_OVERRIDES"):  # loupe.config.OVERRIDES_ENV: key.path=value given on the command line
        run_tags["loupe.overrides"] = os.environ["LOUPE_PARAMS_OVERRIDES"]
    if parent:
        run_tags["mlflow.parentRunId"] = parent
    with mlflow.start_run(run_name=stage, tags={k: str(v) for k, v in run_tags.items()}) as run:
        tracked = StageRun(mlflow, run)
        if params:
            tracked.log_params(params)
        lineage = _safely(tracked, lambda: dvc_lineage(outs=False))
        if lineage is not None:
            _log_lineage_inputs(tracked, lineage)
        # The stage's own work: what runs inside the block (tracking set-up and lineage hashing do not count).
        started = time.perf_counter()
        yield tracked
        seconds = time.perf_counter() - started
        tracked.set_tags({"loupe.stage_seconds": f"{seconds:.3f}"})
        finished = _safely(tracked, lambda: dvc_lineage(lineage.stage)) if lineage is not None else None
        if finished is not None:
            tracked.set_tags(finished.out_tags())
            mlflow.log_dict({"stage": finished.stage, "deps": finished.deps, "params": finished.params,
                             "outs": finished.outs, **git_state()}, "lineage.json")
    _record_timing(stage, seconds)


def _safely(tracked: StageRun, compute: Any) -> DvcLineage | None:
    """Lineage is bookkeeping: when DVC cannot answer (no dvc.yaml where the stage runs), the stage still
    runs, and its run says why it has no hashes rather than failing the work."""
    try:
        return compute()
    except Exception as err:  # noqa: BLE001 - any DVC failure means "no lineage", never a failed stage
        message = f"{type(err).__name__}: {err}"[:500]
        tracked.set_tags({"dvc.lineage_error": message})
        print(f"tracking: no DVC lineage ({message})", flush=True)
        return None


@contextmanager
def pipeline_run(name: str = "pipeline", params: dict[str, Any] | None = None,
                 tags: dict[str, Any] | None = None) -> Iterator[StageRun | NullRun]:
    """Open the pipeline's parent run and export its id in LOUPE_PARENT_RUN_ID for every stage process."""
    if not tracking_enabled():
        yield NullRun()
        return
    mlflow = _mlflow()
    previous = os.environ.get(PARENT_RUN_ENV)
    run_tags = {"loupe.stage": name, "loupe.pipeline": "true", **git_state(), **(tags or {})}
    with mlflow.start_run(run_name=name, tags={k: str(v) for k, v in run_tags.items()}) as run:
        os.environ[PARENT_RUN_ENV] = run.info.run_id
        try:
            tracked = StageRun(mlflow, run)
            if params:
                tracked.log_params(params)
            yield tracked
        finally:
            if previous is None:
                os.environ.pop(PARENT_RUN_ENV, None)
            else:
                os.environ[PARENT_RUN_ENV] = previous


def find_stage_run(stage: str, parent_run_id: str | None = None, outs_md5: str | None = None) -> Any | None:
    """The latest run of `stage` under a parent run, or the one whose outputs hash to `outs_md5`."""
    if not tracking_enabled():
        return None
    mlflow = _mlflow()
    clauses = [f"tags.`loupe.stage` = '{stage}'", "attributes.status = 'FINISHED'"]
    if parent_run_id:
        clauses.append(f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    if outs_md5:
        clauses.append(f"tags.`dvc.outs_md5` = '{outs_md5}'")
    runs = mlflow.search_runs(filter_string=" and ".join(clauses), order_by=["attributes.start_time DESC"],
                              max_results=1, output_format="list")
    return runs[0] if runs else None


def register_model(model_dir: str | Path, name: str, run_id: str, tags: dict[str, Any] | None = None) -> Any:
    """Log `model_dir` as the run's `model` artefact and register it as a new version of model `name`.

    The registry entry points at the run's copy (local, or S3 under LOUPE_ARTIFACT_ROOT), so the version stays
    loadable after the workspace moves on: `mlflow.artifacts.download_artifacts("models:/<name>/<version>")`.
    """
    mlflow = _mlflow()
    client = mlflow.MlflowClient()
    client.log_artifacts(run_id, str(model_dir), "model")
    if client.search_registered_models(filter_string=f"name = '{name}'") == []:
        client.create_registered_model(name, description="Loupe's final model: the pipeline's last training stage.")
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    return client.create_model_version(name, source=source, run_id=run_id,
                                       tags={k: str(v) for k, v in (tags or {}).items()})

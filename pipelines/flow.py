"""The Prefect flow that drives Loupe's pipeline: one task per DVC stage, in dvc.yaml's order.

Each task runs `dvc repro <stage>`: DVC decides whether the stage runs (inputs, code or params changed),
is skipped (nothing changed) or is restored from its run cache; Prefect's own result caching is off, so it
never second-guesses DVC. A task streams the stage's log (raw to the console, line by line to the Prefect
API), retries a failed stage `pipeline.retries` times (never one that exited 2: bad input fails again), and
the flow ends with a summary table: stage, ran or skipped, seconds, key metrics, outputs, MLflow run.

MLflow: the flow opens the parent run and hands its id to every stage (LOUPE_PARENT_RUN_ID); each stage opens
its child run with lineage tags (loupe/tracking.py); at the end the final model is registered (once per
distinct model) and, when a default DVC remote is set, the outputs are pushed to it.

Launch:
    loupe run                                        (or: make run) the whole chain, ephemeral Prefect
    python -m pipelines.flow [--stages sft rl] [--force]
    python -m pipelines.flow --eval-model DIR --out work/eval-mine     eval of any model directory
With PREFECT_API_URL set the flow reports to that Prefect server; otherwise Prefect starts a temporary one
(its database under work/prefect). `prefect deploy --all` registers prefect.yaml's deployments.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path


def prefect_environment(root: Path) -> None:
    """Prefect's settings for a laptop run; call before Prefect is imported (it reads them at import).

    The home (its SQLite database) stays in the workspace; a fresh home's migrations take longer than the
    default 20 s start-up allowance of the temporary server (DESIGN.md section 7), and analytics stay off.
    The memo store is named too: its default ignores PREFECT_HOME (prefect/settings/models/_defaults.py,
    default_memo_store_path) and warns on every run when ~/.prefect is missing. MLflow's INFO records (its
    database migrations on the first run) stay off the terminal. An explicit setting in the environment
    always wins.
    """
    os.environ.setdefault("PREFECT_HOME", str(root / "work" / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes only the last level
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(Path(os.environ["PREFECT_HOME"]) / "memo_store.toml"))
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")


# Prefect reads its settings when first imported, so they are set before the imports below.
prefect_environment(Path.cwd())

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.logging.handlers import APILogHandler
from prefect.runtime import task_run as task_runtime

from loupe.config import load_section
from loupe.tracking import (
    digest,
    find_stage_run,
    lock_lineage,
    pipeline_run,
    register_model,
)
from pipelines.dvc_runner import (
    FAILED,
    StageFailed,
    StageResult,
    configure_remote_from_env,
    default_remote,
    dvc_text,
    repro_stage,
    stage_environment,
    stage_names,
    stream_output,
)
from pipelines.params import PipelineParams
from pipelines.summary import comparison_text, format_table, summary_rows

LOG_DIR = Path("work") / "logs"
"""Each stage's whole output (`<stage>.log`, appended run after run) and the flow's own log (`flow.log`)."""


def stage_log_path(root: Path, stage: str) -> Path:
    """Where a stage's whole output goes: what `dvc repro` printed, libraries' records included."""
    return root / LOG_DIR / f"{stage}.log"


def log_prefect_to_file(root: Path) -> Path:
    """Prefect's own records (the temporary server, flow and task states) into `work/logs/flow.log`; its
    console handler shows warnings and errors only (pipelines/cli.py sets PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL
    before Prefect is imported)."""
    path = root / LOG_DIR / "flow.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("prefect")
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in logger.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
    return path


def _stage_log_to_api() -> logging.Logger:
    """A logger that sends the stage's lines to the Prefect API only: the console already has them raw."""
    logger = logging.getLogger("loupe.stage_log")
    if not logger.handlers:
        logger.addHandler(APILogHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _worth_retrying(task, task_run, state) -> bool:
    """Retry crashes and failures, not bad input (exit status 2, the stage contract's 'fix your input')."""
    error = state.data
    return not (isinstance(error, StageFailed) and error.result.exit_status == 2)


@task(cache_policy=NO_CACHE, persist_result=False, retry_condition_fn=_worth_retrying)
def dvc_stage(stage: str, root: str, single_item: bool = True, force: bool = False) -> StageResult:
    """Run one stage through `dvc repro`; the result says whether it ran, was skipped or restored."""
    get_run_logger().info("dvc repro %s", stage)
    api_log = _stage_log_to_api()
    result = repro_stage(stage, Path(root), stage_environment(), on_line=api_log.info, single_item=single_item,
                         force=force, log_path=stage_log_path(Path(root), stage))
    result.attempts = task_runtime.run_count
    get_run_logger().info("stage %s: %s in %.1f s", stage, result.status, result.seconds)
    return result


def _stage_runs(root: Path, results: list[StageResult], parent_id: str | None) -> dict[str, str | None]:
    """The MLflow run behind each stage's current outputs: this flow's child run when the stage ran, else the
    earlier run whose output hashes match dvc.lock."""
    runs: dict[str, str | None] = {}
    for result in results:
        run = None
        if result.status == "ran" and parent_id:
            run = find_stage_run(result.stage, parent_run_id=parent_id)
        elif result.status != FAILED:
            lock = lock_lineage(result.stage, root / "dvc.lock")
            run = find_stage_run(result.stage, outs_md5=digest(lock.outs)) if lock else None
        if run is not None and result.status == "ran" and "dvc.outs_md5" not in run.data.tags:
            _backfill_lineage(root, result.stage, run.info.run_id)
        runs[result.stage] = run.info.run_id if run else None
    return runs


def _backfill_lineage(root: Path, stage: str, run_id: str) -> None:
    """A stage run in a container image (no DVC there) has no hash tags: give its run dvc.lock's, which DVC
    wrote right after the stage finished, so its numbers trace back like any other stage's."""
    lock = lock_lineage(stage, root / "dvc.lock")
    if lock is None:
        return
    import mlflow

    tags = {**lock.dep_tags(), **lock.out_tags(), "dvc.lineage_source": "dvc.lock"}
    mlflow.MlflowClient().log_batch(run_id, tags=[mlflow.entities.RunTag(k, str(v)) for k, v in tags.items()])


def _register_final_model(root: Path, params: PipelineParams, runs: dict[str, str | None], parent: object) -> str | None:
    """Register the final model once per distinct model (the run that produced it holds the copy)."""
    model_dir = root / params.model_path
    run_id = runs.get(params.model_stage)
    lock = lock_lineage(params.model_stage, root / "dvc.lock")
    if not params.register_model or run_id is None or lock is None or not model_dir.is_dir():
        return None
    import mlflow

    client = mlflow.MlflowClient()
    existing = client.search_model_versions(f"name = '{params.model_name}' and run_id = '{run_id}'")
    if existing:
        return f"{params.model_name} v{existing[0].version} (already registered)"
    tags = {"dvc.md5": lock.outs.get(params.model_path, "unknown"), "dvc.stage": params.model_stage,
            "loupe.pipeline_run": getattr(parent, "run_id", None) or "-"}
    for dep, md5 in lock.deps.items():  # its inputs (data, base model), not its code (the commit names that)
        if dep != "loupe" and dep.split("/")[0] not in ("stages", "pipelines"):
            tags[f"dvc.dep.{dep}"] = md5
    eval_lock = lock_lineage("eval", root / "dvc.lock")
    if eval_lock is not None and eval_lock.deps.get(params.model_path) == tags["dvc.md5"]:
        tags.update(_eval_tags(root / "work" / "eval", params.model_path))
    version = register_model(model_dir, params.model_name, run_id, tags)
    return f"{params.model_name} v{version.version}"


def _eval_tags(eval_dir: Path, model_path: str) -> dict[str, float]:
    """The eval stage's numbers for the model at `model_path` (the comparison's column whose own metrics.json
    names that path): accuracy, its interval and pass@K per benchmark, as `eval.synthetic.accuracy`. MLflow's
    tag names allow no "@": pass@4 becomes pass_at_4, as in the runs' metric names."""
    import json

    try:
        comparison = json.loads((eval_dir / "metrics.json").read_text())
        names = [n for n in comparison["models"]
                 if json.loads((eval_dir / n / "metrics.json").read_text()).get("model") == model_path]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    tags = {}
    for benchmark in comparison["benchmarks"] if names else []:
        for key, value in comparison[benchmark][names[0]].items():
            if isinstance(value, (int, float)):
                tags[f"eval.{benchmark}.{key}".replace("@", "_at_")] = value
    return tags


@flow(name="loupe-pipeline", persist_result=False)
def loupe_pipeline(stages: list[str] | None = None, force: bool = False, root: str = ".") -> list[dict]:
    """Bring every stage of dvc.yaml up to date (or the chosen ones, with what they depend on)."""
    root_path = Path(root).resolve()
    params = load_section(PipelineParams, "pipeline", root_path / "params.yaml")
    known = stage_names(root_path)
    unknown = sorted(set(stages or []) - set(known))
    if unknown:
        raise ValueError(f"dvc.yaml: no stage named {', '.join(unknown)} (stages: {', '.join(known)})")
    chosen = [s for s in known if s in stages] if stages else known
    # The whole chain in order: each task runs its stage alone. A subset: each brings its inputs up to date,
    # unless forced (DVC's --force would rerun everything upstream too; forcing means exactly these stages).
    single_item = chosen == known or force
    results: list[StageResult] = []
    failure: StageFailed | None = None
    remote_url = configure_remote_from_env(root_path)
    with pipeline_run("pipeline", params={"pipeline": params.model_dump(mode="json")},
                      tags={"loupe.stages": ",".join(chosen)}) as parent:
        for stage in chosen:
            runner = dvc_stage.with_options(name=f"stage-{stage}", retries=params.retries,
                                            retry_delay_seconds=params.retry_delay_s)
            state = runner(stage, str(root_path), single_item, force, return_state=True)
            if state.is_failed():
                error = state.result(raise_on_failure=False)
                failure = error if isinstance(error, StageFailed) else StageFailed(
                    StageResult(stage, FAILED, 0.0, -1, None, repr(error)))
                results.append(failure.result)
                break
            results.append(state.result())
        runs = _stage_runs(root_path, results, parent.run_id)
        registered = None if failure else _register_final_model(root_path, params, runs, parent)
        pushed = None
        if failure is None and params.push and default_remote(root_path):
            dvc_text(root_path, "push", env=stage_environment())
            pushed = remote_url or default_remote(root_path)
        rows = summary_rows(root_path, results, runs)
        for result in results:
            parent.log_metrics({f"stage.{result.stage}.seconds": result.seconds})
            parent.set_tags({f"stage.{result.stage}.status": result.status,
                             f"stage.{result.stage}.run": runs.get(result.stage) or "-"})
        if registered:
            parent.set_tags({"loupe.registered_model": registered})
        _log_files(parent, root_path, rows)
        print("\n" + format_table(rows))
        if any(r.stage == "eval" for r in results) and (comparison := comparison_text(root_path)):
            print("\n" + comparison)
        if registered:
            print(f"registered model: {registered}")
        if pushed:
            print(f"outputs pushed to the DVC remote ({pushed})")
        if failure is not None:
            raise failure  # inside the parent run: MLflow marks it FAILED
    return rows


def _log_files(parent: object, root: Path, rows: list[dict]) -> None:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        summary.write_text(json.dumps(rows, indent=2, default=str))
        parent.log_artifact(summary)
    for name in ("dvc.lock", "params.yaml", "dvc.yaml"):
        parent.log_artifact(root / name)


@flow(name="loupe-eval-model", persist_result=False)
def eval_model(model: str, out: str = "work/eval-model", root: str = ".") -> dict:
    """Evaluate any model directory with the eval stage and params.yaml's eval section (outside DVC's DAG)."""
    import json

    root_path = Path(root).resolve()
    command = [sys.executable, "-m", "stages.eval", "--params", "params.yaml", "--model", model, "--out", out]
    api_log = _stage_log_to_api()
    with pipeline_run("eval-model", params={"model": model, "out": out}) as parent:
        process = subprocess.Popen(command, cwd=root_path, env=stage_environment(), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        stream_output(process, api_log.info, echo=True)
        if process.wait() != 0:
            raise RuntimeError(f"eval of {model} failed with exit status {process.returncode}")
        metrics = json.loads((root_path / out / "metrics.json").read_text())
        parent.log_artifact(root_path / out / "metrics.json")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.flow", description=__doc__.split("\n")[0])
    parser.add_argument("--stages", nargs="+", help="only these stages (and what they depend on)")
    parser.add_argument("--force", action="store_true", help="rerun the stages even when nothing changed")
    parser.add_argument("--eval-model", help="instead: evaluate this model directory")
    parser.add_argument("--out", default="work/eval-model", help="output folder of --eval-model")
    args = parser.parse_args(argv)
    try:
        if args.eval_model:
            eval_model(args.eval_model, args.out)
        else:
            loupe_pipeline(args.stages, args.force)
    except StageFailed as err:
        print(f"pipeline: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

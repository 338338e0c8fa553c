"""Write the cold-start SFT set: teacher trajectories through the shared rollout loop, filtered, as a LLaMA-Factory dataset.

Reads the `synth` section of params.yaml (plus `seed`, `protocol` and, for the openai teacher, `rollout`). The
teacher (`synth.teacher`) is `oracle` (synthetic tasks with known target boxes), `openai` (any
OpenAI-compatible VLM) or `import` (a publisher's cold-start set, `synth.import`). Each trajectory is
scored by loupe.rewards and kept only if it passes rejection (stages/synth/rejection.py). Writes into --out:

    dataset/                 the LLaMA-Factory dataset folder (`dataset_dir` for the sft stage): loupe_synth.json,
                             dataset_info.json, index.jsonl, images/
    shards/                  finished shards of trajectories, kept and rejected (a rerun resumes after them)
    metrics.json             acceptance rate, rejection reasons, turns histogram, end reasons, teacher usage/cost
    plots/turns.json|png     turns histogram (all vs kept);  plots/rejections.json|png  rejections by reason
    viewer.html              a sample of kept (and some rejected) trajectories with every crop

Launch:
    python -m stages.synth --params params.yaml --tasks work/data/tasks --out work/synth
The import teacher needs no --tasks. A killed run leaves finished shards and the previous dataset (or none);
rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loupe.config import (
    ParamsError,
    ProtocolParams,
    RolloutParams,
    load_section,
    load_seed,
    params_with_overrides,
)
from loupe.data.tasks import TaskRecord, read_tasks
from loupe.io import atomic_write_json
from loupe.protocol import Protocol, make_protocol
from loupe.rewards import build_judge, score_trajectory
from loupe.rollout import run_rollouts
from loupe.rollout.openai_engine import EndpointError, UsageCounter
from loupe.tracking import stage_run
from loupe.trajectory import Trajectory
from loupe.viewer import render_html
from stages.synth.dataset import ShardStore, write_llamafactory_dataset
from stages.synth.params import SynthParams
from stages.synth.rejection import RejectionRules, rejection_reason
from stages.synth.report import is_kept, summarize, summary_lines, write_plots


def synthesize(params_path: Path, tasks: Path | None, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Run the stage inside its MLflow run; returns the metrics written to metrics.json."""
    seed = load_seed(params_path)
    params = load_section(SynthParams, "synth", params_path)
    protocol = load_section(ProtocolParams, "protocol", params_path)
    rollout = load_section(RolloutParams, "rollout", params_path)
    tracked: dict[str, Any] = {
        "synth": params.model_dump(mode="json", by_alias=True),
        "protocol": protocol.model_dump(mode="json"),
        "seed": seed,
        "tasks": str(tasks),
    }
    if params.teacher == "openai":  # the endpoint's settings name the key's variable, never the key
        tracked["rollout"] = {"openai": rollout.openai.model_dump(mode="json"), "temperature": rollout.temperature}
    with stage_run("synth", params=tracked) as run:
        metrics = _synthesize(seed, params, protocol, rollout, tasks, out_dir, progress)
        run.log_metrics({k: v for k, v in metrics.items() if k not in ("teacher",)})
        for artefact in ("metrics.json", "viewer.html", "plots", "dataset/dataset_info.json"):
            run.log_artifact(out_dir / artefact)
        return metrics


def _synthesize(seed: int, params: SynthParams, protocol_params: ProtocolParams, rollout: RolloutParams,
                tasks_path: Path | None, out_dir: Path, progress: bool) -> dict[str, Any]:
    started = time.perf_counter()
    protocol = make_protocol(protocol_params)
    max_turns = params.max_turns or protocol_params.max_turns
    rules = RejectionRules.from_params(protocol_params, max_turns, params.keep_format_errors, params.require_think,
                                       params.min_tool_calls, params.import_.keep)
    fingerprint: dict[str, Any] = {
        "code": _code_digest(),
        "seed": seed,
        "synth": params.model_dump(mode="json", by_alias=True, exclude={"viewer_trajectories"}),
        "protocol": protocol_params.model_dump(mode="json"),
    }
    usage: dict[str, Any] | None = None
    if params.teacher == "import":
        from stages.synth.importer import data_files

        files = data_files(params.import_.path, params.import_.format)  # type: ignore[arg-type]
        fingerprint["files"] = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        store = ShardStore(out_dir / "shards", fingerprint)
        shards = _import_shards(params, protocol, protocol_params, rules, store, progress)
    else:
        if tasks_path is None:
            raise FileNotFoundError(f"the {params.teacher} teacher needs --tasks (a task folder or .jsonl file)")
        tasks, image_root, task_file = _read_tasks(tasks_path, params)
        fingerprint["tasks"] = [str(task_file.resolve()), hashlib.sha256(task_file.read_bytes()).hexdigest()]
        max_new_tokens = params.max_new_tokens or rollout.max_new_tokens
        fingerprint["max_new_tokens"] = max_new_tokens
        if params.teacher == "openai":
            fingerprint["rollout"] = rollout.model_dump(mode="json", include={"openai", "temperature", "top_p"})
        store = ShardStore(out_dir / "shards", fingerprint)
        shards, usage = _rollout_shards(seed, params, protocol, protocol_params, rollout, rules, tasks, image_root,
                                        max_new_tokens, store, progress)

    trajectories = [t for index in range(shards) for t in store.read(index)[0]]
    kept = [t for t in trajectories if is_kept(t)]
    dataset = write_llamafactory_dataset(kept, out_dir / "dataset")
    metrics = summarize(trajectories, dataset, params.teacher)
    if usage is not None:
        metrics["teacher_usage"] = usage
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    write_plots(metrics, out_dir / "plots")
    render_html(_viewer_sample(trajectories, params.viewer_trajectories), out_dir / "viewer.html",
                title=f"Synth ({params.teacher}): a sample of the teacher's trajectories")
    atomic_write_json(out_dir / "metrics.json", metrics)
    return metrics


def _code_digest() -> str:
    """A digest of the code that writes trajectories (this package and loupe/): shards made by other code are
    not resumed from, so a fix to a teacher or the crop tool always reaches the dataset."""
    import loupe
    import stages.synth

    digest = hashlib.sha256()
    for package in (Path(stages.synth.__file__).parent, Path(loupe.__file__).parent):
        for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
            digest.update(str(path.relative_to(package.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _read_tasks(path: Path, params: SynthParams) -> tuple[list[TaskRecord], Path, Path]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: task folder or file not found")
    task_file = path / f"{params.split}.jsonl" if path.is_dir() else path
    if not task_file.is_file():
        raise FileNotFoundError(f"{task_file}: task file not found (synth.split is {params.split!r})")
    tasks = read_tasks(task_file, check_images=True)
    tasks = tasks[: params.limit] if params.limit else tasks
    if not tasks:
        raise ValueError(f"{task_file}: no tasks to synthesise from")
    return tasks, task_file.parent, task_file


def _make_teacher(seed: int, params: SynthParams, protocol: Protocol, rollout: RolloutParams, max_turns: int) -> Any:
    if params.teacher == "oracle":
        from stages.synth.oracle import OracleEngine

        return OracleEngine(params.oracle, protocol, seed, max_turns)
    from stages.synth.teacher_openai import build_openai_teacher

    return build_openai_teacher(rollout.openai, params.openai, protocol, rollout.temperature, rollout.top_p, seed)


def _judge_and_filter(trajectories: list[Trajectory], params: SynthParams, protocol: Protocol,
                      rules: RejectionRules, judge: Any) -> None:
    for trajectory in trajectories:
        if not trajectory.meta.get("imported"):
            score_trajectory(trajectory, params.reward, judge)
        reason = rejection_reason(trajectory, protocol, rules)
        trajectory.meta["synth"] = {"kept": reason is None, "reason": reason}


def _rollout_shards(seed: int, params: SynthParams, protocol: Protocol, protocol_params: ProtocolParams,
                    rollout: RolloutParams, rules: RejectionRules, tasks: list[TaskRecord], image_root: Path,
                    max_new_tokens: int, store: ShardStore, progress: bool) -> tuple[int, dict[str, Any] | None]:
    """Generate every unfinished shard of tasks; returns the shard count and (openai) this run's usage."""
    chunks = [tasks[i : i + params.shard_tasks] for i in range(0, len(tasks), params.shard_tasks)]
    todo = [i for i in range(len(chunks)) if not store.is_done(i)]
    samples = params.samples_per_task
    finished = sum(len(chunk) for i, chunk in enumerate(chunks) if i not in todo) * samples
    bar = tqdm(total=len(tasks) * samples, initial=finished, desc=f"synth {params.teacher}", unit="traj",
               disable=not progress)
    # Kept so far over every shard, finished ones included: the bar's count is the run's, not the last shard's.
    total_kept = sum(store.manifest(i).get("kept", 0) for i in range(len(chunks)) if i not in todo)
    engine = _make_teacher(seed, params, protocol, rollout, rules.max_turns) if todo else None
    judge = build_judge(params.reward) if todo else None
    try:
        for index in todo:
            chunk = chunks[index]
            if params.teacher == "oracle":
                engine.prepare(chunk, samples, image_root)
            trajectories = run_rollouts(chunk, engine, protocol_params, image_root, samples_per_task=samples,
                                        max_turns=rules.max_turns, max_new_tokens=max_new_tokens)
            for trajectory in trajectories:
                trajectory.meta["teacher"] = params.teacher
                if params.teacher == "oracle":
                    trajectory.meta["pattern"] = engine.patterns.get((trajectory.task["doc_id"], trajectory.sample_index))
            _judge_and_filter(trajectories, params, protocol, rules, judge)
            kept = sum(is_kept(t) for t in trajectories)
            store.write(index, trajectories, {"index": index, "tasks": [t.doc_id for t in chunk],
                                              "trajectories": len(trajectories), "kept": kept})
            total_kept += kept
            bar.update(len(trajectories))
            bar.set_postfix(kept=total_kept)
    finally:
        bar.close()
        if engine is not None:
            engine.close()
        if judge is not None:
            judge.close()
    usage = None
    if params.teacher == "openai":
        from stages.synth.teacher_openai import usage_report

        usage = usage_report(engine.usage if engine is not None else UsageCounter(), params.openai)
    return len(chunks), usage


def _import_shards(params: SynthParams, protocol: Protocol, protocol_params: ProtocolParams,
                   rules: RejectionRules, store: ShardStore, progress: bool) -> int:
    """Convert every unfinished shard of parquet rows; returns the shard count."""
    from stages.synth.importer import iter_rows, row_to_trajectory

    settings = params.import_
    count = total_kept = 0
    bar = tqdm(desc="synth import", unit="row", disable=not progress)
    try:
        for index, rows in enumerate(iter_rows(settings.path, settings.batch_rows, settings.limit,  # type: ignore[arg-type]
                                               settings.format)):
            count = index + 1
            if store.is_done(index):
                total_kept += store.manifest(index).get("kept", 0)
                bar.update(len(rows))
                continue
            trajectories, files = [], {}
            for offset, row in enumerate(rows):
                trajectory, images = row_to_trajectory(row, index * settings.batch_rows + offset, protocol,
                                                       settings.system_prompt == "keep",
                                                       protocol_params.max_decode_pixels, settings.format,
                                                       Path(settings.image_dir) if settings.image_dir else None)
                trajectories.append(trajectory)
                files.update(images)
            _judge_and_filter(trajectories, params, protocol, rules, None)
            kept = sum(is_kept(t) for t in trajectories)
            store.write(index, trajectories, {"index": index, "rows": len(rows), "kept": kept}, files)
            total_kept += kept
            bar.update(len(rows))
            bar.set_postfix(kept=total_kept)
    finally:
        bar.close()
    return count


def _viewer_sample(trajectories: list[Trajectory], count: int, per_task: int = 4) -> list[Trajectory]:
    """Up to `per_task` kept trajectories of each task in turn (several searches of one image side by side, and
    few originals to decode), then up to a quarter of the page of rejected ones."""
    rejected = [t for t in trajectories if not is_kept(t)][: count // 4]
    room = max(0, count - len(rejected))
    shown: list[Trajectory] = []
    per_doc: dict[str, int] = {}
    for trajectory in trajectories:
        doc = str(trajectory.task.get("doc_id"))
        if len(shown) < room and is_kept(trajectory) and per_doc.get(doc, 0) < per_task:
            per_doc[doc] = per_doc.get(doc, 0) + 1
            shown.append(trajectory)
    return shown + rejected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.synth", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    parser.add_argument("--tasks", type=Path, default=None,
                        help="task folder (reads <synth.split>.jsonl) or a .jsonl file; oracle and openai teachers")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                        help="params set on top of the file, as in it (e.g. rl.lr=1e-6); recorded in MLflow")
    args = parser.parse_args(argv)
    try:
        args.params = params_with_overrides(args.params, args.overrides)
        metrics = synthesize(args.params, args.tasks, args.out, progress=not args.no_progress)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"synth: {err}", file=sys.stderr)
        return 2
    except EndpointError as err:
        print(f"synth: {err}; finished shards are kept, rerun to resume", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(metrics, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`loupe`: the project's command line.

    loupe run [--params params.yaml] [--work work]   build what is missing and run the pipeline on it
    loupe model tiny --out DIR [--seed N]            build the embedded tiny Qwen2.5-VL offline
    loupe data synthetic --out DIR [--params ...]    write the synthetic visual-search task set
    loupe view TRAJECTORIES.jsonl --out page.html    a self-contained HTML page of trajectories with crops

Each stage also runs alone: `python -m stages.eval --help`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loupe.config import ModelParams, ParamsError, load_section


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from loupe.models.tiny import build_tiny_model

    started = time.perf_counter()
    path = build_tiny_model(args.out, seed=args.seed)
    print(f"tiny model: {path} (built in {time.perf_counter() - started:.1f} s)")
    return 0


def _cmd_data_synthetic(args: argparse.Namespace) -> int:
    from loupe.data.synthetic import SyntheticConfig, generate_tasks

    config = load_section(SyntheticConfig, "data", args.params)
    started = time.perf_counter()
    splits = generate_tasks(args.out, config, progress=True)
    for split, path in splits.items():
        print(f"{split}: {path}")
    print(f"synthetic tasks written in {time.perf_counter() - started:.1f} s")
    return 0


def _cmd_view(args: argparse.Namespace) -> int:
    from loupe.viewer import view_file

    path = view_file(args.trajectories, args.out, max_trajectories=args.max)
    print(f"viewer: {path.resolve()}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """The embedded pipeline so far: tiny model and tasks when missing, then eval of the base model."""
    from loupe.data.synthetic import SyntheticConfig, generate_tasks
    from loupe.models.tiny import build_tiny_model
    from stages.eval.__main__ import evaluate

    work = Path(args.work)
    model = load_section(ModelParams, "model", args.params)
    model_path = Path(model.path)
    if not (model_path / "config.json").is_file():
        if not model.build_tiny:
            raise ParamsError(f"{args.params}: model.path: {model_path} has no model and model.build_tiny is false")
        print(f"building the tiny model at {model_path}")
        build_tiny_model(model_path, seed=model.tiny_seed)
    data_dir = work / "data" / "tasks"
    if not (data_dir / "test.jsonl").is_file():
        print(f"writing synthetic tasks to {data_dir}")
        generate_tasks(data_dir, load_section(SyntheticConfig, "data", args.params), progress=True)
    metrics = evaluate(Path(args.params), model_path, work / "eval")
    print(f"\nmodel: {model_path}\ntasks: {data_dir}")
    for name, m in metrics["benchmarks"].items():
        k = m["samples_per_question"]
        print(f"{name}: avg@{k} = {m[f'avg@{k}']}, answered {m['end_reasons']['answered']:.0%}")
    print(f"metrics: {work / 'eval' / 'metrics.json'}\ntrajectory viewer: {(work / 'eval' / 'viewer.html').resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loupe", description="Train and evaluate VLMs that think with images.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the pipeline on params.yaml's defaults")
    run.add_argument("--params", default="params.yaml")
    run.add_argument("--work", default="work", help="folder for everything the pipeline writes")
    run.set_defaults(func=_cmd_run)

    model = commands.add_parser("model", help="build models").add_subparsers(dest="kind", required=True)
    tiny = model.add_parser("tiny", help="build the embedded tiny Qwen2.5-VL offline")
    tiny.add_argument("--out", type=Path, required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_model_tiny)

    data = commands.add_parser("data", help="build task sets").add_subparsers(dest="kind", required=True)
    synthetic = data.add_parser("synthetic", help="write the synthetic visual-search tasks")
    synthetic.add_argument("--out", type=Path, required=True)
    synthetic.add_argument("--params", default="params.yaml")
    synthetic.set_defaults(func=_cmd_data_synthetic)

    view = commands.add_parser("view", help="render trajectories as a self-contained HTML page")
    view.add_argument("trajectories", type=Path)
    view.add_argument("--out", type=Path, required=True)
    view.add_argument("--max", type=int, default=None, help="show at most this many trajectories")
    view.set_defaults(func=_cmd_view)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"loupe: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

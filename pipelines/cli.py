"""`loupe`: the project's command line.

    loupe run [--params FILE] [--stages NAME ...] [--force] [KEY.PATH=VALUE ...]
                                                     the pipeline: Prefect flow over dvc.yaml, summary at the end;
                                                     a recipe's FILE, or any run with overrides (rl.lr=1e-6),
                                                     runs in work/runs/<name>/ (docs/recipes.md)
    loupe remote                                     LOUPE_DVC_REMOTE (s3://...) as the default DVC remote
    loupe model tiny --out DIR [--family qwen2_5_vl|qwen3_vl|qwen3_vl_moe|qwen3_5] [--perception-steps N]
                                                     build an embedded tiny model offline as params.yaml's
                                                     model section describes, with its hashes (make tiny-model)
    loupe data tasks --out DIR [--params ...]        write the task set params.yaml's `data` section names
    loupe data import FORMAT --train PATH... [--val PATH... | --val-benchmark NAME PATH | --val-size N]
                     [--test PATH...] [--image-dir DIR] --out DIR
                                                     a seed's published data set, as downloaded, as a task
                                                     folder (without a val split, 5% of --train held out,
                                                     seeded): r1v, r1v_eval, easyr1, lmm_r1, mini_o3,
                                                     deepeyes, pixel_reasoner (loupe/data/published/)
    loupe view TRAJECTORIES.jsonl --out page.html    a self-contained HTML page of trajectories with crops
    loupe serve --model DIR [--params FILE] [--host H] [--port P] [KEY.PATH=VALUE ...]
                                                     the model behind an OpenAI-compatible API with its zoom
                                                     loop run server-side, and a page at / (docs/serve.md)
    loupe stage NAME [--in-container] ARGS...        one stage, locally or in its image (LOUPE_CONTAINER)

Each stage also runs alone: `python -m stages.eval --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from loupe.config import OVERRIDES_ENV, ParamsError, load_section, read_params_file
from loupe.data.published import FORMATS


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from loupe.config import ModelParams
    from loupe.models.tiny_artifact import MANIFEST, build_artifact, build_settings

    model = load_section(ModelParams, "model", args.params)
    settings = build_settings(model.tiny_seed if args.seed is None else args.seed, model.tiny_text_hidden,
                              model.tiny_text_layers,
                              model.tiny_perception_steps if args.perception_steps is None else args.perception_steps,
                              args.family or model.tiny_family)
    from pipelines.dvc_runner import PINNED_CPU_KERNELS

    for name, value in PINNED_CPU_KERNELS.items():  # the kernels the stages compute with (torch is not loaded yet)
        os.environ.setdefault(name, value)
    started = time.perf_counter()
    command = "loupe model tiny " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["model", "tiny"] else ""
    manifest = build_artifact(args.out, settings, command=command, progress=True)
    accuracy = manifest["perception"].get("held_out_accuracy")
    print(f"tiny model: {args.out} ({settings}) built in {time.perf_counter() - started:.1f} s"
          + (f"; held-out colour accuracy {accuracy}" if accuracy is not None else "")
          + f"; file hashes in {args.out / MANIFEST}")
    return 0


def _cmd_data_tasks(args: argparse.Namespace) -> int:
    from loupe.data.families import DataParams, generate_family

    config = load_section(DataParams, "data", args.params)
    started = time.perf_counter()
    splits = generate_family(args.out, config, progress=True)
    for split, path in splits.items():
        print(f"{split}: {path}")
    print(f"{config.family} tasks written in {time.perf_counter() - started:.1f} s")
    return 0


def _cmd_data_import(args: argparse.Namespace) -> int:
    from loupe.data.recipe_formats import import_tasks

    sources = {split: paths for split, paths in (("train", args.train), ("val", args.val), ("test", args.test))
               if paths}
    if not sources and not args.val_benchmark:
        raise ValueError("data import: give at least one of --train, --val, --test, --val-benchmark")
    if args.val_size and (args.val or args.val_benchmark):
        raise ValueError("data import: --val and --val-benchmark give the validation split; --val-size holds one "
                         "out of --train: give one")
    keys = {k: v for k, v in (("prompt_key", args.prompt_key), ("answer_key", args.answer_key),
                              ("image_key", args.image_key), ("video_key", args.video_key)) if v is not None}
    if args.format != "easyr1" and (keys or args.videos != "keep"):
        raise ValueError(f"data import: --prompt-key, --answer-key, --image-key, --video-key and --videos are "
                         f"EasyR1's settings; the {args.format} reader reads its publisher's fields")
    options = {**keys, "videos": args.videos} if args.format == "easyr1" else {}
    given_val = args.val or args.val_benchmark or "train" not in sources
    val_size = 0.0 if given_val else (0.05 if args.val_size is None else args.val_size)
    started = time.perf_counter()
    written = import_tasks(args.format, sources, args.out, data_source=args.source, limit=args.limit,
                           val_size=val_size, seed=args.seed, image_dir=args.image_dir, options=options,
                           val_benchmarks=[(name, Path(path)) for name, path in args.val_benchmark or []],
                           progress=True)
    for split, path in written.items():
        print(f"{split}: {path}")
    print(f"{args.format} data imported in {time.perf_counter() - started:.1f} s; point pipeline.tasks (or an eval "
          f"benchmark's path) at {args.out}")
    return 0


def _cmd_view(args: argparse.Namespace) -> int:
    from loupe.viewer import view_file

    path = view_file(args.trajectories, args.out, max_trajectories=args.max)
    print(f"viewer: {path.resolve()}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from loupe.serve.main import serve_main

    return serve_main(args.model, args.params, args.host, args.port, args.overrides)


def _cmd_run(args: argparse.Namespace) -> int:
    """The whole pipeline through the Prefect flow (DVC decides what runs), then where to look further."""
    root = Path.cwd()
    if not (root / "dvc.yaml").is_file():
        raise FileNotFoundError(f"{root}: no dvc.yaml here; run `loupe run` from the repository root")
    # The flow and the stages come from this checkout (a clone beside the installed one runs its own code).
    sys.path.insert(0, str(root))
    from pipelines.params import PipelineParams

    repo = root
    # `--stages rl eval rl.lr=1e-6` hands the override to --stages (argparse's greedy list): take it back.
    overrides = [*args.overrides, *(s for s in args.stages or [] if "=" in s)]
    args.stages = [s for s in args.stages or [] if "=" not in s] or None
    if overrides:
        from pipelines.overrides import check_overrides

        check_overrides(repo, Path(args.params), overrides)
        os.environ[OVERRIDES_ENV] = " ".join(overrides)
    if overrides or Path(args.params).resolve() != (root / "params.yaml").resolve():
        # Another params file is a recipe: it runs in a DVC workspace of its own, with a dvc.yaml of its shape
        # (pipelines/workspace.py), so its caches and lock never mix with params.yaml's.
        from pipelines.workspace import prepare_workspace

        root = prepare_workspace(repo, Path(args.params), overrides=overrides)
        print(f"loupe: {args.params}{' with ' + ' '.join(overrides) if overrides else ''} runs in "
              f"{root.relative_to(repo)}/ (its own dvc.yaml, dvc.lock and work/)")
    elif not load_section(PipelineParams, "pipeline", root / "params.yaml").default_shape:
        raise ParamsError("params.yaml: pipeline.sft / pipeline.rl_stages change the stages, and dvc.yaml is written "
                          "for the default; put the recipe in its own file and run `loupe run --params FILE`")
    # Every section of every stage, now: a typo would otherwise surface when its stage starts, minutes in.
    from pipelines.overrides import check_params

    where = str(args.params) + (f" with {' '.join(overrides)}" if overrides else "")
    check_params(read_params_file(root / "params.yaml"), where)
    _check_stage_names(args.stages, root / "dvc.yaml")
    _check_task_folders(root, where)
    # Prefect's records go to work/logs/flow.log (pipelines.flow.log_prefect_to_file); the terminal shows its
    # warnings only. Read by Prefect's logging set-up when it is imported, so set first.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from pipelines.dvc_runner import StageFailed
    from pipelines.flow import LOG_DIR, log_prefect_to_file, loupe_pipeline

    log_prefect_to_file(root)
    os.chdir(root)  # DVC and the stages work in the workspace

    started = time.perf_counter()
    print("loupe: starting the Prefect flow (its local server takes 15-30 s to start; then each stage shows "
          f"its progress, and everything it prints goes to {LOG_DIR}/<stage>.log)", flush=True)
    try:
        rows = loupe_pipeline(stages=args.stages, force=args.force, root=str(root))
    except StageFailed as err:  # the summary above says which stage; its log tail says why
        print(f"loupe: {err}", file=sys.stderr)
        return 1
    ran = [r["stage"] for r in rows if r["status"].startswith("ran")]
    print(f"\n{len(rows)} stages in {time.perf_counter() - started:.0f} s; ran: {', '.join(ran) or 'none'}")
    print("Look further:")
    scripts = Path(sys.executable).parent
    if shutil.which("dvc") != str(scripts / "dvc"):  # `make run` does not put the venv on the shell's PATH
        print(f"  (the commands below are in {scripts}: run `source {scripts / 'activate'}` first)")
    print("  dvc metrics show                 every stage's metrics (dvc plots show: the curves, as HTML)")
    if root == repo:
        print("  make ui                          the MLflow UI on work/mlflow.db: the pipeline run and one child")
        print("                                   run per stage, with lineage tags, data sets and artefacts")
    else:
        where = root.relative_to(repo)
        print(f"  (in {where}/ for the two lines above and below: its own dvc.yaml, dvc.lock and work/)")
        print(f"  make ui WORK={where}/work       the MLflow UI on this recipe's runs")
    logs = sorted((root / LOG_DIR).glob("*.log"))
    if logs:
        print(f"  {f'{LOG_DIR}/<stage>.log':<32} everything each stage printed (LLaMA-Factory's, Ray's and DVC's")
        print(f"  {'':<32} records too); flow.log: Prefect's")
    for label, page in _viewer_pages(root / "work"):
        print(f"  {label} trajectories, turn by turn with every crop: {page.as_uri()}")
    comparison = root / "work" / "eval" / "plots" / "comparison.png"
    if comparison.is_file():
        print(f"  the models compared (accuracy with its interval, accuracy vs turn limit): {comparison.as_uri()}")
    return 0


def _check_task_folders(root: Path, where: str) -> None:
    """Refuse a task folder that is not there and that no stage makes (the data stage makes work/data/...), naming
    the command that makes it (`pipeline.tasks_from`), before Prefect's server starts."""
    from pipelines.params import PipelineParams

    pipeline = load_section(PipelineParams, "pipeline", root / "params.yaml")
    for folder in pipeline.task_folders():
        if Path(folder).as_posix().startswith("work/") or (root / folder).is_dir():
            continue
        how = (f"make it with: {pipeline.tasks_from}" if pipeline.tasks_from else
               "make it from the published files with `loupe data import FORMAT ... --out DIR`")
        raise FileNotFoundError(f"{where}: pipeline.tasks: {folder} is not a folder (a relative path is read from "
                                f"{root}, whose data/ is the repository's); {how} (docs/recipes.md, 'Your data')")


def _check_stage_names(names: list[str] | None, dvc_file: Path) -> None:
    """Refuse a `--stages` name dvc.yaml does not have, with the nearest one, before Prefect's server starts."""
    import difflib

    import yaml

    stages = list((yaml.safe_load(dvc_file.read_text()) or {}).get("stages", {}))
    for name in names or []:
        if name not in stages:
            near = difflib.get_close_matches(name, stages, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"--stages: no stage {name!r} in {dvc_file.name}; {hint}the stages are {', '.join(stages)}")


def _viewer_pages(work: Path) -> list[tuple[str, Path]]:
    """The trajectory viewers a run wrote: eval's, one per model in the order it compared them (its
    metrics.json names them), then rl's and synth's."""
    pages = []
    try:
        models = json.loads((work / "eval" / "metrics.json").read_text()).get("models", [])
    except (OSError, ValueError, AttributeError):
        models = []
    for name in models if isinstance(models, list) else []:
        pages.append((f"eval {name}", work / "eval" / str(name) / "viewer.html"))
    pages += [(stage, work / stage / "viewer.html") for stage in ("rl", "synth")]
    return [(label, page) for label, page in pages if page.is_file()]


def _cmd_remote(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path.cwd()))
    from pipelines.dvc_runner import configure_remote_from_env

    url = configure_remote_from_env(Path.cwd(), args.name)
    if url is None:
        raise ValueError("LOUPE_DVC_REMOTE is not set (e.g. s3://my-bucket/loupe/dvc); credentials and the "
                         "endpoint come from the usual AWS variables")
    print(f"DVC remote {args.name!r} -> {url} (default, in .dvc/config.local; credentials stay in the environment)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loupe", description="Train and evaluate VLMs that think with images.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the pipeline (Prefect flow over dvc.yaml) on params.yaml")
    run.add_argument("--params", default="params.yaml",
                     help="params.yaml (the repository's pipeline), or a recipe's file, run in work/runs/<name>/")
    run.add_argument("--stages", nargs="+", help="only these stages (and what they depend on)")
    run.add_argument("--force", action="store_true", help="rerun the stages even when nothing changed")
    run.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                     help="params set on top of the file (e.g. rl.lr=1e-6 rl.kl.coef=0.01), validated like it; the "
                          "run then takes place in work/runs/<name>/ and MLflow records them")
    run.set_defaults(func=_cmd_run)

    remote = commands.add_parser("remote", help="make LOUPE_DVC_REMOTE (s3://...) the default DVC remote")
    remote.add_argument("--name", default="storage", help="the remote's name in .dvc/config.local")
    remote.set_defaults(func=_cmd_remote)

    model = commands.add_parser("model", help="build models").add_subparsers(dest="kind", required=True)
    tiny = model.add_parser("tiny", help="build an embedded tiny model offline (Qwen2.5-VL by default, or --family), "
                                         "with its perception pretraining and a manifest of its files' hashes "
                                         "(loupe.models.tiny_artifact)")
    tiny.add_argument("--out", type=Path, required=True)
    tiny.add_argument("--params", default="params.yaml", help="its settings: the model section's tiny_* keys")
    tiny.add_argument("--seed", type=int, default=None, help="instead of model.tiny_seed")
    tiny.add_argument("--perception-steps", type=int, default=None,
                      help="instead of model.tiny_perception_steps (0: the random model, in seconds)")
    tiny.add_argument("--family", choices=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"], default=None,
                      help="instead of model.tiny_family: the architecture (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, "
                           "Qwen3.5), each with its own processor and crop grid")
    tiny.set_defaults(func=_cmd_model_tiny)

    data = commands.add_parser("data", help="build task sets").add_subparsers(dest="kind", required=True)
    synthetic = data.add_parser("tasks", help="write the task set of params.yaml's data section (zoom or synthetic)")
    synthetic.add_argument("--out", type=Path, required=True)
    synthetic.add_argument("--params", default="params.yaml")
    synthetic.set_defaults(func=_cmd_data_tasks)
    imported = data.add_parser("import", help="read a recipe's published data set into a task folder",
                               description="Read a seed's published data set, as downloaded, into a task folder "
                                           "(docs/recipes.md, each preset's 'Your data').")
    imported.add_argument("format", choices=list(FORMATS), help="the publisher's format (loupe/data/published/)")
    for split in ("train", "val", "test"):
        imported.add_argument(f"--{split}", type=Path, nargs="+", metavar="PATH",
                              help=f"the {split} split: files (parquet, JSON or JSONL) or folders of them, "
                                   "read in order as one split (shards, or Mini-o3's two train files)")
    imported.add_argument("--val-benchmark", nargs=2, action="append", metavar=("NAME", "PATH"),
                          help="a benchmark's local copy as (part of) the val split, read by the eval stage's "
                               "reader (e.g. visualprobe_hard /data/VisualProbe_Hard); repeat for several")
    imported.add_argument("--out", type=Path, required=True, help="the task folder to write (replaced whole)")
    imported.add_argument("--image-dir", type=Path, help="where the rows' image paths are rooted (Mini-o3's "
                          "BASE_IMAGE_DIR, EasyR1's data.image_dir); default: beside the data file (Mini-o3: the "
                          "folder above it)")
    imported.add_argument("--source", help="data_source of every record (default: each row's own, else the format)")
    imported.add_argument("--limit", type=int, help="rows per split at most")
    imported.add_argument("--val-size", type=float, default=None,
                          help="without --val: rows of --train held out as the val split, a share below 1 or a "
                               "count (default 0.05: the presets validate on it)")
    imported.add_argument("--seed", type=int, default=0, help="seed of the held-out draw")
    easyr1 = imported.add_argument_group("EasyR1's keys (RLHFDataset; easyr1 only)")
    easyr1.add_argument("--prompt-key", help="the question column (default problem)")
    easyr1.add_argument("--answer-key", help="the answer column (default answer)")
    easyr1.add_argument("--image-key", help="the images column (default images)")
    easyr1.add_argument("--video-key", help="the videos column (default videos)")
    easyr1.add_argument("--videos", choices=["keep", "refuse"], default="keep",
                        help="video rows: kept as video tasks (default), or refused with the row named")
    imported.set_defaults(func=_cmd_data_import)

    view = commands.add_parser("view", help="render trajectories as a self-contained HTML page")
    view.add_argument("trajectories", type=Path)
    view.add_argument("--out", type=Path, required=True)
    view.add_argument("--max", type=int, default=None, help="show at most this many trajectories")
    view.set_defaults(func=_cmd_view)

    serve = commands.add_parser("serve", help="serve a model with its zoom loop: OpenAI-compatible API and a page")
    serve.add_argument("--model", type=Path, required=True, help="the model directory (work/rl/model, ...)")
    serve.add_argument("--params", type=Path, default=Path("params.yaml"),
                       help="its protocol, rollout and serve sections (a recipe's file for a recipe's model)")
    serve.add_argument("--host", default=None, help="instead of serve.host")
    serve.add_argument("--port", type=int, default=None, help="instead of serve.port (0: a free one)")
    serve.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="params set on top of the file")
    serve.set_defaults(func=_cmd_serve)

    from loupe.containers import add_stage_command

    add_stage_command(commands)
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

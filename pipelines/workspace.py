"""A recipe's own pipeline: its params file, a dvc.yaml of its shape, and a DVC workspace to run them in.

`loupe run --params params/<recipe>.yaml` runs the recipe in `work/runs/<recipe>/`, a DVC project of its own
(`dvc init --no-scm`) beside the repository's, so its caches, `dvc.lock`, metrics and MLflow store never mix
with the default pipeline's, and two recipes can be run, compared and rerun side by side. The workspace holds:

    params.yaml      the recipe's file, merged over its `base` file when it names one (refreshed every run)
    dvc.yaml         the repository's dvc.yaml reshaped by the file's `pipeline` section (`shaped_stages`)
    loupe, stages, pipelines, params, assets, data
                     links to the repository's code, templates, the committed tiny model (DVC hashes
                     through them) and imported task folders (`data/`, made by `loupe data import`)
    work/            every output, as in the repository

A recipe file may start from another: `base: params/<recipe>.yaml` at its top takes every value of that file
(itself merged over its own `base`, if any) and the recipe's own sections are merged over it (mappings key by key,
lists and values replaced), so a CPU twin starts from its recipe's GPU preset and writes only what it scales.
`base` is resolved against the repository. A top-level `scaled:` mapping (`scaled_keys`) lists each dotted key
the file changes on its base with a one-line reason why (`rl.steps: "40 steps fit a laptop"`; a key covers
everything under it); it documents the file and is checked by tests/test_recipes.py, and no stage sees it.

The shape (`pipeline.sft`, `pipeline.rl_stages`, `pipeline.ttrl`, `data.extra_families`) is applied to the repository's
dvc.yaml rather than written anew, so every stage keeps its command, dependencies, parameters and outputs and
the one dvc.yaml stays the reference: without SFT the synth and sft stages go and RL starts from
`${model.path}`; each earlier RL stage is a copy of `rl` with its own name, section, task folder and output
folder, started from the model before it; the eval stage compares whatever models the shape makes.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from loupe.config import ParamsError, apply_overrides, parse_section, read_params_file
from loupe.data.families import DataParams
from loupe.io import atomic_write_text
from pipelines.params import PipelineParams

LINKS = ("loupe", "stages", "pipelines", "params", "assets", "data")
"""Repository folders a workspace reaches through links: the stages' code, the recipes' templates, and `data/`,
where the presets' headers import the publishers' sets (`loupe data import ... --out data/<name>`), so a
preset's relative task folder names the same folder from the repository and from its workspace."""
RUNS = Path("work") / "runs"


def _swap(text: str, old: str, new: str) -> str:
    if old not in text:
        raise ValueError(f"dvc.yaml: expected {old!r} in {text!r}; the stage changed shape, update pipelines/workspace.py")
    return text.replace(old, new)


def _rename_paths(items: list[Any], old: str, new: str) -> list[Any]:
    """Dependencies, outputs, metrics and plots (strings, or one-key mappings) with the prefix `old` renamed."""
    renamed = []
    for item in items:
        if isinstance(item, str):
            renamed.append(new + item[len(old):] if item.startswith(old) else item)
        else:
            renamed.append({(new + k[len(old):] if k.startswith(old) else k): v for k, v in item.items()})
    return renamed


def shaped_stages(spec: dict[str, Any], pipeline: PipelineParams, data: DataParams) -> dict[str, Any]:
    """The repository's dvc.yaml (`spec`, parsed) reshaped for `pipeline` and `data` (module docstring)."""
    spec = copy.deepcopy(spec)
    base = spec["stages"]
    stages: dict[str, Any] = {"data": base["data"]}
    stages["data"]["outs"] = list(stages["data"]["outs"]) + [f"work/data/tasks_{f}" for f in data.extra_families]
    if pipeline.sft:
        stages["synth"], stages["sft"] = base["synth"], base["sft"]
    start = "work/sft/model" if pipeline.sft else "${model.path}"
    models = ["base"] + (["sft"] if pipeline.sft else [])
    for rl in pipeline.rl_stages:
        stage = copy.deepcopy(base["rl"])
        tasks = rl.tasks or "${pipeline.tasks}"
        cmd = _swap(stage["cmd"], "--model work/sft/model", f"--model {start}")
        cmd = _swap(cmd, "--tasks ${pipeline.tasks}", f"--tasks {tasks}")
        cmd = _swap(cmd, "--out work/rl", f"--out work/{rl.name}")
        if rl.params_section != "rl":
            cmd += f" --section {rl.params_section}"
        stage["cmd"] = cmd
        stage["deps"] = [start if d == "work/sft/model" else tasks if d == "${pipeline.tasks}" else d for d in stage["deps"]]
        stage["params"] = [rl.params_section if p == "rl" else p for p in stage["params"]]
        for key in ("outs", "metrics", "plots"):
            stage[key] = _rename_paths(stage.get(key, []), "work/rl/", f"work/{rl.name}/")
        if rl.name != "rl" or not pipeline.sft or len(pipeline.rl_stages) > 1:
            origin = "the SFT model" if start == "work/sft/model" else "model.path" if start == "${model.path}" \
                else f"{start.split('/')[1]}'s model"
            stage["desc"] = f"RL stage {rl.name} (params section {rl.params_section}) on {tasks}, from {origin}."
        stages[rl.name] = stage
        start = f"work/{rl.name}/model"
        models.append(rl.name)

    if pipeline.ttrl:
        stages["ttrl"] = _ttrl_stage(base["rl"], start)
        models.append("ttrl")

    evaluate = base["eval"]
    cmd = _swap(evaluate["cmd"], "--model sft=work/sft/model --model rl=work/rl/model",
                " ".join(f"--model {m}=work/{m}/model" for m in models[1:]))
    evaluate["cmd"] = cmd
    deps = []
    for dep in evaluate["deps"]:
        if dep == "work/sft/model":  # the models' place in the list, kept
            deps += [f"work/{m}/model" for m in models[1:]]
        elif dep != "work/rl/model":
            deps.append(dep)
    evaluate["deps"] = deps + [f"work/data/tasks_{f}" for f in data.extra_families]
    fixed = [o for o in evaluate["outs"] if not (isinstance(o, str) and o.startswith("work/eval/") and
                                                  o.count("/") == 2)]
    evaluate["outs"] = [f"work/eval/{m}" for m in models] + fixed
    stages["eval"] = evaluate
    spec["stages"] = stages
    turn_scaling = "work/eval/plots/turn_scaling.json"
    for plot in spec.get("plots", []):
        for definition in plot.values():
            if isinstance(definition.get("y"), dict) and turn_scaling in definition["y"]:
                definition["y"][turn_scaling] = models
    return spec


def _ttrl_stage(rl: dict[str, Any], start: str) -> dict[str, Any]:
    """The test-time RL stage: the rl stage's command with the `ttrl` section, from `start` (rl's model)."""
    stage = copy.deepcopy(rl)
    stage["cmd"] = _swap(_swap(stage["cmd"], "--model work/sft/model", f"--model {start}"), "--out work/rl",
                         "--out work/ttrl") + " --section ttrl"
    stage["deps"] = [start if d == "work/sft/model" else d for d in stage["deps"]]
    stage["params"] = ["ttrl" if p == "rl" else p for p in stage["params"]]
    for key in ("outs", "metrics", "plots"):
        stage[key] = _rename_paths(stage.get(key, []), "work/rl/", "work/ttrl/")
    stage["desc"] = (f"Test-time RL (params section ttrl): unlabeled questions of ${{pipeline.tasks}}, labels by vote, "
                     f"from {start.split('/')[1]}'s model.")
    return stage


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`: mappings merged key by key, anything else (values, lists) replaced."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _scaled(params_file: Path, data: dict[str, Any]) -> dict[str, str]:
    """Pop and check the `scaled` mapping of a params file's top level (empty when it has none)."""
    scaled = data.pop("scaled", None)
    if scaled is None:
        return {}
    if not isinstance(scaled, dict):
        raise ParamsError(f"{params_file}: scaled: must be a mapping of dotted keys to one-line reasons, "
                          f"got {scaled!r}")
    for key, reason in scaled.items():
        if not isinstance(key, str) or not all(part.strip() for part in key.split(".")):
            raise ParamsError(f"{params_file}: scaled: {key!r} is not a dotted key path (e.g. rl.steps)")
        if not isinstance(reason, str) or not reason.strip() or "\n" in reason.strip():
            raise ParamsError(f"{params_file}: scaled.{key}: must give a one-line reason, got {reason!r}")
    return dict(scaled)


def scaled_keys(params_file: Path) -> dict[str, str]:
    """The dotted keys a recipe file lists under `scaled:` (the keys it changes on its base), each with its
    reason; empty when it lists none. Only the file's own list: its base's is not inherited."""
    return _scaled(Path(params_file), read_params_file(params_file))


def read_recipe(repo: Path, params_file: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's params as one mapping: its `base` file's (recursively) with its own merged over them. Each
    file's `scaled` list is checked and dropped: it documents the file, no stage reads it."""
    data = read_params_file(params_file)
    _scaled(params_file, data)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ParamsError(f"{params_file}: base: must be a params file's path, got {base!r}")
    base_path = (repo / base).resolve()
    if base_path in seen or base_path == params_file.resolve():
        raise ParamsError(f"{params_file}: base: {base} comes back to itself")
    return merged(read_recipe(repo, base_path, seen + (params_file.resolve(),)), data)


def workspace_for(repo: Path, params_file: Path, runs: Path | None = None) -> Path:
    """The workspace folder of a recipe's params file: work/runs/<file name without its suffix> (or under `runs`)."""
    return (runs or repo / RUNS) / Path(params_file).stem


def prepare_workspace(repo: Path, params_file: Path, runs: Path | None = None,
                      overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """Create or refresh the workspace of `params_file` (module docstring) under `runs` (default
    `<repo>/work/runs`), with `overrides` (`key.path=value`) set on the merged params; returns its folder. The
    workspace's params.yaml is what the stages read, so DVC reruns what an override changes, and the file says
    which overrides made it."""
    params_file = Path(params_file)
    if not params_file.is_file():
        raise FileNotFoundError(f"{params_file}: no such params file")
    recipe = apply_overrides(read_recipe(repo, params_file), list(overrides), str(params_file))
    pipeline = parse_section(PipelineParams, recipe.get("pipeline"), "pipeline", str(params_file))
    data = parse_section(DataParams, recipe.get("data"), "data", str(params_file))
    workspace = workspace_for(repo, params_file, runs)
    workspace.mkdir(parents=True, exist_ok=True)
    for name in LINKS:
        link = workspace / name
        if not link.is_symlink():
            if link.exists():
                raise FileExistsError(f"{link}: expected a link to the repository's {name}/")
            link.symlink_to(os.path.relpath(repo / name, workspace), target_is_directory=True)
    target = workspace / "params.yaml"
    made_by = f" with {' '.join(overrides)}" if overrides else ""
    text = (f"# {params_file}{made_by} as the pipeline reads it (merged over its base file), written by `loupe run`\n"
            + yaml.safe_dump(recipe, sort_keys=False, width=120))
    if not target.is_file() or target.read_text(encoding="utf-8") != text:
        atomic_write_text(target, text)
    spec = yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))
    header = (f"# Generated by `loupe run --params {params_file}` from the repository's dvc.yaml and that file's "
              "pipeline section\n# (pipelines/workspace.py); rewritten on every run, so edit those instead.\n")
    text = header + yaml.safe_dump(shaped_stages(spec, pipeline, data), sort_keys=False, width=120)
    if not (workspace / "dvc.yaml").is_file() or (workspace / "dvc.yaml").read_text() != text:
        atomic_write_text(workspace / "dvc.yaml", text)
    shutil.copyfile(repo / ".dvcignore", workspace / ".dvcignore")
    if not (workspace / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=workspace, check=True)
    return workspace

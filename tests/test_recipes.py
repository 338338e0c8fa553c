"""The seeds' recipes as presets (params/*.yaml): every preset validates, recipe files merge over their base, and
`loupe run --params FILE` reshapes dvc.yaml (no SFT, two RL stages in a row) in a DVC workspace of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loupe.config import ParamsError, parse_section, read_params_file
from loupe.data.families import DataParams
from pipelines.overrides import SECTIONS  # every section and its model: the table `loupe run` checks with
from pipelines.params import PipelineParams
from pipelines.workspace import merged, prepare_workspace, read_recipe, scaled_keys, shaped_stages
from stages.rl.params import RLParams

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p for p in (ROOT / "params").glob("*.yaml"))
RECIPES = ("r1-v", "lmm-r1", "easyr1-geo", "deepeyes", "pixel-reasoner", "mini-o3", "pixelis")


def test_every_recipe_has_a_published_preset_and_a_cpu_twin():
    names = {p.stem for p in PRESETS}
    for recipe in RECIPES:
        assert {recipe, f"{recipe}-cpu"} <= names, recipe


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_presets_validate_against_every_section(preset, monkeypatch):
    monkeypatch.chdir(ROOT)  # templates are named relative to the repository, as in a workspace
    recipe = read_recipe(ROOT, preset)
    for name, model in SECTIONS.items():
        parse_section(model, recipe.get(name), name, str(preset))
    pipeline = parse_section(PipelineParams, recipe.get("pipeline"), "pipeline", str(preset))
    for section in pipeline.rl_sections:  # an earlier RL stage, or test-time RL, reads its own section
        parse_section(RLParams, recipe.get(section), section, str(preset))
    assert not set(recipe) - set(SECTIONS) - {"seed"} - set(pipeline.rl_sections), \
        "a section no stage reads"


def test_a_recipe_merges_over_its_base(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("seed: 3\nrl: {steps: 16, lr: 0.1, reward: {tool_bonus: 0.5, format_weight: 0.0}}\n"
                    "eval: {benchmarks: [{name: synthetic, path: a}]}\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: base.yaml\nrl: {steps: 40, reward: {format_weight: 1.0}}\n"
                      "eval: {benchmarks: [{name: tasks, path: b}]}\n")
    data = read_recipe(tmp_path, recipe)
    assert data == {"seed": 3, "rl": {"steps": 40, "lr": 0.1, "reward": {"tool_bonus": 0.5, "format_weight": 1.0}},
                    "eval": {"benchmarks": [{"name": "tasks", "path": "b"}]}}  # lists replaced, not merged
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ParamsError, match="comes back to itself"):
        read_recipe(tmp_path, loop)
    assert merged({"a": {"b": 1}}, {"a": 2}) == {"a": 2}


_ABSENT = object()


def _leaves(tree: dict, prefix: str = "") -> dict:
    """Dotted path -> value of every leaf (a value, a list or an empty mapping) of a params mapping."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _twin_differences(recipe: str) -> dict:
    """The leaves where the resolved CPU twin differs from its resolved GPU preset: (twin's, preset's)."""
    twin, gpu = (_leaves(read_recipe(ROOT, ROOT / "params" / f"{name}.yaml")) for name in (f"{recipe}-cpu", recipe))
    return {path: (twin.get(path, _ABSENT), gpu.get(path, _ABSENT)) for path in sorted(set(twin) | set(gpu))
            if twin.get(path, _ABSENT) != gpu.get(path, _ABSENT)}


def _under(path: str, key: str) -> bool:
    return path == key or path.startswith(key + ".")


def _shown(value) -> str:
    return "absent" if value is _ABSENT else repr(value)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_cpu_twin_differs_from_its_gpu_preset_only_in_keys_it_lists_as_scaled(recipe):
    twin_file = ROOT / "params" / f"{recipe}-cpu.yaml"
    assert read_params_file(twin_file)["base"] == f"params/{recipe}.yaml", "a twin starts from its GPU preset"
    scaled = scaled_keys(twin_file)
    differences = _twin_differences(recipe)
    unlisted = [f"{path}: twin {_shown(t)}, preset {_shown(g)}" for path, (t, g) in differences.items()
                if not any(_under(path, key) for key in scaled)]
    assert not unlisted, f"{twin_file.name}: differs from {recipe}.yaml in keys not under scaled:\n" + \
        "\n".join(unlisted)


def test_the_pixelis_operations_twin_changes_only_the_keys_it_lists_on_the_pixelis_twin():
    variant, twin = (_leaves(read_recipe(ROOT, ROOT / "params" / f"{name}.yaml"))
                     for name in ("pixelis-operations-cpu", "pixelis-cpu"))
    changed = {path for path in set(variant) | set(twin) if variant.get(path, _ABSENT) != twin.get(path, _ABSENT)}
    scaled = scaled_keys(ROOT / "params" / "pixelis-operations-cpu.yaml")
    assert read_params_file(ROOT / "params" / "pixelis-operations-cpu.yaml")["base"] == "params/pixelis-cpu.yaml"
    assert changed and all(any(_under(path, key) for key in scaled) for path in changed), sorted(changed)
    assert all(any(_under(path, key) for path in changed) for key in scaled), scaled
    assert variant["data.operations.train"] == 256 and variant["data.family"] == "mixed"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_scaled_key_of_a_cpu_twin_really_differs(recipe):
    differences = _twin_differences(recipe)
    stale = [key for key in scaled_keys(ROOT / "params" / f"{recipe}-cpu.yaml")
             if not any(_under(path, key) for path in differences)]
    assert not stale, f"{recipe}-cpu.yaml: scaled lists keys the twin does not change: {stale}"


@pytest.mark.parametrize("scaled", ["[rl.steps]", "rl.steps", "{rl.steps: ''}", "{rl.steps: 40}", "{rl.steps: }",
                                    "{rl.steps: \"two\\nlines\"}", "{'rl..steps': a reason}",
                                    "{3: a reason}"])
def test_a_malformed_scaled_list_names_the_file(tmp_path, scaled):
    (tmp_path / "base.yaml").write_text("rl: {steps: 300}\n")
    twin = tmp_path / "twin.yaml"
    twin.write_text(f"base: base.yaml\nscaled: {scaled}\nrl: {{steps: 40}}\n")
    with pytest.raises(ParamsError, match=re.escape(str(twin)) + ": scaled"):
        scaled_keys(twin)
    with pytest.raises(ParamsError, match=re.escape(str(twin)) + ": scaled"):
        read_recipe(tmp_path, twin)


def test_stages_never_see_scaled(tmp_path):
    (tmp_path / "base.yaml").write_text("scaled: {rl.lr: the base's own list}\nrl: {steps: 300, lr: 1.0e-6}\n")
    twin = tmp_path / "twin.yaml"
    twin.write_text("base: base.yaml\nscaled: {rl.steps: 40 steps fit a laptop}\nrl: {steps: 40}\n")
    assert read_recipe(tmp_path, twin) == {"rl": {"steps": 40, "lr": 1.0e-6}}
    assert scaled_keys(twin) == {"rl.steps": "40 steps fit a laptop"}  # the file's own list, not its base's
    assert scaled_keys(tmp_path / "base.yaml") == {"rl.lr": "the base's own list"}
    for preset in PRESETS:
        assert "scaled" not in read_recipe(ROOT, preset), preset.name
    workspace = prepare_workspace(ROOT, ROOT / "params" / "r1-v-cpu.yaml", runs=tmp_path / "runs")
    assert "scaled" not in yaml.safe_load((workspace / "params.yaml").read_text())


SPEC = yaml.safe_load((ROOT / "dvc.yaml").read_text())


def test_the_default_shape_is_dvc_yaml_itself():
    assert shaped_stages(SPEC, PipelineParams(), DataParams()) == SPEC
    assert PipelineParams().default_shape


def test_without_sft_rl_starts_from_the_base_model():
    spec = shaped_stages(SPEC, PipelineParams(sft=False), DataParams())
    stages = spec["stages"]
    assert list(stages) == ["data", "rl", "eval"]
    assert "--model ${model.path} " in stages["rl"]["cmd"] and "${model.path}" in stages["rl"]["deps"]
    assert "sft" not in stages["eval"]["cmd"] and "work/sft/model" not in stages["eval"]["deps"]
    assert "work/eval/sft" not in stages["eval"]["outs"]
    assert spec["plots"][0]["eval_turn_scaling"]["y"]["work/eval/plots/turn_scaling.json"] == ["base", "rl"]


def test_two_rl_stages_chain_with_their_own_data_and_section():
    pipeline = PipelineParams(rl_stages=[{"name": "rl_fre", "tasks": "work/data/tasks"},
                                         {"name": "rl", "tasks": "work/data/tasks_geometry"}])
    stages = shaped_stages(SPEC, pipeline, DataParams(extra_families=["geometry"]))["stages"]
    assert list(stages) == ["data", "synth", "sft", "rl_fre", "rl", "eval"]
    fre, mgt = stages["rl_fre"], stages["rl"]
    assert fre["cmd"].endswith("--model work/sft/model --tasks work/data/tasks --out work/rl_fre --section rl_fre")
    assert "rl_fre" in fre["params"] and "rl" not in fre["params"]
    assert "work/rl_fre/model" in fre["outs"] and {"work/rl_fre/checkpoints": {"cache": False}} in fre["outs"]
    assert "--model work/rl_fre/model --tasks work/data/tasks_geometry --out work/rl" in mgt["cmd"]
    assert "work/rl_fre/model" in mgt["deps"] and "work/data/tasks_geometry" in mgt["deps"]
    assert "work/data/tasks_geometry" in stages["data"]["outs"]
    assert "--model sft=work/sft/model --model rl_fre=work/rl_fre/model --model rl=work/rl/model" in stages["eval"]["cmd"]


def test_a_test_time_rl_stage_follows_rl_and_is_evaluated_beside_it():
    pipeline = PipelineParams(ttrl=True)
    assert not pipeline.default_shape and pipeline.rl_sections == ["rl", "ttrl"]
    spec = shaped_stages(SPEC, pipeline, DataParams())
    stages = spec["stages"]
    assert list(stages) == ["data", "synth", "sft", "rl", "ttrl", "eval"]
    ttrl = stages["ttrl"]
    assert ttrl["cmd"].endswith("--model work/rl/model --tasks ${pipeline.tasks} --out work/ttrl --section ttrl")
    assert "work/rl/model" in ttrl["deps"] and "ttrl" in ttrl["params"] and "rl" not in ttrl["params"]
    assert "work/ttrl/model" in ttrl["outs"] and {"work/ttrl/checkpoints": {"cache": False}} in ttrl["outs"]
    assert "--model rl=work/rl/model --model ttrl=work/ttrl/model" in stages["eval"]["cmd"]
    assert "work/ttrl/model" in stages["eval"]["deps"] and "work/eval/ttrl" in stages["eval"]["outs"]
    assert spec["plots"][0]["eval_turn_scaling"]["y"]["work/eval/plots/turn_scaling.json"] == ["base", "sft", "rl", "ttrl"]


def test_the_last_rl_stage_is_rl():
    with pytest.raises(ValueError, match="must be named rl"):
        PipelineParams(rl_stages=[{"name": "rl"}, {"name": "rl_second"}])
    with pytest.raises(ValueError):
        PipelineParams(rl_stages=[{"name": "ppo stage"}, {"name": "rl"}])


def test_a_workspace_is_a_dvc_project_of_the_recipes_shape(tmp_path):
    workspace = prepare_workspace(ROOT, ROOT / "params" / "lmm-r1-cpu.yaml", runs=tmp_path)
    assert workspace == tmp_path / "lmm-r1-cpu"
    assert all((workspace / name).is_symlink() for name in ("loupe", "stages", "pipelines", "params"))
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    assert params["rl_fre"]["estimator"] == "reinforce_baseline" and params["sft"]["learning_rate"] == 0.001  # twin's
    dag = subprocess.run([sys.executable, "-m", "dvc", "dag", "--md"], cwd=workspace, capture_output=True,
                         text=True, check=True).stdout
    names = dict(re.findall(r'(node\d+)\["([^"]+)"\]', dag))
    edges = {(names[a], names[b]) for a, b in re.findall(r"(node\d+)-->(node\d+)", dag)}
    assert {("synth", "sft"), ("sft", "rl_fre"), ("rl_fre", "rl"), ("data", "rl"), ("rl", "eval"),
            ("rl_fre", "eval")} <= edges
    assert ("sft", "rl") not in edges, "the second RL stage starts from the first's model"
    text = (workspace / "dvc.yaml").read_text()
    again = prepare_workspace(ROOT, ROOT / "params" / "lmm-r1-cpu.yaml", runs=tmp_path)
    assert (again / "dvc.yaml").read_text() == text, "refreshing is idempotent"


def test_loupe_run_refuses_a_reshaped_params_yaml(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main

    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    (tmp_path / "params.yaml").write_text("pipeline: {sft: false}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run"]) == 2
    assert "loupe run --params FILE" in capsys.readouterr().err


def test_a_preset_without_its_task_folder_names_the_command_that_makes_it(tmp_path, monkeypatch, capsys):
    """A preset's imported task folder is checked before Prefect starts; the message is the preset's own
    `pipeline.tasks_from`. The workspace sees the repository's data/, where the presets' headers import to."""
    import pipelines.flow
    from pipelines.cli import main

    for name in ("dvc.yaml", ".dvcignore"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    (tmp_path / "params").symlink_to(ROOT / "params")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--params", "params/lmm-r1.yaml"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.tasks: data/fre is not a folder" in err
    assert "make it with: loupe data import lmm_r1 --train /path/to/deepscaler_message.jsonl" in err
    (tmp_path / "data" / "fre").mkdir(parents=True)
    assert main(["run", "--params", "params/lmm-r1.yaml"]) == 2
    assert "data/mgt_geo is not a folder" in capsys.readouterr().err  # each RL stage's own folder too
    (tmp_path / "data" / "mgt_geo").mkdir()
    ran = []
    monkeypatch.setattr(pipelines.flow, "log_prefect_to_file", lambda root: None)
    monkeypatch.setattr(pipelines.flow, "loupe_pipeline", lambda **kw: ran.append(kw) or [])
    assert main(["run", "--params", "params/lmm-r1.yaml"]) == 0 and len(ran) == 1
    assert (tmp_path / "work" / "runs" / "lmm-r1" / "data" / "mgt_geo").is_dir()  # through the workspace's link


def test_the_qwen3_vl_variant_of_mini_o3_changes_only_what_the_family_changes():
    """params/mini-o3-qwen3-vl.yaml is Mini-o3's recipe with each key the model family changes listed and argued
    under `scaled`: nothing else differs, and each listed key does."""
    variant_file = ROOT / "params" / "mini-o3-qwen3-vl.yaml"
    variant, preset = (_leaves(read_recipe(ROOT, path)) for path in (variant_file, ROOT / "params" / "mini-o3.yaml"))
    changed = {path for path in set(variant) | set(preset) if variant.get(path, _ABSENT) != preset.get(path, _ABSENT)}
    scaled = scaled_keys(variant_file)
    assert read_params_file(variant_file)["base"] == "params/mini-o3.yaml"
    assert all(any(_under(path, key) for key in scaled) for path in changed), sorted(changed)
    assert all(any(_under(path, key) for path in changed) for key in scaled), scaled
    # The token budget Mini-o3 gave an image, on the 32-px grid (a token: 32 x 32 px, not 28 x 28).
    assert variant["protocol.max_pixels"] // 1024 == preset["protocol.max_pixels"] // 784
    assert variant["protocol.min_pixels"] // 1024 == preset["protocol.min_pixels"] // 784

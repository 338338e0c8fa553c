"""`key.path=value` on the command line, as verl, EasyR1 and OpenRLHF users write it: parsed as the file's YAML,
checked against the section's model before anything runs, written into the run's params and recorded in MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loupe.config import OVERRIDES_ENV, ParamsError, apply_overrides, params_with_overrides, parse_override

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("text", "parts", "value"),
    [("rl.lr=1e-6", ("rl", "lr"), 1e-6),  # PyYAML alone reads 1e-6 as a string
     ("rl.kl.coef=0.01", ("rl", "kl", "coef"), 0.01),
     ("rl.steps=20", ("rl", "steps"), 20),
     ("rl.overlap=true", ("rl", "overlap"), True),
     ("rl.val_prompts=null", ("rl", "val_prompts"), None),
     ("rl.betas=[0.9, 0.95]", ("rl", "betas"), [0.9, 0.95]),
     ("model.path=/models/Qwen2.5-VL-7B", ("model", "path"), "/models/Qwen2.5-VL-7B"),
     ("rl.reward.format_rule=r1v", ("rl", "reward", "format_rule"), "r1v")],
)
def test_an_override_reads_as_the_file_would(text, parts, value):
    assert parse_override(text) == (parts, value)


@pytest.mark.parametrize("text", ["rl.lr", "=3", "rl..lr=3", "rl.lr=[1,"])
def test_a_malformed_override_is_refused_with_its_text(text):
    with pytest.raises(ParamsError, match="override"):
        parse_override(text)


def test_overrides_set_nested_keys_on_a_copy_and_refuse_to_walk_through_a_value():
    data = {"rl": {"kl": {"coef": 0.0}, "lr": 1e-6}}
    out = apply_overrides(data, ["rl.kl.coef=0.04", "rl.kl.form=loss", "rl.curiosity.enabled=true"])
    assert out["rl"]["kl"] == {"coef": 0.04, "form": "loss"} and out["rl"]["curiosity"] == {"enabled": True}
    assert data["rl"]["kl"] == {"coef": 0.0}  # the input is untouched
    with pytest.raises(ParamsError, match="rl.lr is float, not a section"):
        apply_overrides(data, ["rl.lr.value=3"])


def test_a_stage_reads_its_params_with_the_overrides_and_its_run_records_them(tmp_path, monkeypatch):
    monkeypatch.delenv(OVERRIDES_ENV, raising=False)
    source = tmp_path / "params.yaml"
    source.write_text("rl:\n  lr: 1.0e-06\n  steps: 4\n")
    assert params_with_overrides(source, []) == source
    written = params_with_overrides(source, ["rl.lr=2e-5", "rl.clip_high=0.28"])
    assert written.name == "params+overrides.yaml"
    assert yaml.safe_load(written.read_text())["rl"] == {"lr": 2e-5, "steps": 4, "clip_high": 0.28}
    import os

    assert os.environ[OVERRIDES_ENV] == "rl.lr=2e-5 rl.clip_high=0.28"


def test_loupe_run_checks_each_overridden_section_before_anything_runs(tmp_path):
    from pipelines.overrides import check_overrides

    params = REPO / "params" / "lmm-r1-cpu.yaml"
    data = check_overrides(REPO, params, ["rl.lr=3e-5", "rl_fre.kl.coef=0.002", "seed=3"])
    assert data["rl"]["lr"] == 3e-5 and data["rl_fre"]["kl"]["coef"] == 0.002 and data["seed"] == 3
    with pytest.raises(ParamsError, match=r"with rl.lrr=1: rl.lrr: Extra inputs are not permitted"):
        check_overrides(REPO, params, ["rl.lrr=1"])
    with pytest.raises(ParamsError, match=r"rl.clip_low: Input should be less than or equal to 1"):
        check_overrides(REPO, params, ["rl.clip_low=2"])
    with pytest.raises(ParamsError, match="no section 'rll'"):
        check_overrides(REPO, params, ["rll.lr=1"])


def test_a_workspace_params_file_carries_the_overrides(tmp_path):
    from pipelines.workspace import prepare_workspace

    workspace = prepare_workspace(REPO, REPO / "params" / "r1-v-cpu.yaml", runs=tmp_path, overrides=["rl.steps=3"])
    text = (workspace / "params.yaml").read_text()
    assert "with rl.steps=3" in text.splitlines()[0]
    assert yaml.safe_load(text)["rl"]["steps"] == 3


def test_a_stage_command_takes_overrides_and_refuses_a_bad_one(tmp_path, capsys):
    from stages.rl.__main__ import main

    (tmp_path / "model").mkdir()
    code = main(["--params", str(REPO / "params.yaml"), "--model", str(tmp_path / "model"), "--tasks", str(tmp_path),
                 "--out", str(tmp_path / "out"), "rl.not_a_key=1"])
    assert code == 2
    assert "rl.not_a_key: Extra inputs are not permitted" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["params.yaml", *sorted(p.name for p in (REPO / "params").glob("*.yaml"))])
def test_every_shipped_params_file_passes_the_whole_check(name):
    from pipelines.overrides import check_params
    from pipelines.workspace import read_recipe

    path = REPO / name if name == "params.yaml" else REPO / "params" / name
    check_params(read_recipe(REPO, path), name)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(dta=d.pop("data")), r"'dta' is not a section; did you mean 'data'\?"),
    (lambda d: d["eval"].update(samplez=2), r"eval.samplez: Extra inputs are not permitted"),
    (lambda d: d["synth"]["oracle"].update(patterns={"direkt": 1.0}), r"synth.oracle.patterns.direkt"),
    (lambda d: d.update(seed="0"), r"seed: must be an integer"),
])
def test_a_typo_in_any_stage_is_named_before_anything_runs(tmp_path, monkeypatch, capsys, edit, message):
    from pipelines.cli import main

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    edit(data)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loupe: params.yaml") and __import__("re").search(message, err), err
    assert not (tmp_path / "work").exists()  # refused before Prefect, DVC or a stage started


def test_a_mistyped_stage_name_is_refused_with_the_nearest_one(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--stages", "sft", "evl"]) == 2
    err = capsys.readouterr().err
    assert "--stages: no stage 'evl' in dvc.yaml; did you mean 'eval'?" in err and "data, synth, sft, rl, eval" in err
    assert not (tmp_path / "work").exists()

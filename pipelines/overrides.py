"""Command-line overrides checked before anything runs: `loupe run --params FILE rl.lr=1e-6 ...`.

Each override's section is validated with the model its stage reads it with (the same `ParamsError`, naming the
file, the override and the key path), so a typo stops the run at once instead of at the stage that reads it,
minutes in. Sections of earlier RL stages (`pipeline.rl_stages`) are RL sections.
"""

from __future__ import annotations

from pathlib import Path

from loupe.config import (
    ModelParams,
    ParamsError,
    ProtocolParams,
    RolloutParams,
    apply_overrides,
    parse_override,
    parse_section,
)
from loupe.data.families import DataParams
from pipelines.params import PipelineParams
from pipelines.workspace import read_recipe
from stages.eval.params import EvalParams
from stages.rl.params import RLParams
from stages.sft.params import SftParams
from stages.synth.params import SynthParams

SECTIONS = {"model": ModelParams, "protocol": ProtocolParams, "rollout": RolloutParams, "data": DataParams,
            "synth": SynthParams, "sft": SftParams, "rl": RLParams, "eval": EvalParams, "pipeline": PipelineParams}
"""Each params section and the model its stage validates it with."""


def check_overrides(repo: Path, params_file: Path, overrides: list[str]) -> dict:
    """The merged params with `overrides` set, after validating every section they touch; raises ParamsError."""
    data = apply_overrides(read_recipe(repo, params_file), overrides, str(params_file))
    rl_sections = set(parse_section(PipelineParams, data.get("pipeline"), "pipeline", str(params_file)).rl_sections)
    for text in overrides:
        section = parse_override(text)[0][0]
        if section == "seed":
            if not isinstance(data["seed"], int) or isinstance(data["seed"], bool):
                raise ParamsError(f"{params_file} with {text}: seed: must be an integer")
            continue
        model = SECTIONS.get(section) or (RLParams if section in rl_sections else None)
        if model is None:
            known = ", ".join(sorted({*SECTIONS, *rl_sections, "seed"}))
            raise ParamsError(f"{params_file} with {text}: no section {section!r}; the sections are {known}")
        parse_section(model, data.get(section), section, f"{params_file} with {text}")
    return data

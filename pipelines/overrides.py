"""Params checked before anything runs: the whole file (`check_params`) and command-line overrides
(`loupe run --params FILE rl.lr=1e-6 ...`, `check_overrides`).

Every section is validated with the model its stage reads it with (the same `ParamsError`, naming the file, the
override and the key path), and a top-level key that is no section is refused with the nearest name, so a typo
(`dta:`, `rl.lrr`) stops the run at once instead of being ignored or failing at the stage that reads it, minutes
in. Sections of earlier RL stages (`pipeline.rl_stages`) and of the `ttrl` stage are RL sections.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

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
from loupe.serve.params import ServeParams
from pipelines.params import PipelineParams
from pipelines.workspace import read_recipe
from stages.eval.params import EvalParams
from stages.rl.params import RLParams
from stages.sft.params import SftParams
from stages.synth.params import SynthParams

SECTIONS = {"model": ModelParams, "protocol": ProtocolParams, "rollout": RolloutParams, "data": DataParams,
            "synth": SynthParams, "sft": SftParams, "rl": RLParams, "eval": EvalParams, "pipeline": PipelineParams, "serve": ServeParams}
"""Each params section and the model its stage validates it with."""


def check_overrides(repo: Path, params_file: Path, overrides: list[str]) -> dict:
    """The merged params with `overrides` set, after validating every section they touch; raises ParamsError."""
    data = apply_overrides(read_recipe(repo, params_file), overrides, str(params_file))
    rl_sections = set(parse_section(PipelineParams, data.get("pipeline"), "pipeline", str(params_file)).rl_sections)
    for text in overrides:
        section = parse_override(text)[0][0]
        if section == "seed":
            _check_seed(data, f"{params_file} with {text}")
            continue
        model = SECTIONS.get(section) or (RLParams if section in rl_sections else None)
        if model is None:
            known = ", ".join(sorted({*SECTIONS, *rl_sections, "seed"}))
            raise ParamsError(f"{params_file} with {text}: no section {section!r}; the sections are {known}")
        parse_section(model, data.get(section), section, f"{params_file} with {text}")
    return data


def _check_seed(data: dict[str, Any], where: str) -> None:
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ParamsError(f"{where}: seed: must be an integer, got {seed!r}")


def check_params(data: dict[str, Any], where: str) -> None:
    """Validate every section of a params mapping (a file's, merged over its base, overrides set) with the model
    its stage reads it with, and refuse top-level keys that are no section; raises ParamsError naming `where`."""
    if not isinstance(data, dict):
        raise ParamsError(f"{where}: must be a mapping of sections, got {type(data).__name__}")
    rl_sections = set(parse_section(PipelineParams, data.get("pipeline"), "pipeline", where).rl_sections)
    known = sorted({*SECTIONS, *rl_sections, "seed"})
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ParamsError(f"{where}: {key!r} is not a section; {hint}the sections are {', '.join(known)}")
    _check_seed(data, where)
    for section, model in SECTIONS.items():
        parse_section(model, data.get(section), section, where)
    for section in sorted(rl_sections - SECTIONS.keys()):
        parse_section(RLParams, data.get(section), section, where)

"""The `pipeline` section of params.yaml: how the flow drives the stages (no stage reads it)."""

from __future__ import annotations

from pydantic import Field

from loupe.config import Section


class PipelineParams(Section):
    """Retries, the model registry and the DVC remote, for the Prefect flow in pipelines/flow.py."""

    tasks: str = "work/data/tasks"
    """Task folder the synth and rl stages read (`--tasks`, <split>.jsonl task records): the data stage's
    synthetic tasks by default; a folder of your own (e.g. VisualProbe's train set) in a real run. dvc.yaml
    fills it into those stages' commands and dependencies, so changing it reruns them."""
    retries: int = Field(1, ge=0)
    """Times a failed stage is run again before the flow fails. A stage that exits with status 2 (bad input,
    named in its message) is never retried: the same input would fail the same way."""
    retry_delay_s: float = Field(5.0, ge=0)
    """Seconds between a failure and its retry."""
    register_model: bool = True
    """Register the final model in MLflow's model registry (once per distinct model: a rerun that rebuilt
    nothing registers nothing)."""
    model_name: str = "loupe"
    """Registered model name."""
    model_stage: str = "rl"
    """The stage whose output is the final model; its MLflow run holds the registered copy."""
    model_path: str = "work/rl/model"
    """The final model's directory (an output of `model_stage` in dvc.yaml)."""
    push: bool = True
    """`dvc push` the stages' outputs at the end when a default DVC remote is configured (see
    docs/orchestration.md: `loupe remote` sets one from LOUPE_DVC_REMOTE); nothing happens without one."""

"""The `pipeline` section of params.yaml: how the flow drives the stages (no stage reads it)."""

from __future__ import annotations

from pydantic import Field, model_validator

from loupe.config import Section


class RLStageParams(Section):
    """One RL stage of the pipeline (a recipe may chain two: LMM-R1 trains FRE, then MGT)."""

    name: str = Field("rl", pattern=r"^rl(_[a-z0-9]+)?$")
    """The stage's name in dvc.yaml and its output folder `work/<name>`; the last stage is `rl`."""
    section: str | None = None
    """The params section of its RL settings (an `rl`-shaped section); None: the stage's name."""
    tasks: str | None = None
    """Its task folder; None: `pipeline.tasks`."""

    @property
    def params_section(self) -> str:
        return self.section or self.name


class PipelineParams(Section):
    """Retries, the model registry and the DVC remote, for the Prefect flow in pipelines/flow.py."""

    tasks: str = "work/data/tasks"
    """Task folder the synth and rl stages read (`--tasks`, <split>.jsonl task records): the data stage's
    synthetic tasks by default; a folder of your own (e.g. VisualProbe's train set) in a real run. dvc.yaml
    fills it into those stages' commands and dependencies, so changing it reruns them."""
    tasks_from: str | None = None
    """How `tasks` (and the RL stages' own task folders) is made from the publisher's files, as downloaded: the
    `loupe data import ...` command a preset names (docs/recipes.md, "Your data"). `loupe run` prints it when a
    task folder is missing, before any stage starts; no stage reads it."""
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
    sft: bool = True
    """Cold start before RL (the synth and sft stages). False: RL starts from `model.path` (R1-V's recipe), and
    the eval stage compares the base model with the RL stages' models. A pipeline shape other than the default
    runs from its own params file (`loupe run --params FILE`), in a workspace of its own (docs/recipes.md)."""
    rl_stages: list[RLStageParams] = Field(default_factory=lambda: [RLStageParams()])
    """The RL stages in order, each starting from the one before (the first from the SFT model, or from
    `model.path` without SFT); the last is `rl`, whose model the eval stage and the registry take."""

    ttrl: bool = False
    """After `rl`, a test-time RL stage `ttrl` (stages/rl/ttrl.py): the rl stage's code with the `ttrl` params
    section (rl-shaped, with `ttrl.enabled: true` and `train_split` naming the unlabeled questions, e.g. test),
    on `pipeline.tasks`, from rl's model; the eval stage compares its model beside the others."""

    @property
    def rl_sections(self) -> list[str]:
        """Every params section an RL stage of this shape reads (rl-shaped sections)."""
        return [stage.params_section for stage in self.rl_stages] + (["ttrl"] if self.ttrl else [])

    @model_validator(mode="after")
    def _last_stage_is_rl(self) -> "PipelineParams":
        names = [stage.name for stage in self.rl_stages]
        if not names or names[-1] != "rl":
            raise ValueError("rl_stages: the last RL stage must be named rl (the eval stage and the registry read "
                             f"work/rl/model); got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"rl_stages: names repeat: {names}")
        return self

    def task_folders(self) -> list[str]:
        """Every task folder the synth and RL stages read (`tasks`, then each RL stage's own), each once."""
        folders = [self.tasks] + [stage.tasks for stage in self.rl_stages if stage.tasks]
        return list(dict.fromkeys(folders))

    @property
    def default_shape(self) -> bool:
        """Whether the stages are the repository's dvc.yaml as written (synth, sft and one rl stage)."""
        return (self.sft and not self.ttrl
                and [s.model_dump() for s in self.rl_stages] == [RLStageParams().model_dump()])

"""The `rl.pixelis` section: Pixelis' combined reward (its weights, curriculum, curiosity, coherence and tool
penalties), read by stages/rl/pixelis.py; docs/recipes.md has the upstream lines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from loupe.config import Section


class PixelisWeights(Section):
    """Weights of Pixelis' reward terms (`RewardOrchestrator`: task_reward_weight 1.0, curiosity 0.3, coherence 0.2)."""

    task: float = 1.0
    curiosity: float = 0.3
    coherence: float = 0.2


class PixelisStageWeights(Section):
    """The weights a curriculum stage sets; an unset one keeps the value before it."""

    task: float | None = None
    curiosity: float | None = None
    coherence: float | None = None


class PixelisCurriculumStage(Section):
    step: int = Field(ge=0)
    """The RL step from which this stage's weights hold."""
    weights: PixelisStageWeights = PixelisStageWeights()


class PixelisCuriosityParams(Section):
    """Pixelis' intrinsic-curiosity module (`CuriosityRewardModule`: beta 0.2, eta 0.5, hidden 256)."""

    beta: float = Field(0.2, ge=0, le=1)
    """The forward loss's share of the module's training loss (the inverse model's is 1 - beta)."""
    eta: float = Field(0.5, ge=0)
    """Scale of the intrinsic reward (the forward model's squared error)."""
    hidden: int = Field(256, ge=1)
    """Width of its MLPs."""
    lr: float = Field(1e-3, gt=0)
    """Adam's rate for the module, trained once a step on the step's transitions (upstream does not fix one)."""


class PixelisCoherenceParams(Section):
    """`TrajectoryCoherenceAnalyzer` (repetition_penalty 0.5, min_trajectory_length 2)."""

    repetition_penalty: float = Field(0.5, ge=0)
    min_length: int = Field(2, ge=0)


class PixelisPenaltyParams(Section):
    """`_calculate_tool_penalty` (tool_misuse_penalty -0.1, excessive_tool_use_threshold 10 and penalty -0.2)."""

    misuse: float = Field(-0.1, le=0)
    excessive_threshold: int = Field(10, ge=0)
    excessive: float = Field(-0.2, le=0)


class PixelisRewardParams(Section):
    """Pixelis' combined reward (stages/rl/pixelis.py): the reward rule's total as the task reward, its curiosity
    and coherence rewards under a curriculum, and its tool penalties, replacing each valid total."""

    enabled: bool = False
    weights: PixelisWeights = PixelisWeights()
    """The weights without a curriculum; with one, the task weight from step 0 (curiosity and coherence 0)."""
    curriculum: list[PixelisCurriculumStage] = Field(default_factory=list)
    """Stages `{step, weights}` in step order; empty: `weights` throughout."""
    normalize: bool = True
    """Z-score each term by its running statistics (`normalize_rewards`, on upstream)."""
    statistics_update: Literal["step", "trajectory"] = "step"
    """When the running statistics take in new values. `step`: every trajectory of a step is z-scored with the
    statistics as they were before the step, which then take in the step's values in order. `trajectory`:
    upstream's order (`calculate_reward` updates them before z-scoring each value). With `trajectory`, a GRPO
    group of equal rewards gets z-scores that differ by the sample's position, as the mean moves between them,
    and dividing by the group's std turns that drift into advantages of about +-1: on the operations twin,
    RL then unlearnt the operations (docs/learning.md, "Pixelis' reward terms, kind by kind")."""
    clip: float = Field(10.0, gt=0)
    """The total is clipped to +-clip (`reward_clip_value`)."""
    curiosity: PixelisCuriosityParams = PixelisCuriosityParams()
    coherence: PixelisCoherenceParams = PixelisCoherenceParams()
    penalties: PixelisPenaltyParams = PixelisPenaltyParams()

    @field_validator("curriculum")
    @classmethod
    def _stages_in_order(cls, stages: list[PixelisCurriculumStage]) -> list[PixelisCurriculumStage]:
        steps = [stage.step for stage in stages]
        if steps != sorted(steps):
            raise ValueError(f"stages must be in step order, got steps {steps}")
        return stages

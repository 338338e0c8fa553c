"""The `synth` section of params.yaml: which teacher writes the cold-start set, and what is kept."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from loupe.config import Section
from loupe.rewards import RewardConfig


class OracleParams(Section):
    """The oracle teacher: knows each synthetic task's target box and writes varied, correct searches."""

    patterns: dict[Literal["direct", "wide_then_close", "wrong_then_right", "observation_zoom", "glance"], float] = Field(
        default_factory=lambda: {"direct": 1.0, "wide_then_close": 2.0, "wrong_then_right": 2.0, "observation_zoom": 2.0}
    )
    """Relative weights of the search patterns: `direct` (zoom on the target, answer), `wide_then_close` (a wide
    look around the target, then closer looks on the original), `wrong_then_right` (one or more regions without
    the target first, noticed and corrected), `observation_zoom` (a wide look, then zooms into the observation),
    `glance` (no zoom: a guess from the downscaled view, kept by rejection only when right; needs
    `min_tool_calls: 0`). A task with a search path (`waypoints`: pointer tasks, depth-2 zoom tasks) is searched
    by `follow` with `direct`'s weight against `glance`'s, whatever the others say."""
    turns: dict[int, float] = Field(default_factory=lambda: {2: 2.0, 3: 3.0, 4: 3.0, 5: 1.5, 6: 1.0})
    """Relative weights of the number of assistant turns (answer included). Each trajectory draws its pattern
    first, then its turn count among those the pattern can make (direct: 2; the others: 3 or more), capped by
    the turn limit."""
    close_margin: tuple[float, float] = (0.5, 1.5)
    """Margin around the target in the closest look, per side, in target sizes (drawn uniformly)."""
    min_close_side: float = Field(0.03, gt=0.0, le=1.0)
    """Smallest side of the closest look, as a fraction of the original's side (tiny targets get some context)."""
    wide_side: tuple[float, float] = (0.25, 0.5)
    """Side of a wide look as a fraction of the original's side (drawn uniformly; grown to hold the target)."""
    wrong_side: tuple[float, float] = (0.15, 0.4)
    """Side of a look at the wrong region, as a fraction of the original's side."""
    plain_wording: bool = False
    """One fixed, shortest wording per sentence slot and no optional sentences (stages/synth/wording.py), so
    the only words that vary are those that carry the decision: where to zoom, what was seen."""
    name_first_look: bool = True
    """Whether the first turn says in words where its zoom goes ("Checking the left side."). False: it names no
    place ("Checking the frame.") and the box alone carries it. On the tiny default, SFT's loss on side words
    the model both reads in the question and writes in its turn pulled " left" and " right" together again, and
    the box written after the word stopped following it at two seeds of five; without the word every seed's
    zooms land on the named cell, and the box is read from the question alone, which on kernels below AVX2 the
    tiny model learned for the left cell only (docs/learning.md, "The side word SFT writes")."""
    obs_source_rate: float = Field(0.5, ge=0.0, le=1.0)
    """In `wide_then_close` and `wrong_then_right`, the chance that a closer look after a wide one names the
    observation as its source instead of the original (`observation_zoom` always does)."""

    @field_validator("patterns")
    @classmethod
    def _some_pattern(cls, value: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in value.values()) or not any(w > 0 for w in value.values()):
            raise ValueError("weights must be non-negative with at least one positive")
        return value

    @field_validator("turns")
    @classmethod
    def _turn_weights(cls, value: dict[int, float]) -> dict[int, float]:
        if any(t < 2 for t in value):
            raise ValueError("turn counts start at 2 (one zoom, then the answer)")
        if any(w < 0 for w in value.values()) or not any(w > 0 for w in value.values()):
            raise ValueError("weights must be non-negative with at least one positive")
        return value

    @field_validator("close_margin", "wide_side", "wrong_side")
    @classmethod
    def _ordered_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= value[0] <= value[1]:
            raise ValueError(f"must be a range [low, high] with 0 <= low <= high, got {list(value)}")
        return value


class OpenAITeacherParams(Section):
    """The openai teacher: an OpenAI-compatible VLM (endpoint, concurrency, retries: `rollout.openai`)."""

    exemplars: str = "stages/synth/exemplars"
    """Folder of few-shot exemplar trajectories (*.json, hand-written in the protocol's format)."""
    num_exemplars: int = Field(2, ge=0)
    """Exemplars shown to the teacher in its system prompt (0 for none)."""
    cache_dir: str = "work/cache/synth_openai"
    """Disk cache of the endpoint's replies, outside the stage's output (DVC deletes outputs before a run), so an
    interrupted or repeated run pays for no request twice."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of the teacher; None keeps rollout.temperature."""
    price_per_1k_prompt_tokens: float = Field(0.0, ge=0)
    """Price of 1,000 prompt tokens, for the cost report (currency of your price list)."""
    price_per_1k_completion_tokens: float = Field(0.0, ge=0)
    """Price of 1,000 completion tokens, for the cost report."""


class ImportParams(Section):
    """The import teacher: a publisher's cold-start SFT set from a local copy (stages/synth/import_formats.py)."""

    format: Literal["mini_o3", "pixel_reasoner", "r1v_cot"] = "mini_o3"
    """The set's publisher: `mini_o3` (Mini-o3-Coldstart-Dataset, parquet), `pixel_reasoner`
    (PixelReasoner-SFT-Data, a JSON list of `message_list` chats), `r1v_cot` (R1-V's R1-distilled
    chain-of-thought set: `image`, `problem`, `thinking`, `solution`)."""
    path: str | None = None
    """A data file, or a folder whose files of the format are read in name order (its train files when some are
    named so)."""
    image_dir: str | None = None
    """Where image paths in the rows are rooted (PixelReasoner-SFT-Data names files); None: beside the data
    file, its `images.zip`, or by the paths' trailing parts there."""
    system_prompt: Literal["protocol", "keep"] = "protocol"
    """`protocol` replaces each record's system prompt with this protocol's (what rl and eval prompt with);
    `keep` keeps the record's own."""
    limit: int | None = Field(None, ge=1)
    """Import only the first N rows (smoke runs); None for all."""
    batch_rows: int = Field(64, ge=1)
    """Rows read from the parquet at a time, and rows per shard (bounds memory: rows hold their images' bytes)."""
    keep: Literal["checked", "trainable"] = "checked"
    """Which imported rows reach the dataset: those that pass every rejection check (`checked`), or every row
    LLaMA-Factory can train on (`trainable`, Mini-o3: scripts/preprocess_coldstart.py:35-49 writes every row):
    readable images, one per placeholder, user and assistant turns alternating to an assistant turn, whatever
    the parser, the turn and image limits or the pixel budget say (LLaMA-Factory's `SharegptDatasetConverter`,
    src/llamafactory/data/converter.py, skips only rows with a wrong role order or message count)."""


class SynthParams(Section):
    """How the synth stage writes the cold-start SFT dataset."""

    model_config = ConfigDict(populate_by_name=True)

    teacher: Literal["oracle", "openai", "import"] = "oracle"
    """Who writes the trajectories: `oracle` (synthetic tasks with a known target box), `openai` (any
    OpenAI-compatible VLM) or `import` (a publisher's cold-start set, `import.format`)."""
    split: str = "train"
    """Task file read from --tasks: `<split>.jsonl` (oracle and openai teachers)."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N tasks (smoke runs); None for all."""
    samples_per_task: int = Field(10, ge=1)
    """Trajectories generated per task (each oracle sample draws its own pattern, boxes and wording)."""
    max_turns: int | None = Field(None, ge=1)
    """Assistant-turn limit of generation and of the kept trajectories; None keeps protocol.max_turns."""
    max_new_tokens: int | None = Field(None, ge=1)
    """New tokens one teacher turn may take; None keeps rollout.max_new_tokens (the oracle keeps its turns
    within it too, so the student is never taught turns longer than it may write)."""
    shard_tasks: int = Field(8, ge=1)
    """Tasks per shard (the import teacher shards by `import.batch_rows`). Finished shards are kept on disk, so a
    rerun resumes after them."""
    keep_format_errors: bool = False
    """Keep trajectories that recovered from a format error. Off (Mini-o3 keeps only clean ones): the erroneous
    turn is an assistant turn, so training on it would teach the mistake along with the recovery."""
    require_think: bool = True
    """Keep only trajectories whose every assistant turn reasons inside <think>…</think>."""
    min_tool_calls: int = Field(1, ge=0)
    """Keep only trajectories with at least this many tool calls (the cold start teaches searching)."""
    viewer_trajectories: int = Field(40, ge=0)
    """Trajectories shown in viewer.html (kept ones, then a few rejected ones)."""
    reward: RewardConfig = RewardConfig()
    """How answers are judged right (exact match, or an LLM judge for free-form answers)."""
    oracle: OracleParams = OracleParams()
    """Settings of the oracle teacher."""
    openai: OpenAITeacherParams = OpenAITeacherParams()
    """Settings of the openai teacher (the endpoint itself is rollout.openai)."""
    import_: ImportParams = Field(ImportParams(), alias="import")
    """Settings of the import teacher (key `import` in params.yaml)."""

    @model_validator(mode="after")
    def _import_has_a_path(self) -> SynthParams:
        if self.teacher == "import" and not self.import_.path:
            raise ValueError("import.path: the import teacher needs the path of the cold-start set (import.format)")
        return self

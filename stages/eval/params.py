"""The `eval` section of params.yaml."""

from __future__ import annotations

from pydantic import Field, model_validator

from loupe.config import Section
from loupe.rewards import RewardConfig


class BenchmarkSpec(Section):
    """One benchmark to evaluate, read from a local copy."""

    name: str
    """Benchmark reader (loupe.data.benchmarks.BENCHMARKS): synthetic (or tasks: any task folder's test.jsonl,
    e.g. one `loupe data import` wrote), vstar, hrbench4k, hrbench8k, visualprobe_easy/medium/hard,
    mme_realworld_lite, superclevr and geoqa (R1-V's test prompts)."""
    path: str
    """Local file or folder in the benchmark's published format."""
    limit: int | None = Field(None, ge=1)
    """Evaluate only the first N questions (smoke runs); None for all."""


class EvalParams(Section):
    """How the eval stage scores a model; every model of one run (base, SFT, RL) is scored the same way."""

    benchmarks: list[BenchmarkSpec] = [BenchmarkSpec(name="synthetic", path="work/data/tasks")]
    """Benchmarks to run, in order. A missing path is an error, never a skipped benchmark."""
    samples: int = Field(1, ge=1)
    """K samples per question: accuracy is Avg@K (mean over samples), plus pass@K. Mini-o3 reports Avg@32."""
    max_turns: int = Field(8, ge=1)
    """Turn limit at test time; the turn-scaling curve covers 1, 2, 4, ... up to it (Mini-o3 tests up to 32)."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature for eval; None keeps rollout.temperature."""
    chunk_size: int = Field(32, ge=1)
    """Questions rolled out together (each with its K samples). Eval runs a benchmark a chunk at a time and
    writes each chunk's trajectories and result rows before the next starts, so its memory (decoded originals,
    crops, token traces) is bounded by the chunk, not the benchmark. Larger chunks keep the engine busier (a
    chunk's slowest trajectory holds up the next chunk). Sampled results depend on (seed, chunk_size): the
    engines draw their random numbers in the loop's order, which the chunking sets (the transformers engine
    from one torch stream, vLLM a seed per request in order), and no engine can be reseeded per question.
    Greedy decoding (temperature 0) gives the same outputs whatever the chunking, up to the engine's
    batch-size numerics (exact on CPU in tests/test_eval_streaming.py). A benchmark no larger than one chunk
    runs as one batch, exactly as before chunking existed."""
    model_processes: int | None = Field(None, ge=1)
    """Models evaluated at once, each in its own process at one torch thread. None: every model side by side
    when the transformers engine runs on the CPU and each model has 100 trajectories or more (a process's start
    costs about 8 s), one after another on a GPU, another engine or a small evaluation. A model's files are the
    same either way (stages/eval/side_by_side.py); memory holds that many models and their batches."""
    viewer_trajectories: int = Field(40, ge=0)
    """Trajectories shown in the HTML viewer page."""
    reward: RewardConfig = RewardConfig()
    """How answers are scored (exact match or an LLM judge for free-form answers)."""

    @model_validator(mode="after")
    def _names_unique(self) -> EvalParams:
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"benchmarks: each benchmark may appear once, got {names}")
        return self

    @property
    def turn_limits(self) -> list[int]:
        """1, 2, 4, ... and the maximum itself."""
        limits, limit = [], 1
        while limit < self.max_turns:
            limits.append(limit)
            limit *= 2
        return limits + [self.max_turns]

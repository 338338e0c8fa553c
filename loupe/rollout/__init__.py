"""The one multi-turn rollout loop (loop.py) over pluggable engines (transformers, vllm, openai)."""

from __future__ import annotations

from typing import Any

from loupe.config import ProtocolParams, RolloutParams
from loupe.protocol import get_protocol
from loupe.rollout.engine import Engine, Generation, TokenTrace
from loupe.rollout.loop import RolloutStats, run_rollouts
from loupe.tools import fit_to_budget

__all__ = ["Engine", "Generation", "RolloutStats", "TokenTrace", "fit_to_budget", "make_engine", "run_rollouts"]


def make_engine(
    rollout: RolloutParams,
    protocol: ProtocolParams,
    model_path: str | None = None,
    seed: int = 0,
    model: Any = None,
    processor: Any = None,
    sleep_mode: bool = False,
    compute_dtype: Any = None,
) -> Engine:
    """Build the engine `rollout.engine` names; a loaded `model`/`processor` pair is reused when given.
    `sleep_mode`: a vLLM engine that can free its GPU memory while a colocated learner updates.
    `compute_dtype`: the transformers engine generates under autocast to it (a colocated learner's float32
    module in bf16 on a GPU)."""
    # DeepEyes' turns run to their end (protocol.turn_reading: deepeyes): no stop string
    stop = () if getattr(protocol, "turn_reading", "first_call") == "deepeyes" else get_protocol(protocol.name).stop
    if rollout.engine == "openai":
        from loupe.rollout.openai_engine import OpenAIEngine

        engine = OpenAIEngine(rollout.openai, stop, rollout.temperature, rollout.top_p, seed)
        engine.top_k = rollout.top_k
        engine.later_temperature = rollout.later_turn_temperature
        return engine
    if model_path is None and (model is None or processor is None):
        raise ValueError(f"the {rollout.engine} engine needs a model directory")
    from loupe.models import load_processor

    processor = processor if processor is not None else load_processor(model_path)
    if rollout.engine == "vllm":
        from loupe.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            str(model_path),
            processor,
            stop,
            rollout.temperature,
            rollout.top_p,
            seed,
            max_images=protocol.max_images,
            max_context_tokens=protocol.max_context_tokens,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            dtype=rollout.vllm_dtype,
            enable_sleep_mode=sleep_mode,
        )
        engine.top_k = rollout.top_k
        engine.later_temperature = rollout.later_turn_temperature
        return engine
    from loupe.models import load_model
    from loupe.rollout.hf import TransformersEngine

    model = model if model is not None else load_model(model_path, device=rollout.device)
    engine = TransformersEngine(model, processor, stop, rollout.temperature, rollout.top_p, rollout.batch_size, seed,
                                compute_dtype=compute_dtype)
    engine.top_k = rollout.top_k
    engine.later_temperature = rollout.later_turn_temperature
    return engine

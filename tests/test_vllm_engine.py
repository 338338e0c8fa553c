"""The vLLM engine on a GPU: the same loop, the same tokens as the transformers engine under greedy decoding.

Marked `gpu`: deselected by default; run with `pytest -m gpu` on a machine with CUDA and vLLM 0.33.
"""

from __future__ import annotations


import pytest

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.models import load_model, load_processor
from loupe.protocol import get_protocol
from loupe.rollout.hf import TransformersEngine
from loupe.rollout.loop import run_rollouts

pytestmark = pytest.mark.gpu

PROTOCOL = ProtocolParams(min_pixels=3136, max_pixels=50176, max_turns=3)


def tasks(n: int) -> list[TaskRecord]:
    return [
        TaskRecord(doc_id=f"q{i}", images=["scene.png"], problem=f"Which colour is square {i}?", solution="A",
                   options=["yellow", "blue"])
        for i in range(n)
    ]


def test_vllm_greedy_matches_transformers_greedy(tiny_model_dir, scene_dir):
    import torch

    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    from loupe.rollout.vllm_engine import VLLMEngine

    processor = load_processor(tiny_model_dir)
    stop = get_protocol("mini_o3").stop
    vllm_engine = VLLMEngine(str(tiny_model_dir), processor, stop, temperature=0.0, seed=0, dtype="float32",
                             gpu_memory_utilization=0.3)
    from_vllm = run_rollouts(tasks(8), vllm_engine, PROTOCOL, scene_dir, max_new_tokens=32)
    vllm_engine.close()
    model = load_model(tiny_model_dir, device="cuda", dtype="float32")
    hf_engine = TransformersEngine(model, processor, stop, temperature=0.0, batch_size=8)
    from_hf = run_rollouts(tasks(8), hf_engine, PROTOCOL, scene_dir, max_new_tokens=32)
    assert [t.end_reason for t in from_vllm] == [t.end_reason for t in from_hf]
    same = sum(a.trace.input_ids == b.trace.input_ids for a, b in zip(from_vllm, from_hf))
    assert same >= 6, f"only {same}/8 trajectories agree token for token"
    for t in from_vllm:
        flags = t.trace.generated
        assert len(flags) == len(t.trace.logprobs) == len(t.trace.input_ids) and sum(flags) == t.generated_tokens

"""CPU tests for code paths that only a GPU takes: the attention kernel choice on CUDA and ROCm, the order in
which vLLM's caches are reset around sleep and a weight sync, and the optimiser's offload before a colocated
engine wakes. The paths run on a GPU in `benchmarks/gpu_check.py`; here each decision is checked on its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loupe.rollout import kv_batch
from loupe.rollout.vllm_engine import VLLMEngine
from stages.rl.learner import move_optimizer_state


def test_grouped_heads_go_to_the_kernel_except_where_no_fused_kernel_takes_them_masked():
    assert kv_batch.gqa_in_kernel("cpu", masked=True) and kv_batch.gqa_in_kernel("cpu", masked=False)
    # CUDA: the memory-efficient kernel takes a mask and grouped heads; ROCm's takes no grouped heads, and flash
    # no mask, so there a masked grouped call is repeated first.
    assert kv_batch.gqa_in_kernel("cuda", masked=True, rocm=False)
    assert not kv_batch.gqa_in_kernel("cuda", masked=True, rocm=True)
    assert kv_batch.gqa_in_kernel("cuda", masked=False, rocm=True)


def test_the_repeated_heads_path_gives_the_same_attention(monkeypatch):
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    module = SimpleNamespace(is_causal=True)
    grouped, _ = kv_batch.sdpa_gqa_attention(module, query, key, value, mask)
    sent: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        sent.append({"key_heads": args[1].shape[1], "enable_gqa": kwargs["enable_gqa"]})
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_batch, "gqa_in_kernel", lambda device_type, masked: False)  # as on ROCm with a mask
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    repeated, _ = kv_batch.sdpa_gqa_attention(module, query, key, value, mask)
    assert sent == [{"key_heads": 4, "enable_gqa": False}]
    torch.testing.assert_close(repeated, grouped)


class FakeLLM:
    """The parts of `vllm.LLM` the engine's sync path calls, recording the order."""

    def __init__(self, prefix_reset_ok: bool = True):
        self.calls: list[str] = []
        self.prefix_reset_ok = prefix_reset_ok
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: self.calls.append("reset_encoder_cache"))

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags) -> None:
        self.calls.append(f"wake_up {tags}")

    def collective_rpc(self, method: str, args=()):
        self.calls.append(method)
        return [3]

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return self.prefix_reset_ok


def _engine(llm: FakeLLM) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: only the sync bookkeeping runs
    engine.llm, engine._kv_cache_asleep, engine._caches_stale = llm, False, False
    return engine


def test_caches_are_reset_after_a_sync_and_only_once_the_kv_cache_is_awake():
    llm = FakeLLM()
    engine = _engine(llm)
    assert engine.receive_weights([[["w", "float32", [1]]]]) == 3
    assert llm.calls == ["receive_weights", "reset_prefix_cache", "reset_encoder_cache"]
    llm.calls.clear()
    engine.sleep()
    engine.wake_up(["weights"])
    engine.receive_weights([])
    assert llm.calls == ["sleep 2", "wake_up ['weights']", "receive_weights"]  # KV cache still released: wait
    engine.wake_up(["kv_cache"])
    assert llm.calls[3:] == ["wake_up ['kv_cache']", "reset_prefix_cache", "reset_encoder_cache"]
    engine.wake_up(["kv_cache"])  # nothing stale any more
    assert llm.calls[-1] == "wake_up ['kv_cache']"


def test_a_refused_prefix_reset_is_an_error_not_a_stale_cache():
    engine = _engine(FakeLLM(prefix_reset_ok=False))
    with pytest.raises(RuntimeError, match="prefix cache was not reset"):
        engine.receive_weights([])


def test_the_optimiser_state_moves_off_the_device_and_back():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    assert move_optimizer_state(optimizer, "cpu") == 0  # already there
    assert move_optimizer_state(optimizer, "meta") == state_bytes  # a stand-in for the GPU -> host move
    assert all(v.device.type == "meta" for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))

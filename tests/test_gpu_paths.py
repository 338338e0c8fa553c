"""CPU tests for code paths that only a GPU takes: the masked grouped attention a GPU runs in its math kernel, the order in
which vLLM's caches are reset around sleep and a weight sync, and the optimiser's offload before a colocated
engine wakes. The paths run on a GPU in `benchmarks/gpu_check.py`; here each decision is checked on its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loupe.rollout import kv_batch
from loupe.rollout.vllm_engine import VLLMEngine
from stages.rl.optimizer import move_optimizer_state


def test_a_masked_grouped_call_hands_the_grouped_heads_to_sdpa_and_matches_repeated_heads(monkeypatch):
    """The engine's attention never copies the cache to repeat heads, masked (a padded batch) or not; the numbers
    are those of transformers' repeated-heads call. On a GPU the masked call runs in the math kernel, which
    benchmarks/gpu_check.py measured faster than repeating into the memory-efficient kernel (kv_batch's docstring)."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    module = SimpleNamespace(is_causal=True)
    real = torch.nn.functional.scaled_dot_product_attention
    repeated = real(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2)
    sent: list[dict] = []

    def spy(*args, **kwargs):
        sent.append({"key_heads": args[1].shape[1], "enable_gqa": kwargs["enable_gqa"], "masked": kwargs["attn_mask"] is not None})
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    grouped, _ = kv_batch.sdpa_gqa_attention(module, query, key, value, mask)
    assert sent == [{"key_heads": 2, "enable_gqa": True, "masked": True}]
    torch.testing.assert_close(grouped, repeated.contiguous())


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

"""The real vLLM (the CPU build) behind loupe's `VLLMEngine`: rollouts through vLLM's scheduler, model runner and
sampler, weights synced into the live engine from a learner, and the encoder-cache check.

1. Rollouts of image questions on the tiny model; the learner (`stages.rl.learner.Learner`, float32) scores the
   same tokens: the engine/learner log-prob gap.
2. The learner's vision tower alone is changed and synced into the engine over the weight-sync group (gloo, the
   path vLLM's CPU workers take: `reload_weights`). The same images, seen before the sync, are rolled out again:
   their log-probs must move with the new vision tower and agree with the learner's again (vLLM caches encoder
   outputs by image hash; a cache left as it was would keep the old features).
3. A second vision-only sync with the scheduler's encoder-cache reset skipped: what happens then is recorded.

    .venv-vllm/bin/python tests/vllm_checks/engine_sync.py --model DIR
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from _harness import main, model_dir, quiet, versions

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def gap(engine_lps: list, learner_lps: list) -> dict[str, float]:
    from stages.rl.trainer import logprob_gap

    return logprob_gap(engine_lps, learner_lps)


def check(result: dict) -> None:
    quiet()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from rl_helpers import make_toy_tasks

    from loupe.config import ProtocolParams, RolloutParams
    from loupe.data.tasks import read_tasks
    from loupe.rollout import make_engine, run_rollouts
    from loupe.rollout.weight_sync import free_address, plan_manifest
    from stages.rl.learner import Learner
    from stages.rl.params import RLParams
    from stages.rl.trainer import to_sequence

    model = model_dir()
    result["versions"] = versions()
    scratch = Path(tempfile.mkdtemp(prefix="vllm-sync-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    root = make_toy_tasks(scratch)
    tasks = read_tasks(root / "train.jsonl")[:3]
    protocol = ProtocolParams(max_turns=2, max_context_tokens=2048)
    rollout = RolloutParams(engine="vllm", temperature=1.0, max_new_tokens=12, vllm_dtype=os.environ.get("VLLM_CHECK_DTYPE", "float32"))
    engine = make_engine(rollout, protocol, model_path=model, seed=0)
    result["weights_format"] = list(engine.weights_format())
    result["device_identity"] = engine.device_identity()
    learner = Learner(model, RLParams(), temperature=1.0, generation_budget=24, device="cpu")

    def roll(seed: int, old_weights: dict | None = None) -> dict:
        engine.reseed(seed)
        trajectories = run_rollouts(tasks, engine, protocol, str(root), 2, 2, 12)
        sequences = [to_sequence(t, True, "0") for t in trajectories]
        engine_lps = [s.old_logprobs for s in sequences]
        found = {"tokens": sum(int(s.num_trained) for s in sequences), "gap": gap(engine_lps, learner.logprobs(sequences)),
                 "ends": sorted({t.end_reason for t in trajectories}), "ids": [t.trace.input_ids for t in trajectories],
                 "engine_lps": [x.tolist() for x in engine_lps]}
        if old_weights is not None:  # the same tokens scored by the weights before the sync
            new_weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
            learner.model.load_state_dict(old_weights)
            found["gap_to_old_weights"] = gap(engine_lps, learner.logprobs(sequences))
            learner.model.load_state_dict(new_weights)
        return found

    before = roll(1)
    result["before"] = {k: v for k, v in before.items() if k in ("tokens", "gap", "ends")}

    host, port = free_address()
    joined = threading.Thread(target=engine.init_weight_sync, args=(host, port, 1, 2, "gloo", 120.0))
    joined.start()
    learner.init_weight_sync(host, port, 2, "gloo", 120.0)
    joined.join()
    manifest = plan_manifest(learner.weight_specs(), torch.float32, 64 << 10)  # small buckets: several broadcasts
    result["manifest_buckets"] = len(manifest)

    def sync() -> int:
        loaded: list[int] = []
        receiver = threading.Thread(target=lambda: loaded.append(engine.receive_weights(manifest)))
        receiver.start()
        learner.send_weights(manifest)
        receiver.join()
        return loaded[0] if loaded else -1

    def change_vision_tower(seed: int) -> list[str]:
        generator = torch.Generator().manual_seed(seed)
        changed = []
        with torch.no_grad():
            for name, tensor in learner.model.named_parameters():
                if ".visual." in f".{name}" and tensor.dim() == 2:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
                    changed.append(name)
        return changed

    # Same weights first: a sync of unchanged weights leaves the log-probs as they were (same seed, same tokens).
    result["loaded_same"] = sync()
    same = roll(1)
    result["same_weights_same_tokens"] = same["ids"] == before["ids"]
    result["same_weights_max_lp_change"] = max(
        (abs(a - b) for x, y in zip(same["engine_lps"], before["engine_lps"]) for a, b in zip(x, y)), default=None)

    old_weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    changed = change_vision_tower(7)
    result["vision_tensors_changed"] = len(changed)
    result["text_tensors_changed"] = sum(".visual." not in f".{n}" for n in changed)
    result["loaded"] = sync()
    result["manifest_tensors"] = sum(len(b) for b in manifest)
    # The images were encoded before the sync: had vLLM kept their features, the engine's log-probs would stay
    # near the old weights' and away from the new.
    after = roll(1, old_weights)
    result["after"] = {k: v for k, v in after.items() if k in ("tokens", "gap", "gap_to_old_weights", "ends")}

    # The scheduler's encoder-cache reset skipped on purpose: what vLLM does with a seen image then.
    change_vision_tower(8)
    original = engine.llm.llm_engine.reset_encoder_cache
    engine.llm.llm_engine.reset_encoder_cache = lambda: None
    try:
        sync()
        try:
            stale = roll(1)
            result["without_encoder_reset"] = {"error": None, "gap": stale["gap"]}
        except Exception as error:  # noqa: BLE001 - recorded: the point is what vLLM does
            result["without_encoder_reset"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    finally:
        engine.llm.llm_engine.reset_encoder_cache = original
    engine.close()


if __name__ == "__main__":
    main(check)

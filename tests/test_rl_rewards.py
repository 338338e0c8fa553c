"""The rl stage's reward pool: LLM-judge calls overlap, verdicts are cached, a failed judge makes a reward
invalid (neither trained nor counted), and custom reward functions may see the whole trajectory."""

from __future__ import annotations

import threading
import time

from fake_openai import FakeOpenAIServer
from rl_helpers import TOY_REWARD

from loupe.rewards import JudgeConfig, RewardConfig
from loupe.trajectory import Trajectory, Turn
from stages.rl.params import RLParams
from stages.rl.trainer import _trainable
from stages.rl.workers import RewardPool

KEY_ENV = "LOUPE_TEST_RL_JUDGE_KEY"


def _trajectory(k: int, answer: str) -> Trajectory:
    task = {"doc_id": f"q{k}", "images": ["x.png"], "problem": "What colour is the car?", "solution": "red"}
    t = Trajectory(traj_id=f"q{k}#0", task=task, protocol="mini_o3", system="", end_reason="answered", answer=answer)
    t.turns = [Turn("user", "<image>\nWhat colour?", images=[0]),
               Turn("assistant", f"<think>look</think>\n<answer>{answer}</answer>", action="answer")]
    return t


def test_judge_calls_overlap_are_cached_and_failures_are_invalid(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def judge(request: dict) -> str:
        prompt = request["messages"][-1]["content"]
        if "broken" in prompt:
            raise RuntimeError("judge model crashed")
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.2)  # long enough that concurrent requests are in flight together
        with lock:
            state["now"] -= 1
        return "Score: 1" if "crimson" in prompt else "Score: 0"

    with FakeOpenAIServer(judge, api_key="sk-test") as server:
        config = JudgeConfig(base_url=server.base_url, model="judge", api_key_env=KEY_ENV, max_retries=1,
                             backoff_s=0.0, cache_dir=str(tmp_path / "cache"))
        pool = RewardPool(RewardConfig(free_form_match="judge", judge=config), concurrency=8)
        answers = ["crimson", "blue", "red", "crimson red", "green", "broken", "maroon", "crimson!"]
        trajectories = [_trajectory(k, a) for k, a in enumerate(answers)]
        scores = pool.score(trajectories)
        assert [s["accuracy"] for s in scores] == [1.0, 0.0, 1.0, 1.0, 0.0, None, 0.0, 1.0]
        assert state["most"] > 1, "judge calls must overlap"
        calls = server.count()
        assert pool.score(trajectories[:5]) == scores[:5]
        assert server.count() == calls, "a second scoring is answered from the cache"

    for t, s in zip(trajectories, scores):
        t.rewards = s
    params = RLParams()
    assert _trainable(trajectories[5], params) == (False, False)  # judge outage: not wrong, just unknown
    assert _trainable(trajectories[1], params) == (True, True)


def test_custom_reward_sees_the_trajectory():
    pool = RewardPool(RewardConfig(), custom_reward=f"{TOY_REWARD}:letter_in_response")
    found = pool.score([_trajectory(0, "B is my pick"), _trajectory(1, "none")])
    # the toy reward looks for the task's solution ("red" here) in the first response
    assert [s["total"] for s in found] == [0.0, 0.0]
    t = _trajectory(2, "red")
    assert pool.score([t])[0]["total"] == 1.0 and pool.score([t])[0]["matched_by"] == "custom"

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


def test_a_verl_compute_score_is_called_as_verl_calls_it(tmp_path):
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`: the response's text, the
    record's solution and extra fields; a dict's `score` is the total and its `acc` the accuracy."""
    source = tmp_path / "verl_reward.py"
    source.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = ground_truth in solution_str\n"
        "    return {'score': (2.0 if right else -1.0) + (0.5 if data_source == 'geo' else 0.0),\n"
        "            'acc': float(right), 'seen': extra_info.get('hint')}\n"
    )
    pool = RewardPool(RewardConfig(), custom_reward=f"{source}:compute_score")
    right, wrong = _trajectory(0, "red"), _trajectory(1, "blue")
    right.task = {**right.task, "data_source": "geo", "hint": "look left"}
    scored = pool.score([right, wrong])
    assert [s["total"] for s in scored] == [2.5, -1.0]
    assert [s["accuracy"] for s in scored] == [1.0, 0.0]
    plain = tmp_path / "plain.py"
    plain.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 'yes'\n")
    import pytest

    from loupe.rewards import CustomRewardError

    with pytest.raises(CustomRewardError, match="expected a number or a dict with 'score'"):
        RewardPool(RewardConfig(), custom_reward=f"{plain}:compute_score").score([wrong])


def test_rewards_follow_the_tasks_data_source():
    """verl dispatches by data_source; so does `by_data_source`: the same answer, scored by each source's rule."""
    from loupe.data.tasks import TaskRecord
    from loupe.rewards import score

    cfg = RewardConfig(free_form_match="exact", format_weight=0.5,
                       by_data_source={"math": {"free_form_match": "math", "format_weight": 0.0}})
    def task(source):
        return TaskRecord(doc_id="q", images=[], problem="Half of one?", solution="\\frac{1}{2}", data_source=source)
    as_math = score(task("math"), "0.5", "answered", 0, 0, True, cfg)
    as_text = score(task("visual"), "0.5", "answered", 0, 0, True, cfg)
    assert (as_math.accuracy, as_math.total, as_math.matched_by) == (1.0, 1.0, "math")
    assert (as_text.accuracy, as_text.total, as_text.matched_by) == (0.0, 0.5, "exact")
    import pytest

    with pytest.raises(ValueError, match="by_data_source.vstar: judge: a judge section is required"):
        RewardConfig(by_data_source={"vstar": {"free_form_match": "judge"}})

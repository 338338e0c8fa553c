"""What the Mini-o3 preset trains on, worked from Mini-o3's code (Mini-o3/Mini-o3@8654dbf; docs/recipes.md, the
Mini-o3 table): multi-line answers, the length-cut turn, a call past the turn limit, out-of-range boxes, the judge,
crop resampling, the cold-start rows and the run's length. Each test states upstream's rule with its lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fake_openai import FakeOpenAIServer
from PIL import Image
from rl_helpers import make_toy_tasks, write_params
from test_rollout_loop import ScriptedEngine

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.rewards import JudgeConfig, LLMJudge
from loupe.rewards.judge import parse_mini_o3_score
from loupe.rewards.mini_o3 import mini_o3_answer
from loupe.rollout.engine import TokenTrace
from loupe.rollout.loop import run_rollouts
from loupe.tools import PixelBudget, fit_crop, mini_o3_resize
from loupe.trajectory import Trajectory, Turn
from pipelines.workspace import read_recipe
from stages.rl.inputs import read_inputs
from stages.rl.params import RLParams
from stages.rl.trainer import to_sequence
from stages.synth.rejection import RejectionRules, rejection_reason

REPO = Path(__file__).resolve().parent.parent
PRESET = read_recipe(REPO, REPO / "params" / "mini-o3.yaml")


def test_an_answer_spanning_lines_goes_to_the_judge_unstripped():
    """general_qa_tool.py:289-290: `re.search(r'<answer>(.*?)</answer>', ..., re.DOTALL)` on the joined turns."""
    assert mini_o3_answer(["<think>looked</think>\n<answer>\nred\n</answer>"]) == "\nred\n"
    assert mini_o3_answer(["<grounding>{}</grounding>", "<answer>a\nb</answer> <answer>c</answer>"]) == "a\nb"
    assert mini_o3_answer(["<answer>\nred"]) is None


# --- the rollout: a call past the limit, an out-of-range box ---------------------------------------------------


def _rollout(tmp_path: Path, turns: list[str], **protocol) -> Trajectory:
    Image.new("RGB", (1000, 800), (90, 120, 150)).save(tmp_path / "scene.png")
    params = ProtocolParams.model_validate({**PRESET["protocol"], "max_turns": 2, **protocol})
    task = TaskRecord(doc_id="t", images=["scene.png"], problem="What colour?", solution="red")
    [trajectory] = run_rollouts([task], ScriptedEngine([turns]), params, tmp_path, max_turns=2)
    return trajectory


CALL = '<think>zoom</think>\n<grounding>{"bbox_2d": [0.1, 0.1, 0.5, 0.5], "source": "original_image"}</grounding>'
BROKEN_CALL = '<think>zoom again</think>\n<grounding>{"bbox_2d": [0.1, 0.1]}</grounding>'


def test_a_malformed_call_in_the_last_round_is_over_turn_as_in_mini_o3(tmp_path):
    """vllm_async_engine.py:697-706: any `<grounding>(.*?)</grounding>` match when no round is left sets `exceed`,
    before the call is parsed; `ignore_exceed` then masks it (dp_actor.py:316-322)."""
    assert PRESET["protocol"]["call_at_limit"] == "matched"
    matched = _rollout(tmp_path, [CALL, BROKEN_CALL])
    assert matched.end_reason == "over_turn" and matched.num_tool_calls == 2
    parsed = _rollout(tmp_path, [CALL, BROKEN_CALL], call_at_limit="parsed")  # Loupe's default rule
    assert parsed.end_reason == "format_error"
    early = _rollout(tmp_path, [BROKEN_CALL, "<think>ok</think>\n<answer>red</answer>"])  # not at the limit
    assert early.end_reason == "answered" and early.num_format_errors == 1


def test_a_box_past_the_edge_is_clamped_and_cut_as_in_mini_o3(tmp_path):
    """function_tools.py:52-63: relative x the source's size, int(), then clamped to [0, w-1] x [0, h-1]."""
    past = '<grounding>{"bbox_2d": [0.4, 0.25, 1.3, 0.6], "source": "original_image"}</grounding>'
    clamped = _rollout(tmp_path, [past, "<think>ok</think>\n<answer>red</answer>"])
    assert clamped.end_reason == "answered" and clamped.num_format_errors == 0
    crop = next(t.crop for t in clamped.turns if t.crop is not None)
    assert crop["box_px"] == [400, 200, 999, 480]  # the far edge kept inside the last column, as upstream's
    refused = _rollout(tmp_path, [past, "<think>ok</think>\n<answer>red</answer>"], out_of_range_boxes="refuse")
    assert refused.num_format_errors == 1


# --- crops: Mini-o3's NEAREST process_image, then the processor's resize ---------------------------------------


def test_a_crop_is_resized_as_mini_o3s_process_image_then_the_processor_do():
    """vllm_async_engine.py:189-223,551: area scaled by sqrt into [min, max] with int() sides, NEAREST; a side
    under 28 px scaled up to 28 (+1); the processor then resizes (bicubic) to its smart_resize within its own
    bounds (Qwen2.5-VL's 3,136 to 12,845,056 pixels: `:433`, dp_actor.py:262), not [40,000, 2,000,000]. Until
    issue 54 the second step used the protocol's bounds and gave 252 x 196 here."""
    budget = PixelBudget(40_000, 2_000_000)
    colours = [(255, 0, 0), (0, 0, 255)]
    region = Image.new("RGB", (20, 15))
    region.putdata([colours[(x + y) % 2] for y in range(15) for x in range(20)])
    nearest = mini_o3_resize(region, budget)
    assert nearest.size == (230, 173)  # int(20 x 11.547), int(15 x 11.547): sqrt(40000 / 300)
    assert {c for _, c in nearest.getcolors(1 << 16)} <= set(colours)  # NEAREST makes no new colour
    mini_o3 = PixelBudget(40_000, 2_000_000, crop_resample="mini_o3")
    assert fit_crop(region, mini_o3).size == (224, 168)  # the processor's smart_resize of 230 x 173: 48 tokens
    assert fit_crop(region, mini_o3).tobytes() != fit_crop(region, budget).tobytes()
    thin = mini_o3_resize(Image.new("RGB", (400, 5)), PixelBudget(784, 2_000_000))
    assert thin.height >= 28  # 400 x 5 < 784: scaled by sqrt to 396 x 4, then the short side up past 28
    assert PRESET["protocol"]["crop_resample"] == "mini_o3"


# --- training: the cut turn, the run's length ----------------------------------------------------------------


def _cut_trajectory(turns: int) -> Trajectory:
    trace = TokenTrace()
    trace.append([1, 2, 3, 4, 5], generated=False)
    for turn in range(turns):
        if turn:
            trace.append([6, 7, 8], generated=False)  # the observation turn
        trace.append([9, 10, 11], generated=True, logprobs=[-0.1, -0.2, -0.3])
    return Trajectory(traj_id="t", task={}, protocol="mini_o3", system="", end_reason="length", trace=trace)


def test_the_turn_a_length_cut_ends_is_not_trained_but_the_turns_before_it_are():
    """The response mask ends at the dialogue's last <|im_end|> (vllm_async_engine.py:916,
    torch_functional.py:171-198 `get_final_eos_mask`, dp_actor.py:312): the cut turn has none."""
    assert PRESET["rl"]["cut_turn"] == "masked"
    two = _cut_trajectory(2)
    assert to_sequence(two, True, "g").positions.tolist() == [5, 6, 7, 11, 12, 13]  # Loupe's default trains all
    assert to_sequence(two, True, "g", mask_cut_turn=True).positions.tolist() == [5, 6, 7]
    assert to_sequence(_cut_trajectory(1), True, "g", mask_cut_turn=True).num_trained == 0
    answered = _cut_trajectory(2)
    answered.end_reason = "answered"
    assert to_sequence(answered, True, "g", mask_cut_turn=True).num_trained == 6


def test_the_run_length_follows_the_train_split_as_verls_does(tiny_model_dir, tmp_path):
    """ray_trainer.py:580-581,623-628: steps = len(train_dataloader) x total_epochs, `drop_last=True`."""
    tasks = make_toy_tasks(tmp_path / "toy", count=11)
    params = write_params(tmp_path / "p.yaml", {"prompts_per_step": 4})
    data = yaml.safe_load(params.read_text())
    del data["rl"]["steps"]
    params.write_text(yaml.safe_dump({**data, "rl": {**data["rl"], "epochs": 3}}))
    inputs = read_inputs(params, tiny_model_dir, tasks)
    assert inputs.params.steps == 3 * (11 // 4)
    with pytest.raises(ValueError, match="one way"):
        RLParams(steps=5, epochs=2)
    assert PRESET["rl"]["epochs"] == 100 and "steps" not in PRESET["rl"]


# --- the judge --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "score"), [
    ("Score: 1", 1.0), ("score:0", 0.0), ("The prediction matches.\nScore: 1\nDone", 1.0), ("SCORE: **1**", 1.0),
    ("Score: 10", 1.0), ("Score: 0 (not 1)", 0.0), ("no verdict", None), ("Score: yes", None),
])
def test_the_judges_reply_is_read_as_mini_o3_reads_it(reply, score):
    """general_qa_tool.py:76-82: the first word after the last "score:" (lowercased) must hold a 0 or a 1, else
    the query is retried; :312-313: `'1' in` that word gives 1."""
    assert parse_mini_o3_score(reply) == score


def test_the_judge_asks_with_upstreams_prompts_warms_up_on_retries_and_never_caches(monkeypatch, tmp_path):
    """general_qa_tool.py:6-9 (prompts), :63-70 (temperature min(0.2 x attempt, 1), 16,384 tokens), :306-315 (asked
    each time: no cache)."""
    replies = iter(["I cannot tell.", "Score: maybe", "Score: 1", "Score: 0"])
    monkeypatch.setenv("MINI_O3_JUDGE_KEY", "k")
    with FakeOpenAIServer(lambda request: next(replies), api_key="k") as server:
        preset = PRESET["rl"]["reward"]["judge"]
        config = JudgeConfig(**{**preset, "base_url": server.base_url, "api_key_env": "MINI_O3_JUDGE_KEY",
                                "backoff_s": 0.001, "max_backoff_s": 0.01, "cache_dir": str(tmp_path)})
        judge = LLMJudge(config)
        first = judge.judge("What colour?", "red", "\nred\n")
        again = judge.judge("What colour?", "red", "\nred\n")
        bodies = [r.body for r in server.requests]
    assert (first.score, first.attempts, again.score) == (1.0, 3, 0.0)  # the same item asked anew
    assert [b["temperature"] for b in bodies] == pytest.approx([0.0, 0.2, 0.4, 0.0])
    assert {b["max_tokens"] for b in bodies} == {16384}
    system, user = bodies[0]["messages"]
    assert system["content"].startswith("You are an intelligent chatbot designed for evaluating the correctness")
    assert "2. **Ground Truth Answer**: red\n3. **Model Predicted Answer**: \nred\n" in user["content"]
    assert user["content"].endswith('The format should be "Score: 0 or 1"')
    assert list(tmp_path.rglob("*.json")) == []


# --- the cold start -------------------------------------------------------------------------------------------


def _imported(texts: list[tuple[str, str]]) -> Trajectory:
    t = Trajectory(traj_id="i", task={}, protocol="mini_o3", system="", end_reason="format_error",
                   meta={"imported": True})
    t.turns = [Turn(role, text) for role, text in texts]
    return t


def test_every_cold_start_row_llamafactory_can_train_is_kept(monkeypatch):
    """scripts/preprocess_coldstart.py:35-49 writes every row; LLaMA-Factory's sharegpt converter skips only a
    wrong role order or message count (src/llamafactory/data/converter.py, `SharegptDatasetConverter`)."""
    from loupe.protocol import get_protocol

    assert PRESET["synth"]["import"]["keep"] == "trainable"
    protocol = get_protocol("mini_o3")
    params = ProtocolParams.model_validate(PRESET["protocol"])
    checked = RejectionRules.from_params(params, 12, True, False, 0)
    trainable = RejectionRules.from_params(params, 12, True, False, 0, import_keep="trainable")
    no_answer = _imported([("user", "<image>\nq"), ("assistant", "<think>it is red</think> red")])
    assert rejection_reason(no_answer, protocol, checked) == "not_answered:format_error"
    assert rejection_reason(no_answer, protocol, trainable) is None
    ends_on_user = _imported([("user", "<image>\nq"), ("assistant", "a"), ("user", "b")])
    assert rejection_reason(ends_on_user, protocol, trainable) == "protocol"
    broken = _imported([("user", "q"), ("assistant", "a")])
    broken.meta["reject"] = "bad_image"
    assert rejection_reason(broken, protocol, trainable) == "bad_image"

"""Issue 54's second reading of the Mini-o3 preset against Mini-o3/Mini-o3@8654dbf: each test writes upstream's rule
as its code runs it (a transcription in the test, with file and line) and puts Loupe's preset beside it on an
input where the two used to differ. docs/recipes.md's Mini-o3 table has a row for each.

`eng` = verl/workers/rollout/vllm_rollout/vllm_async_engine.py, `ft` = its function_tools.py, `gqa` =
verl/utils/reward_score/general_qa_tool.py, `mmd` = verl/utils/dataset/multimodal_dataset.py, `trainer` =
verl/trainer/ppo/ray_trainer.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_openai import FakeOpenAIServer, Fault
from PIL import Image
from test_rollout_loop import ScriptedEngine

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.protocol import make_protocol
from loupe.rewards import JudgeConfig, LLMJudge, RewardConfig
from loupe.rewards.mini_o3 import mini_o3_answer
from loupe.rewards.score import score
from loupe.rollout.engine import TokenTrace
from loupe.rollout.loop import on_model_grid, run_rollouts
from loupe.tools import PixelBudget, fit_crop, fit_image
from loupe.trajectory import Trajectory
from pipelines.workspace import read_recipe
from stages.rl.params import RLParams
from stages.rl.trainer import PromptStream, Trainer, to_sequence

REPO = Path(__file__).resolve().parent.parent
PRESET = read_recipe(REPO, REPO / "params" / "mini-o3.yaml")
PROTOCOL = ProtocolParams.model_validate(PRESET["protocol"])


# --- the call grammar: eng:523-526, ft:30-50 ---------------------------------------------------------------------


def upstream_reads(turn: str, observations: int) -> tuple[list[float], int] | None:
    """What Mini-o3's engine and tool make of a call turn (None: an error turn). Only ever given the safe inputs
    below: upstream runs the box through Python's `eval`."""
    try:
        match = re.match('.*<grounding>{"bbox_2d": (.*),.*"source": [\',"](.*)[\',"]}</grounding>', turn, re.DOTALL)
        bbox, source = match.group(1), match.group(2)
        obj = {"bbox_2d": eval(bbox), "source": source}
        assert isinstance(obj["bbox_2d"], list) and len(obj["bbox_2d"]) == 4
        number = 0 if source == "original_image" else int(re.match("observation_([0-9]*)", source, re.DOTALL).group(1))
        assert number < observations + 1  # the original is observations[0]
        return obj["bbox_2d"], number
    except Exception:  # noqa: BLE001 (any failure upstream is an error turn)
        return None


CALLS = [
    '{"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "original_image"}',
    '{"bbox_2d": [0.1,0.2,0.5,0.6,], "source": "original_image"}',           # JSON refuses the trailing comma
    '{"bbox_2d": [1/4, 0.2, 0.5, 0.6], "source": \'observation_1\'}',       # arithmetic; single quotes
    '{"bbox_2d": [.1, 2e-1, .5, .6], "source": "observation_1 (the sign)"}',  # a name matched by its prefix
    '{"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "observation_0"}',         # the original by number
    '{"bbox_2d": (0.1, 0.2, 0.5, 0.6), "source": "original_image"}',        # a tuple: refused upstream
    '{"bbox_2d":[0.1, 0.2, 0.5, 0.6], "source": "original_image"}',         # no space: the pattern fails
    '{"source": "original_image", "bbox_2d": [0.1, 0.2, 0.5, 0.6]}',        # keys reversed: the pattern fails
    '{"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "observation_"}',          # no number
    '{"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "observation_2"}',         # not there yet
    '{"bbox_2d": [0.1, 0.2, 0.5], "source": "original_image"}',             # three numbers
]


@pytest.mark.parametrize("call", CALLS)
def test_a_call_reads_as_mini_o3s_engine_reads_it(call):
    turn = f"<think>look</think>\n<grounding>{call}</grounding>"
    action = make_protocol(PROTOCOL).parse(turn, num_observations=1)
    expected = upstream_reads(turn, observations=1)
    if expected is None:
        assert action.call is None and action.error is not None, (call, action)
        return
    box, number = expected
    assert action.call is not None, (call, action.error)
    assert action.call.arguments["bbox_2d"] == pytest.approx(box)
    assert action.call.arguments["source"] == ("original_image" if number == 0 else f"observation_{number}")


def test_a_box_is_evaluated_as_arithmetic_and_never_run():
    """Upstream's `eval` would run this; Loupe refuses anything but numbers, lists and arithmetic (argued in the
    table: a model's text is never code), and the strict JSON reading of Loupe's default refuses what JSON does."""
    turn = '<grounding>{"bbox_2d": [__import__("os").getpid(), 0, 1, 1], "source": "original_image"}</grounding>'
    action = make_protocol(PROTOCOL).parse(turn)
    assert action.call is None and "not a list of numbers" in action.error.detail
    strict = make_protocol(PROTOCOL.model_copy(update={"turn_reading": "first_call"}))
    assert strict.parse(f"<grounding>{CALLS[1]}</grounding>").error is not None


def _rollout(tmp_path: Path, turns: list[str], **protocol) -> Trajectory:
    Image.new("RGB", (1000, 800), (90, 120, 150)).save(tmp_path / "scene.png")
    params = PROTOCOL.model_copy(update={"max_turns": 3, **protocol})
    task = TaskRecord(doc_id="t", images=["scene.png"], problem="<image>\nWhat colour?", solution="red")
    [trajectory] = run_rollouts([task], ScriptedEngine([turns]), params, tmp_path, max_turns=3)
    return trajectory


def test_an_answer_beside_a_call_runs_the_call_and_still_counts_for_the_reward(tmp_path):
    """eng:697-714: a turn with a `<grounding>` span is a call whatever else it holds; gqa:284-295 then scores the
    first `<answer>` across the turns, this one."""
    both = f"<think>maybe</think>\n<answer>red</answer>\n<grounding>{CALLS[0]}</grounding>"
    trajectory = _rollout(tmp_path, [both, "<think>seen</think>\n<answer>blue</answer>"])
    assert trajectory.end_reason == "answered" and trajectory.num_tool_calls == 1
    assert trajectory.num_format_errors == 0 and any(turn.crop for turn in trajectory.turns)
    assert mini_o3_answer([t.text for t in trajectory.turns if t.role == "assistant"]) == "red"
    loupes = _rollout(tmp_path, [both, "<think>seen</think>\n<answer>blue</answer>"], turn_reading="first_call")
    assert loupes.num_format_errors == 1 and not any(turn.crop for turn in loupes.turns)


# --- pixels: eng:189-223,433,551; mmd:79-113,231-238; dp_actor.py:262 ---------------------------------------------


def upstream_process_image(image: Image.Image, min_pixels: int, max_pixels: int, resample: int) -> Image.Image:
    """`process_image` as eng:189-223 (NEAREST, crops) and mmd:79-113 (LANCZOS, the question's image) write it."""
    if image.width * image.height > max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)), resample=resample)
    if image.width * image.height < min_pixels:
        factor = math.sqrt(min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)), resample=resample)
    return image


def processor_size(image: Image.Image, bounds: tuple[int, int]) -> tuple[int, int]:
    """(width, height) Qwen2.5-VL's processor resizes `image` to, by transformers' own `smart_resize`."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    height, width = smart_resize(image.height, image.width, factor=28, min_pixels=bounds[0], max_pixels=bounds[1])
    return width, height


QWEN25_PROCESSOR = (3136, 12_845_056)


@pytest.mark.parametrize(("size", "shown"), [((20, 15), (224, 168)), ((3000, 1500), (1988, 1008))])
def test_a_crop_is_shown_as_the_checkpoints_processor_resizes_mini_o3s_image(size, shown):
    """The issue's two cases: NEAREST into [40,000, 2,000,000], then the processor within its own bounds (the
    checkpoint's: Qwen2.5-VL's 3,136 to 12,845,056), not the protocol's."""
    region = Image.new("RGB", size, (10, 200, 30))
    budget = PROTOCOL.budget
    assert (budget.min_pixels, budget.max_pixels, budget.processor_pixels) == (40_000, 2_000_000, None)
    expected = processor_size(upstream_process_image(region, 40_000, 2_000_000, Image.Resampling.NEAREST),
                              QWEN25_PROCESSOR)
    assert fit_crop(region, budget).size == expected == shown


def test_the_question_image_is_resized_as_mini_o3s_dataset_then_the_processor_do():
    """mmd:79-113 (LANCZOS into [40,000, 2,000,000], whole sides) then mmd:231-238 (the processor's resize)."""
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor,
    )

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1500, 3000, 3), dtype=np.uint8))
    lanczos = upstream_process_image(image, 40_000, 2_000_000, Image.Resampling.LANCZOS)
    expected_size = processor_size(lanczos, QWEN25_PROCESSOR)
    expected = lanczos.resize(expected_size, Image.Resampling.BICUBIC)
    shown = fit_image(image, PROTOCOL.budget)
    assert shown.size == expected_size and shown.tobytes() == expected.tobytes()
    assert shown.size == (1988, 1008)  # past the 2,000,000 pixels, as upstream's image is
    assert fit_image(image, PixelBudget(40_000, 2_000_000)).size == (1988, 980)  # Loupe's bicubic: within them
    processor = Qwen2VLImageProcessor(size={"shortest_edge": QWEN25_PROCESSOR[0], "longest_edge": QWEN25_PROCESSOR[1]})
    grid = processor(images=[shown], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert (grid[2] * 14, grid[1] * 14) == shown.size  # the processor resizes it no further


def test_the_processors_bounds_come_from_the_model_that_runs():
    engine = SimpleNamespace(image_factor=28, image_pixels=(3136, 50176))
    params = on_model_grid(PROTOCOL, engine)
    assert params.budget.processor_pixels == (3136, 50176)
    pinned = on_model_grid(PROTOCOL.model_copy(update={"processor_max_pixels": 1_000_000}), engine)
    assert pinned.budget.processor_pixels == (3136, 1_000_000)


# --- the judge: gqa:18-22,63-96,284-315 ---------------------------------------------------------------------------


def _judge(server: FakeOpenAIServer, monkeypatch) -> tuple[LLMJudge, list[float]]:
    monkeypatch.setenv("MINI_O3_JUDGE_KEY", "k")
    waits: list[float] = []
    monkeypatch.setattr("loupe.endpoint.time.sleep", waits.append)
    config = JudgeConfig(**{**PRESET["rl"]["reward"]["judge"], "base_url": server.base_url,
                            "api_key_env": "MINI_O3_JUDGE_KEY"})
    return LLMJudge(config), waits


def test_rate_limits_are_waited_out_uncounted_at_the_same_temperature(monkeypatch):
    """gqa:18-22: the openai client retries a 429 twice itself; gqa:86-89: a RateLimitError that outlasts it
    waits 3 s and asks again without counting an attempt, so the temperature stays min(0.2 x 0, 1) = 0. Five 429s
    in a row: upstream asks six times at 0.0 and scores the reply; Loupe before issue 54 spent its five attempts
    on them and left the trajectory untrained."""
    with FakeOpenAIServer(lambda request: "Score: 1", api_key="k") as server:
        server.add_faults(*[Fault.status(429)] * 5)
        judge, waits = _judge(server, monkeypatch)
        verdict = judge.judge("What colour?", "red", "red")
        temperatures = [r.body["temperature"] for r in server.requests]
    assert verdict.valid and verdict.score == 1.0 and verdict.attempts == 6
    assert temperatures == [0.0] * 6
    assert waits == [0.5, 1.0, 3.0, 0.5, 1.0]  # the client's two waits, upstream's 3 s, the client's again
    assert PRESET["rl"]["reward"]["judge"]["timeout_s"] == 120  # gqa:71


def test_other_failures_count_and_warm_the_temperature(monkeypatch):
    """gqa:90-96: any other exception (here HTTP 500s that outlast the client's two retries) counts an attempt,
    and the next asks at 0.2."""
    with FakeOpenAIServer(lambda request: "Score: 1", api_key="k") as server:
        server.add_faults(*[Fault.status(500)] * 5)
        judge, _ = _judge(server, monkeypatch)
        verdict = judge.judge("What colour?", "red", "red")
        temperatures = [r.body["temperature"] for r in server.requests]
    assert verdict.valid and temperatures == pytest.approx([0.0, 0.0, 0.0, 0.2, 0.2, 0.2])


def test_the_judge_reads_the_user_turn_as_the_model_saw_it(monkeypatch):
    """mmd:299-301 (`raw_prompt` = the user turn's content) and nmt:97: the judge's question is the problem with
    its `<image>`, not a cleaned copy."""
    with FakeOpenAIServer(lambda request: "Score: 1", api_key="k") as server:
        judge, _ = _judge(server, monkeypatch)
        task = TaskRecord(doc_id="d", images=["a.png"], problem="<image>\nWhat is written on the sign?",
                          solution="STOP")
        cfg = RewardConfig.model_validate({**PRESET["rl"]["reward"], "judge": judge.config.model_dump()})
        parts = score(task, None, "answered", 0, 0, True, cfg, judge,
                      assistant_turns=["<think>t</think><answer>STOP</answer>"])
        user = server.requests[0].body["messages"][1]["content"]
    assert parts.accuracy == 1.0
    assert "**Question Related to the Image**: <image>\nWhat is written on the sign?\n" in user


# --- training: trainer:1318-1470,1559-1570; nmt:162-164; ft:217-220 ---------------------------------------------


def verl_fit(kept_by_batch: list[int], epochs: int, batches_per_pass: int, batch: int) -> tuple[int, int]:
    """Mini-o3's fit loop with rejection sampling (trainer:1318-1321,1435-1470,1559-1570): (steps trained, batches
    generated). Each generation batch adds its kept groups; a step trains once `batch` are kept (the rest cut);
    the loop over `epochs` passes ends the run, a short last batch untrained; total_training_steps bounds it."""
    total, steps, generated, kept = epochs * batches_per_pass, 0, 0, 0
    for _ in range(epochs):
        for _ in range(batches_per_pass):
            kept += kept_by_batch[generated]
            generated += 1
            if kept < batch:
                continue
            steps, kept = steps + 1, 0
            if steps >= total:
                return steps, generated
    return steps, generated


def _trajectory(k: int, total: float, valid: bool = True) -> Trajectory:
    t = Trajectory(traj_id=str(k), task={}, protocol="mini_o3", system="", end_reason="answered")
    t.rewards = {"total": total, "valid": valid}
    return t


def _scripted_trainer(groups_by_batch: list[list[list[Trajectory]]], **rl) -> Trainer:
    """A Trainer whose rollouts replay `groups_by_batch` (one list of groups per generation batch)."""
    params = RLParams(**{"samples_per_prompt": 2, "ray": {"enabled": False}, **rl})
    trainer = Trainer.__new__(Trainer)
    train = [TaskRecord(doc_id=str(k), images=[], problem="q", solution="a") for k in range(10)]
    trainer.params, trainer.ahead, trainer.ttrl, trainer.pixelis = params, None, None, None
    trainer.inputs = SimpleNamespace(train=train, seed=0)
    passes = params.run_length == "passes"
    trainer.stream = PromptStream(len(train), 0, whole_batches=params.prompts_per_step if passes else None)
    trainer.batch_budget = params.epochs * (len(train) // params.prompts_per_step) if passes else None
    script = iter(groups_by_batch)
    trainer._rollout_scored = lambda tasks, n, seeds, timing: [t for g in next(script) for t in g]
    return trainer


def _run(trainer: Trainer) -> tuple[int, int]:
    """run_loop's rule around `_collect`: a step trains on a whole batch; out of prompts with less, the run ends."""
    steps = 0
    for step in range(1, trainer.params.steps + 1):
        kept, _, timing = trainer._collect(step)
        if timing.get("out_of_prompts") and len(kept) < trainer.params.prompts_per_step:
            break
        steps += 1
    return steps, trainer.stream.batches_drawn


def test_the_run_ends_when_its_passes_are_drawn_as_verls_loop_ends():
    """10 prompts, 4 a batch: two whole batches a pass (2 prompts dropped), 3 passes. Each batch keeps 0, 1 or 2
    of its 4 groups (the rest uniform): upstream trains 2 steps over its 6 batches, the sixth's one group left
    untrained; Loupe's `steps` would keep drawing fresh prompts to its bound of 6 steps."""
    kept = [2, 2, 1, 0, 3, 1]
    batches = [[[_trajectory(0, 1.0), _trajectory(1, 0.0)] if g < k else [_trajectory(0, 1.0), _trajectory(1, 1.0)]
                for g in range(4)] for k in kept]
    trainer = _scripted_trainer(batches, prompts_per_step=4, epochs=3, run_length="passes",
                                dynamic_sampling={"enabled": True, "max_tries": 256})
    assert trainer.params.steps == 4  # the inputs set 3 x 2 = 6 from the split; unset here: the bound is rl.steps
    trainer.params = trainer.params.model_copy(update={"steps": 6})
    assert _run(trainer) == verl_fit(kept, 3, 2, 4) == (2, 6)
    assert trainer.stream.position == 2 * 10 + 8  # every pass's last 2 prompts dropped
    stream = PromptStream(10, 0, whole_batches=4)
    for _ in range(3):
        stream.take(4)
    assert (stream.position, stream.batches_drawn) == (14, 3)  # the third batch starts the second pass


def test_a_judge_failure_drops_its_whole_group():
    """nmt:162-164 (`is_filter`), ft:217-220: the uid of a trajectory the judge failed is left out whole."""
    failed = [_trajectory(0, 1.0), _trajectory(1, 0.0, valid=False)]
    good = [_trajectory(2, 1.0), _trajectory(3, 0.0)]
    trainer = _scripted_trainer([[failed, good]], prompts_per_step=2, steps=1, invalid_reward="group",
                                dynamic_sampling={"enabled": False})
    kept, _, _ = trainer._collect(1)
    assert kept == [good]
    trainer = _scripted_trainer([[failed, good]], prompts_per_step=2, steps=1, dynamic_sampling={"enabled": False})  # Loupe's default keeps the group
    kept, _, _ = trainer._collect(1)
    assert kept == [failed, good]


def _sequence(ids: list[int], end: int, trained: bool = True, reason: str = "answered"):
    trace = TokenTrace()
    trace.append([1, 2, 3], generated=False)
    trace.append([*ids, end], generated=True, logprobs=[-0.1] * (len(ids) + 1))
    t = Trajectory(traj_id="t", task={}, protocol="mini_o3", system="", end_reason=reason, trace=trace)
    return to_sequence(t, trained, "g", mask_cut_turn=True, end_of_turn_id=151645)


def test_a_last_turn_ended_by_endoftext_is_not_trained():
    """eng:508-510 and torch_functional.py:171-198: the response mask ends at the last <|im_end|> (151645); a last
    turn ended by <|endoftext|> (151643) is after it."""
    assert _sequence([7, 8], 151645).num_trained == 3
    assert _sequence([7, 8], 151643).num_trained == 0


class _RecordingLearner:
    """The learner's update with `_backward` recorded, not run: which rows each micro-batch holds, divided by what."""

    def __init__(self, tiny_model_dir: Path, **rl):
        from stages.rl.learner import Learner

        self.calls: list[tuple[int, float]] = []
        self.learner = Learner(tiny_model_dir, RLParams(**{"lr": 0.01, "ray": {"enabled": False}, **rl}), 1.0, 64)
        self.learner._backward = lambda micro, normaliser, scale=1.0, kl_tokens=1.0: (
            self.calls.append((len(micro), normaliser)) or {})


def test_rows_masked_whole_count_in_the_sequence_mean_as_verl_counts_them(tiny_model_dir):
    """dp_actor.py:284-286,316-322,394: one-sequence micro-batches (RM:135), each its token mean, summed and divided
    by the accumulation count, an over-turn row's mean 0 among them: four rows, one masked, divide by four."""
    rows = [_sequence([7, 8], 151645) for _ in range(3)] + [_sequence([7, 8], 151645, trained=False)]
    masked = _RecordingLearner(tiny_model_dir, micro_batch_size=1, loss_aggregation="seq_mean_token_mean",
                               masked_rows_in_loss=True)
    masked.learner.update(rows)
    assert masked.calls == [(1, 4.0)] * 3
    loupes = _RecordingLearner(tiny_model_dir, micro_batch_size=1, loss_aggregation="seq_mean_token_mean")
    loupes.learner.update(rows)
    assert loupes.calls == [(1, 3.0)] * 3


def test_a_prompt_past_the_length_limit_is_left_out_as_mini_o3s_dataset_filters(tiny_model_dir, tmp_path):
    """mmd:201-204: `len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True)) <= max_prompt_length`,
    the prompt being the system turn and the record's problem, `<image>` unexpanded."""
    from transformers import AutoTokenizer

    from stages.rl.inputs import prompts_within

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    short = TaskRecord(doc_id="s", images=["a.png"], problem="<image>\nWhat colour?", solution="red")
    long = TaskRecord(doc_id="l", images=["a.png"], problem="<image>\n" + " ".join(["Which colour is it?"] * 40),
                      solution="red")
    protocol = make_protocol(PROTOCOL)
    def upstream_length(task: TaskRecord) -> int:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": protocol.system_prompt()},
                                             {"role": "user", "content": task.problem}],
                                            add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    lengths = [upstream_length(task) for task in (short, long)]
    assert lengths[0] < lengths[1]
    kept = prompts_within([short, long], tokenizer, PROTOCOL, lengths[1] - 1, tmp_path / "train.jsonl")
    assert [t.doc_id for t in kept] == ["s"]
    assert len(prompts_within([short, long], tokenizer, PROTOCOL, lengths[1], tmp_path / "train.jsonl")) == 2
    assert PRESET["rl"]["max_prompt_tokens"] == 8192


class _RecordingEngine(ScriptedEngine):
    def __init__(self, scripts):
        super().__init__(scripts)
        self.budgets: list[int] = []

    def generate(self, states, max_new_tokens):
        self.budgets.append(max_new_tokens)
        return super().generate(states, max_new_tokens)


def test_a_turn_is_capped_where_vllms_context_ends(tmp_path):
    """eng:306-307, yaml:125: vLLM's `max_model_len` is 32,768, so a turn stops where the dialogue reaches it even
    within its 8,192 tokens. The scripted engine counts 100 prompt tokens, 10 a turn, 50 + 64 an image turn."""
    Image.new("RGB", (1000, 800)).save(tmp_path / "scene.png")
    task = TaskRecord(doc_id="t", images=["scene.png"], problem="<image>\nWhat colour?", solution="red")
    engine = _RecordingEngine([[f"<grounding>{CALLS[0]}</grounding>", "<answer>red</answer>"]])
    params = PROTOCOL.model_copy(update={"model_len": 300, "max_context_tokens": 1000})
    run_rollouts([task], engine, params, tmp_path, max_turns=3, max_new_tokens=256)
    assert engine.budgets == [300 - 100, 300 - (100 + 10 + 114)]
    assert PRESET["protocol"]["model_len"] == 32768


def test_a_prompt_that_fills_vllms_context_is_over_turn_before_any_turn(tmp_path):
    """A question whose prompt already takes the whole context (vLLM would refuse the request) ends over-turn
    without a turn generated, as a later turn that fills it does. The scripted prompt is 100 tokens."""
    Image.new("RGB", (1000, 800)).save(tmp_path / "scene.png")
    task = TaskRecord(doc_id="t", images=["scene.png"], problem="<image>\nWhat colour?", solution="red")
    engine = _RecordingEngine([["<answer>red</answer>"]])
    params = PROTOCOL.model_copy(update={"model_len": 100, "max_context_tokens": 1000})
    [trajectory] = run_rollouts([task], engine, params, tmp_path, max_turns=3, max_new_tokens=256)
    assert engine.budgets == [] and trajectory.end_reason == "over_turn"
    [trajectory] = run_rollouts([task], _RecordingEngine([["<answer>red</answer>"]]),
                                params.model_copy(update={"model_len": 101}), tmp_path, max_turns=3,
                                max_new_tokens=256)
    assert trajectory.end_reason == "answered"


def test_ids_past_the_tokenizer_are_never_drawn(tiny_model_dir):
    """eng:677-679: Mini-o3 drops sampled ids above 151,664 (embedding rows no token names) from the turn; Loupe's
    engines never draw one (`suppress_unused_ids`: the transformers engine from its embedding's rows, vLLM from
    config.json's vocab_size), so in both no turn shows or trains one."""
    import torch

    from loupe.config import RolloutParams
    from loupe.rollout import make_engine
    from loupe.rollout.kv_batch import sample

    engine = make_engine(RolloutParams(device="cpu"), PROTOCOL, str(tiny_model_dir))
    known = len(engine.tokenizer)
    assert not any(i >= known for i in engine.suppressed)  # the tiny model names every row
    engine.suppress_unused_ids(known + 4)
    logits = torch.zeros(1, known + 4)
    logits[0, known:] = 50.0  # the unnamed rows would take nearly all the mass
    tokens, _ = sample(logits, 1.0, 1.0, engine.suppressed, torch.Generator().manual_seed(0))
    assert int(tokens[0]) < known
    index = engine._suppressed_on(logits.device)  # what the decode step masks, rebuilt for the longer list
    assert index.tolist() == engine.suppressed and set(range(known, known + 4)) <= set(index.tolist())
    tokens, _ = sample(logits, 1.0, 1.0, index, torch.Generator().manual_seed(0))
    assert int(tokens[0]) < known


@pytest.mark.parametrize("turn", [
    '<grounding>{"bbox_2d": [0.1, 0.1, 0.5, 0.5], "source": "a"}</grounding> <grounding>{"bbox_2d": [5, 6], "source": "b"}</grounding>',
    '<grounding>{"bbox_2d": [1, 2], "source": "a"}</grounding><grounding>{"bbox_2d": broken</grounding>',
    '<grounding>{"bbox_2d": [1, 2], "source": "a"} junk</grounding>',
    'no call at all',
])
def test_the_call_is_found_where_mini_o3s_whole_pattern_finds_it(turn):
    """The rightmost head whose rest matches, as the pattern's greedy `.*` settles on it, without its backtracking."""
    from loupe.protocol.mini_o3 import MINI_O3_CALL_PATTERN, _mini_o3_call_match

    found, expected = _mini_o3_call_match(turn), MINI_O3_CALL_PATTERN.match(turn)
    assert (found.groups() if found else None) == (expected.groups() if expected else None)


def test_a_quota_that_never_clears_counts_instead_of_waiting_forever(monkeypatch):
    """Upstream would wait 3 s and ask again for ever on any RateLimitError; OpenAI's `insufficient_quota` 429
    never clears, so here it counts like any failure and the judge gives up (the trajectory is not trained)."""
    with FakeOpenAIServer(lambda request: "Score: 1", api_key="k") as server:
        server.add_faults(*[Fault.status(429, message="You exceeded your current quota: insufficient_quota")] * 15)
        judge, waits = _judge(server, monkeypatch)
        verdict = judge.judge("What colour?", "red", "red")
    assert not verdict.valid and verdict.attempts == 15  # 5 attempts of 3 requests each
    assert 3.0 not in waits


def test_a_box_too_large_for_a_float_is_an_error_turn():
    action = make_protocol(PROTOCOL).parse('<think>t</think><grounding>{"bbox_2d": [1' + "0" * 400
                                           + ', 0, 1, 1], "source": "original_image"}</grounding>')
    assert action.call is None and "out of range" in action.error.detail and action.think == "t"


def test_a_passes_run_ends_when_its_prompts_are_drawn_and_resumes_to_nothing_left(tiny_model_dir, tmp_path):
    """The rl stage itself with `run_length: passes`: 10 toy prompts, 4 a batch, 3 passes, dynamic sampling on.
    However many groups the toy keeps, the stream ends after 3 x 2 whole batches (each pass's last 2 prompts
    dropped: position 28), no step draws more, the model and metrics are written, and a second run on the same
    folder resumes to nothing left to do."""
    import json

    import yaml
    from rl_helpers import make_toy_tasks, write_params

    from stages.rl import __main__ as rl_main
    from stages.rl.checkpoint import latest_checkpoint, load_checkpoint

    tasks = make_toy_tasks(tmp_path / "toy", count=10)
    params = write_params(tmp_path / "params.yaml", {
        "prompts_per_step": 4, "samples_per_prompt": 2, "epochs": 3, "run_length": "passes", "checkpoint_every": 4,
        "dynamic_sampling": {"enabled": True, "max_tries": 256}})
    data = yaml.safe_load(params.read_text())
    del data["rl"]["steps"]  # the bound comes from the split: 3 passes x 2 whole batches
    params.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    rl_main.train(params, tiny_model_dir, tasks, out, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    assert 1 <= len(train) <= 6 and sum(row["batch/tries"] for row in train) <= 6
    assert all(row["stream/batches_drawn"] <= 6 for row in train)
    _, state = load_checkpoint(latest_checkpoint(out))
    assert int(state["step"]) == len(train) and int(state["stream_position"]) == 28
    assert (out / "model" / "config.json").is_file() and json.loads((out / "metrics.json").read_text())
    rl_main.train(params, tiny_model_dir, tasks, out, progress=False)
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert again == rows

"""Putting the parts together: `score` turns one finished trajectory's facts into `RewardParts`;
`score_trajectory` reads those facts off a `Trajectory` and records the parts on it."""

from __future__ import annotations

from loupe.data.tasks import OPTION_LETTERS, TaskRecord
from loupe.protocol import IMAGE_PLACEHOLDER, last_boxed
from loupe.rewards.choice import extract_choice
from loupe.rewards.config import RewardConfig
from loupe.rewards.deepeyes import (
    DEEPEYES_MAX_ANSWER_CHARS,
    decoded_response,
    deepeyes_answer_text,
    deepeyes_common,
    deepeyes_crops,
    deepeyes_format_broken,
    deepeyes_math,
)
from loupe.rewards.format import format_reward
from loupe.rewards.judge import JudgeResult, LLMJudge
from loupe.rewards.lmm_r1 import lmm_r1_accuracy
from loupe.rewards.math_grading import grade_answer, math_equal
from loupe.rewards.mini_o3 import mini_o3_answer
from loupe.rewards.parts import RewardParts
from loupe.rewards.pixel_reasoner import (
    pixel_reasoner_accuracy,
    pixel_reasoner_response,
)
from loupe.rewards.pixelis import task_reward as pixelis_task_reward
from loupe.rewards.r1v import r1v_accuracy
from loupe.rewards.text import exact_match
from loupe.trajectory import END_REASONS, Trajectory


def tool_reward(correct: bool, num_tool_calls: int, cfg: RewardConfig) -> float:
    """`tool_bonus` for a right answer reached with at least one tool call, minus the per-call penalty."""
    bonus = cfg.tool_bonus if correct and num_tool_calls > 0 else 0.0
    return bonus - cfg.tool_call_penalty * max(0, num_tool_calls - cfg.free_tool_calls)


JUDGE_FAILED_ZERO = "judge failed, scored 0"
"""`matched_by` (after the rule's name) of an accuracy of 0 given for a failed verdict under `on_failure: zero`."""


def _judged_by(rule: str, verdicts: list[JudgeResult | None]) -> str:
    """`matched_by` for a rule that asked the judge: the rule's name, marked when a verdict was `zeroed`."""
    return f"{rule}, {JUDGE_FAILED_ZERO}" if any(v is not None and v.zeroed for v in verdicts) else rule


def _judge_question_text(task: TaskRecord, how: str = "plain") -> str:
    """The question as the judge reads it (`RewardConfig.judge_question`): `plain`, no image placeholders (the
    judge sees no image) and the options listed; `prompt`, the record's question turn verbatim (its own `prompt`,
    else its problem as written)."""
    if how == "prompt":
        return task.prompt if task.prompt is not None else task.problem
    problem = task.problem.replace(IMAGE_PLACEHOLDER, "").strip()
    if not task.options:
        return problem
    options = "\n".join(f"({letter}) {text}" for letter, text in zip(OPTION_LETTERS, task.options))
    return f"{problem}\nOptions:\n{options}"


def score(
    task: TaskRecord,
    answer: str | None,
    end_reason: str,
    num_tool_calls: int,
    num_format_errors: int,
    has_think: bool,
    cfg: RewardConfig,
    judge: LLMJudge | None = None,
    final_text: str | None = None,
    response: str | None = None,
    assistant_turns: list[str] | None = None,
    last_call_failed: bool = False,
) -> RewardParts:
    """Score one finished trajectory.

    `answer` is the text inside the final `<answer>…</answer>` (the rollout's `Action.answer`), None when the
    trajectory ended otherwise; `has_think` says whether the model's turns reasoned inside `<think>…</think>`;
    `num_format_errors` counts turns that came back as error observations; `final_text` is the last assistant
    turn verbatim (the `r1v` format rule reads it); `response` the decoded dialogue after the question (the
    `deepeyes` and `pixel_reasoner` rules read it); `last_call_failed` whether the last turn given back was an
    error (`failed_last_call_zeroes`). A trajectory that did not answer
    scores accuracy 0 (valid). Raises ValueError for an unknown end reason, or when `cfg` asks for a judge
    and none is given (configuration mistakes, not runtime trouble).
    """
    if end_reason not in END_REASONS:
        raise ValueError(f"unknown end_reason {end_reason!r}; expected one of {', '.join(END_REASONS)}")
    top, cfg = cfg, cfg.for_source(task.data_source)
    if cfg is not top and cfg.judge is not None and cfg.judge != top.judge:
        judge = _SourceJudge(cfg)  # type: ignore[assignment]
    if cfg.free_form_match in ("deepeyes_math", "deepeyes_common"):
        return _deepeyes_other(task, response if response is not None else (final_text or ""), cfg, judge)
    if cfg.free_form_match == "deepeyes":
        return _deepeyes(task, response if response is not None else (final_text or ""), cfg, judge)
    if cfg.free_form_match == "mini_o3":
        turns = assistant_turns if assistant_turns is not None else [final_text or ""]
        return _mini_o3(task, turns, end_reason, has_think, num_format_errors, num_tool_calls, cfg, judge, final_text)
    wants_judge = (cfg.free_form_match == "judge" and not task.is_choice) or (
        cfg.choice_judge_fallback and task.is_choice
    )
    if wants_judge and judge is None:
        raise ValueError("the reward config asks for an LLM judge but none was given to score()")

    fmt = format_reward(end_reason, has_think, num_format_errors, cfg.format_rule, final_text, answer)
    extracted: str | None = None
    verdict: JudgeResult | None = None
    if cfg.free_form_match == "r1v":  # R1-V reads every completion whole, answered or not
        extracted = final_text
        accuracy, matched_by = r1v_accuracy(final_text, task.solution), "r1v"
    elif cfg.free_form_match == "lmm_r1":  # LMM-R1's server reads every response whole
        extracted = final_text
        accuracy = lmm_r1_accuracy(final_text, task.solution, cfg.upstream_bugs == "fix")
        matched_by = "lmm_r1"
    elif cfg.free_form_match == "pixel_reasoner":  # graded on the whole response, answered or not
        text = pixel_reasoner_response(response if response is not None else (final_text or ""))
        extracted = last_boxed(text)
        accuracy, matched_by = pixel_reasoner_accuracy(text, task.solution), "pixel_reasoner"
    elif cfg.free_form_match == "mathruler":  # EasyR1: the last \boxed{} of the response, answered or not
        extracted = last_boxed(final_text or "")
        accuracy, matched_by = float(grade_answer(extracted if extracted is not None else "None", task.solution)), "mathruler"
    elif end_reason != "answered" or not (answer or "").strip():
        accuracy, matched_by = 0.0, "no_answer"
    elif cfg.free_form_match == "pixelis":  # the answer as written, else half its similarity (partial credit)
        extracted = answer
        accuracy, matched_by = pixelis_task_reward(answer, task.solution), "pixelis"
    elif task.is_choice:
        extracted = extract_choice(answer, task.options or [])
        accuracy, matched_by = float(extracted == task.solution), "letter"
        if extracted is None and wants_judge:
            reference = f"({task.solution}) {task.answer_text()}"
            verdict = judge.judge(_judge_question_text(task, cfg.judge_question), reference, answer)  # type: ignore[union-attr]
    elif cfg.free_form_match == "math":
        extracted = answer
        accuracy, matched_by = float(math_equal(answer, task.solution)), "math"
    else:
        extracted = answer
        accuracy, matched_by = float(exact_match(answer, task.solution)), "exact"
        if accuracy == 0.0 and wants_judge:
            verdict = judge.judge(_judge_question_text(task, cfg.judge_question), task.solution, answer)  # type: ignore[union-attr]

    if verdict is not None:
        if not verdict.valid:
            reason = f"judge failed: {verdict.error}"
            return RewardParts(
                None, fmt, tool_reward(False, num_tool_calls, cfg), None, False, reason, extracted, "judge"
            )
        accuracy, matched_by = float(verdict.score or 0.0), _judged_by("judge", [verdict])

    if cfg.format_rule == "deepeyes" and len(answer or "") >= DEEPEYES_MAX_ANSWER_CHARS:
        accuracy = 0.0
    if cfg.failed_last_call_zeroes and last_call_failed and accuracy > 0.5:
        accuracy, matched_by = 0.0, f"{matched_by}, last call failed"
    tool = tool_reward(accuracy == 1.0, num_tool_calls, cfg)
    total = cfg.accuracy_weight * accuracy + cfg.format_weight * fmt + tool
    return RewardParts(accuracy, fmt, tool, total, True, None, extracted, matched_by)


def build_judge(cfg: RewardConfig) -> LLMJudge | None:
    """The LLM judge `cfg` asks for, or None when every answer is scored by rules."""
    if cfg.judge is None or not cfg.wants_judge:
        return None
    return LLMJudge(cfg.judge)


def _deepeyes(task: TaskRecord, response: str, cfg: RewardConfig, judge: LLMJudge | None) -> RewardParts:
    """DeepEyes' `compute_score` (`verl/utils/reward_score/vl_agent.py`) on the decoded response
    (`loupe.rewards.deepeyes`): 0.8 x the judge's verdict on the last answer's text, 0.2 x (-1 after a format
    error, else 0), and the tool bonus for a right answer after a crop, with the weights of `cfg`."""
    if judge is None:
        raise ValueError("the reward config asks for an LLM judge but none was given to score()")
    answer_text = deepeyes_answer_text(response)
    broken = deepeyes_format_broken(response)
    verdict = judge.judge(_judge_question_text(task, cfg.judge_question), task.solution, answer_text)
    fmt = -1.0 if broken else 0.0
    matched_by = _judged_by("deepeyes", [verdict])
    if not verdict.valid:
        return RewardParts(None, fmt, 0.0, None, False, f"judge failed: {verdict.error}", answer_text, "judge")
    accuracy = 0.0 if len(answer_text) >= DEEPEYES_MAX_ANSWER_CHARS else float(verdict.score or 0.0)
    tool = cfg.tool_bonus if deepeyes_crops(response) > 0 and accuracy > 0.5 else 0.0
    total = cfg.accuracy_weight * accuracy + cfg.format_weight * fmt + tool
    return RewardParts(accuracy, fmt, tool, total, True, None, answer_text, matched_by)


_SOURCE_JUDGES: dict[str, LLMJudge] = {}


class _SourceJudge:
    """The judge of a `by_data_source` entry that names its own, made when first asked (a row that never reaches
    the judge needs no key or server) and kept for the process, one per distinct judge config, so its cache and
    connection serve every trajectory."""

    def __init__(self, cfg: RewardConfig):
        self.config = cfg.judge

    def judge(self, question: str, reference: str, prediction: str) -> JudgeResult:
        key = self.config.model_dump_json()  # type: ignore[union-attr]
        if key not in _SOURCE_JUDGES:
            _SOURCE_JUDGES[key] = LLMJudge(self.config)  # type: ignore[arg-type]
        return _SOURCE_JUDGES[key].judge(question, reference, prediction)


def _deepeyes_other(task: TaskRecord, response: str, cfg: RewardConfig, judge: LLMJudge | None) -> RewardParts:
    """DeepEyes' `compute_score_math` or `compute_common_reasoning` (`loupe.rewards.deepeyes`) on the decoded
    response, with the weights of `cfg` (DeepEyes: 1.2 x accuracy + 0.4 x format for math; 0.8, 0.2 and the
    1.2 tool bonus for a right answer after a crop for geoguessr)."""
    if judge is None:
        raise ValueError("the reward config asks for an LLM judge but none was given to score()")
    question = _judge_question_text(task, cfg.judge_question)
    rule = deepeyes_math if cfg.free_form_match == "deepeyes_math" else deepeyes_common
    verdicts: list[JudgeResult | None] = []

    def ask(text: str) -> JudgeResult:
        verdicts.append(judge.judge(question, task.solution, text))  # type: ignore[union-attr]
        return verdicts[-1]  # type: ignore[return-value]

    accuracy, fmt, answer = rule(response, task.solution, ask)
    matched_by = _judged_by(cfg.free_form_match, verdicts)
    if accuracy is None:
        return RewardParts(None, fmt, 0.0, None, False, "judge failed", answer, "judge")
    tool = cfg.tool_bonus if cfg.free_form_match == "deepeyes_common" and deepeyes_crops(response) > 0 and accuracy > 0.5 else 0.0
    total = cfg.accuracy_weight * accuracy + cfg.format_weight * fmt + tool
    return RewardParts(accuracy, fmt, tool, total, True, None, answer, matched_by)


def _mini_o3(task: TaskRecord, turns: list[str], end_reason: str, has_think: bool, num_format_errors: int,
             num_tool_calls: int, cfg: RewardConfig, judge: LLMJudge | None, final_text: str | None) -> RewardParts:
    """Mini-o3's accuracy (`loupe.rewards.mini_o3`), with the format and tool parts of `cfg` (Mini-o3's own
    weights are 1, 0, 0)."""
    if judge is None:
        raise ValueError("the reward config asks for an LLM judge but none was given to score()")
    answer = mini_o3_answer(turns)
    fmt = format_reward(end_reason, has_think, num_format_errors, cfg.format_rule, final_text, answer)
    accuracy, matched_by = 0.0, "mini_o3"
    if answer is not None:
        verdict = judge.judge(_judge_question_text(task, cfg.judge_question), task.solution, answer)
        matched_by = _judged_by("mini_o3", [verdict])
        if not verdict.valid:
            return RewardParts(None, fmt, 0.0, None, False, f"judge failed: {verdict.error}", answer, "judge")
        accuracy = float(verdict.score or 0.0)
    tool = tool_reward(accuracy == 1.0, num_tool_calls, cfg)
    total = cfg.accuracy_weight * accuracy + cfg.format_weight * fmt + tool
    return RewardParts(accuracy, fmt, tool, total, True, None, answer, matched_by)


def score_trajectory(trajectory: Trajectory, cfg: RewardConfig, judge: LLMJudge | None = None) -> RewardParts:
    """Score a finished trajectory and record every part on it (`trajectory.rewards`)."""
    assistant = [turn.text for turn in trajectory.turns if turn.role == "assistant"]
    has_think = bool(assistant) and all("<think>" in text and "</think>" in text for text in assistant)
    given_back = [turn for turn in trajectory.turns[1:] if turn.role == "user"]
    parts = score(
        TaskRecord.model_validate(trajectory.task),
        trajectory.answer,
        trajectory.end_reason or "format_error",
        trajectory.num_tool_calls,
        trajectory.num_format_errors,
        has_think,
        cfg,
        judge,
        final_text=assistant[-1] if assistant else None,
        response=decoded_response([(turn.role, turn.text, not (turn.error or "").startswith("length"))
                                   for turn in trajectory.turns[1:]]) if cfg.reads_response else None,
        assistant_turns=assistant,
        last_call_failed=bool(given_back) and bool(given_back[-1].error),
    )
    trajectory.rewards = parts.to_dict()
    return parts

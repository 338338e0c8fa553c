"""The parser core every grammar shares: the `Protocol` interface the rollout loop calls, typed format errors, and
the checks a tool call goes through (JSON objects, keys, boxes, one call a turn).

`Protocol.parse` never raises on model output: anything malformed becomes an `Action` holding a typed
`FormatError`, which the loop sends back as an error observation saying what was wrong. The parser's policy for
each corner case (text after a call, coordinates a hair outside [0, 1], sub-pixel boxes, bounded error
messages) is written down in docs/architecture.md, "Parser policy".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from loupe.data.tasks import IMAGE_PLACEHOLDER, OPTION_LETTERS, TaskRecord

ORIGINAL_IMAGE = "original_image"

MAX_ERROR_DETAIL = 200
"""The most characters of detail an error observation carries, whatever the model wrote (docs: Parser policy)."""

RELATIVE_TOLERANCE = 1e-3
"""How far outside [0, 1] a relative coordinate may fall and still be clamped into it: one unit of the third
decimal. Models write boxes with two or three decimals, and a corner computed as x0 + width and rounded can
overshoot the edge by that much (1.001, -0.001); a coordinate farther out is a mistake, not rounding."""

ABSOLUTE_TOLERANCE = 0.5
"""How far below 0 an absolute (pixel) coordinate may fall and still be clamped to 0: under half a pixel."""


class FormatErrorKind(str, Enum):
    """Why a model turn could not be taken as a tool call or an answer."""

    NO_ACTION = "no_action"
    UNCLOSED_TAG = "unclosed_tag"
    MULTIPLE_CALLS = "multiple_calls"
    CALL_AND_ANSWER = "call_and_answer"
    TRAILING_TEXT = "trailing_text"
    BAD_JSON = "bad_json"
    MISSING_KEY = "missing_key"
    WRONG_TYPE = "wrong_type"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"
    EMPTY_BOX = "empty_box"
    UNKNOWN_SOURCE = "unknown_source"
    UNKNOWN_TOOL = "unknown_tool"
    EMPTY_ANSWER = "empty_answer"
    TOOLS_UNAVAILABLE = "tools_unavailable"


@dataclass(frozen=True)
class FormatError:
    """A typed reason plus a sentence the model can read in its error observation."""

    kind: FormatErrorKind
    detail: str


@dataclass(frozen=True)
class ToolCall:
    """A well-formed request to run a registered tool (see `loupe.tools.TOOLS`)."""

    tool: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Action:
    """What one assistant turn did: called a tool, answered, or broke the format."""

    think: str | None = None
    call: ToolCall | None = None
    answer: str | None = None
    error: FormatError | None = None

    @property
    def kind(self) -> str:
        if self.error is not None:
            return "error"
        return "call" if self.call is not None else "answer"


def clip_text(text: str, limit: int = MAX_ERROR_DETAIL) -> str:
    """`text` cut to at most `limit` characters, ending in "..." when cut."""
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _shown(value: Any, limit: int = 40) -> str:
    """A value from the model's JSON as a short string for an error message (JSON spelling, cut to `limit`)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # e.g. an int past Python's 4,300-digit str() limit
        text = f"<a {type(value).__name__}>"
    return clip_text(text, limit)


def _error_detail(detail: str | FormatError) -> str:
    """The sentence an error turn carries, bounded to `MAX_ERROR_DETAIL` characters."""
    return clip_text(detail.detail if isinstance(detail, FormatError) else str(detail))


class _Invalid(Exception):
    """Internal: carries a FormatError out of nested checks; never leaves this module."""

    def __init__(self, kind: FormatErrorKind, detail: str):
        super().__init__(detail)
        self.error = FormatError(kind, clip_text(detail))


_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OBSERVATION_SOURCE = re.compile(r"observation_(\d{1,9})", re.ASCII)  # bounded: int() refuses 4,300+ digits


def extract_answer(text: str) -> str | None:
    """The text inside the last `<answer>…</answer>`, stripped; None when there is none."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


def extract_think(text: str) -> str | None:
    found = _THINK.findall(text or "")
    return "\n".join(t.strip() for t in found) if found else None


def _reject_constant(name: str) -> float:
    raise _Invalid(FormatErrorKind.NOT_FINITE, f"the tool call's JSON holds {name}, which is not a number")


def _load_json_object(payload: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(payload, parse_constant=_reject_constant)
    except _Invalid:
        raise
    except (ValueError, RecursionError) as err:
        raise _Invalid(FormatErrorKind.BAD_JSON, f"{what} is not valid JSON ({clip_text(str(err), 80)})") from None
    if not isinstance(value, dict):
        raise _Invalid(FormatErrorKind.WRONG_TYPE, f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _check_keys(obj: dict[str, Any], required: tuple[str, ...], what: str, accepted: tuple[str, ...] = ()) -> None:
    """Every `required` key present, and nothing else but the `accepted` ones (read by no tool)."""
    for key in required:
        if key not in obj:
            raise _Invalid(FormatErrorKind.MISSING_KEY, f"{what} lacks the key '{key}'")
    extra = sorted(set(obj) - set(required) - set(accepted))
    if extra:
        shown = ", ".join(_shown(key, 30) for key in extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise _Invalid(FormatErrorKind.WRONG_TYPE, f"{what} has unexpected keys [{shown}]")


def _check_box(value: Any, upper: float | None, clamp: bool = False) -> tuple[float, float, float, float]:
    """A 4-number box with x0 < x1, y0 < y1, each in [0, upper] (no upper bound when None).

    A coordinate within the tolerance outside the range (`RELATIVE_TOLERANCE` for relative boxes,
    `ABSOLUTE_TOLERANCE` below 0 for pixel boxes) is clamped into it; one farther out is refused, or clamped too
    when `clamp` (`protocol.out_of_range_boxes: clamp`, DeepEyes' tool). The numbers are
    otherwise kept exactly as written: a box too small to cover a pixel passes here and the crop tool, which
    knows the source's size, refuses it.
    """
    if not isinstance(value, list) or len(value) != 4:
        raise _Invalid(FormatErrorKind.WRONG_TYPE, "'bbox_2d' must be a list of four numbers [x0, y0, x1, y1]")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise _Invalid(FormatErrorKind.WRONG_TYPE, "'bbox_2d' must hold numbers only")
    try:
        box = tuple(float(v) for v in value)
    except OverflowError:  # an integer literal too large for a float is finite, just far out of range
        raise _Invalid(FormatErrorKind.OUT_OF_RANGE, "'bbox_2d' holds a number far out of range") from None
    if not all(math.isfinite(v) for v in box):
        raise _Invalid(FormatErrorKind.NOT_FINITE, "'bbox_2d' holds a number that is not finite")
    limit = "in [0, 1]" if upper == 1.0 else "non-negative pixels"
    slack = RELATIVE_TOLERANCE if upper == 1.0 else ABSOLUTE_TOLERANCE
    if not clamp and any(v < -slack or (upper is not None and v > upper + slack) for v in box):
        raise _Invalid(FormatErrorKind.OUT_OF_RANGE, f"'bbox_2d' coordinates must be {limit}, got {_shown(value, 80)}")
    top = upper if upper is not None else math.inf
    x0, y0, x1, y1 = (0.0 if v <= 0 else min(v, top) for v in box)  # -0.0 becomes 0.0 too
    if x1 <= x0 or y1 <= y0:
        raise _Invalid(FormatErrorKind.EMPTY_BOX, f"'bbox_2d' needs x0 < x1 and y0 < y1, got {_shown(value, 80)}")
    return x0, y0, x1, y1


def _split_single(text: str, open_tag: str, close_tag: str) -> tuple[str, str, str] | None:
    """(before, inside, after) of the one `open…close` span; None when absent; raises on two or unclosed."""
    count = text.count(open_tag)
    if count == 0:
        return None
    if count > 1:
        raise _Invalid(FormatErrorKind.MULTIPLE_CALLS, f"one turn may hold only one {open_tag}…{close_tag}")
    start = text.index(open_tag)
    end = text.find(close_tag, start)
    if end < 0:
        raise _Invalid(FormatErrorKind.UNCLOSED_TAG, f"{open_tag} is never closed by {close_tag}")
    return text[:start], text[start + len(open_tag) : end], text[end + len(close_tag) :]


class Protocol:
    """The interface the rollout loop, the teachers and the converters use. Subclass and register to add one."""

    name: ClassVar[str]
    multi_turn: ClassVar[bool] = True
    stop: ClassVar[tuple[str, ...]] = ()
    """Strings that end generation (kept in the output): a tool call's closing tag."""
    call_open: ClassVar[str] = ""
    call_close: ClassVar[str] = ""
    absolute_boxes: ClassVar[bool] = False
    """Whether a call's box is in pixels of the original image (DeepEyes) rather than relative to its source."""

    template: Any = None
    """A compiled Jinja prompt template for the question turn (`protocol.prompt_template`), or None."""
    system_override: str | None = None
    """A recipe's system prompt in place of the protocol's (`protocol.system_prompt`), or None."""
    observation_override: str | None = None
    """A recipe's crop-returning turn (`protocol.observation_template`: `{image}`, `{index}`), or None."""
    error_override: str | None = None
    """A recipe's error turn (`protocol.error_template`: `{error}`), or None."""
    extra_arguments: tuple[str, ...] = ()
    """Tool-call argument names accepted and ignored (`protocol.tool_extra_arguments`)."""
    clamp_boxes: bool = False
    """Whether a box reaching outside its image is clamped onto it rather than refused (`protocol.out_of_range_boxes`)."""
    turn_reading: str = "first_call"
    """`first_call`, `deepeyes` or `mini_o3` (`protocol.turn_reading`): which call of a turn is read and how, and
    whether an answer beside a call wins."""
    record_prompts: bool = True
    """Whether a record's own `system` and `prompt` are shown as they are (`protocol.record_prompts`)."""

    def can_call(self, tool: str) -> bool:
        """Whether this grammar has a call for the registered tool `tool` (teachers check before writing one)."""
        return tool == "crop"

    def observation_turn(self, index: int, size: tuple[int, int] | None = None) -> str:
        """The user turn returning crop `index`, shown at `size` (width, height): the recipe's template when set
        (`{image}`, `{index}`, `{width}`, `{height}`), else the protocol's own."""
        if self.observation_override is None:
            return self.observation_text(index, size)
        width, height = size if size is not None else ("?", "?")
        return self.observation_override.format(image=IMAGE_PLACEHOLDER, index=index, width=width, height=height)

    def tool_result_turn(self, numbers: list[int], sizes: list[tuple[int, int]], text: str | None) -> str:
        """The user turn returning a visual operation's outcome (`loupe.visual_ops`): each new image as an
        observation turn would show it, then the operation's words."""
        parts = [self.observation_turn(number, size) for number, size in zip(numbers, sizes)]
        if text:
            parts.append(self.tool_text(text))
        return "\n".join(parts)

    def tool_text(self, text: str) -> str:
        """How an operation's words read in the dialogue; the protocol's grammar may wrap them."""
        return text

    def error_turn(self, detail: str | FormatError) -> str:
        """The user turn after a malformed turn: the recipe's template when set, else the protocol's own."""
        if self.error_override is None:
            return self.error_text(detail)
        return self.error_override.format(error=_error_detail(detail))

    def system_prompt(self) -> str:
        """The system prompt every dialogue starts with: the override when set, else the protocol's own."""
        return self.system_override if self.system_override is not None else self.default_system_prompt()

    def default_system_prompt(self) -> str:
        raise NotImplementedError

    def task_system_prompt(self, task: TaskRecord) -> str:
        """The system prompt of a dialogue about `task`: the record's own when it has one and `record_prompts`,
        else `system_prompt()`."""
        if self.record_prompts and task.system is not None:
            return task.system
        return self.system_prompt()

    def question_text(self, task: TaskRecord) -> str:
        """The first user turn: the record's own `prompt` when it has one and `record_prompts`, else the
        protocol's (`protocol_question_text`) or the prompt template rendered over it; a template that drops or
        adds image placeholders raises ValueError naming the task."""
        if self.record_prompts and task.prompt is not None:
            return task.prompt
        content = self.protocol_question_text(task)
        if self.template is None:
            return content
        text = self.template.render(content=content, problem=task.problem, options=task.options or [],
                                    task=task.model_dump(exclude_none=True))
        if text.count(IMAGE_PLACEHOLDER) != content.count(IMAGE_PLACEHOLDER):
            raise ValueError(f"task {clip_text(task.doc_id, 80)!r}: the prompt template wrote "
                             f"{text.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} placeholders for "
                             f"{content.count(IMAGE_PLACEHOLDER)} images; render {{{{ content }}}} once")
        return text

    def protocol_question_text(self, task: TaskRecord) -> str:
        """The first user turn: one image placeholder per task image, the question, the options.

        A `problem` that already holds one placeholder per image (Mini-o3's records start with "<image>\n") is
        used as it is, with no second set; a problem holding some other number of placeholders cannot be
        matched to its images and raises ValueError naming the task (the task reader should refuse it first).
        """
        problem = task.problem.strip()
        placeholders = problem.count(IMAGE_PLACEHOLDER)
        if placeholders == 0:
            lines = [IMAGE_PLACEHOLDER * len(task.images), problem] if task.images else [problem]
        elif placeholders == len(task.images):
            lines = [problem]
        else:
            raise ValueError(
                f"task {clip_text(task.doc_id, 80)!r}: field 'problem' holds {placeholders} {IMAGE_PLACEHOLDER} "
                f"placeholders but the task has {len(task.images)} images; give none (one per image is added) "
                "or exactly one per image"
            )
        if task.options:
            lines.append("Options:")
            lines += [f"({letter}) {text}" for letter, text in zip(OPTION_LETTERS, task.options)]
            lines.append("Answer with the option's letter.")
        return "\n".join(lines)

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        """The user turn that returns crop number `index` (1-based), shown at `size` (width, height) when known, to
        the model, holding one image placeholder."""
        raise NotImplementedError

    def error_text(self, detail: str | FormatError) -> str:
        """The user turn that tells the model why its last turn was not usable (no image).

        `detail` is a sentence (a `FormatError`'s or a tool error's) or the `FormatError` itself; it is cut to
        `MAX_ERROR_DETAIL` characters, whatever produced it.
        """
        return (
            f"Your last turn could not be carried out: {_error_detail(detail)}. "
            "Continue your reasoning inside <think> and </think>, then either call the tool correctly or answer."
        )

    def parse(self, text: str, num_observations: int = 0) -> Action:
        """Read one assistant turn; `num_observations` is how many crops exist so far. Never raises."""
        try:
            return self._parse(text if isinstance(text, str) else "", num_observations)
        except _Invalid as invalid:
            return Action(think=extract_think(text) if isinstance(text, str) else None, error=invalid.error)
        except Exception as err:  # a bug in a variant must still not end a rollout
            return Action(error=FormatError(FormatErrorKind.BAD_JSON, f"unreadable turn ({type(err).__name__})"))

    def stop_strings(self) -> tuple[str, ...]:
        """What ends generation of a turn: the call's closing tag, or nothing under DeepEyes' reading."""
        return () if self.turn_reading == "deepeyes" else self.stop

    def holds_call_span(self, text: str) -> bool:
        """Whether the turn holds an opening call tag with a closing one after it (Mini-o3's `findall` of
        `<grounding>(.*?)</grounding>` with DOTALL, vllm_async_engine.py:657,697-698), whatever lies between."""
        if not self.call_open:
            return False
        start = text.find(self.call_open)
        return start >= 0 and text.find(self.call_close, start + len(self.call_open)) >= 0

    def turn_calls(self, text: str) -> bool:
        """Whether a turn counts as calling a tool, for `turn_without_call: ends`: under Loupe's reading any
        opening call tag (an unclosed one gets an error turn); under DeepEyes' a last complete call that is not
        empty (visual_toolbox_v2.py:43-44,63-65); under Mini-o3's a complete call span
        (vllm_async_engine.py:657,697-698)."""
        if not self.call_open:
            return False
        if self.turn_reading == "deepeyes":
            calls = self._complete_calls(text)
            return bool(calls and calls[-1])
        if self.turn_reading == "mini_o3":
            return self.holds_call_span(text)
        return self.call_open in text

    def cut_at_call(self, text: str) -> str:
        """The turn as the stop string ends it: up to and including the first call's closing tag.

        Engines that honour `stop` (transformers, vLLM) never produce more; an endpoint or teacher that ignores
        it may. The parser reads only this part, so a turn means the same whichever engine wrote it; the loop
        may record this part as the turn. Text holding no complete call comes back unchanged.
        """
        if not self.call_open:
            return text
        start = text.find(self.call_open)
        end = text.find(self.call_close, start) if start >= 0 else -1
        return text if end < 0 else text[: end + len(self.call_close)]

    def _parse(self, text: str, num_observations: int) -> Action:
        if self.turn_reading == "deepeyes" and self.call_open:
            return self._parse_deepeyes(text, num_observations)
        text = self.cut_at_call(text)  # what follows the first complete call is ignored (docs: Parser policy)
        call_parts = _split_single(text, self.call_open, self.call_close) if self.call_open else None
        if call_parts is None:
            return self._parse_answer_or_nothing(text)
        before, payload, _ = call_parts
        if "<answer>" in before:
            raise _Invalid(FormatErrorKind.CALL_AND_ANSWER, "a turn must either call the tool or answer, not both")
        return Action(think=extract_think(before), call=self._read_call(payload, num_observations))

    def _parse_deepeyes(self, text: str, num_observations: int) -> Action:
        """DeepEyes' reading of a whole turn (`VisualToolBoxV2.execute`, visual_toolbox_v2.py:26-28,43-44,60-65):
        the last `<answer>…</answer>`, when it holds anything, ends the episode and no call runs; otherwise the
        last complete call is read; a turn with neither ends the episode (`turn_without_call: ends`)."""
        answers = _ANSWER.findall(text)
        if answers and answers[-1]:  # upstream's `if answer:`: white space alone counts as an answer
            return Action(think=extract_think(text), answer=answers[-1].strip())
        calls = self._complete_calls(text)
        if not calls or not calls[-1]:  # upstream's `if not action:`: an empty last call ends it too (:63-65)
            raise _Invalid(FormatErrorKind.NO_ACTION, "the turn holds neither a tool call nor <answer>…</answer>")
        return Action(think=extract_think(text), call=self._read_call(calls[-1], num_observations))

    def _complete_calls(self, text: str) -> list[str]:
        """What each complete call span of the turn holds, in order (DeepEyes' reading: visual_toolbox_v2.py:43-44)."""
        return re.findall(re.escape(self.call_open) + "(.*?)" + re.escape(self.call_close), text, re.DOTALL)

    def _read_call(self, payload: str, num_observations: int) -> ToolCall:
        """The tool call inside the variant's call tags; raises _Invalid on anything malformed."""
        raise NotImplementedError

    def _parse_answer_or_nothing(self, text: str) -> Action:
        parts = _split_single(text, "<answer>", "</answer>")
        if parts is None:
            raise _Invalid(FormatErrorKind.NO_ACTION, "the turn holds neither a tool call nor <answer>…</answer>")
        _, inside, after = parts
        if after.strip():
            raise _Invalid(FormatErrorKind.TRAILING_TEXT, "nothing may follow </answer>")
        if not inside.strip():
            raise _Invalid(FormatErrorKind.EMPTY_ANSWER, "the answer is empty")
        return Action(think=extract_think(text), answer=inside.strip())

    def render_call(self, think: str, call: ToolCall) -> str:
        """An assistant turn that makes `call` (teachers write trajectories with it)."""
        raise NotImplementedError

    def render_answer(self, think: str, answer: str) -> str:
        return f"<think>{think}</think>\n<answer>{answer}</answer>"


def _short_relative_box(box: list[float]) -> list[float]:
    """The box with three decimals, or as many more as it takes to keep x0 < x1 and y0 < y1 (tiny boxes)."""
    for digits in range(3, 18):
        short = [round(v, digits) for v in box]
        if short[0] < short[2] and short[1] < short[3]:
            return short
    return list(box)

"""The dialogue protocol: system prompt, tool-call grammar, observation turns, answer extraction.

A protocol variant says how a model talks: what the system prompt asks, how a tool call is written and
parsed, how the tool's answer comes back, and when generation stops. The rollout loop only ever calls the
`Protocol` interface, so a new variant (another tool grammar, another prompt) is a new subclass registered in
`PROTOCOLS`, with no change to the loop.

Variants:
- `mini_o3` (default): `<think>…</think>` then `<grounding>{"bbox_2d": [x0, y0, x1, y1], "source": …}</grounding>`
  with coordinates relative to the named source, or `<answer>…</answer>`. Its system prompt, observation and
  error turns are Mini-o3's own strings (the `MINI_O3_*` compatibility constants below), so Mini-o3's released
  checkpoints are evaluated and fine-tuned on the text they were trained with.
- `loupe`: the same grammar with Loupe's own wording (names the `observation_N` sources, states x0 < x1).
- `deepeyes`: `<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [...]}}</tool_call>` with
  absolute pixel coordinates on the original image.
- `single_turn`: R1-V style `<think>…</think><answer>…</answer>`, no tools.
- `boxed`: EasyR1's single turn, the answer in `\boxed{}`.
- `pixel_reasoner`: Pixel-Reasoner's Qwen `<tool_call>` JSON calling `crop_image_normalized` on a 1-based
  `target_image`, the answer in `\boxed{}` in a turn that calls nothing, and its own prompt strings.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from loupe.data.tasks import IMAGE_PLACEHOLDER, OPTION_LETTERS, TaskRecord  # noqa: F401 (IMAGE_PLACEHOLDER re-exported)

if TYPE_CHECKING:
    from loupe.trajectory import Trajectory


ORIGINAL_IMAGE = "original_image"

# --- Mini-o3 compatibility constants ------------------------------------------------------------------------
# Byte for byte from github.com/Mini-o3/Mini-o3 (commit 8654dbf), verl/trainer/constants.py, because Mini-o3's
# checkpoints were trained on exactly these strings. Their typos ("the the", "Countinue") are part of them.
# tests/test_protocol.py holds each constant equal to a copy written from that file.

MINI_O3_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the user's question based on the image provided. Output your thinking "
    "process within the <think> and </think> tags. Whenever you find anything unclear, you can zoom in a specific "
    "region in the given image to see more clearly by outputing <grounding>{\"bbox_2d\": [x0, y0, x1, y1], "
    "\"source\": \"original_image\"}</grounding>, where (x0, y0) and (x1, y1) are the top-left and bottom-right "
    "coordinates of the region that you want to zoom in, respectively (suppose the width and height of the image "
    "are 1.0), and 'source' refers to the image that you zoom in and could be either 'original_image' or "
    "'observation_i'. Once the final answer is confirmed, put it within <answer> and </answer>."
)
"""`TOOL_CROP_SYSTEM_PROMPT`, the system turn of every Mini-o3 dialogue (`data.system_prompt="tool_crop"` in its
README's train and eval commands, looked up in `SYSTEM_PROMPT_MAP`; `make_conversation_multimodal` in
verl/utils/dataset/multimodal_dataset.py puts it first, then the record's `problem` as the user turn)."""

MINI_O3_OBSERVATION_TEMPLATE = (
    "After the above Action {action_turn}, here is the the zoom-in image (Observation {observation_turn}):\n"
    "<|vision_start|><|image_pad|><|vision_end|>.\nContinue your reasoning process inside <think> and </think>. "
    "If needed, you can continue to zoom in on the original image or any of the observations, by outputting "
    "<grounding> and </grounding> as before. If the final answer is confirmed, put your final answer inside "
    "<answer> and </answer>."
)
"""`TOOL_CALL_CROP_MULTI_TRUN_PROMPT`, the user turn returning a crop. `AsyncvLLMEngine.process_tool_call` in
verl/workers/rollout/vllm_rollout/vllm_async_engine.py (the `rollout.mode="async"` engine of Mini-o3's demo and
eval commands) fills it with `action_turn=current_iteration, observation_turn=current_iteration+1`, where
`current_iteration` counts the dialogue's assistant turns from 0: the first crop is "Action 0 … Observation 1"."""

MINI_O3_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
"""One image in Qwen2.5-VL's chat text: what the chat template (and LLaMA-Factory's qwen2_vl template) writes for
an `<image>` placeholder, so Loupe's turns hold `IMAGE_PLACEHOLDER` where Mini-o3's constant holds this."""

MINI_O3_TOOL_ERROR_TEMPLATE = "ERROR occurs during grounding. Error Information: {error_info}.\n"
"""What `AsyncvLLMEngine.process_tool_call` (vllm_async_engine.py) sends when a grounding call fails, followed by
`MINI_O3_ERROR_PROMPT` in the same user turn."""

MINI_O3_ERROR_PROMPT = (
    "Please analyze the error information obtained from the function tool and adjust your response. "
    "Countinue your reasoning process inside <think> and </think>."
)
"""`ERROR_INFO_MULTI_TURN_PROMPT` (verl/trainer/constants.py), the rest of an error turn."""

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


_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
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

    def question_text(self, task: TaskRecord) -> str:
        """The first user turn: the protocol's (`protocol_question_text`), or the prompt template rendered over
        it; a template that drops or adds image placeholders raises ValueError naming the task."""
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
        text = self.cut_at_call(text)  # what follows the first complete call is ignored (docs: Parser policy)
        call_parts = _split_single(text, self.call_open, self.call_close) if self.call_open else None
        if call_parts is None:
            return self._parse_answer_or_nothing(text)
        before, payload, _ = call_parts
        if "<answer>" in before:
            raise _Invalid(FormatErrorKind.CALL_AND_ANSWER, "a turn must either call the tool or answer, not both")
        return Action(think=extract_think(before), call=self._read_call(payload, num_observations))

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


class MiniO3Protocol(Protocol):
    """Mini-o3's grounding tool and Mini-o3's own wording: relative boxes on the original or an earlier observation.

    The system prompt, observation turn and error turn are the `MINI_O3_*` constants. Observations are numbered
    as Mini-o3 numbers them when every call succeeds: crop N is "Action N-1 … Observation N", and the model names
    it "observation_N". (After a failed call Mini-o3 numbers by assistant turn, so its text then names an
    observation that its own tool does not know; Loupe keeps Observation N = observation_N.)
    """

    name = "mini_o3"
    stop = ("</grounding>",)
    call_open, call_close = "<grounding>", "</grounding>"

    def default_system_prompt(self) -> str:
        return MINI_O3_SYSTEM_PROMPT

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        text = MINI_O3_OBSERVATION_TEMPLATE.format(action_turn=index - 1, observation_turn=index)
        return text.replace(MINI_O3_IMAGE_MARKUP, IMAGE_PLACEHOLDER)

    def error_text(self, detail: str | FormatError) -> str:
        return MINI_O3_TOOL_ERROR_TEMPLATE.format(error_info=_error_detail(detail)) + MINI_O3_ERROR_PROMPT

    def _read_call(self, payload: str, num_observations: int) -> ToolCall:
        obj = _load_json_object(payload, "the grounding call")
        _check_keys(obj, ("bbox_2d", "source"), "the grounding call", self.extra_arguments)
        box = _check_box(obj["bbox_2d"], upper=1.0, clamp=self.clamp_boxes)
        source = obj["source"]
        if not isinstance(source, str):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'source' must be a string")
        match = _OBSERVATION_SOURCE.fullmatch(source)
        if source != ORIGINAL_IMAGE and not (match and int(match.group(1)) <= num_observations):
            raise _Invalid(
                FormatErrorKind.UNKNOWN_SOURCE,
                f"unknown source {clip_text(source, 40)!r}; known: {_known_sources(num_observations)}",
            )
        if match:  # one name per image: observation_01 is observation_1, observation_0 the original
            number = int(match.group(1))
            source = f"observation_{number}" if number else ORIGINAL_IMAGE
        return ToolCall("crop", {"bbox_2d": list(box), "source": source, "frame": "relative"})

    def render_call(self, think: str, call: ToolCall) -> str:
        args = {"bbox_2d": _short_relative_box(call.arguments["bbox_2d"]), "source": call.arguments["source"]}
        return f"<think>{think}</think>\n{self.call_open}{json.dumps(args)}{self.call_close}"


def _known_sources(num_observations: int) -> str:
    """The source names that exist after `num_observations` crops, written in a bounded length."""
    if num_observations <= 0:
        return ORIGINAL_IMAGE
    if num_observations <= 3:
        return ", ".join([ORIGINAL_IMAGE] + [f"observation_{i}" for i in range(1, num_observations + 1)])
    return f"{ORIGINAL_IMAGE}, observation_1 ... observation_{num_observations}"


class LoupeProtocol(MiniO3Protocol):
    """Mini-o3's grammar with Loupe's own wording: names the `observation_N` sources and the box rules."""

    name = "loupe"

    def default_system_prompt(self) -> str:
        return (
            "You answer questions about images. The image you see may be downscaled, so small details can be "
            "unreadable. First reason inside <think> and </think>. Then do exactly one of two things:\n"
            "1. Zoom in: write <grounding>{\"bbox_2d\": [x0, y0, x1, y1], \"source\": \"original_image\"}"
            "</grounding>. The box is relative to the source image, each coordinate between 0 and 1, with "
            "x0 < x1 and y0 < y1. The source is \"original_image\" or \"observation_N\" for an earlier zoom-in "
            "image N. The crop comes back to you as a new observation at a higher resolution.\n"
            "2. Answer: write <answer>your final answer</answer>.\n"
            "Zoom as many times as you need; look elsewhere if the target is not where you expected."
        )

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        return (
            f"After the above Action {index - 1}, here is the zoom-in image (Observation {index}): "
            f"{IMAGE_PLACEHOLDER}.\nContinue your reasoning inside <think> and </think>. If needed, zoom in "
            "again on the original image or an observation; once you are confident, give the final answer "
            "inside <answer> and </answer>."
        )

    def error_text(self, detail: str | FormatError) -> str:
        return Protocol.error_text(self, detail)  # Loupe's wording, not the Mini-o3 turn the parent sends


class DeepEyesProtocol(Protocol):
    """DeepEyes' zoom tool: a JSON function call with absolute pixel boxes on the original image."""

    name = "deepeyes"
    stop = ("</tool_call>",)
    call_open, call_close = "<tool_call>", "</tool_call>"
    tool_name = "image_zoom_in_tool"
    absolute_boxes = True

    def default_system_prompt(self) -> str:
        return (
            "You answer questions about images. Think inside <think> and </think>. To look closer, call "
            f'<tool_call>{{"name": "{self.tool_name}", "arguments": {{"bbox_2d": [x0, y0, x1, y1]}}}}</tool_call>'
            " with the box in pixels of the original image. When sure, answer inside <answer> and </answer>."
        )

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        return f"<tool_response>{IMAGE_PLACEHOLDER}</tool_response>\nContinue, or give your final answer."

    def _read_call(self, payload: str, num_observations: int) -> ToolCall:
        obj = _load_json_object(payload, "the tool call")
        _check_keys(obj, ("name", "arguments"), "the tool call")
        name = obj["name"]
        if name != self.tool_name:
            shown = repr(clip_text(name, 40)) if isinstance(name, str) else _shown(name)
            raise _Invalid(FormatErrorKind.UNKNOWN_TOOL, f"unknown tool {shown}; use {self.tool_name!r}")
        if not isinstance(obj["arguments"], dict):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'arguments' must be a JSON object")
        _check_keys(obj["arguments"], ("bbox_2d",), "the tool call's arguments", self.extra_arguments)
        box = _check_box(obj["arguments"]["bbox_2d"], upper=None, clamp=self.clamp_boxes)
        return ToolCall("crop", {"bbox_2d": list(box), "source": ORIGINAL_IMAGE, "frame": "absolute"})

    def render_call(self, think: str, call: ToolCall) -> str:
        # Round outwards, as the crop tool does, so a sub-pixel box stays non-empty and crops the same pixels.
        x0, y0, x1, y1 = call.arguments["bbox_2d"]
        box = [math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1)]
        args = {"name": self.tool_name, "arguments": {"bbox_2d": box}}
        return f"<think>{think}</think>\n{self.call_open}{json.dumps(args)}{self.call_close}"


class SingleTurnProtocol(Protocol):
    """R1-V style: think, then answer, in one turn; any tool call is a format error."""

    name = "single_turn"
    multi_turn = False

    def default_system_prompt(self) -> str:
        return "Think about the question inside <think> and </think>, then give the final answer inside <answer> and </answer>."

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        raise RuntimeError("the single_turn protocol has no observations")

    def _parse(self, text: str, num_observations: int) -> Action:
        if "<grounding>" in text or "<tool_call>" in text:
            raise _Invalid(FormatErrorKind.TOOLS_UNAVAILABLE, "this protocol has no tools; answer directly")
        return self._parse_answer_or_nothing(text)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{…}` with its braces matched, or None (what MathRuler's
    `extract_boxed_content`, EasyR1's answer reader, takes; it returns the string "None" where this returns None)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


class BoxedProtocol(SingleTurnProtocol):
    """EasyR1's math answers: think, then the final answer in `\\boxed{}` anywhere after (its
    `examples/format_prompt/math.jinja` asks for it; `examples/reward_function/math.py` reads the last box)."""

    name = "boxed"

    def default_system_prompt(self) -> str:
        return "Think about the question inside <think> and </think>, then put the final answer in \\boxed{}."

    def _parse(self, text: str, num_observations: int) -> Action:
        if "<grounding>" in text or "<tool_call>" in text:
            raise _Invalid(FormatErrorKind.TOOLS_UNAVAILABLE, "this protocol has no tools; answer directly")
        answer = last_boxed(text)
        if answer is None:
            raise _Invalid(FormatErrorKind.NO_ACTION, "the turn holds no \\boxed{…} answer")
        if not answer.strip():
            raise _Invalid(FormatErrorKind.EMPTY_ANSWER, "the answer is empty")
        return Action(think=extract_think(text), answer=answer.strip())

    def render_answer(self, think: str, answer: str) -> str:
        return f"<think>{think}</think>\nThe answer is \\boxed{{{answer}}}."


# --- Pixel-Reasoner ------------------------------------------------------------------------------------------
# Prompt strings of TIGER-AI-Lab/Pixel-Reasoner (commit a3a6c3a), curiosity_driven_rl/: the tools' schemas and the
# turns its rollout writes (openrlhf/trainer/ppo_utils/experience_maker.py), in the Nous function-calling frame
# of Qwen-Agent (qwen_agent/llm/fncall_prompts/nous_fncall_prompt.py, commit 31a4d36), because its warm-start
# checkpoint was trained on exactly this text. They are data, reproduced; tests/test_protocol.py checks them.

PIXEL_REASONER_TOOLS = (
    {"type": "function", "function": {
        "name": "crop_image_normalized",
        "description": "Zoom in on the image based on the bounding box coordinates. It is useful when the object "
                       "or text in the image is too small to be seen.",
        "parameters": {"type": "object", "properties": {
            "bbox_2d": {"type": "array", "description": "coordinates for bounding box of the area you want to zoom "
                        "in. Values should be within [0.0,1.0].", "items": {"type": "number"}},
            "target_image": {"type": "number", "description": "The index of the image to crop. Index from 1 to the "
                             "number of images. Choose 1 to operate on original image."}},
            "required": ["bbox_2d", "target_image"]}}},
    {"type": "function", "function": {
        "name": "select_frames",
        "description": "Select frames from a video.",
        "parameters": {"type": "object", "properties": {
            "target_frames": {"type": "array", "description": "List of frame indices to select from the video (no "
                              "more than 8 frames in total).", "items": {"type": "integer", "description":
                              "Frame index from 1 to 16."}}},
            "required": ["target_frames"]}}},
)
"""The two tools' `function` records (`CropImageNormalized`, `SelectFrames` in experience_maker.py), in the order
`self.tools` lists them, as Qwen-Agent's `NousFnCallPrompt.preprocess_fncall_messages` wraps them."""

NOUS_TOOL_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tool_descs}\n</tools>\n\nFor each function call, return "
    "a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""Qwen-Agent's `FN_CALL_TEMPLATE` (nous_fncall_prompt.py), appended to the system turn after a blank line."""

PIXEL_REASONER_SYSTEM_PROMPT = "You are a helpful assistant.\n\n" + NOUS_TOOL_BLOCK.format(
    tool_descs="\n".join(json.dumps(tool, ensure_ascii=False) for tool in PIXEL_REASONER_TOOLS))
"""The system turn: `get_required_messages`' "You are a helpful assistant." then the Nous tool block."""

PIXEL_REASONER_OBSERVATION = "\nHere is the cropped image (Image Size: {width}x{height}):"
"""The user turn returning a crop, followed by the crop (experience_maker.py, the rollout's `crop` branch)."""

PIXEL_REASONER_ERROR = "\nExecution error:\n{error}\n"
"""The user turn after a call that failed (experience_maker.py, the rollout's `except` branch)."""

PIXEL_REASONER_CROP_TOOL = "crop_image_normalized"


class PixelReasonerProtocol(Protocol):
    """Pixel-Reasoner's dialogue: Qwen's `<tool_call>` JSON calling `crop_image_normalized` on an image picked by
    its 1-based `target_image`, and a final answer in `\\boxed{}` in a turn that calls nothing.

    As its rollout decides (experience_maker.py): a turn is a call only when its text ends with `</tool_call>`
    (generation runs to the end-of-turn token; there is no stop string), and then the last `<tool_call>`'s JSON
    is read; any other turn is the last, its answer the last `\\boxed{}` (the reward reads the whole response).
    A box is normalised when all four numbers are below 1, else pixels of the target image. A `target_image`
    past the last image, or `select_frames` (which needs a video), is a call whose tool fails, as upstream's
    tool fails it, so it counts as a call and gets an error turn.
    """

    name = "pixel_reasoner"
    call_open, call_close = "<tool_call>", "</tool_call>"

    def default_system_prompt(self) -> str:
        return PIXEL_REASONER_SYSTEM_PROMPT

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        width, height = size if size is not None else ("?", "?")
        return PIXEL_REASONER_OBSERVATION.format(width=width, height=height) + IMAGE_PLACEHOLDER

    def error_text(self, detail: str | FormatError) -> str:
        return PIXEL_REASONER_ERROR.format(error=_error_detail(detail))

    def cut_at_call(self, text: str) -> str:
        return text  # a call is the turn's end, so nothing follows it

    def _parse(self, text: str, num_observations: int) -> Action:
        if not text.endswith(self.call_close):
            boxed = last_boxed(text)
            return Action(answer=(boxed if boxed is not None else text).strip())
        payload = text.split(self.call_open)[-1].split(self.call_close)[0]
        think = text[: text.rfind(self.call_open)].strip() if self.call_open in text else None
        obj = _load_json_object(payload, "the tool call")
        _check_keys(obj, ("name", "arguments"), "the tool call")
        name, arguments = obj["name"], obj["arguments"]
        if name == "select_frames":  # a call (upstream counts it); the tool says why it cannot run on an image
            return Action(think=think, call=ToolCall("select_frames", arguments if isinstance(arguments, dict) else {}))
        if name != PIXEL_REASONER_CROP_TOOL:
            shown = repr(clip_text(name, 40)) if isinstance(name, str) else _shown(name)
            raise _Invalid(FormatErrorKind.UNKNOWN_TOOL, f"unknown tool {shown}; use {PIXEL_REASONER_CROP_TOOL!r}")
        if not isinstance(arguments, dict):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'arguments' must be a JSON object")
        _check_keys(arguments, ("bbox_2d", "target_image"), "the tool call's arguments", self.extra_arguments)
        target = arguments["target_image"]
        if isinstance(target, bool) or not isinstance(target, int):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, f"'target_image' must be an image's number, got {_shown(target)}")
        if target < 1:  # upstream indexes its list with target - 1, so 0 would crop the last image
            raise _Invalid(FormatErrorKind.UNKNOWN_SOURCE, f"'target_image' must be within [1, {num_observations + 1}] "
                                                           f"(1 is the original image), got {_shown(target)}")
        box = arguments["bbox_2d"]
        if (not isinstance(box, list) or len(box) != 4
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'bbox_2d' must be a list of four numbers [x1, y1, x2, y2]")
        try:
            floats = [float(v) for v in box]
        except OverflowError:
            raise _Invalid(FormatErrorKind.OUT_OF_RANGE, "'bbox_2d' holds a number far out of range") from None
        if not all(math.isfinite(v) for v in floats):
            raise _Invalid(FormatErrorKind.NOT_FINITE, "'bbox_2d' holds a number that is not finite")
        frame = "relative" if all(v < 1 for v in floats) else "absolute"
        source = ORIGINAL_IMAGE if target == 1 else f"observation_{target - 1}"
        return Action(think=think, call=ToolCall("crop", {"bbox_2d": floats, "source": source, "frame": frame}))

    def render_call(self, think: str, call: ToolCall) -> str:
        # Below 1 on every side, or upstream reads the box as pixels.
        box = [min(v, 0.999) for v in _short_relative_box(call.arguments["bbox_2d"])]
        source = call.arguments.get("source", ORIGINAL_IMAGE)
        target = 1 if source == ORIGINAL_IMAGE else int(source.rsplit("_", 1)[1]) + 1
        args = {"name": PIXEL_REASONER_CROP_TOOL, "arguments": {"bbox_2d": box, "target_image": target}}
        return f"{think}\n{self.call_open}\n{json.dumps(args)}\n{self.call_close}"

    def render_answer(self, think: str, answer: str) -> str:
        return f"{think}\nThe answer is \\boxed{{{answer}}}."


PIXELIS_OPERATIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "ZOOM_IN": ("crop", ("x0", "y0", "x1", "y1"), "ZOOM_IN(x0, y0, x1, y1, source='original_image'): look closer at a box"),
    "SEGMENT_OBJECT_AT": ("segment_at", ("x", "y"),
                          "SEGMENT_OBJECT_AT(x, y, source='original_image'): the object at a point, as mask_N"),
    "GET_PROPERTIES": ("get_properties", ("mask",), "GET_PROPERTIES(mask='mask_N'): colour, shape, area and box of a mask"),
    "READ_TEXT": ("read_text", ("x0", "y0", "x1", "y1"), "READ_TEXT(x0, y0, x1, y1, source='original_image'): the text in a box"),
    "ROTATE": ("rotate", ("angle",), "ROTATE(angle, source='original_image'): the image turned counter-clockwise"),
    "SELECT_FRAMES": ("select_frames", ("frames",), "SELECT_FRAMES(frames=[i, ...]): frames of the video to see again"),
    "TRACK_OBJECT": ("track_object", ("x0", "y0", "x1", "y1", "start_frame"),
                     "TRACK_OBJECT(x0, y0, x1, y1, start_frame=1): follow an object's box through the frames"),
}
"""Pixelis' operation names (`core/modules/operations/*.py`, registered under upper-case names in
`core/modules/operation_registry.py`), each with the Loupe tool it runs, its positional arguments, and the line
the system prompt shows. Coordinates are fractions of the source's sides."""

_PIXELIS_CALL = re.compile(r"^\s*([A-Z][A-Z_]{1,40})\((.*)\)\s*$", re.S)


class PixelisProtocol(Protocol):
    """Pixelis' dialogue: reasoning in `<think>`, then either one visual operation written as a function call,
    `SEGMENT_OBJECT_AT(x=0.42, y=0.31)`, on the turn's last line, or `<answer>…</answer>`.

    Pixelis' trajectories write operations this way (its `parse_trajectory` reads `SEGMENT_OBJECT_AT(x=100,
    y=200)`, `READ_TEXT()`, `TRACK_OBJECT(id=1)` lines; `core/modules/operations/*.py` hold the operations).
    Loupe reads the arguments as Python literals (`ast.literal_eval`, never evaluated code), positional in the
    order `PIXELIS_OPERATIONS` gives or by keyword, and hands them to the registered tool, whose typed
    arguments check them. Pixelis points with pixel coordinates; Loupe's operations take fractions of the
    source's sides, as its crop does, so a call means the same whatever size the image was shown at.
    """

    name = "pixelis"

    def default_system_prompt(self) -> str:
        lines = "\n".join(f"- {usage}" for _, _, usage in PIXELIS_OPERATIONS.values())
        return (
            "You answer questions about images and videos by operating on their pixels. Think inside <think> and "
            "</think>, then either call one operation on the last line of your turn, or give the final answer "
            "inside <answer> and </answer>. Coordinates are fractions (0 to 1) of the image's width and height; "
            "images are 'original_image' or 'observation_N'. Operations:\n" + lines
        )

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        return f"observation_{index}: {IMAGE_PLACEHOLDER}"

    def tool_text(self, text: str) -> str:
        return f"Result: {text}"

    def can_call(self, tool: str) -> bool:
        return any(tool == registered for registered, _, _ in PIXELIS_OPERATIONS.values())

    def error_text(self, detail: str | FormatError) -> str:
        return f"Error: {_error_detail(detail)}\nFix the call, or answer."

    def _parse(self, text: str, num_observations: int) -> Action:
        body = _THINK.sub("", text).strip()
        last_line = body.rsplit("\n", 1)[-1]
        match = _PIXELIS_CALL.match(last_line)
        if match is None:
            return self._parse_answer_or_nothing(text)
        if "<answer>" in body:
            raise _Invalid(FormatErrorKind.CALL_AND_ANSWER, "a turn must either call an operation or answer, not both")
        return Action(think=extract_think(text), call=self._read_operation(match.group(1), match.group(2)))

    def _read_operation(self, name: str, argument_text: str) -> ToolCall:
        import ast

        if name not in PIXELIS_OPERATIONS:
            raise _Invalid(FormatErrorKind.UNKNOWN_TOOL,
                           f"unknown operation {clip_text(name, 40)!r}; known: {', '.join(PIXELIS_OPERATIONS)}")
        tool, positional, _ = PIXELIS_OPERATIONS[name]
        try:
            call = ast.parse(f"f({argument_text})", mode="eval").body
            assert isinstance(call, ast.Call)
            values = [ast.literal_eval(node) for node in call.args]
            keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        except (SyntaxError, ValueError, TypeError, AssertionError, MemoryError, RecursionError) as error:
            raise _Invalid(FormatErrorKind.BAD_JSON, f"the arguments of {name} are not literals: "
                                                      f"{clip_text(str(error), 80)}") from None
        if len(values) > len(positional):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, f"{name} takes at most {len(positional)} positional arguments")
        arguments = dict(zip(positional, values)) | keywords
        return ToolCall(tool, _to_tool_arguments(tool, arguments))

    def render_call(self, think: str, call: ToolCall) -> str:
        name = next(n for n, (tool, _, _) in PIXELIS_OPERATIONS.items() if tool == call.tool)
        arguments = dict(call.arguments)
        box = arguments.pop("bbox_2d", None)
        parts = [f"{v:.3f}".rstrip("0").rstrip(".") if isinstance(v, float) else repr(v) for v in (box or [])]
        if "point" in arguments:
            x, y = arguments.pop("point")
            parts += [f"x={x:.3f}", f"y={y:.3f}"]
        parts += [f"{k}={v!r}" for k, v in arguments.items() if not (k == "source" and v == ORIGINAL_IMAGE)]
        return f"<think>{think}</think>\n{name}({', '.join(parts)})"


def _to_tool_arguments(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Pixelis' flat arguments in the shape the registered tool takes (a box, a point, frame numbers)."""
    out = dict(arguments)
    corners = [out.pop(k) for k in ("x0", "y0", "x1", "y1") if k in out]
    if corners:
        out["bbox_2d"] = corners
    if "x" in out or "y" in out:
        out["point"] = [out.pop("x", None), out.pop("y", None)]
    if "frames" in out:
        out["target_frames"] = out.pop("frames")
    return out


PROTOCOLS: dict[str, type[Protocol]] = {
    cls.name: cls for cls in (MiniO3Protocol, LoupeProtocol, DeepEyesProtocol, SingleTurnProtocol, BoxedProtocol,
                               PixelReasonerProtocol, PixelisProtocol)
}


def compile_template(text: str, where: str = "prompt template") -> Any:
    """A Jinja template (jinja2, as EasyR1 renders its `format_prompt`); undefined variables are errors, and a
    syntax error raises ValueError naming `where` and the line."""
    import jinja2

    try:
        return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False).from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{where}:{err.lineno}: {err.message}") from None


def read_template(path_text: str, field: str) -> str:
    """The text of the Jinja file a params field names, checked to compile: a missing file or a syntax error is
    named when the params load, not at the first use (the protocol's prompt, the judge's prompt)."""
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{field}: cannot read {path}: {err.strerror or err}") from None
    compile_template(text, str(path))
    return text


def make_protocol(params: Any) -> Protocol:
    """The protocol `params` (loupe.config.ProtocolParams) names, with its prompt template and system prompt."""
    protocol = get_protocol(params.name)
    if getattr(params, "template_text", None):
        protocol.template = compile_template(params.template_text, params.prompt_template)
    if getattr(params, "system_prompt", None) is not None:
        protocol.system_override = params.system_prompt
    protocol.observation_override = getattr(params, "observation_template", None)
    protocol.error_override = getattr(params, "error_template", None)
    protocol.extra_arguments = tuple(getattr(params, "tool_extra_arguments", ()) or ())
    protocol.clamp_boxes = getattr(params, "out_of_range_boxes", "refuse") == "clamp"
    return protocol


def get_protocol(name: str) -> Protocol:
    try:
        return PROTOCOLS[name]()
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; known: {', '.join(sorted(PROTOCOLS))}") from None


# --- conversions of a finished trajectory -------------------------------------------------------------------


def split_on_images(text: str, images: list[Any]) -> list[dict[str, Any]]:
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"turn holds {len(pieces) - 1} image placeholders but {len(images)} images: {text[:80]!r}")
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if piece:
            content.append({"type": "text", "text": piece})
        if i < len(images):
            content.append({"type": "image", "image": images[i]})
    return content


def to_chat_messages(trajectory: "Trajectory") -> list[dict[str, Any]]:
    """Hugging Face chat messages (`processor.apply_chat_template` input); images as PIL images or paths."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": [{"type": "text", "text": trajectory.system}]}]
    for turn in trajectory.turns:
        images = [trajectory.pending.get(i) or str(trajectory.image_path(i)) for i in turn.images]
        messages.append({"role": turn.role, "content": split_on_images(turn.text, images)})
    return messages


def to_sharegpt(trajectory: "Trajectory") -> dict[str, Any]:
    """A LLaMA-Factory sharegpt record: system/human/gpt turns, `<image>` placeholders, image paths in order.

    Observations (crops and error messages alike) are human turns, as in Mini-o3's cold-start set. The
    record must end on the model's turn, so only finished trajectories convert; crops must be saved first.
    """
    if not trajectory.turns or trajectory.turns[-1].role != "assistant":
        raise ValueError(f"trajectory {trajectory.traj_id} does not end on an assistant turn")
    roles = {"user": "human", "assistant": "gpt"}
    conversations = [{"from": "system", "value": trajectory.system}]
    images: list[str] = []
    for turn in trajectory.turns:
        if turn.text.count(IMAGE_PLACEHOLDER) != len(turn.images):
            raise ValueError(
                f"trajectory {trajectory.traj_id}: a {turn.role} turn holds {turn.text.count(IMAGE_PLACEHOLDER)} "
                f"image placeholders but {len(turn.images)} images"
            )
        conversations.append({"from": roles[turn.role], "value": turn.text})
        images += [str(trajectory.image_path(i)) for i in turn.images]
    return {"conversations": conversations, "images": images}

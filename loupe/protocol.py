"""The dialogue protocol: system prompt, tool-call grammar, observation turns, answer extraction.

A protocol variant says how a model talks: what the system prompt asks, how a tool call is written and
parsed, how the tool's answer comes back, and when generation stops. The rollout loop only ever calls the
`Protocol` interface, so a new variant (another tool grammar, another prompt) is a new subclass registered in
`PROTOCOLS`, with no change to the loop.

Variants:
- `mini_o3` (default): `<think>…</think>` then `<grounding>{"bbox_2d": [x0, y0, x1, y1], "source": …}</grounding>`
  with coordinates relative to the named source, or `<answer>…</answer>`.
- `deepeyes`: `<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [...]}}</tool_call>` with
  absolute pixel coordinates on the original image.
- `single_turn`: R1-V style `<think>…</think><answer>…</answer>`, no tools.

`Protocol.parse` never raises on model output: anything malformed becomes an `Action` holding a typed
`FormatError`, which the loop sends back as an error observation saying what was wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from loupe.data.tasks import OPTION_LETTERS, TaskRecord

if TYPE_CHECKING:
    from loupe.trajectory import Trajectory

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a turn's text (LLaMA-Factory's placeholder; chat templates expand it)."""

ORIGINAL_IMAGE = "original_image"


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


class _Invalid(Exception):
    """Internal: carries a FormatError out of nested checks; never leaves this module."""

    def __init__(self, kind: FormatErrorKind, detail: str):
        super().__init__(detail)
        self.error = FormatError(kind, detail)


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
        raise _Invalid(FormatErrorKind.BAD_JSON, f"{what} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise _Invalid(FormatErrorKind.WRONG_TYPE, f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _check_keys(obj: dict[str, Any], required: tuple[str, ...], what: str) -> None:
    for key in required:
        if key not in obj:
            raise _Invalid(FormatErrorKind.MISSING_KEY, f"{what} lacks the key '{key}'")
    extra = sorted(set(obj) - set(required))
    if extra:
        raise _Invalid(FormatErrorKind.WRONG_TYPE, f"{what} has unexpected keys {extra}")


def _check_box(value: Any, upper: float | None) -> tuple[float, float, float, float]:
    """A 4-number box with x0 < x1, y0 < y1, each in [0, upper] (no upper bound when None)."""
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
    limit = "[0, 1]" if upper == 1.0 else "non-negative pixels"
    if any(v < 0 or (upper is not None and v > upper) for v in box):
        raise _Invalid(FormatErrorKind.OUT_OF_RANGE, f"'bbox_2d' coordinates must be {limit}, got {list(value)}")
    x0, y0, x1, y1 = box
    if x1 <= x0 or y1 <= y0:
        raise _Invalid(FormatErrorKind.EMPTY_BOX, f"'bbox_2d' needs x0 < x1 and y0 < y1, got {list(value)}")
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

    def system_prompt(self) -> str:
        raise NotImplementedError

    def question_text(self, task: TaskRecord) -> str:
        """The first user turn: one image placeholder per task image, the question, the options."""
        lines = [IMAGE_PLACEHOLDER * len(task.images), task.problem.strip()]
        if task.options:
            lines.append("Options:")
            lines += [f"({letter}) {text}" for letter, text in zip(OPTION_LETTERS, task.options)]
            lines.append("Answer with the option's letter.")
        return "\n".join(lines)

    def observation_text(self, index: int) -> str:
        """The user turn that returns crop number `index` (1-based) to the model, holding one image placeholder."""
        raise NotImplementedError

    def error_text(self, detail: str) -> str:
        """The user turn that tells the model why its last turn was not usable (no image)."""
        return (
            f"Your last turn could not be carried out: {detail}. "
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

    def _parse(self, text: str, num_observations: int) -> Action:
        call_parts = _split_single(text, self.call_open, self.call_close) if self.call_open else None
        if call_parts is None:
            return self._parse_answer_or_nothing(text)
        before, payload, after = call_parts
        if "<answer>" in before or "<answer>" in after:
            raise _Invalid(FormatErrorKind.CALL_AND_ANSWER, "a turn must either call the tool or answer, not both")
        if after.strip():
            raise _Invalid(FormatErrorKind.TRAILING_TEXT, f"nothing may follow {self.call_close}")
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
    """Mini-o3's grounding tool: relative boxes on the original image or any earlier observation."""

    name = "mini_o3"
    stop = ("</grounding>",)
    call_open, call_close = "<grounding>", "</grounding>"

    def system_prompt(self) -> str:
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

    def observation_text(self, index: int) -> str:
        return (
            f"After the above Action {index - 1}, here is the zoom-in image (Observation {index}): "
            f"{IMAGE_PLACEHOLDER}.\nContinue your reasoning inside <think> and </think>. If needed, zoom in "
            "again on the original image or an observation; once you are confident, give the final answer "
            "inside <answer> and </answer>."
        )

    def _read_call(self, payload: str, num_observations: int) -> ToolCall:
        obj = _load_json_object(payload, "the grounding call")
        _check_keys(obj, ("bbox_2d", "source"), "the grounding call")
        box = _check_box(obj["bbox_2d"], upper=1.0)
        source = obj["source"]
        if not isinstance(source, str):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'source' must be a string")
        match = _OBSERVATION_SOURCE.fullmatch(source)
        if source != ORIGINAL_IMAGE and not (match and int(match.group(1)) <= num_observations):
            known = [ORIGINAL_IMAGE] + [f"observation_{i}" for i in range(num_observations + 1)]
            shown = source if len(source) <= 40 else source[:40] + "..."
            raise _Invalid(FormatErrorKind.UNKNOWN_SOURCE, f"unknown source {shown!r}; known: {', '.join(known)}")
        if match:  # one name per image: observation_01 is observation_1, observation_0 the original
            number = int(match.group(1))
            source = f"observation_{number}" if number else ORIGINAL_IMAGE
        return ToolCall("crop", {"bbox_2d": list(box), "source": source, "frame": "relative"})

    def render_call(self, think: str, call: ToolCall) -> str:
        args = {"bbox_2d": _short_relative_box(call.arguments["bbox_2d"]), "source": call.arguments["source"]}
        return f"<think>{think}</think>\n{self.call_open}{json.dumps(args)}{self.call_close}"


class DeepEyesProtocol(Protocol):
    """DeepEyes' zoom tool: a JSON function call with absolute pixel boxes on the original image."""

    name = "deepeyes"
    stop = ("</tool_call>",)
    call_open, call_close = "<tool_call>", "</tool_call>"
    tool_name = "image_zoom_in_tool"

    def system_prompt(self) -> str:
        return (
            "You answer questions about images. Think inside <think> and </think>. To look closer, call "
            f'<tool_call>{{"name": "{self.tool_name}", "arguments": {{"bbox_2d": [x0, y0, x1, y1]}}}}</tool_call>'
            " with the box in pixels of the original image. When sure, answer inside <answer> and </answer>."
        )

    def observation_text(self, index: int) -> str:
        return f"<tool_response>{IMAGE_PLACEHOLDER}</tool_response>\nContinue, or give your final answer."

    def _read_call(self, payload: str, num_observations: int) -> ToolCall:
        obj = _load_json_object(payload, "the tool call")
        _check_keys(obj, ("name", "arguments"), "the tool call")
        if obj["name"] != self.tool_name:
            raise _Invalid(FormatErrorKind.UNKNOWN_TOOL, f"unknown tool {obj['name']!r}; use {self.tool_name!r}")
        if not isinstance(obj["arguments"], dict):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'arguments' must be a JSON object")
        _check_keys(obj["arguments"], ("bbox_2d",), "the tool call's arguments")
        box = _check_box(obj["arguments"]["bbox_2d"], upper=None)
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

    def system_prompt(self) -> str:
        return "Think about the question inside <think> and </think>, then give the final answer inside <answer> and </answer>."

    def observation_text(self, index: int) -> str:
        raise RuntimeError("the single_turn protocol has no observations")

    def _parse(self, text: str, num_observations: int) -> Action:
        if "<grounding>" in text or "<tool_call>" in text:
            raise _Invalid(FormatErrorKind.TOOLS_UNAVAILABLE, "this protocol has no tools; answer directly")
        return self._parse_answer_or_nothing(text)


PROTOCOLS: dict[str, type[Protocol]] = {
    cls.name: cls for cls in (MiniO3Protocol, DeepEyesProtocol, SingleTurnProtocol)
}


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

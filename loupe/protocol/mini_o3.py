"""Mini-o3's grammar (`mini_o3`) and Loupe's wording of it (`loupe`): `<think>…</think>` then
`<grounding>{"bbox_2d": [x0, y0, x1, y1], "source": …}</grounding>` with coordinates relative to the named source,
or `<answer>…</answer>`. `mini_o3` speaks Mini-o3's own strings (the `MINI_O3_*` constants), so its released
checkpoints are evaluated and fine-tuned on the text they were trained with; `loupe` names the `observation_N`
sources and states x0 < x1.
"""

from __future__ import annotations

import json
import re

from loupe.data.tasks import IMAGE_PLACEHOLDER
from loupe.protocol.box_expression import BoxExpressionError, evaluate_box_expression
from loupe.protocol.core import (
    _OBSERVATION_SOURCE,
    ORIGINAL_IMAGE,
    Action,
    FormatError,
    FormatErrorKind,
    Protocol,
    ToolCall,
    _check_box,
    _check_keys,
    _error_detail,
    _Invalid,
    _load_json_object,
    _short_relative_box,
    clip_text,
    extract_think,
)

MINI_O3_CALL_PATTERN = re.compile(r'.*<grounding>{"bbox_2d": (.*),.*"source": [\',"](.*)[\',"]}</grounding>', re.DOTALL)
"""How Mini-o3's engine reads a grounding call (`process_tool_call`, vllm_async_engine.py:523-526): greedy, so the
last `<grounding>{"bbox_2d": ` of the turn, the box up to the last comma before `"source"`, the source between
quotes (a comma is one of its three "quote" characters). `turn_reading: mini_o3` reads calls with it."""
_CALL_HEAD = '<grounding>{"bbox_2d": '
_CALL_TAIL = re.compile(r'(.*),.*"source": [\',"](.*)[\',"]}</grounding>', re.DOTALL)
MINI_O3_SOURCE_PATTERN = re.compile(r"observation_([0-9]*)", re.DOTALL)
"""Mini-o3's source names (`prepare_grounding_inputs_multi_turn`, function_tools.py:39-50), matched at the start
only: "observation_2 (the left one)" names observation 2."""

# --- Mini-o3 compatibility constants ------------------------------------------------------------------------
# Byte for byte from github.com/Mini-o3/Mini-o3 (commit 8654dbf), verl/trainer/constants.py, because Mini-o3's
# checkpoints were trained on exactly these strings. Their typos ("the the", "Countinue") are part of them.
# tests/test_protocol_variants.py holds each constant equal to a copy written from that file.

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

    def _parse(self, text: str, num_observations: int) -> Action:
        """Under `turn_reading: mini_o3`, Mini-o3's reading of a turn (vllm_async_engine.py:657,697-714): a turn
        holding a complete `<grounding>…</grounding>` is a call, whatever else it holds (an `<answer>` beside it
        too: the call runs, and the answer still counts for the reward), read by `MINI_O3_CALL_PATTERN`; any
        other turn is read for its answer. Otherwise Loupe's reading (`Protocol._parse`)."""
        if self.turn_reading != "mini_o3":
            return super()._parse(text, num_observations)
        text = self.cut_at_call(text)
        if not self.holds_call_span(text):
            return self._parse_answer_or_nothing(text)
        return Action(think=extract_think(text), call=self._read_mini_o3_call(text, num_observations))

    def _read_mini_o3_call(self, text: str, num_observations: int) -> ToolCall:
        """The call as Mini-o3's engine and tool read it (module constants); a box is evaluated as number
        arithmetic, never run (`loupe.protocol.box_expression`), and must then be a list of four numbers
        (function_tools.py:34)."""
        match = _mini_o3_call_match(text)
        if match is None:
            raise _Invalid(FormatErrorKind.BAD_JSON, 'the grounding call does not read as {"bbox_2d": [x0, y0, x1, '
                                                     'y1], "source": "..."}')
        try:
            value = evaluate_box_expression(match.group(1))
        except BoxExpressionError as err:
            raise _Invalid(FormatErrorKind.BAD_JSON, f"'bbox_2d' is not a list of numbers ({err})") from None
        if not isinstance(value, list) or len(value) != 4:
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'bbox_2d' must be a list of four numbers [x0, y0, x1, y1]")
        box = _check_box(value, upper=1.0, clamp=self.clamp_boxes)
        source = match.group(2)
        number = 0
        if source != ORIGINAL_IMAGE:
            named = MINI_O3_SOURCE_PATTERN.match(source)
            try:
                number = int(named.group(1)) if named is not None else -1
            except ValueError:  # no digits, or more than Python reads
                number = -1
            if not 0 <= number <= num_observations:
                raise _Invalid(FormatErrorKind.UNKNOWN_SOURCE, f"unknown source {clip_text(source, 40)!r}; known: "
                                                               f"{_known_sources(num_observations)}")
        source = f"observation_{number}" if number else ORIGINAL_IMAGE
        return ToolCall("crop", {"bbox_2d": list(box), "source": source, "frame": "relative"})

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


def _mini_o3_call_match(text: str) -> re.Match[str] | None:
    """`MINI_O3_CALL_PATTERN.match(text)`'s groups, found without its leading `.*`, whose backtracking over a long
    turn takes seconds: that greedy prefix settles on the rightmost `<grounding>{"bbox_2d": ` after which the rest
    matches, so the rest is tried after each such head from the right."""
    start = len(text)
    while (start := text.rfind(_CALL_HEAD, 0, start)) >= 0:
        match = _CALL_TAIL.match(text, start + len(_CALL_HEAD))
        if match is not None:
            return match
    return None


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

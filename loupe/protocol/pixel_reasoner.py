"""Pixel-Reasoner's grammar (`pixel_reasoner`): Qwen's `<tool_call>` JSON calling `crop_image_normalized` on a
1-based `target_image`, the answer in `\boxed{}` in a turn that calls nothing, and its own prompt strings.
"""

from __future__ import annotations

import json
import math

from loupe.data.tasks import IMAGE_PLACEHOLDER
from loupe.protocol.core import (
    ORIGINAL_IMAGE,
    Action,
    FormatError,
    FormatErrorKind,
    Protocol,
    ToolCall,
    _check_keys,
    _error_detail,
    _Invalid,
    _load_json_object,
    _short_relative_box,
    _shown,
    clip_text,
)
from loupe.protocol.single_turn import last_boxed

# --- Pixel-Reasoner ------------------------------------------------------------------------------------------
# Prompt strings of TIGER-AI-Lab/Pixel-Reasoner (commit a3a6c3a), curiosity_driven_rl/: the tools' schemas and the
# turns its rollout writes (openrlhf/trainer/ppo_utils/experience_maker.py), in the Nous function-calling frame
# of Qwen-Agent (qwen_agent/llm/fncall_prompts/nous_fncall_prompt.py, commit 31a4d36), because its warm-start
# checkpoint was trained on exactly this text. They are data, reproduced; tests/test_protocol_variants.py checks them.

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

"""DeepEyes' grammar (`deepeyes`): `<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [...]}}</tool_call>`
with absolute pixel coordinates on the original image.
"""

from __future__ import annotations

import json
import math

from loupe.data.tasks import IMAGE_PLACEHOLDER
from loupe.protocol.core import (
    ORIGINAL_IMAGE,
    FormatErrorKind,
    Protocol,
    ToolCall,
    _check_box,
    _check_keys,
    _Invalid,
    _load_json_object,
    _shown,
    clip_text,
)

ROTATE_TOOL = "image_rotate_tool"
"""DeepEyes' second tool (visual_toolbox_v2.py:90-95): `{"angle": degrees}`, the original turned by PIL's
`Image.rotate(angle)` (counter-clockwise, the canvas kept, NEAREST, black corners); read under
`turn_reading: deepeyes` only."""


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

    def can_call(self, tool: str) -> bool:
        return tool == "crop" or (tool == "rotate" and self.turn_reading == "deepeyes")

    def _read_call(self, payload: str, num_observations: int) -> ToolCall:
        """The call's JSON. Under DeepEyes' reading (`turn_reading: deepeyes`) as its tool reads it
        (`VisualToolBoxV2.execute`, visual_toolbox_v2.py:66-100): keys it does not read are ignored, anywhere, and
        `image_rotate_tool` turns the original by `angle` degrees counter-clockwise on its own canvas; otherwise
        strictly: `name` and `arguments` only, the zoom tool alone, `bbox_2d` and the accepted extra arguments."""
        obj = _load_json_object(payload, "the tool call")
        lenient = self.turn_reading == "deepeyes"
        _check_keys(obj, ("name", "arguments"), "the tool call", tuple(obj) if lenient else ())
        name, arguments = obj["name"], obj["arguments"]
        if lenient and name == ROTATE_TOOL:
            if not isinstance(arguments, dict):
                raise _Invalid(FormatErrorKind.WRONG_TYPE, "'arguments' must be a JSON object")
            _check_keys(arguments, ("angle",), "the tool call's arguments", tuple(arguments))
            angle = arguments["angle"]
            if not isinstance(angle, (int, float)) or isinstance(angle, bool) or not math.isfinite(angle):
                raise _Invalid(FormatErrorKind.WRONG_TYPE, "'angle' must be a number of degrees")
            # A turn by `angle` and by `angle` mod 360 are the same picture on a kept canvas.
            return ToolCall("rotate", {"angle": math.fmod(float(angle), 360.0), "source": ORIGINAL_IMAGE,
                                       "canvas": "kept"})
        if name != self.tool_name:
            shown = repr(clip_text(name, 40)) if isinstance(name, str) else _shown(name)
            raise _Invalid(FormatErrorKind.UNKNOWN_TOOL, f"unknown tool {shown}; use {self.tool_name!r}")
        if not isinstance(arguments, dict):
            raise _Invalid(FormatErrorKind.WRONG_TYPE, "'arguments' must be a JSON object")
        _check_keys(arguments, ("bbox_2d",), "the tool call's arguments",
                    tuple(arguments) if lenient else self.extra_arguments)
        box = _check_box(arguments["bbox_2d"], upper=None, clamp=self.clamp_boxes)
        return ToolCall("crop", {"bbox_2d": list(box), "source": ORIGINAL_IMAGE, "frame": "absolute"})

    def render_call(self, think: str, call: ToolCall) -> str:
        if call.tool == "rotate":  # what `can_call` accepts under DeepEyes' reading: its image_rotate_tool
            args = {"name": ROTATE_TOOL, "arguments": {"angle": call.arguments["angle"]}}
            return f"<think>{think}</think>\n{self.call_open}{json.dumps(args)}{self.call_close}"
        # Round outwards, as the crop tool does, so a sub-pixel box stays non-empty and crops the same pixels.
        x0, y0, x1, y1 = call.arguments["bbox_2d"]
        box = [math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1)]
        args = {"name": self.tool_name, "arguments": {"bbox_2d": box}}
        return f"<think>{think}</think>\n{self.call_open}{json.dumps(args)}{self.call_close}"

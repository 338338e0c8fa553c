"""Pixelis' grammar (`pixelis`): operations written as calls (`ZOOM_IN(x0, y0, x1, y1, source=...)`,
`SEGMENT_OBJECT_AT(x, y)`, ...), each handed to the registered visual-operation tool (`loupe.visual_ops`).
"""

from __future__ import annotations

import re
from typing import Any

from loupe.data.tasks import IMAGE_PLACEHOLDER
from loupe.protocol.core import (
    _THINK,
    ORIGINAL_IMAGE,
    Action,
    FormatError,
    FormatErrorKind,
    Protocol,
    ToolCall,
    _error_detail,
    _Invalid,
    clip_text,
    extract_think,
)

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

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

One module per grammar (`mini_o3`, `deepeyes`, `single_turn`, `pixel_reasoner`, `pixelis`) over the parser
core they share (`core`: the `Protocol` interface, typed errors, the JSON and box checks), as `loupe/rewards/` is
one module per recipe family; `conversions` turns a finished trajectory into chat messages or ShareGPT. This
module registers the grammars and reads a recipe's templates; every name the project imports is here.

`Protocol.parse` never raises on model output: anything malformed becomes an `Action` holding a typed
`FormatError`, which the loop sends back as an error observation saying what was wrong. The parser's policy for
each corner case (text after a call, coordinates a hair outside [0, 1], sub-pixel boxes, bounded error
messages) is written down in docs/architecture.md, "Parser policy".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loupe.protocol.conversions import split_on_images, to_chat_messages, to_sharegpt
from loupe.protocol.core import (
    ABSOLUTE_TOLERANCE,
    IMAGE_PLACEHOLDER,
    MAX_ERROR_DETAIL,
    OPTION_LETTERS,
    ORIGINAL_IMAGE,
    RELATIVE_TOLERANCE,
    Action,
    FormatError,
    FormatErrorKind,
    Protocol,
    ToolCall,
    clip_text,
    extract_answer,
    extract_think,
)
from loupe.protocol.deepeyes import DeepEyesProtocol
from loupe.protocol.mini_o3 import (
    MINI_O3_ERROR_PROMPT,
    MINI_O3_IMAGE_MARKUP,
    MINI_O3_OBSERVATION_TEMPLATE,
    MINI_O3_SYSTEM_PROMPT,
    MINI_O3_TOOL_ERROR_TEMPLATE,
    LoupeProtocol,
    MiniO3Protocol,
)
from loupe.protocol.pixel_reasoner import (
    NOUS_TOOL_BLOCK,
    PIXEL_REASONER_CROP_TOOL,
    PIXEL_REASONER_ERROR,
    PIXEL_REASONER_OBSERVATION,
    PIXEL_REASONER_SYSTEM_PROMPT,
    PIXEL_REASONER_TOOLS,
    PixelReasonerProtocol,
)
from loupe.protocol.pixelis import PIXELIS_OPERATIONS, PixelisProtocol
from loupe.protocol.single_turn import BoxedProtocol, SingleTurnProtocol, last_boxed

__all__ = [
    "ABSOLUTE_TOLERANCE", "IMAGE_PLACEHOLDER", "MAX_ERROR_DETAIL", "MINI_O3_ERROR_PROMPT", "MINI_O3_IMAGE_MARKUP",
    "MINI_O3_OBSERVATION_TEMPLATE", "MINI_O3_SYSTEM_PROMPT", "MINI_O3_TOOL_ERROR_TEMPLATE", "NOUS_TOOL_BLOCK",
    "OPTION_LETTERS", "ORIGINAL_IMAGE", "PIXELIS_OPERATIONS", "PIXEL_REASONER_CROP_TOOL", "PIXEL_REASONER_ERROR",
    "PIXEL_REASONER_OBSERVATION", "PIXEL_REASONER_SYSTEM_PROMPT", "PIXEL_REASONER_TOOLS", "PROTOCOLS",
    "RELATIVE_TOLERANCE", "Action", "BoxedProtocol", "DeepEyesProtocol", "FormatError", "FormatErrorKind",
    "LoupeProtocol", "MiniO3Protocol", "PixelReasonerProtocol", "PixelisProtocol", "Protocol", "SingleTurnProtocol",
    "ToolCall", "clip_text", "compile_template", "extract_answer", "extract_think", "get_protocol", "last_boxed",
    "make_protocol", "read_template", "split_on_images", "to_chat_messages", "to_sharegpt",
]


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
    protocol.turn_reading = getattr(params, "turn_reading", "first_call")
    protocol.record_prompts = getattr(params, "record_prompts", True)
    return protocol


def get_protocol(name: str) -> Protocol:
    try:
        return PROTOCOLS[name]()
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; known: {', '.join(sorted(PROTOCOLS))}") from None

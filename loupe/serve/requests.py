"""What a client may send to `POST /v1/chat/completions`, and how a request becomes a question with images.

The body follows OpenAI's chat-completions schema (the fields below, nothing else: an unknown field is a 400
naming it, not silently ignored), plus one extension, `loupe`. Images are `image_url` parts holding data URLs;
http(s) addresses are fetched only when `serve.fetch_image_urls` allows it. Every image is checked from its
header before it is decoded (size, pixel count), so a decompression bomb is refused without being unpacked,
and a truncated file is refused when decoding fails, not at the model.

Two kinds of request (`loupe.loop`):
- **the zoom loop** (the default): the last user message is the question, its images the pictures. The server
  asks it the way the model was trained (the protocol's system prompt and question template), runs every turn
  (generate, parse the call, crop the full-resolution upload, show the crop, generate again) and answers with
  the final answer. Earlier messages and a client's system message are not shown to the model: it was trained on
  one question per dialogue.
- **one turn** (`loop: false`): the messages are the dialogue so far, rendered as they are, and the reply is the
  model's next assistant turn, ending at a tool call's closing tag. A client that runs the loop itself (Loupe's
  `openai` engine, an agent framework) uses the server like any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Annotated, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from loupe.images import ImageError, ImageTooLarge, open_image_bytes
from loupe.protocol import IMAGE_PLACEHOLDER
from loupe.serve.params import ServeParams


class RequestError(Exception):
    """A request the server refuses: its HTTP status, a message for the client and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted for compatibility; the model sees every image at the protocol's pixel budget."""


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send one more chunk before [DONE] with the whole request's usage, as OpenAI's streams do."""


class LoupeOptions(_Strict):
    """The request's `loupe` extension."""

    loop: bool = True
    """Run the zoom loop server-side (True) or return the model's next turn only (False)."""
    trajectory: bool = True
    """Return the search in the reply's `loupe.trajectory`: each turn's text, box and crop size."""
    crops: bool = False
    """With the trajectory, each crop as a PNG data URL (what the model saw)."""
    options: list[str] | None = Field(None, min_length=2)
    """A choice question's options: shown to the model as its protocol shows them, the answer then a letter."""


class ChatRequest(_Strict):
    """The body of `POST /v1/chat/completions`."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    """Accepted when it asks for no stop string beyond the protocol's (a tool call's closing tag), which the
    engine stops at anyway; a client running the loop itself sends those."""
    n: int | None = Field(None, ge=1, le=1)
    top_k: int | None = Field(None, ge=0)
    """Not OpenAI's, but vLLM's and Loupe's `openai` engine's: accepted when it is the server's
    (`rollout.top_k`), like temperature."""
    seed: int | None = None
    user: str | None = None
    loupe: LoupeOptions = Field(default_factory=LoupeOptions)


@dataclass
class Dialogue:
    """A one-turn request's messages, rendered: the system prompt, then (role, text with placeholders, images)."""

    system: str
    turns: list[tuple[str, str, list[Image.Image]]] = field(default_factory=list)


@dataclass
class Question:
    """A zoom-loop request's question and its decoded pictures."""

    text: str
    images: list[Image.Image]


def decode_image(url: str, params: ServeParams, where: str) -> Image.Image:
    """The RGB image an `image_url` holds, decoded by the rule training and eval decode with
    (`loupe.images.open_image`: its formats, EXIF orientation, transparency on white, 16-bit scaling, the pixel
    limit read from the header); RequestError (400, or 413 past a size limit) naming `where`."""
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or ";base64" not in header:
            raise RequestError(400, f"{where}: a data URL must be base64 (data:image/png;base64,...)", where)
        if len(payload) > params.max_request_bytes * 4 // 3 + 4:
            raise RequestError(413, f"{where}: the image is larger than {params.max_request_bytes} bytes", where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, f"{where}: the data URL's base64 is not valid", where) from None
    elif url.startswith(("http://", "https://")):
        if not params.fetch_image_urls:
            raise RequestError(400, f"{where}: http(s) image URLs are refused (serve.fetch_image_urls is off); send "
                                    "the image as a data URL", where)
        data = _fetch(url, params, where)
    else:
        raise RequestError(400, f"{where}: an image_url must be a data URL (or http(s) when allowed), got "
                                f"{url[:40]!r}", where)
    try:
        image = open_image_bytes(data, where, params.max_image_pixels)
    except ImageTooLarge as err:
        raise RequestError(413, f"{err} (serve.max_image_pixels)", where) from None
    except ImageError as err:  # not an image, a format outside the training decoder's, truncated, damaged
        raise RequestError(400, str(err), where) from None
    if min(image.size) < params.min_image_side:
        raise RequestError(400, f"{where}: the image is {image.width}x{image.height}; both sides must be at least "
                                f"{params.min_image_side} pixels", where)
    return image


def _fetch(url: str, params: ServeParams, where: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=params.fetch_timeout_s, follow_redirects=True) as reply:
            if reply.status_code != 200:
                raise RequestError(400, f"{where}: fetching {url[:80]} gave HTTP {reply.status_code}", where)
            data = bytearray()
            for chunk in reply.iter_bytes():
                data += chunk
                if len(data) > params.max_request_bytes:
                    raise RequestError(413, f"{where}: {url[:80]} is larger than {params.max_request_bytes} bytes",
                                       where)
            return bytes(data)
    except httpx.HTTPError as err:
        raise RequestError(400, f"{where}: fetching {url[:80]} failed ({type(err).__name__})", where) from None


def _parts(message: Message) -> list[TextPart | ImagePart]:
    if message.content is None:
        return []
    if isinstance(message.content, str):
        return [TextPart(type="text", text=message.content)]
    return list(message.content)


def _render(message: Message, index: int, params: ServeParams, counted: list[int], limit: int,
            limit_name: str) -> tuple[str, list[Image.Image]]:
    """A message's text with one placeholder where each image was, and its images, decoded; at most `limit`
    images counted over the request (`counted`)."""
    text, images = [], []
    for number, part in enumerate(_parts(message)):
        if isinstance(part, TextPart):
            if IMAGE_PLACEHOLDER in part.text:
                raise RequestError(400, f"messages[{index}].content[{number}]: the text holds {IMAGE_PLACEHOLDER!r}, "
                                        "which marks an image; send images as image_url parts",
                                   f"messages[{index}].content")
            text.append(part.text)
            continue
        counted[0] += 1
        if counted[0] > limit:
            raise RequestError(400, f"messages[{index}]: more than {limit_name} ({limit}) images in the request",
                               "messages")
        images.append(decode_image(part.image_url.url, params, f"messages[{index}].content[{number}].image_url"))
        text.append(IMAGE_PLACEHOLDER)
    return "".join(text), images


def read_question(request: ChatRequest, params: ServeParams) -> Question:
    """The zoom loop's question: the last user message's text (placeholders removed) and its images."""
    users = [i for i, message in enumerate(request.messages) if message.role == "user"]
    if not users:
        raise RequestError(400, "messages: no user message; the last user message is the question", "messages")
    index = users[-1]
    text, images = _render(request.messages[index], index, params, [0], params.max_images_per_request,
                           "serve.max_images_per_request")
    question = text.replace(IMAGE_PLACEHOLDER, " ").strip()
    if not images:
        raise RequestError(400, f"messages[{index}]: the question has no image; add an image_url part (a data URL)",
                           f"messages[{index}].content")
    if not question:
        raise RequestError(400, f"messages[{index}]: the question has no text", f"messages[{index}].content")
    return Question(question, images)


def read_dialogue(request: ChatRequest, params: ServeParams, default_system: str, max_images: int) -> Dialogue:
    """A one-turn request's dialogue: an optional system message first, then user and assistant turns that
    alternate, starting and ending with a user turn. Its images are the question's and every crop so far, so
    they are bounded by the protocol's `max_images`, as a dialogue in training is."""
    messages = list(request.messages)
    system = default_system
    if messages[0].role in ("system", "developer"):
        system = "".join(part.text for part in _parts(messages[0]) if isinstance(part, TextPart))
        messages = messages[1:]
    offset = len(request.messages) - len(messages)
    dialogue = Dialogue(system)
    counted = [0]
    for number, message in enumerate(messages):
        index = number + offset
        expected = "user" if number % 2 == 0 else "assistant"
        if message.role != expected:
            raise RequestError(400, f"messages[{index}]: expected a {expected} message here (after an optional "
                                    f"system message, user and assistant turns alternate), got {message.role}",
                               f"messages[{index}].role")
        text, images = _render(message, index, params, counted, max_images, "protocol.max_images")
        if message.role == "assistant" and images:
            raise RequestError(400, f"messages[{index}]: an assistant message cannot hold images",
                               f"messages[{index}].content")
        dialogue.turns.append((message.role, text, images))
    if not dialogue.turns or dialogue.turns[-1][0] != "user":
        raise RequestError(400, "messages: the last message must be the user's", "messages")
    return dialogue

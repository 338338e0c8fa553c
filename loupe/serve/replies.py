"""The server's replies in OpenAI's shapes (chat.completion, chat.completion.chunk, error), with Loupe's
`loupe` extension: the search's turns, each box on the original, and on request each crop as a data URL."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from PIL import Image

from loupe.serve.scheduler import Job, Outcome, TurnRecord

LOOP_FINISH = {"answered": "stop", "format_error": "stop", "over_turn": "length", "length": "length"}
"""The OpenAI finish reason of each way a search ends; `loupe.end_reason` keeps the exact one. A search that
ran out of turns is `length`, as a reply that ran out of tokens is."""


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def turn_json(record: TurnRecord, job: Job, crops: bool, first: bool) -> dict[str, Any]:
    """One turn for the client. A crop's `region_px` is the pixels cut from its base (the original, or observation
    `base` when that is an image of its own, such as a rotated view); on the original, `box` is the same region
    as fractions of its width and height (what a page draws on the upload)."""
    out: dict[str, Any] = {"role": record.role, "text": record.text, "tokens": record.tokens}
    for key in ("action", "call", "error"):
        if getattr(record, key) is not None:
            out[key] = getattr(record, key)
    if record.crop is not None:
        crop = dict(record.crop)
        if job.original_size is not None and crop.get("base", 0) == 0:  # region_px is on the original
            width, height = job.original_size
            x0, y0, x1, y1 = crop["region_px"]
            crop["box"] = [round(x0 / width, 4), round(y0 / height, 4), round(x1 / width, 4), round(y1 / height, 4)]
        out["crop"] = crop
    if record.tool is not None:
        out["tool"] = json.loads(json.dumps(record.tool, default=str))
    if crops and record.images and not first:  # the question's own images are the client's uploads
        out["images"] = [png_data_url(image) for image in record.images]
    return out


def usage(outcome: Outcome) -> dict[str, int]:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def finish_reason(job: Job, outcome: Outcome) -> str:
    if job.zoom_loop:
        return LOOP_FINISH.get(outcome.finish, "stop")
    return "length" if outcome.finish == "length" else "stop"


def completion(job: Job, model: str, outcome: Outcome, turns: list[dict[str, Any]] | None,
               last_turn: str | None = None) -> dict[str, Any]:
    """A whole reply: the answer as the message's content; for the loop, the final turn (`last_turn`) as its
    reasoning, and the search (`turns`) when the request wants it."""
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
    body: dict[str, Any] = {
        "id": job.id, "object": "chat.completion", "created": job.created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(job, outcome), "logprobs": None}],
        "usage": usage(outcome),
    }
    if job.zoom_loop:
        message["reasoning_content"] = last_turn
        body["loupe"] = {"end_reason": outcome.finish, "turns": outcome.turns}
        if turns is not None:
            body["loupe"]["trajectory"] = turns
    return body


def chunk(job: Job, model: str, delta: dict[str, Any], finish: str | None = None,
          extension: dict[str, Any] | None = None, usage_: dict[str, int] | None = None) -> str:
    """One server-sent event of a streamed reply."""
    body: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model,
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if usage_ is not None:
        body["choices"] = []
        body["usage"] = usage_
    if extension is not None:
        body["loupe"] = extension
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

"""The `openai` engine: the rollout loop on any OpenAI-compatible chat endpoint (a vLLM server, a hosted VLM).

Dialogues are kept as chat messages with images as PNG data URLs; each round sends every live dialogue's
request through a thread pool of `concurrency` workers. Retries with exponential backoff on 429, 5xx,
time-outs and dropped connections are the `openai` client's own (`max_retries`), which also honours
`Retry-After`; once they run out the request fails with an `EndpointError` naming the endpoint and the cause.
The API key is read from the environment variable the parameters name and never logged.

Token counts come from the endpoint's `usage`; there are no token ids or log-probs, so this engine serves
synthesis and evaluation, not RL.
"""

from __future__ import annotations

import base64
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai
from PIL import Image

from loupe.config import OpenAIEndpointParams
from loupe.protocol import split_on_images
from loupe.rollout.engine import Engine, Generation


class EndpointError(RuntimeError):
    """A request that still failed after its retries."""


def image_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _content(text: str, images: list[Image.Image]) -> list[dict[str, Any]]:
    parts = []
    for part in split_on_images(text, images):
        if part["type"] == "text":
            parts.append({"type": "text", "text": part["text"]})
        else:
            parts.append({"type": "image_url", "image_url": {"url": image_data_url(part["image"])}})
    return parts


@dataclass
class _ChatState:
    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    """The endpoint's count of the dialogue's tokens after the last reply (an estimate before it)."""


@dataclass
class UsageCounter:
    """Tokens and requests spent on an endpoint, summed across threads."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion


class OpenAIEngine(Engine):
    """Generates through an OpenAI-compatible `/chat/completions` endpoint."""

    name = "openai"

    def __init__(
        self,
        endpoint: OpenAIEndpointParams,
        stop: tuple[str, ...] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ):
        self.endpoint = endpoint
        self.stop = tuple(stop)
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.batch_size = endpoint.concurrency
        self.usage = UsageCounter()
        self.client = openai.OpenAI(
            base_url=endpoint.base_url,
            api_key=os.environ.get(endpoint.api_key_env) or "EMPTY",
            timeout=endpoint.timeout_s,
            max_retries=endpoint.max_retries,
        )
        self._pool = ThreadPoolExecutor(max_workers=endpoint.concurrency, thread_name_prefix="loupe-openai")

    def begin(self, system: str, question: str, images: list[Image.Image]) -> _ChatState:
        state = _ChatState(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": _content(question, images)}]
        )
        state.tokens = (len(system) + len(question)) // 3 + 256 * len(images)
        return state

    def add_user_turn(self, state: _ChatState, text: str, images: list[Image.Image]) -> None:
        state.messages.append({"role": "user", "content": _content(text, images)})
        state.tokens += len(text) // 3 + 256 * len(images)

    def context_length(self, state: _ChatState) -> int:
        return state.tokens

    def generate(self, states: list[_ChatState], max_new_tokens: int) -> list[Generation]:
        return list(self._pool.map(lambda s: self._complete(s, max_new_tokens), states))

    def _complete(self, state: _ChatState, max_new_tokens: int) -> Generation:
        request: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": state.messages,
            "max_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop:
            request["stop"] = list(self.stop)
        if self.seed is not None:
            request["seed"] = self.seed
        try:
            response = self.client.chat.completions.create(**request)
        except openai.APIError as err:
            status = getattr(err, "status_code", None)
            cause = f"HTTP {status}" if status else type(err).__name__
            raise EndpointError(
                f"{self.endpoint.base_url}: chat completion failed after {self.endpoint.max_retries} retries ({cause})"
            ) from None
        choice = response.choices[0]
        text = choice.message.content or ""
        finish = "length" if choice.finish_reason == "length" else "eos"
        if choice.finish_reason == "stop":
            # Endpoints drop the stop string from the reply; put a tool call's closing tag back.
            for stop in self.stop:
                opener = stop.replace("</", "<", 1)
                if text.count(opener) > text.count(stop):
                    text += stop
                    finish = "stop"
                    break
        usage = response.usage
        prompt_tokens = usage.prompt_tokens if usage else state.tokens
        completion_tokens = usage.completion_tokens if usage else max(1, len(text) // 3)
        self.usage.add(prompt_tokens, completion_tokens)
        state.messages.append({"role": "assistant", "content": text})
        state.tokens = prompt_tokens + completion_tokens
        return Generation(text=text, finish=finish, num_tokens=completion_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

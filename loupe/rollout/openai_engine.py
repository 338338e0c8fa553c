"""The `openai` engine: the rollout loop on any OpenAI-compatible chat endpoint (a vLLM server, a hosted VLM).

Dialogues are kept as chat messages with images as PNG data URLs; a dialogue's next request is sent as soon
as its last turn has been handled (the rollout loop's `submit`), through a thread pool of `concurrency`
workers, so no trajectory waits for another's reply. Each request goes through `loupe.endpoint`'s one retry
loop: 408/409/429/5xx, time-outs, dropped connections and malformed HTTP 200 replies (not JSON, no choices,
wrong types, empty or null content, an unknown finish reason...) are retried with exponential backoff and
Retry-After; once the attempts run out the request fails with an `EndpointError` naming the endpoint, the
requests sent and the last cause. A malformed reply is the endpoint's fault, never the model's format error.

The API key is read at construction from the environment variable `api_key_env` names; an unset or empty
variable is an error naming it, and `api_key_env: null` sends no key (a local server started without one).
The key is never logged and is redacted from error messages.

Token counts come from the endpoint's `usage`; there are no token ids or log-probs, so this engine serves
synthesis and evaluation, not RL.

Identical requests (the K samples of a task start from the same prompt) are told apart by their occurrence
number n, counted in the order the loop hands states over; (request, n) is the key of the optional `cache` (any
object with `get(key) -> dict | None` and `put(key, dict)`, such as the synth stage's disk cache), so a
repeated run sends no request twice and K samples keep K replies. Cached replies are counted apart from paid
ones in `usage`. Only replies that passed `validate_reply` are stored, and a stored one that does not pass it
when read back (a damaged file, another shape) is discarded and asked for again, as a paid request. When one
request of a batch fails, the requests already in flight still finish and reach the cache.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import threading
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image

from loupe.config import OpenAIEndpointParams
from loupe.endpoint import (
    ChatReply,
    EndpointError,
    MalformedReply,
    RetryPolicy,
    make_client,
    redactor,
    resolve_api_key,
    send_with_retries,
    validate_reply,
)
from loupe.protocol import split_on_images
from loupe.rollout.engine import Engine, Generation

__all__ = ["EndpointError", "OpenAIEngine", "ReplyCache", "UsageCounter", "image_data_url"]

log = logging.getLogger(__name__)


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
    """Tokens and requests spent on an endpoint, summed across threads; replies served from the cache apart."""

    requests: int = 0
    """Replies received and accepted (paid for)."""
    failed_requests: int = 0
    """Requests sent that brought no usable reply (HTTP errors, time-outs, malformed replies)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_requests: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, prompt: int, completion: int, cached: bool = False) -> None:
        with self._lock:
            if cached:
                self.cached_requests += 1
                self.cached_prompt_tokens += prompt
                self.cached_completion_tokens += completion
            else:
                self.requests += 1
                self.prompt_tokens += prompt
                self.completion_tokens += completion

    def add_failed(self, count: int) -> None:
        with self._lock:
            self.failed_requests += count


class ReplyCache(Protocol):
    """Where replies are kept between runs, by request key (chat.completion objects as JSON dicts)."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def put(self, key: str, reply: dict[str, Any]) -> None: ...


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
        cache: ReplyCache | None = None,
    ):
        self.endpoint = endpoint
        self.cache = cache
        self._occurrences: Counter[str] = Counter()
        self.stop = tuple(stop)
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = 0
        """Top-k sampling, sent as `top_k` when set (RolloutParams.top_k)."""
        self.seed = seed
        self.batch_size = endpoint.concurrency
        self.usage = UsageCounter()
        api_key = resolve_api_key(endpoint.api_key_env, "rollout.openai")
        self._redact = redactor(api_key)
        self.retry = RetryPolicy(endpoint.max_retries, endpoint.backoff_s, endpoint.max_backoff_s)
        self.client = make_client(endpoint.base_url, api_key, endpoint.timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=endpoint.concurrency, thread_name_prefix="loupe-openai")
        self._waiting: deque[tuple[int, _ChatState, tuple[str, dict[str, Any]]]] = deque()
        self._in_flight: dict[Future, int] = {}
        self._ticket = 0
        self._dropped: set[int] = set()

    def reseed(self, seed: int) -> None:
        self.seed = seed

    def begin(self, system: str, question: str, images: list[Image.Image]) -> _ChatState:
        state = _ChatState(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": _content(question, images)}]
        )
        state.tokens = (len(system) + len(question)) // 3 + 256 * len(images)
        return state

    def add_user_turn(self, state: _ChatState, text: str, images: list[Image.Image]) -> None:
        state.messages.append({"role": "user", "content": _content(text, images)})
        state.tokens += len(text) // 3 + 256 * len(images)

    def add_assistant_text(self, state: _ChatState, text: str) -> None:
        state.messages.append({"role": "assistant", "content": text})
        state.tokens += len(text) // 3

    def context_length(self, state: _ChatState) -> int:
        return state.tokens

    def generate(self, states: list[_ChatState], max_new_tokens: int) -> list[Generation]:
        return self.generate_by_polling(states, max_new_tokens)

    def submit(self, state: _ChatState, max_new_tokens: int) -> int:
        # Requests are numbered here, in submission order, so a task's K identical first requests get the
        # occurrence numbers (cache keys) 0..K-1 run after run.
        self._ticket += 1
        self._waiting.append((self._ticket, state, self._request(state, max_new_tokens)))
        self._send_waiting()
        return self._ticket

    def _send_waiting(self) -> None:
        """Hand waiting requests to the pool while fewer than `concurrency` are in flight: whatever the pool
        holds is being sent, so a failure cancels nothing that is half-way."""
        while self._waiting and len(self._in_flight) < self.endpoint.concurrency:
            ticket, state, request = self._waiting.popleft()
            self._in_flight[self._pool.submit(self._complete, state, request)] = ticket

    def poll(self) -> list[tuple[int, Generation]]:
        """The requests that have come back since the last poll (at least one), in submission order."""
        if not self._in_flight:
            raise RuntimeError("openai engine: poll with no request in flight")
        done, _ = wait(list(self._in_flight), return_when=FIRST_COMPLETED)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            error = failed.exception()
            self.cancel()
            raise error
        finished = sorted((self._in_flight.pop(future), future.result()) for future in done)
        if self._dropped:
            kept = [(ticket, reply) for ticket, reply in finished if ticket not in self._dropped]
            self._dropped -= {ticket for ticket, _ in finished}
            finished = kept
        self._send_waiting()
        return finished

    def cancel(self) -> None:
        # Requests not yet sent are dropped, but those in flight finish and reach the cache first: a reply the
        # endpoint was paid for must not be asked for again by the resumed run.
        self._waiting.clear()
        wait(list(self._in_flight))
        self._in_flight.clear()

    def discard(self, tickets: set[int]) -> None:
        # Requests in flight are not recalled (HTTP has no abort); their replies are dropped when they come.
        self._waiting = deque(entry for entry in self._waiting if entry[0] not in tickets)
        self._dropped.update(tickets)

    def _request(self, state: _ChatState, max_new_tokens: int) -> tuple[str, dict[str, Any]]:
        """The request body for a state's next turn and its key: a digest of endpoint and body, then `-n`."""
        request: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": state.messages,
            "max_tokens": max_new_tokens,
            "temperature": self.temperature_for(not any(m.get("role") == "assistant" for m in state.messages)),
            "top_p": self.top_p,
        }
        if self.stop:
            request["stop"] = list(self.stop)
        if self.seed is not None:
            request["seed"] = self.seed
        extra = dict(self.endpoint.extra_body)
        if self.top_k:  # not OpenAI's parameter; vLLM's server and most open servers read it from the body
            extra["top_k"] = self.top_k
        if extra:
            request["extra_body"] = extra
        digest = hashlib.sha256(
            json.dumps([self.endpoint.base_url, request], sort_keys=True, ensure_ascii=False).encode("utf-8")
        ).hexdigest()
        n = self._occurrences[digest]
        self._occurrences[digest] += 1
        if self.seed is not None:
            # K samples of a task send identical requests; a seeded endpoint would answer all K alike.
            request["seed"] = self.seed + n
        return f"{digest}-{n}", request

    def _cached(self, key: str) -> ChatReply | None:
        """The cache's reply for `key` if it holds one that validates; a damaged entry counts as a miss."""
        entry = self.cache.get(key) if self.cache is not None else None
        if entry is None:
            return None
        try:
            return validate_reply(entry)
        except MalformedReply as err:
            log.warning("reply cache entry %s is not a valid chat completion (%s); asking the endpoint again", key, err)
            return None

    def _complete(self, state: _ChatState, keyed_request: tuple[str, dict[str, Any]]) -> Generation:
        key, request = keyed_request
        reply = self._cached(key)
        cached = reply is not None
        if reply is None:
            reply, body = self._send(request)
            if self.cache is not None:
                self.cache.put(key, body)  # validated: nothing malformed is ever stored
        text = reply.text
        finish = "length" if reply.finish_reason == "length" else "eos"
        ends = [text.find(stop) + len(stop) for stop in self.stop if stop in text]
        if ends:
            # An endpoint that ignored `stop` wrote on past it; the turn is what a stopping engine would give.
            text, finish = text[: min(ends)], "stop"
        elif reply.finish_reason == "stop":
            # Endpoints drop the stop string from the reply; put a tool call's closing tag back.
            for stop in self.stop:
                opener = stop.replace("</", "<", 1)
                if text.count(opener) > text.count(stop):
                    text += stop
                    finish = "stop"
                    break
        prompt_tokens = reply.prompt_tokens if reply.prompt_tokens is not None else state.tokens
        completion_tokens = reply.completion_tokens if reply.completion_tokens is not None else max(1, len(text) // 3)
        self.usage.add(prompt_tokens, completion_tokens, cached=cached)
        state.messages.append({"role": "assistant", "content": text})
        state.tokens = prompt_tokens + completion_tokens
        return Generation(text=text, finish=finish, num_tokens=completion_tokens)

    def _send(self, request: dict[str, Any]) -> tuple[ChatReply, dict[str, Any]]:
        """The validated reply to `request` and its JSON body, through the shared retry loop."""
        try:
            sent = send_with_retries(self.client, request, self.retry, endpoint=self.endpoint.base_url,
                                     redact=self._redact)
        except EndpointError as err:
            self.usage.add_failed(err.attempts)
            raise
        self.usage.add_failed(sent.attempts - 1)
        return sent.reply, sent.body

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

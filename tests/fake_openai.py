"""A real OpenAI-compatible HTTP server on loopback, scripted by the test that starts it.

Tests of anything that calls an OpenAI-compatible endpoint (the LLM judge, the rollout's `openai` engine, the
synth stage's teacher) talk to it through the real `openai` client over real sockets, so retries, timeouts
and headers are exercised as in production:

    def responder(request: dict) -> str:            # the request's JSON body -> the assistant's text
        return "Score: 1"

    with FakeOpenAIServer(responder, api_key="sk-test") as server:
        server.add_faults(Fault.status(429), Fault.status(500), Fault.malformed())
        client = openai.OpenAI(base_url=server.base_url, api_key="sk-test")
        ...
        assert server.count() == 4                 # three faults served, then one real answer
        server.requests[0].headers["authorization"]

Endpoints: `POST /v1/chat/completions` (also `/chat/completions`), `GET /v1/models`. Any message content
shape is accepted (strings, lists of text / image_url parts with data URLs). Like the OpenAI API and vLLM,
the reply is cut before the first of the request's `stop` strings (which is not included) with
finish_reason "stop", and cut to `max_tokens` / `max_completion_tokens` "tokens" (whitespace-separated
words here) with finish_reason "length". `n` > 1 calls the responder once per choice. `stream: true` is
answered as server-sent events (one content chunk, one finish chunk, `[DONE]`).

Faults queued with `add_faults` are served one per request, in order, before the responder answers again.
A responder may return a `Reply` to set the finish reason or token counts itself, or a `Fault` (not `slow`) to
have that one request faulted (a fault aimed at one request of a concurrent batch); if it raises, the request gets
HTTP 500 with the exception in the error message.

Malformed replies (`Fault.malformed(kind)`, one kind per way an HTTP 200 can be unusable, all listed in
MALFORMED_KINDS) are served with status 200 and never call the responder. Where the kind keeps a message, its
content is MALFORMED_TEXT, a reply every client would accept if it overlooked the fault.

Built on the standard library's `ThreadingHTTPServer` (no web framework needed for two endpoints), bound to
127.0.0.1 on a free port, serving from a daemon thread.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

IMAGE_TOKENS = 85
"""Prompt tokens counted per image part (any content part that is not text)."""


@dataclass(frozen=True)
class Reply:
    """A scripted answer with more control than a bare string."""

    text: str
    finish_reason: str | None = None
    """None: decided by stop strings and max_tokens, else "stop"."""
    completion_tokens: int | None = None


MALFORMED_TEXT = "<think>fine</think>\n<answer>A</answer> Score: 1"
"""The assistant text of malformed replies that keep one: an answer and a judge verdict a careless client takes."""

MALFORMED_KINDS = (
    "not_json",  # an HTML error page from a proxy, served as text/html
    "truncated",  # a JSON body cut off mid-way, served as application/json
    "null_body",  # the JSON value null
    "no_choices",  # a completion without `choices`
    "empty_choices",  # `choices: []`
    "choices_not_list",  # `choices` an object
    "message_not_object",  # `message` a string
    "content_number",  # `content` a number
    "empty_content",  # `content: ""`
    "null_content",  # `content: null`
    "empty_content_length",  # `content: ""` with finish_reason "length"
    "no_finish_reason",  # `finish_reason: null`
    "aborted_finish_reason",  # `finish_reason: "abort"` (vLLM: dropped midway)
    "usage_wrong_types",  # `usage.prompt_tokens` a string
    "cut_stream",  # a server-sent event stream cut before its finish chunk and `[DONE]`
)


@dataclass(frozen=True)
class Fault:
    """One injected failure, served instead of (or, for `slow`, before) a normal answer."""

    kind: str
    """`status`, `slow`, `malformed`, `disconnect` or `cut`."""
    variant: str = ""
    """Which malformed reply (one of MALFORMED_KINDS) for `malformed` faults."""
    code: int = 500
    message: str | None = None
    """Error message for `status` faults (default "injected fault: HTTP <code>")."""
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def status(cls, code: int, retry_after: float | None = None, message: str | None = None) -> Fault:
        """An OpenAI-style error body with HTTP `code` (429, 500, 503...), optionally with Retry-After."""
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        return cls("status", code=code, message=message, headers=headers)

    @classmethod
    def slow(cls, delay_s: float) -> Fault:
        """Wait `delay_s` seconds, then answer normally (a client with a shorter timeout gives up first)."""
        return cls("slow", delay_s=delay_s)

    @classmethod
    def malformed(cls, kind: str = "truncated") -> Fault:
        """HTTP 200 with a body that is not a usable chat completion, of one of MALFORMED_KINDS."""
        if kind not in MALFORMED_KINDS:
            raise ValueError(f"unknown malformed reply kind {kind!r}; known: {', '.join(MALFORMED_KINDS)}")
        return cls("malformed", code=200, variant=kind)

    @classmethod
    def disconnect(cls) -> Fault:
        """Close the connection without any response."""
        return cls("disconnect")

    @classmethod
    def cut(cls) -> Fault:
        """HTTP 200 and a Content-Length, then the connection closes halfway through the body."""
        return cls("cut", code=200)


@dataclass(frozen=True)
class RecordedRequest:
    """One request as received: method, path, headers (lower-case names), decoded JSON body (None if not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    raw_body: bytes
    received_at: float


def _count_tokens(content: Any) -> int:
    """Rough prompt size: words of text parts plus IMAGE_TOKENS per non-text part, whatever the shape."""
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        return sum(_count_tokens(part) for part in content)
    if isinstance(content, dict):
        if "text" in content and isinstance(content["text"], str):
            return len(content["text"].split())
        if "content" in content:
            return _count_tokens(content["content"])
        return IMAGE_TOKENS
    return 0


class FakeOpenAIServer:
    """An OpenAI-compatible server for tests; use as a context manager. Thread-safe request log."""

    def __init__(
        self,
        responder: Callable[[dict[str, Any]], str | Reply] = lambda request: "ok",
        *,
        api_key: str | None = None,
        models: tuple[str, ...] = ("fake-model",),
    ):
        self.responder = responder
        self.api_key = api_key
        """When set, requests must carry `Authorization: Bearer <api_key>` or get HTTP 401."""
        self.models = models
        self.honour_stop = True
        """False: reply past the request's `stop` strings, as some endpoints do."""
        self._faults: deque[Fault] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --

    def start(self) -> FakeOpenAIServer:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- scripting and inspection --

    def add_faults(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    def _next_fault(self) -> Fault | None:
        with self._lock:
            return self._faults.popleft() if self._faults else None

    @property
    def pending_faults(self) -> int:
        with self._lock:
            return len(self._faults)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every request received so far, faulted ones included, in arrival order."""
        with self._lock:
            return list(self._requests)

    def count(self, path: str = "/v1/chat/completions") -> int:
        return sum(1 for r in self.requests if r.path == path or (path.startswith("/v1") and r.path == path[3:]))

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
            self._faults.clear()

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(request)

    # -- answers --

    def completion(self, request: dict[str, Any]) -> dict[str, Any]:
        """The chat.completion object answering `request` (the responder is called once per choice)."""
        stops = request.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        choices, completion_tokens = [], 0
        for index in range(int(request.get("n") or 1)):
            reply = self.responder(request)
            if isinstance(reply, Fault):
                raise _ServeFault(reply)
            if not isinstance(reply, Reply):
                reply = Reply(str(reply))
            text, finish = reply.text, reply.finish_reason
            cut = [text.index(s) for s in stops if s and s in text and self.honour_stop]
            if cut:
                text, finish = text[: min(cut)], finish or "stop"
            words = list(re.finditer(r"\S+", text))
            if limit is not None and len(words) > int(limit):
                text, finish = text[: words[int(limit) - 1].end()] if int(limit) > 0 else "", finish or "length"
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish or "stop",
                    "logprobs": None,
                }
            )
            completion_tokens += reply.completion_tokens if reply.completion_tokens is not None else len(text.split())
        prompt_tokens = sum(_count_tokens(m) for m in request.get("messages") or [])
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model", self.models[0]),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


class _ServeFault(Exception):
    """A responder asked for its request to be faulted."""

    def __init__(self, fault: Fault):
        super().__init__(fault.kind)
        self.fault = fault


def malformed_body(kind: str, model: str = "fake-model") -> tuple[bytes, str]:
    """The body and content type of one malformed 200 reply (see MALFORMED_KINDS)."""
    if kind == "not_json":
        return b"<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"
    if kind == "truncated":
        return b'{"id": "chatcmpl-broken", "choices": [', "application/json"
    if kind == "null_body":
        return b"null", "application/json"
    message: dict[str, Any] = {"role": "assistant", "content": MALFORMED_TEXT}
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
    completion: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    if kind == "cut_stream":
        base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        first = base | {"choices": [{"index": 0, "delta": message, "finish_reason": None}]}
        return f"data: {json.dumps(first)}\n\n".encode(), "text/event-stream"
    if kind == "no_choices":
        del completion["choices"]
    elif kind == "empty_choices":
        completion["choices"] = []
    elif kind == "choices_not_list":
        completion["choices"] = {"0": choice}
    elif kind == "message_not_object":
        choice["message"] = MALFORMED_TEXT
    elif kind == "content_number":
        message["content"] = 1
    elif kind in ("empty_content", "empty_content_length"):
        message["content"] = ""
        choice["finish_reason"] = "length" if kind == "empty_content_length" else "stop"
    elif kind == "null_content":
        message["content"] = None
    elif kind == "no_finish_reason":
        choice["finish_reason"] = None
    elif kind == "aborted_finish_reason":
        choice["finish_reason"] = "abort"
    elif kind == "usage_wrong_types":
        completion["usage"]["prompt_tokens"] = "ten"
    else:
        raise ValueError(f"unknown malformed reply kind {kind!r}")
    return json.dumps(completion).encode("utf-8"), "application/json"


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAIServer  # set on the per-server subclass
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client (httpx) expects
    timeout = 30  # an idle kept-alive connection ends instead of holding a thread forever

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read the request log instead

    def _send(
        self, status: int, body: bytes, content_type: str = "application/json", headers: dict[str, str] | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (timed out) before the answer came

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode("utf-8"), headers=headers)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found", 429: "rate_limit_exceeded"}
        error = {"message": message, "type": kind.get(status, "server_error"), "param": None, "code": status}
        self._send_json(status, {"error": error}, headers)

    def _read(self) -> RecordedRequest:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        request = RecordedRequest(
            self.command,
            self.path.split("?")[0],
            {k.lower(): v for k, v in self.headers.items()},
            body,
            raw,
            time.time(),
        )
        self.fake._record(request)
        return request

    def _authorised(self, request: RecordedRequest) -> bool:
        if self.fake.api_key is None or request.headers.get("authorization") == f"Bearer {self.fake.api_key}":
            return True
        self._error(401, "Incorrect API key provided.")
        return False

    def do_GET(self) -> None:
        request = self._read()
        if not self._authorised(request):
            return
        if request.path in ("/v1/models", "/models"):
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.fake.models]
            self._send_json(200, {"object": "list", "data": data})
        else:
            self._error(404, f"no route GET {request.path}")

    def do_POST(self) -> None:
        request = self._read()
        if request.path not in ("/v1/chat/completions", "/chat/completions"):
            self._error(404, f"no route POST {request.path}")
            return
        if not self._authorised(request):
            return
        fault = self.fake._next_fault()
        if fault is not None and self._serve_fault(fault):
            return
        if not isinstance(request.body, dict) or not isinstance(request.body.get("messages"), list):
            self._error(400, "the body must be a JSON object with a 'messages' list")
            return
        try:
            completion = self.fake.completion(request.body)
        except _ServeFault as chosen:
            if chosen.fault.kind == "slow":
                self._error(500, "a responder cannot return a slow fault; queue it with add_faults")
            else:
                self._serve_fault(chosen.fault)
            return
        except Exception as err:  # noqa: BLE001 - a responder bug shows up in the client's error, not as a hang
            self._error(500, f"responder raised {type(err).__name__}: {err}")
            return
        if request.body.get("stream"):
            self._stream(completion)
        else:
            self._send_json(200, completion)

    def _serve_fault(self, fault: Fault) -> bool:
        """Serve `fault`; True when that was the whole answer, False when a normal answer must follow (slow)."""
        if fault.kind == "status":
            self._error(fault.code, fault.message or f"injected fault: HTTP {fault.code}", fault.headers)
            return True
        if fault.kind == "malformed":
            body, content_type = malformed_body(fault.variant or "truncated", self.fake.models[0])
            self._send(200, body, content_type=content_type, headers=fault.headers)
            return True
        if fault.kind == "disconnect":
            self.close_connection = True
            return True
        if fault.kind == "cut":
            body, _ = malformed_body("no_finish_reason", self.fake.models[0])
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return True
        if fault.kind == "slow":
            time.sleep(fault.delay_s)
            return False
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    def _stream(self, completion: dict[str, Any]) -> None:
        events = []
        base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        for choice in completion["choices"]:
            delta = {"role": "assistant", "content": choice["message"]["content"]}
            events.append(base | {"choices": [{"index": choice["index"], "delta": delta, "finish_reason": None}]})
            events.append(
                base | {"choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]}
            )
        events.append(base | {"choices": [], "usage": completion["usage"]})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, body.encode("utf-8"), content_type="text/event-stream")

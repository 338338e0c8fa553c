"""The HTTP side of `loupe serve`: FastAPI routes in OpenAI's shapes over the engine's scheduler.

- `POST /v1/chat/completions`: the zoom loop server-side (or one turn, `loupe.loop: false`), whole or streamed
  turn by turn as server-sent events (`stream: true`), in OpenAI's chat.completion(.chunk) shapes, so the
  `openai` client works unchanged; the search rides along in the `loupe` extension field.
- `GET /v1/models`, `GET /health` (no key needed: a load balancer's probe), and the page at `/`.

Refusals are OpenAI's error object with a 4xx status naming the field: malformed JSON, unknown fields, no image,
a non-image, a truncated image, a pixel bomb (413), too many images, a body past `serve.max_request_bytes` (413,
counted as it arrives, so a huge body is never held whole), a full queue (503 with Retry-After), a wrong or
missing key (401). None of them reaches the engine, which goes on serving. A client that disconnects, streaming
or not, has its request dropped from the engine's batch (`Scheduler.cancel`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from loupe.serve.params import ServeParams
from loupe.serve.replies import chunk, completion, error_body, finish_reason, turn_json, usage
from loupe.serve.requests import ChatRequest, RequestError, read_dialogue, read_question
from loupe.serve.scheduler import Job, Outcome, QueueFull, Scheduler

PAGE = Path(__file__).with_name("page.html")
DISCONNECT_CHECK_S = 0.5
"""How often a request that is not streamed looks whether its client is still there."""


class BodyLimit:
    """ASGI middleware: a request whose Content-Length passes `limit` bytes is answered 413 before its body is
    read. A body sent without one is counted as it arrives by the handler (`read_body`)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        declared = dict(scope.get("headers") or []).get(b"content-length") if scope["type"] == "http" else None
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            body = json.dumps(error_body(too_large(self.limit), code="request_too_large")).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def too_large(limit: int) -> str:
    return f"the request body is larger than serve.max_request_bytes ({limit})"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit`, so a huge one is never held whole."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise RequestError(413, too_large(limit), code="request_too_large")
    return bytes(body)


def _error(err: RequestError) -> dict[str, Any]:
    """OpenAI's error object for a refusal: the client's fault below 500, the server's from it."""
    return error_body(err.message, "invalid_request_error" if err.status < 500 else "server_error", err.param,
                      err.code)


def _refusal(err: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(_error(err), status_code=err.status, headers=headers)


def _validation_message(err: ValidationError) -> tuple[str, str | None]:
    """The first problems of a body that does not fit the schema, each with its field's path."""
    problems, first = [], None
    for problem in err.errors()[:5]:
        where = ".".join(str(part) for part in problem["loc"])
        first = first or where or None
        if problem["type"] == "json_invalid":
            return f"the body is not valid JSON ({problem['msg']})", None
        if problem["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown field")
        else:
            problems.append(f"{where or 'body'}: {problem['msg']}")
    return "; ".join(problems), first


def create_app(scheduler: Scheduler, params: ServeParams, model: str, api_key: str | None) -> FastAPI:
    """The server's ASGI app over a started scheduler (`loupe.serve.main` builds both)."""
    app = FastAPI(title="loupe serve", docs_url=None, redoc_url=None, openapi_url=None)
    page = PAGE.read_text(encoding="utf-8")

    def authorized(request: Request) -> bool:
        if not api_key:
            return True
        sent = request.headers.get("authorization", "")
        return sent.startswith("Bearer ") and hmac.compare_digest(sent[7:].encode(), api_key.encode())

    def unauthorized() -> JSONResponse:
        # Checked in each /v1 route, not in an `@app.middleware("http")`: Starlette's BaseHTTPMiddleware wraps
        # `receive`, and a request behind it no longer sees its client disconnect (`is_disconnected`).
        return JSONResponse(error_body("a valid API key is needed: Authorization: Bearer <key>",
                                       "authentication_error", code="invalid_api_key"), status_code=401)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/health")
    async def health() -> Any:
        if not scheduler.alive:
            return JSONResponse({"status": "failed", "model": model, "error": scheduler.failure or "stopped"},
                                status_code=503)
        return {"status": "ok", "model": model, "needs_key": bool(api_key), **scheduler.load()}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if not authorized(request):
            return unauthorized()
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "loupe"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        if not authorized(request):
            return unauthorized()
        try:
            job, body = await _read(request)
        except RequestError as err:
            return _refusal(err)
        try:
            scheduler.submit(job)
        except QueueFull as err:
            return _refusal(RequestError(503, f"the server is full: {err}; retry shortly", code="server_busy"))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(job, body, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, job, body)

    async def _read(request: Request) -> tuple[Job, ChatRequest]:
        # JSON only: a browser's form post from another site (text/plain, no CORS preflight) cannot start work
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise RequestError(415, f"the body must be JSON (Content-Type: application/json), got {kind or 'none'}",
                               code="unsupported_media_type")
        raw = await read_body(request, params.max_request_bytes)
        try:
            body = ChatRequest.model_validate_json(raw)
        except ValidationError as err:
            message, param = _validation_message(err)
            raise RequestError(400, message, param) from None
        if body.model is not None and body.model != model:
            raise RequestError(404, f"model {body.model!r} is not served here; this server serves {model!r}",
                               "model", code="model_not_found")
        served_top_k = getattr(scheduler.engine, "top_k", 0) or 0
        for name, served, setting in (("temperature", params.temperature, "serve.temperature"),
                                      ("top_p", params.top_p, "serve.top_p"), ("top_k", served_top_k, "rollout.top_k")):
            asked = getattr(body, name)
            if asked is not None and abs(asked - served) > 1e-9:
                raise RequestError(400, f"{name} {asked} differs from the server's {served}: requests share one "
                                        f"batch, so it is set for the server ({setting})", name)
        if not scheduler.alive:
            raise RequestError(503, f"the engine has stopped ({scheduler.failure}); restart the server",
                               code="engine_stopped")
        if not scheduler.has_room():  # before decoding: a full server spends nothing on what it will refuse
            raise RequestError(503, f"the server is full: {scheduler.describe_load()}; retry shortly",
                               code="server_busy")
        asked_stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        extra = sorted(set(asked_stops) - set(scheduler.rollout.protocol.stop_strings()))
        if extra:
            raise RequestError(400, f"stop: {extra} are not the protocol's stop strings; the server stops at "
                                    f"{list(scheduler.rollout.protocol.stop_strings())} only", "stop")
        budget = min(scheduler.max_new_tokens, body.max_completion_tokens or body.max_tokens or scheduler.max_new_tokens)
        if body.loupe.loop:
            work: Any = await run_in_threadpool(read_question, body, params)
        else:
            if body.loupe.options is not None:
                raise RequestError(400, "loupe.options: only the zoom loop formats options (loupe.loop: true)",
                                   "loupe.options")
            work = await run_in_threadpool(read_dialogue, body, params, scheduler.rollout.protocol.system_prompt(),
                                           scheduler.protocol.max_images)
        return Job(work, budget, body.loupe.options), body

    async def _whole(request: Request, job: Job, body: ChatRequest) -> Any:
        turns: list[dict[str, Any]] = []
        last_turn: str | None = None
        seen = 0
        while True:
            try:
                kind, data = await asyncio.wait_for(job.events.get(), DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job)
                    return JSONResponse(error_body("client went away"), status_code=499)
                continue
            if kind == "turns":
                for record in data:
                    if record.role == "assistant":
                        last_turn = record.text
                    if body.loupe.trajectory:
                        turns.append(turn_json(record, job, body.loupe.crops, first=seen == 0))
                    seen += 1
            elif kind == "error":
                return _refusal(data)
            else:
                wanted = turns if body.loupe.trajectory and job.zoom_loop else None
                return JSONResponse(completion(job, model, data, wanted, last_turn))

    async def _stream(job: Job, body: ChatRequest, include_usage: bool) -> AsyncIterator[str]:
        sent_turns = 0
        try:
            yield chunk(job, model, {"role": "assistant", "content": ""})
            while True:
                kind, data = await job.events.get()
                if kind == "turns":
                    for record in data:
                        extension = None
                        if body.loupe.trajectory:
                            extension = {"turn": turn_json(record, job, body.loupe.crops, first=sent_turns == 0),
                                         "original_size": job.original_size}
                        sent_turns += 1
                        if record.role == "assistant" or extension is not None:
                            delta = {"reasoning_content": record.text} if record.role == "assistant" else {}
                            yield chunk(job, model, delta, extension=extension)
                elif kind == "error":
                    yield f"data: {json.dumps(_error(data))}\n\n"
                    break
                else:
                    outcome: Outcome = data
                    yield chunk(job, model, {"content": outcome.text})
                    extension = {"end_reason": outcome.finish, "turns": outcome.turns} if job.zoom_loop else None
                    yield chunk(job, model, {}, finish_reason(job, outcome), extension=extension)
                    if include_usage:
                        yield chunk(job, model, {}, usage_=usage(outcome))
                    break
            yield "data: [DONE]\n\n"
        finally:
            # A client that went away mid-stream ends here too (the generator is closed): its slot is freed.
            scheduler.cancel(job)

    return app

"""One chat completion from an OpenAI-compatible endpoint, checked and retried; shared by the `openai` rollout
engine (and the synth teacher built on it) and the LLM judge.

Why the `openai` client's own parsing and retries are not enough (openai-python `_response.py`,
`BaseAPIResponse._parse`, and `_base_client.py`, `_process_response_data`, with `_strict_response_validation`
off, its default):
- an HTTP 200 body that is not JSON raises a bare `json.JSONDecodeError` when its content type says JSON, and
  comes back as a `str` when it does not; a JSON `null` comes back as None;
- any other JSON is built with `construct_type` (no validation), so a missing `choices`, a string where the
  message object belongs or a number for `content` surface later as AttributeError or TypeError, far from the
  request and outside any retry;
- its retry loop looks at HTTP statuses and connection errors only, so a malformed 200 would need a second
  loop around it, and two nested loops multiply the attempts a message would have to report.

So the client is built with `max_retries=0`, the raw body is read (`with_raw_response`) and checked by
`validate_reply`, and `send_with_retries` is the one retry loop:
- retried, one attempt each: HTTP 408, 409, 429 and 5xx; time-outs and dropped connections; every malformed 200
  (`MalformedReply`: not JSON, truncated, no or empty `choices`, wrong types, empty or null content, a missing
  or empty `finish_reason` or vLLM's "abort", an event stream we did not ask for), and whatever the caller's
  `check` refuses;
- not retried: other 4xx (a wrong key, model or request does not fix itself);
- wait before retry n (0-based): `backoff_s * 2**n` with +-50% jitter, at most `max_backoff_s`, but never
  less than the server's Retry-After (itself capped at two minutes);
- when the attempts run out, `EndpointError` says "failed after N attempts", N being the requests sent.

Empty or null content is a fault whatever the finish reason, `length` included: an endpoint that dropped the
text cannot be told from a model that wrote nothing (a reasoning parser that moved every token into
`reasoning_content`, a `max_tokens` too small to hold one token of content), and neither is a turn worth
training on or scoring. A model that really emits nothing even when asked again ends the run with an
`EndpointError` that names the finish reason, rather than passing for a format error of the model.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

KEYLESS = "EMPTY"
"""Sent as the key to a server that needs none (vLLM's own examples use it); the client refuses an empty key."""

FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
"""The reasons the OpenAI API defines. Other servers send their own for the end of a sequence ("eos" on Together,
"eos_token" on older TGI, "stop_sequence"), so any other non-empty reason is accepted and read as "the turn
ended"; only a missing or empty one, or vLLM's "abort", is a fault."""
"""The finish reasons of the chat completion API (openai-python `types/chat/chat_completion.py`, `Choice`);
any other (vLLM's `abort`, a proxy's own word) or none means the reply did not finish normally."""

RETRYABLE_STATUS = frozenset({408, 409, 429})
"""HTTP statuses below 500 worth another attempt, as the openai client's `_should_retry` has them."""

CLIENT_BACKOFF_S, CLIENT_MAX_BACKOFF_S = 0.5, 8.0
"""The openai client's own waits between its retries (openai-python `_constants.py`, INITIAL_RETRY_DELAY and
MAX_RETRY_DELAY), for `RetryPolicy.transport_retries`."""

_MAX_RETRY_AFTER_S = 120.0
"""A server's Retry-After above this is ignored (the openai client's MAX_RETRY_AFTER_DELAY)."""


class EndpointError(RuntimeError):
    """A chat completion that still failed after its attempts; the message names the endpoint, the count of
    requests sent and the last cause (with the API key redacted)."""

    def __init__(self, message: str, attempts: int = 0, cause: str = ""):
        super().__init__(message)
        self.attempts = attempts
        self.cause = cause


class EndpointFault(Exception):
    """One attempt's failure that another attempt may not have; consumes one retry."""


class MalformedReply(EndpointFault):
    """An HTTP 200 reply (or a cached one) that is not a usable chat completion; the message says why."""


@dataclass(frozen=True)
class RetryPolicy:
    """How many times and how patiently a request is retried."""

    max_retries: int
    """Retries after the first attempt."""
    backoff_s: float
    """First wait; each later one doubles, with +-50% jitter."""
    max_backoff_s: float
    """Cap on one exponential wait; a server's Retry-After (at most two minutes) is obeyed even when longer."""
    transport_retries: int = 0
    """HTTP failures (408, 409, 429, 5xx, time-outs, dropped connections) asked again this many times within one
    attempt, at the same request, before they count as the attempt's failure: the openai client's own loop
    inside each attempt of a caller that keeps it (its default 2; Mini-o3's and DeepEyes' judges)."""
    rate_limit_wait_s: float | None = None
    """After a 429 that outlasted `transport_retries`: wait this long and ask again without counting an attempt,
    as often as it takes (Mini-o3's judge: 3 s, general_qa_tool.py:86-89); None counts it like any failure. A 429
    that says `insufficient_quota` (OpenAI's: the account is out of credit) never clears, so it counts."""

    def delay(self, retry: int, retry_after: float = 0.0) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        exponential = self.backoff_s * 2**retry * random.uniform(0.5, 1.5)
        # A server that says how long to wait is obeyed (retry_after_seconds caps it at two minutes): waiting
        # less only spends the retries on more 429s.
        return max(retry_after, min(self.max_backoff_s, exponential))


@dataclass(frozen=True)
class ChatReply:
    """The parts of a validated chat completion that Loupe reads (the first choice only; it asks for one)."""

    text: str
    """The assistant's content: a non-empty string."""
    finish_reason: str
    """The endpoint's reason, a non-empty string (FINISH_REASONS, or a server's own word for end of sequence)."""
    prompt_tokens: int | None
    """From `usage`, None when the endpoint sent none."""
    completion_tokens: int | None


class Sent(NamedTuple):
    reply: ChatReply
    body: dict[str, Any]
    """The reply's JSON object as received: what a cache may keep (it passed `validate_reply`)."""
    attempts: int
    """Requests sent, the successful one included."""


def _preview(value: Any, limit: int = 80) -> str:
    """A value quoted for a message, cut to `limit` characters."""
    text = repr(value)
    return text[:limit] + ("..." if len(text) > limit else "")


def _json_kind(value: Any) -> str:
    """A decoded JSON value's type in JSON's words."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _token_count(usage: Mapping[str, Any], name: str) -> int:
    value = usage.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MalformedReply(f"usage.{name} is {_preview(value)}, not a count of tokens")
    return value


def validate_reply(body: Any) -> ChatReply:
    """Check a chat completion (a decoded JSON body, received or cached) and return what Loupe reads of it.

    Hand-written rather than `ChatCompletion.model_validate`: that model also requires fields Loupe never reads
    (`id`, `created`, `object`), which some compatible servers leave out, while it accepts an empty `choices`
    list, empty or null content and a missing usage count; the checks here are exactly the ones Loupe needs.
    Raises `MalformedReply` saying what is wrong.
    """
    if not isinstance(body, dict):
        raise MalformedReply(f"the reply is {_json_kind(body)}, not an object")
    choices = body.get("choices")
    if choices is None:
        raise MalformedReply("the reply has no 'choices'")
    if not isinstance(choices, list):
        raise MalformedReply(f"'choices' is {_json_kind(choices)}, not a list")
    if not choices:
        raise MalformedReply("'choices' is empty")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedReply(f"choices.0 is {_json_kind(choice)}, not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise MalformedReply(f"choices.0.message is {_json_kind(message)}, not an object")
    finish = choice.get("finish_reason")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise MalformedReply(f"choices.0.message.content is {_json_kind(content)}, not a string")
    if not content:
        raise MalformedReply(f"choices.0.message.content is {'null' if content is None else 'empty'} "
                             f"(finish_reason {finish!r})")
    if not isinstance(finish, str) or not finish.strip():
        raise MalformedReply(f"choices.0.finish_reason is {_preview(finish)}, not a reason")
    if finish == "abort":  # vLLM's request aborted server-side: the text is cut, not finished
        raise MalformedReply("choices.0.finish_reason is 'abort': the server dropped the request midway")
    usage = body.get("usage")
    if usage is None:
        return ChatReply(content, finish, None, None)
    if not isinstance(usage, dict):
        raise MalformedReply(f"'usage' is {_json_kind(usage)}, not an object")
    return ChatReply(content, finish, _token_count(usage, "prompt_tokens"), _token_count(usage, "completion_tokens"))


def decode_body(raw: bytes, content_type: str = "", redact: Callable[[str], str] = lambda text: text) -> Any:
    """The JSON value of a reply body; `MalformedReply` for anything else (an HTML error page, a body cut off,
    a server-sent event stream, nesting deep enough to exhaust the parser). The start of a body that is not
    JSON is quoted in the message after `redact` (a proxy's error page may echo the request's headers)."""
    if content_type.split(";")[0].strip().lower() == "text/event-stream" or raw.lstrip().startswith(b"data:"):
        raise MalformedReply("the reply is an event stream, though none was asked for")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise MalformedReply("the reply body is not UTF-8 text") from None
    except RecursionError:
        raise MalformedReply("the reply body nests too deeply to parse") from None
    except ValueError as err:
        raise MalformedReply(f"the reply body is not JSON ({err.msg} at character {err.pos}): "
                             f"{_preview(redact(raw.decode('utf-8', 'replace')))}") from None


def retry_after_seconds(headers: Mapping[str, str]) -> float:
    """The wait a 429/503 asks for: `retry-after-ms`, `retry-after` in seconds or as an HTTP date; 0 when
    absent, unreadable, negative or beyond two minutes (as the openai client's `_parse_retry_after_header`)."""
    seconds: float | None = None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
            break
        except ValueError:
            if name == "retry-after":
                try:
                    seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
                except (TypeError, ValueError, IndexError, OverflowError):
                    seconds = None
    if seconds is None or not 0 < seconds <= _MAX_RETRY_AFTER_S:  # NaN fails the comparison too
        return 0.0
    return seconds


def resolve_api_key(api_key_env: str | None, where: str) -> str:
    """The API key from the variable `api_key_env` names; `KEYLESS` when it is None (a server that needs no
    key, such as a local vLLM started without `--api-key`). A named variable that is unset or empty is an
    error naming it: sending a placeholder to a server that wants a key only fails later, with a 401."""
    import os

    if api_key_env is None:
        return KEYLESS
    key = os.environ.get(api_key_env, "")
    if not key:
        raise ValueError(
            f"{where}: api_key_env names the environment variable {api_key_env}, which is not set or empty; "
            f"export the API key in it, or set api_key_env to null for a server that needs no key"
        )
    return key


def make_client(base_url: str, api_key: str, timeout_s: float) -> Any:
    """An `openai.OpenAI` client with its own retries off: `send_with_retries` is the only retry loop."""
    import openai  # imported here: processes that never call an endpoint need not pay for it

    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)


def redactor(api_key: str) -> Callable[[str], str]:
    """A function that blanks the key out of a text (servers and proxies sometimes echo it in errors)."""

    def redact(text: str) -> str:
        return text.replace(api_key, "[redacted]") if api_key and api_key != KEYLESS else text

    return redact


def send_with_retries(
    client: Any,
    request: dict[str, Any],
    policy: RetryPolicy,
    *,
    endpoint: str,
    redact: Callable[[str], str] = lambda text: text,
    check: Callable[[ChatReply], None] | None = None,
    on_attempt: Callable[[], None] | None = None,
    vary: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None,
) -> Sent:
    """Send `request` to `/chat/completions` until a reply validates (and passes `check`, which raises
    `EndpointFault` to refuse one) or the attempts run out; see the module docstring for the policy.

    `endpoint` names the server in messages; `on_attempt` is called before each request is sent; `vary(retry,
    request)`, when given, is the request of each attempt (0 the first: a judge that raises its temperature). Raises
    `EndpointError` carrying the number of requests sent and the last cause.
    """
    import openai

    attempts, cause, retry, transport, rate_limited = 0, "no attempt made", 0, 0, 0
    while True:
        attempts += 1
        if on_attempt is not None:
            on_attempt()
        retry_after, status = 0.0, None
        try:
            sent = vary(retry, request) if vary is not None else request
            raw = client.chat.completions.with_raw_response.create(**sent)
            http = raw.http_response
            body = decode_body(http.content, http.headers.get("content-type", ""), redact)
            reply = validate_reply(body)
            if check is not None:
                check(reply)
            return Sent(reply, body, attempts)
        except openai.APIStatusError as err:
            cause = f"HTTP {err.status_code}: {_preview(redact(str(err.message)), 200)}"
            if err.status_code < 500 and err.status_code not in RETRYABLE_STATUS:
                break
            retry_after, status = retry_after_seconds(err.response.headers), err.status_code
        except openai.APIConnectionError as err:  # time-outs are connection errors too
            cause, status = redact(f"{type(err).__name__}: {err}"), 0
        except EndpointFault as err:
            cause = redact(f"{'malformed reply' if isinstance(err, MalformedReply) else 'refused reply'}: {err}")
        if status is not None and transport < policy.transport_retries:
            transport += 1  # the client's own loop: the same attempt asked again
            time.sleep(max(retry_after, min(CLIENT_MAX_BACKOFF_S, CLIENT_BACKOFF_S * 2 ** (transport - 1))))
            continue
        transport = 0
        if status == 429 and policy.rate_limit_wait_s is not None and "insufficient_quota" not in cause:
            rate_limited += 1
            if rate_limited == 1 or rate_limited % 20 == 0:
                log.warning("%s: rate limited (%d times so far); asking again in %.1fs, not counted as an attempt",
                            endpoint, rate_limited, policy.rate_limit_wait_s)
            time.sleep(policy.rate_limit_wait_s)
            continue
        if retry >= policy.max_retries:
            break
        delay = policy.delay(retry, retry_after)
        # counted in tries of the policy (each may hold transport retries); the final error counts requests sent
        log.warning("%s: try %d/%d failed (%s); retrying in %.2fs",
                    endpoint, retry + 1, policy.max_retries + 1, cause, delay)
        time.sleep(delay)
        retry += 1
    plural = "s" if attempts != 1 else ""
    raise EndpointError(f"{endpoint}: chat completion failed after {attempts} attempt{plural} ({cause})",
                        attempts, cause)

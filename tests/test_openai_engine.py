"""The openai engine against a real OpenAI-compatible server on loopback: the loop, data URLs, retries, errors,
every kind of malformed HTTP 200 reply, the reply cache and the API-key rule."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fake_openai import MALFORMED_KINDS, MALFORMED_TEXT, FakeOpenAIServer, Fault
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import ValidationError

from loupe.config import OpenAIEndpointParams, ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.endpoint import (
    MalformedReply,
    RetryPolicy,
    decode_body,
    retry_after_seconds,
    validate_reply,
)
from loupe.rollout.loop import run_rollouts
from loupe.rollout.openai_engine import EndpointError, OpenAIEngine

PROTOCOL = ProtocolParams(min_pixels=3136, max_pixels=50176)


def searcher(request: dict) -> str:
    """Zooms once, then answers 'B' once it has seen an observation."""
    user_turns = [m for m in request["messages"] if m["role"] == "user"]
    if len(user_turns) == 1:
        call = {"bbox_2d": [0.4, 0.4, 0.7, 0.7], "source": "original_image"}
        return f"<think>zoom</think>\n<grounding>{json.dumps(call)}</grounding> trailing words the stop cuts"
    return "<think>red it is</think>\n<answer>B</answer>"


@pytest.fixture()
def task_dir(tmp_path: Path) -> Path:
    image = Image.new("RGB", (1200, 900), (240, 240, 240))
    image.paste((255, 0, 0), (600, 450, 660, 510))
    image.save(tmp_path / "scene.png")
    return tmp_path


def tasks(n: int) -> list[TaskRecord]:
    return [
        TaskRecord(doc_id=f"q{i}", images=["scene.png"], problem="Colour?", solution="B", options=["blue", "red"])
        for i in range(n)
    ]


FAST = {"backoff_s": 0.001, "max_backoff_s": 0.01}
"""Waits between attempts kept tiny: the tests count attempts, not seconds."""


def make_engine(server: FakeOpenAIServer, cache=None, **kw) -> OpenAIEngine:
    endpoint = OpenAIEndpointParams(base_url=server.base_url, model="fake", api_key_env="LOUPE_TEST_KEY",
                                    **{**FAST, **kw})
    return OpenAIEngine(endpoint, stop=("</grounding>",), temperature=0.0, seed=1, cache=cache)


def test_loop_over_an_http_endpoint_sends_images_and_restores_the_stop_string(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "sk-secret-123")
    with FakeOpenAIServer(searcher, api_key="sk-secret-123") as server:
        engine = make_engine(server, concurrency=4)
        trajectories = run_rollouts(tasks(3), engine, PROTOCOL, task_dir)
        requests = [r for r in server.requests if r.path.endswith("/chat/completions")]
    assert [t.end_reason for t in trajectories] == ["answered"] * 3
    assert all(t.answer == "B" and t.num_tool_calls == 1 for t in trajectories)
    assert trajectories[0].turns[1].text.endswith("</grounding>")  # put back after the endpoint dropped it
    assert len(requests) == 6 and engine.usage.requests == 6
    second = requests[1].body if requests[1].body["messages"][-1]["role"] == "user" else requests[3].body
    images = [p for m in second["messages"] for p in (m["content"] if isinstance(m["content"], list) else [])
              if p.get("type") == "image_url"]
    assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in images) and len(images) >= 1
    assert requests[0].body["stop"] == ["</grounding>"] and requests[0].body["seed"] >= 1
    assert requests[0].headers["authorization"] == "Bearer sk-secret-123"


def test_an_endpoint_that_ignores_stop_gives_the_turn_a_stopping_engine_would(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "sk-secret-123")
    with FakeOpenAIServer(searcher) as server:
        server.honour_stop = False
        engine = make_engine(server)
        [trajectory] = run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        second_request = server.requests[-1].body
    assert trajectory.end_reason == "answered" and trajectory.num_tool_calls == 1
    assert trajectory.turns[1].text.endswith("</grounding>") and "trailing words" not in trajectory.turns[1].text
    assert second_request["messages"][2] == {"role": "assistant", "content": trajectory.turns[1].text}


def test_retries_through_429_and_500_lose_nothing_and_count_nothing_twice(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(Fault.status(429, retry_after=0.01), Fault.status(500), Fault.status(503))
        engine = make_engine(server, concurrency=1, max_retries=4)
        [t] = run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        served = server.count()
    assert t.end_reason == "answered" and t.answer == "B"
    assert served == 5  # three faults, then the two real turns
    assert engine.usage.requests == 2  # only successful replies are counted


def test_a_body_cut_off_by_a_closed_connection_is_retried(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(Fault.cut(), Fault.disconnect())
        engine = make_engine(server, concurrency=1, max_retries=2)
        [t] = run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        assert server.count() == 4
    assert (t.end_reason, t.num_format_errors) == ("answered", 0)
    assert (engine.usage.requests, engine.usage.failed_requests) == (2, 2)


def test_slow_reply_times_out_and_is_retried(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(Fault.slow(2.0))
        engine = make_engine(server, concurrency=1, max_retries=2, timeout_s=0.5)
        [t] = run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
    assert t.end_reason == "answered"


def test_exhausted_retries_fail_with_a_clear_error_that_hides_the_key(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "sk-never-show-me")
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(*[Fault.status(500)] * 5)
        engine = make_engine(server, concurrency=1, max_retries=1)
        base_url = server.base_url
        with pytest.raises(EndpointError) as caught:
            run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        sent = server.count()
    message = str(caught.value)
    assert sent == 2 and f"failed after {sent} attempts" in message  # the count is the requests sent
    assert base_url in message and "HTTP 500" in message
    assert "sk-never-show-me" not in message
    assert (engine.usage.requests, engine.usage.failed_requests) == (0, 2)


def test_a_400_is_not_retried(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(Fault.status(400, message="bad request"))
        with pytest.raises(EndpointError, match=r"after 1 attempt \(HTTP 400"):
            run_rollouts(tasks(1), make_engine(server, concurrency=1, max_retries=3), PROTOCOL, task_dir)
        assert server.count() == 1


def test_length_finish_is_reported(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(lambda request: "word " * 500) as server:
        [t] = run_rollouts(tasks(1), make_engine(server), PROTOCOL, task_dir, max_new_tokens=8)
    assert t.end_reason == "length" and t.generated_tokens == 8


def test_identical_requests_of_k_samples_carry_different_seeds(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(searcher) as server:
        run_rollouts(tasks(1), make_engine(server), PROTOCOL, task_dir, samples_per_task=3)
        first_turn_seeds = sorted(r.body["seed"] for r in server.requests if len(r.body["messages"]) == 2)
    assert first_turn_seeds == [1, 2, 3]


class DictCache:
    def __init__(self):
        self.replies: dict[str, dict] = {}

    def get(self, key: str) -> dict | None:
        return self.replies.get(key)

    def put(self, key: str, reply: dict) -> None:
        self.replies[key] = reply


def test_a_failed_request_lets_its_batch_finish_so_every_paid_reply_is_cached(task_dir, monkeypatch):
    """One request of a batch fails at once while another is still being answered: the answer still lands
    in the cache before the error ends the run, so a rerun does not pay for it again."""

    def responder(request: dict) -> str:
        question = json.dumps(request["messages"][1]["content"])
        if "fail" in question:
            raise RuntimeError("boom")
        time.sleep(1.0)  # still in flight when the failure is raised
        return "<think>done</think>\n<answer>B</answer>"

    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    # The failing request comes first, so its error is seen while the other is still in flight.
    records = [TaskRecord(doc_id="bad", images=["scene.png"], problem="fail", solution="B", options=["a", "b"]),
               TaskRecord(doc_id="slow", images=["scene.png"], problem="Colour?", solution="B", options=["a", "b"])]
    with FakeOpenAIServer(responder) as server:
        endpoint = OpenAIEndpointParams(base_url=server.base_url, model="fake", api_key_env="LOUPE_TEST_KEY",
                                        concurrency=2, max_retries=0)
        cache = DictCache()
        engine = OpenAIEngine(endpoint, stop=("</grounding>",), temperature=0.0, seed=1, cache=cache)
        with pytest.raises(EndpointError):
            run_rollouts(records, engine, PROTOCOL, task_dir)
        engine.close()
        answered = server.count()
    assert answered == 2
    [reply] = cache.replies.values()
    assert "<answer>B</answer>" in reply["choices"][0]["message"]["content"]


def test_a_dead_endpoint_fails_the_batch_without_sending_the_queued_requests(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")

    def dead(request: dict) -> str:
        time.sleep(0.3)  # slow enough that the batch's cancel comes before a worker picks the next request
        raise RuntimeError("down")

    with FakeOpenAIServer(dead) as server:
        endpoint = OpenAIEndpointParams(base_url=server.base_url, model="fake", api_key_env="LOUPE_TEST_KEY",
                                        concurrency=2, max_retries=0)
        engine = OpenAIEngine(endpoint, stop=("</grounding>",), temperature=0.0, seed=1)
        with pytest.raises(EndpointError):
            run_rollouts(tasks(20), engine, PROTOCOL, task_dir)
        engine.close()
        sent = server.count()
    assert sent <= 4  # the two in flight when the first failed, at most two more started meanwhile; not 20


# --- malformed HTTP 200 replies ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_a_malformed_reply_is_retried_and_the_run_goes_on(kind, task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    cache = DictCache()
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(Fault.malformed(kind))
        engine = make_engine(server, cache=cache, concurrency=1, max_retries=2)
        [t] = run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        bodies = [r.body for r in server.requests]
    # Not the model's format error: the faulted attempt left no trace in the dialogue.
    assert (t.end_reason, t.answer, t.num_format_errors, t.num_tool_calls) == ("answered", "B", 0, 1)
    assert all(MALFORMED_TEXT not in turn.text for turn in t.turns)
    assert len(bodies) == 3  # the fault, then the two real turns
    assert (engine.usage.requests, engine.usage.failed_requests) == (2, 1)
    assert len(cache.replies) == 2 and all(validate_reply(r).text != MALFORMED_TEXT for r in cache.replies.values())
    assert not any(b.get("stream") for b in bodies)  # the engine never asks for a stream


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_replies_outlasting_the_retries_fail_as_an_endpoint_error(kind, task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    cache = DictCache()
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(*[Fault.malformed(kind)] * 3)
        engine = make_engine(server, cache=cache, concurrency=1, max_retries=2)
        with pytest.raises(EndpointError) as caught:
            run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        sent = server.count()
    assert sent == 3 and "failed after 3 attempts (malformed reply:" in str(caught.value)
    assert cache.replies == {}  # nothing that failed validation is stored


def test_a_cache_entry_that_does_not_validate_is_refetched_and_paid(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    cache = DictCache()
    with FakeOpenAIServer(searcher) as server:
        run_rollouts(tasks(1), make_engine(server, cache=cache), PROTOCOL, task_dir)
        assert server.count() == 2 and len(cache.replies) == 2
        first, second = sorted(cache.replies)
        cache.replies[first]["choices"][0]["message"]["content"] = None  # as an older Loupe could have stored
        cache.replies[second] = {"id": "torn"}
        engine = make_engine(server, cache=cache)
        [t] = run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        assert server.count() == 4  # both asked for again
    assert t.end_reason == "answered" and t.answer == "B"
    assert (engine.usage.requests, engine.usage.cached_requests) == (2, 0)
    assert all(validate_reply(r) for r in cache.replies.values())  # replaced by the fresh replies


def test_a_malformed_sibling_leaves_the_replies_already_received_in_the_cache(task_dir, monkeypatch):
    """One request of a batch keeps getting a malformed reply while the other is still being answered: the good
    reply still reaches the cache before the error ends the run, and the bad ones never do."""

    def responder(request: dict):
        if "fail" in json.dumps(request["messages"][1]["content"]):
            return Fault.malformed("null_content")
        time.sleep(1.0)  # still in flight when the failure is raised
        return "<think>done</think>\n<answer>B</answer>"

    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    records = [TaskRecord(doc_id="bad", images=["scene.png"], problem="fail", solution="B", options=["a", "b"]),
               TaskRecord(doc_id="slow", images=["scene.png"], problem="Colour?", solution="B", options=["a", "b"])]
    cache = DictCache()
    with FakeOpenAIServer(responder) as server:
        engine = make_engine(server, cache=cache, concurrency=2, max_retries=1)
        with pytest.raises(EndpointError, match="failed after 2 attempts .*content is null"):
            run_rollouts(records, engine, PROTOCOL, task_dir)
        engine.close()
        sent = server.count()
    assert sent == 3  # two malformed attempts and the good one
    [reply] = cache.replies.values()
    assert validate_reply(reply).text == "<think>done</think>\n<answer>B</answer>"


# --- the API key ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, ""])
def test_a_missing_key_variable_is_an_error_naming_it_and_nothing_is_sent(value, monkeypatch):
    if value is None:
        monkeypatch.delenv("LOUPE_TEST_KEY", raising=False)
    else:
        monkeypatch.setenv("LOUPE_TEST_KEY", value)
    with FakeOpenAIServer(searcher) as server:
        with pytest.raises(ValueError, match="LOUPE_TEST_KEY.*not set or empty.*api_key_env to null"):
            make_engine(server)
        assert server.count() == 0


def test_a_keyless_local_server_is_reached_with_api_key_env_null(task_dir, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeOpenAIServer(searcher) as server:  # a server with no key, as vLLM without --api-key
        endpoint = OpenAIEndpointParams(base_url=server.base_url, model="fake", api_key_env=None, **FAST)
        [t] = run_rollouts(tasks(1), OpenAIEngine(endpoint, stop=("</grounding>",)), PROTOCOL, task_dir)
        assert t.end_reason == "answered" and server.requests[0].headers["authorization"] == "Bearer EMPTY"


def test_a_key_pasted_as_the_variable_name_is_refused_without_echo():
    secret = "sk-proj-abc123-def456"
    with pytest.raises(ValidationError) as caught:
        OpenAIEndpointParams(api_key_env=secret)
    assert "api_key_env" in str(caught.value) and secret not in str(caught.value)


def test_retry_after_is_honoured(task_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TEST_KEY", "k")
    with FakeOpenAIServer(searcher) as server:
        server.add_faults(Fault.status(429, retry_after=0.4))
        engine = make_engine(server, concurrency=1, max_retries=1, max_backoff_s=5.0)
        run_rollouts(tasks(1), engine, PROTOCOL, task_dir)
        first, second = server.requests[:2]
    assert second.received_at - first.received_at >= 0.4


# --- the shared reply check (loupe.endpoint) -----------------------------------------------------------------


def test_retry_after_forms_and_the_backoff_bounds():
    assert retry_after_seconds({"retry-after": "1.5"}) == 1.5
    assert retry_after_seconds({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert 8 < retry_after_seconds({"retry-after": time.strftime("%a, %d %b %Y %H:%M:%S GMT",
                                                                 time.gmtime(time.time() + 10))}) <= 10
    for ignored in ({}, {"retry-after": "soon"}, {"retry-after": "-3"}, {"retry-after": "nan"},
                    {"retry-after": "3600"}):  # beyond two minutes: the exponential wait stands
        assert retry_after_seconds(ignored) == 0.0
    policy = RetryPolicy(max_retries=5, backoff_s=1.0, max_backoff_s=6.0)
    assert all(0.5 <= policy.delay(0) <= 1.5 and 2.0 <= policy.delay(2) <= 6.0 for _ in range(50))
    assert policy.delay(10) == 6.0 and policy.delay(0, retry_after=4.0) == 4.0 and policy.delay(0, 60.0) == 60.0  # Retry-After obeyed past the cap


def test_a_valid_reply_without_usage_is_accepted():
    body = {"choices": [{"message": {"content": "<answer>A</answer>"}, "finish_reason": "length"}]}
    reply = validate_reply(body)
    assert (reply.text, reply.finish_reason, reply.prompt_tokens, reply.completion_tokens) == \
        ("<answer>A</answer>", "length", None, None)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "message", "content", "finish_reason", "usage", "prompt_tokens",
                         "completion_tokens", "id"]) | st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON_VALUES)
def test_any_json_value_is_a_reply_or_a_malformed_reply(value):
    try:
        reply = validate_reply(value)
    except MalformedReply as err:
        assert str(err)
        return
    assert isinstance(reply.text, str) and reply.text and reply.finish_reason in {"stop", "length", "tool_calls",
                                                                                "content_filter", "function_call"}


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_body_decodes_or_is_a_malformed_reply(raw):
    try:
        decode_body(raw)
    except MalformedReply as err:
        assert str(err)


@pytest.mark.parametrize("reason", ["stop", "length", "eos", "eos_token", "stop_sequence"])
def test_a_servers_own_word_for_the_end_of_a_sequence_is_a_valid_reply(reason):
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "<answer>A</answer>"},
                         "finish_reason": reason}]}
    reply = validate_reply(body)
    assert reply.text == "<answer>A</answer>" and reply.finish_reason == reason


@pytest.mark.parametrize("reason", [None, "", "  ", 3, "abort"])
def test_a_missing_or_aborted_finish_reason_is_malformed(reason):
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": reason}]}
    with pytest.raises(MalformedReply, match="finish_reason"):
        validate_reply(body)

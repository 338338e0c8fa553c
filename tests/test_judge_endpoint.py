"""The LLM judge against malformed HTTP 200 replies, damaged cache entries and the API-key rule, over a real
OpenAI-compatible server on loopback (tests/fake_openai.py). The judge's other behaviour is in
test_reward_scoring.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_openai import MALFORMED_KINDS, FakeOpenAIServer, Fault

from loupe.rewards import JudgeConfig, LLMJudge

KEY = "sk-judge-endpoint-test-7c1d"
KEY_ENV = "LOUPE_JUDGE_ENDPOINT_KEY"


def wrong(request: dict) -> str:
    """Every real verdict is 0, while malformed replies carry "Score: 1": a judge that took one would say 1."""
    return "The candidate names another colour.\nScore: 0"


def make_config(server: FakeOpenAIServer, cache_dir: Path | None, **overrides) -> JudgeConfig:
    settings = {"base_url": server.base_url, "model": "judge-model", "api_key_env": KEY_ENV, "timeout_s": 2.0,
                "max_retries": 2, "backoff_s": 0.001, "max_backoff_s": 0.01,
                "cache_dir": str(cache_dir) if cache_dir is not None else None}
    return JudgeConfig(**{**settings, **overrides})


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeOpenAIServer(wrong, api_key=KEY) as fake:
        yield fake


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_a_malformed_reply_is_retried_and_never_taken_for_a_verdict(kind, server, tmp_path):
    server.add_faults(Fault.malformed(kind))
    judge = LLMJudge(make_config(server, tmp_path))
    result = judge.judge("What colour?", "red", "blue")
    assert (result.valid, result.score, result.attempts) == (True, 0.0, 2)
    assert server.count() == 2 and judge.stats() == {"calls": 2, "cache_hits": 0, "failures": 0}
    [entry] = tmp_path.rglob("*.json")
    assert json.loads(entry.read_text())["score"] == 0
    assert not any(r.body.get("stream") for r in server.requests)  # the judge never asks for a stream


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_replies_outlasting_the_retries_leave_the_verdict_invalid_and_uncached(kind, server, tmp_path):
    server.add_faults(*[Fault.malformed(kind)] * 3)
    judge = LLMJudge(make_config(server, tmp_path, max_retries=2))
    result = judge.judge("What colour?", "red", "blue")
    assert (result.valid, result.score, result.attempts) == (False, None, 3)
    assert server.count() == 3 and judge.stats()["calls"] == 3 and judge.stats()["failures"] == 1
    assert result.error.startswith("malformed reply: ")
    assert list(tmp_path.rglob("*.json")) == []
    assert judge.judge("What colour?", "red", "blue").score == 0.0  # the endpoint recovered: judged afresh


def test_empty_content_cut_by_the_length_limit_is_a_fault_named_in_the_error(server, tmp_path):
    server.add_faults(*[Fault.malformed("empty_content_length")] * 2)
    result = LLMJudge(make_config(server, None, max_retries=1)).judge("Q", "red", "blue")
    assert not result.valid and "content is empty (finish_reason 'length')" in result.error


@pytest.mark.parametrize(
    "entry",
    [
        [1],  # not an object
        {"model": "judge-model", "score": True, "reply": "Score: 1"},  # a boolean, not 0 or 1
        {"model": "judge-model", "score": 2, "reply": "Score: 2"},
        {"model": "judge-model", "score": 1, "reply": 1},  # the reply is not text
        {"model": "judge-model", "reply": "Score: 1"},  # no score
        {"model": "another-model", "score": 1, "reply": "Score: 1"},
    ],
)
def test_a_cache_entry_that_does_not_validate_is_refetched_and_paid(entry, server, tmp_path):
    first = LLMJudge(make_config(server, tmp_path))
    assert first.judge("Q", "red", "blue").score == 0.0
    [path] = tmp_path.rglob("*.json")
    path.write_text(json.dumps(entry))
    fresh = LLMJudge(make_config(server, tmp_path))
    result = fresh.judge("Q", "red", "blue")
    assert (result.valid, result.score, result.cached) == (True, 0.0, False)
    assert fresh.stats() == {"calls": 1, "cache_hits": 0, "failures": 0} and server.count() == 2
    assert json.loads(path.read_text())["score"] == 0  # overwritten by the fresh verdict


def test_an_empty_key_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "")
    with FakeOpenAIServer(wrong) as server:
        with pytest.raises(ValueError, match=f"judge: .*{KEY_ENV}.*not set or empty"):
            LLMJudge(make_config(server, None))
        assert server.count() == 0


def test_a_keyless_local_server_is_reached_with_api_key_env_none(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with FakeOpenAIServer(wrong) as server:
        result = LLMJudge(make_config(server, None, api_key_env=None)).judge("Q", "red", "blue")
        assert result.valid and server.requests[0].headers["authorization"] == "Bearer EMPTY"


def test_a_recipes_judge_prompt_and_verdict_form_are_what_the_server_sees_and_reads(monkeypatch, tmp_path):
    """DeepEyes' judge: its system message, a few-shot user message from a template, temperature 0.3, and the
    reply read by "Judgement:" (a reply without the form is wrong, not retried); the prompt is in the cache key."""
    monkeypatch.setenv(KEY_ENV, KEY)
    replies = iter(["Judgement: 1", "The answer disagrees.\nJudgement: 0", "no verdict here"])
    with FakeOpenAIServer(lambda request: next(replies), api_key=KEY) as server:
        template = Path(__file__).resolve().parent.parent / "params" / "templates" / "judge_deepeyes.jinja"
        config = make_config(server, tmp_path / "cache", system_prompt="You are a helpful assistant.",
                             prompt_template=str(template), verdict="judgement", temperature=0.3)
        judge = LLMJudge(config)
        results = [judge.judge("What colour is the bus?", "B", answer) for answer in ("blue", "red", "green")]
        assert [r.score for r in results] == [1.0, 0.0, 0.0] and all(r.valid for r in results)
        body = server.requests[0].body
        assert body["temperature"] == 0.3 and body["messages"][0]["content"] == "You are a helpful assistant."
        user = body["messages"][1]["content"]
        assert user.rstrip().endswith("[Model_answer] : blue\nJudgement:") and "[Standard Answer]: B" in user
        assert len(server.requests) == 3  # the reply without a verdict was not retried
        plain = LLMJudge(make_config(server, tmp_path / "cache"))
        assert plain.cache_key("q", "B", "blue") != judge.cache_key("q", "B", "blue")


def test_deepeyes_reads_a_judgement_as_its_reward_does():
    from loupe.rewards.judge import parse_judgement

    assert parse_judgement("Judgement: 1") == 1.0 and parse_judgement("Judgement: 0") == 0.0
    assert parse_judgement("I think 1. Judgement: 0") == 0.0  # the text after the last "Judgement:" decides
    assert parse_judgement("1") == 1.0 and parse_judgement("unsure") == 0.0 and parse_judgement(None) == 0.0

"""Rewards through score(): the LLM judge against a real loopback server (retries, faults, the cache, the key never
logged), score() over a task and its answer, custom rewards, and the fake server the judge tests rely on."""

from __future__ import annotations

import json
import pickle
import threading
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAIServer, Fault, Reply
from pydantic import ValidationError

from loupe.data.tasks import TaskRecord
from loupe.rewards import (
    CustomRewardError,
    JudgeConfig,
    JudgeItem,
    JudgeResult,
    LLMJudge,
    RewardConfig,
    RewardParts,
    load_custom_reward,
    parse_judge_score,
    score,
)

SECRET = "sk-test-7f3a9c1e5b2d4f60-never-log-me"
KEY_ENV = "LOUPE_TEST_JUDGE_KEY"
COLOURS = ["red car", "blue car", "green car", "yellow car"]


# --- the judge, against a real server on loopback -----------------------------------------------------------


def judge_by_keyword(request: dict) -> str:
    """Says the candidate is right when the candidate block holds the word 'right'."""
    user = request["messages"][-1]["content"]
    candidate = user.split("<<<")[1].split(">>>")[0]
    return "The candidate matches.\nScore: 1" if "right" in candidate else "Score: 0"


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


@pytest.fixture
def server():
    with FakeOpenAIServer(judge_by_keyword, api_key=SECRET) as fake:
        yield fake


def make_config(server: FakeOpenAIServer, cache_dir: Path | None, **overrides) -> JudgeConfig:
    settings_ = {
        "base_url": server.base_url,
        "model": "judge-model",
        "api_key_env": KEY_ENV,
        "timeout_s": 2.0,
        "max_retries": 3,
        "backoff_s": 0.01,
        "max_backoff_s": 0.05,
        "cache_dir": str(cache_dir) if cache_dir is not None else None,
    }
    return JudgeConfig(**{**settings_, **overrides})


def test_parse_judge_score():
    assert parse_judge_score("Score: 1") == 1.0
    assert parse_judge_score("reasoning...\n**Score**: 0") == 0.0
    assert parse_judge_score("score=1") == 1.0
    assert parse_judge_score("Score: 0 ... on reflection, Score: 1") == 1.0
    assert parse_judge_score("Score: 10") is None
    assert parse_judge_score("I think it is right") is None
    assert parse_judge_score(None) is None


def test_judge_scores_and_sends_the_key(api_key, server, tmp_path):
    with LLMJudge(make_config(server, tmp_path, temperature=None)) as judge:
        right = judge.judge("What colour?", "red", "the right one")
        wrong = judge.judge("What colour?", "red", "blue")
    assert (right.score, right.valid, right.attempts) == (1.0, True, 1)
    assert (wrong.score, wrong.valid) == (0.0, True)
    assert server.count() == 2
    request = server.requests[0]
    assert request.headers["authorization"] == f"Bearer {SECRET}"
    assert request.body["model"] == "judge-model"
    assert "temperature" not in request.body and request.body["max_tokens"] == 64
    assert "What colour?" in request.body["messages"][-1]["content"]


def test_cache_makes_a_rerun_free(api_key, server, tmp_path):
    items = [("Q1", "red", "right"), ("Q2", "blue", "green"), ("Q3", "cat", "right cat")]
    with LLMJudge(make_config(server, tmp_path)) as first:
        scores = [r.score for r in first.score_many(items)]
    assert server.count() == 3
    assert len(list(tmp_path.rglob("*.json"))) == 3

    with LLMJudge(make_config(server, tmp_path)) as second:  # a new process would see only the files
        again = second.score_many(items)
    assert server.count() == 3, "the rerun must not send a single request"
    assert [r.score for r in again] == scores
    assert all(r.cached for r in again)
    assert second.stats() == {"calls": 0, "cache_hits": 3, "failures": 0}

    other_model = LLMJudge(make_config(server, tmp_path, model="another-judge"))
    other_model.judge(*items[0])
    assert server.count() == 4, "the judge model is part of the cache key"


def test_damaged_cache_entry_is_a_miss(api_key, server, tmp_path):
    judge = LLMJudge(make_config(server, tmp_path))
    judge.judge("Q", "red", "right")
    (entry,) = tmp_path.rglob("*.json")
    entry.write_text("{not json")
    fresh = LLMJudge(make_config(server, tmp_path))
    assert fresh.judge("Q", "red", "right").score == 1.0
    assert server.count() == 2
    assert json.loads(entry.read_text())["score"] == 1


def test_retries_through_429_and_500(api_key, server, tmp_path):
    server.add_faults(Fault.status(429, retry_after=0.01), Fault.status(500))
    judge = LLMJudge(make_config(server, tmp_path))
    result = judge.judge("Q", "red", "right")
    assert (result.valid, result.score, result.attempts) == (True, 1.0, 3)
    assert server.count() == 3
    assert judge.stats()["calls"] == 3
    assert server.requests[-1].body["temperature"] == 0.0


def test_retries_through_malformed_body_disconnect_and_unparseable_reply(api_key, tmp_path):
    replies = iter(["I would rather not say.", "Score: 1"])
    with FakeOpenAIServer(lambda request: next(replies), api_key=SECRET) as server:
        server.add_faults(Fault.malformed(), Fault.disconnect())
        result = LLMJudge(make_config(server, tmp_path, max_retries=4)).judge("Q", "red", "red-ish")
        assert (result.valid, result.score, result.attempts) == (True, 1.0, 4)
        assert server.count() == 4


def test_slow_response_beyond_the_timeout_is_retried(api_key, server, tmp_path):
    server.add_faults(Fault.slow(1.5))
    started = time.monotonic()
    result = LLMJudge(make_config(server, tmp_path, timeout_s=0.3)).judge("Q", "red", "right")
    assert (result.valid, result.score, result.attempts) == (True, 1.0, 2)
    assert time.monotonic() - started < 1.5, "the client must give up on the slow request, not wait it out"


def test_failure_after_retries_is_invalid_not_zero(api_key, server, tmp_path):
    server.add_faults(*[Fault.status(503)] * 3)
    cfg = make_config(server, tmp_path, max_retries=2)
    judge = LLMJudge(cfg)
    result = judge.judge("Q", "red", "right")
    assert (result.valid, result.score, result.attempts) == (False, None, 3)
    assert "503" in result.error
    assert server.count() == 3
    assert judge.stats()["failures"] == 1
    assert list(tmp_path.rglob("*.json")) == [], "failures are not cached"

    # through score(): invalid, no accuracy, no total
    server.add_faults(*[Fault.status(500)] * 3)
    task = TaskRecord(doc_id="t", images=["a.png"], problem="Q", solution="red")
    reward_cfg = RewardConfig(free_form_match="judge", judge=cfg)
    parts = score(task, "crimson", "answered", 1, 0, True, reward_cfg, judge)
    assert (parts.valid, parts.accuracy, parts.total) == (False, None, None)
    assert "judge failed" in parts.invalid_reason

    # once the server recovers the same item is judged afresh
    assert judge.judge("Q", "red", "right").score == 1.0


def test_the_key_never_leaks(api_key, tmp_path, caplog):
    with FakeOpenAIServer(judge_by_keyword, api_key="a-different-key") as server:
        judge = LLMJudge(make_config(server, tmp_path))
        rejected = judge.judge("Q", "red", "right")
        assert not rejected.valid and "401" in rejected.error
        assert server.count() == 1, "a 401 is not worth retrying"
        texts = [rejected.error, repr(judge), str(judge), caplog.text, repr(judge.config)]
        assert all(SECRET not in text for text in texts)
        pickled = pickle.dumps(judge)
        assert SECRET.encode() not in pickled

    with FakeOpenAIServer(judge_by_keyword, api_key=SECRET) as server:
        judge = LLMJudge(make_config(server, tmp_path))
        judge.judge("Q", "red", "right")
        restored = pickle.loads(pickle.dumps(judge))  # re-reads the key from the environment
        assert restored.judge("Q2", "red", "right").score == 1.0
    files = list(tmp_path.rglob("*"))
    assert files and all(SECRET not in p.read_text() for p in files if p.is_file())


def test_a_proxy_echoing_the_key_is_redacted(api_key, server, tmp_path, caplog):
    # Some gateways echo request headers in their error pages.
    server.add_faults(*[Fault.status(502, message=f"upstream refused Authorization: Bearer {SECRET}")] * 2)
    result = LLMJudge(make_config(server, tmp_path, max_retries=1)).judge("Q", "red", "right")
    assert not result.valid and "502" in result.error and "[redacted]" in result.error
    assert SECRET not in result.error and SECRET not in caplog.text
    assert "upstream refused" in caplog.text


def test_a_key_pasted_as_the_variable_name_is_refused_without_echo():
    with pytest.raises(ValidationError) as caught:
        JudgeConfig(api_key_env=SECRET)
    assert "api_key_env" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_missing_key_variable_names_the_variable(monkeypatch, server):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=KEY_ENV):
        LLMJudge(make_config(server, None))


def test_score_many_runs_concurrently_and_judges_each_item_once(api_key, tmp_path):
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def slow_judge(request: dict) -> str:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.2)
        with lock:
            state["now"] -= 1
        return judge_by_keyword(request)

    items = [JudgeItem(f"Q{i}", "ref", "right" if i % 2 else "wrong") for i in range(8)]
    with FakeOpenAIServer(slow_judge, api_key=SECRET) as server:
        results = LLMJudge(make_config(server, tmp_path)).score_many(items, max_workers=4)
        questions = [r.body["messages"][-1]["content"].split("\n")[1] for r in server.requests]
    assert [r.score for r in results] == [float(i % 2) for i in range(8)]
    assert sorted(questions) == sorted(f"Q{i}" for i in range(8)), "each item judged exactly once"
    assert state["peak"] >= 2, "requests must overlap"


def test_identical_items_in_flight_share_one_request(api_key, tmp_path):
    def slow(request: dict) -> str:
        time.sleep(0.2)
        return "Score: 1"

    with FakeOpenAIServer(slow, api_key=SECRET) as server:
        judge = LLMJudge(make_config(server, None))
        results = judge.score_many([("Q", "red", "scarlet")] * 6, max_workers=3)
        assert server.count() == 1
    assert all(r.valid and r.score == 1.0 for r in results)
    assert judge.stats() == {"calls": 1, "cache_hits": 5, "failures": 0}


# --- score() ------------------------------------------------------------------------------------------------


CHOICE = TaskRecord(doc_id="c", images=["a.png"], problem="Which car?", solution="B", options=COLOURS)
FREE = TaskRecord(doc_id="f", images=["a.png"], problem="How many cars?", solution="twelve")


def test_score_choice_with_plain_weights():
    cfg = RewardConfig(accuracy_weight=1.0, format_weight=0.5)
    right = score(CHOICE, "The answer is B.", "answered", 0, 0, True, cfg, None)
    assert (right.accuracy, right.format, right.tool, right.total, right.valid) == (1.0, 1.0, 0.0, 1.5, True)
    assert (right.extracted, right.matched_by) == ("B", "letter")
    wrong = score(CHOICE, "red car", "answered", 0, 0, True, cfg, None)
    assert (wrong.accuracy, wrong.extracted, wrong.total) == (0.0, "A", 0.5)


def test_score_deepeyes_shape():
    cfg = RewardConfig.deepeyes()
    # DeepEyes' format term is 0 for a clean trajectory and -1 after a format error (vl_agent.compute_score)
    assert score(CHOICE, "B", "answered", 2, 0, True, cfg).total == pytest.approx(0.8 + 1.2)
    assert score(CHOICE, "B", "answered", 0, 0, True, cfg).total == pytest.approx(0.8)  # right, no tool: no bonus
    assert score(CHOICE, "A", "answered", 2, 0, True, cfg).total == pytest.approx(0.0)  # wrong: no bonus
    assert score(CHOICE, "B", "answered", 2, 1, True, cfg).total == pytest.approx(0.8 - 0.2 + 1.2)


def test_tool_call_penalty_beyond_free_calls():
    cfg = RewardConfig(tool_call_penalty=0.1, free_tool_calls=2)
    assert score(CHOICE, "B", "answered", 2, 0, True, cfg).tool == 0.0
    assert score(CHOICE, "B", "answered", 5, 0, True, cfg).tool == pytest.approx(-0.3)
    assert score(CHOICE, "B", "answered", 5, 0, True, cfg).total == pytest.approx(0.7)


@pytest.mark.parametrize(
    "end_reason, has_think, format_errors, expected",
    [
        ("answered", True, 0, 1.0),
        ("answered", False, 0, 0.5),
        ("answered", True, 2, 0.5),
        ("over_turn", True, 0, 0.0),
        ("format_error", True, 3, 0.0),
        ("length", True, 0, 0.0),
    ],
)
def test_format_reward_rule(end_reason, has_think, format_errors, expected):
    parts = score(CHOICE, "B", end_reason, 1, format_errors, has_think, RewardConfig(format_weight=1.0))
    assert parts.format == expected
    if end_reason != "answered":
        assert (parts.accuracy, parts.valid, parts.matched_by) == (0.0, True, "no_answer")


def test_score_rejects_unknown_end_reason():
    with pytest.raises(ValueError, match="end_reason"):
        score(CHOICE, "B", "finished", 0, 0, True, RewardConfig())


def test_free_form_exact_then_judge(api_key, server, tmp_path):
    assert score(FREE, "12", "answered", 0, 0, True, RewardConfig()).accuracy == 1.0
    assert score(FREE, "about a dozen", "answered", 0, 0, True, RewardConfig()).accuracy == 0.0

    cfg = RewardConfig(free_form_match="judge", judge=make_config(server, tmp_path))
    judge = LLMJudge(cfg.judge)
    exact = score(FREE, "Twelve.", "answered", 0, 0, True, cfg, judge)
    assert (exact.accuracy, exact.matched_by) == (1.0, "exact")
    assert server.count() == 0, "an exact match needs no judge call"
    judged = score(FREE, "a dozen, right?", "answered", 0, 0, True, cfg, judge)
    assert (judged.accuracy, judged.matched_by, judged.valid) == (1.0, "judge", True)
    assert server.count() == 1
    with pytest.raises(ValueError, match="judge"):
        score(FREE, "a dozen", "answered", 0, 0, True, cfg, None)


def test_choice_judge_fallback_only_when_the_cascade_finds_nothing(api_key, server, tmp_path):
    cfg = RewardConfig(choice_judge_fallback=True, judge=make_config(server, tmp_path))
    judge = LLMJudge(cfg.judge)
    assert score(CHOICE, "B", "answered", 0, 0, True, cfg, judge).matched_by == "letter"
    assert server.count() == 0
    parts = score(CHOICE, "the right, bluish vehicle", "answered", 0, 0, True, cfg, judge)
    assert (parts.accuracy, parts.matched_by) == (1.0, "judge")
    assert "(B) blue car" in server.requests[0].body["messages"][-1]["content"]


def test_reward_config_is_strict_and_documented():
    with pytest.raises(ValidationError):
        RewardConfig(acuracy_weight=1.0)
    with pytest.raises(ValidationError, match="judge"):
        RewardConfig(free_form_match="judge")
    with pytest.raises(ValidationError):
        JudgeConfig(timeout_s=0)
    for model in (RewardConfig, JudgeConfig):
        undocumented = [name for name, f in model.model_fields.items() if not f.description]
        assert undocumented == [], f"{model.__name__} fields without a docstring: {undocumented}"


def test_reward_parts_to_dict():
    parts = score(CHOICE, "B", "answered", 1, 0, True, RewardConfig())
    d = parts.to_dict()
    assert d["accuracy"] == 1.0 and d["valid"] is True and d["invalid_reason"] is None
    assert json.loads(json.dumps(d)) == d


# --- custom rewards -----------------------------------------------------------------------------------------


def write_module(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return path


def test_load_custom_reward_number_and_parts(tmp_path):
    path = write_module(
        tmp_path,
        "from loupe.rewards import score\n"
        "def shaped(**kwargs):\n"
        "    return 2.5 if kwargs['answer'] == 'B' else -1\n"
        "def wrapped(task, answer, end_reason, num_tool_calls, num_format_errors, has_think, cfg, judge):\n"
        "    return score(task, answer, end_reason, num_tool_calls, num_format_errors, has_think, cfg, judge)\n",
    )
    args = {
        "task": CHOICE,
        "answer": "B",
        "end_reason": "answered",
        "num_tool_calls": 0,
        "num_format_errors": 0,
        "has_think": True,
        "cfg": RewardConfig(),
        "judge": None,
    }
    shaped = load_custom_reward(f"{path}:shaped")
    assert shaped(**args) == RewardParts(None, 0.0, 0.0, 2.5, True, None, None, "custom")
    assert shaped(**{**args, "answer": "A"}).total == -1.0
    assert load_custom_reward(f"{path}:wrapped")(**args).accuracy == 1.0


@pytest.mark.parametrize(
    "source, function, message",
    [
        ("def f(**kw):\n    return 1\n", "missing", "defines no 'missing'.*'f'"),
        ("def f(task):\n    return 1\n", "f", "must accept the keyword arguments"),
        ("f = 3\n", "f", "not callable"),
        ("import not_a_module_anywhere\n", "f", "importing .* failed: ModuleNotFoundError"),
    ],
)
def test_load_custom_reward_errors(tmp_path, source, function, message):
    path = write_module(tmp_path, source)
    with pytest.raises(CustomRewardError, match=message):
        load_custom_reward(f"{path}:{function}")


def test_load_custom_reward_bad_specs_and_returns(tmp_path):
    with pytest.raises(CustomRewardError, match="not found"):
        load_custom_reward(f"{tmp_path}/absent.py:f")
    with pytest.raises(CustomRewardError, match="expected 'path/to/file.py:function_name'"):
        load_custom_reward("no_colon_here.py")
    path = write_module(tmp_path, "def f(**kw):\n    return 'great'\n")
    with pytest.raises(CustomRewardError, match="returned str"):
        load_custom_reward(f"{path}:f")(answer="B")


# --- the fake server itself (other tests rely on its behaviour) ---------------------------------------------


def test_fake_server_speaks_the_openai_protocol():
    import openai

    with FakeOpenAIServer(lambda request: "one two three four <grounding>x</grounding> tail") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == ["fake-model"]
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "look here"}, image]}]
        stopped = client.chat.completions.create(model="m", messages=messages, stop=["</grounding>"])
        assert stopped.choices[0].message.content == "one two three four <grounding>x"
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.prompt_tokens == 2 + 85
        cut = client.chat.completions.create(model="m", messages=messages, max_tokens=2, n=2)
        assert [c.message.content for c in cut.choices] == ["one two", "one two"]
        assert cut.choices[0].finish_reason == "length"
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(model="m", messages=messages, stream=True)
            if chunk.choices
        )
        assert streamed.startswith("one two three")
        server.responder = lambda request: Reply("done", finish_reason="length", completion_tokens=7)
        custom = client.chat.completions.create(model="m", messages=messages)
        assert (custom.choices[0].finish_reason, custom.usage.completion_tokens) == ("length", 7)
        assert server.count() == 4 and server.count("/v1/models") == 1


def test_the_judge_reads_the_question_without_image_placeholders():
    class Recorder:
        def judge(self, question, reference, prediction):
            self.question = question
            return JudgeResult(score=1.0, valid=True)

    recorder = Recorder()
    task = TaskRecord(doc_id="q", images=["a.png"], problem="<image>\nWhat is written on the sign?", solution="stop")
    cfg = RewardConfig(free_form_match="judge", judge=JudgeConfig(base_url="http://127.0.0.1:9/v1", model="j", api_key_env=None))
    parts = score(task, "halt", "answered", 1, 0, True, cfg, recorder)
    assert recorder.question == "What is written on the sign?" and parts.accuracy == 1.0

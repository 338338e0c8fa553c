"""The openai engine against a real OpenAI-compatible server on loopback: the loop, data URLs, retries, errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAIServer, Fault
from PIL import Image

from loupe.config import OpenAIEndpointParams, ProtocolParams
from loupe.data.tasks import TaskRecord
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


def make_engine(server: FakeOpenAIServer, **kw) -> OpenAIEngine:
    endpoint = OpenAIEndpointParams(base_url=server.base_url, model="fake", api_key_env="LOUPE_TEST_KEY", **kw)
    return OpenAIEngine(endpoint, stop=("</grounding>",), temperature=0.0, seed=1)


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
    message = str(caught.value)
    assert base_url in message and "1 retries" in message and "HTTP 500" in message
    assert "sk-never-show-me" not in message


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

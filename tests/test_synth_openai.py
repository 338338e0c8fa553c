"""The openai teacher against a real OpenAI-compatible server on loopback that answers with the oracle's moves.

Injected 429, 500 and slow replies lose nothing and count nothing twice; the reply cache makes a repeated run
free (zero HTTP calls) and an interrupted run pay nothing twice; every kind of malformed HTTP 200 reply is kept
out of the cache, and a rerun after one succeeds paying only for what is missing; the API key never reaches a
file, a log line or MLflow (the real MLflow store is checked in a slow test).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from fake_openai import MALFORMED_KINDS, MALFORMED_TEXT, FakeOpenAIServer, Fault
from test_synth_support import synth_tasks_dir, train_tasks, write_params  # noqa: F401  (fixture)

import stages.synth
import stages.synth.__main__ as synth_main
from loupe.config import OpenAIEndpointParams, ProtocolParams
from loupe.endpoint import validate_reply
from loupe.protocol import get_protocol
from loupe.rollout import run_rollouts
from loupe.rollout.openai_engine import EndpointError
from stages.synth.__main__ import main
from stages.synth.dataset import DATASET_NAME
from stages.synth.oracle import OracleEngine
from stages.synth.params import OpenAITeacherParams, OracleParams
from stages.synth.teacher_openai import (
    DiskReplyCache,
    ExemplarError,
    build_openai_teacher,
    load_exemplars,
)

KEY = "sk-loupe-synth-test-5ecret-9f3a"
KEY_ENV = "LOUPE_SYNTH_TEST_KEY"
SAMPLES = 2
EXEMPLARS = Path(stages.synth.__file__).parent / "exemplars"


class OracleResponder:
    """Answers each request with the oracle's turn for that question, sample (the request's seed) and turn."""

    def __init__(self, tasks_dir: Path):
        tasks = train_tasks(tasks_dir)
        protocol = get_protocol("mini_o3")
        engine = OracleEngine(OracleParams(), protocol, seed=0, max_turns=6)
        engine.prepare(tasks, SAMPLES)
        self.moves: dict[tuple[str, int], list[str]] = {}
        for trajectory in run_rollouts(tasks, engine, ProtocolParams(), tasks_dir, samples_per_task=SAMPLES):
            question = protocol.question_text(next(t for t in tasks if t.doc_id == trajectory.task["doc_id"]))
            key = (question.replace("<image>", ""), trajectory.sample_index)
            self.moves[key] = [turn.text for turn in trajectory.turns if turn.role == "assistant"]
        self.systems: list[str] = []
        self.answered = 0
        self.fail_when = None  # a predicate on (question, turn): answer HTTP 500 (or `failure`) instead
        self.failure: Fault | None = None
        self._lock = threading.Lock()

    def __call__(self, request: dict) -> str:
        messages = request["messages"]
        question = "".join(p["text"] for p in messages[1]["content"] if p["type"] == "text")
        turn = sum(m["role"] == "assistant" for m in messages)
        if self.fail_when is not None and self.fail_when(question, turn):
            if self.failure is not None:
                return self.failure
            raise RuntimeError("the endpoint is down")
        with self._lock:
            self.systems.append(messages[0]["content"])
            self.answered += 1
        return self.moves[(question, request["seed"])][turn]


@pytest.fixture(scope="module")
def responder(synth_tasks_dir):  # noqa: F811
    return OracleResponder(synth_tasks_dir)


class RecordingRun:
    """Stands in for `stage_run`, keeping what the stage hands to MLflow."""

    def __init__(self):
        self.stage, self.params, self.metrics, self.artifacts = None, None, {}, []

    @contextmanager
    def stage_run(self, stage, params=None, tags=None):
        self.stage, self.params = stage, params
        yield self

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(Path(path))

    def log_params(self, params):
        self.params.update(params)

    def set_tags(self, tags):
        pass


def teacher_params(tmp_path: Path, server: FakeOpenAIServer, cache: Path, **endpoint) -> Path:
    synth = {
        "teacher": "openai",
        "samples_per_task": SAMPLES,
        "shard_tasks": 3,
        "openai": {"exemplars": str(EXEMPLARS), "num_exemplars": 2, "cache_dir": str(cache),
                   "price_per_1k_prompt_tokens": 0.5, "price_per_1k_completion_tokens": 2.0},
    }
    openai = {"base_url": server.base_url, "model": "fake-model", "api_key_env": KEY_ENV, "concurrency": 4,
              "max_retries": 3, "timeout_s": 5.0, "backoff_s": 0.001, "max_backoff_s": 0.01, **endpoint}
    return write_params(tmp_path / "params.yaml", synth, rollout={"temperature": 0.7, "openai": openai})


def assistant_turns(out: Path) -> int:
    records = json.loads((out / "dataset" / f"{DATASET_NAME}.json").read_text())
    return sum(m["from"] == "gpt" for r in records for m in r["conversations"])


def files_holding(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_faults_lose_nothing_count_nothing_twice_and_the_key_stays_secret(
    responder, synth_tasks_dir, tmp_path, monkeypatch, capsys  # noqa: F811
):
    monkeypatch.setenv(KEY_ENV, KEY)
    tracked = RecordingRun()
    monkeypatch.setattr(synth_main, "stage_run", tracked.stage_run)
    with FakeOpenAIServer(responder, api_key=KEY) as server:
        server.add_faults(Fault.status(429, retry_after=0.01), Fault.status(500), Fault.slow(2.0))
        params = teacher_params(tmp_path, server, tmp_path / "cache", timeout_s=1.0)
        out = tmp_path / "out"
        answered_before = responder.answered
        code = main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        received = server.count()
        metrics = json.loads((out / "metrics.json").read_text())
        usage = metrics["teacher_usage"]
        # The slow request's handler answers 2 s after it arrived, whether or not the client still waits; the
        # per-trajectory loop can finish before that, so wait for it (bounded) before counting what was paid.
        deadline = time.monotonic() + 10.0
        while responder.answered - answered_before < usage["requests"] + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert metrics["trajectories"] == 6 * SAMPLES and metrics["accepted"] == 6 * SAMPLES  # nothing lost
    # One paid request per assistant turn of every trajectory; the three faulted attempts are not counted.
    paid = responder.answered - answered_before
    assert usage["requests"] == paid - 1  # the slow reply was answered after the client had given up
    assert received == usage["requests"] + 3
    assert usage["requests"] == sum(int(n) * c for n, c in metrics["turns_histogram_all"].items())
    assert usage["requests"] == assistant_turns(out) and usage["cached_requests"] == 0
    assert usage["cost"] == pytest.approx(usage["prompt_tokens"] / 1000 * 0.5 + usage["completion_tokens"] / 1000 * 2.0)
    assert "teacher:" in captured.out and f"{usage['requests']} requests" in captured.out
    # The teacher saw the exemplars; the dataset keeps the plain protocol prompt the student will get.
    assert all("Example 1:" in s and "Example 3:" not in s for s in responder.systems)
    records = json.loads((out / "dataset" / f"{DATASET_NAME}.json").read_text())
    assert {r["conversations"][0]["value"] for r in records} == {get_protocol("mini_o3").system_prompt()}
    for leak in (captured.out, captured.err):
        assert KEY not in leak
    assert files_holding(tmp_path, KEY) == []  # outputs and cache
    assert tracked.stage == "synth" and tracked.params["rollout"]["openai"]["api_key_env"] == KEY_ENV
    assert KEY not in json.dumps(tracked.params) + json.dumps(tracked.metrics)  # what MLflow would receive
    assert tracked.metrics["teacher_usage"]["requests"] == usage["requests"]


@pytest.mark.slow
def test_the_key_never_reaches_the_mlflow_store(responder, synth_tasks_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv("LOUPE_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("LOUPE_WORK", str(tmp_path / "work"))
    with FakeOpenAIServer(responder, api_key=KEY) as server:
        params = teacher_params(tmp_path, server, tmp_path / "cache")
        assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(tmp_path / "out"),
                     "--no-progress"]) == 0
    store = (tmp_path / "mlflow.db").read_bytes()
    assert b"api_key_env" in store and KEY_ENV.encode() in store  # the parameters were logged, by name
    assert files_holding(tmp_path, KEY) == []  # database, artefacts, outputs, cache


def test_a_repeated_run_is_served_from_the_cache_with_zero_http_calls(responder, synth_tasks_dir, tmp_path,  # noqa: F811
                                                                      monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeOpenAIServer(responder, api_key=KEY) as server:
        params = teacher_params(tmp_path, server, tmp_path / "cache")
        first = tmp_path / "first"
        assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(first), "--no-progress"]) == 0
        paid = server.count()
        second = tmp_path / "second"  # no shards to resume from: every turn is asked again, of the cache
        assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(second), "--no-progress"]) == 0
        assert server.count() == paid
    usage = json.loads((second / "metrics.json").read_text())["teacher_usage"]
    assert usage["requests"] == 0 and usage["cost"] == 0 and usage["cached_requests"] == paid
    assert usage["cost_saved_by_cache"] > 0
    assert (second / "dataset" / f"{DATASET_NAME}.json").read_text() == \
        (first / "dataset" / f"{DATASET_NAME}.json").read_text()
    samples = json.loads((first / "dataset" / f"{DATASET_NAME}.json").read_text())
    assert len(samples) == 6 * SAMPLES  # per-sample seeds: the two samples of a task differ


def second_shard_questions(responder, synth_tasks_dir: Path) -> set[str]:  # noqa: F811
    """The questions the responder knows beyond the first three tasks (the first shard)."""
    return {q for (q, _) in responder.moves} - {
        get_protocol("mini_o3").question_text(t).replace("<image>", "") for t in train_tasks(synth_tasks_dir)[:3]}


def test_an_interrupted_run_resumes_and_pays_for_no_request_twice(responder, synth_tasks_dir, tmp_path,  # noqa: F811
                                                                  monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, KEY)
    second_shard = second_shard_questions(responder, synth_tasks_dir)
    with FakeOpenAIServer(responder, api_key=KEY) as server:
        params = teacher_params(tmp_path, server, tmp_path / "cache", max_retries=1)
        out = tmp_path / "out"
        responder.fail_when = lambda question, turn: question in second_shard and turn == 1
        before = responder.answered
        try:
            code = main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"])
        finally:
            responder.fail_when = None
        err = capsys.readouterr().err
        assert code == 1 and "HTTP 500" in err and "rerun to resume" in err and KEY not in err
        assert (out / "shards" / "shard-00000" / "manifest.json").is_file() and not (out / "dataset").exists()
        assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"]) == 0
        paid_in_total = responder.answered - before
    metrics = json.loads((out / "metrics.json").read_text())
    all_turns = sum(int(n) * c for n, c in metrics["turns_histogram_all"].items())
    assert metrics["accepted"] == 6 * SAMPLES
    assert paid_in_total == all_turns  # every turn paid exactly once across the two runs
    assert metrics["teacher_usage"]["cached_requests"] > 0  # the broken shard's first turns came from the cache


def test_exemplars_are_checked_against_the_protocol(tmp_path):
    protocol = get_protocol("mini_o3")
    assert len(load_exemplars(EXEMPLARS, protocol)) >= 3
    # The loupe protocol shares mini_o3's grammar, so the same exemplars serve it; deepeyes' grammar differs.
    assert [e.name for e in load_exemplars(EXEMPLARS, get_protocol("loupe"))] == [e.name for e in load_exemplars(EXEMPLARS, protocol)]
    with pytest.raises(ExemplarError, match="no exemplar"):
        load_exemplars(EXEMPLARS, get_protocol("deepeyes"))
    good = json.loads((EXEMPLARS / "01_direct_zoom.json").read_text())

    def check(name: str, data: dict, match: str) -> None:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "ex.json").write_text(json.dumps(data))
        with pytest.raises(ExemplarError, match=match):
            load_exemplars(folder, protocol)

    check("wrong", {**good, "solution": "A"}, "does not match the solution")
    broken = json.loads(json.dumps(good))
    broken["turns"][0]["assistant"] = broken["turns"][0]["assistant"].replace('"source"', '"src"')
    check("broken", broken, r"ex.json: turns.0: missing_key")
    order = {**good, "turns": [good["turns"][0], good["turns"][0]]}
    check("order", order, r"turns.1: expected an observation turn")
    check("other", {**good, "protocol": "deepeyes"}, "no exemplar written for the mini_o3 protocol")


def completion(content) -> dict:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


def test_disk_cache_treats_a_torn_or_invalid_file_as_a_miss(tmp_path):
    cache = DiskReplyCache(tmp_path)
    cache.put("ab12-0", completion("<answer>A</answer>"))
    assert cache.get("ab12-0") == completion("<answer>A</answer>")
    damaged = {
        "ab12-1": b'{"id": ',  # cut short
        "ab12-2": json.dumps(completion(None)).encode(),  # null content, as an older Loupe could store
        "ab12-3": json.dumps({"id": "x"}).encode(),  # no choices
        "ab12-4": b"\xff\xfe not utf-8",
        "ab12-5": b"[" * 100_000 + b"]" * 100_000,  # nests past the parser's recursion limit
        "ab12-6": b"[]",
    }
    for key, raw in damaged.items():
        (tmp_path / "ab" / f"{key}.json").write_bytes(raw)
    assert [cache.get(key) for key in damaged] == [None] * len(damaged)
    assert cache.get("cd34-0") is None
    assert (cache.hits, cache.misses) == (1, len(damaged) + 1)
    cache.put("ab12-2", completion("fresh"))  # the refetched reply takes the damaged one's place
    assert cache.get("ab12-2") == completion("fresh")
    assert not [p for p in tmp_path.rglob("*.tmp")]
    assert os.listdir(tmp_path) == ["ab"]


def cache_files_all_validate(cache: Path) -> int:
    """The number of cached replies, after checking that each validates and none is a malformed reply."""
    files = list(cache.rglob("*.json"))
    for path in files:
        reply = validate_reply(json.loads(path.read_text()))
        assert reply.text != MALFORMED_TEXT, path
    return len(files)


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_a_rerun_after_a_malformed_reply_pays_only_for_what_is_missing(kind, responder, synth_tasks_dir,  # noqa: F811
                                                                        tmp_path, monkeypatch):
    """The teacher (shared engine + disk cache) meets one malformed reply with no retry left: the run fails as an
    endpoint error, the cache holds only good replies, and a rerun succeeds paying once for each missing turn."""
    monkeypatch.setenv(KEY_ENV, KEY)
    tasks = train_tasks(synth_tasks_dir)[:2]
    protocol = get_protocol("mini_o3")
    params = OpenAITeacherParams(exemplars=str(EXEMPLARS), cache_dir=str(tmp_path / "cache"))
    with FakeOpenAIServer(responder, api_key=KEY) as server:
        endpoint = OpenAIEndpointParams(base_url=server.base_url, model="fake-model", api_key_env=KEY_ENV,
                                        concurrency=2, max_retries=0, timeout_s=5.0)

        def run():
            teacher = build_openai_teacher(endpoint, params, protocol, temperature=0.7, top_p=1.0, seed=0)
            try:
                return run_rollouts(tasks, teacher, ProtocolParams(), synth_tasks_dir), teacher.usage
            finally:
                teacher.close()

        server.add_faults(Fault.malformed(kind))
        answered_before = responder.answered
        with pytest.raises(EndpointError, match="failed after 1 attempt \\(malformed reply: "):
            run()
        cached = cache_files_all_validate(tmp_path / "cache")
        assert cached == 1  # the sibling request in flight when the fault came was kept
        trajectories, usage = run()
        paid = responder.answered - answered_before
        sent = server.count()
    turns = sum(t.num_turns for t in trajectories)
    assert [t.end_reason for t in trajectories] == ["answered"] * 2
    assert all(MALFORMED_TEXT not in turn.text for t in trajectories for turn in t.turns)
    assert paid == turns and sent == turns + 1  # every turn paid once; the one malformed attempt on top
    assert (usage.cached_requests, usage.requests) == (cached, turns - cached)
    assert cache_files_all_validate(tmp_path / "cache") == turns


@pytest.mark.parametrize("kind", ["not_json", "null_content"])
def test_the_stage_fails_on_malformed_replies_and_a_rerun_resumes(kind, responder, synth_tasks_dir,  # noqa: F811
                                                                  tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, KEY)
    second_shard = second_shard_questions(responder, synth_tasks_dir)
    with FakeOpenAIServer(responder, api_key=KEY) as server:
        params = teacher_params(tmp_path, server, tmp_path / "cache", max_retries=1)
        out = tmp_path / "out"
        responder.fail_when = lambda question, turn: question in second_shard and turn == 1
        responder.failure = Fault.malformed(kind)
        before = responder.answered
        try:
            code = main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"])
        finally:
            responder.fail_when, responder.failure = None, None
        err = capsys.readouterr().err
        assert code == 1 and "failed after 2 attempts (malformed reply:" in err and "rerun to resume" in err
        cache_files_all_validate(tmp_path / "cache")
        assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"]) == 0
        paid_in_total = responder.answered - before
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["accepted"] == 6 * SAMPLES
    assert paid_in_total == sum(int(n) * c for n, c in metrics["turns_histogram_all"].items())
    assert metrics["teacher_usage"]["failed_requests"] == 0 and metrics["teacher_usage"]["cached_requests"] > 0

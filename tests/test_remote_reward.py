"""The remote reward model (OpenRLHF's --remote_rm_url format) against a loopback server that fails, stalls and
misreplies: every trajectory gets its own score exactly once, a cache answers reruns, and a server that never
recovers leaves rewards invalid, never 0."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from loupe.remote_reward import RemoteItem, RemoteRewardConfig, RemoteRewardModel, parse_rewards, remote_item
from loupe.rewards import RewardConfig
from loupe.trajectory import Trajectory, Turn
from stages.rl.params import RLParams
from stages.rl.workers import RewardPool


def expected_reward(query: str, label: str) -> float:
    """What the server answers: 1 when the label is the last answer, plus a fraction unique to the query, so a
    score handed to the wrong trajectory (or a batch's scores shifted) shows."""
    answer = query.rsplit("<answer>", 1)[-1].split("</answer>", 1)[0].strip()
    unique = int(hashlib.sha256(query.encode()).hexdigest()[:6], 16) / 16**6
    return float(answer == label) + unique / 10


class Server:
    """OpenRLHF's reward server shape (`POST /get_reward`: query, prompts, labels -> rewards), with scripted faults.

    `faults` is consumed one per request: "500", "429", "stall" (answers after the client's time-out),
    "short" (one reward too few), "garbage" (not JSON), "drop" (closes the connection), or None (a good reply).
    """

    def __init__(self, faults: list[str | None] | None = None, always: str | None = None):
        self.faults = list(faults or [])
        self.always = always
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.scored: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test's output readable
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    fault = server.always or (server.faults.pop(0) if server.faults else None)
                if self.path != "/get_reward":
                    return self._reply(404, b"no such path")
                if fault == "drop":
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                if fault in ("500", "429"):
                    return self._reply(int(fault), b"busy", {"Retry-After": "0"})
                if fault == "stall":
                    time.sleep(1.5)
                rewards = [expected_reward(q, lab) for q, lab in zip(body["query"], body["labels"])]
                if fault == "short":
                    rewards = rewards[:-1]
                if fault == "garbage":
                    return self._reply(200, b"<html>oops</html>")
                if fault is None:
                    with server.lock:
                        for q in body["query"]:
                            server.scored[q] = server.scored.get(q, 0) + 1
                self._reply(200, json.dumps({"rewards": rewards, "scores": rewards, "extra_logs": {}}).encode())

            def _reply(self, status, payload, headers=None):
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a stalled reply's client has gone: expected
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _trajectory(k: int, answer: str, solution: str = "12") -> Trajectory:
    task = {"doc_id": f"q{k}", "images": ["x.png"], "problem": "How many?", "solution": solution}
    t = Trajectory(traj_id=f"q{k}#0", task=task, protocol="mini_o3", system="", end_reason="answered", answer=answer)
    t.turns = [Turn("user", f"<image>\nHow many apples in picture {k}?", images=[0]),
               Turn("assistant", f"<think>count</think><answer>{answer}</answer>", action="answer")]
    return t


def _config(url: str, **overrides) -> RemoteRewardConfig:
    values = {"url": url, "batch_size": 3, "concurrency": 2, "timeout_s": 0.5, "max_retries": 4, "backoff_s": 0.01,
              "max_backoff_s": 0.05}
    return RemoteRewardConfig(**{**values, **overrides})


def test_request_layout_is_openrlhfs():
    item = remote_item(_trajectory(3, "12"))
    assert item.prompt == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nHow many apples in picture 3?" \
                          "<|im_end|>\n<|im_start|>assistant\n"
    assert item.query.startswith(item.prompt)
    assert item.query.endswith("<think>count</think><answer>12</answer><|im_end|>\n")
    assert item.label == "12"
    with Server() as server:
        RemoteRewardModel(_config(server.url)).score_many([item])
        assert server.requests == [{"query": [item.query], "prompts": [item.prompt], "labels": ["12"]}]


def test_faults_and_stalls_lose_and_double_count_nothing(tmp_path):
    trajectories = [_trajectory(k, "12" if k % 3 else "7") for k in range(10)]
    items = [remote_item(t) for t in trajectories]
    faults = ["500", "stall", "short", "garbage", "drop", None, "429", "500", None, "stall"]
    with Server(faults) as server:
        model = RemoteRewardModel(_config(server.url, name="math-rm", cache_dir=str(tmp_path / "cache")))
        scores = model.score_many(items)
        assert [s.valid for s in scores] == [True] * 10
        assert [s.reward for s in scores] == [expected_reward(i.query, i.label) for i in items]
        assert sorted(server.scored.values()) == [1] * 10, "each query scored by exactly one good reply"
        requests = len(server.requests)
        assert requests == 4 + sum(f is not None for f in faults)  # 4 batches of <= 3, one more request a fault

        again = model.score_many(items[::-1])
        assert [s.reward for s in again] == [s.reward for s in scores[::-1]]
        assert all(s.cached for s in again) and len(server.requests) == requests

    moved = _config("http://127.0.0.1:9/get_reward", name="math-rm", cache_dir=str(tmp_path / "cache"), max_retries=0)
    assert [s.reward for s in RemoteRewardModel(moved).score_many(items)] == [s.reward for s in scores], \
        "the disk cache outlives the run and the server's address"
    renamed = RemoteRewardModel(moved.model_copy(update={"name": "math-rm-v2"}))
    assert not any(s.valid for s in renamed.score_many(items[:1])), "another reward model's scores are not reused"


def test_repeated_samples_in_one_call_are_asked_once():
    t = _trajectory(1, "12")
    with Server() as server:
        scores = RemoteRewardModel(_config(server.url)).score_many([remote_item(t)] * 4)
        assert len({s.reward for s in scores}) == 1 and len(scores) == 4
        assert [len(r["query"]) for r in server.requests] == [1]


def test_a_server_that_never_recovers_leaves_rewards_invalid_not_zero():
    items = [remote_item(_trajectory(k, "12")) for k in range(4)]
    with Server(always="500") as server:
        model = RemoteRewardModel(_config(server.url, max_retries=2))
        scores = model.score_many(items)
        assert all(not s.valid and s.reward is None for s in scores)
        assert "failed after 3 attempts" in scores[0].error
        assert len(server.requests) == 2 * 3  # two batches, three attempts each
        assert model.stats()["failures"] == 4


def test_a_wrong_request_is_not_retried():
    with Server() as server:
        model = RemoteRewardModel(_config(server.url.replace("/get_reward", "/wrong")))
        [result] = model.score_many([remote_item(_trajectory(0, "12"))])
        assert not result.valid and "HTTP 404" in result.error
        assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("body", "problem"),
    [(b"[1, 2]", "no 'rewards'"), (b'{"rewards": [1]}', "should list 2"), (b'{"rewards": [1, NaN]}', "finite"),
     (b'{"rewards": [1, true]}', "finite"), (b'{"rewards": "1,2"}', "should list 2")],
)
def test_malformed_replies_are_refused(body, problem):
    with pytest.raises(Exception, match=problem):
        parse_rewards(body, 2)
    assert parse_rewards(b'{"rewards": [1, 0.5]}', 2) == [1.0, 0.5]


def test_rl_reward_pool_takes_the_servers_reward_as_total():
    trajectories = [_trajectory(k, a) for k, a in enumerate(["12", "7", "12"])]
    with Server(["500"]) as server:
        pool = RewardPool(RewardConfig(), remote=_config(server.url))
        parts = pool.score(trajectories)
    for t, p in zip(trajectories, parts):
        item = remote_item(t)
        assert p["total"] == expected_reward(item.query, item.label)
        assert p["rule_total"] == p["accuracy"] == float(t.answer == "12")
    with Server(always="500") as server:
        pool = RewardPool(RewardConfig(), remote=_config(server.url, max_retries=0))
        failed = pool.score(trajectories)
    assert all(p["valid"] is False and p["total"] is None and "remote reward" in p["invalid_reason"] for p in failed)


def test_rl_params_take_one_replacement_reward(tmp_path):
    params = RLParams(remote_reward={"url": "http://127.0.0.1:5000/get_reward"})
    assert params.remote_reward.batch_size == 32
    with pytest.raises(ValidationError, match="keep one of them"):
        RLParams(remote_reward={"url": "http://127.0.0.1:5000/get_reward"}, custom_reward="r.py:f")
    with pytest.raises(ValidationError):
        RLParams(remote_reward={"url": "127.0.0.1:5000"})
    assert RemoteItem("q", "p", "l").label == "l"

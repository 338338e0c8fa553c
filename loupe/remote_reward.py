"""A reward model behind HTTP, in OpenRLHF's `--remote_rm_url` format: the rl stage's `rl.remote_reward`.

The wire format is OpenRLHF's, so a server written for OpenRLHF or LMM-R1 (LMM-R1's math verifier,
`openrlhf/models/remote_rm/math_verifier.py`; OpenRLHF's `openrlhf/cli/serve_rm.py`) serves Loupe unchanged:

    POST <url>   {"query": [str, ...], "prompts": [str, ...], "labels": [str, ...]}
    200          {"rewards": [float, ...], ...}        one reward per query, in order

`query` is the whole dialogue rendered as ChatML (`<|im_start|>role\\n…<|im_end|>\\n`, images as
`<|vision_start|><|image_pad|><|vision_end|>`), as OpenRLHF decodes prompt and response with special tokens
kept; `prompts` is the rendered question up to `<|im_start|>assistant\\n` (LMM-R1's server cuts the response
from the query at that marker); `labels` is the task's reference answer. OpenRLHF's clients (the old
`openrlhf/utils/remote_rm_utils.py`, `request_api_wrapper`, and the current `openrlhf/utils/agent.py`,
`SingleTurnAgentExecutor._fetch_rewards_via_http`) read `rewards`; newer ones also read `scores` and
`extra_logs`, which Loupe ignores.

What Loupe adds to OpenRLHF's client (5 tries, 1 s apart, then an exception or a None reward):
- **batches** of `batch_size` trajectories a request (OpenRLHF's newest client sends one; its older one the
  whole rollout batch split across servers), `concurrency` requests in flight;
- **checked replies**: a reply that is not a JSON object with a list of finite numbers under `rewards`, one
  per query, is a failed attempt and is retried; never half-used;
- **retries with backoff** (`loupe.endpoint.RetryPolicy`, Retry-After obeyed) on 408/409/429/5xx, time-outs
  and dropped connections; other 4xx fail at once (the request itself is wrong);
- **a cache** (memory, and disk when `cache_dir` is set) keyed on the server name, query, prompt and label, so
  a rerun or a resumed run pays nothing twice, and a sample repeated within a batch is sent once;
- **invalid, never zero**: a batch that still fails leaves each of its trajectories with an invalid reward
  (`valid=False`, total None), which the rl stage drops like a failed judge's, rather than a score of 0.

Written on `httpx` (already installed with `openai`) rather than the `openai` client: this is not a chat API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from loupe import endpoint
from loupe.io import atomic_write_json
from loupe.protocol import IMAGE_PLACEHOLDER
from loupe.trajectory import Trajectory

log = logging.getLogger(__name__)

IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
"""How Qwen2.5-VL's chat template writes one image in a message; `<image>` placeholders are rendered so."""


class RemoteRewardConfig(BaseModel):
    """Where the reward server is and how patiently to ask it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = Field(pattern=r"^https?://")
    """The endpoint the batches are POSTed to, path included (OpenRLHF's examples: http://host:5000/get_reward)."""
    name: str | None = None
    """The reward model's name in the cache key; None uses `url`. Set it to keep the cache when the server moves,
    change it when the server's scoring changes."""
    batch_size: int = Field(default=32, ge=1)
    """Trajectories a request carries."""
    concurrency: int = Field(default=4, ge=1)
    """Requests in flight at once."""
    timeout_s: float = Field(default=180.0, gt=0)
    """Seconds one request may take (OpenRLHF's client: 180)."""
    max_retries: int = Field(default=4, ge=0)
    """Retries after the first attempt (OpenRLHF: 5 attempts in all)."""
    backoff_s: float = Field(default=1.0, ge=0)
    """First wait before a retry; each later one doubles, with +-50% jitter (OpenRLHF: a fixed 1 s)."""
    max_backoff_s: float = Field(default=30.0, ge=0)
    """Cap on one wait; a server's Retry-After (at most two minutes) is obeyed even when longer."""
    cache_dir: str | None = None
    """Folder of cached rewards (one JSON file each); None keeps them in memory for the run only."""


class RemoteItem(NamedTuple):
    """One trajectory as the server sees it."""

    query: str
    prompt: str
    label: str


@dataclass(frozen=True)
class RemoteScore:
    """One trajectory's reward from the server: `reward` None and `valid` False when every attempt failed."""

    reward: float | None
    valid: bool
    cached: bool = False
    error: str | None = None


class BadReply(endpoint.EndpointFault):
    """An HTTP 200 whose body cannot be used; the attempt counts as failed."""


def _chatml(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text.replace(IMAGE_PLACEHOLDER, IMAGE_MARKUP)}<|im_end|>\n"


def remote_item(trajectory: Trajectory) -> RemoteItem:
    """The query, prompt and label OpenRLHF's format sends for `trajectory` (module docstring)."""
    turns = trajectory.turns
    first_user = next((i for i, turn in enumerate(turns) if turn.role == "user"), None)
    prompt_turns = turns[: first_user + 1] if first_user is not None else []
    prompt = "".join(_chatml(t.role, t.text) for t in prompt_turns) + "<|im_start|>assistant\n"
    query = "".join(_chatml(t.role, t.text) for t in turns)
    return RemoteItem(query, prompt, str(trajectory.task.get("solution", "")))


def parse_rewards(body: bytes, expected: int) -> list[float]:
    """The `rewards` list of a reply body, checked: JSON object, a list of `expected` finite numbers."""
    try:
        reply = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise BadReply(f"reply is not JSON ({err}): {body[:80]!r}") from None
    if not isinstance(reply, dict) or "rewards" not in reply:
        raise BadReply(f"reply has no 'rewards' key: {body[:80]!r}")
    rewards = reply["rewards"]
    if not isinstance(rewards, list) or len(rewards) != expected:
        size = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
        raise BadReply(f"'rewards' should list {expected} numbers, one per query; got {size}")
    for value in rewards:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadReply(f"'rewards' holds {value!r}, not a finite number")
    return [float(value) for value in rewards]


class RemoteRewardModel:
    """Scores trajectories through a remote reward server; see the module docstring for the policy."""

    def __init__(self, config: RemoteRewardConfig):
        self.config = config
        self.name = config.name or config.url
        self.policy = endpoint.RetryPolicy(config.max_retries, config.backoff_s, config.max_backoff_s)
        self._memory: dict[str, float] = {}
        self._lock = threading.Lock()
        self.requests = 0
        self.cache_hits = 0
        self.failures = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"requests": self.requests, "cache_hits": self.cache_hits, "failures": self.failures}

    # -- cache --

    def cache_key(self, item: RemoteItem) -> str:
        payload = json.dumps([self.name, item.query, item.prompt, item.label])
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def _cache_path(self, key: str) -> Path | None:
        if self.config.cache_dir is None:
            return None
        return Path(self.config.cache_dir) / key[:2] / f"{key}.json"

    def _cached(self, key: str) -> float | None:
        with self._lock:
            if key in self._memory:
                return self._memory[key]
        path = self._cache_path(key)
        if path is None or not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            reward = entry["reward"]
            if entry.get("name") != self.name or isinstance(reward, bool) or not isinstance(reward, (int, float)):
                return None
            return float(reward)
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None  # a torn or foreign entry is a miss; the fresh reward overwrites it

    def _remember(self, key: str, item: RemoteItem, reward: float) -> None:
        with self._lock:
            self._memory[key] = reward
        path = self._cache_path(key)
        if path is not None:
            try:
                atomic_write_json(path, {"name": self.name, "label": item.label, "query": item.query,
                                         "reward": reward})
            except OSError as err:  # a full disk must not lose the reward already received
                log.warning("remote reward cache write failed at %s: %s", path, err)

    # -- requests --

    def _post(self, client: Any, items: Sequence[RemoteItem]) -> list[float]:
        """One batch, retried by the policy; raises `endpoint.EndpointError` when the attempts run out."""
        import httpx

        payload = {"query": [i.query for i in items], "prompts": [i.prompt for i in items],
                   "labels": [i.label for i in items]}
        attempts, cause = 0, "no attempt made"
        for retry in range(self.policy.max_retries + 1):
            attempts += 1
            with self._lock:
                self.requests += 1
            retry_after = 0.0
            try:
                response = client.post(self.config.url, json=payload)
                if response.status_code != 200:
                    cause = f"HTTP {response.status_code}: {response.text[:200]!r}"
                    if response.status_code < 500 and response.status_code not in endpoint.RETRYABLE_STATUS:
                        break
                    retry_after = endpoint.retry_after_seconds(response.headers)
                else:
                    return parse_rewards(response.content, len(items))
            except httpx.TransportError as err:  # time-outs, refused and dropped connections
                cause = f"{type(err).__name__}: {err}"
            except BadReply as err:
                cause = f"malformed reply: {err}"
            if retry < self.policy.max_retries:
                delay = self.policy.delay(retry, retry_after)
                log.warning("reward server %s: attempt %d/%d failed (%s); retrying in %.2fs",
                            self.config.url, attempts, self.policy.max_retries + 1, cause, delay)
                time.sleep(delay)
        raise endpoint.EndpointError(f"reward server {self.config.url}: failed after {attempts} attempts ({cause})",
                                     attempts, cause)

    def score_many(self, items: Sequence[RemoteItem]) -> list[RemoteScore]:
        """A score per item, in order: cached ones without a request, the rest in batches of `batch_size`."""
        import httpx

        keys = [self.cache_key(item) for item in items]
        results: dict[str, RemoteScore] = {}
        todo: dict[str, RemoteItem] = {}
        for key, item in zip(keys, items):
            if key in results or key in todo:
                continue  # the same sample twice in one call is asked once
            reward = self._cached(key)
            if reward is None:
                todo[key] = item
            else:
                with self._lock:
                    self.cache_hits += 1
                results[key] = RemoteScore(reward, True, cached=True)
        pending = list(todo.items())
        batches = [pending[i: i + self.config.batch_size] for i in range(0, len(pending), self.config.batch_size)]

        def run(batch: list[tuple[str, RemoteItem]], client: Any) -> dict[str, RemoteScore]:
            try:
                rewards = self._post(client, [item for _, item in batch])
            except endpoint.EndpointError as err:
                log.error("%s", err)
                with self._lock:
                    self.failures += len(batch)
                return {key: RemoteScore(None, False, error=str(err)) for key, _ in batch}
            for (key, item), reward in zip(batch, rewards):
                self._remember(key, item, reward)
            return {key: RemoteScore(reward, True) for (key, _), reward in zip(batch, rewards)}

        if batches:
            with httpx.Client(timeout=self.config.timeout_s) as client, ThreadPoolExecutor(
                max_workers=min(self.config.concurrency, len(batches)), thread_name_prefix="remote-rm"
            ) as pool:
                for done in pool.map(lambda batch: run(batch, client), batches):
                    results.update(done)
        return [results[key] for key in keys]

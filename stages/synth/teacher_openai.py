"""The openai teacher: any OpenAI-compatible VLM, shown a few hand-written exemplars, with a reply cache.

It is the shared `OpenAIEngine` (concurrency, retries with backoff, token counts) with three additions:
- few-shot exemplars (stages/synth/exemplars/*.json, validated against the protocol when loaded) appended to
  the system prompt the endpoint sees; the trajectory keeps the plain protocol prompt, which is what the
  student is trained and later prompted with;
- a disk cache of replies (`DiskReplyCache`) keyed by request and occurrence: an interrupted or repeated run
  pays for no request twice; only validated replies are stored, and an entry that fails validation on reading
  is discarded and asked for again;
- per-sample seeds come from the shared engine: the n-th identical request carries `seed + n`.

The API key is read by the engine from the environment variable `rollout.openai.api_key_env` names; it is
never in a cache key, a cached file, a log line, metrics or MLflow parameters.

Exemplar file format (one trajectory per file; images are described in words, never shipped):

    {"protocol": "mini_o3", "image": "a 4000x3000 photo of ...", "question": "...", "options": null,
     "solution": "...", "turns": [{"assistant": "<think>…</think>\\n<grounding>…</grounding>"},
                                  {"observation": "what the crop shows"}, {"assistant": "… <answer>…</answer>"}]}
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from loupe.config import OpenAIEndpointParams
from loupe.data.tasks import TaskRecord
from loupe.endpoint import MalformedReply, validate_reply
from loupe.io import atomic_write_json
from loupe.protocol import IMAGE_PLACEHOLDER, PROTOCOLS, Protocol
from loupe.rewards import RewardConfig, score
from loupe.rollout.openai_engine import OpenAIEngine, UsageCounter
from stages.synth.params import OpenAITeacherParams

log = logging.getLogger(__name__)


class ExemplarError(ValueError):
    """An exemplar file that is not a valid trajectory in the protocol's format; names the file and turn."""


@dataclass(frozen=True)
class Exemplar:
    name: str
    text: str
    """The exemplar rendered as a dialogue transcript for the system prompt."""


def _describe(description: str) -> str:
    return f"[image: {description}]"


def load_exemplars(folder: str | Path, protocol: Protocol) -> list[Exemplar]:
    """Every `*.json` exemplar in `folder` written in `protocol`'s grammar, checked turn by turn, in file-name order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: exemplar folder not found")
    exemplars = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ExemplarError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ExemplarError(f"{path}: an exemplar must be a JSON object")
        written_for = PROTOCOLS.get(str(data.get("protocol", "mini_o3")))
        # An exemplar serves every protocol of its grammar (mini_o3 and loupe differ only in their prompts).
        if written_for is None or (written_for.call_open, written_for.multi_turn) != (protocol.call_open, protocol.multi_turn):
            continue
        exemplars.append(Exemplar(path.stem, _render(path, data, protocol)))
    if not exemplars:
        raise ExemplarError(f"{folder}: no exemplar written for the {protocol.name} protocol")
    return exemplars


def _render(path: Path, data: dict[str, Any], protocol: Protocol) -> str:
    for key in ("image", "question", "solution", "turns"):
        if key not in data:
            raise ExemplarError(f"{path}: field '{key}' is missing")
    try:
        task = TaskRecord(doc_id=path.stem, images=["exemplar"], problem=data["question"],
                          solution=data["solution"], options=data.get("options"))
    except ValueError as err:
        raise ExemplarError(f"{path}: {err}") from None
    question = protocol.question_text(task).replace(IMAGE_PLACEHOLDER, _describe(data["image"]))
    lines = [f"User: {question}"]
    observations, answer = 0, None
    turns = data["turns"]
    for i, turn in enumerate(turns):
        where = f"{path}: turns.{i}"
        if not isinstance(turn, dict) or len(turn) != 1 or not isinstance(next(iter(turn.values())), str):
            raise ExemplarError(f"{where}: each turn is {{\"assistant\": text}} or {{\"observation\": description}}")
        role, text = next(iter(turn.items()))
        expected = "assistant" if i % 2 == 0 else "observation"
        if role != expected:
            raise ExemplarError(f"{where}: expected an {expected} turn, got {role!r}")
        if role == "observation":
            observations += 1
            lines.append(f"User: {protocol.observation_turn(observations).replace(IMAGE_PLACEHOLDER, _describe(text))}")
            continue
        action = protocol.parse(text, observations)
        if action.error is not None:
            raise ExemplarError(f"{where}: {action.error.kind.value}: {action.error.detail}")
        last = i == len(turns) - 1
        if last != (action.answer is not None):
            raise ExemplarError(f"{where}: only the last turn answers, and it must")
        answer = action.answer
        lines.append(f"Assistant: {text}")
    parts = score(task, answer, "answered", observations, 0, True, RewardConfig())
    if parts.accuracy != 1.0:
        raise ExemplarError(f"{path}: the final answer {answer!r} does not match the solution {data['solution']!r}")
    return "\n".join(lines)


def few_shot_block(exemplars: list[Exemplar]) -> str:
    shown = "\n\n".join(f"Example {i + 1}:\n{e.text}" for i, e in enumerate(exemplars))
    return (
        "\n\nBelow are examples of good searches. Their images are described in brackets; yours are real "
        "images. Follow the same format exactly, one action per turn.\n\n" + shown
    )


class DiskReplyCache:
    """Chat completions on disk, one JSON file per request key (`<dir>/<key[:2]>/<key>.json`), written atomically.

    Safe across threads and processes (each write is a rename). A file that cannot be read or decoded, or whose
    reply does not pass `loupe.endpoint.validate_reply` (cut short, another shape, written by an older Loupe
    that stored malformed replies), counts as a miss, so the reply is asked for again and the fresh one takes
    its place. The engine stores only replies that validated.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        path = self._path(key)
        try:
            reply = json.loads(path.read_text(encoding="utf-8"))
            validate_reply(reply)
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, RecursionError, MalformedReply) as err:
            # ValueError covers bad JSON and bad UTF-8 (UnicodeDecodeError is one).
            # Not deleted: the fresh reply's atomic rename replaces it, and a delete could race another process's
            # rename of a good reply into the same place.
            log.warning("reply cache: %s is not a valid reply (%s); it is ignored and asked for again", path, err)
            self.misses += 1
            return None
        self.hits += 1
        return reply

    def put(self, key: str, reply: dict[str, Any]) -> None:
        atomic_write_json(self._path(key), reply)


class FewShotOpenAIEngine(OpenAIEngine):
    """The shared OpenAI engine with exemplars in the system prompt."""

    name = "openai_teacher"

    def __init__(
        self,
        endpoint: OpenAIEndpointParams,
        exemplars: list[Exemplar],
        num_exemplars: int,
        stop: tuple[str, ...] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        cache: DiskReplyCache | None = None,
    ):
        super().__init__(endpoint, stop, temperature, top_p, seed, cache=cache)
        self.exemplars = exemplars
        self.num_exemplars = min(num_exemplars, len(exemplars))

    def begin(self, system: str, question: str, images: list[Image.Image]) -> Any:
        if self.num_exemplars:
            # Chosen by the question, so a rerun sends the very same prompt (and hits the cache).
            chosen = random.Random(f"loupe-exemplars/{question}").sample(self.exemplars, self.num_exemplars)
            system = system + few_shot_block(chosen)
        return super().begin(system, question, images)


def build_openai_teacher(
    endpoint: OpenAIEndpointParams,
    params: OpenAITeacherParams,
    protocol: Protocol,
    temperature: float,
    top_p: float,
    seed: int,
) -> FewShotOpenAIEngine:
    exemplars = load_exemplars(params.exemplars, protocol) if params.num_exemplars else []
    temperature = params.temperature if params.temperature is not None else temperature
    cache = DiskReplyCache(params.cache_dir)
    return FewShotOpenAIEngine(endpoint, exemplars, params.num_exemplars, protocol.stop_strings(), temperature, top_p, seed, cache)


def usage_report(usage: UsageCounter, params: OpenAITeacherParams) -> dict[str, Any]:
    """Requests, tokens and cost of this run (paid requests), and what the cache saved."""

    def cost(prompt: int, completion: int) -> float:
        return round(prompt / 1000 * params.price_per_1k_prompt_tokens
                     + completion / 1000 * params.price_per_1k_completion_tokens, 6)

    return {
        "requests": usage.requests,
        "failed_requests": usage.failed_requests,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cost": cost(usage.prompt_tokens, usage.completion_tokens),
        "cached_requests": usage.cached_requests,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "cached_completion_tokens": usage.cached_completion_tokens,
        "cost_saved_by_cache": cost(usage.cached_prompt_tokens, usage.cached_completion_tokens),
    }

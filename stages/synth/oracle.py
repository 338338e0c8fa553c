"""The oracle teacher: an `Engine` that knows each synthetic task's target box and writes varied, correct searches.

It runs through the shared rollout loop (`loupe.rollout.run_rollouts`) like any model, so its calls go through
the real protocol parser and crop tool, its observations are real crops, and the trajectories it leaves are
exactly what a model would have produced. Per trajectory it draws a search plan from its own random stream
(seeded by the run's seed, the task's id and the sample index, so a rerun writes the same words):

- `direct`: zoom on the target, answer (2 turns);
- `wide_then_close`: a wide look around the target, then closer looks (3+ turns);
- `wrong_then_right`: one or more looks at regions without the target, each noticed and corrected (3+ turns);
- `observation_zoom`: a wide look, then zooms into the observation rather than the original (3+ turns);
- `reason`: tasks with no target box but a worked `rationale` (the recipe families: arithmetic, counting,
  geometry) are answered at once, the rationale as the reasoning (1 turn);
- `follow`: tasks with a search path (`waypoints`: a pointer task's pointer, loupe.data.zoom_tasks) get a look
  at each waypoint, what it showed said in the next turn, then the look at the target (3+ turns), into the last
  waypoint's observation when the target lies inside it (a depth-2 zoom task's zoom into a zoom); `glance`
  weighs against `direct` for them;
- `operate`: tasks that name a visual `operation` (loupe.data.operation_tasks) get that operation's calls on
  their `bbox`: `read_text` on a sign's box, `segment_at` on an object's centre then `get_properties` on its
  mask, `track_object` from a square's box on the first frame; then the answer the result gives (2-3 turns).
  Only a protocol with those calls (`pixelis`) can write them;
- `glance`: no zoom: a guess from the downscaled view (1 turn), right only by chance, as a real teacher that
  skips the search sometimes is. Rejection by answer keeps the lucky guesses, so a cold start with glances
  teaches a model that answering at once sometimes pays and zooming pays more: RL's job is to learn the
  difference (docs/learning.md). Free-form guesses are drawn from the answers of the prepared tasks.

The pattern mix and the turn-count distribution are `synth.oracle` parameters. Reasoning text comes from
stages/synth/wording.py. The oracle never sees pixels: it places every box from the task's ground-truth
`bbox`, and maps boxes into an observation's frame from the region that observation shows.

The loop calls `begin` with the rendered question only, so `prepare(tasks, samples)` tells the oracle which
tasks come next; questions are matched in the loop's order (task by task, sample by sample).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from loupe.data.tasks import IMAGE_PLACEHOLDER, OPTION_LETTERS, TaskRecord
from loupe.protocol import ORIGINAL_IMAGE, Protocol, ToolCall
from loupe.rollout.engine import Engine, Generation
from stages.synth.params import OracleParams
from stages.synth.wording import Box, Sentence, Wording, area_name, fit_sentences

CHARS_PER_TOKEN = 2.5
"""A conservative characters-per-token estimate (Qwen's tokenizer averages about 4, the tiny model's about 2.9):
the oracle keeps each turn within `max_new_tokens` by this measure."""


class OracleError(ValueError):
    """A task the oracle cannot search (no target box), or a question it was not prepared for."""


@dataclass(frozen=True)
class Look:
    """One planned zoom."""

    role: str
    """`wrong` (a region without the target), `wide` (holds the target, too coarse), `waypoint` (a place the
    task's search path passes: a pointer), or `close` (answerable)."""
    region: Box
    """What the crop shows, relative to the original image."""
    source: int
    """0 for the original image, N for observation N."""
    box: Box
    """The call's box, relative to the source."""
    seen: str = ""
    """What a `waypoint` look shows (the task's words), said in the turn after it."""


@dataclass
class Plan:
    pattern: str
    looks: list[Look]
    calls: list[ToolCall] = field(default_factory=list)
    """The visual operations of an `operate` plan, in order."""


def operation_calls(task: TaskRecord) -> list[ToolCall]:
    """The calls that answer a task naming a visual `operation`, on its `bbox` (relative to its first image or
    frame)."""
    box = list(task.bbox or ())
    if task.operation == "segment_at":
        point = [(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]
        return [ToolCall("segment_at", {"point": point}), ToolCall("get_properties", {"mask": "mask_1"})]
    if task.operation in ("read_text", "track_object"):
        return [ToolCall(task.operation, {"bbox_2d": box})]
    raise OracleError(f"task {task.doc_id}: the oracle has no plan for operation {task.operation!r}; it knows "
                      "read_text, segment_at and track_object")


@dataclass
class _OracleState:
    task: TaskRecord
    plan: Plan
    wording: Wording
    tokens: int
    step: int = 0
    observations: int = 0
    failed: bool = False
    original_size: tuple[int, int] | None = None
    """The original image's width and height, when the protocol's boxes are in its pixels (deepeyes)."""


def _rationale(task: TaskRecord) -> str:
    """A recipe task's worked solution (an extra record field), or '' when it has none."""
    value = (task.model_extra or {}).get("rationale")
    return value.strip() if isinstance(value, str) else ""


# --- geometry -------------------------------------------------------------------------------------------------


def _place(center: float, size: float) -> tuple[float, float]:
    """An interval of `size` centred at `center`, shifted to lie inside [0, 1]."""
    size = min(size, 1.0)
    low = min(max(center - size / 2, 0.0), 1.0 - size)
    return low, low + size


def _around(target: Box, margin: float, min_side: float) -> Box:
    """The target grown by `margin` target-sizes on each side, at least `min_side` wide and tall, inside [0, 1]."""
    tw, th = target[2] - target[0], target[3] - target[1]
    w = max(tw * (1 + 2 * margin), min_side)
    h = max(th * (1 + 2 * margin), min_side)
    x0, x1 = _place((target[0] + target[2]) / 2, w)
    y0, y1 = _place((target[1] + target[3]) / 2, h)
    return x0, y0, x1, y1


def _containing(inner: Box, side: float, rng: random.Random) -> Box:
    """A box of `side` (grown to hold `inner` if needed) at a random position that holds `inner`."""
    out = []
    for low, high in ((inner[0], inner[2]), (inner[1], inner[3])):
        size = min(1.0, max(side, high - low))
        start = rng.uniform(max(0.0, high - size), min(low, 1.0 - size))
        out.append((start, start + size))
    (x0, x1), (y0, y1) = out
    return x0, y0, x1, y1


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _away_from(target: Box, side: float, rng: random.Random, avoid: list[Box]) -> Box | None:
    """A box of `side` that shows none of the target (with a gap) and does not repeat an earlier wrong look."""
    tw, th = target[2] - target[0], target[3] - target[1]
    guard = (target[0] - tw, target[1] - th, target[2] + tw, target[3] + th)
    for _ in range(200):
        x0, y0 = rng.uniform(0.0, 1.0 - side), rng.uniform(0.0, 1.0 - side)
        box = (x0, y0, x0 + side, y0 + side)
        if not _overlaps(box, guard) and all(_center_distance(box, other) > side / 2 for other in avoid):
            return box
    return None


def _center_distance(a: Box, b: Box) -> float:
    return math.dist(((a[0] + a[2]) / 2, (a[1] + a[3]) / 2), ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2))


def _within(region: Box, frame: Box) -> Box:
    """`region` (original coordinates) in the coordinates of `frame`, clipped to it."""
    fw, fh = frame[2] - frame[0], frame[3] - frame[1]
    x0, x1 = ((v - frame[0]) / fw for v in (region[0], region[2]))
    y0, y1 = ((v - frame[1]) / fh for v in (region[1], region[3]))
    x0, y0 = max(0.0, x0), max(0.0, y0)
    x1, y1 = min(1.0, x1), min(1.0, y1)
    return x0, y0, x1, y1


def _from_source(box: Box, frame: Box) -> Box:
    """A box relative to `frame` back in original coordinates."""
    fw, fh = frame[2] - frame[0], frame[3] - frame[1]
    return frame[0] + box[0] * fw, frame[1] + box[1] * fh, frame[0] + box[2] * fw, frame[1] + box[3] * fh


# --- plans ----------------------------------------------------------------------------------------------------


def _feasible_turns(pattern: str, max_turns: int, params: OracleParams) -> dict[int, float]:
    if pattern == "glance":  # one turn whatever the turn weights say
        return {1: 1.0}
    counts = {2} if pattern == "direct" else set(range(3, max_turns + 1))
    return {t: w for t, w in params.turns.items() if t in counts and t <= max_turns and w > 0}


def draw_plan(target: Box, params: OracleParams, max_turns: int, rng: random.Random) -> Plan:
    """A search plan for a target box: its pattern, then every look (the answer turn follows the last look)."""
    options = {p: w for p, w in params.patterns.items() if w > 0 and _feasible_turns(p, max_turns, params)}
    if not options:  # the turn limit or the turn weights leave no pattern: zoom once if a zoom fits at all
        return Plan("direct", [_close_look(target, params, rng, frame=None, source=0)] if max_turns >= 2 else [])
    pattern = rng.choices(list(options), weights=list(options.values()))[0]
    turns_weights = _feasible_turns(pattern, max_turns, params)
    turns = rng.choices(list(turns_weights), weights=list(turns_weights.values()))[0]
    looks_wanted = turns - 1
    if pattern == "glance":
        return Plan(pattern, [])
    close = _around(target, rng.uniform(*params.close_margin), params.min_close_side)

    if pattern == "direct":
        return Plan(pattern, [Look("close", close, 0, close)])
    looks: list[Look] = []
    if pattern == "wrong_then_right":
        then_wide = looks_wanted >= 3 and rng.random() < 0.5
        wrong_regions: list[Box] = []
        for _ in range(looks_wanted - (2 if then_wide else 1)):
            region = _away_from(target, rng.uniform(*params.wrong_side), rng, wrong_regions)
            if region is None:  # a target too large to avoid: fewer wrong looks
                break
            wrong_regions.append(region)
            looks.append(Look("wrong", region, 0, region))
        if not looks:
            pattern = "wide_then_close"
        elif not then_wide:
            looks.append(Look("close", close, 0, close))
            return Plan(pattern, looks)
        else:
            looks_wanted = 2
    # A chain from a wide look down to the close one: sides shrink geometrically, each look holds the close box.
    wide = _containing(close, rng.uniform(*params.wide_side), rng)
    chain = looks_wanted if pattern != "wrong_then_right" else 2
    sides = [max(wide[2] - wide[0], wide[3] - wide[1])]
    close_side = max(close[2] - close[0], close[3] - close[1])
    for i in range(1, chain - 1):
        sides.append(sides[0] * (close_side / sides[0]) ** (i / (chain - 1)))
    regions = [wide] + [_containing(close, side, rng) for side in sides[1:]] + [close]
    # Each later look must lie inside the one before when it zooms into that observation.
    source, frame = 0, (0.0, 0.0, 1.0, 1.0)
    for i, region in enumerate(regions[:chain]):
        role = "close" if i == chain - 1 else "wide"
        on_observation = i > 0 and (pattern == "observation_zoom" or rng.random() < params.obs_source_rate)
        if on_observation:
            source = len(looks)  # the observation the previous look produced
            frame = looks[-1].region
            box = _within(region, frame)
            region = _from_source(box, frame)
        else:
            source, box = 0, region
        looks.append(Look(role, region, source, box))
    return Plan(pattern, looks)


def follow_plan(task: TaskRecord, params: OracleParams, rng: random.Random) -> Plan:
    """A task with a search path (`waypoints`, a pointer task): `follow` looks at each waypoint, then at the
    target, then answers; or a `glance` as often as `patterns` says (its weight against `direct`'s: a path is
    the direct search of such a task)."""
    follow, glance = params.patterns.get("direct", 0.0), params.patterns.get("glance", 0.0)
    if glance > 0 and rng.random() < glance / (follow + glance):
        return Plan("glance", [])
    looks = [Look("waypoint", tuple(w.bbox), 0, tuple(w.bbox), w.seen) for w in task.waypoints or []]
    target = tuple(task.bbox or (0.0, 0.0, 1.0, 1.0))
    if looks and _contains(looks[-1].region, target):  # a zoom into a zoom: the box is on the last observation
        box = tuple(round(v, 4) for v in _within(target, looks[-1].region))
        return Plan("follow", looks + [Look("close", target, len(looks), box)])  # type: ignore[arg-type]
    return Plan("follow", looks + [Look("close", target, 0, target)])  # type: ignore[arg-type]


def _contains(outer: Box, inner: Box) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def _close_look(target: Box, params: OracleParams, rng: random.Random, frame: Box | None, source: int) -> Look:
    close = _around(target, rng.uniform(*params.close_margin), params.min_close_side)
    return Look("close", close, source, close if frame is None else _within(close, frame))


def _question_key(question: str) -> str:
    """A question without its image placeholders and with its spaces collapsed: a video task's placeholders (one
    per sampled frame) are known only once the loop has read its clip."""
    return " ".join(question.replace(IMAGE_PLACEHOLDER, " ").split())


# --- the engine -----------------------------------------------------------------------------------------------


class OracleEngine(Engine):
    """Writes each turn from its plan; the loop parses it, runs the crop tool and feeds the crop back."""

    name = "oracle"

    def __init__(self, params: OracleParams, protocol: Protocol, seed: int, max_turns: int, batch_size: int = 1024):
        self.image_root: Path | None = None
        self.params = params
        self.protocol = protocol
        self.seed = seed
        self.max_turns = max_turns
        self.batch_size = batch_size
        self._expected: dict[str, deque[tuple[TaskRecord, int]]] = {}
        self.patterns: dict[tuple[str, int], str] = {}
        """The pattern each (doc_id, sample) was given, for the stage's report."""
        self._free_answers: set[str] = set()
        """Every free-form answer of the prepared tasks: what a `glance` guesses among."""

    def prepare(self, tasks: list[TaskRecord], samples_per_task: int, image_root: Path | None = None) -> None:
        """Announce the tasks the next `run_rollouts` call runs; each needs a target `bbox`, or a `rationale`
        (the recipe families' worked solution: loupe.data.recipe_tasks), which it answers with at once.
        `image_root` (the tasks' folder) is needed when the protocol's boxes are in pixels of the original."""
        self.image_root = image_root
        for task in tasks:
            if task.operation is not None:
                missing = [c.tool for c in operation_calls(task) if not self.protocol.can_call(c.tool)]
                if missing:
                    raise OracleError(f"task {task.doc_id}: its operation {task.operation!r} needs the call(s) "
                                      f"{', '.join(missing)}, which the {self.protocol.name} protocol has no "
                                      "grammar for; use protocol.name: pixelis")
            if task.tools and task.bbox is None and not _rationale(task):
                raise OracleError(f"task {task.doc_id}: field 'bbox' is missing; the oracle teacher needs tasks "
                                  "with a ground-truth target box (synthetic tasks) or a 'rationale' to answer with")
            if not task.is_choice:
                self._free_answers.add(task.solution)
            queue = self._expected.setdefault(_question_key(self.protocol.question_text(task)), deque())
            queue.extend((task, k) for k in range(samples_per_task))

    def begin(self, system: str, question: str, images: list[Image.Image]) -> _OracleState:
        queue = self._expected.get(_question_key(question))
        if not queue:
            raise OracleError(f"the oracle was not prepared for the question {question[:80]!r}")
        task, k = queue.popleft()
        rng = random.Random(f"loupe-oracle/{self.seed}/{task.doc_id}/{k}")
        if not task.tools:  # a question without the tool: answered in its first turn
            plan = Plan("reason" if _rationale(task) else "no_tools", [])
        elif task.operation is not None:
            plan = Plan("operate", [], operation_calls(task))
        elif task.waypoints:
            plan = follow_plan(task, self.params, rng)
        elif task.bbox is None:
            plan = Plan("reason", [])
        else:
            plan = draw_plan(tuple(task.bbox), self.params, self.max_turns, rng)
        self.patterns[(task.doc_id, k)] = plan.pattern
        tokens = (len(system) + len(question)) // 3 + 256 * len(images)
        size = None
        if self.protocol.absolute_boxes and plan.looks:
            if self.image_root is None:
                raise OracleError(f"the {self.protocol.name} protocol's boxes are in pixels: prepare() needs the "
                                  "tasks' image_root to read the original's size")
            with Image.open(self.image_root / task.images[0]) as original:  # reads the header only
                size = original.size
        return _OracleState(task, plan, Wording(rng, plain=self.params.plain_wording), tokens, original_size=size)

    def add_user_turn(self, state: _OracleState, text: str, images: list[Image.Image]) -> None:
        state.observations += len(images)
        if state.plan.pattern == "operate":
            # An operation may answer in words alone; the protocol's result marker ("Result:") tells its answer
            # from an error turn. A grammar without one gives no sign, and rejection by answer is the check.
            marker = self.protocol.tool_text("").strip()
            state.failed = state.failed or bool(marker) and marker not in text
        elif not images:  # an error message: the plan no longer matches the dialogue
            state.failed = True
        state.tokens += len(text) // 3 + 256 * len(images)

    def context_length(self, state: _OracleState) -> int:
        return state.tokens

    def generate(self, states: list[_OracleState], max_new_tokens: int) -> list[Generation]:
        return [self._turn(state, max_new_tokens) for state in states]

    def _turn(self, state: _OracleState, max_new_tokens: int) -> Generation:
        looks, step, words = state.plan.looks, state.step, state.wording
        state.step += 1
        budget = int(max_new_tokens * CHARS_PER_TOKEN)
        if state.plan.pattern == "glance":
            task = state.task
            guesses = OPTION_LETTERS[: len(task.options or [])] if task.is_choice else sorted(self._free_answers)
            answer = state.wording.rng.choice(guesses)
            text = task.options[OPTION_LETTERS.index(answer)] if task.is_choice else answer
            sentences = words.glance(text, answer if task.is_choice else None)
            think = fit_sentences(sentences, budget - len(self.protocol.render_answer("", answer)))
            return self._emit(state, self.protocol.render_answer(think, answer), "eos", max_new_tokens)
        if state.plan.pattern == "reason":
            answer = state.task.solution
            rationale = _rationale(state.task)
            think = fit_sentences([Sentence(rationale, rationale)], budget - len(self.protocol.render_answer("", answer)))
            return self._emit(state, self.protocol.render_answer(think, answer), "eos", max_new_tokens)
        if state.plan.pattern == "operate":
            return self._operate(state, step, budget, max_new_tokens)
        if step >= len(looks) or state.failed:
            letter = state.task.solution if state.task.is_choice else None
            sentences = words.answer(state.observations, state.task.answer_text(), letter)
            answer = state.task.solution
            think = fit_sentences(sentences, budget - len(self.protocol.render_answer("", answer)))
            text = self.protocol.render_answer(think, answer)
            return self._emit(state, text, "eos", max_new_tokens)
        look = looks[step]
        if step == 0:
            area = area_name(look.region) if self.params.name_first_look else None
            sentences = words.first_turn(area, close=look.role == "close")
        else:
            previous = looks[step - 1]
            n = state.observations
            if previous.role == "wrong":
                sentences = words.after_miss(n, area_name(previous.region), area_name(look.region))
            elif previous.role == "waypoint":  # the next look's place in words, on the image it zooms into
                sentences = words.after_waypoint(n, previous.seen, area_name(look.box if look.source else look.region))
            else:
                in_view = area_name(_within(look.region, previous.region))
                sentences = words.after_spot(n, in_view, look.source or None)
        source = ORIGINAL_IMAGE if look.source == 0 else f"observation_{look.source}"
        call = ToolCall("crop", {"bbox_2d": list(look.box), "source": source})
        if state.original_size is not None:  # pixels of the original: the region the look shows, scaled
            width, height = state.original_size
            x0, y0, x1, y1 = look.region
            call = ToolCall("crop", {"bbox_2d": [x0 * width, y0 * height, x1 * width, y1 * height],
                                     "source": ORIGINAL_IMAGE})
        think = fit_sentences(sentences, budget - len(self.protocol.render_call("", call)))
        return self._emit(state, self.protocol.render_call(think, call), "stop", max_new_tokens)

    def _operate(self, state: _OracleState, step: int, budget: int, max_new_tokens: int) -> Generation:
        """A turn of an `operate` plan: the next operation's call, or the answer its result gave."""
        task, calls, words = state.task, state.plan.calls, state.wording
        if step >= len(calls) or state.failed:
            answer = task.solution
            if state.failed:
                sentences = words.answer(state.observations, task.answer_text(), None)
            else:
                sentences = words.operated(calls[-1].tool, task.answer_text())
            think = fit_sentences(sentences, budget - len(self.protocol.render_answer("", answer)))
            return self._emit(state, self.protocol.render_answer(think, answer), "eos", max_new_tokens)
        call = calls[step]
        sentences = words.operate(call.tool, area_name(tuple(task.bbox or (0, 0, 1, 1))),
                                  mask=call.arguments.get("mask", ""))
        think = fit_sentences(sentences, budget - len(self.protocol.render_call("", call)))
        return self._emit(state, self.protocol.render_call(think, call), "stop", max_new_tokens)

    def _emit(self, state: _OracleState, text: str, finish: str, max_new_tokens: int) -> Generation:
        tokens = max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
        if tokens > max_new_tokens:  # even the shortest wording does not fit: cut, as a model would be cut
            text, finish, tokens = text[: int(max_new_tokens * CHARS_PER_TOKEN)], "length", max_new_tokens
        state.tokens += tokens
        return Generation(text=text, finish=finish, num_tokens=tokens)  # type: ignore[arg-type]


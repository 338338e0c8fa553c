"""The one multi-turn rollout loop: synth's teachers, rl's sampler and eval all run trajectories through it.

Every trajectory advances on its own: its next assistant turn is handed to the engine, and when it comes back
it is parsed by the protocol: an answer ends the trajectory; a tool call runs the tool and the
crop (or a visual operation's images and text, `loupe.visual_ops`) comes back as a user turn; a malformed call or a refused box comes back as an error message, until the
retries run out. Limits end a trajectory as `over_turn`: the turn limit with a call still pending, the image
limit, or a context that could not fit another turn.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from loupe import visual_ops  # noqa: F401 (registers the visual operations beyond the crop)
from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.protocol import Protocol, make_protocol
from loupe.rollout.engine import Engine
from loupe.tools import (
    CropResult,
    ImageSession,
    ToolResult,
    fit_image,
    fit_to_budget,
    open_image,
    run_tool,
)
from loupe.trajectory import Trajectory, Turn
from loupe.video import read_clip


@dataclass
class _Live:
    trajectory: Trajectory
    session: ImageSession
    state: Any
    errors_left: int


@dataclass
class RolloutStats:
    """What a run of the loop cost, for progress bars and benchmarks."""

    trajectories: int = 0
    turns: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


def on_model_grid(protocol_params: ProtocolParams, engine: Engine) -> ProtocolParams:
    """The protocol's settings with the image grid of the engine's model (`ProtocolParams.image_factor`) and its
    processor's pixel bounds where the params leave them unset (`processor_min_pixels`, `processor_max_pixels`):
    every image and crop is then shown at sides the model's processor keeps as they are. A grid the params give
    that the model's processor contradicts is refused, naming both."""
    update: dict[str, int] = {}
    grid = getattr(engine, "image_factor", None)
    if grid is not None and protocol_params.image_factor != grid:
        if protocol_params.image_factor is not None:
            raise ValueError(f"protocol.image_factor is {protocol_params.image_factor}, but the model's processor "
                             f"resizes images on a {grid}-px grid (patch x merge); set it to {grid} or leave it null")
        update["image_factor"] = grid
    bounds = getattr(engine, "image_pixels", None)
    if bounds is not None:
        for key, value in zip(("processor_min_pixels", "processor_max_pixels"), bounds):
            if getattr(protocol_params, key) is None:
                update[key] = value
    return protocol_params.model_copy(update=update) if update else protocol_params


class Rollout:
    """One run of the loop's bookkeeping: the trajectories started, the ones still live, the ones ended.

    `run_rollouts` drives it trajectory by trajectory; `benchmarks/rollout_throughput.py` drives the same object
    round by round (its baseline), so the two differ only in when a turn is asked for.
    """

    def __init__(self, tasks: list[TaskRecord], engine: Engine, protocol_params: ProtocolParams, image_root: str | Path,
                 samples_per_task: int, max_turns: int | None, max_new_tokens: int, progress: bool | str,
                 stats: RolloutStats | None, on_finish: Callable[[Trajectory], None] | None):
        self.tasks, self.engine = tasks, engine
        self.protocol_params = protocol_params = on_model_grid(protocol_params, engine)
        self.protocol: Protocol = make_protocol(protocol_params)
        self.turn_limit = max_turns if max_turns is not None else protocol_params.max_turns
        if not self.protocol.multi_turn:
            self.turn_limit = 1
        self.max_new_tokens = max_new_tokens
        self.stats = stats if stats is not None else RolloutStats()
        self.on_finish = on_finish
        self.started = time.perf_counter()
        self.bar = tqdm(total=len(tasks) * samples_per_task, desc=progress if isinstance(progress, str) else "rollout",
                        unit="traj", disable=not progress)
        self.finished: list[Trajectory] = []
        self.live = self._begin(Path(image_root), samples_per_task)
        """Trajectories that wait for their first turn, in task and sample order."""

    def _begin(self, image_root: Path, samples_per_task: int) -> list[_Live]:
        live = []
        for task in self.tasks:
            live += self.add_task(task, image_root, samples_per_task)
        return live

    def add_task(self, task: TaskRecord, image_root: Path | None, samples_per_task: int = 1,
                 images: list[Image.Image] | None = None) -> list[_Live]:
        """Begin `samples_per_task` trajectories of `task`; returns those still live (a prompt past the context
        ends at once as `over_turn`). Its images are read from `image_root`, or given decoded in `images` (a
        served request's uploads, `loupe.serve`), recorded in the trajectory as they are."""
        live = []
        protocol, protocol_params, engine = self.protocol, self.protocol_params, self.engine
        # Decoded once per task: its samples share the original and the downscaled copy the model sees.
        prompt_task, frames = task, []
        if images is not None:
            originals = images
            shown = [fit_image(img, protocol_params.budget) for img in originals]
        elif task.video is not None:
            # A video's sampled frames are its images: one placeholder each in the question.
            frames = read_clip(task.video, image_root, protocol_params.video_max_frames,
                               protocol_params.max_decode_pixels)
            originals = frames
            shown = [fit_to_budget(img, protocol_params.frame_budget(len(frames))) for img in frames]
            prompt_task = task.model_copy(update={"images": [f"{task.video}#{n}" for n in range(1, len(frames) + 1)]})
        else:
            originals = [open_image(p, image_root, protocol_params.max_decode_pixels) for p in task.images]
            shown = [fit_image(img, protocol_params.budget) for img in originals]
        for k in range(samples_per_task):
            trajectory = Trajectory(
                traj_id=f"{task.doc_id}#{k}",
                task=task.model_dump(exclude_none=True),
                protocol=protocol.name,
                system=protocol.task_system_prompt(task),
                sample_index=k,
                meta={"engine": engine.name},
            )
            question = protocol.question_text(prompt_task)
            if frames or images is not None:  # kept in the trajectory (written beside it, like crops): frames
                # as the model saw them, uploads as they came
                indices = [trajectory.add_image(image) for image in (shown if frames else originals)]
            else:
                # Absolute but not resolved: a hub-cache file is a symlink to a blob with no image suffix.
                indices = [trajectory.add_image(Path(os.path.abspath(image_root / p))) for p in task.images]
            trajectory.turns.append(Turn("user", question, images=indices))
            state = engine.begin(trajectory.system, question, shown)
            trajectory.prompt_tokens = engine.context_length(state)
            trajectory.turns[0].num_tokens = trajectory.prompt_tokens
            # A text-only task has no original: a crop call gets the tool's "no such source" error back.
            session = ImageSession(original=originals[0] if originals else None,
                                   shown_original=shown[0] if shown else None, frames=frames)
            item = _Live(trajectory, session, state, protocol_params.format_error_retries)
            if context_full(trajectory.prompt_tokens, protocol_params, self.max_new_tokens):
                self._finish(item, "over_turn")
            else:
                live.append(item)
        return live

    def turn_tokens(self, item: _Live) -> int:
        """New tokens the trajectory's next turn may take: `max_new_tokens`, or what is left of the engine's context
        (`protocol.model_len`) when less, as vLLM stops a request at its `max_model_len`."""
        model_len = self.protocol_params.model_len
        if model_len is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, model_len - self.engine.context_length(item.state)))

    def take(self, item: _Live, generation: Any) -> bool:
        """Act on a trajectory's new turn (parse, crop, next user turn); True while it goes on."""
        self.stats.turns += 1
        self.stats.generated_tokens += generation.num_tokens
        reason = _take_turn(item, generation, self.protocol, self.protocol_params, self.engine, self.turn_limit,
                            self.max_new_tokens)
        if reason is not None:
            self._finish(item, reason)
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix(turns=self.stats.turns, tok_s=f"{self.stats.generated_tokens / max(elapsed, 1e-9):.0f}",
                             refresh=False)
        return reason is None

    def _finish(self, item: _Live, reason: str) -> None:
        item.trajectory.end_reason = reason
        item.trajectory.trace = self.engine.trace(item.state)
        self.finished.append(item.trajectory)
        self.bar.update(1)
        if self.on_finish is not None:
            self.on_finish(item.trajectory)

    def close(self) -> list[Trajectory]:
        """The ended trajectories in task and sample order."""
        self.bar.close()
        self.stats.trajectories += len(self.finished)
        self.stats.seconds += time.perf_counter() - self.started
        position = {task.doc_id: i for i, task in enumerate(self.tasks)}
        return sorted(self.finished, key=lambda t: (position[t.task["doc_id"]], t.sample_index))


def run_rollouts(
    tasks: list[TaskRecord],
    engine: Engine,
    protocol_params: ProtocolParams,
    image_root: str | Path,
    samples_per_task: int = 1,
    max_turns: int | None = None,
    max_new_tokens: int = 256,
    progress: bool | str = False,
    stats: RolloutStats | None = None,
    on_finish: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Run `samples_per_task` trajectories for every task to their end; returns them in task order.

    Each trajectory advances as soon as its own turn comes back: the engine is handed every live trajectory's
    next turn (`Engine.submit`) and reports turns as they finish (`Engine.poll`); a finished turn is parsed,
    its crop taken and its next turn submitted while the others are still generating. A batch engine
    generates its queue first in, first out, `batch_size` turns at a time, so a trajectory at its fifth turn
    shares a batch with one at its first (continuous batching at turn granularity); an endpoint engine keeps
    its requests in flight. `max_turns` overrides the protocol's turn limit (eval's turn-scaling runs use up
    to 32). `on_finish` is called with each trajectory as it ends (for incremental saving).
    """
    run = Rollout(tasks, engine, protocol_params, image_root, samples_per_task, max_turns, max_new_tokens, progress,
                  stats, on_finish)
    waiting = {engine.submit(item.state, run.turn_tokens(item)): item for item in run.live}
    try:
        while waiting:
            for ticket, generation in engine.poll():
                item = waiting.pop(ticket)
                if run.take(item, generation):
                    waiting[engine.submit(item.state, run.turn_tokens(item))] = item
    except BaseException:
        engine.cancel()
        raise
    return run.close()


def _take_turn(
    item: _Live,
    generation: Any,
    protocol: Protocol,
    protocol_params: ProtocolParams,
    engine: Engine,
    turn_limit: int,
    max_new_tokens: int,
) -> str | None:
    """Record one generated turn and act on it; returns the end reason, or None to go on."""
    trajectory, session = item.trajectory, item.session
    trajectory.generated_tokens += generation.num_tokens
    turn = Turn("assistant", generation.text, num_tokens=generation.num_tokens)
    trajectory.turns.append(turn)
    if generation.finish == "length":
        turn.action = "error"
        capped = "" if protocol_params.model_len is None else ", or the end of the context (protocol.model_len)"
        turn.error = f"length: the turn reached {generation.num_tokens} new tokens without finishing (at most {max_new_tokens}{capped})"
        return "length"

    at_limit = trajectory.num_turns >= turn_limit or len(trajectory.images) >= protocol_params.max_images
    if at_limit and protocol_params.call_at_limit == "matched" and protocol.holds_call_span(generation.text):
        turn.action = "call"  # the recipe's rule: a call attempted past the limit is over-turn, parsed or not
        trajectory.num_tool_calls += 1
        return "over_turn"
    action = protocol.parse(generation.text, num_observations=len(session.observations))
    turn.action = action.kind
    if action.answer is not None:
        trajectory.answer = action.answer
        return "answered"
    if not trajectory.task.get("tools", True):  # a question without the tool: its first turn is its last
        trajectory.num_format_errors += 1
        turn.error = (f"{action.error.kind.value}: {action.error.detail}" if action.error is not None
                      else "no_tools: the question offers no tool, and the turn gave no answer")
        return "format_error"

    if action.call is not None:
        trajectory.num_tool_calls += 1
        turn.call = {"tool": action.call.tool, "arguments": action.call.arguments}
        if at_limit:
            return "over_turn"
        result = run_tool(action.call, session, protocol_params.budget)
        if isinstance(result, (CropResult, ToolResult)):
            return _show_result(item, result, action.call.tool, protocol, protocol_params, engine, max_new_tokens)
        error_kind, detail = result.kind.value, result.detail
    else:
        assert action.error is not None
        error_kind, detail = action.error.kind.value, action.error.detail
        turn.error = f"{error_kind}: {detail}"

    trajectory.num_format_errors += 1
    if action.call is None and protocol_params.turn_without_call == "ends" and not protocol.turn_calls(generation.text):
        return "format_error"  # the recipe's policy: a turn that calls nothing is the last, scored as it stands
    if item.errors_left <= 0 or trajectory.num_turns >= turn_limit:
        return "format_error"
    item.errors_left -= 1
    message = protocol.error_turn(detail)
    trajectory.turns.append(Turn("user", message, error=f"{error_kind}: {detail}"))
    return _append_user(item, message, [], engine, protocol_params, max_new_tokens)


def _show_result(
    item: _Live,
    result: CropResult | ToolResult,
    tool: str,
    protocol: Protocol,
    protocol_params: ProtocolParams,
    engine: Engine,
    max_new_tokens: int,
) -> str | None:
    """Give a tool's outcome back as the next user turn: a crop (an observation that is a region of its source,
    recorded in `Turn.crop`), or a visual operation's new images, each an observation of its own, and its text
    (recorded in `Turn.tool`)."""
    trajectory, session = item.trajectory, item.session
    if isinstance(result, CropResult):
        name = session.add_observation(result.image, result.region, base=result.base)
        number = int(name.rsplit("_", 1)[1])
        source_index = 0 if result.source == "original_image" else _observation_image_index(trajectory, result.source)
        images = [result.image]
        text = protocol.observation_turn(number, result.image.size)
        record = {"crop": {"source": result.source, "source_image": source_index, "box_px": list(result.box_px),
                           "region_px": list(result.region_px), "size": list(result.image.size),
                           "observation": number, "base": result.base}}
    else:
        if len(trajectory.images) + len(result.images) > protocol_params.max_images:
            return "over_turn"
        images = [new.image for new in result.images]
        numbers = [int(session.add_image(new.image, new.full).rsplit("_", 1)[1]) for new in result.images]
        text = protocol.tool_result_turn(numbers, [image.size for image in images], result.text)
        record = {"tool": {"tool": tool, "observations": numbers, "text": result.text, **result.record}}
    indices = [trajectory.add_image(image) for image in images]
    trajectory.turns.append(Turn("user", text, images=indices, **record))
    return _append_user(item, text, images, engine, protocol_params, max_new_tokens)


def _observation_image_index(trajectory: Trajectory, source: str) -> int:
    for turn in trajectory.turns:
        if turn.crop is not None and f"observation_{turn.crop['observation']}" == source:
            return turn.images[0]
        if turn.tool is not None:  # a visual operation's images: observations of their own
            for image, number in zip(turn.images, turn.tool.get("observations", [])):
                if f"observation_{number}" == source:
                    return image
    raise KeyError(source)  # the tool found the source, so the trajectory has it


def _append_user(
    item: _Live, text: str, images: list[Image.Image], engine: Engine, protocol_params: ProtocolParams, max_new_tokens: int
) -> str | None:
    before = engine.context_length(item.state)
    engine.add_user_turn(item.state, text, images)
    after = engine.context_length(item.state)
    item.trajectory.turns[-1].num_tokens = after - before
    return "over_turn" if context_full(after, protocol_params, max_new_tokens) else None


def context_full(tokens: int, protocol_params: ProtocolParams, max_new_tokens: int) -> bool:
    """Whether a dialogue of `tokens` has no room for its next turn: a whole turn would pass
    `protocol.max_context_tokens`, or the engine's context (`protocol.model_len`) has no token left."""
    if tokens + max_new_tokens > protocol_params.max_context_tokens:
        return True
    return protocol_params.model_len is not None and tokens >= protocol_params.model_len

"""The one multi-turn rollout loop: synth's teachers, rl's sampler and eval all run trajectories through it.

Each round, every live trajectory generates its next assistant turn in one engine call (the engine batches
them). The turn is parsed by the protocol: an answer ends the trajectory; a tool call runs the tool and the
crop comes back as a user turn; a malformed call or a refused box comes back as an error message, until the
retries run out. Limits end a trajectory as `over_turn`: the turn limit with a call still pending, the image
limit, or a context that could not fit another turn.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from PIL import Image
from tqdm import tqdm

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.protocol import Protocol, get_protocol
from loupe.rollout.engine import Engine
from loupe.tools import CropResult, ImageSession, open_image, run_tool, smart_resize
from loupe.trajectory import Trajectory, Turn


@dataclass
class _Live:
    trajectory: Trajectory
    session: ImageSession
    state: Any
    errors_left: int


def fit_to_budget(image: Image.Image, protocol_params: ProtocolParams) -> Image.Image:
    """The image as the model is shown it: resized by Qwen's rule into the protocol's pixel budget."""
    height, width = smart_resize(image.height, image.width, protocol_params.budget)
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.BICUBIC)


@dataclass
class RolloutStats:
    """What a run of the loop cost, for progress bars and benchmarks."""

    trajectories: int = 0
    turns: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


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

    `max_turns` overrides the protocol's turn limit (eval's turn-scaling runs use up to 32).
    `on_finish` is called with each trajectory as it ends (for incremental saving).
    """
    protocol: Protocol = get_protocol(protocol_params.name)
    turn_limit = max_turns if max_turns is not None else protocol_params.max_turns
    if not protocol.multi_turn:
        turn_limit = 1
    image_root = Path(image_root)
    started = time.perf_counter()
    stats = stats if stats is not None else RolloutStats()
    total = len(tasks) * samples_per_task
    bar = tqdm(total=total, desc=progress if isinstance(progress, str) else "rollout", unit="traj", disable=not progress)

    live: list[_Live] = []
    finished: list[Trajectory] = []

    def finish(item: _Live, reason: str) -> None:
        item.trajectory.end_reason = reason
        item.trajectory.trace = engine.trace(item.state)
        finished.append(item.trajectory)
        bar.update(1)
        if on_finish is not None:
            on_finish(item.trajectory)

    for task in tasks:
        # Decoded once per task: its samples share the original and the downscaled copy the model sees.
        originals = [open_image(p, image_root, protocol_params.max_decode_pixels) for p in task.images]
        shown = [fit_to_budget(img, protocol_params) for img in originals]
        for k in range(samples_per_task):
            trajectory = Trajectory(
                traj_id=f"{task.doc_id}#{k}",
                task=task.model_dump(exclude_none=True),
                protocol=protocol.name,
                system=protocol.system_prompt(),
                sample_index=k,
                meta={"engine": engine.name},
            )
            question = protocol.question_text(task)
            # Absolute but not resolved: a hub-cache file is a symlink to a blob with no image suffix.
            indices = [trajectory.add_image(Path(os.path.abspath(image_root / p))) for p in task.images]
            trajectory.turns.append(Turn("user", question, images=indices))
            state = engine.begin(trajectory.system, question, shown)
            trajectory.prompt_tokens = engine.context_length(state)
            trajectory.turns[0].num_tokens = trajectory.prompt_tokens
            item = _Live(trajectory, ImageSession(original=originals[0]), state, protocol_params.format_error_retries)
            if trajectory.prompt_tokens + max_new_tokens > protocol_params.max_context_tokens:
                finish(item, "over_turn")
            else:
                live.append(item)

    while live:
        generations = engine.generate([item.state for item in live], max_new_tokens)
        still_live: list[_Live] = []
        for item, generation in zip(live, generations):
            stats.turns += 1
            stats.generated_tokens += generation.num_tokens
            reason = _take_turn(item, generation, protocol, protocol_params, engine, turn_limit, max_new_tokens)
            if reason is None:
                still_live.append(item)
            else:
                finish(item, reason)
        live = still_live
        elapsed = time.perf_counter() - started
        bar.set_postfix(turns=stats.turns, tok_s=f"{stats.generated_tokens / max(elapsed, 1e-9):.0f}")
    bar.close()

    stats.trajectories += len(finished)
    stats.seconds += time.perf_counter() - started
    position = {task.doc_id: i for i, task in enumerate(tasks)}
    finished.sort(key=lambda t: (position[t.task["doc_id"]], t.sample_index))
    return finished


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
        turn.error = f"length: the turn reached {max_new_tokens} new tokens without finishing"
        return "length"

    action = protocol.parse(generation.text, num_observations=len(session.observations))
    turn.action = action.kind
    if action.answer is not None:
        trajectory.answer = action.answer
        return "answered"

    if action.call is not None:
        trajectory.num_tool_calls += 1
        turn.call = {"tool": action.call.tool, "arguments": action.call.arguments}
        if trajectory.num_turns >= turn_limit or len(trajectory.images) >= protocol_params.max_images:
            return "over_turn"
        result = run_tool(action.call, session, protocol_params.budget)
        if isinstance(result, CropResult):
            return _add_observation(item, result, protocol, protocol_params, engine, max_new_tokens)
        error_kind, detail = result.kind.value, result.detail
    else:
        assert action.error is not None
        error_kind, detail = action.error.kind.value, action.error.detail
        turn.error = f"{error_kind}: {detail}"

    trajectory.num_format_errors += 1
    if item.errors_left <= 0 or trajectory.num_turns >= turn_limit:
        return "format_error"
    item.errors_left -= 1
    message = protocol.error_text(detail)
    trajectory.turns.append(Turn("user", message, error=f"{error_kind}: {detail}"))
    return _append_user(item, message, [], engine, protocol_params, max_new_tokens)


def _add_observation(
    item: _Live,
    result: CropResult,
    protocol: Protocol,
    protocol_params: ProtocolParams,
    engine: Engine,
    max_new_tokens: int,
) -> str | None:
    trajectory = item.trajectory
    name = item.session.add_observation(result.image, result.region)
    number = int(name.rsplit("_", 1)[1])
    source_index = 0 if result.source == "original_image" else _observation_image_index(trajectory, result.source)
    index = trajectory.add_image(result.image)
    text = protocol.observation_text(number)
    trajectory.turns.append(
        Turn(
            "user",
            text,
            images=[index],
            crop={
                "source": result.source,
                "source_image": source_index,
                "box_px": list(result.box_px),
                "region_px": list(result.region_px),
                "size": list(result.image.size),
                "observation": number,
            },
        )
    )
    return _append_user(item, text, [result.image], engine, protocol_params, max_new_tokens)


def _observation_image_index(trajectory: Trajectory, source: str) -> int:
    for turn in trajectory.turns:
        if turn.crop is not None and f"observation_{turn.crop['observation']}" == source:
            return turn.images[0]
    raise KeyError(source)  # the tool found the source, so the trajectory has it


def _append_user(
    item: _Live, text: str, images: list[Image.Image], engine: Engine, protocol_params: ProtocolParams, max_new_tokens: int
) -> str | None:
    before = engine.context_length(item.state)
    engine.add_user_turn(item.state, text, images)
    after = engine.context_length(item.state)
    item.trajectory.turns[-1].num_tokens = after - before
    if after + max_new_tokens > protocol_params.max_context_tokens:
        return "over_turn"
    return None

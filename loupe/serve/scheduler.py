"""The engine's one thread: every request's turns go through it, so concurrent requests share the running batch.

An engine is not thread-safe and generates many turns together (the transformers engine's running batch, vLLM's
scheduler), so one thread owns it and runs the same bookkeeping as training's and eval's rollouts
(`loupe.rollout.loop.Rollout`: parse the turn, crop the full-resolution image, append the observation). A
request is a job: it waits in the inbox (at most `max_queued`: one more is refused, the server answers 503),
is admitted while fewer than `max_running` jobs search, and from then on each of its turns is submitted to the
engine the moment the previous one has been handled, beside whatever other jobs' turns are in flight. A job
whose client went away is dropped from the engine between two polls (`Engine.discard`), which frees its slot.

Jobs hear back through their asyncio queue (`Job.events`), fed from this thread with `call_soon_threadsafe`.
What an event carries is copied here, in the engine's thread, so the web side never reads a trajectory the
engine is still writing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.rollout.engine import Engine, Generation
from loupe.rollout.loop import Rollout, _Live
from loupe.serve.requests import Dialogue, Question, RequestError
from loupe.tools import fit_to_budget
from loupe.trajectory import Trajectory, Turn

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every running slot is taken and the inbox holds `max_queued` jobs."""


@dataclass
class TurnRecord:
    """One turn of a served search, copied out of the trajectory for the client."""

    role: str
    text: str
    action: str | None = None
    call: dict[str, Any] | None = None
    error: str | None = None
    crop: dict[str, Any] | None = None
    tool: dict[str, Any] | None = None
    tokens: int = 0
    images: list[Image.Image] = field(default_factory=list, repr=False)
    """The turn's new images (a crop, a visual operation's outputs): never changed once made."""


@dataclass
class Outcome:
    """How a job ended."""

    text: str
    """The loop's answer (empty when the search ended without one), or the one turn's text."""
    finish: str
    """The loop's end reason (answered, over_turn, format_error, length) or the turn's (stop, eos, length)."""
    prompt_tokens: int
    """Tokens the model read but did not write (system prompt, question, images, observations)."""
    completion_tokens: int
    """Tokens the model generated, over every turn."""
    turns: int = 1


class Job:
    """One request: what to run, and the asyncio queue its events go to ("turns", "done" or "error")."""

    def __init__(self, work: Question | Dialogue, max_new_tokens: int, options: list[str] | None = None):
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.work = work
        self.max_new_tokens = max_new_tokens
        self.options = options
        self.cancelled = False
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.original_size: tuple[int, int] | None = None
        self.state: Any = None
        """A one-turn job's engine state."""

    @property
    def zoom_loop(self) -> bool:
        return isinstance(self.work, Question)

    def emit(self, kind: str, data: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))
        except RuntimeError:  # the event loop has closed (the server is shutting down): nobody is listening
            pass


def turn_record(turn: Turn, trajectory: Trajectory) -> TurnRecord:
    images = [trajectory.pending[i] for i in turn.images if i in trajectory.pending]
    return TurnRecord(turn.role, turn.text, turn.action, turn.call, turn.error, turn.crop, turn.tool, turn.num_tokens,
                      images)


class Scheduler:
    """Runs jobs on one engine in a thread of its own (`start`, `close`)."""

    def __init__(self, engine: Engine, protocol: ProtocolParams, max_turns: int, max_new_tokens: int,
                 max_running: int, max_queued: int):
        self.engine = engine
        self.max_new_tokens = max_new_tokens
        self.max_running = max_running
        self.max_queued = max_queued
        self.rollout = Rollout([], engine, protocol, ".", 1, max_turns, max_new_tokens, False, None, None)
        self.protocol = self.rollout.protocol_params  # on the model's image grid (loop.on_model_grid)
        self._inbox: deque[Job] = deque()
        self._running: set[Job] = set()
        self._waiting: dict[int, tuple[Job, _Live | None]] = {}
        self._wake = threading.Condition()
        self._closed = False
        self.failure: str | None = None
        """Why the engine's thread stopped, if it did: the server then refuses requests (503) and /health says so."""
        self.served = 0
        """Jobs that ended with an outcome."""
        self._thread = threading.Thread(target=self._run, name="loupe-serve-engine", daemon=True)

    # --- the web side ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self.engine.close()

    def _full(self) -> bool:
        return len(self._inbox) + len(self._running) >= self.max_running + self.max_queued

    def has_room(self) -> bool:
        """Whether a request now would be queued (a check before its images are decoded; `submit` decides)."""
        with self._wake:
            return self.alive and not self._full()

    def describe_load(self) -> str:
        with self._wake:  # a re-entrant lock: `submit` calls this holding it
            return (f"{len(self._running)} requests running and {len(self._inbox)} queued "
                    f"(serve.max_running {self.max_running}, serve.max_queued {self.max_queued})")

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when the running slots and the inbox are all taken."""
        with self._wake:
            if self._closed or self.failure is not None:
                raise QueueFull(f"the engine has stopped ({self.failure})" if self.failure else
                                "the server is shutting down")
            if self._full():
                raise QueueFull(self.describe_load())
            self._inbox.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Drop a job whose client went away: at once if it waits, at the engine's next poll if it runs."""
        with self._wake:
            job.cancelled = True
            if job in self._inbox:
                self._inbox.remove(job)
            self._wake.notify()

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def load(self) -> dict[str, Any]:
        with self._wake:
            return {"running": len(self._running), "queued": len(self._inbox), "served": self.served,
                    "max_running": self.max_running, "max_queued": self.max_queued}

    # --- the engine's thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        """The engine's loop, guarded: should it fail outside any one request, every request waiting or running
        gets the error, later ones a 503, and /health reports the failure, rather than all of them hanging."""
        try:
            self._loop()
        except BaseException as err:
            log.exception("the engine's thread failed")
            self.failure = f"{type(err).__name__}: {err}"
            with self._wake:
                jobs = [job for job, _ in self._waiting.values()] + list(self._inbox) + list(self._running)
                self._inbox.clear()
                self._waiting = {}
            for job in dict.fromkeys(jobs):
                self._end(job, "error", RequestError(500, f"the engine stopped: {self.failure}", code="engine_error"))

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._inbox and not self._waiting:
                    self._wake.wait()
                if self._closed:
                    break
                dropped = {ticket for ticket, (job, _) in self._waiting.items() if job.cancelled}
                admitted = []
                while self._inbox and len(self._running) < self.max_running:
                    job = self._inbox.popleft()
                    self._running.add(job)
                    admitted.append(job)
                for ticket in dropped:
                    self._running.discard(self._waiting.pop(ticket)[0])
            if dropped:
                self.engine.discard(dropped)
            for job in admitted:
                try:
                    self._start(job)
                except RequestError as err:
                    self._end(job, "error", err)
                except ValueError as err:  # what the processor refuses in the request's own text or images
                    self._end(job, "error", RequestError(400, f"the model's processor refused the request: {err}"))
                except Exception as err:  # a request the engine cannot take fails alone
                    log.exception("request %s could not start", job.id)
                    self._end(job, "error", RequestError(500, f"the engine could not start the request: {err}",
                                                         code="engine_error"))
            if not self._waiting:
                continue
            try:
                finished = self.engine.poll()
            except Exception as err:
                # Every turn in flight is lost with the failed batch; the server goes on with the next requests.
                log.exception("the engine failed; %d requests fail with it", len(self._waiting))
                self.engine.cancel()
                failed, self._waiting = self._waiting, {}
                for job, _ in failed.values():
                    self._end(job, "error", RequestError(500, f"the engine failed: {err}", code="engine_error"))
                continue
            for ticket, generation in finished:
                entry = self._waiting.pop(ticket, None)
                if entry is None:
                    continue
                try:
                    self._take(ticket, entry[0], entry[1], generation)
                except Exception as err:  # one search's next step failed (its crop, its next prompt): it alone ends
                    log.exception("request %s failed after a turn", entry[0].id)
                    self._end(entry[0], "error", RequestError(500, f"the search failed after a turn: {err}",
                                                              code="engine_error"))

    def _end(self, job: Job, kind: str, data: Any) -> None:
        with self._wake:
            self._running.discard(job)
            if kind == "done":
                self.served += 1
        if not job.cancelled:
            job.emit(kind, data)

    def _start(self, job: Job) -> None:
        if isinstance(job.work, Dialogue):
            self._start_turn(job, job.work)
            return
        question = job.work
        job.original_size = question.images[0].size
        task = TaskRecord(doc_id=job.id, images=[f"upload-{n + 1}.png" for n in range(len(question.images))],
                          problem=question.text, solution="-", data_source="serve", options=job.options)
        # `solution` is required of a task record; a served question has none, and nothing here scores it.
        started = self.rollout.add_task(task, None, 1, images=question.images)
        if not started:  # the prompt alone fills the context
            self._finish_loop(job, self.rollout.finished.pop())
            return
        item = started[0]
        self.rollout.finished.clear()
        job.emit("turns", [turn_record(turn, item.trajectory) for turn in item.trajectory.turns])
        self._waiting[self.engine.submit(item.state, job.max_new_tokens)] = (job, item)

    def _start_turn(self, job: Job, dialogue: Dialogue) -> None:
        engine = self.engine
        # Within the protocol's pixel budget, as every image the model saw in training was; an image the client
        # already fitted (Loupe's own `openai` engine sends them so) comes through unchanged.
        turns = [(role, text, [fit_to_budget(image, self.protocol.budget) for image in images])
                 for role, text, images in dialogue.turns]
        role, text, images = turns[0]
        state = engine.begin(dialogue.system, text, images)
        for role, text, images in turns[1:]:
            if role == "assistant":
                engine.add_assistant_text(state, text)
            else:
                engine.add_user_turn(state, text, images)
        length = engine.context_length(state)
        if length + job.max_new_tokens > self.protocol.max_context_tokens:
            raise RequestError(400, f"messages: the dialogue is {length} tokens; with max_tokens {job.max_new_tokens} "
                                    f"it passes protocol.max_context_tokens ({self.protocol.max_context_tokens})",
                               "messages", code="context_length_exceeded")
        job.state = state
        self._waiting[engine.submit(state, job.max_new_tokens)] = (job, None)

    def _take(self, ticket: int, job: Job, item: _Live | None, generation: Generation) -> None:
        if job.cancelled:
            self._end(job, "cancelled", None)
            return
        if item is None:  # one turn: the generation is the reply
            read = self.engine.context_length(job.state) - generation.num_tokens
            self._end(job, "done", Outcome(generation.text, generation.finish, read, generation.num_tokens))
            return
        trajectory = item.trajectory
        seen = len(trajectory.turns)
        going_on = self.rollout.take(item, generation)
        self.rollout.finished.clear()  # a server keeps no history: each job's trajectory goes to its client
        job.emit("turns", [turn_record(turn, trajectory) for turn in trajectory.turns[seen:]])
        if going_on:
            self._waiting[self.engine.submit(item.state, job.max_new_tokens)] = (job, item)
        else:
            self._finish_loop(job, trajectory)

    def _finish_loop(self, job: Job, trajectory: Trajectory) -> None:
        context = sum(turn.num_tokens for turn in trajectory.turns)
        self._end(job, "done", Outcome(trajectory.answer or "", trajectory.end_reason or "",
                                       context - trajectory.generated_tokens, trajectory.generated_tokens,
                                       trajectory.num_turns))

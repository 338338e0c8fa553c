"""What the rollout loop needs from a generator: start a dialogue, extend it, generate the next turns.

An engine owns the running context of each trajectory (token ids for local models, chat messages for an HTTP
endpoint) and extends it in place: the loop never re-renders the dialogue between turns (token-in/token-out,
as verl found necessary for stable RL). Engines: `transformers` (hf.py), `vllm` (vllm_engine.py) and `openai`
(openai_engine.py); the synth stage's oracle teacher is one more.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from PIL import Image


@dataclass
class Generation:
    """One assistant turn as generated."""

    text: str
    """Decoded text of the new tokens, special tokens removed, a stop string kept."""
    finish: Literal["stop", "eos", "length"]
    """Why it stopped: a stop string (a tool call's closing tag), the end-of-turn token, or the token budget."""
    num_tokens: int
    """New tokens generated (an estimate where the engine sees no tokens)."""


@dataclass
class TokenTrace:
    """A trajectory's full token sequence, which of its tokens the model generated, and their log-probs.

    RL trains on exactly these ids: `generated[i]` is 1 for a model token, 0 for prompt, observation and
    turn-closing tokens; `logprobs[i]` is the sampling log-prob of a generated token (0.0 elsewhere).
    """

    input_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Image.Image] = field(default_factory=list, repr=False)
    """The images exactly as the model saw them, in placeholder order."""
    extras: dict[str, Any] = field(default_factory=dict, repr=False)
    """Engine-specific tensors (processed pixel values, grid sizes) kept for re-use, never serialised: a pickled
    trace (a Ray actor's result) comes back with it empty."""

    def __getstate__(self) -> dict[str, Any]:
        """The trace without `extras`: its float32 pixel values are 8x the uint8 images they come from
        (24 bytes a pixel), and whoever consumes a trace elsewhere recomputes them from `images`."""
        state = dict(self.__dict__)
        state["extras"] = {}
        return state

    def append(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        self.input_ids += ids
        self.generated += [int(generated)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class TurnQueue:
    """A batch engine's submitted turns, oldest first: (ticket, state, max_new_tokens)."""

    turns: list[tuple[int, Any, int]] = field(default_factory=list)
    next_ticket: int = 0


class Engine(ABC):
    """A generator the rollout loop drives. States are opaque to the loop.

    The loop hands over one turn at a time (`submit`) and collects finished turns (`poll`). The default is a
    batch engine's: turns queue first in, first out, and each `poll` generates the first `batch_size` of them
    together through `generate`, so batches are refilled from whatever trajectories wait, whatever their turn,
    and the same submissions always make the same batches. Engines that serve requests concurrently (an HTTP
    endpoint) override `submit`, `poll` and `cancel`.
    """

    name: str = "engine"
    batch_size: int = 1
    """Turns generated together: the most a `poll` of a batch engine takes from its queue."""
    temperature: float = 1.0
    """Sampling temperature of a dialogue's first assistant turn (of every turn unless `later_temperature`)."""
    later_temperature: float | None = None
    """Sampling temperature of every assistant turn after the first (`rollout.later_turn_temperature`), or None."""
    image_factor: int | None = None
    """The model's image grid (patch x merge) when the engine knows its model's processor, else None: the rollout
    loop shows every image on it (`loupe.config.ProtocolParams.image_factor`)."""
    image_pixels: tuple[int, int] | None = None
    """(min, max) area the model's image processor resizes into, when the engine knows it
    (`ProtocolParams.processor_min_pixels`, `processor_max_pixels`)."""

    def temperature_for(self, first_turn: bool) -> float:
        """The temperature a turn samples at: `later_temperature` for a dialogue's later turns, when set."""
        return self.temperature if first_turn or self.later_temperature is None else self.later_temperature

    @abstractmethod
    def begin(self, system: str, question: str, images: list[Image.Image]) -> Any:
        """A new dialogue's state: the system prompt and the first user turn (`<image>` placeholders)."""

    @abstractmethod
    def generate(self, states: list[Any], max_new_tokens: int) -> list[Generation]:
        """Generate the next assistant turn of every state, appending it to that state."""

    @abstractmethod
    def add_user_turn(self, state: Any, text: str, images: list[Image.Image]) -> None:
        """Close the assistant turn and append a user turn (an observation or an error message)."""

    def add_assistant_text(self, state: Any, text: str) -> None:
        """Append an assistant turn written elsewhere (a dialogue a client sends `loupe serve`), as context the
        model did not generate; `add_user_turn` closes it."""
        raise NotImplementedError(f"the {self.name} engine cannot take a written assistant turn")

    @abstractmethod
    def context_length(self, state: Any) -> int:
        """Tokens the dialogue holds now (an estimate where the engine sees no tokens)."""

    def trace(self, state: Any) -> TokenTrace | None:
        """The state's token-level record, where the engine has one."""
        return None

    def submit(self, state: Any, max_new_tokens: int) -> int:
        """Queue the state's next assistant turn; returns the ticket `poll` reports it under."""
        queue = self._queue()
        queue.next_ticket += 1
        queue.turns.append((queue.next_ticket, state, max_new_tokens))
        return queue.next_ticket

    def poll(self) -> list[tuple[int, Generation]]:
        """Generate at least one queued turn and return the finished ones as (ticket, generation).

        A batch engine takes the oldest `batch_size` queued turns that share the first one's token budget.
        """
        turns = self._queue().turns
        if not turns:
            raise RuntimeError(f"{self.name} engine: poll with no turn submitted")
        budget = turns[0][2]
        taken = [turn for turn in turns if turn[2] == budget][: max(1, self.batch_size)]
        for turn in taken:
            turns.remove(turn)
        generations = self.generate([state for _, state, _ in taken], budget)
        return [(ticket, generation) for (ticket, _, _), generation in zip(taken, generations)]

    def generate_by_polling(self, states: list[Any], max_new_tokens: int) -> list[Generation]:
        """`generate` for an engine that serves turns as they are submitted (it overrides `submit` and `poll`):
        submit every state, poll until all are back, in the states' order; on an error, drop the rest."""
        tickets = [self.submit(state, max_new_tokens) for state in states]
        finished: dict[int, Generation] = {}
        try:
            while len(finished) < len(tickets):
                finished.update(self.poll())
        except BaseException:
            self.cancel()
            raise
        return [finished[ticket] for ticket in tickets]

    def cancel(self) -> None:
        """Drop every submitted turn not yet returned (the loop stops on an error)."""
        self._queue().turns.clear()

    def discard(self, tickets: set[int]) -> None:
        """Drop these submitted turns and leave the others running (a served request whose client went away,
        `loupe.serve`); a dropped turn is never reported by `poll`. A batch engine drops them from its queue;
        engines with turns mid-way also stop those."""
        queue = self._queue()
        queue.turns = [turn for turn in queue.turns if turn[0] not in tickets]

    def _queue(self) -> TurnQueue:
        queue = getattr(self, "_turn_queue", None)
        if queue is None:
            queue = self._turn_queue = TurnQueue()
        return queue

    def reseed(self, seed: int) -> None:
        """Make the samples of the turns submitted from now on a function of `seed` (and the submissions)."""

    def close(self) -> None:
        """Release what the engine holds (GPU memory, threads)."""

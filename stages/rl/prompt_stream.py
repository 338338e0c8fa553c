"""The order in which a run draws its training prompts: a fresh seeded permutation of the train split each
epoch, whose whole state is one integer (checkpointed), and, for rl.run_length: passes, whole batches within a
pass as verl's `drop_last=True` dataloader draws them."""

from __future__ import annotations

import numpy as np


class PromptStream:
    """Task indices in a fresh seeded permutation each epoch; its whole state is one integer, `position`.

    With `whole_batches` (rl.run_length: passes) every `take` is one batch of that size drawn within one pass:
    a pass's last partial batch is skipped, as verl's `drop_last=True` dataloader drops it, and `batches_drawn`
    counts the batches taken, verl's generation batches."""

    def __init__(self, num_tasks: int, seed: int, position: int = 0, whole_batches: int | None = None):
        if num_tasks < 1:
            raise ValueError("the train split holds no task")
        self.num_tasks, self.seed, self.position = num_tasks, seed, position
        self.whole_batches = whole_batches
        self._orders: dict[int, np.ndarray] = {}

    @property
    def batches_drawn(self) -> int:
        """Whole batches taken so far (with `whole_batches`)."""
        size = self.whole_batches or 1
        passes, into = divmod(self.position, self.num_tasks)
        return passes * (self.num_tasks // size) + into // size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_tasks)}
        return self._orders[epoch]

    def take(self, count: int) -> list[int]:
        if self.whole_batches is not None and self.position % self.num_tasks + count > self.num_tasks:
            self.position += self.num_tasks - self.position % self.num_tasks  # the pass's partial batch, dropped
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, self.num_tasks)
            out.append(int(self._order(epoch)[index]))
            self.position += 1
        return out

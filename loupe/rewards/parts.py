"""`RewardParts`: a trajectory's reward, part by part (what `score` returns and custom rewards may return)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RewardParts:
    """A trajectory's reward, part by part. Invalid rewards (the judge failed) have accuracy and total None."""

    accuracy: float | None
    format: float
    tool: float
    total: float | None
    valid: bool = True
    invalid_reason: str | None = None
    extracted: str | None = None
    """What was compared: the option letter found, or the answer text; None when there was nothing."""
    matched_by: str | None = None
    """How accuracy was decided: `letter`, `exact`, `math`, `mathruler`, `judge`, `no_answer`, `custom`, or a
    recipe's rule (`deepeyes`, `mini_o3`, ...); `<rule>, judge failed, scored 0` when the judge gave no verdict and
    its `on_failure: zero` scored accuracy 0."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

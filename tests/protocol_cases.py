"""What the protocol tests share (tests/test_protocol*.py): the protocols, the fuzzing budget, the parser's
documented tolerance, a Mini-o3 turn around a payload and the check that an Action holds exactly the fields its
kind says."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings

from loupe.protocol import (
    ORIGINAL_IMAGE,
    Action,
    FormatErrorKind,
    get_protocol,
)

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MINI = get_protocol("mini_o3")
LOUPE = get_protocol("loupe")
DEEPEYES = get_protocol("deepeyes")
SINGLE = get_protocol("single_turn")

TOLERANCE = 1e-3
"""The documented slack outside [0, 1] that is clamped (docs/architecture.md, Parser policy); written here, not
imported, so a change to the parser's constant shows up as a failing test."""
HAIR_OUTSIDE = [-1e-9, -0.0005, -0.001, 1.0000001, 1.0005, 1.001]


def grounding(payload: str, think: str = "the sign is small") -> str:
    return f"<think>{think}</think>\n<grounding>{payload}</grounding>"


def call_payload(box: Any, source: Any = ORIGINAL_IMAGE) -> str:
    return json.dumps({"bbox_2d": box, "source": source})


def assert_well_typed(action: Action) -> None:
    """An Action has exactly the field set its kind says."""
    assert action.kind in ("call", "answer", "error")
    if action.kind == "call":
        assert action.call is not None and action.answer is None and action.error is None
    elif action.kind == "answer":
        assert action.answer is not None and action.call is None and action.error is None
    else:
        assert action.error is not None and action.call is None and action.answer is None
        assert isinstance(action.error.kind, FormatErrorKind)
        assert isinstance(action.error.detail, str) and action.error.detail.strip()

K = FormatErrorKind

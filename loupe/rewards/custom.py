"""User-supplied reward functions: `load_custom_reward("path/to/file.py:fn")` for the rl stage."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from collections.abc import Callable
from numbers import Real
from pathlib import Path
from typing import Any

from loupe.rewards.parts import RewardParts

SCORE_ARGUMENTS = ("task", "answer", "end_reason", "num_tool_calls", "num_format_errors", "has_think", "cfg", "judge")
"""The keyword arguments a custom reward function is called with (`score`'s, less its optional `final_text`)."""


class CustomRewardError(ValueError):
    """A custom reward spec that cannot be loaded, or a custom function that returned something unusable."""


def load_custom_reward(spec: str) -> Callable[..., RewardParts]:
    """Load `path/to/file.py:function_name` and return it wrapped to always give `RewardParts`.

    The function is called with `score`'s keyword arguments (task, answer, end_reason, num_tool_calls,
    num_format_errors, has_think, cfg, judge; it may take `**kwargs` for those it ignores) and returns either
    `RewardParts` or a plain number, taken as the total (accuracy then reads None: not measured). It may call
    `loupe.rewards.score` itself and adjust the result.
    """
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise CustomRewardError(f"custom reward {spec!r}: expected 'path/to/file.py:function_name'")
    path = Path(path_text)
    if not path.is_file():
        raise CustomRewardError(f"custom reward {spec!r}: file {path} not found")
    if path.suffix != ".py":
        raise CustomRewardError(f"custom reward {spec!r}: {path} is not a .py file")
    module_name = "loupe_custom_reward_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise CustomRewardError(f"custom reward {spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        raise CustomRewardError(
            f"custom reward {spec!r}: importing {path} failed: {type(err).__name__}: {err}"
        ) from err
    function = getattr(module, name, None)
    if function is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CustomRewardError(f"custom reward {spec!r}: {path} defines no {name!r}; callables there: {public}")
    if not callable(function):
        raise CustomRewardError(f"custom reward {spec!r}: {name!r} is not callable")
    try:
        inspect.signature(function).bind(**{arg: None for arg in SCORE_ARGUMENTS})
    except TypeError as err:
        raise CustomRewardError(
            f"custom reward {spec!r}: {name} must accept the keyword arguments {', '.join(SCORE_ARGUMENTS)} "
            f"(or **kwargs): {err}"
        ) from None
    except ValueError:
        pass  # a builtin without a signature: find out at call time

    def custom_reward(**kwargs: Any) -> RewardParts:
        value = function(**kwargs)
        if isinstance(value, RewardParts):
            return value
        if isinstance(value, Real) and not isinstance(value, bool):
            return RewardParts(None, 0.0, 0.0, float(value), True, None, None, "custom")
        raise CustomRewardError(
            f"custom reward {spec!r} returned {type(value).__name__}; expected RewardParts or a number"
        )

    custom_reward.__name__ = f"custom_reward[{name}]"
    custom_reward.__wrapped__ = function  # type: ignore[attr-defined]
    return custom_reward

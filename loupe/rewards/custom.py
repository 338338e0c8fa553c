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

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""verl's custom reward signature (`verl/trainer/ppo/reward.py`, `get_custom_reward_fn`, called by its reward
managers as `compute_score(data_source, solution_str, ground_truth, extra_info)`): a function whose parameters
are these is called so, with the response text, and may return a number or a dict holding `score`."""


class CustomRewardError(ValueError):
    """A custom reward spec that cannot be loaded, or a custom function that returned something unusable."""


def load_custom_reward(spec: str) -> Callable[..., RewardParts]:
    """Load `path/to/file.py:function_name` and return it wrapped to always give `RewardParts`.

    The function is called with `score`'s keyword arguments (task, answer, end_reason, num_tool_calls,
    num_format_errors, has_think, cfg, judge; it may take `**kwargs` for those it ignores) and returns either
    `RewardParts` or a plain number, taken as the total (accuracy then reads None: not measured). It may call
    `loupe.rewards.score` itself and adjust the result.

    A verl reward function, `compute_score(data_source, solution_str, ground_truth, extra_info)`, is called the
    verl way instead (`VERL_ARGUMENTS`): the wrapper then needs `task` and `response` (the assistant turns'
    text, joined by newlines: one turn is verl's decoded response exactly) and passes as `extra_info` the row's
    own `extra_info` when the record keeps one (`loupe data import deepeyes`), else the record's extra fields. A
    dict it returns gives the total from `score` and the accuracy from `acc` when present.
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
    if _takes_verl_arguments(function):
        return _verl_reward(function, spec, name)
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


def _takes_verl_arguments(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except ValueError:
        return False
    return {"solution_str", "ground_truth"} <= set(parameters)


def _verl_reward(function: Callable[..., Any], spec: str, name: str) -> Callable[..., RewardParts]:
    """The wrapper of a verl-style `compute_score` (see `load_custom_reward`)."""

    def verl_reward(*, task: Any, response: str, **_: Any) -> RewardParts:
        extra = dict(getattr(task, "model_extra", None) or {})
        if isinstance(extra.get("extra_info"), dict):  # the publisher's own, kept whole by the import
            extra = dict(extra["extra_info"])
        value = function(data_source=task.data_source, solution_str=response, ground_truth=task.solution,
                         extra_info=extra)
        accuracy = None
        if isinstance(value, dict):
            if "score" not in value:
                raise CustomRewardError(f"custom reward {spec!r} returned a dict without 'score': {sorted(value)}")
            accuracy = value.get("acc")
            value = value["score"]
        if isinstance(value, Real) and not isinstance(value, bool):
            return RewardParts(None if accuracy is None else float(accuracy), 0.0, 0.0, float(value), True, None,
                               None, "custom")
        raise CustomRewardError(f"custom reward {spec!r} returned {type(value).__name__}; expected a number or a "
                                "dict with 'score' (verl's compute_score)")

    verl_reward.__name__ = f"verl_reward[{name}]"
    verl_reward.__wrapped__ = function  # type: ignore[attr-defined]
    verl_reward.verl_style = True  # type: ignore[attr-defined]
    return verl_reward

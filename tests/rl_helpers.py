"""Helpers of the rl stage's tests: a toy task set, a params file, and the toy reward the learning test uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from PIL import Image

from loupe.data.tasks import TaskRecord, write_tasks

TOY_REWARD = Path(__file__).with_name("rl_toy_reward.py")


def make_toy_tasks(root: Path, count: int = 8, side: int = 56) -> Path:
    """`count` four-option choice questions, each about its own small image, whose right letter is always B."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    tasks = []
    for i in range(count):
        Image.new("RGB", (side, side), (30 * i % 256, (200 - 20 * i) % 256, 90)).save(root / "images" / f"{i}.png")
        tasks.append(
            TaskRecord(
                doc_id=f"toy-{i}",
                images=[f"images/{i}.png"],
                problem="Which option is right?",
                solution="B",
                options=["red", "green", "blue", "grey"],
                data_source="toy",
            )
        )
    write_tasks(tasks, root / "train.jsonl")
    write_tasks(tasks[: max(2, count // 2)], root / "val.jsonl")
    return root


def write_params(path: Path, rl: dict[str, Any], protocol: dict[str, Any] | None = None,
                 rollout: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """A params file with the toy defaults below, overridden by the given sections' keys."""
    base_rl: dict[str, Any] = {
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 4,
        "lr": 0.01,
        "cpu_threads": 1,
        "val_every": 0,
        "sample_trajectories_every": 0,
        "checkpoint_every": 1,
        "dynamic_sampling": {"enabled": False},
        "custom_reward": f"{TOY_REWARD}:letter_in_response",
        "ray": {"enabled": False},
    }
    data = {
        "seed": seed,
        "protocol": {"name": "single_turn", **(protocol or {})},
        "rollout": {"max_new_tokens": 4, "device": "cpu", **(rollout or {})},
        "rl": {**base_rl, **rl},
    }
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run the module's tiny-model work on one torch thread (import this fixture to use it).

    On a small CPU shared with other jobs, OpenMP threads waiting for a busy core stall every op: one thread is
    10-30x faster here. The previous setting comes back afterwards, so other test modules are untouched.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def crash_at_step_3(params: Path, model: Path, tasks: Path, out: Path, monkeypatch: Any) -> Any:
    """Train until step 3 raises (after the step-2 checkpoint); returns the real `Trainer.train_step`, for the
    caller to put back before it resumes."""
    from stages.rl import __main__ as rl_main
    from stages.rl.trainer import Trainer

    real_step = Trainer.train_step

    def crashing(self: Any, step: int) -> Any:
        if step == 3:
            raise RuntimeError("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        rl_main.train(params, model, tasks, out, progress=False)
    return real_step


@pytest.fixture
def votes_by_first_letter(monkeypatch):
    """Test-time RL's vote on the toy (import this fixture to use it): the untrained tiny model writes no
    `<answer>`, so a sample's vote is the first option letter in its last turn."""
    import stages.rl.ttrl as ttrl

    def first_letter(trajectory):
        text = next(t.text for t in reversed(trajectory.turns) if t.role == "assistant")
        return next((c for c in text if c in "ABCD"), None)

    monkeypatch.setattr(ttrl, "normalised_answer", first_letter)

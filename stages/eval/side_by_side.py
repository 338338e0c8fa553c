"""Models evaluated side by side on a CPU: one process each, one torch thread each, one progress bar.

On a CPU the transformers engine's small matrices use a second thread poorly: the default's eval rolled out
0.098 s a trajectory at two threads and 0.053 s with two models in two processes at one thread each (2 cores,
docs/speed.md, "What was removed"). Each model's evaluation (`stages.eval.one_model.evaluate_model`) is
independent: its own engine, sampling from its own generator seeded with the run's seed, into its own folder.
Forward passes give the same bits at one thread as at two on the pinned kernels, so a model's files are the
same, byte for byte, whether it ran alone or beside the others (tests/test_eval_compare.py).

Processes are spawned, not forked: the stage has imported torch, whose thread pools do not survive a fork.
The children report each finished trajectory to a shared counter, which feeds the parent's single bar;
MLflow, the comparison and the summary stay in the parent.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from stages.eval.one_model import evaluate_model, set_progress_counter

MIN_TRAJECTORIES = 100
"""Trajectories a model must have for `model_processes: null` to run the models side by side: a spawned process
spends about 8 s importing torch and transformers on 2 cores, which about 100 trajectories repay (0.045 s saved
on each, measured on the default)."""


def model_processes(setting: int | None, engine: str, device: str, models: int, trajectories: int) -> int:
    """How many models run at once: `eval.model_processes`, or with None every model when the transformers
    engine runs on the CPU and each model has `MIN_TRAJECTORIES`, else one (a GPU, vLLM, an endpoint and a
    small evaluation run them one after another)."""
    if setting is not None:
        return max(1, min(setting, models))
    if engine != "transformers" or models < 2 or trajectories < MIN_TRAJECTORIES:
        return 1
    from loupe.models import resolve_device

    return models if resolve_device(device) == "cpu" else 1


def _start_child(counter: Any, parent: int) -> None:
    set_progress_counter(counter)
    # A stage killed outright (SIGKILL, or SIGTERM to it alone) must not leave its models computing: the child
    # gets SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG, as stages/sft/runner.py sets for
    # LLaMA-Factory), and stops at once if the parent is already gone.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the pool's own broken-pipe check ends the child later
        pass
    if os.getppid() != parent:
        os._exit(1)
    import torch

    torch.set_num_threads(1)  # one core each: the models, not the threads, share the machine


def _evaluate_child(params_path: Path, model_path: Path, out_dir: Path, benchmarks: list, label: str) -> tuple:
    return evaluate_model(params_path, model_path, out_dir, benchmarks, False, label=label)


def evaluate_side_by_side(params_path: Path, models: dict[str, Path], out_dir: Path, benchmarks: list,
                          samples: int, processes: int, progress: bool) -> dict[str, tuple]:
    """`_evaluate` of every model into `out_dir/<name>`, `processes` at a time; {name: its result}."""
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    total = sum(len(tasks) for _, tasks, _ in benchmarks) * samples * len(models)
    with ProcessPoolExecutor(max_workers=processes, mp_context=context, initializer=_start_child,
                             initargs=(counter, os.getpid())) as pool, \
         tqdm(total=total, desc=f"eval {', '.join(models)} ({processes} processes)", unit="traj",
              disable=not progress) as bar:
        futures = {name: pool.submit(_evaluate_child, params_path, path, out_dir / name, benchmarks, name)
                   for name, path in models.items()}
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            bar.update(counter.value - bar.n)
            if any(f.exception() is not None for f in done):
                for future in pending:
                    future.cancel()
                break
        bar.update(counter.value - bar.n)
        return {name: future.result() for name, future in futures.items()}

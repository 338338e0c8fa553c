"""The one-GPU user's rl stage, reproduced on the CPU: Ray off, the learner and an in-process engine naming the
same GPU.

On one H200 (issue 41) `python -m stages.rl ... rl.ray.enabled=false` made its first update and then waited in
the weight sync until killed: the transport rule saw one GPU for every rank and picked `ipc`, whose receiver was
a thread of the learner's own process. CUDA does not let a process open an IPC handle it made itself
(`cuIpcOpenMemHandle` answers "invalid device context", the error UCX's CUDA IPC transport reports for a
same-process handle, openucx/ucx PR 11603), so the receiving thread died, and the learner waited at the barrier
for a rank that would never come.

Here the device identities are faked so that the rule sees one GPU, and the CUDA handle's rule is faked with it:
a handle opens in any process but the one that made it. Before the fix the run failed after `sync_timeout_s`;
now an in-process engine takes the learner's weights directly and no transport runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from rl_helpers import make_toy_tasks, one_torch_thread, write_params  # noqa: F401 (autouse fixture)

import loupe.rollout.weight_sync as weight_sync
import stages.rl.learner as learner_module
from stages.rl import __main__ as rl_main

ONE_GPU = "127.0.0.1/GPU-5f1c0e2a-fake-h200"
"""The identity every rank reports: one GPU for the learner and its engine, as on the H200."""


def _open_handle(maker_pid: int, payload: bytes):
    if maker_pid == os.getpid():
        raise RuntimeError("CUDA error: invalid device context (cuIpcOpenMemHandle on a handle this process made)")
    return pickle.loads(payload)


class CudaLikeHandle:
    """A CPU shared-memory handle that obeys CUDA's IPC rule: it opens in any process but the one that made it."""

    def __init__(self, maker_pid: int, payload: bytes):
        self.maker_pid, self.payload = maker_pid, payload

    def __reduce__(self):
        return _open_handle, (self.maker_pid, self.payload)


@pytest.fixture
def one_fake_gpu(monkeypatch):
    """Every rank on one GPU, and the `ipc` handles behaving as CUDA's do."""
    shared_memory_handle = weight_sync._ipc_handle
    monkeypatch.setattr(weight_sync, "device_identity", lambda device: ONE_GPU)
    monkeypatch.setattr(learner_module, "device_identity", lambda device: ONE_GPU)
    monkeypatch.setattr(weight_sync, "_ipc_handle",
                        lambda buffer: pickle.dumps(CudaLikeHandle(os.getpid(), shared_memory_handle(buffer))))


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return make_toy_tasks(tmp_path_factory.mktemp("toy"))


def _train_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def test_the_faked_gpu_makes_the_rule_pick_ipc_and_its_handles_refuse_their_own_process(one_fake_gpu):
    """The reproduction's two fakes do what the H200 did: `ipc` is chosen, and a same-process open fails."""
    assert weight_sync.choose_backend(learner_module.device_identity("cuda:0"), [weight_sync.device_identity("cuda")]) == "ipc"
    handle = weight_sync._ipc_handle(torch.arange(4, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="invalid device context"):
        pickle.loads(handle)


def test_one_gpu_without_ray_finishes_its_steps_with_the_engine_on_the_learners_weights(one_fake_gpu, tiny_model_dir, toy_dir, tmp_path):
    params = write_params(tmp_path / "params.yaml", {"steps": 3, "sync_timeout_s": 5})
    started = time.monotonic()
    rl_main.train(params, tiny_model_dir, toy_dir, tmp_path / "out", progress=False)
    rows = _train_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "out" / "model" / "config.json").is_file()
    # The engine sampled steps 2 and 3 from the updated weights: its log-probs are the learner's to float32
    # rounding. An engine left on the old weights differs by far more after an update at lr 0.01.
    assert all(r["rollout/logprob_gap_max"] < 1e-3 for r in rows[1:]), [r["rollout/logprob_gap_max"] for r in rows]
    assert all(r["time/sync"] < 2.0 for r in rows)  # no wait on a transport
    assert time.monotonic() - started < 120


def _gap_of_one_colocated_step(tiny_model_dir, toy_dir, out: Path, monkeypatch, engine_autocast: bool) -> dict:
    from loupe.rollout.hf import TransformersEngine

    if not engine_autocast:  # the engine as it was: the learner's float32 module in float32
        monkeypatch.setattr(TransformersEngine, "_autocast", lambda self: contextlib.nullcontext())
    params = write_params(out.with_suffix(".yaml"), {"steps": 1, "mixed_precision": "bf16", "samples_per_prompt": 8,
                                                     "ray": {"enabled": False, "colocate": True}},
                          rollout={"max_new_tokens": 16})
    rl_main.train(params, tiny_model_dir, toy_dir, out, progress=False)
    monkeypatch.undo()
    return _train_rows(out)[0]


def test_a_colocated_engine_generates_in_the_learners_bf16(tiny_model_dir, toy_dir, tmp_path, monkeypatch):
    """Colocated mode on a GPU: the engine generates with the learner's float32 module under the learner's bf16
    autocast. Forced here on the CPU (mixed_precision: bf16): the engine's log-probs are the bf16 learner's to
    within bf16's rounding of two forwards that differ only in batching, far closer than a float32 engine's
    (measured: mean 5.5e-5, p99 9.9e-4 nats against 4.8e-4 and 1.6e-3 for a float32 engine)."""
    bf16 = _gap_of_one_colocated_step(tiny_model_dir, toy_dir, tmp_path / "bf16", monkeypatch, engine_autocast=True)
    fp32 = _gap_of_one_colocated_step(tiny_model_dir, toy_dir, tmp_path / "fp32", monkeypatch, engine_autocast=False)
    assert bf16["rollout/logprob_gap_mean"] < fp32["rollout/logprob_gap_mean"] / 2

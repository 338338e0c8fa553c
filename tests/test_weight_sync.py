"""Weights from the learner to the rollout engines by bucketed broadcast (loupe.rollout.weight_sync), on gloo, and
by handle (`ipc`, the colocated transport), and the rule that picks the transport.

The learner's rank 0 and the engines form a process group of their own; here the engines run in threads of
this process (gloo connects them over loopback like separate processes), and through Ray actors in
tests/test_rl_stage.py and tests/test_rl_cluster.py.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch
from rl_helpers import one_torch_thread  # noqa: F401 (autouse fixture)

from loupe.config import ProtocolParams, RolloutParams
from loupe.rollout import make_engine
from loupe.rollout.weight_sync import (
    ALIGNMENT,
    SyncGroup,
    bucket_layout,
    choose_backend,
    device_identity,
    free_address,
    load_into_module,
    manifest_names,
    module_digest,
    plan_manifest,
    receive_weights,
    send_weights,
)
from stages.rl.learner import Learner
from stages.rl.params import RLParams


def test_manifest_buckets_respect_the_size_and_keep_order():
    specs = [(f"w{i}", torch.float32, (10, 10)) for i in range(10)] + [("big", torch.float32, (100, 100)), ("step", torch.int64, (1,))]
    manifest = plan_manifest(specs, torch.bfloat16, bucket_bytes=700)
    assert manifest_names(manifest) == [name for name, _, _ in specs]
    for bucket in manifest:
        offsets, size = bucket_layout(bucket)
        assert all(offset % ALIGNMENT == 0 for offset in offsets)
        assert size <= 700 or len(bucket) == 1  # only a tensor larger than a bucket gets one of its own
    entries = {name: (dtype, shape) for bucket in manifest for name, dtype, shape in bucket}
    assert entries["w0"] == ("bfloat16", [10, 10])  # floating tensors travel in the engine's dtype
    assert entries["step"] == ("int64", [1])  # others keep theirs
    # Plain lists of str/int: what vLLM's msgpack encoder carries unchanged (and pickle, trivially).
    assert pickle.loads(pickle.dumps(manifest)) == manifest
    assert all(isinstance(x, (str, list)) for b in manifest for e in b for x in e)


def _broadcast(sender_state, receivers, manifest, backend="gloo"):
    host, port = free_address()
    world = 1 + len(receivers)
    loaded, errors = [0] * len(receivers), []

    def receive(i, module):
        try:
            group = SyncGroup(host, port, 1 + i, world, backend, 60)
            loaded[i] = load_into_module(module, receive_weights(group, manifest))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=receive, args=(i, m)) for i, m in enumerate(receivers)]
    for t in threads:
        t.start()
    group = SyncGroup(host, port, 0, world, backend, 60)
    sent = send_weights(group, sender_state.items(), manifest)
    for t in threads:
        t.join(60)
    assert not errors, errors
    return sent, loaded


def test_learner_weights_reach_two_engines_exactly(tiny_model_dir):
    learner = Learner(tiny_model_dir, RLParams(lr=0.05), 1.0, generation_budget=4, device="cpu")
    with torch.no_grad():  # weights the engines do not have yet
        for p in learner.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    engines = [make_engine(RolloutParams(device="cpu"), ProtocolParams(), model_path=str(tiny_model_dir)) for _ in range(2)]
    assert all(e.weights_digest() != module_digest(learner.model) for e in engines)
    manifest = plan_manifest(learner.weight_specs(), torch.float32, bucket_bytes=64 << 10)
    assert len(manifest) > 1  # several buckets, so the bucket walk is exercised
    sent, loaded = _broadcast(learner.model.state_dict(), [e.model for e in engines], manifest)
    assert loaded == [len(manifest_names(manifest))] * 2
    assert sent >= sum(p.numel() * 4 for p in learner.model.parameters())
    assert [e.weights_digest() for e in engines] == [module_digest(learner.model)] * 2


def test_bf16_sync_rounds_like_a_cast(tiny_model_dir):
    learner = Learner(tiny_model_dir, RLParams(), 1.0, generation_budget=4, device="cpu")
    engine = make_engine(RolloutParams(device="cpu"), ProtocolParams(), model_path=str(tiny_model_dir))
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    manifest = plan_manifest(learner.weight_specs(), torch.bfloat16)
    sent, _ = _broadcast(learner.model.state_dict(), [engine.model], manifest)
    expected = {k: v.to(torch.bfloat16).float() for k, v in learner.model.state_dict().items()}
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert sent < sum(p.numel() * 4 for p in learner.model.parameters())  # half the fp32 bytes, give or take


def test_a_manifest_that_does_not_match_the_learner_fails_by_name(tiny_model_dir):
    learner = Learner(tiny_model_dir, RLParams(), 1.0, generation_budget=4, device="cpu")
    specs = learner.weight_specs()
    manifest = plan_manifest([specs[1], specs[0], *specs[2:]], torch.float32)
    with pytest.raises(ValueError, match="the manifest expects"):
        send_weights(None, learner.model.state_dict().items(), manifest)


def test_an_engine_of_another_architecture_is_refused(tiny_model_dir):
    module = torch.nn.Linear(2, 2)
    with pytest.raises(KeyError, match="no tensor 'model.language_model"):
        load_into_module(module, [("model.language_model.embed_tokens.weight", torch.zeros(2, 2))])


def test_ipc_transport_hands_buckets_by_handle_and_each_engine_copies_them(tiny_model_dir):
    """The colocated transport (`ipc`): gloo carries only each bucket's handle and a barrier. On CPU the handle
    names a shared-memory file, on a GPU a CUDA IPC handle; the code path is the same."""
    learner = Learner(tiny_model_dir, RLParams(), 1.0, generation_budget=4, device="cpu")
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    engines = [make_engine(RolloutParams(device="cpu"), ProtocolParams(), model_path=str(tiny_model_dir)) for _ in range(2)]
    manifest = plan_manifest(learner.weight_specs(), torch.float32, bucket_bytes=64 << 10)
    sent, loaded = _broadcast(learner.model.state_dict(), [e.model for e in engines], manifest, backend="ipc")
    assert loaded == [len(manifest_names(manifest))] * 2 and sent > 0
    assert [e.weights_digest() for e in engines] == [module_digest(learner.model)] * 2


@pytest.mark.parametrize(
    ("learner", "engines", "expected"),
    [
        ("n1/cpu", ["n1/cpu"], "gloo"),  # the laptop
        ("n1/GPU-a", ["n1/cpu"], "gloo"),  # vLLM's CPU build beside a GPU learner
        ("n1/GPU-a", ["n1/GPU-b", "n1/GPU-c"], "nccl"),  # a GPU a rank
        ("n1/GPU-a", ["n2/GPU-a", "n2/GPU-b"], "nccl"),  # the same UUID text on two nodes is two GPUs
        ("n1/GPU-a", ["n1/GPU-a"], "ipc"),  # colocated on one GPU
        ("n1/GPU-a", ["n1/GPU-a", "n1/GPU-a"], "ipc"),
        ("n1/GPU-a", ["n1/GPU-a", "n1/GPU-b"], "gloo"),  # learner on cuda:0, Ray gave GPU 0 to worker 0
        ("n1/GPU-a", ["n1/GPU-b", "n1/GPU-b"], "gloo"),  # two engines on one GPU
    ],
)
def test_the_transport_follows_where_each_rank_is_never_two_nccl_ranks_on_one_gpu(learner, engines, expected):
    assert choose_backend(learner, engines) == expected


def test_device_identity_names_a_gpu_by_uuid_whatever_its_index(monkeypatch):
    """A faked CUDA device: the learner sees it as cuda:1, a Ray worker as cuda:0; both name the same GPU."""
    from types import SimpleNamespace

    uuids = {0: "GPU-0000", 1: "GPU-1111"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuids[index]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    learner = device_identity("cuda:1")
    worker_view = device_identity("cuda")  # current device: 1 here
    assert learner == worker_view and learner.endswith("/GPU-1111") and device_identity("cpu").endswith("/cpu")
    assert choose_backend(learner, [worker_view]) == "ipc"
    assert choose_backend(learner, [worker_view, device_identity("cuda:0")]) == "gloo"


# --- no wait is unbounded: every transport ends within sync_timeout_s and says who was doing what ----------


def _group_in_thread(host, port, rank, world, backend, timeout_s, then=None):
    """Rank `rank` joins in a thread and runs `then(group)`; returns the thread and a dict of its result/error."""
    found: dict = {}

    def run():
        try:
            group = SyncGroup(host, port, rank, world, backend, timeout_s)
            found["group"] = group
            if then is not None:
                found["result"] = then(group)
        except Exception as err:  # noqa: BLE001 (asserted by the caller)
            found["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, found


def _state_and_manifest(large: bool = False):
    """Two tensors in several buckets; `large`, a 32 MiB first bucket: more than loopback's socket buffers hold, so a
    gloo broadcast from the root cannot complete before a receiver reads it (a small one is sent and done)."""
    state = {"a.weight": torch.randn(4096, 2048) if large else torch.randn(64, 64), "b.weight": torch.randn(64)}
    manifest = plan_manifest([(k, v.dtype, tuple(v.shape)) for k, v in state.items()], torch.float32, bucket_bytes=1 << 12)
    return state, manifest


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_an_engine_that_never_receives_ends_the_learners_wait_within_the_timeout(backend):
    from loupe.rollout.weight_sync import WeightSyncError

    state, manifest = _state_and_manifest(large=True)
    host, port = free_address()
    _thread, _engine = _group_in_thread(host, port, 1, 2, backend, 2.0)  # joins, never receives (kept alive)
    learner = SyncGroup(host, port, 0, 2, backend, 2.0)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        send_weights(learner, state.items(), manifest)
    waited = time.monotonic() - started
    assert 1.5 < waited < 6.0, waited
    message = str(raised.value)
    assert f"weight sync over {backend}" in message
    assert "rank 0 (the learner) gave up after 2 s (rl.sync_timeout_s) at: bucket 1 of" in message
    assert "rank 1 (an engine): joined, idle" in message


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_learner_that_never_sends_ends_the_engines_wait_within_the_timeout(backend):
    from loupe.rollout.weight_sync import WeightSyncError

    _, manifest = _state_and_manifest()
    host, port = free_address()
    learner = {}
    joiner = threading.Thread(target=lambda: learner.setdefault("group", SyncGroup(host, port, 0, 2, backend, 2.0)))
    joiner.start()
    engine = SyncGroup(host, port, 1, 2, backend, 2.0)
    joiner.join(10)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        list(receive_weights(engine, manifest))
    assert time.monotonic() - started < 6.0
    message = str(raised.value)
    assert "rank 1 (an engine) gave up after 2 s" in message and "bucket 1 of" in message
    assert "rank 0 (the learner): joined, idle" in message


def test_an_engine_that_fails_ends_the_learners_wait_at_once_with_its_error(tiny_model_dir):
    """A receiver whose load fails (here a model of another architecture) tells the learner, which stops waiting
    long before the timeout and names the engine's error."""
    from loupe.rollout.weight_sync import WeightSyncError

    state, manifest = _state_and_manifest()
    host, port = free_address()

    def receive(group):
        with group.reporting():
            return load_into_module(torch.nn.Linear(2, 2), receive_weights(group, manifest))

    thread, engine = _group_in_thread(host, port, 1, 2, "ipc", 60.0, then=receive)
    learner = SyncGroup(host, port, 0, 2, "ipc", 60.0)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        send_weights(learner, state.items(), manifest)
    assert time.monotonic() - started < 10.0  # not the 60 s timeout
    thread.join(10)
    assert isinstance(engine.get("error"), KeyError)
    message = str(raised.value)
    assert "another rank failed" in message
    assert "rank 1 (an engine): failed: KeyError" in message and "no tensor 'a.weight'" in message


def test_a_rank_that_never_joins_ends_the_group_forming_within_the_timeout():
    from loupe.rollout.weight_sync import WeightSyncError

    host, port = free_address()
    thread, engine = _group_in_thread(host, port, 1, 3, "gloo", 2.0)  # rank 2 never comes
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        SyncGroup(host, port, 0, 3, "gloo", 2.0)
    assert time.monotonic() - started < 15.0
    message = str(raised.value)
    assert "weight sync over gloo: rank 0 (the learner) could not form the group" in message
    assert "rank 2 (an engine): never reached the group" in message
    thread.join(15)
    assert isinstance(engine.get("error"), WeightSyncError)

"""Check (c): the weight-sync worker extension as vLLM 0.33 loads and calls it.

Runs in .venv-vllm: python tests/vllm_checks/worker_extension.py --model TINY_MODEL_DIR

1. `loupe.rollout.weight_sync.VLLMWeightSyncExtension` imports here and its methods have the signatures the
   engine calls them with.
2. vLLM's own `WorkerWrapperBase.init_worker` mixes it into `vllm.v1.worker.gpu_worker.Worker` (the GPU worker
   class; its constructor runs on CPU): no name clash (vLLM asserts none), the methods become the worker's.
3. A weight sync end to end, on gloo: loupe's VLLMEngine (on vLLM's front end, `_harness.replay_engine`) calls
   `init_weight_sync`, `receive_weights` and `weights_digest` through `LLM.collective_rpc`; the calls cross
   vLLM's msgpack encoder/decoder and the executor's pickle hop unchanged, run on that worker, join a group
   with a learner thread (rank 0, `send_weights` of a perturbed transformers model's state dict), and land
   in vLLM's own Qwen2.5-VL model (built on CPU) through its `load_weights`. The result must equal the same
   state dict handed to `load_weights` directly, and every parameter must have changed.
"""

from __future__ import annotations

import inspect
import threading

import _harness

_harness.select_cpu_platform()


def check(result: dict) -> None:
    model_path = _harness.model_dir()

    import torch

    result["versions"] = _harness.versions()

    # 1. Import and signatures.
    from loupe.rollout import weight_sync
    from loupe.rollout.weight_sync import VLLMWeightSyncExtension

    result["extension_methods"] = {
        name: str(inspect.signature(getattr(VLLMWeightSyncExtension, name)))
        for name in ("init_weight_sync", "receive_weights", "weights_digest")
    }

    # 2. vLLM mixes it into its GPU worker class.
    engine, core = _harness.replay_engine(model_path, temperature=1.0, top_p=1.0, seed=0)
    result["worker_extension_cls"] = core.vllm_config.parallel_config.worker_extension_cls
    worker, vllm_model = _harness.attach_worker(core)
    worker_class = type(worker.worker)
    result["worker_class"] = f"{worker_class.__module__}.{worker_class.__qualname__}"
    result["worker_bases"] = [f"{b.__module__}.{b.__qualname__}" for b in worker_class.__bases__]
    result["worker_has_methods"] = {
        name: callable(getattr(worker.worker, name, None)) for name in ("init_weight_sync", "receive_weights", "weights_digest")
    }
    result["vllm_model_class"] = type(vllm_model).__name__
    result["vllm_model_dtype"] = str(next(vllm_model.parameters()).dtype)

    # 3. A sync through collective_rpc. The learner: the checkpoint, perturbed so the sync is visible.
    from transformers import AutoModelForImageTextToText

    learner = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in learner.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    state = learner.state_dict()
    dtype, device = engine.weights_format()
    result["weights_format"] = [dtype, device]
    manifest = weight_sync.plan_manifest(
        [(name, t.dtype, tuple(t.shape)) for name, t in state.items()], weight_sync.dtype_from_name(dtype), bucket_bytes=64 << 10
    )
    result["manifest_buckets"] = len(manifest)
    result["manifest_tensors"] = sum(len(b) for b in manifest)

    before = {name: p.detach().clone() for name, p in vllm_model.named_parameters()}
    host, port = "127.0.0.1", _harness.free_port()
    learner_side: dict = {}

    def learner_thread() -> None:
        try:
            group = weight_sync.SyncGroup(host, port, 0, 2, "gloo", 60.0)
            learner_side["joined"] = True
            ready.wait(60)
            learner_side["sent_bytes"] = weight_sync.send_weights(group, state.items(), manifest)
            group.close()
        except BaseException as error:  # noqa: BLE001 - reported below
            learner_side["error"] = repr(error)

    ready = threading.Event()
    thread = threading.Thread(target=learner_thread, daemon=True)
    thread.start()
    engine.init_weight_sync(host, port, 1, 2, "gloo", 60.0)
    ready.set()
    loaded = engine.receive_weights(manifest)
    thread.join(120)
    result["learner"] = learner_side
    result["loaded"] = loaded
    result["prefix_cache_resets"] = core.prefix_cache_resets
    result["encoder_cache_resets"] = core.encoder_cache_resets
    digest = engine.weights_digest()

    # The reference: the same state dict, cast as the manifest casts it, given to the same model's
    # load_weights directly (vLLM registers attention layers by name: a second model would clash).
    synced = {name: p.detach().clone() for name, p in vllm_model.named_parameters()}
    wire = {entry[0]: weight_sync.dtype_from_name(entry[1]) for bucket in manifest for entry in bucket}
    vllm_model.load_weights((name, t.to(wire[name])) for name, t in state.items())
    reference = dict(vllm_model.named_parameters())
    result["params"] = len(synced)
    result["params_equal_reference"] = sum(torch.equal(reference[name], p) for name, p in synced.items())
    result["params_changed_by_sync"] = sum(not torch.equal(before[name], p) for name, p in synced.items())
    result["digest_is_vllm_model_digest"] = digest == weight_sync.module_digest(vllm_model)
    result["digest_equals_learner_digest"] = digest == weight_sync.module_digest(learner)
    # What crossed the serialisers: the Python types the caller sent, the engine core decoded, the worker got.
    result["rpc"] = core.rpc_log
    result["rpc_args_unchanged"] = all(entry["core_args_equal"] for entry in core.rpc_log)

    # The manifest alone, every hop, types included (a tuple would come back a list: msgpack has one array type).
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    frames = MsgpackEncoder().encode((0, 1, "collective_rpc", ("receive_weights", None, (manifest,), None)))
    _, _, _, utility_args = MsgpackDecoder().decode(frames)
    _, _, got_args, _ = EngineCoreProc._convert_msgspec_args(EngineCore.collective_rpc, utility_args)
    result["manifest_roundtrip_equal"] = got_args[0] == manifest
    result["manifest_roundtrip_types_equal"] = _harness.type_tree(got_args[0]) == _harness.type_tree(manifest)
    result["tuple_becomes"] = type(MsgpackDecoder().decode(MsgpackEncoder().encode(((1, 2),)))[0]).__name__
    engine.close()


if __name__ == "__main__":
    _harness.main(check)

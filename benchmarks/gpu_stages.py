"""The GPU check of the stages themselves: the default's rl and eval stages run as a user runs them, on one GPU.

Legs, each timed; a failed leg is reported and the later legs still run (the exit status is 1 if any failed):
  a. draw params.yaml's task set (its `data` section, as the data stage does, a worker a core), unless --tasks;
  b. `python -m stages.rl` from the SFT model (--sft-model, default work/sft/model from a CPU `make run`) for
     --steps steps with Ray off, under a time limit; its metrics.jsonl read back;
  c. `python -m stages.eval` on the SFT and the RL model, and the verdict: RL at or above SFT, with the eval's
     95% intervals (the leg fails only if RL's interval lies wholly below SFT's);
  d. rl for 2 steps on a random Qwen2.5-VL at 3B width (hidden 2048, 4 layers; the tiny builder's tokenizer,
     processor, head size 32 and MLP ratio, not the real 3B's), bf16 compute (rl.mixed_precision auto);
  e. the same at 7B width (hidden 3584) with LoRA (rl.lora.rank=16 rl.lora.alpha=32);
  f. rl for 2 steps on a random Qwen3-VL at 8B width (hidden 4096, 4 layers, the tiny builder's shape otherwise:
     loupe.models.tiny, family qwen3_vl);
  g. the same on a random Qwen3.5 at 9B width (hidden 4096, 4 layers: three Gated DeltaNet layers and a full
     attention one, its linear-attention state kept between turns by the transformers engine).
Every rl leg prints seconds a step, the engine/learner log-prob gap, peak GPU memory, learner tokens/s and MFU.
The summary table is printed last and written, with every figure, to OUT/gpu_stages.json (OUT: --out, else
$OUT, else gpu-out/); each stage's log and metrics are copied there too. The legs share a time budget
(--budget-s): a leg gets what is left, up to its own limit, and is skipped (and named) with less than 20 s.
A leg that runs out of time has every thread's stack written to its log before it is killed.

Without a GPU it runs at tiny sizes on the CPU (a small task set, 1 rl step, eval on 4 questions, the wide legs
at hidden 64 x 1 layer) and prints a line for each thing it could not show.

    bash benchmarks/gpu_stages.sh                      # on the lent GPU machine (installs .whl/, then runs this)
    .venv/bin/python benchmarks/gpu_stages.py          # here: the CPU run (about a minute and a half)
    python benchmarks/gpu_stages.py --legs bc --tasks work/data/tasks --set rl.ray.colocate=true
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CUDA = False
"""Whether torch sees a GPU; set by `main` (torch is imported there, not at the top: the data draw's spawned
workers import this file again)."""
MIN_LEG_S = 20.0
"""A leg with less of the budget left than this is skipped, not started."""
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
                   ("A100", 312e12))
"""Dense bf16 FLOP/s by device name, first match wins (NVIDIA's data sheets, no sparsity; a plain H100 is SXM)."""
LAUNCHER = ("import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
"""`python -m MODULE ARGS`, with SIGUSR1 writing every thread's stack to the log (sent before a timed-out leg dies)."""
WIDE = {"d": ("3B width", 2048, False, "qwen2_5_vl"), "e": ("7B width, LoRA", 3584, True, "qwen2_5_vl"),
        "f": ("Qwen3-VL, 8B width", 4096, False, "qwen3_vl"), "g": ("Qwen3.5, 9B width", 4096, False, "qwen3_5")}
"""The random wide legs: title, hidden size, LoRA, model family."""
QUIET = ["rl.val_every=0", "rl.val_before_train=false", "rl.sample_trajectories_every=0"]
"""No validation and no sample pages: the wide legs' random models, and every rl leg on the CPU."""


@dataclass
class Leg:
    """One leg's outcome: ok, failed or skipped, its wall time, a note, and its figures."""

    name: str
    title: str
    status: str = "skipped"
    seconds: float = 0.0
    note: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


class Run:
    """The legs' shared state: options, folders, the stages' environment, the budget, and what was skipped."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        self.work = Path(tempfile.mkdtemp(prefix="gpu-stages-", dir=args.work))
        self.deadline = time.monotonic() + args.budget_s
        self.skipped: list[str] = []
        self.device = sys.modules["torch"].cuda.get_device_name(0) if CUDA else "cpu"  # torch: imported by main
        self.tasks: Path | None = args.tasks.resolve() if args.tasks else None
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.env.setdefault("LOUPE_TRACKING", "off")  # no MLflow: the GPU machine has none
        if not CUDA:  # on a small shared CPU, OpenMP threads waiting for a busy core stall every op
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))

    def skip(self, line: str) -> None:
        """Name something this run does not show, now and in the closing list."""
        print(f"skipped: {line}", flush=True)
        self.skipped.append(line)

    def time_left(self, cap: float) -> float:
        """Seconds a leg may run: `cap`, or what is left of the budget if less."""
        return min(cap, self.deadline - time.monotonic())

    def stage(self, name: str, module: str, argv: list[str], cap: float) -> tuple[int, float, bool]:
        """`python -m module argv` in the checkout, logged to OUT/<name>.log: (exit status, seconds, timed out)."""
        limit = max(self.time_left(cap), 1.0)
        log_path = self.out / f"{name}.log"
        shown = shlex.join([Path(sys.executable).name, "-m", module, *argv])
        print(f"$ {shown}\n  (limit {limit:.0f} s, log {log_path})", flush=True)
        started = time.perf_counter()
        with open(log_path, "w") as log:
            log.write(f"$ {shown}\n")
            log.flush()
            process = subprocess.Popen([sys.executable, "-c", LAUNCHER, module, *argv], cwd=REPO, env=self.env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return process.wait(timeout=limit), time.perf_counter() - started, False
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGUSR1)  # every thread's stack into the log: where does it wait?
                    time.sleep(3)
                    os.killpg(process.pid, signal.SIGKILL)  # the stage's own session: it and its children
                process.wait()
                return -9, time.perf_counter() - started, True
            except BaseException:  # interrupted (Ctrl-C, SIGTERM): the stage, in its own session, goes too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                raise

    def failed(self, name: str, rc: int, seconds: float, timed_out: bool) -> RuntimeError:
        """The error of a stage that did not exit 0, after printing its log's tail (the stacks, if it hung)."""
        tail = (self.out / f"{name}.log").read_text(errors="replace").splitlines()[-40 if timed_out else -20:]
        print("\n".join(f"  | {line}" for line in tail), flush=True)
        return RuntimeError(f"timed out after {seconds:.0f} s (every thread's stack is in {name}.log)" if timed_out
                            else f"exit status {rc} (see {name}.log)")


def param_count(model_dir: Path) -> int:
    """Parameters in the model's safetensors files, read from their headers (no weights loaded)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total


def peak_flops(device: str) -> float | None:
    """Dense bf16 FLOP/s of the named device, or None for one the table lacks."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device), None)


def rl_figures(metrics_path: Path, params: int, lora: bool, device: str) -> dict[str, Any]:
    """An rl leg's figures from its metrics.jsonl (whatever rows it holds, a killed run's too): seconds a step
    and learner tokens/s (after the first step, which pays the warm-up, when there are more), the log-prob gap
    (largest over steps), peak GPU memory (largest), and MFU: 6N FLOPs a token (4N with LoRA: the frozen
    weights get no weight gradient) x learner tokens/s / the device's peak. The learner's time also holds the
    log-prob recompute (2N a token more), so the MFU is a lower bound."""
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    train = [row for row in map(json.loads, filter(str.strip, lines)) if row.get("kind") == "train"]
    steady = train[1:] if len(train) > 1 else train

    def values(key: str, rows: list[dict[str, Any]]) -> list[float]:
        return [float(row[key]) for row in rows if isinstance(row.get(key), (int, float))]

    def mean(found: list[float]) -> float | None:
        return sum(found) / len(found) if found else None

    tokens_per_s = mean([v for v in values("throughput/update_tokens_per_s", steady) if v > 0])
    flops_per_token = 4 if lora else 6
    peak = peak_flops(device) if CUDA else None
    return {"steps": len(train), "first_step_s": train[0].get("time/step") if train else None,
            "s_per_step": mean(values("time/step", steady)),
            "logprob_gap_mean": max(values("rollout/logprob_gap_mean", train), default=None),
            "logprob_gap_p99": max(values("rollout/logprob_gap_p99", train), default=None),
            "peak_allocated_gib": max(values("memory/peak_allocated_gib", train), default=None),
            "update_tokens_per_s": tokens_per_s, "parameters": params,
            "mfu": flops_per_token * params * tokens_per_s / peak if tokens_per_s and peak else None,
            "mfu_rule": f"{flops_per_token}N",
            "mfu_note": f"unknown GPU {device!r}: no peak FLOP/s in the table" if CUDA and not peak else None}


def show(value: Any, digits: int = 3) -> str:
    """A figure for the table: - when absent, thousands separated, small ones in significant digits."""
    if not isinstance(value, float):
        return "-" if value is None else str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if abs(value) < 0.01 else f"{value:.{digits}f}"


def percent(value: float | None) -> str:
    """A fraction as a percentage, or - when absent."""
    return "-" if value is None else f"{100 * value:.1f}%"


def draw(run: Run, leg: Leg) -> None:
    """Leg a: params.yaml's task set into the work folder (a small one without a GPU)."""
    from loupe.config import load_section
    from loupe.data.families import DataParams, generate_families

    params = load_section(DataParams, "data", run.args.params)
    if not CUDA and hasattr(params, params.family):
        small = getattr(params, params.family).model_copy(update={"train": 16, "val": 4, "test": 8})
        params = params.model_copy(update={params.family: small})
        run.skip(f"a: params.yaml's full task set (no GPU): {params.family} 16/4/8 train/val/test drawn instead")
    started = time.perf_counter()
    workers = (os.cpu_count() or 1) if CUDA else 1  # the small CPU set draws faster than workers start
    run.tasks = generate_families(run.work / "data", params, progress=False, workers=workers)["tasks"]
    leg.status, leg.seconds, leg.note = "ok", time.perf_counter() - started, f"{params.family} tasks, {run.tasks}"
    print(f"drew {params.family} tasks with {workers} workers in {leg.seconds:.1f} s", flush=True)


def rl(run: Run, leg: Leg, model: Path, steps: int, extra: list[str], lora: bool, cap: float) -> None:
    """An rl leg: the stage from `model` for `steps` steps, with `extra` and --set overrides, into WORK/<leg>."""
    if run.tasks is None:
        raise RuntimeError("no task set (leg a failed or was not run: give --tasks)")
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"{model}: no model there (the SFT model comes from `make run`: carry work/sft/model)")
    out = run.work / leg.name
    small = [] if CUDA else ["rl.prompts_per_step=2", "rl.samples_per_prompt=2", *QUIET]
    overrides = list(dict.fromkeys(["rl.ray.enabled=false", f"rl.steps={steps}", *small, *extra, *run.args.set]))
    argv = ["--params", str(run.args.params), "--model", str(model), "--tasks", str(run.tasks), "--out", str(out),
            "--no-progress", *overrides]
    rc, leg.seconds, timed_out = run.stage(leg.name, "stages.rl", argv, cap)
    if (out / "metrics.jsonl").exists():
        shutil.copy(out / "metrics.jsonl", run.out / f"{leg.name}.metrics.jsonl")
    f = leg.figures = rl_figures(out / "metrics.jsonl", param_count(model), lora, run.device)
    notes = [note for note in (f["mfu_note"], "LoRA: frozen weights get no weight gradient" if lora else None) if note]
    print(f"{leg.name} {leg.title}: {f['steps']} steps, {show(f['s_per_step'])} s a step (first "
          f"{show(f['first_step_s'])}); log-prob gap mean {show(f['logprob_gap_mean'])}, p99 "
          f"{show(f['logprob_gap_p99'])}; peak {show(f['peak_allocated_gib'])} GiB; learner "
          f"{show(f['update_tokens_per_s'])} tokens/s; MFU {percent(f['mfu'])} ({f['mfu_rule']}, N = "
          f"{f['parameters']:,}{''.join('; ' + note for note in notes)})", flush=True)
    if rc != 0:
        raise run.failed(leg.name, rc, leg.seconds, timed_out)
    leg.status = "ok"


def evaluate(run: Run, leg: Leg, sft: Path, rl_model: Path) -> None:
    """Leg c: the eval stage on the SFT and RL models, and the verdict per benchmark."""
    from loupe.compare import verdict

    if not (rl_model / "config.json").exists():
        run.skip("c: eval: no RL model (leg b did not run or did not finish)")
        return
    questions = run.args.eval_questions or (None if CUDA else 4)
    bench = {"name": "synthetic", "path": str(run.tasks), **({"limit": questions} if questions else {})}
    overrides = [f"eval.benchmarks={json.dumps([bench])}", *([] if CUDA else ["eval.samples=1"])]
    if not CUDA:
        run.skip(f"c: eval on every test question (no GPU): {questions} questions x 1 sample")
    out = run.work / "eval"
    argv = ["--params", str(run.args.params), "--model", f"sft={sft}", "--model", f"rl={rl_model}", "--out", str(out),
            "--no-progress", *overrides]
    rc, leg.seconds, timed_out = run.stage("eval", "stages.eval", argv, run.args.eval_timeout)
    if rc != 0:
        raise run.failed("eval", rc, leg.seconds, timed_out)
    metrics = json.loads((out / "metrics.json").read_text())
    shutil.copy(out / "metrics.json", run.out / "eval.metrics.json")
    worse = []
    for name in metrics["benchmarks"]:
        entry = metrics[name]
        figures = {f"{model}_{key}": entry[model][key] for model in ("sft", "rl")
                   for key in ("accuracy", "accuracy_ci_low", "accuracy_ci_high")}
        at_or_above = figures["rl_accuracy"] >= figures["sft_accuracy"]
        clearly_worse = figures["rl_accuracy_ci_high"] < figures["sft_accuracy_ci_low"]
        line = (f"{name} ({entry['questions']} questions x {entry['samples_per_question']}): SFT "
                + ", RL ".join(f"{figures[m + '_accuracy']:.3f} [{figures[m + '_accuracy_ci_low']:.3f}, "
                               f"{figures[m + '_accuracy_ci_high']:.3f}]" for m in ("sft", "rl"))
                + f": RL {'at or above' if at_or_above else 'below'} SFT{' beyond the intervals' * clearly_worse}")
        leg.figures[name] = {"questions": entry["questions"], "samples": entry["samples_per_question"], **figures,
                             "rl_at_or_above_sft": at_or_above, "rl_clearly_worse": clearly_worse, "line": line}
        print(f"eval {line}\n  {verdict(metrics, name)}", flush=True)
        worse += [name] * clearly_worse
    if worse:
        raise RuntimeError(f"RL clearly below SFT on {', '.join(worse)} (the intervals apart)")
    leg.status = "ok"


def wide(run: Run, leg: Leg, hidden: int, lora: bool, family: str) -> None:
    """Legs d to g: a random model of the family at the given width (the tiny tokenizer and processor), then rl."""
    from loupe.models.tiny import build_tiny_model

    layers = run.args.wide_layers
    if not CUDA:
        run.skip(f"{leg.name}: {leg.title} (hidden {hidden} x {layers} layers, bf16) needs a GPU: "
                 "run at hidden 64 x 1 layer on the CPU")
        hidden, layers = 64, 1
    started = time.perf_counter()
    model = build_tiny_model(run.work / f"model-{leg.name}", seed=0, text_hidden=hidden, text_layers=layers,
                             family=family)
    print(f"built a random model of hidden {hidden} x {layers} layers in {time.perf_counter() - started:.1f} s",
          flush=True)
    try:
        rl(run, leg, model, run.args.wide_steps, QUIET + (["rl.lora.rank=16", "rl.lora.alpha=32"] if lora else []),
           lora, run.args.wide_timeout)
    finally:
        leg.seconds = time.perf_counter() - started
        leg.figures.update(hidden=hidden, layers=layers)
        shutil.rmtree(model, ignore_errors=True)  # GBs at 7B width


def summary(legs: list[Leg]) -> str:
    """The closing table: a row per leg; then the eval's verdicts, the failures, and what MFU counts."""
    rows = [("leg", "status", "wall s", "s/step", "gap mean", "gap p99", "peak GiB", "learner tok/s", "MFU")]
    for leg in legs:
        f = leg.figures
        rows.append((f"{leg.name} {leg.title}", leg.status, f"{leg.seconds:.0f}", show(f.get("s_per_step")),
                     show(f.get("logprob_gap_mean")), show(f.get("logprob_gap_p99")), show(f.get("peak_allocated_gib")),
                     show(f.get("update_tokens_per_s")),
                     percent(f.get("mfu")) + (f" ({f['mfu_rule']})" if f.get("mfu") is not None else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    verdicts = [found for leg in legs for found in leg.figures.values() if isinstance(found, dict) and "line" in found]
    lines += [f"verdict {found['line']}" for found in verdicts]
    lines += [f"{leg.name} failed: {leg.note}" for leg in legs if leg.status == "failed"]
    if any(leg.figures.get("mfu") is not None for leg in legs):
        lines.append("MFU: 6N (4N with LoRA) FLOPs a token x learner tokens/s / the GPU's dense bf16 peak; N counts "
                     "every weight; the learner's time also holds the log-prob recompute, so it is a lower bound")
    return "\n".join(lines)


def run_leg(run: Run, leg: Leg) -> None:
    """One leg by its letter."""
    args = run.args
    if leg.name == "a":
        if run.tasks is not None:
            run.skip(f"a: tasks given ({run.tasks}), none drawn")
        else:
            draw(run, leg)
    elif leg.name == "b":
        rl(run, leg, args.sft_model, args.steps, [], False, args.rl_timeout)
    elif leg.name == "c":
        evaluate(run, leg, args.sft_model, run.work / "b" / "model")
    else:
        wide(run, leg, *WIDE[leg.name][1:])


def run_legs(run: Run) -> int:
    """Every leg asked for, in order, then the summary and OUT/gpu_stages.json; 1 if a leg failed, else 0."""
    args = run.args
    versions = {name: _version(name) for name in ("torch", "transformers", "peft")}
    print(f"device: {run.device if CUDA else 'no GPU: CPU mode at tiny sizes'}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; work {run.work}; out {run.out}", flush=True)
    if not CUDA:
        run.skip("bf16 compute, peak GPU memory and MFU (no GPU): float32 on the CPU, shown as -")
    legs = [Leg("a", "draw tasks"), Leg("b", "rl from SFT"), Leg("c", "eval SFT vs RL"),
            *(Leg(name, title) for name, (title, *_) in WIDE.items())]
    started = time.perf_counter()
    for leg in legs:
        if leg.name not in args.legs:
            run.skip(f"{leg.name}: {leg.title}: not asked for (--legs {args.legs})")
        elif leg.name != "a" and run.time_left(float("inf")) < MIN_LEG_S:
            run.skip(f"{leg.name}: {leg.title}: the budget (--budget-s {args.budget_s:.0f}) is spent")
        else:
            print(f"\n=== {leg.name}. {leg.title}", flush=True)
            try:
                run_leg(run, leg)
            except Exception as error:  # noqa: BLE001 - a failed leg is a finding; the later legs still run
                leg.status, leg.note = "failed", f"{type(error).__name__}: {error}"
                print(f"!!! {leg.name} failed: {leg.note}", flush=True)
    seconds = time.perf_counter() - started
    print(f"\n=== summary ({run.device}, {seconds:.0f} s)\n{summary(legs)}", flush=True)
    if run.skipped:
        print("not shown here:\n" + "\n".join(f"  {line}" for line in run.skipped))
    failed = [leg.name for leg in legs if leg.status == "failed"]
    report = {"device": run.device, "cuda": CUDA, "versions": versions, "seconds": round(seconds, 1),
              "legs": [asdict(leg) for leg in legs], "skipped": run.skipped, "failed": failed}
    (run.out / "gpu_stages.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {run.out / 'gpu_stages.json'}", flush=True)
    return 1 if failed else 0


def main() -> int:
    """Parse the options, run the legs, clean the scratch folder up; the exit status."""
    global CUDA
    import torch

    CUDA = torch.cuda.is_available()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through `Run.stage`, which ends its stage
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--sft-model", type=Path, default=REPO / "work/sft/model", help="the SFT model (make run's)")
    parser.add_argument("--tasks", type=Path, help="a task folder to use instead of drawing one (skips leg a)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-out"), help="logs and JSON")
    parser.add_argument("--work", type=Path, help="parent of the scratch folder (default: the system's temp)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch folder (tasks, models, outputs)")
    parser.add_argument("--legs", default="abcdefg", help="which legs to run, by letter (default: abcdefg)")
    parser.add_argument("--steps", type=int, default=4 if CUDA else 1, help="rl steps of leg b (4; 1 on CPU)")
    parser.add_argument("--wide-steps", type=int, default=2 if CUDA else 1, help="rl steps of legs d-g (2; 1 on CPU)")
    parser.add_argument("--wide-layers", type=int, default=4, help="decoder layers of the wide models on a GPU")
    parser.add_argument("--eval-questions", type=int, help="eval on the first N test questions (all; 4 on CPU)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="more rl overrides")
    parser.add_argument("--budget-s", type=float, default=420.0 if CUDA else 1500.0, help="seconds for all legs")
    parser.add_argument("--rl-timeout", type=float, default=120.0 if CUDA else 300.0, help="leg b's limit, s")
    parser.add_argument("--eval-timeout", type=float, default=120.0 if CUDA else 300.0, help="leg c's limit, s")
    parser.add_argument("--wide-timeout", type=float, default=75.0 if CUDA else 300.0, help="legs d-g's limit, s")
    args = parser.parse_args()
    args.params, args.sft_model = args.params.resolve(), args.sft_model.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    try:
        return run_legs(run)
    finally:
        if not args.keep_work:
            shutil.rmtree(run.work, ignore_errors=True)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


if __name__ == "__main__":
    sys.exit(main())

"""Does cold-start SFT teach the tiny model to *see*? Held-out accuracy of the base and SFT models vs chance.

One probe runs the real stages at small scale, each as its own CLI in a subprocess, on a params file written
into the probe's folder (the repository's params.yaml with the probe's overrides; params.yaml itself is never
touched):

1. build a tiny Qwen2.5-VL (the embedded builder; `--model-cfg` overrides its config, e.g. a wider text model);
2. generate tasks: `--family zoom` (loupe.data.zoom_tasks, `--data` overrides ZoomTaskConfig) or `--family
   synthetic` (loupe.data.synthetic, `--data` overrides SyntheticConfig);
3. `python -m stages.synth` with the oracle teacher on the train split (`--synth` overrides the synth section);
4. `python -m stages.sft` (`--sft` overrides the sft section: epochs, learning rate, freeze_vision_tower, ...);
5. `python -m stages.rl` from the SFT model when `--rl` is given (JSON merged into the rl section);
6. one `python -m stages.eval` of the base model (unless `--skip-base`), the SFT model and the RL model on the
   test split (>= 200 held-out questions by default, `--eval` overrides the eval section, e.g. samples), into
   `<out>/eval/<name>/` with the stage's comparison (95% bootstrap intervals) in `<out>/eval/metrics.json`.

It prints, per model, accuracy (Avg@K) against the split's chance rate (best constant answer for free-form
questions, 1 / option count for choice ones), pass@K, the valid-turn rate, mean turns and tool calls, end
reasons, the answers given (a model that always says one colour is visible at once), and each stage's wall
time; everything also goes to `<out>/summary.json`. `--no-zoom` is the control: the oracle answers at once
(synth max_turns 1, no tool call required) and eval allows one turn, so the model must answer from the
downscaled view; if that scores at chance while the zooming model does not, the zoom is what made the
answer legible.

    .venv/bin/python benchmarks/learning_probe.py --out /tmp/probe-zoom \
        --family zoom --data '{"train": 320, "test": 200}' \
        --sft '{"num_train_epochs": 8, "freeze_vision_tower": false}' --synth '{"oracle": {"patterns": {"direct": 1}}}'

Runs take minutes on 2 cores (see docs/learning.md for the figures measured with it). Not a test: a measurement.
Tracking is off (LOUPE_TRACKING=off) unless `--tracking`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


REPLACED_WHOLE = {"patterns", "turns", "benchmarks"}
"""Mappings given whole rather than merged: `--synth '{"oracle": {"patterns": {"direct": 1}}}'` means direct only."""


def deep_merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, recursively for nested mappings (lists, scalars and the mappings
    named in REPLACED_WHOLE replace)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in REPLACED_WHOLE:
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build_model(out: Path, seed: int, overrides: dict[str, Any], min_pixels: int, max_pixels: int) -> int:
    """The embedded tiny model, or a variant: `overrides` keys are text_hidden, text_layers, text_heads,
    text_kv_heads, text_intermediate, vision_hidden, vision_depth, vision_heads, vision_intermediate.
    Returns the parameter count."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    from loupe.models.tiny import tiny_config, tiny_processor
    from loupe.models.tiny_tokenizer import train_tokenizer

    tokenizer = train_tokenizer(seed)
    config = tiny_config(tokenizer)
    text, vision = config.text_config, config.vision_config
    o = dict(overrides)
    hidden = int(o.pop("text_hidden", text.hidden_size))
    heads = int(o.pop("text_heads", text.num_attention_heads))
    text.hidden_size = hidden
    text.num_attention_heads = heads
    text.num_key_value_heads = int(o.pop("text_kv_heads", text.num_key_value_heads))
    text.intermediate_size = int(o.pop("text_intermediate", 2 * hidden))
    text.num_hidden_layers = int(o.pop("text_layers", text.num_hidden_layers))
    text.max_window_layers = text.num_hidden_layers
    if hasattr(text, "layer_types") and text.layer_types is not None:
        text.layer_types = ["full_attention"] * text.num_hidden_layers
    half = hidden // heads // 2  # rotary frequencies per head, split over (time, height, width) as Qwen does
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    rope = dict(text.rope_parameters or {})
    rope["mrope_section"] = section
    text.rope_parameters = rope
    vhidden = int(o.pop("vision_hidden", vision.hidden_size))
    vision.hidden_size = vhidden
    vision.intermediate_size = int(o.pop("vision_intermediate", 2 * vhidden))
    vision.num_heads = int(o.pop("vision_heads", vision.num_heads))
    vision.depth = int(o.pop("vision_depth", vision.depth))
    vision.fullatt_block_indexes = [vision.depth - 1]
    vision.out_hidden_size = hidden
    if o:
        raise SystemExit(f"--model-cfg: unknown keys {sorted(o)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.pad_token_id],
        pad_token_id=text.pad_token_id,
        use_cache=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tiny_processor(tokenizer, min_pixels, max_pixels).save_pretrained(out)
    for weights in out.glob("*.safetensors"):
        os.chmod(weights, 0o644)
    return sum(p.numel() for p in model.parameters())


def generate(family: str, out: Path, data: dict[str, Any]) -> float:
    """Write the task folder; returns the chance rate of its test split."""
    from loupe.data.tasks import read_tasks
    from loupe.data.tasks import chance_rate

    if family == "zoom":
        from loupe.data.zoom_tasks import ZoomTaskConfig, generate_zoom_tasks

        generate_zoom_tasks(out, ZoomTaskConfig(**data), workers=2)
    else:
        from loupe.data.synthetic import SyntheticConfig, generate_tasks

        generate_tasks(out, SyntheticConfig(**data))
    return chance_rate(read_tasks(out / "test.jsonl"))


def run_stage(name: str, args: list[str], log: Path) -> float:
    """Run `python -m stages.<name> ARGS`, its output to `log`; returns its wall time. Exits on failure."""
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with log.open("w") as handle:
        code = subprocess.call([sys.executable, "-m", f"stages.{name}", *args], cwd=REPO, env=env,
                               stdout=handle, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"stage {name} failed (exit {code}) after {seconds:.0f}s; end of {log}:\n{tail}")
    return seconds


def zoom_hits(folder: Path, tasks: Path) -> dict[str, Any]:
    """Localisation vs reading: the share of answered trajectories whose last crop holds the target box's
    centre, and accuracy among those that did and those that did not."""
    from PIL import Image

    sizes: dict[str, tuple[int, int]] = {}
    groups: dict[bool, list[float]] = {True: [], False: []}
    for line in (folder / "trajectories" / "synthetic.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        t = json.loads(line)
        if t.get("end_reason") != "answered":
            continue
        crops = [turn["crop"] for turn in t["turns"] if turn.get("crop")]
        image = t["task"]["images"][0]
        if image not in sizes:
            with Image.open(tasks / image) as im:
                sizes[image] = im.size
        w, h = sizes[image]
        x0, y0, x1, y1 = t["task"]["bbox"]
        cx, cy = (x0 + x1) / 2 * w, (y0 + y1) / 2 * h
        hit = bool(crops) and (lambda r: r[0] <= cx <= r[2] and r[1] <= cy <= r[3])(crops[-1]["region_px"])
        groups[hit].append(float(t.get("rewards", {}).get("accuracy") or 0.0))
    answered = len(groups[True]) + len(groups[False])
    return {"answered": answered,
            "last_crop_holds_target": len(groups[True]) / answered if answered else None,
            "accuracy_when_held": sum(groups[True]) / len(groups[True]) if groups[True] else None,
            "accuracy_when_missed": sum(groups[False]) / len(groups[False]) if groups[False] else None}


def eval_summary(folder: Path, tasks: Path) -> dict[str, Any]:
    metrics = json.loads((folder / "metrics.json").read_text())
    bench = next(iter(metrics["benchmarks"].values()))
    answers = Counter()
    for line in (folder / "results.jsonl").read_text().splitlines():
        if line.strip():
            answers[str(json.loads(line).get("answer"))] += 1
    keep = ("questions", "samples_per_question", "accuracy", "valid_turn_rate", "mean_turns", "mean_tool_calls",
            "end_reasons")
    out = {k: bench.get(k) for k in keep}
    out["pass@k"] = next((v for k, v in bench.items() if k.startswith("pass@")), None)
    out["answers"] = dict(answers.most_common(8))
    out.update(zoom_hits(folder, tasks))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="probe folder (model, tasks, stage outputs)")
    parser.add_argument("--family", choices=("zoom", "synthetic"), default="zoom")
    parser.add_argument("--data", default="{}", help="JSON overrides of the task generator's config")
    parser.add_argument("--model-cfg", default="{}", help="JSON overrides of the tiny model (see build_model)")
    parser.add_argument("--synth", default="{}", help="JSON merged into params.yaml's synth section")
    parser.add_argument("--sft", default="{}", help="JSON merged into params.yaml's sft section")
    parser.add_argument("--eval", default="{}", help="JSON merged into params.yaml's eval section")
    parser.add_argument("--rl", default=None, help="JSON merged into params.yaml's rl section: also run RL from "
                        "the SFT model and evaluate it")
    parser.add_argument("--perception-steps", type=int, default=None,
                        help="perception pretraining steps of the built model (default: params.yaml's model section)")
    parser.add_argument("--params", default="{}", help="JSON merged into the whole params file (protocol, ...)")
    parser.add_argument("--no-zoom", action="store_true", help="control: teach and test answering without a zoom")
    parser.add_argument("--skip-base", action="store_true", help="do not evaluate the untrained base model")
    parser.add_argument("--eval-only", action="store_true", help="rerun only the evals of an existing probe")
    parser.add_argument("--reuse", action="store_true", help="keep model/tasks/synth already in --out")
    parser.add_argument("--tracking", action="store_true", help="leave MLflow tracking on")
    args = parser.parse_args(argv)
    if not args.tracking:
        os.environ["LOUPE_TRACKING"] = "off"

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    family_defaults = (params.get("data") or {}).get(args.family, {})
    data = {**family_defaults, "test": 200, **json.loads(args.data)}
    tasks, model = out / "tasks", out / "model"
    params = deep_merge(params, json.loads(args.params))
    over: dict[str, Any] = {
        "model": {"path": str(model), "build_tiny": False},
        "synth": deep_merge({"viewer_trajectories": 8}, json.loads(args.synth)),
        "sft": json.loads(args.sft),
        "eval": deep_merge({"benchmarks": [{"name": "synthetic", "path": str(tasks)}], "samples": 2,
                            "viewer_trajectories": 8}, json.loads(args.eval)),
        "rl": json.loads(args.rl) if args.rl else {},
        "pipeline": {"tasks": str(tasks)},
    }
    if args.no_zoom:
        over["synth"] = deep_merge(over["synth"], {"max_turns": 1, "min_tool_calls": 0})
        over["eval"] = deep_merge(over["eval"], {"max_turns": 1})
    params = deep_merge(params, over)
    params_file = out / "params.yaml"
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    summary: dict[str, Any] = {"family": args.family, "data": data, "model_cfg": json.loads(args.model_cfg),
                               "synth": over["synth"], "sft": params["sft"], "eval": over["eval"],
                               "no_zoom": args.no_zoom, "seconds": {}}

    if args.eval_only:
        args.reuse = True
    started = time.perf_counter()
    if not (args.reuse and model.is_dir()):
        defaults = {"text_hidden": params["model"].get("tiny_text_hidden", 64),
                    "text_layers": params["model"].get("tiny_text_layers", 2)}
        summary["parameters"] = build_model(model, params["model"].get("tiny_seed", 0),
                                            {**defaults, **json.loads(args.model_cfg)},
                                            params["protocol"]["min_pixels"], params["protocol"]["max_pixels"])
        steps = args.perception_steps if args.perception_steps is not None else \
            params["model"].get("tiny_perception_steps", 0)
        if steps:
            from dataclasses import asdict

            from loupe.models.tiny_perception import pretrain_perception

            summary["perception"] = asdict(pretrain_perception(model, steps=steps,
                                                               seed=params["model"].get("tiny_seed", 0)))
    summary["seconds"]["model"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    if not (args.reuse and (tasks / "test.jsonl").is_file()):
        generate(args.family, tasks, data)
    from loupe.data.tasks import read_tasks
    from loupe.data.tasks import chance_rate

    summary["chance"] = chance_rate(read_tasks(tasks / "test.jsonl"))
    summary["seconds"]["data"] = round(time.perf_counter() - started, 1)
    print(f"[probe] model and tasks ready; test chance rate {summary['chance']:.3f}", flush=True)

    p = ["--params", str(params_file)]
    if not (args.reuse and (out / "synth" / "dataset").is_dir()):
        summary["seconds"]["synth"] = round(run_stage("synth", [*p, "--tasks", str(tasks), "--out", str(out / "synth"),
                                                               "--no-progress"], out / "synth.log"), 1)
    synth_metrics = json.loads((out / "synth" / "metrics.json").read_text())
    summary["synth_kept"] = synth_metrics.get("accepted")
    print(f"[probe] synth done: {summary['synth_kept']} trajectories kept", flush=True)
    if not (args.eval_only and (out / "sft" / "model").is_dir()):
        summary["seconds"]["sft"] = round(run_stage("sft", [*p, "--model", str(model), "--dataset",
                                                            str(out / "synth" / "dataset"), "--out", str(out / "sft")],
                                                    out / "sft.log"), 1)
    sft_metrics = json.loads((out / "sft" / "metrics.json").read_text())
    summary["sft_metrics"] = {k: sft_metrics.get(k) for k in ("first_loss", "final_loss", "min_loss", "steps",
                                                               "epochs", "samples_per_second", "train_runtime_s")}
    print(f"[probe] sft done in {summary['seconds'].get('sft', 0):.0f}s: {summary['sft_metrics']}", flush=True)
    models = {"sft": out / "sft" / "model"} if args.skip_base else {"base": model, "sft": out / "sft" / "model"}
    if args.rl is not None and not (args.eval_only and (out / "rl" / "model").is_dir()):
        summary["seconds"]["rl"] = round(run_stage("rl", [*p, "--model", str(out / "sft" / "model"), "--tasks",
                                                         str(tasks), "--out", str(out / "rl"), "--no-progress"],
                                                   out / "rl.log"), 1)
    if args.rl is not None:
        models["rl"] = out / "rl" / "model"
    # One eval run scores every model on the same questions (the stage's comparison, with intervals).
    model_args = [arg for name, path in models.items() for arg in ("--model", f"{name}={path}")]
    summary["seconds"]["eval"] = round(run_stage("eval", [*p, *model_args, "--out", str(out / "eval"),
                                                          "--no-progress"], out / "eval.log"), 1)
    comparison = json.loads((out / "eval" / "metrics.json").read_text())
    entry = comparison[comparison["benchmarks"][0]]
    summary["models"] = {}
    for name in models:
        summary["models"][name] = {**eval_summary(out / "eval" / name, tasks),
                                   "accuracy_ci": [entry[name]["accuracy_ci_low"], entry[name]["accuracy_ci_high"]],
                                   "turn_scaling": entry[name]["turn_scaling"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    print(f"\n{args.family} tasks, test chance rate {summary['chance']:.3f}; synth kept {summary['synth_kept']}; "
          f"sft loss {summary['sft_metrics']['final_loss']}")
    print(f"{'model':6} {'accuracy':>8} {'pass@k':>7} {'valid':>6} {'turns':>6} {'calls':>6}  answers")
    for name, m in summary["models"].items():
        acc = m["accuracy"] if m["accuracy"] is not None else float("nan")
        print(f"{name:6} {acc:8.3f} {m['pass@k'] or 0:7.3f} {m['valid_turn_rate'] or 0:6.3f} "
              f"{m['mean_turns'] or 0:6.2f} {m['mean_tool_calls'] or 0:6.2f}  {m['answers']}")
        print(f"       95% interval {m['accuracy_ci']}, accuracy by turn limit {m['turn_scaling']}")
        print(f"       last crop holds the target in {m['last_crop_holds_target']} of {m['answered']} answered; "
              f"accuracy then {m['accuracy_when_held']}, otherwise {m['accuracy_when_missed']}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["seconds"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

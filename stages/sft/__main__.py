"""Supervised fine-tuning of the base model on the synth stage's dataset, through LLaMA-Factory.

Reads the `sft` section of params.yaml (plus `seed` and `protocol`, whose pixel budget sizes the images),
checks the model and the dataset before anything starts (exit 2 naming the sample and the fix), writes a
LLaMA-Factory YAML, runs `llamafactory-cli train` on it (under torchrun with `sft.cpu_processes` > 1) with its
output streamed here and its loss, learning rate and throughput reported to this stage's MLflow run, then writes
into --out:

    model/                     Hugging Face model (LoRA merged, use_cache on): AutoModelForImageTextToText loads it
    llamafactory/train.yaml    the generated config: its header's command repeats the run by hand
    llamafactory/train.log     LLaMA-Factory's full output (export.yaml / export.log too for LoRA)
    dataset/                   the dataset with over-budget images pre-scaled (same pixels, less time per step)
    train/                     LLaMA-Factory's output folder: checkpoints and trainer state, for resuming
    metrics.json               first/final loss, steps, samples per second, wall time, dataset size
    plots/loss.json, loss.png  the loss curve (DVC plot data and a picture)

A run killed midway resumes from its last checkpoint when started again with the same inputs; with other
inputs it starts over.

Launch:
    python -m stages.sft --params params.yaml --model work/models/tiny --dataset work/synth/dataset --out work/sft
On a GPU machine the `sft.gpu` settings apply (bf16, flash-attention, DeepSpeed ZeRO).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from loupe.config import (
    ParamsError,
    ProtocolParams,
    load_section,
    load_seed,
    params_with_overrides,
)
from loupe.io import atomic_write_json
from loupe.models.family import ModelFamilyError, llamafactory_template, read_family
from loupe.tracking import stage_run, tracking_uri
from stages.sft import checks, export, images, llamafactory_config, report, runner
from stages.sft.params import SftParams


def _on_gpu(device: str) -> bool:
    import torch

    available = torch.cuda.is_available()
    if device == "gpu" and not available:
        raise checks.InputError("sft.device is gpu but torch sees no GPU; set sft.device: auto or cpu")
    return available if device == "auto" else device == "gpu"


def _check_gpu_stack(params: SftParams, on_gpu: bool, deepspeed: Path | None) -> list[str]:
    """Packages the GPU settings need: DeepSpeed is required, flash-attn only worth a note (it falls back)."""
    notes = []
    if on_gpu and deepspeed is not None and importlib.util.find_spec("deepspeed") is None:
        raise checks.InputError(
            "sft.gpu.deepspeed is set but the deepspeed package is not installed; install it (the sft GPU image "
            "has it) or set sft.gpu.deepspeed: null"
        )
    if on_gpu and params.gpu.flash_attn == "fa2" and importlib.util.find_spec("flash_attn") is None:
        notes.append("flash-attn is not installed: LLaMA-Factory falls back to its default attention")
    return notes


def run_sft(params_path: Path, model_path: Path, dataset_dir: Path, out_dir: Path, progress: bool = True,
            verbose: bool = False) -> dict[str, Any]:
    """The whole stage; returns the metrics written to metrics.json. LLaMA-Factory's output goes to
    `llamafactory/train.log`; the console shows one progress bar, or, with `verbose`, that output itself."""
    started = time.perf_counter()
    seed = load_seed(params_path)
    protocol = load_section(ProtocolParams, "protocol", params_path)
    params = load_section(SftParams, "sft", params_path)
    on_gpu = _on_gpu(params.device)
    deepspeed = llamafactory_config.resolve_deepspeed(params.gpu.deepspeed) if on_gpu else None
    notes = _check_gpu_stack(params, on_gpu, deepspeed)
    preflight = checks.preflight(
        model_path, dataset_dir, params.dataset, params.cutoff_len, protocol.min_pixels, protocol.max_pixels
    )
    try:
        template = llamafactory_template(read_family(model_path), params.template)
    except ModelFamilyError as error:
        raise checks.InputError(str(error)) from error
    print(
        f"sft: {preflight.samples} samples, {preflight.assistant_turns} assistant turns, {preflight.images} images; "
        f"tokens per sample: mean {preflight.mean_tokens:.0f}, max {preflight.max_tokens} (cutoff {params.cutoff_len})"
    )
    for note in notes:
        print(f"sft: note: {note}")

    inputs = {"model": str(model_path), "dataset": str(dataset_dir)}
    with stage_run("sft", params={"sft": params.model_dump(mode="json"), "inputs": inputs}) as run:
        lf_dir, train_dir = out_dir / "llamafactory", out_dir / "train"
        training_data = dataset_dir
        if params.presize_images:
            training_data, scaled = images.presize_dataset(
                preflight.spec, preflight.records, preflight.image_sizes, protocol.max_pixels, protocol.min_pixels,
                out_dir / "dataset", progress=progress,
            )
            print(f"sft: {scaled} images over the pixel budget are pre-scaled in {training_data}")
        config = llamafactory_config.train_config(
            params, protocol, seed, model_path, training_data, train_dir, on_gpu, template=template,
            deepspeed=llamafactory_config.copy_deepspeed(deepspeed, lf_dir),
            report_to="mlflow" if run.run_id else "none",
            hide_gpu=params.device == "cpu",
        )
        train_yaml = lf_dir / "train.yaml"
        processes = llamafactory_config.cpu_processes(params, on_gpu)
        launch = llamafactory_config.launch_environment(processes)
        command = runner.llamafactory_command("train", train_yaml.resolve(), processes=processes)
        llamafactory_config.write_yaml(train_yaml, config, runner.by_hand(command, launch))
        digest = runner.fingerprint(
            llamafactory_config.fingerprint_view(config),
            [preflight.spec.file, preflight.spec.folder / "dataset_info.json"],
            list(preflight.image_sizes),
            model_path,
        )
        state = runner.prepare_train_dir(train_dir, digest)
        if state.note:
            print(f"sft: {state.note}")
        env = runner.child_environment(run.run_id, tracking_uri() if run.run_id else None,
                                       force_torchrun=on_gpu and deepspeed is not None, launch=launch)
        if state.kind != "done":
            log = lf_dir / "train.log"
            print(f"sft: {runner.by_hand(command, launch)} (output: {train_dir}; its log: {log})", flush=True)
            watch = None if verbose else runner.TrainerProgress(train_dir / "trainer_log.jsonl", disable=not progress)
            runner.launch(command, env, log, progress=watch)

        export.build_model_dir(params.finetuning_type, model_path, train_dir, out_dir / "model", lf_dir, env, template)

        points, final = report.read_log_history(train_dir)
        report.write_loss_plots(points, out_dir / "plots")
        metrics = {
            "base_model": str(model_path),
            "dataset": str(dataset_dir),
            "finetuning_type": params.finetuning_type,
            "device": "gpu" if on_gpu else "cpu",
            "cpu_processes": processes,
            **report.summarize(points, final),
            "resumed_from_step": state.step,
            "wall_time_s": round(time.perf_counter() - started, 2),
            "samples": preflight.samples,
            "assistant_turns": preflight.assistant_turns,
            "mean_sample_tokens": round(preflight.mean_tokens, 1),
            "max_sample_tokens": preflight.max_tokens,
        }
        atomic_write_json(out_dir / "metrics.json", metrics)
        run.log_metrics(metrics)  # the summary; the per-step curves came from LLaMA-Factory's own reporting
        run.set_tags({"sft.resumed_from_step": state.step, "sft.device": metrics["device"]})
        for artefact in ("metrics.json", "plots", "llamafactory"):
            run.log_artifact(out_dir / artefact)
        if not params.keep_checkpoints:
            runner.remove_checkpoints(train_dir)
        return metrics


def _print_summary(metrics: dict[str, Any], out_dir: Path) -> None:
    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    print(
        f"sft: {metrics['steps']} steps ({metrics['finetuning_type']}, {metrics['device']}), loss "
        f"{fmt(metrics['first_loss'])} -> {fmt(metrics['final_loss'])}, {fmt(metrics['samples_per_second'])} samples/s, "
        f"wall time {metrics['wall_time_s']:.0f} s"
        + (f", resumed from step {metrics['resumed_from_step']}" if metrics["resumed_from_step"] else "")
    )
    print(f"model: {out_dir / 'model'}\nmetrics: {out_dir / 'metrics.json'}\nloss curve: {out_dir / 'plots' / 'loss.png'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.sft", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    parser.add_argument("--model", type=Path, required=True, help="base model: a Hugging Face model directory")
    parser.add_argument("--dataset", type=Path, required=True, help="LLaMA-Factory dataset folder (the synth stage's)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--verbose", action="store_true",
                        help="stream LLaMA-Factory's own output here (it always goes to OUT/llamafactory/train.log)")
    parser.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                        help="params set on top of the file, as in it (e.g. rl.lr=1e-6); recorded in MLflow")
    args = parser.parse_args(argv)
    try:
        args.params = params_with_overrides(args.params, args.overrides)
        metrics = run_sft(args.params, args.model, args.dataset, args.out, progress=not args.no_progress,
                          verbose=args.verbose)
    except (ParamsError, checks.InputError, FileNotFoundError) as err:
        print(f"sft: {err}", file=sys.stderr)
        return 2
    except runner.TrainingFailed as err:
        print(f"sft: {err}", file=sys.stderr)
        return 1
    _print_summary(metrics, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

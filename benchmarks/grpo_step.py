"""One GRPO step on the tiny model, timed part by part, and packed (padding-free) vs padded updates.

The step is the rl stage's own code: a `RolloutWorker` rolls out `--prompts` synthetic visual-search tasks
`--samples` times each with the mini_o3 protocol, the `RewardPool` scores them, GRPO advantages are computed,
and a `Learner` recomputes old log-probs and runs the update. Each part's wall time and peak memory is
printed (CUDA: peak allocated; CPU: peak resident set size sampled every 2 ms, above the level at its start).

Then the weight sync: the updated policy goes to `--sync-workers` rollout workers the stage's way (a
`WorkerSet` whose engines join the learner's weight-sync group and receive bucketed broadcasts, gloo on CPU;
the workers run in threads here, Ray actors in the stage), against the route the stage used before (the full
state dict copied, serialised as Ray's object store would, and loaded by each worker), both measured in this
run. The same comparison is repeated on a slice of a Qwen2.5-VL-7B-shaped state dict (the embedding and
`--slice-layers` decoder layers at 7B's sizes, random, float32 on the learner, bfloat16 on the wire), whose
bytes per second give the full 7B model's sync time by proportion.

Then the same batch is updated again from the same starting weights with `batching: packed` and with
`batching: padded`, `--repeats` times each (median), and the ratio padded/packed is printed, with the tokens
each layout computes (padding included).

    python benchmarks/grpo_step.py [--model DIR] [--prompts 4] [--samples 4] [--max-new-tokens 32]
                                   [--threads 1] [--device cpu] [--sync-workers 2] [--slice-layers 2]

Without --model the tiny model is built in a temporary folder. Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.tasks import read_tasks
from stages.rl.advantages import compute_advantages
from stages.rl.learner import Learner
from stages.rl.params import RLParams
from stages.rl.trainer import to_sequence
from stages.rl.workers import RewardPool, RolloutWorker, WorkerSet

QWEN25_VL_7B = {"vocab": 152064, "hidden": 3584, "intermediate": 18944, "layers": 28, "kv_heads": 4, "head_dim": 128}
"""The text model's sizes from Qwen2.5-VL-7B-Instruct's config.json (the vision tower adds about 0.7 B)."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_memory(device: str) -> Iterator[dict[str, float]]:
    """Yields a dict that holds `peak_mb` (above the starting level) once the block ends."""
    result: dict[str, float] = {}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result["peak_mb"] = (torch.cuda.max_memory_allocated() - start) / 2**20
        return
    start, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        result["peak_mb"] = max(0, max(peak[0], _rss_bytes()) - start) / 2**20


@contextmanager
def timed(label: str, device: str, report: dict) -> Iterator[None]:
    with peak_memory(device) as memory:
        started = time.perf_counter()
        yield
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    report[label] = (seconds, memory["peak_mb"])
    print(f"{label:>24}: {seconds:7.3f} s   peak +{memory['peak_mb']:7.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a shared 2-core CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-workers", type=int, default=2, help="rollout workers receiving the weight sync")
    parser.add_argument("--slice-layers", type=int, default=2, help="7B-shaped decoder layers in the sync slice (-1: skip)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, {args.prompts} prompts x {args.samples} samples, "
          f"max {args.max_new_tokens} new tokens a turn")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from loupe.models.tiny import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", seed=args.seed)
        data = Path(tmp) / "tasks"
        generate_tasks(data, SyntheticConfig(seed=args.seed, train=args.prompts, val=0, test=0))
        tasks = read_tasks(data / "train.jsonl")
        protocol = ProtocolParams(name="mini_o3", max_turns=3)
        rollout = RolloutParams(device=args.device, max_new_tokens=args.max_new_tokens)
        params = RLParams(micro_batch_size=args.micro_batch_size, lr=1e-3, learner_device=args.device, ray={"enabled": False})

        worker = RolloutWorker(str(model_dir), rollout, protocol, str(data), seed=args.seed)
        pool = RewardPool(params.reward)
        learner = Learner(model_dir, params, rollout.temperature, args.max_new_tokens * protocol.max_turns)
        start_state = learner.state_dict()
        worker.rollout(tasks[:1], 1, args.seed, protocol.max_turns, 4)  # warm-up: first-call costs

        report: dict[str, tuple[float, float]] = {}
        print("one GRPO step:")
        with timed("rollout", args.device, report):
            trajectories, stats = worker.rollout(tasks, args.samples, args.seed, protocol.max_turns, args.max_new_tokens)
        with timed("reward", args.device, report):
            for t, parts in zip(trajectories, pool.score(trajectories)):
                t.rewards = parts
        sequences = [to_sequence(t, True, str(k // args.samples)) for k, t in enumerate(trajectories)]
        # A random policy earns no reward; a spread of advantages makes the update do real work anyway.
        rewards = [float(k % 3) for k in range(len(sequences))]
        for s, a in zip(sequences, compute_advantages(rewards, [s.group for s in sequences], "grpo")):
            s.advantage = float(a)
        with timed("update (recompute+ppo)", args.device, report):
            for s, old in zip(sequences, learner.logprobs(sequences)):
                s.old_logprobs = old
            learner.update(sequences)
        total = sum(seconds for seconds, _ in report.values())
        print(f"{'step total':>24}: {total:7.3f} s; rollout {stats.generated_tokens} generated tokens "
              f"({stats.generated_tokens / report['rollout'][0]:.0f} tok/s), {stats.turns} turns; "
              f"learner peak +{report['update (recompute+ppo)'][1]:.1f} MB")
        sync_tiny(learner, model_dir, rollout, protocol, data, params, args)
        sync_slice(args)

        lengths = [len(s) for s in sequences]
        micro = [lengths[i : i + args.micro_batch_size] for i in range(0, len(lengths), args.micro_batch_size)]
        real_tokens = sum(lengths)
        padded_tokens = sum(max(m) * len(m) for m in micro)
        print(f"\nupdate layouts on the same batch ({len(sequences)} sequences, lengths {min(lengths)}-{max(lengths)}): "
              f"packed computes {real_tokens} tokens, padded {padded_tokens} ({padded_tokens / real_tokens - 1:.0%} padding)")
        medians = {}
        for mode in ("packed", "padded"):
            learner.batching = mode
            runs, peaks = [], []
            for _ in range(args.repeats):
                learner.load_state_dict(start_state)
                learner.optimizer = torch.optim.AdamW(learner.model.parameters(), lr=params.lr)
                with peak_memory(args.device) as memory:
                    started = time.perf_counter()
                    learner.logprobs(sequences)
                    learner.update(sequences)
                    runs.append(time.perf_counter() - started)
                peaks.append(memory["peak_mb"])
            medians[mode] = statistics.median(runs)
            print(f"{mode:>24}: {medians[mode]:7.3f} s median of {args.repeats} (recompute + update), "
                  f"peak +{max(peaks):.1f} MB, {(real_tokens if mode == 'packed' else padded_tokens) / medians[mode]:.0f} tok/s")
        print(f"packed speed-up over padded: {medians['padded'] / medians['packed']:.2f}x")


def by_value(state: dict[str, torch.Tensor], receivers: list[torch.nn.Module]) -> None:
    """The old route: a full CPU copy of the state dict, serialised once (ray.put), read by every worker."""
    import pickle

    blob = pickle.dumps({k: v.detach().to("cpu", copy=True) for k, v in state.items()}, protocol=5)
    for module in receivers:
        module.load_state_dict(pickle.loads(blob), strict=False)


def sync_tiny(learner: Learner, model_dir: Path, rollout: RolloutParams, protocol: ProtocolParams, data: Path,
              params: RLParams, args: argparse.Namespace) -> None:
    from loupe.rollout.weight_sync import plan_manifest

    workers = WorkerSet(str(model_dir), rollout, protocol, str(data), params.model_copy(
        update={"ray": params.ray.model_copy(update={"num_workers": args.sync_workers})}), args.seed, use_ray=False)
    workers.connect_weights(learner, workers.device_identities(), "gloo", 60)
    manifest = plan_manifest(learner.weight_specs(), torch.float32, params.sync_bucket_mb << 20)
    broadcast, copied = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        sent = workers.sync_weights(learner, manifest)
        broadcast.append(time.perf_counter() - started)
        started = time.perf_counter()
        by_value(learner.model.state_dict(), [w.engine.model for w in workers.workers])
        copied.append(time.perf_counter() - started)
    b, c = statistics.median(broadcast), statistics.median(copied)
    print(f"\nweight sync of the tiny model to {args.sync_workers} workers ({sent / 2**20:.2f} MiB): "
          f"broadcast {b * 1e3:.1f} ms, by value {c * 1e3:.1f} ms (median of {args.repeats}), ratio {c / b:.2f}x")
    workers.close()


def sync_slice(args: argparse.Namespace) -> None:
    """The sync primitive on a 7B-shaped slice: the embedding and `--slice-layers` decoder layers."""
    import threading as _threading

    from loupe.rollout.weight_sync import (
        SyncGroup,
        free_address,
        plan_manifest,
        receive_weights,
        send_weights,
    )

    if args.slice_layers < 0:
        return
    d = QWEN25_VL_7B
    kv = d["kv_heads"] * d["head_dim"]
    state = {"model.language_model.embed_tokens.weight": torch.randn(d["vocab"], d["hidden"])}
    for i in range(args.slice_layers):
        prefix = f"model.language_model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (d["hidden"], d["hidden"])), ("self_attn.k_proj.weight", (kv, d["hidden"])),
                            ("self_attn.v_proj.weight", (kv, d["hidden"])), ("self_attn.o_proj.weight", (d["hidden"], d["hidden"])),
                            ("mlp.gate_proj.weight", (d["intermediate"], d["hidden"])), ("mlp.up_proj.weight", (d["intermediate"], d["hidden"])),
                            ("mlp.down_proj.weight", (d["hidden"], d["intermediate"]))):
            state[prefix + name] = torch.randn(*shape)
    numel = sum(t.numel() for t in state.values())
    manifest = plan_manifest([(k, v.dtype, tuple(v.shape)) for k, v in state.items()], torch.bfloat16)
    receivers = [{k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in state.items()} for _ in range(args.sync_workers)]
    host, port = free_address()
    world = 1 + args.sync_workers

    def receive(rank: int, target: dict[str, torch.Tensor], rounds: int) -> None:
        group = SyncGroup(host, port, rank, world, "gloo", 600)
        for _ in range(rounds):
            for name, tensor in receive_weights(group, manifest):
                target[name].copy_(tensor)

    threads = [_threading.Thread(target=receive, args=(1 + i, r, args.repeats)) for i, r in enumerate(receivers)]
    for t in threads:
        t.start()
    group = SyncGroup(host, port, 0, world, "gloo", 600)
    broadcast = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        sent = send_weights(group, state.items(), manifest)
        broadcast.append(time.perf_counter() - started)
    for t in threads:
        t.join()
    copied = []
    modules = [torch.nn.Module() for _ in receivers]
    for _ in range(args.repeats):
        started = time.perf_counter()
        by_value(state, modules)
        copied.append(time.perf_counter() - started)
    b, c = statistics.median(broadcast), statistics.median(copied)
    full_7b_bytes = 8.3e9 * 2  # 8.3 B parameters in bfloat16
    print(f"weight sync of a Qwen2.5-VL-7B-shaped slice ({numel / 1e9:.2f} B parameters, {sent / 2**30:.2f} GiB as bf16) "
          f"to {args.sync_workers} receivers: broadcast {b:.2f} s ({sent / b / 2**30:.2f} GiB/s), by value (fp32) {c:.2f} s, "
          f"ratio {c / b:.2f}x; at this rate the whole 7B model takes {full_7b_bytes / (sent / b):.1f} s on gloo/CPU")


if __name__ == "__main__":
    main()

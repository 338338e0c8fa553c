"""Eval streams: a benchmark runs a chunk of questions at a time, outputs are appended as it goes and renamed
into place at the end; and the K samples of a task share one decoded image, so a group pickles (Ray) small.

Most tests drive the stage with a scripted engine (no model load, crops on every sample); the equality with the
unchunked computation and the image sharing of real token traces use the embedded tiny model.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import yaml
from test_rollout_loop import ScriptedEngine, call

import stages.eval.__main__ as eval_stage
import stages.eval.one_model as one_model
from loupe.config import ProtocolParams, RolloutParams
from loupe.data.benchmarks import load_benchmark
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.rewards import score_trajectory
from loupe.rollout import make_engine, run_rollouts
from loupe.trajectory import (
    JsonlWriter,
    Trajectory,
    read_trajectories,
    write_trajectories,
)
from loupe.sample_metrics import SampleRecord, result_rows, summarize
from stages.eval.params import EvalParams

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [call([0.4, 0.4, 0.7, 0.7]), "<think>found it</think>\n<answer>A</answer>"]
"""Every scripted sample zooms once, then answers: each trajectory carries a crop to save."""
FINAL_OUTPUTS = ("results.jsonl", "trajectories/synthetic.jsonl", "metrics.json", "viewer.html")
"""A model's final outputs, under OUT/model/ (the stage names a bare --model path `model`)."""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("streaming") / "tasks"
    generate_tasks(root, SyntheticConfig(seed=11, train=0, val=0, test=5, canvas_side=(1024, 1024)))
    return root


def write_params(folder: Path, tasks_dir: Path, **eval_keys) -> Path:
    params = {
        "seed": 5,
        "protocol": {"max_turns": 4},
        "rollout": {"max_new_tokens": 24, "temperature": 1.0},
        "eval": {"benchmarks": [{"name": "synthetic", "path": str(tasks_dir)}], "samples": 2, "max_turns": 4, **eval_keys},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return folder / "params.yaml"


def run_stage(params: Path, model: Path, out: Path) -> Path:
    """The stage on one bare model path (a folder, made empty for a scripted engine); returns its output folder."""
    model.mkdir(parents=True, exist_ok=True)
    assert eval_stage.main(["--params", str(params), "--model", str(model), "--out", str(out), "--no-progress"]) == 0
    return out / "model"


@pytest.fixture()
def scripted(monkeypatch):
    """The stage's engine replaced by a scripted one; returns the list of task counts run_rollouts was given."""
    monkeypatch.setattr(one_model, "make_engine", lambda *args, **kwargs: ScriptedEngine([SCRIPT]))
    return monkeypatch


def leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith((".partial", ".tmp"))]


# --- Memory: what eval holds is bounded by the chunk ---------------------------------------------------------------


def test_eval_holds_at_most_a_chunk_of_trajectories_and_the_viewers_share(tmp_path, tasks_dir, scripted):
    params = write_params(tmp_path, tasks_dir, chunk_size=2, viewer_trajectories=1)
    real_run = one_model.run_rollouts
    made: list[weakref.ref] = []
    calls: list[dict] = []

    def watched(tasks, *args, **kwargs):
        gc.collect()
        alive = [r() for r in made if r() is not None]
        calls.append({"tasks": len(tasks), "alive": len(alive), "heavy": [t for t in alive if t.trace or t.pending]})
        del alive
        out = real_run(tasks, *args, **kwargs)
        made.extend(weakref.ref(t) for t in out)
        return out

    scripted.setattr(one_model, "run_rollouts", watched)
    run_stage(params, tmp_path / "model", tmp_path / "out")
    # 5 questions in chunks of 2: three calls, and before each one only the viewer's single trajectory survives
    # of the earlier chunks (an eval that kept everything would hold 4 and then 8 here).
    assert [c["tasks"] for c in calls] == [2, 2, 1]
    assert [c["alive"] for c in calls] == [0, 1, 1]
    assert all(c["heavy"] == [] for c in calls)  # the one kept holds neither a token trace nor an unsaved crop
    assert len(read_trajectories(tmp_path / "out" / "model" / "trajectories" / "synthetic.jsonl")) == 10


def test_a_benchmark_no_larger_than_a_chunk_runs_in_one_call(tmp_path, tasks_dir, scripted):
    sizes: list[int] = []
    real_run = one_model.run_rollouts
    scripted.setattr(one_model, "run_rollouts", lambda tasks, *a, **k: sizes.append(len(tasks)) or real_run(tasks, *a, **k))
    run_stage(write_params(tmp_path, tasks_dir), tmp_path / "model", tmp_path / "out")
    assert EvalParams().chunk_size >= 5 and sizes == [5]


def test_chunking_changes_no_output_of_a_deterministic_engine(tmp_path, tasks_dir, scripted):
    whole = run_stage(write_params(tmp_path / "a", tasks_dir, chunk_size=100), tmp_path / "model", tmp_path / "whole")
    chunked = run_stage(write_params(tmp_path / "b", tasks_dir, chunk_size=2), tmp_path / "model", tmp_path / "chunked")
    for name in ("results.jsonl", "trajectories/synthetic.jsonl", "plots/turn_scaling.json"):
        assert (chunked / name).read_text() == (whole / name).read_text(), name
    assert (tmp_path / "chunked" / "plots" / "turn_scaling.json").read_text() == \
        (tmp_path / "whole" / "plots" / "turn_scaling.json").read_text()
    one, other = (json.loads((d / "metrics.json").read_text()) for d in (whole, chunked))
    assert one["benchmarks"] == other["benchmarks"] and one["benchmarks"]["synthetic"]["trajectories"] == 10
    crops = sorted(p.relative_to(chunked) for p in chunked.rglob("*.png"))
    assert len(crops) == 11  # one crop per trajectory, plus the model's turn-scaling plot


# --- Atomic outputs --------------------------------------------------------------------------------------------------


def test_a_failure_mid_run_leaves_the_previous_outputs_whole(tmp_path, tasks_dir, scripted):
    params = write_params(tmp_path, tasks_dir, chunk_size=2)
    out = tmp_path / "out"
    run_stage(params, tmp_path / "model", out)
    before = {name: (out / "model" / name).read_bytes() for name in FINAL_OUTPUTS}
    comparison = (out / "metrics.json").read_bytes()
    real_run = one_model.run_rollouts
    seen: list[int] = []

    def failing(tasks, *args, **kwargs):
        if seen:
            # The first chunk is already on disk, under a hidden name: streamed, not held.
            [partial] = (out / "model" / "trajectories").glob(".synthetic.jsonl.*.partial")
            seen.append(len(partial.read_text().splitlines()))
            raise RuntimeError("node lost")
        seen.append(0)
        return real_run(tasks, *args, **kwargs)

    scripted.setattr(one_model, "run_rollouts", failing)
    with pytest.raises(RuntimeError, match="node lost"):
        eval_stage.main(["--params", str(params), "--model", str(tmp_path / "model"), "--out", str(out), "--no-progress"])
    assert seen == [0, 4]
    assert {name: (out / "model" / name).read_bytes() for name in FINAL_OUTPUTS} == before
    assert (out / "metrics.json").read_bytes() == comparison
    assert leftovers(out) == []


KILLED_DRIVER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_rollout_loop import ScriptedEngine
import stages.eval.__main__ as eval_stage
import stages.eval.one_model as one_model
one_model.make_engine = lambda *a, **k: ScriptedEngine([{script!r}])
real_run, calls = one_model.run_rollouts, []
def run(tasks, *a, **k):
    calls.append(len(tasks))
    if len(calls) == 2:  # chunk 1 is written: say so, then wait to be killed
        Path({marker!r}).write_text("ready")
        time.sleep(120)
    return real_run(tasks, *a, **k)
one_model.run_rollouts = run
sys.exit(eval_stage.main(sys.argv[1:]))
"""


def test_a_killed_run_leaves_no_half_file_and_the_next_run_cleans_up(tmp_path, tasks_dir):
    params = write_params(tmp_path, tasks_dir, chunk_size=2)
    out, marker = tmp_path / "out", tmp_path / "ready"
    (tmp_path / "model").mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(KILLED_DRIVER.format(tests=str(ROOT / "tests"), script=SCRIPT, marker=str(marker)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOUPE_TRACKING": "off"}
    args = ["--params", str(params), "--model", str(tmp_path / "model"), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen([sys.executable, str(driver), *args], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "the driver ended before its second chunk"
            assert time.monotonic() < deadline, "the driver never reached its second chunk"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    for name in FINAL_OUTPUTS:
        assert not (out / "model" / name).exists(), name
    assert not (out / "metrics.json").exists()
    partial = leftovers(out)
    assert {p.name.split(".")[1] for p in partial} == {"results", "synthetic"}
    [trajectories] = [p for p in partial if p.name.startswith(".synthetic")]
    assert len(trajectories.read_text().splitlines()) == 4  # chunk 1 (2 questions x 2 samples) had been streamed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(one_model, "make_engine", lambda *a, **k: ScriptedEngine([SCRIPT]))
        run_stage(params, tmp_path / "model", out)
    assert leftovers(out) == []
    assert len((out / "model" / "results.jsonl").read_text().splitlines()) == 10


def test_jsonl_writer_appends_and_renames_only_on_commit(tmp_path):
    path = tmp_path / "rows.jsonl"
    with JsonlWriter(path) as writer:
        writer.write_rows([{"a": 1}])
        assert not path.exists() and writer.tmp_path.read_text() == '{"a": 1}\n'
        writer.write_rows([{"a": "é"}])
    assert path.read_text() == '{"a": 1}\n{"a": "\\u00e9"}\n' and leftovers(tmp_path) == []
    with pytest.raises(TypeError), JsonlWriter(path) as writer:
        writer.write_rows([{"a": 2}])
        writer.write_rows([{"a": 3}, {"b": object()}])  # refused before any of its rows is written
    assert path.read_text() == '{"a": 1}\n{"a": "\\u00e9"}\n' and leftovers(tmp_path) == []


# --- The tiny model: streamed eval equals the unchunked computation ---------------------------------------------


def unchunked_reference(params_path: Path, model: Path, out: Path) -> dict:
    """What the stage computed before it streamed: every question in one run_rollouts call, every trajectory held
    to the end, metrics from the trajectories themselves."""
    raw = yaml.safe_load(params_path.read_text())
    protocol = ProtocolParams(**raw["protocol"])
    params = EvalParams(**raw["eval"])
    rollout = RolloutParams(**raw["rollout"])
    if params.temperature is not None:
        rollout = rollout.model_copy(update={"temperature": params.temperature})
    benchmark = load_benchmark("synthetic", params.benchmarks[0].path, out / "benchmark_cache")
    engine = make_engine(rollout, protocol, model_path=str(model), seed=raw["seed"])
    trajectories = run_rollouts(benchmark.tasks, engine, protocol, benchmark.image_root, samples_per_task=params.samples,
                                max_turns=params.max_turns, max_new_tokens=rollout.max_new_tokens)
    for trajectory in trajectories:
        score_trajectory(trajectory, params.reward, None)
    write_trajectories(trajectories, out / "trajectories" / "synthetic.jsonl")
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in result_rows("synthetic", trajectories)))
    return summarize(trajectories, params.turn_limits)


@pytest.mark.parametrize("temperature, chunk_size", [(1.0, 32), (0.0, 1)])
def test_streamed_eval_equals_the_unchunked_run_on_the_tiny_model(tmp_path, tiny_model_dir, tasks_dir, temperature,
                                                                   chunk_size):
    """Sampled: a benchmark within one chunk is the old single batch, so every byte matches. Greedy: chunks of
    one question still give the same outputs (decoding does not depend on the batch it ran in)."""
    params = write_params(tmp_path, tasks_dir, chunk_size=chunk_size, temperature=temperature)
    reference = unchunked_reference(params, tiny_model_dir, tmp_path / "reference")
    streamed = run_stage(params, tiny_model_dir, tmp_path / "streamed")
    for name in ("results.jsonl", "trajectories/synthetic.jsonl"):
        assert (streamed / name).read_text() == (tmp_path / "reference" / name).read_text(), name
    metrics = json.loads((streamed / "metrics.json").read_text())["benchmarks"]["synthetic"]
    assert json.dumps(metrics) == json.dumps(reference) and metrics["trajectories"] == 10


def test_a_sampled_chunked_run_repeats_exactly(tmp_path, tiny_model_dir, tasks_dir):
    """Sampled results depend on (seed, chunk_size); the same pair gives the same bytes."""
    params = write_params(tmp_path, tasks_dir, chunk_size=2, temperature=1.0)
    first = run_stage(params, tiny_model_dir, tmp_path / "first")
    second = run_stage(params, tiny_model_dir, tmp_path / "second")
    for name in ("results.jsonl", "trajectories/synthetic.jsonl"):
        assert (first / name).read_text() == (second / name).read_text(), name


# --- Images travel once: the K samples of a task share its decoded images -------------------------------------------


class RecordingEngine(ScriptedEngine):
    def __init__(self, scripts):
        super().__init__(scripts)
        self.begun: list[list] = []

    def begin(self, system, question, images):
        self.begun.append(list(images))
        return super().begin(system, question, images)


def test_a_tasks_image_is_decoded_once_and_shared_by_its_samples(tasks_dir, monkeypatch):
    from loupe.rollout import loop

    opened: list[str] = []
    real_open = loop.open_image
    monkeypatch.setattr(loop, "open_image", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    benchmark = load_benchmark("synthetic", tasks_dir, tasks_dir / "cache")
    engine = RecordingEngine([SCRIPT])
    trajectories = run_rollouts(benchmark.tasks[:2], engine, ProtocolParams(), benchmark.image_root, samples_per_task=3)
    assert len(opened) == 2 and len(trajectories) == 6  # once per task, not per sample
    first, second = engine.begun[:3], engine.begun[3:]
    assert all(images[0] is first[0][0] for images in first) and all(images[0] is second[0][0] for images in second)
    assert first[0][0] is not second[0][0]


def test_a_group_of_k_traces_shares_its_image_and_pickles_about_once(tiny_model_dir, tasks_dir):
    """The transformers engine's traces (what rl ships through Ray) point at one image and one pixel tensor per
    task; pickle writes a shared object once, so K samples cost barely more than one."""
    protocol = ProtocolParams()
    benchmark = load_benchmark("synthetic", tasks_dir, tasks_dir / "cache")
    engine = make_engine(RolloutParams(max_new_tokens=8), protocol, model_path=str(tiny_model_dir), seed=0)
    group = run_rollouts(benchmark.tasks[:1], engine, protocol, benchmark.image_root, samples_per_task=4, max_new_tokens=8)
    first = group[0].trace
    for other in group[1:]:
        assert other.trace.images[0] is first.images[0]
        assert other.trace.extras["pixel_values"][0] is first.extras["pixel_values"][0]
    one = len(pickle.dumps(group[0]))
    together = len(pickle.dumps(group))
    assert one > 100_000  # the image and its pixel values dominate a trajectory's pickle
    assert together < 1.5 * one, (one, together)  # not 4x: the shared image is written once
    restored = pickle.loads(pickle.dumps(group))
    assert restored[1].trace.images[0] is restored[0].trace.images[0]


def test_compact_records_give_the_summary_of_the_trajectories(tmp_path, tasks_dir, scripted):
    out = run_stage(write_params(tmp_path, tasks_dir), tmp_path / "model", tmp_path / "out")
    trajectories: list[Trajectory] = read_trajectories(out / "trajectories" / "synthetic.jsonl")
    records = [SampleRecord.of(t) for t in trajectories]
    limits = EvalParams(max_turns=4).turn_limits
    assert json.dumps(summarize(records, limits)) == json.dumps(summarize(trajectories, limits))
    assert result_rows("synthetic", records) == result_rows("synthetic", trajectories)

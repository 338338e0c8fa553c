"""`loupe serve` on a real model: the committed tiny Qwen2.5-VL (assets/tiny-model) on the transformers engine,
greedy, over the first 4 questions of the default's test split (the same generator and seed as `make run`'s).

- The zoom loop run by the server gives, for each question, the trajectory the in-process rollout loop gives
  (`run_rollouts`, the eval stage's loop), and requests sent all at once (sharing the running batch) give what
  they give one after another.
- Parity through the eval stage: `stages.eval` with `rollout.engine: openai` pointed at the server (one turn per
  request, `loupe.loop: false`: the stage's own loop drives it) scores the same answers as `stages.eval` in
  process.
The tiny base model follows no protocol, so these are checks of the path (tokens, crops, batching), not of
learning; tests/test_learning.py serves the trained model (`make test-learning`). About 90 s.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from loupe.config import ProtocolParams
from loupe.data.families import DataParams, generate_family
from loupe.data.tasks import read_tasks
from loupe.models import load_model, load_processor
from loupe.rollout import run_rollouts
from loupe.rollout.hf import TransformersEngine
from loupe.protocol import get_protocol
from loupe.serve.main import build_server
from serve_helpers import question, running
from stages.eval.__main__ import main as eval_main

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "assets" / "tiny-model"
QUESTIONS = 4
SETTINGS = {"protocol": {"max_turns": 4}, "rollout": {"max_new_tokens": 40, "device": "cpu", "batch_size": 8},
            "serve": {"max_turns": 4}}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serve-tasks") / "tasks"
    generate_family(folder, DataParams(family="zoom", zoom={"train": 0, "val": 0, "test": QUESTIONS}))
    return folder


@pytest.fixture(scope="module")
def params_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve-params") / "params.yaml"
    path.write_text(yaml.safe_dump(SETTINGS))
    return path


@pytest.fixture(scope="module")
def server(params_file):
    built = build_server(MODEL, params_file)
    with running(built.app) as url:
        yield url, built
    built.scheduler.close()


def _served(url: str, model: str, image: Path, text: str) -> dict:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=model, messages=question(image, text))
    extension = reply.model_extra["loupe"]
    return {"answer": reply.choices[0].message.content, "end": extension["end_reason"],
            "said": [turn["text"] for turn in extension["trajectory"] if turn["role"] == "assistant"],
            "crops": [turn["crop"]["region_px"] for turn in extension["trajectory"] if "crop" in turn]}


def test_the_server_loop_gives_the_in_process_trajectories_alone_or_together(tasks, server):
    url, built = server
    records = read_tasks(tasks / "test.jsonl")
    asks = [(tasks / record.images[0], record.problem) for record in records]
    one_by_one = [_served(url, built.model, image, text) for image, text in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda ask: _served(url, built.model, *ask), asks))
    assert together == one_by_one

    protocol = ProtocolParams(max_turns=4)
    engine = TransformersEngine(load_model(MODEL, device="cpu"), load_processor(MODEL),
                                get_protocol(protocol.name).stop, temperature=0.0, batch_size=8)
    in_process = run_rollouts(records, engine, protocol, tasks, max_new_tokens=40)
    expected = [{"answer": t.answer or "", "end": t.end_reason,
                 "said": [turn.text for turn in t.turns if turn.role == "assistant"],
                 "crops": [turn.crop["region_px"] for turn in t.turns if turn.crop]} for t in in_process]
    assert one_by_one == expected
    assert all(len(served["said"]) >= 1 for served in one_by_one)


def test_the_eval_stage_through_the_server_scores_what_it_scores_in_process(tasks, server, tmp_path):
    url, built = server
    common = {"seed": 0, **SETTINGS,
              "eval": {"benchmarks": [{"name": "synthetic", "path": str(tasks)}], "samples": 1, "max_turns": 4,
                       "temperature": 0.0, "viewer_trajectories": 0}}
    local = dict(common, rollout={**SETTINGS["rollout"], "temperature": 0.0})
    remote = dict(common, rollout={**SETTINGS["rollout"], "engine": "openai", "temperature": 0.0,
                                   "openai": {"base_url": url + "/v1", "model": built.model, "api_key_env": None,
                                              "concurrency": 4, "extra_body": {"loupe": {"loop": False}}}})
    answers = {}
    for name, params in (("local", local), ("remote", remote)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(params))
        model = str(MODEL) if name == "local" else "served"
        assert eval_main(["--params", str(tmp_path / f"{name}.yaml"), "--model", f"m={model}",
                          "--out", str(tmp_path / name), "--no-progress"]) == 0
        rows = [json.loads(line) for line in (tmp_path / name / "m" / "results.jsonl").read_text().splitlines()]
        answers[name] = [(row["doc_id"], row.get("answer"), row.get("end_reason"), row.get("num_turns")) for row in rows]
    assert len(answers["local"]) == QUESTIONS
    assert answers["remote"] == answers["local"]


def test_the_load_benchmark_runs_and_checks_its_answers(tasks, tmp_path, params_file):
    """benchmarks/serve_load.py at a tiny size: both phases, the answers compared, the figures written."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import serve_load

    out = tmp_path / "load.json"
    assert serve_load.main(["--model", str(MODEL), "--tasks", str(tasks), "--params", str(params_file),
                            "--clients", "3", "--requests", "6", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["identical"] == figures["requests"] == 6 and figures["errors"] == 0
    assert figures["sequential_s"] > 0 and figures["concurrent_s"] > 0


def test_a_discarded_turn_leaves_the_running_batch_and_the_others_unchanged(tasks):
    """TransformersEngine.discard: a row dropped mid-decode is never reported, and the rows left decode the
    tokens they decode without it (greedy)."""
    from PIL import Image

    processor, model = load_processor(MODEL), load_model(MODEL, device="cpu")
    records = read_tasks(tasks / "test.jsonl")[:3]

    def generations(drop: bool) -> dict[int, str]:
        engine = TransformersEngine(model, processor, (), temperature=0.0, batch_size=8)
        tickets = []
        for record, budget in zip(records, (2, 48, 48)):  # the first ends at once, the others decode on
            image = Image.open(tasks / record.images[0]).convert("RGB").resize((112, 112))
            tickets.append(engine.submit(engine.begin("S", "<image>\n" + record.problem, [image]), budget))
        finished = dict(engine.poll())  # the three rows were admitted together; at least one has ended
        if drop:
            assert tickets[0] in finished and len(finished) < len(tickets)
            victim = tickets[1]
            engine.discard({victim})
        while len(finished) < len(tickets) - int(drop):
            finished.update(engine.poll())
        return {tickets.index(ticket): generation.text for ticket, generation in finished.items()}

    whole, dropped = generations(False), generations(True)
    assert len(dropped) == 2 and all(dropped[i] == whole[i] for i in dropped)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_each_family_is_served_with_its_zoom_loop_as_in_process(family, family_model_dirs, tasks, params_file):
    """`loupe serve` on a tiny Qwen3-VL, Qwen3-VL-MoE and Qwen3.5: two requests at once (sharing the running batch,
    Qwen3.5's linear-attention states kept per dialogue) get the trajectories the in-process loop gives."""
    model = family_model_dirs[family]
    built = build_server(model, params_file)
    records = read_tasks(tasks / "test.jsonl")[:2]
    try:
        with running(built.app) as url, ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda record: _served(url, built.model, tasks / record.images[0], record.problem),
                                   records))
    finally:
        built.scheduler.close()
    protocol = ProtocolParams(max_turns=4)
    engine = TransformersEngine(load_model(model, device="cpu"), load_processor(model),
                                get_protocol(protocol.name).stop, temperature=0.0, batch_size=8)
    in_process = run_rollouts(records, engine, protocol, tasks, max_new_tokens=40)
    assert served == [{"answer": t.answer or "", "end": t.end_reason,
                       "said": [turn.text for turn in t.turns if turn.role == "assistant"],
                       "crops": [turn.crop["region_px"] for turn in t.turns if turn.crop]} for t in in_process]

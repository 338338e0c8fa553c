"""Load on `loupe serve`: many clients at once against one client at a time, on the same server and questions.

The server runs in this process (`loupe.serve.main.build_server`, on a free loopback port) with the model and
params given; clients are threads, each with its own `openai` client, sending the test split's questions (their
images as PNG data URLs) for the zoom loop server-side. Two phases over the same requests:

- `sequential`: one client, one request after another (the baseline, measured in the same run);
- `concurrent`: `--clients` clients at once, `--requests` requests in all (the test split's questions in turn).

It prints each phase's requests a second, latency percentiles and errors, the ratio of the two throughputs, and
whether every concurrent answer (answer, end reason and every assistant turn's text) equals the sequential run's
for the same question: greedy decoding on a shared running batch gives each request the search it gets alone.
It also scores the answers against the questions' solutions. Exit status 1 on an error or a mismatch.

    python benchmarks/serve_load.py --model work/rl/model --tasks work/data/tasks --clients 32 --requests 200
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loupe.data.tasks import read_tasks  # noqa: E402
from loupe.serve.main import build_server, serving_in_thread  # noqa: E402


def _messages(image: Path, text: str) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode("ascii")
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _phase(base: str, model: str, asks: list[tuple[str, list[dict]]], clients: int) -> tuple[list, float]:
    """Send every request with `clients` threads; returns [(doc_id, result or error, seconds)] and wall time."""
    pool_clients = [OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600) for _ in range(clients)]

    def send(index: int) -> tuple[str, dict | str, float]:
        doc_id, messages = asks[index]
        client = pool_clients[index % clients]
        started = time.perf_counter()
        try:
            reply = client.chat.completions.create(model=model, messages=messages)
        except Exception as err:  # counted and printed, never hidden
            return doc_id, f"{type(err).__name__}: {err}", time.perf_counter() - started
        extension = reply.model_extra["loupe"]
        result = {"answer": reply.choices[0].message.content, "end": extension["end_reason"],
                  "said": [t["text"] for t in extension["trajectory"] if t["role"] == "assistant"],
                  "tokens": reply.usage.completion_tokens}
        return doc_id, result, time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(send, range(len(asks))))
    return results, time.perf_counter() - started


def _report(name: str, results: list, wall: float) -> None:
    latencies = sorted(seconds for _, _, seconds in results)
    errors = [r for _, r, _ in results if isinstance(r, str)]
    turns = [len(r["said"]) for _, r, _ in results if isinstance(r, dict)]
    print(f"{name:>10}: {len(results)} requests in {wall:6.1f} s = {len(results) / wall:6.2f} req/s; latency p50 "
          f"{statistics.median(latencies):.2f} s, p95 {latencies[int(0.95 * (len(latencies) - 1))]:.2f} s; "
          f"{statistics.mean(turns) if turns else 0:.2f} turns a request; errors {len(errors)}")
    for error in errors[:3]:
        print(f"            {error[:200]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tasks", type=Path, default=ROOT / "work" / "data" / "tasks")
    parser.add_argument("--split", default="test")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE")
    args = parser.parse_args(argv)

    records = read_tasks(args.tasks / f"{args.split}.jsonl")
    picked = [records[i % len(records)] for i in range(args.requests)]
    asks = [(r.doc_id, _messages(args.tasks / r.images[0], r.problem)) for r in picked]
    solutions = {r.doc_id: r.solution for r in records}
    server = build_server(args.model, args.params, args.overrides)
    print(f"serving {server.model} with the {server.scheduler.engine.name} engine: {args.requests} requests, "
          f"{args.clients} clients, max_running {server.scheduler.max_running}")
    try:
        with serving_in_thread(server.app) as base:
            _phase(base, server.model, asks[:2], 1)  # warm-up: first-call costs out of both phases
            sequential, seq_wall = _phase(base, server.model, asks, 1)
            concurrent, con_wall = _phase(base, server.model, asks, args.clients)
    finally:
        server.scheduler.close()
    _report("sequential", sequential, seq_wall)
    _report("concurrent", concurrent, con_wall)
    same = sum(a == b for (_, a, _), (_, b, _) in zip(sequential, concurrent) if isinstance(a, dict))
    right = sum(isinstance(r, dict) and r["answer"].strip().lower() == solutions[d].strip().lower()
                for d, r, _ in concurrent)
    speedup = seq_wall / con_wall
    print(f"throughput ratio concurrent/sequential: {speedup:.2f}x; answers identical to the sequential run's: "
          f"{same}/{len(asks)}; accuracy {right / len(asks):.3f}")
    errors = sum(isinstance(r, str) for _, r, _ in sequential + concurrent)
    if args.out is not None:
        args.out.write_text(json.dumps({"requests": len(asks), "clients": args.clients, "sequential_s": seq_wall,
                                        "concurrent_s": con_wall, "ratio": speedup, "identical": same,
                                        "errors": errors, "accuracy": right / len(asks)}, indent=1))
    return 0 if errors == 0 and same == len(asks) else 1


if __name__ == "__main__":
    sys.exit(main())

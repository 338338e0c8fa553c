"""`loupe serve`: a trained model behind an OpenAI-compatible API, the zoom loop run server-side.

    loupe serve --model work/rl/model                  # http://127.0.0.1:8000: the page at /, the API at /v1
    loupe serve --model DIR --params params/mini-o3.yaml --port 9000 rollout.engine=vllm
    LOUPE_API_KEY=secret loupe serve --model DIR serve.host=0.0.0.0

The model runs with the protocol and the crop tool `protocol` names and the engine `rollout` names
(transformers by default, on CPU or a GPU; `rollout.engine=vllm` on vLLM), as the rl and eval stages ran it;
`serve` holds the server's own settings (loupe/serve/params.py). docs/serve.md walks through it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loupe.config import ProtocolParams, RolloutParams, load_section, params_with_overrides
from loupe.serve.app import BodyLimit, create_app
from loupe.serve.params import ServeParams
from loupe.serve.scheduler import Scheduler

log = logging.getLogger("loupe.serve")


@dataclass
class Server:
    """What `build_server` makes: the ASGI app (body limit included), its scheduler and its settings."""

    app: Any
    scheduler: Scheduler
    params: ServeParams
    model: str


def build_server(model_dir: str | Path | None, params_file: str | Path = "params.yaml", overrides: list[str] = (),
                 engine: Any = None) -> Server:
    """Load the sections, build the engine (or take `engine`, a test's), start the scheduler's thread."""
    path = params_with_overrides(params_file, list(overrides))
    serve = load_section(ServeParams, "serve", path)
    protocol = load_section(ProtocolParams, "protocol", path)
    rollout = load_section(RolloutParams, "rollout", path)
    max_running = serve.max_running or rollout.batch_size
    # The server's sampling is the request's unless it asks for another (then 400): one value for the batch.
    rollout = rollout.model_copy(update={"temperature": serve.temperature, "top_p": serve.top_p,
                                         "later_turn_temperature": None, "batch_size": max_running})
    if engine is None:
        if model_dir is None or not Path(model_dir).is_dir():
            raise FileNotFoundError(f"--model {model_dir}: no such model directory")
        from loupe.rollout import make_engine

        engine = make_engine(rollout, protocol, model_path=str(model_dir), seed=0)
    api_key = os.environ.get(serve.api_key_env, "") if serve.api_key_env else ""
    name = serve.model_name or (Path(model_dir).name if model_dir is not None else engine.name)
    scheduler = Scheduler(engine, protocol, serve.max_turns or protocol.max_turns,
                          serve.max_new_tokens or rollout.max_new_tokens, max_running, serve.max_queued)
    scheduler.start()
    app = create_app(scheduler, serve, name, api_key or None)
    return Server(BodyLimit(app, serve.max_request_bytes), scheduler, serve, name)


def serve_main(model_dir: Path, params_file: Path, host: str | None, port: int | None, overrides: list[str]) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = build_server(model_dir, params_file, overrides)
    params = server.params
    host = host or params.host
    port = params.port if port is None else port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    keyed = bool(params.api_key_env and os.environ.get(params.api_key_env))
    print(f"loupe serve: {server.model} ({server.scheduler.engine.name} engine, protocol "
          f"{server.scheduler.rollout.protocol.name}) on http://{host}:{bound}/ ; API at http://{host}:{bound}/v1"
          + ("" if keyed else f"; no API key ({params.api_key_env or 'serve.api_key_env'} unset): anyone who "
                               "reaches the port can use it"), flush=True)
    config = uvicorn.Config(server.app, log_level="info", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.scheduler.close()
    return 0


@contextlib.contextmanager
def serving_in_thread(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve an ASGI app on a free port in a thread of this process (tests, benchmarks, notebooks); yields its
    base URL (no /v1) and stops the server on leaving. The caller closes the scheduler."""
    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="loupe-serve-http")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

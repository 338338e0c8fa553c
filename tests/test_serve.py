"""`loupe serve` as a client sees it, with a scripted engine that zooms (tests/serve_helpers.py): the zoom loop
run server-side, streaming, the `openai` client unchanged, the API key, concurrent requests sharing one batch,
the queue's bound, a client that goes away, and every bad input answered with its 4xx while the server goes on.
The real tiny model's path (the transformers engine, concurrent against sequential, one-turn mode and the eval
stage through the server) is tests/test_serve_model.py. About 20 s.
"""

from __future__ import annotations

import io
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from loupe.serve.main import build_server
from serve_helpers import ZoomingEngine, data_url, question, running, scene

REPO_PARAMS = "params.yaml"


@pytest.fixture()
def serve(monkeypatch):
    """Start servers on a ZoomingEngine: serve(engine=..., overrides=[...]) -> (base URL, server)."""
    stack = []

    def start(engine=None, overrides=(), key=None):
        if key is not None:
            monkeypatch.setenv("LOUPE_API_KEY", key)
        else:
            monkeypatch.delenv("LOUPE_API_KEY", raising=False)
        server = build_server(None, REPO_PARAMS, list(overrides), engine=engine or ZoomingEngine())
        context = running(server.app)
        url = context.__enter__()
        stack.append((context, server))
        return url, server

    yield start
    for context, server in reversed(stack):
        context.__exit__(None, None, None)
        server.scheduler.close()


def test_the_openai_client_gets_the_answer_and_the_search(serve):
    url, server = serve()
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model=server.model, messages=question(scene("green")))
    assert reply.choices[0].message.content == "green"
    assert reply.choices[0].finish_reason == "stop"
    extension = reply.model_extra["loupe"]
    assert extension["end_reason"] == "answered" and extension["turns"] == 3
    turns = extension["trajectory"]
    assert [turn["role"] for turn in turns] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    first, second = turns[2]["crop"], turns[4]["crop"]
    assert first["source"] == "original_image" and second["source"] == "observation_1"
    assert first["box"] == pytest.approx([0.35, 0.35, 0.65, 0.65], abs=0.01)
    # The zoom into the zoom, mapped back onto the original: the middle 40% of the middle 30%.
    assert second["box"] == pytest.approx([0.44, 0.44, 0.56, 0.56], abs=0.01)
    assert "images" not in turns[2]  # crops only on request
    assert reply.usage.completion_tokens == 36 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].message.model_extra["reasoning_content"].endswith("<answer>green</answer>")


def test_crops_come_as_images_when_asked(serve):
    url, server = serve()
    body = {"messages": question(scene("blue")), "loupe": {"crops": True}}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
    crops = [turn for turn in reply["loupe"]["trajectory"] if "crop" in turn]
    assert len(crops) == 2
    for turn in crops:
        [image_url] = turn["images"]
        image = Image.open(io.BytesIO(__import__("base64").b64decode(image_url.split(",", 1)[1])))
        assert list(image.size) == turn["crop"]["size"]
    assert "images" not in reply["loupe"]["trajectory"][0]  # the upload is not echoed back


def test_a_stream_sends_each_turn_as_it_happens(serve):
    url, server = serve(ZoomingEngine(seconds_per_batch=0.05))
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model=server.model, messages=question(scene("red")), stream=True,
                                                 stream_options={"include_usage": True}))
    turns = [c.model_extra["loupe"]["turn"] for c in chunks if c.model_extra and "turn" in c.model_extra.get("loupe", {})]
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert sum(1 for r in reasoning if r) == 3
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "red"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 36


def test_models_health_and_the_page(serve):
    url, server = serve(overrides=["serve.model_name=zoomer"])
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "zoomer"
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "zoomer" and health["running"] == 0
    page = httpx.get(url + "/")
    assert page.status_code == 200 and 'id="boxes"' in page.text and "/v1/chat/completions" in page.text
    wrong = httpx.post(url + "/v1/chat/completions", json={"model": "other", "messages": question(scene("red"))})
    assert wrong.status_code == 404 and "zoomer" in wrong.json()["error"]["message"]


def test_the_api_key_is_required_and_never_echoed(serve, caplog):
    url, server = serve(key="s3cret-key-value")
    body = {"messages": question(scene("red"))}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    bad = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and "wrong" not in bad.text
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").json()["needs_key"] is True  # a probe needs no key
    client = OpenAI(base_url=url + "/v1", api_key="s3cret-key-value")
    assert client.chat.completions.create(model=server.model, messages=question(scene("red"))).choices[0].message.content == "red"
    assert "s3cret-key-value" not in caplog.text


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, with almost no data: a decompression bomb's first bytes."""
    def block(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + block(b"IHDR", header) + block(b"IDAT", zlib.compress(b"\x00" * 64)) + block(b"IEND", b"")


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _bodies() -> dict[str, tuple[object, int, str]]:
    """Each bad input: (body, its status, words its message must hold)."""
    good = question(scene("red"))
    text_only = [{"role": "user", "content": "What colour is the square?"}]
    truncated = _png_bytes(scene("red"))[:3000]
    def with_url(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What colour?"}]}]
    return {
        "no image": ({"messages": text_only}, 400, "no image"),
        "no user message": ({"messages": [{"role": "system", "content": "hi"}]}, 400, "no user message"),
        "not an image": ({"messages": with_url("data:image/png;base64,"
                                               + __import__("base64").b64encode(b"hello, not a picture").decode())},
                         400, "not an image"),
        "bad base64": ({"messages": with_url("data:image/png;base64,@@@@")}, 400, "base64"),
        "truncated": ({"messages": with_url(data_url(truncated))}, 400, "truncated"),
        "pixel bomb": ({"messages": with_url(data_url(_png_claiming(60000, 60000)))}, 413, "pixels"),
        "too small": ({"messages": with_url(data_url(Image.new("RGB", (4, 300))))}, 400, "at least"),
        "http url": ({"messages": with_url("http://example.com/a.png")}, 400, "fetch_image_urls"),
        "too many images": ({"messages": [{"role": "user", "content": good[0]["content"][:1] * 5
                                           + [{"type": "text", "text": "Which?"}]}]}, 400, "max_images_per_request"),
        "unknown field": ({"messages": good, "frequency_penalty_x": 1}, 400, "frequency_penalty_x: unknown field"),
        "unknown part field": ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "colour": "red"}]}]}, 400, "unknown field"),
        "no messages": ({"model": "x"}, 400, "messages"),
        "other temperature": ({"messages": good, "temperature": 0.7}, 400, "serve.temperature"),
        "n above one": ({"messages": good, "n": 3}, 400, "n"),
        "tools": ({"messages": good, "tools": []}, 400, "tools: unknown field"),
    }


@pytest.mark.parametrize("name", sorted(_bodies()))
def test_bad_input_gets_its_4xx_and_the_server_goes_on(serve, name):
    url, server = serve(overrides=["serve.max_image_pixels=20000000"])
    body, status, words = _bodies()[name]
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert words in error["message"], error
    after = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("yellow"))}, timeout=30)
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "yellow"


def test_malformed_json_and_an_oversized_body(serve):
    url, server = serve(overrides=["serve.max_request_bytes=200000"])
    broken = httpx.post(url + "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    big = {"messages": question(Image.effect_noise((600, 600), 80).convert("RGB"))}
    oversized = httpx.post(url + "/v1/chat/completions", json=big)
    assert oversized.status_code == 413 and "max_request_bytes" in oversized.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"messages": "' + b"x" * 150000
        yield b"x" * 150000 + b'"}'
    streamed = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}).status_code == 200


def test_concurrent_requests_share_the_engines_batch(serve):
    engine = ZoomingEngine(batch_size=16, seconds_per_batch=0.05)
    url, server = serve(engine, overrides=["serve.max_running=16"])
    colours = ["red", "green", "blue", "yellow", "white", "black"] * 4
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def ask(colour):
        return client.chat.completions.create(model=server.model, messages=question(scene(colour))).choices[0].message.content

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, colours))
    assert answers == colours
    assert max(engine.batches) >= 8  # turns of different requests decoded together
    assert sum(engine.batches) == 3 * len(colours)  # every turn once: nothing was run twice
    assert len(engine.batches) < 3 * len(colours) / 4


def test_past_the_queue_bound_a_request_gets_503(serve):
    url, server = serve(ZoomingEngine(batch_size=1, seconds_per_batch=0.3),
                        overrides=["serve.max_running=1", "serve.max_queued=1"])
    client = httpx.Client(timeout=30)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: client.post(url + "/v1/chat/completions",
                                                      json={"messages": question(scene("red"))}), range(4)))
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 2 and 503 in codes
    busy = next(r for r in replies if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "serve.max_queued" in busy.json()["error"]["message"]
    assert client.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}).status_code == 200


def test_a_client_that_leaves_mid_stream_frees_its_slot(serve):
    engine = ZoomingEngine(batch_size=1, seconds_per_batch=0.4)
    url, server = serve(engine, overrides=["serve.max_running=1", "serve.max_queued=0"])
    body = {"messages": question(scene("red")), "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            for line in reply.iter_lines():
                if '"turn"' in line and '"assistant"' in line:
                    break  # the first assistant turn arrived: leave
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["running"] == 0
    # The slot is free: with no queue at all, a new request is served, not refused.
    after = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("green"))}, timeout=30)
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "green"
    assert sum(engine.batches) < 3 + 3  # the left request did not run to its end


def test_a_client_that_leaves_a_whole_reply_frees_its_slot(serve):
    engine = ZoomingEngine(batch_size=1, seconds_per_batch=0.5)
    url, server = serve(engine, overrides=["serve.max_running=1", "serve.max_queued=0"])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=0.7)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["running"] == 0
    assert httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("blue"))}, timeout=30).status_code == 200


def test_an_engine_failure_fails_its_requests_and_the_next_is_served(serve):
    class Failing(ZoomingEngine):
        fail_next = True

        def generate(self, states, max_new_tokens):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("out of memory (simulated)")
            return super().generate(states, max_new_tokens)

    url, server = serve(Failing())
    failed = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=30)
    assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
    assert httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=30).status_code == 200


def test_one_turn_mode_returns_the_next_turn_only(serve):
    url, server = serve()
    body = {"messages": [{"role": "system", "content": "S"}] + question(scene("red")), "loupe": {"loop": False}}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
    text = reply["choices"][0]["message"]["content"]
    assert text.endswith("</grounding>") and '"original_image"' in text
    assert "loupe" not in reply and reply["usage"]["completion_tokens"] == 12
    odd = {"messages": question(scene("red")) + [{"role": "user", "content": "again"}], "loupe": {"loop": False}}
    refused = httpx.post(url + "/v1/chat/completions", json=odd, timeout=30)
    assert refused.status_code == 400 and "alternate" in refused.json()["error"]["message"]


def test_a_search_that_fails_after_a_turn_fails_alone(serve):
    class BrokenCrop(ZoomingEngine):
        def add_user_turn(self, state, text, images):
            if state.get("poison"):
                raise RuntimeError("the processor failed (simulated)")
            super().add_user_turn(state, text, images)

        def begin(self, system, question, images):
            state = super().begin(system, question, images)
            state["poison"] = "poison" in question
            return state

    url, server = serve(BrokenCrop())
    failed = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"), "poison?")}, timeout=30)
    assert failed.status_code == 500 and "processor failed" in failed.json()["error"]["message"]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "red"


def test_an_engine_thread_that_dies_fails_everyone_and_says_so(serve):
    class Fatal(BaseException):
        """Not an Exception: what no per-request handler catches (a bug, an interpreter-level error)."""

    class Dying(ZoomingEngine):
        def generate(self, states, max_new_tokens):
            raise Fatal("the engine's thread cannot go on (simulated)")

    url, server = serve(Dying())
    failed = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=30)
    assert failed.status_code == 500 and "engine stopped" in failed.json()["error"]["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "simulated" in health.json()["error"]
    refused = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=30)
    assert refused.status_code == 503 and "engine has stopped" in refused.json()["error"]["message"]


def test_an_upright_picture_is_what_the_model_sees_and_the_boxes_land_on(serve):
    url, server = serve()
    picture = scene("green", (900, 700)).rotate(90, expand=True)  # stored sideways ...
    exif = Image.Exif()
    exif[0x0112] = 8  # ... with the EXIF orientation that stands it up again
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", exif=exif, quality=95)
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": question(buffer.getvalue())}, timeout=30).json()
    assert reply["choices"][0]["message"]["content"] == "green"
    first = next(turn["crop"] for turn in reply["loupe"]["trajectory"] if "crop" in turn)
    assert first["region_px"][2] <= 900 and first["region_px"][3] <= 700  # cut from the 900x700 upright picture


def test_what_a_client_running_its_own_loop_sends_is_accepted(serve):
    url, server = serve()
    crops = [{"type": "image_url", "image_url": {"url": data_url(scene("red", (112, 112)))}}]
    messages = [{"role": "system", "content": "S"}] + question(scene("red"))
    for n in range(5):  # five crops so far: six images in the request, within protocol.max_images
        messages += [{"role": "assistant", "content": '<grounding>{"bbox_2d": [0, 0, 1, 1]}</grounding>'},
                     {"role": "user", "content": crops + [{"type": "text", "text": f"Observation {n + 1}"}]}]
    body = {"messages": messages, "loupe": {"loop": False}, "top_k": 0, "stop": ["</grounding>"]}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    other_k = httpx.post(url + "/v1/chat/completions", json={**body, "top_k": 5}, timeout=30)
    assert other_k.status_code == 400 and "rollout.top_k" in other_k.json()["error"]["message"]
    literal = [{"role": "user", "content": [{"type": "text", "text": "a <image> here"}]}]
    refused = httpx.post(url + "/v1/chat/completions", json={"messages": literal, "loupe": {"loop": False}})
    assert refused.status_code == 400 and "image_url parts" in refused.json()["error"]["message"]


def test_a_body_that_is_not_json_is_refused(serve):
    url, server = serve()
    form = httpx.post(url + "/v1/chat/completions", content=b"messages=hi", headers={"content-type": "text/plain"})
    assert form.status_code == 415 and "application/json" in form.json()["error"]["message"]


def test_without_the_trajectory_the_reply_still_gives_the_last_turn(serve):
    url, server = serve()
    body = {"messages": question(scene("blue")), "loupe": {"trajectory": False}}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
    assert "trajectory" not in reply["loupe"] and reply["loupe"]["turns"] == 3
    assert reply["choices"][0]["message"]["reasoning_content"].endswith("<answer>blue</answer>")

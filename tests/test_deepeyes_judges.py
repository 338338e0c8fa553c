"""DeepEyes' three LLM judges as the preset asks them, worked from DeepEyes' code (Visual-Agent/DeepEyes @ 6c5e796,
`verl/utils/reward_score/vl_agent.py`, "vla" below; docs/recipes.md, the DeepEyes table): the messages sent (its
prompts byte for byte), how replies are read, the sampling settings, the retries, and the 0 that a geoguessr or
math row scores when its judge gives no verdict.

Every judge here is the preset's own (params/deepeyes.yaml, `rl.reward`) pointed at a real OpenAI-compatible server
on loopback (tests/fake_openai.py), through Loupe's reward path (`loupe.rewards.score`). The expected messages are
upstream's strings for the same values, stored in tests/fixtures/recipes/judges/deepeyes.json. With
DEEPEYES_VL_AGENT naming upstream's file at that commit
(`git -C <DeepEyes clone> show 6c5e796:verl/utils/reward_score/vl_agent.py > vl_agent.py`) and `-m upstream`
(deselected by default: CI has no copy of upstream's code), the tests also run
upstream's own functions with a scripted client: they recompute the fixture, and check that upstream pays each case
below what the table says and sends the very messages Loupe sends.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
from fake_openai import FakeOpenAIServer, Fault

from loupe.data.tasks import TaskRecord
from loupe.protocol import compile_template
from loupe.rewards import JudgeConfig, LLMJudge, RewardConfig, score
from loupe.rewards.judge import (
    parse_equivalence,
    parse_equivalence_or_zero,
    parse_judgement,
)
from pipelines.workspace import read_recipe

REPO = Path(__file__).resolve().parent.parent
PRESET = read_recipe(REPO, REPO / "params" / "deepeyes.yaml")
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "recipes" / "judges" / "deepeyes.json").read_text())
COMMIT = "6c5e79671dbff958a6f9d44848ba2ca87854f0b0"
KEY, KEY_ENV = "sk-deepeyes-judge", "JUDGE_API_KEY"  # the preset's api_key_env
UPSTREAM = os.environ.get("DEEPEYES_VL_AGENT", "")
needs_upstream = pytest.mark.upstream
"""Tests that run upstream's own file: deselected by default (pyproject.toml), run with `-m upstream`."""


@pytest.fixture(autouse=True)
def _upstream_named(request):
    if request.node.get_closest_marker("upstream") and not Path(UPSTREAM).is_file():
        pytest.fail("-m upstream needs DEEPEYES_VL_AGENT naming upstream's vl_agent.py at 6c5e796 (see the docstring)")

TEMPLATES = {"accuracy": "judge_deepeyes.jinja", "common": "judge_deepeyes_common.jinja",
             "math": "judge_deepeyes_math.jinja"}
SOURCE = {"accuracy": "vl_agent", "common": "geoguessr", "math": "thinklite_eureka"}
"""The data_source that sends a row to each judge (reward_score/__init__.py:64-74)."""


# --- helpers: the preset's reward settings on a loopback server; upstream's module with a scripted client ---------


def _preset_reward(server: FakeOpenAIServer) -> RewardConfig:
    """The preset's `rl.reward`, each judge pointed at `server`, with waits between retries shortened."""
    reward = copy.deepcopy(PRESET["rl"]["reward"])
    judges = [reward["judge"]] + [entry["judge"] for entry in reward["by_data_source"].values() if "judge" in entry]
    for judge in judges:
        judge.update(base_url=server.base_url, backoff_s=0.001, max_backoff_s=0.002)
    return RewardConfig.model_validate(reward)


@pytest.fixture
def server(monkeypatch):
    """A scripted judge: `server.script` is the list of replies (texts or `Fault`s), one a request, in order."""
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setattr(importlib.import_module("loupe.rewards.score"), "_SOURCE_JUDGES", {})
    script: list = []
    with FakeOpenAIServer(lambda request: script.pop(0), api_key=KEY) as fake:
        fake.script = script
        yield fake


ROWS = {
    # (question, reference, response): what the model answered, decoded as DeepEyes' reward reads it.
    "accuracy": ("Is the countertop tan or blue?", "The countertop is tan.",
                 "<think>It looks tan.</think>\n<answer>tan</answer><|im_end|>"),
    "common": ("In which city was this photo taken?", "Paris",
               "<think>The Eiffel Tower.</think>\n<answer>Paris, France</answer><|im_end|>"),
    "math": ("How many eggs are in the box?", "12",
             "<think>Two rows of six.</think> There are \\boxed{a dozen} eggs.<|im_end|>"),
}
"""One row a judge: each answer is well formed (format 0), uses no tool, and (math) is not math-verify's equal of
the reference, so the judge decides; the total is then accuracy x 0.8 (accuracy, common) or x 1.2 (math)."""
WEIGHT = {"accuracy": 0.8, "common": 0.8, "math": 1.2}
ANSWER = {"accuracy": "tan", "common": "Paris, France", "math": "a dozen"}


def _loupe(kind: str, server: FakeOpenAIServer, replies: list):
    question, reference, response = ROWS[kind]
    server.script[:] = replies
    task = TaskRecord(doc_id=kind, images=["x.png"], problem=f"<image>\n{question}", solution=reference,
                      data_source=SOURCE[kind])
    cfg = _preset_reward(server)
    top = LLMJudge(cfg.judge)
    parts = score(task, None, "answered", 0, 0, True, cfg, top, final_text=response, response=response)
    return parts, [request.body for request in server.requests]


class _ScriptedClient:
    """openai.OpenAI inside upstream's module: each `chat.completions.create` records its arguments, then answers
    the next reply (a text) or raises it (an Exception: a request the SDK's own retries could not save)."""

    def __init__(self, replies: list):
        self.replies, self.calls = list(replies), []
        self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self.create))

    def create(self, **request):
        self.calls.append(request)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=types.SimpleNamespace(content=reply))])


def _upstream_module(replies: list) -> tuple[dict, _ScriptedClient]:
    """Upstream's vl_agent.py run as a module, its client (vla:16-27) replaced by a scripted one."""
    client = _ScriptedClient(replies)
    openai = types.ModuleType("openai")
    openai.OpenAI = lambda **kwargs: client
    requests = types.ModuleType("requests")
    requests.get = lambda url: types.SimpleNamespace(json=lambda: {"data": [{"id": "judge"}]})
    namespace: dict = {"__name__": "vl_agent"}
    with mock.patch.dict(sys.modules, {"openai": openai, "requests": requests}):
        exec(compile(Path(UPSTREAM).read_text(encoding="utf-8"), "vl_agent.py", "exec"), namespace)  # noqa: S102
    return namespace, client


def _upstream(kind: str, replies: list) -> tuple[float, list[dict]]:
    """Upstream's scorer of `kind`'s row (compute_score, compute_common_reasoning, compute_score_math): its total
    and the requests its client was asked for."""
    namespace, client = _upstream_module(replies)
    question, reference, response = ROWS[kind]
    scorer = {"accuracy": "compute_score", "common": "compute_common_reasoning", "math": "compute_score_math"}[kind]
    total = namespace[scorer](response, reference, {"question": question})
    return total, client.calls


# --- 1. the prompts: upstream's text, byte for byte ---------------------------------------------------------------


@pytest.mark.parametrize("kind", TEMPLATES)
@pytest.mark.parametrize("rendering", range(len(FIXTURE["renderings"])))
def test_each_judge_sends_upstreams_messages_for_the_same_values(kind, rendering, server):
    """vla:155-169,220,226-234 (accuracy: "You are a helpful assistant." then get_prompt), vla:310-325 (geoguessr:
    COMMON_VERIFY_PROMPT alone), vla:356-372 (math: MATH_VERIFY_PROMPT alone); values holding braces, `%`, Jinja
    marks and line breaks go in verbatim, as Python's formatting puts them."""
    case = FIXTURE["renderings"][rendering]
    server.script[:] = ["## Equivalence Judgement\nTRUE" if kind != "accuracy" else "Judgement: 1"]
    cfg = _preset_reward(server).for_source(SOURCE[kind])
    values = case["values"]
    result = LLMJudge(cfg.judge).judge(values["question"], values["reference"], values["prediction"])
    [request] = server.requests
    assert result.valid and result.score == 1.0
    assert request.body["messages"] == case[kind]


def test_the_templates_cite_upstream_in_a_header_that_renders_to_nothing():
    for name in TEMPLATES.values():
        text = (REPO / "params" / "templates" / name).read_text(encoding="utf-8")
        header = text[: text.index("#}") + 2]
        assert header.startswith("{#-") and COMMIT in header and "vl_agent.py" in header
        assert compile_template(header).render() == ""
    reward = PRESET["rl"]["reward"]
    assert reward["judge"]["prompt_template"].endswith(TEMPLATES["accuracy"])
    assert reward["by_data_source"]["geoguessr"]["judge"]["prompt_template"].endswith(TEMPLATES["common"])
    for source in ("thinklite_eureka", "xince"):
        assert reward["by_data_source"][source]["judge"]["prompt_template"].endswith(TEMPLATES["math"])


@needs_upstream
def test_the_stored_renderings_are_upstreams_strings():
    """The fixture, recomputed from upstream's assignments (vla:31-169) with the same values."""
    source = Path(UPSTREAM).read_text(encoding="utf-8").splitlines(keepends=True)
    namespace: dict = {}
    exec("".join(source[30:169]), namespace)  # noqa: S102 - vla:31-169: get_prompt and the two VERIFY prompts
    for case in FIXTURE["renderings"]:
        q, r, p = (case["values"][k] for k in ("question", "reference", "prediction"))
        assert case["accuracy"][1]["content"] == namespace["get_prompt"](p, r, q)
        assert case["common"][0]["content"] == namespace["COMMON_VERIFY_PROMPT"].format(query=q, gold_ans=r, pred_ans=p)
        assert case["math"][0]["content"] == namespace["MATH_VERIFY_PROMPT"].format(query=q, gold_ans=r, pred_ans=p)


# --- 2. the replies, read as upstream reads them; 3. the retries and the 0 on failure -----------------------------

NO = "I cannot tell from the answers given."
E500 = "E500"
"""A request that fails with HTTP 500 (upstream: the exception the openai client raises after its own retries)."""

CASES = [
    # (id, judge, replies, upstream's accuracy, Loupe's requests, upstream's client calls, why)
    ("acc_judgement_1", "accuracy", ["Judgement: 1"], 1.0, 1, 1, "vla:237-240: '1' after 'Judgement:'"),
    ("acc_judgement_0", "accuracy", ["Judgement: 0"], 0.0, 1, 1, "vla:241-242"),
    ("acc_bare_1", "accuracy", ["1"], 1.0, 1, 1, "vla:247-248: the reply is exactly '1'"),
    ("acc_bare_1_spaced", "accuracy", ["\n 1 \n"], 1.0, 1, 1, "vla:235: the reply is stripped first"),
    ("acc_bare_0", "accuracy", ["0"], 0.0, 1, 1, "vla:249-250"),
    ("acc_bare_1_dot", "accuracy", ["1."], 0.0, 1, 1, "vla:247-253: not exactly '1'"),
    ("acc_bare_sentence", "accuracy", ["The answer is 1"], 0.0, 1, 1, "vla:247-253: a '1', but not exactly '1'"),
    ("acc_typo_heading", "accuracy", ["Judement: 1"], 0.0, 1, 1, "vla:237: the prompt's own typo is no 'Judgement:'"),
    ("acc_lower_heading", "accuracy", ["judgement: 1"], 0.0, 1, 1, "vla:237: the heading is case-sensitive"),
    ("acc_one_in_tail", "accuracy", ["Judgement: 0 (not 1)"], 1.0, 1, 1, "vla:239: any '1' after it counts"),
    ("acc_last_heading", "accuracy", ["Judgement: 1\nJudgement: 0"], 0.0, 1, 1, "vla:238: split(...)[-1]"),
    ("acc_empty_tail", "accuracy", ["Judgement:"], 0.0, 1, 1, "vla:243-245: neither digit: 0, not asked again"),
    ("acc_no_form", "accuracy", [NO], 0.0, 1, 1, "vla:251-253: 0, not asked again"),
    ("common_true", "common", ["## Equivalence Judgement\nTRUE"], 1.0, 1, 1, "vla:327-330"),
    ("common_false", "common", ["## Equivalence Judgement\nFALSE"], 0.0, 1, 1, "vla:331-333"),
    ("common_no_heading", "common", ["TRUE"], 1.0, 1, 1, "vla:327: no heading, the whole reply is read"),
    ("common_last_heading", "common", ["True, I think. ## Equivalence Judgement\nFALSE"], 0.0, 1, 1,
     "vla:327: only the text after the last heading"),
    ("common_untrue", "common", ["untrue"], 1.0, 1, 1, "vla:328: 'true' in 'untrue', no 'false'"),
    ("common_asked_again", "common", [NO, "## Equivalence Judgement\nTRUE or FALSE", "## Equivalence Judgement\ntrue"],
     1.0, 3, 3, "vla:317,334-336: a reply with neither or both is asked again"),
    ("common_eight_without_verdict", "common", [NO] * 8, 0.0, 8, 8, "vla:316-317: 8 tries, then accuracy 0"),
    ("math_true", "math", ["## Equivalence Judgement\nTRUE"], 1.0, 1, 1, "vla:379-381,411"),
    ("math_false", "math", ["## Equivalence Judgement\nFALSE"], 0.0, 1, 1, "vla:382-383,411"),
    ("math_no_verdict", "math", [NO], 0.0, 1, 1, "vla:374,379-385: the first reply decides; None scores 0"),
    ("math_both", "math", ["## Equivalence Judgement\nTRUE or FALSE"], 0.0, 1, 1, "vla:379-385: None, 0"),
    ("math_error_then_true", "math", [E500, "## Equivalence Judgement\nTRUE"], 1.0, 2, 2,
     "vla:363-377: an error is tried again"),
    # Upstream tries 8 times, each try the openai client's 3 requests (its default 2 retries): 24 requests.
    ("math_every_try_fails", "math", [E500] * 24, 0.0, 24, 8, "vla:362,379-385: every try failed: '' reads None, 0"),
]


def _as_faults(replies: list) -> list:
    return [Fault.status(500) if reply == E500 else reply for reply in replies]


@pytest.mark.parametrize(("case_id", "kind", "replies", "accuracy", "requests", "calls", "why"), CASES,
                         ids=[case[0] for case in CASES])
def test_the_preset_pays_what_upstreams_code_pays_for_each_reply(case_id, kind, replies, accuracy, requests, calls,
                                                                  why, server):
    parts, bodies = _loupe(kind, server, _as_faults(replies))
    assert parts.valid, why
    assert (parts.accuracy, parts.format, parts.tool) == (accuracy, 0.0, 0.0), why
    assert parts.total == pytest.approx(WEIGHT[kind] * accuracy), why
    assert parts.extracted == ANSWER[kind]
    assert len(bodies) == requests, why
    if case_id == "math_every_try_fails":
        assert parts.matched_by == "deepeyes_math, judge failed, scored 0"


@needs_upstream
@pytest.mark.parametrize(("case_id", "kind", "replies", "accuracy", "requests", "calls", "why"), CASES,
                         ids=[case[0] for case in CASES])
def test_upstreams_code_pays_what_the_table_says(case_id, kind, replies, accuracy, requests, calls, why):
    upstream_replies = [RuntimeError("HTTP 500") if r == E500 else r for r in replies[:calls]]
    total, sent = _upstream(kind, upstream_replies)
    assert total == pytest.approx(WEIGHT[kind] * accuracy), why
    assert len(sent) == calls, why


@pytest.mark.parametrize("kind", TEMPLATES)
def test_each_judge_sends_upstreams_request_settings(kind, server):
    """vla:226-234 (accuracy: temperature 0.3), vla:318-325 (geoguessr: 0.5), vla:365-372 (math: 0.0); no
    max_tokens anywhere (the server's default); every answer asked anew (no cache), each try sent as the first."""
    reply = "Judgement: 1" if kind == "accuracy" else "## Equivalence Judgement\nTRUE"
    question, reference, _ = ROWS[kind]
    for _ in range(2):  # the same row twice: asked twice
        _loupe(kind, server, [reply])
    bodies = [request.body for request in server.requests]
    assert len(bodies) == 2 and bodies[0] == bodies[1]
    assert bodies[0]["temperature"] == {"accuracy": 0.3, "common": 0.5, "math": 0.0}[kind]
    assert bodies[0]["model"] == "judge" and "max_tokens" not in bodies[0]
    roles = [message["role"] for message in bodies[0]["messages"]]
    assert roles == (["system", "user"] if kind == "accuracy" else ["user"])
    user = bodies[0]["messages"][-1]["content"]
    if kind == "accuracy":
        assert user.endswith(f"[Question]: {question}\n[Standard Answer]: {reference}\n"
                             f"[Model_answer] : {ANSWER[kind]}\nJudgement:")
    else:
        assert user.endswith(f"**Question**:\n{question}\n\n**Reference Answer**\n{reference}\n\n"
                             f"## Student Final Answer\n{ANSWER[kind]}")


@needs_upstream
@pytest.mark.parametrize("kind", TEMPLATES)
def test_loupe_sends_the_messages_and_temperature_upstreams_code_sends(kind, server):
    """Upstream's own requests for the same row (its random seed aside: Loupe sends none)."""
    reply = "Judgement: 1" if kind == "accuracy" else "## Equivalence Judgement\nTRUE"
    _, [body] = _loupe(kind, server, [reply])
    _, [sent] = _upstream(kind, [reply])
    assert body["messages"] == sent["messages"] and body["temperature"] == sent["temperature"]
    assert set(sent) == {"model", "messages", "seed", "temperature"}  # no max_tokens upstream either


def test_the_accuracy_judges_failure_leaves_the_reward_invalid(server):
    """vla:226-234: the accuracy judge's request has no loop and no try: after the openai client's 2 retries the
    error ends upstream's run (nothing in verl/workers/reward_manager/naive.py:80-85 catches it). Loupe makes the
    same 3 requests, then drops the trajectory (`on_failure: invalid`) rather than end the run."""
    parts, bodies = _loupe("accuracy", server, _as_faults([E500] * 3))
    assert len(bodies) == 3 and not parts.valid and parts.total is None
    assert parts.invalid_reason.startswith("judge failed: HTTP 500")


@needs_upstream
def test_upstreams_accuracy_judge_raises_on_a_failed_request():
    with pytest.raises(RuntimeError, match="HTTP 500"):
        _upstream("accuracy", [RuntimeError("HTTP 500")])


def test_a_geoguessr_judge_failing_to_the_last_try_scores_0(server):
    """vla:316-336: upstream's loop asks 8 times; an HTTP error is outside any try there and would end its run
    (documented difference); here it takes one of the 8 tries, and the row scores 0 when none gives a verdict."""
    parts, bodies = _loupe("common", server, _as_faults([E500, NO, E500, NO, NO, E500, NO, NO]))
    assert len(bodies) == 8 and parts.valid
    assert (parts.accuracy, parts.total, parts.matched_by) == (0.0, 0.0, "deepeyes_common, judge failed, scored 0")


# --- the reading rules themselves -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "expected"), [(r[0], a) for _, k, r, a, *_ in CASES if k == "accuracy"]
                         + [(None, 0.0), ("", 0.0)])
def test_parse_judgement_is_vla_235_253(reply, expected):
    assert parse_judgement(reply) == expected


@pytest.mark.parametrize(("reply", "expected"), [
    ("## Equivalence Judgement\nTRUE", 1.0), ("## Equivalence Judgement\nFalse.", 0.0), ("untrue", 1.0),
    (NO, None), ("## Equivalence Judgement\nTRUE or FALSE", None), ("", None), (None, None),
])
def test_the_equivalence_readings_are_vla_327_336_and_379_385(reply, expected):
    assert parse_equivalence(reply) == expected  # geoguessr: None is asked again
    assert parse_equivalence_or_zero(reply) == (0.0 if expected is None else expected)  # math: None scores 0


def test_on_failure_zero_applies_to_any_judged_rule_and_invalid_stays_the_default(server):
    """`judge.on_failure` is honoured by the plain `judge` rule too; a judge config without it keeps Loupe's
    invalid reward."""
    assert JudgeConfig().on_failure == "invalid"
    judge = {"base_url": server.base_url, "api_key_env": KEY_ENV, "max_retries": 1, "backoff_s": 0.001}
    task = TaskRecord(doc_id="f", problem="What colour?", solution="red")
    for on_failure, valid in (("invalid", False), ("zero", True)):
        server.script[:] = [Fault.status(500)] * 2
        cfg = RewardConfig(free_form_match="judge", judge={**judge, "on_failure": on_failure})
        parts = score(task, "crimson", "answered", 0, 0, True, cfg, LLMJudge(cfg.judge))
        assert parts.valid is valid
        if valid:
            assert (parts.accuracy, parts.matched_by) == (0.0, "judge, judge failed, scored 0")

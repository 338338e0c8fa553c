"""How a trajectory's reward is put together: `RewardConfig` and the LLM judge's `JudgeConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)


class JudgeConfig(BaseModel):
    """Where and how to ask an LLM whether a free-form answer means the reference answer."""

    # A key pasted into `api_key_env` by mistake must not be echoed back in the validation error.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, hide_input_in_errors=True)

    base_url: str = "https://api.openai.com/v1"
    """OpenAI-compatible endpoint, ending in `/v1` (a local vLLM server works too)."""
    model: str = "gpt-4o-mini"
    """Judge model name as the server knows it; part of the cache key."""
    api_key_env: str | None = Field(default="OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """NAME of the environment variable holding the API key (never the key itself); None for a keyless local server."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Seconds one HTTP request may take before it counts as a failed attempt."""
    max_retries: int = Field(default=4, ge=0)
    """Retries after the first attempt on 408/409/429/5xx, timeouts, connection errors, malformed HTTP 200 replies
    and replies without a score (loupe.endpoint)."""
    backoff_s: float = Field(default=1.0, ge=0)
    """First retry waits about this long; each later one doubles it, with +-50% jitter."""
    max_backoff_s: float = Field(default=30.0, ge=0)
    """Cap on one exponential wait between retries; a server's Retry-After (up to two minutes) is obeyed."""
    transport_retries: int = Field(default=0, ge=0)
    """HTTP failures (408, 409, 429, 5xx, time-outs) asked again this many times within one attempt, at the same
    temperature, before they count against `max_retries`: the openai client's own retries inside each attempt of
    a judge that keeps the client's default (2: Mini-o3's `AzureOpenAI`, general_qa_tool.py:18-22)."""
    rate_limit_wait_s: float | None = Field(default=None, gt=0)
    """After an HTTP 429 that outlasts `transport_retries`, wait this long and ask again, counting no attempt and
    keeping the temperature, for as long as the server refuses (Mini-o3: 3 s, general_qa_tool.py:86-89). None: a
    429 is a failure like any other."""
    cache_dir: str | None = None
    """Directory of cached verdicts (one JSON file per verdict); None keeps them in memory only."""
    max_workers: int = Field(default=8, ge=1)
    """Concurrent requests in `LLMJudge.score_many`."""
    max_tokens: int | None = Field(default=64, ge=1)
    """Reply length budget; the judge only needs to write `Score: 1` or `Score: 0`. None sends none, leaving the
    server's default (vLLM: the rest of the context), as DeepEyes' judge requests do (`vl_agent.py:226-234`)."""
    temperature: float | None = 0.0
    """Sampling temperature; None sends none (some reasoning models accept only their default). DeepEyes: 0.3."""
    temperature_step: float | None = Field(default=None, gt=0)
    """Raise the temperature by this at each retry, capped at 1 (Mini-o3: `min(0.2 x attempt, 1)` from 0,
    general_qa_tool.py:69); None keeps `temperature` for every attempt."""
    cache: bool = True
    """Reuse a verdict for the same question, reference and answer (in memory, and in `cache_dir`); false asks the
    judge every time, as Mini-o3 does (a judge sampling above temperature 0 may answer differently)."""
    system_prompt: str | None = None
    """The judge's system message in place of Loupe's (DeepEyes sends "You are a helpful assistant."); an empty
    string sends none (DeepEyes' geoguessr and math checks send the user message alone)."""
    prompt_template: str | None = None
    """A Jinja file rendering the judge's user message from `question`, `reference` and `prediction`, in place
    of Loupe's; read when the config loads. Its text is part of every cache key."""
    verdict: Literal["score", "judgement", "equivalence", "equivalence_or_zero", "mini_o3"] = "score"
    """How a reply is read: `score`, a "Score: 1" / "Score: 0" line (a reply without one is retried);
    `judgement`, DeepEyes' accuracy judge (`vl_agent.py:235-253`, `compute_score`): the stripped reply holding
    "Judgement:" is right when the text after the last one holds a 1; without "Judgement:" it is right only when
    it is exactly "1"; anything else is wrong (never retried); `equivalence`, DeepEyes' geoguessr check
    (`vl_agent.py:326-336`, `compute_common_reasoning`): the text after the last "## Equivalence Judgement",
    lowercased, is right when it holds "true" and not "false", wrong the other way round, and a reply holding
    both or neither is asked again; `equivalence_or_zero`, DeepEyes' math check (`vl_agent.py:363-385`,
    `generative_verify`): the same reading of the first reply received, a reply holding both or neither being
    wrong (not asked again); or `mini_o3`, Mini-o3's (`general_qa_tool.py:76-82`,
    `GPT4VisionClient.query`, and `:312-313`): the first word after the last "score:" (any case), right when it
    holds a 1; a reply without "score:", or whose word holds neither 0 nor 1, is retried)."""
    on_failure: Literal["invalid", "zero"] = "invalid"
    """When the judge gives no verdict after its retries (HTTP errors, time-outs, malformed replies, or replies
    the verdict rule refuses to the last): `invalid` makes the trajectory's reward invalid (not trained, not
    counted); `zero` scores its accuracy 0 and goes on, as DeepEyes' geoguessr and math checks do after their 8
    tries (`vl_agent.py:316-336,363-385`)."""
    _template_text: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _template_is_readable(self) -> JudgeConfig:
        if self.prompt_template is None:
            return self
        from loupe.protocol import read_template

        self._template_text = read_template(self.prompt_template, "prompt_template")
        return self

    @property
    def template_text(self) -> str | None:
        return self._template_text


JUDGED = ("judge", "deepeyes", "deepeyes_math", "deepeyes_common", "mini_o3")
"""The `free_form_match` rules that ask the LLM judge."""


class RewardConfig(BaseModel):
    """How a trajectory's parts add up to a reward: total = acc_w*accuracy + fmt_w*format + tool."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    accuracy_weight: float = 1.0
    """Weight of accuracy (1 right, 0 wrong) in the total."""
    format_weight: float = 0.0
    """Weight of the format reward (1, 0.5 or 0; see `format_reward`) in the total."""
    tool_bonus: float = 0.0
    """Added when the answer is right and the trajectory called the tool at least once (DeepEyes: 1.2)."""
    tool_call_penalty: float = Field(default=0.0, ge=0)
    """Subtracted per tool call beyond `free_tool_calls`."""
    free_tool_calls: int = Field(default=0, ge=0)
    """Tool calls that cost nothing before `tool_call_penalty` applies."""
    free_form_match: Literal["exact", "judge", "math", "mathruler", "r1v", "lmm_r1", "deepeyes", "deepeyes_math",
                             "deepeyes_common", "mini_o3", "pixel_reasoner", "pixelis"] = "exact"
    """Free-form answers: normalised exact match only; exact match then the LLM judge for the rest; or `math`,
    equal by value through math-verify (`\\frac{1}{2}` = 0.5, `\\boxed{60}` = 60), then exact match
    (`loupe.rewards.math_grading.math_equal`: R1-V's, LMM-R1's and Pixel-Reasoner's verifier); or `mathruler`,
    EasyR1's grader (`loupe.rewards.math_grading.grade_answer`: an integer reference needs an integer answer,
    fractions must be written alike), on the response's last `\\boxed{}` whether it answered or not; or `r1v`,
    R1-V's `accuracy_reward` on the whole final turn (`loupe.rewards.r1v.r1v_accuracy`), choice questions
    included; or `lmm_r1`, LMM-R1's math verifier server in process (`loupe.rewards.lmm_r1`), likewise; or
    `deepeyes`, DeepEyes' `compute_score` on the whole decoded response (`loupe.rewards.deepeyes`): the judge on
    the last `<answer>`'s text for every task, choice included, its format from tag counts, and its tool bonus
    for a right answer after at least one crop the tool returned (needs `judge` and `format_rule: deepeyes`);
    `deepeyes_math` and `deepeyes_common`, its scorers for ThinkLite and geoguessr rows (`compute_score_math`:
    the last `\\boxed{}` by math-verify, then the judge; `compute_common_reasoning`: the judge on the first
    `<answer>`; both need `judge`, DeepEyes' with `verdict: equivalence_or_zero` and `equivalence`); or
    `mini_o3`, Mini-o3's: the judge on the first `<answer>` across the assistant turns, for every task, choice
    included (`loupe.rewards.mini_o3`; needs `judge`); or `pixel_reasoner`, Pixel-Reasoner's rule on the whole
    decoded response, lowercased (`loupe.rewards.pixel_reasoner`): the last `\\boxed`, then `<answer>`, then
    the whole text through math-verify, 1 / 0, and -1 when nothing in it parses; or `pixelis`, Pixelis' task
    reward (`loupe.rewards.pixelis.task_reward`): 1 for the answer exactly as the solution is written, else half
    their `difflib` similarity."""
    failed_last_call_zeroes: bool = False
    """A right answer scores 0 when the trajectory's last tool call failed, i.e. its last turn given back was an
    error (Pixel-Reasoner's `final_error_flags`: a broken visual operation the model did not mend)."""
    format_rule: Literal["loupe", "r1v", "easyr1", "deepeyes", "lmm_r1"] = "loupe"
    """What the format part measures (see `format_reward`): `loupe` 1 / 0.5 / 0 for a clean answer / one without
    `<think>` or after format errors / none; `r1v` 1 when the final turn is exactly `<think>…</think>
    <answer>…</answer>` (R1-V's `format_reward`), else 0; `deepeyes` 0, or -1 after a format error (DeepEyes'
    `vl_agent.compute_score`); `lmm_r1` 1 for LMM-R1's think-then-answer shape (`loupe.rewards.lmm_r1`)."""
    upstream_bugs: Literal["reproduce", "fix"] = "reproduce"
    """Where a recipe's reward has a plain bug, `reproduce` trains on it as the recipe did and `fix` mends it.
    Covered: `lmm_r1` pays 1.0 for any answer when the reference does not parse (fix: exact match)."""
    choice_judge_fallback: bool = False
    """Choice questions: ask the judge when the letter cascade finds no letter (needs `judge`)."""
    judge: JudgeConfig | None = None
    """The LLM judge; required when `free_form_match` is `judge` or `choice_judge_fallback` is on."""
    judge_question: Literal["plain", "prompt"] = "plain"
    """The question the judge is shown: `plain`, the problem without image placeholders (the judge sees no
    image) and with its options listed; or `prompt`, the record's question turn as the model saw it, its
    `<image>` placeholders included (Mini-o3's `raw_prompt`, the user turn's content:
    verl/utils/dataset/multimodal_dataset.py:299-301, naive_multithreads_tool.py:97)."""
    by_data_source: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Reward settings for the tasks of one `data_source`, set over the ones above (verl's
    `default_compute_score` picks a scorer by data_source; DeepEyes scores its ThinkLite math rows with a math
    rule and its visual rows with the judge): `{thinklite: {free_form_match: math}}`. Each is validated as a
    whole RewardConfig; a `judge` of its own asks another prompt (or model) for those rows, else the judge
    above is asked."""
    _by_source: dict[str, RewardConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _judge_configured_when_used(self) -> RewardConfig:
        if self.free_form_match == "deepeyes" and self.format_rule != "deepeyes":
            raise ValueError("free_form_match: deepeyes scores DeepEyes' format too; set format_rule: deepeyes")
        if (self.free_form_match in JUDGED or self.choice_judge_fallback) and self.judge is None:
            raise ValueError(
                "judge: a judge section is required when free_form_match is 'judge' or choice_judge_fallback is on"
            )
        base = self.model_dump(exclude={"by_data_source"})
        for source, settings in self.by_data_source.items():
            if "by_data_source" in settings:
                raise ValueError(f"by_data_source.{source}: cannot hold a by_data_source of its own")
            try:
                self._by_source[source] = RewardConfig(**{**base, **settings})
            except ValidationError as err:
                reasons = "; ".join(".".join(str(p) for p in e["loc"]) + (": " if e["loc"] else "")
                                    + e["msg"].removeprefix("Value error, ") for e in err.errors())
                raise ValueError(f"by_data_source.{source}: {reasons}") from None
        return self

    @property
    def wants_judge(self) -> bool:
        """Whether any task, of any data source, may be sent to the judge."""
        own = self.free_form_match in JUDGED or self.choice_judge_fallback
        return own or any(cfg.wants_judge for cfg in self._by_source.values())

    @property
    def reads_response(self) -> bool:
        """Whether any task is scored on the whole decoded response (DeepEyes' and Pixel-Reasoner's rules), which
        then must be built."""
        own = self.free_form_match in ("deepeyes", "deepeyes_math", "deepeyes_common", "pixel_reasoner")
        return own or any(c.reads_response for c in self._by_source.values())

    def for_source(self, data_source: str | None) -> RewardConfig:
        """The settings that score a task of `data_source`: its `by_data_source` entry, or these."""
        return self._by_source.get(data_source or "", self)

    @classmethod
    def deepeyes(cls, **overrides: Any) -> RewardConfig:
        """DeepEyes' shape: 0.8 accuracy + 0.2 format (0, or -1 after a format error) + 1.2 when the tool was used
        and the answer is right (DeepEyes `verl/utils/reward_score/vl_agent.py`, `compute_score`)."""
        return cls(**{"accuracy_weight": 0.8, "format_weight": 0.2, "tool_bonus": 1.2, "format_rule": "deepeyes",
                      **overrides})

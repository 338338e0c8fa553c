"""Typed parameters: one model per `params.yaml` section, loaded and validated with clear errors.

`params.yaml` is the single source of truth. Each stage reads its own section plus the shared ones
(`seed`, `model`, `protocol`, `rollout`); an unknown or mistyped key fails with its dotted path named::

    params.yaml: eval.turn_limits.0: Input should be a valid integer

Every field carries a docstring (pydantic turns it into the field's description), so `loupe params --help`
style documentation and the comments in params.yaml come from one place.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from loupe.tools import IMAGE_FACTOR, QWEN_PROCESSOR_PIXELS, PixelBudget


class Section(BaseModel):
    """Base of every params section: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class ModelParams(Section):
    """Which model the pipeline starts from."""

    path: str = "work/models/tiny"
    """Hugging Face model directory of the base model. The default is the embedded tiny Qwen2.5-VL, which the
    `data` stage builds; point it at a local Qwen2.5-VL-7B-Instruct copy for real runs."""
    build_tiny: bool = True
    """Whether the data stage builds the embedded tiny model (at its `--tiny-model` folder, `work/models/tiny`,
    the default `path`). False for a run on another model: the folder then holds only a note saying so."""
    tiny_seed: int = 0
    """Seed of the tiny model's weights and tokenizer corpus."""
    tiny_text_hidden: int = Field(128, ge=32, multiple_of=32)
    """Width of the tiny model's language model, in heads of 32 (the smallest vLLM's CPU build runs; tests
    build the 64-wide default of loupe.models.tiny). 128 wide and 4 deep learns the zoom task's cold start; 64 x 2 does not (docs/learning.md)."""
    tiny_text_layers: int = Field(4, ge=1)
    """Depth of the tiny model's language model."""
    tiny_family: Literal["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"] = "qwen2_5_vl"
    """The tiny model's architecture (loupe.models.tiny): Qwen2.5-VL (the committed artefact's), Qwen3-VL,
    Qwen3-VL-MoE or Qwen3.5 (Gated DeltaNet layers), each with its own processor and crop grid."""
    tiny_perception_steps: int = Field(600, ge=0)
    """Steps of the tiny model's perception pretraining in the data stage (loupe.models.tiny_perception:
    naming the colour of a square in generic pictures, never a task's canvas), so the base model sees as a
    real base model does; 0 leaves it random. About 50 s on 2 cores."""
    tiny_artifact: str | None = "assets/tiny-model"
    """The tiny model built once and committed, with its files' hashes (loupe.models.tiny_artifact): the data
    stage copies it, checked by hash, when it was built with the tiny settings above, so the base model is the
    same on every CPU; with other settings, or null, the data stage builds and pretrains the model itself."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype when loading: `auto` is float32 on CPU and bfloat16 on GPU."""


class ProtocolParams(Section):
    """How the model talks and what it may see: shared by synth, rl and eval."""

    name: str = "mini_o3"
    """Protocol variant (loupe.protocol.PROTOCOLS): mini_o3 (Mini-o3's grammar and its own prompt strings), loupe
    (the same grammar in Loupe's wording), deepeyes, pixel_reasoner (its `<tool_call>` JSON and `\\boxed{}`
    answers), pixelis (every visual operation, `SEGMENT_OBJECT_AT(x=.., y=..)` calls: loupe/visual_ops.py),
    single_turn or boxed."""
    min_pixels: int = Field(3136, gt=0)
    """Smallest area (px) of an image shown to the model; crops are scaled up to it. Mini-o3: 40,000."""
    max_pixels: int = Field(50176, gt=0)
    """Largest area (px) of an image shown to the model; larger ones are scaled down. Mini-o3: 2,000,000."""
    max_turns: int = Field(6, ge=1)
    """Assistant turns allowed in training and synthesis (Mini-o3: 6); eval sets its own limit."""
    max_images: int = Field(12, ge=1)
    """Images a dialogue may hold (the question's included); a call past it ends the trajectory as over_turn."""
    max_context_tokens: int = Field(8192, ge=64)
    """Tokens a dialogue may hold; a turn that could overflow it ends the trajectory as over_turn."""
    model_len: int | None = Field(None, ge=64)
    """The engine's context length (vLLM's `max_model_len`): a turn's new tokens are capped at what is left of
    it, so a late turn can be cut (end reason `length`) before `max_new_tokens` (Mini-o3 and DeepEyes: 32,768:
    Mini-o3's vllm_async_engine.py:306-307, DeepEyes' vllm_rollout_spmd.py:146). None: no cap but
    `max_new_tokens` (the turn still starts only within `max_context_tokens`)."""
    format_error_retries: int = Field(1, ge=0)
    """The malformed-turn policy: error turns given back after malformed turns (or refused tool calls) before
    the trajectory ends as format_error. 0 ends at the first; a number at least `max_turns` answers every one
    and lets the dialogue go on to its turn limit (DeepEyes and Mini-o3 do so)."""
    turn_without_call: Literal["error_turn", "ends"] = "error_turn"
    """The other half of the malformed-turn policy: a malformed turn that holds no tool call (no answer, an
    unclosed or doubled answer, prose) gets an error turn like a broken call (`error_turn`), or ends the
    trajectory there as format_error, to be scored as it stands (`ends`: DeepEyes, Mini-o3 and Pixel-Reasoner
    treat any turn without a call as the last one)."""
    observation_template: str | None = None
    """The user turn that returns a crop, in place of the protocol's: `{image}` marks where the crop goes (once),
    `{index}` is its number and `{width}`, `{height}` its size as shown (DeepEyes: "<tool_response>{image}" + its USER_PROMPT_V2 + "</tool_response>")."""
    error_template: str | None = None
    """The user turn after a malformed turn, in place of the protocol's: `{error}` is why (DeepEyes: "Error: {error}")."""
    tool_extra_arguments: list[str] = Field(default_factory=list)
    """Tool-call argument names accepted and ignored besides the tool's own (DeepEyes' schema and example
    call carry an optional `label`, which its tool does not read)."""
    out_of_range_boxes: Literal["refuse", "clamp"] = "refuse"
    """A box reaching outside its image (beyond half a pixel, or 1e-3 of a relative side): refused with an error
    turn (`refuse`), or clamped onto the image and cut (`clamp`: DeepEyes' tool takes max(0, left) and
    min(width, right), visual_toolbox_v2.py `maybe_resize_bbox`)."""
    min_crop_side: int = Field(1, ge=1)
    """A crop whose shorter side, in pixels of the image it is cut from (the original; with `crop_cut: shown`
    the image shown), is below this is refused with an error turn (DeepEyes: 31, since its tool needs both
    sides above 30 px; Pixel-Reasoner: 29, above 28 px)."""
    crop_min_pixels: int | None = Field(None, gt=0)
    """Smallest area (px) of a crop shown to the model; None: `min_pixels` (Pixel-Reasoner: 3,136)."""
    crop_max_pixels: int | None = Field(None, gt=0)
    """Largest area (px) of a crop shown to the model; None: `max_pixels` (Pixel-Reasoner: 784,000, half its
    question image's 1,568,000)."""
    crop_padding: float = Field(0.0, ge=0.0, lt=1.0)
    """Widens every box on each side by this fraction of its source before the cut, then clamps it
    (Pixel-Reasoner: 0.1)."""
    crop_cut: Literal["composed", "whole_pixels", "shown", "rounded"] = "composed"
    """Whose pixels a crop is cut from (`loupe.tools.crop`): `composed` (Loupe: boxes composed in floats onto
    the full-resolution original, rounded outwards once), `whole_pixels` (Mini-o3: each observation kept at
    full resolution as cut, each box truncated to whole pixels with its far edge trimmed, level after level) or
    `shown` (Pixel-Reasoner: cut from the image as the model was shown it, the original resized into the budget
    and each crop as shown) or `rounded` (DeepEyes: each coordinate rounded as PIL's `Image.crop` rounds it, half
    to even, on the named source, and cut from the original's pixels; DeepEyes crops only the original, at full
    resolution: visual_toolbox_v2.py:87)."""
    crop_box_checks: Literal["cut", "box"] = "cut"
    """What `min_crop_side` and `max_crop_aspect` are checked on: the cut in whole pixels (`cut`), or the clamped
    box in floats before it is rounded (`box`: DeepEyes' `validate_bbox`, visual_toolbox_v2.py:129-139,147-148,
    where a side must be above 30 px, so [10.5, 10.5, 40.5, 40.5] is refused; a side must then exceed
    `min_crop_side` - 1)."""
    max_crop_aspect: float = Field(200.0, ge=1.0, le=200.0)
    """The most elongated box a crop may be, longer side over shorter (DeepEyes: 100, visual_toolbox_v2.py:135); at
    most 200, past which Qwen's processors refuse an image."""
    turn_reading: Literal["first_call", "deepeyes", "mini_o3"] = "first_call"
    """How a turn with tool calls is generated and read: `first_call` (Loupe's) stops generation at a
    call's closing tag and reads that call, a call beside an answer being an error turn; `deepeyes` generates to
    the end of the turn with no stop string (parallel_env.py:121-126, ppo_trainer.yaml:128 `custom_stop: []`),
    a non-empty last `<answer>` ends the episode and no call runs, else the last call is read
    (visual_toolbox_v2.py:26-28,43-44,60-65), an empty last call ending it too and argument keys its tool does not
    read being ignored (:63-65,75-81); `mini_o3` stops at the call's closing tag like `first_call`, but a turn
    holding a call span is a call whatever else it holds (an `<answer>` beside it included: the call runs), and the
    call is read as Mini-o3 reads it (vllm_async_engine.py:523-526, function_tools.py:30-50): its pattern
    `.*<grounding>{"bbox_2d": (.*),.*"source": [',"](.*)[',"]}</grounding>`, the box evaluated as Python
    arithmetic (never run as code: `loupe.protocol.box_expression`), a source name matched by its
    `observation_N` prefix."""
    crop_resample: Literal["bicubic", "mini_o3"] = "bicubic"
    """How a crop is resized for the model (`loupe.tools.fit_crop`): `bicubic`, straight to Qwen's size for the
    budget; `mini_o3`, Mini-o3's `process_image` first (NEAREST into [min_pixels, max_pixels], small sides up to
    28 px; vllm_async_engine.py:189-223,551), then the processor's bicubic resize of that within the processor's
    own bounds (`processor_min_pixels`, `processor_max_pixels`; `:433`, verl/workers/actor/dp_actor.py:262)."""
    image_resample: Literal["bicubic", "mini_o3"] = "bicubic"
    """How the question's image is resized for the model: `bicubic`, straight to Qwen's size for the budget
    (`smart_resize`); `mini_o3`, Mini-o3's dataset `process_image` first (LANCZOS into [min_pixels, max_pixels]
    with whole sides, no grid; verl/utils/dataset/multimodal_dataset.py:79-113,231-238), then the processor's
    resize of that within the processor's own bounds (`processor_min_pixels`, `processor_max_pixels`)."""
    processor_min_pixels: int | None = Field(None, gt=0)
    """The smallest area the model's image processor resizes to. None: the processor's own, read by the engine
    that runs the model (Qwen2.5-VL's: 3,136; without a model, that). Only the `mini_o3` resamplings use it: there
    the processor's resize follows Mini-o3's own, within the processor's bounds, not [min_pixels, max_pixels]."""
    processor_max_pixels: int | None = Field(None, gt=0)
    """The largest area the model's image processor resizes to; None: the processor's own (Qwen2.5-VL's:
    12,845,056). Read with `processor_min_pixels`."""
    call_at_limit: Literal["parsed", "matched"] = "parsed"
    """A turn that calls a tool when no turn or image is left: over-turn when its call parses, a malformed one a
    format error (`parsed`); or over-turn whenever it holds a complete call span, parsed or not (`matched`:
    Mini-o3 checks `<grounding>(.*?)</grounding>` before reading it, vllm_async_engine.py:698-706)."""
    max_decode_pixels: int = Field(400_000_000, gt=0)
    """Source images larger than this are refused before decoding (decompression-bomb guard)."""
    video_max_frames: int = Field(8, ge=1)
    """A video task's frame budget: at most this many frames, spread evenly over the clip (first and last
    included), shown as the question's images (`loupe.video.read_clip`). Pixel-Reasoner's video prompts hold 16."""
    video_max_pixels: int | None = Field(None, gt=0)
    """A video task's pixel budget for all its frames together: each frame is resized into
    `min(max_pixels, video_max_pixels / frames)` (not below `min_pixels`); None gives each frame `max_pixels`."""
    image_factor: int | None = Field(None, ge=1)
    """The model's image grid in pixels (patch x merge: 28 for Qwen2-VL and Qwen2.5-VL, 32 for Qwen3-VL and
    Qwen3.5): the sides of every image and crop the model is shown are multiples of it, so its processor never
    resizes them again. None: the model's own, read from its processor by the engine that runs it (a teacher
    without a model, the oracle's or an endpoint's, uses 28); set it for a cold start written by such a teacher
    for a model of another grid. A value the model's processor contradicts stops the run."""
    prompt_template: str | None = None
    """A Jinja file that renders the question turn (a recipe's prompt: R1-V's "Output the thinking process in
    <think> </think> ..." suffix, EasyR1's `format_prompt`); it sees `content` (the question as the protocol
    writes it, image placeholders and options included: EasyR1's variable), `problem`, `options` and `task`
    (the record). None: the protocol's own question turn. Read once, when the params are loaded."""
    system_prompt: str | None = None
    """Replaces the protocol's system prompt (a recipe's own, e.g. LMM-R1's); None keeps the protocol's."""
    record_prompts: bool = True
    """Whether a task record's own system prompt and question turn (`system`, `prompt`: a publisher's chat rows
    as `loupe data import` keeps them, DeepEyes' and LMM-R1's) are shown verbatim, as upstream trains on them,
    instead of `system_prompt` and the protocol's question turn (with `prompt_template`). Records without them
    are rendered the protocol's way either way."""
    _template_text: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _budget_is_consistent(self) -> ProtocolParams:
        self.budget  # raises ValueError on a bad pair
        from loupe.protocol import PROTOCOLS

        if self.name not in PROTOCOLS:
            raise ValueError(f"name: unknown protocol {self.name!r}; known: {', '.join(sorted(PROTOCOLS))}")
        if self.turn_reading == "mini_o3" and self.name not in ("mini_o3", "loupe"):
            raise ValueError(f"turn_reading: mini_o3 reads Mini-o3's <grounding> calls; protocol {self.name!r} has "
                             "none (use it with protocol mini_o3 or loupe)")
        return self

    @model_validator(mode="after")
    def _turn_templates_fit(self) -> ProtocolParams:
        for name, fields in (("observation_template", {"image": "<image>", "index": 1, "width": 1, "height": 1}),
                             ("error_template", {"error": "x"})):
            text = getattr(self, name)
            if text is None:
                continue
            try:
                text.format(**fields)
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"{name}: {err!r}; the fields are {', '.join('{' + f + '}' for f in fields)} "
                                 "(double a literal brace: {{ }})") from None
        if self.observation_template is not None and self.observation_template.count("{image}") != 1:
            raise ValueError("observation_template: must hold {image} exactly once, where the crop goes")
        return self

    @model_validator(mode="after")
    def _template_is_readable(self) -> ProtocolParams:
        if self.prompt_template is None:
            return self
        from loupe.protocol import read_template

        self._template_text = read_template(self.prompt_template, "prompt_template")
        return self

    @property
    def template_text(self) -> str | None:
        """The prompt template's text (read when the params were loaded, so actors need not find the file)."""
        return self._template_text

    @property
    def budget(self) -> PixelBudget:
        return self._budget(self.max_pixels)

    def frame_budget(self, frames: int) -> PixelBudget:
        """The pixel budget of each of a video task's `frames` frames (`video_max_pixels` shared among them)."""
        if self.video_max_pixels is None:
            return self.budget
        return self._budget(max(self.min_pixels, min(self.max_pixels, self.video_max_pixels // max(frames, 1))))

    def _budget(self, max_pixels: int) -> PixelBudget:
        processor = None
        if self.processor_min_pixels is not None or self.processor_max_pixels is not None:
            processor = (self.processor_min_pixels or QWEN_PROCESSOR_PIXELS[0],
                         self.processor_max_pixels or QWEN_PROCESSOR_PIXELS[1])
        return PixelBudget(
            self.min_pixels, max_pixels, self.min_crop_side, self.crop_min_pixels, self.crop_max_pixels,
            self.crop_padding, self.crop_cut, self.crop_resample, self.image_factor or IMAGE_FACTOR,
            image_resample=self.image_resample, processor_pixels=processor, crop_box_checks=self.crop_box_checks,
            max_crop_aspect=self.max_crop_aspect,
        )


class OpenAIEndpointParams(Section):
    """An OpenAI-compatible chat endpoint (a vLLM server, a hosted model)."""

    # A key pasted into `api_key_env` by mistake must not be echoed back in the validation error.
    model_config = ConfigDict(hide_input_in_errors=True)

    base_url: str = "http://127.0.0.1:8000/v1"
    """The endpoint's base URL, up to and including /v1."""
    model: str = "default"
    """Model name sent with each request."""
    api_key_env: str | None = Field("OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the API key (the key itself never goes in params). If it is
    unset or empty, building the engine fails naming it; null sends no key, for a server started without one
    (a local vLLM without --api-key)."""
    concurrency: int = Field(8, ge=1)
    """Requests in flight at once."""
    max_retries: int = Field(5, ge=0)
    """Retries after the first attempt on 408/409/429/5xx, time-outs, dropped connections and malformed HTTP 200
    replies (loupe.endpoint), before the request fails."""
    backoff_s: float = Field(0.5, ge=0)
    """First wait between attempts; each later one doubles, with +-50% jitter, and is at least Retry-After."""
    max_backoff_s: float = Field(8.0, ge=0)
    """Cap on one exponential wait between attempts; a server's Retry-After (up to two minutes) is obeyed."""
    timeout_s: float = Field(120.0, gt=0)
    """Seconds one request may take."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Fields added to every request's body, for a server's own options: `{loupe: {loop: false}}` makes
    `loupe serve` answer one turn at a time, so this engine's loop drives it like any endpoint (docs/serve.md)."""


class RolloutParams(Section):
    """The multi-turn loop's engine and sampling settings, shared by synth, rl and eval."""

    engine: Literal["transformers", "vllm", "openai"] = "transformers"
    """Who generates: transformers (CPU or GPU), vllm (GPU, or vLLM's CPU build: `make vllm-venv`) or an
    OpenAI-compatible endpoint."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy. The RL learner scores every token at this temperature."""
    later_turn_temperature: float | None = Field(None, ge=0)
    """Sampling temperature of every assistant turn after a dialogue's first (Pixel-Reasoner: 0.9 after 1.0,
    experience_maker.py); None: `temperature` throughout. Sampling only: the learner still scores at
    `temperature`, as Pixel-Reasoner's OpenRLHF actor does, so RL needs `logprob_source: recompute`."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Sample among the k likeliest tokens only; 0 is off (R1-V's trl trainer samples with transformers'
    default top_k 50). Log-probs stay those of the untruncated distribution, which the learner recomputes."""
    max_new_tokens: int = Field(256, ge=1)
    """New tokens one assistant turn may generate; a turn that reaches it ends the trajectory as `length`."""
    batch_size: int = Field(64, ge=1)
    """Turns decoding together in the transformers engine's running batch (rows leave as their turns end and waiting
    turns join)."""
    device: str = "auto"
    """Torch device for the transformers engine: auto (cuda when present), cpu or cuda:N."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """vLLM's share of GPU memory."""
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype inside the vllm engine (vLLM's `dtype`): auto is the checkpoint's on GPU and bfloat16 on
    vLLM's CPU build. The learner sends its weights cast to it at every sync."""
    openai: OpenAIEndpointParams = OpenAIEndpointParams()
    """Endpoint settings for the openai engine."""


Params = TypeVar("Params", bound=Section)


class ParamsError(ValueError):
    """A params file or section that does not validate; the message names the file and the key path."""


def _format_errors(source: str, prefix: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join([prefix, *(str(p) for p in e["loc"])]) if prefix else ".".join(str(p) for p in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {path or '(root)'}: {message}")
    return "\n".join(lines)


def read_params_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of sections")
    return data


def parse_section(model: type[Params], data: Any, name: str, source: str = "params.yaml") -> Params:
    """Validate one section's mapping; errors carry `source: name.key.path: message`."""
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as err:
        raise ParamsError(_format_errors(source, name, err)) from None


def load_section(model: type[Params], name: str, path: str | Path = "params.yaml") -> Params:
    """Read `path` and validate section `name` (a dotted name reaches a nested mapping)."""
    data: Any = read_params_file(path)
    for part in name.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return parse_section(model, data, name, str(path))


def load_seed(path: str | Path = "params.yaml") -> int:
    seed = read_params_file(path).get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ParamsError(f"{path}: seed: must be an integer, got {seed!r}")
    return seed


# --- overrides on the command line ------------------------------------------------------------------------------

OVERRIDES_ENV = "LOUPE_PARAMS_OVERRIDES"
"""Environment variable holding the `key.path=value` overrides of the run in progress, space-separated: the
stages' MLflow runs record it as the tag `loupe.overrides` (loupe/tracking.py), whichever process they run in."""


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """`rl.kl.coef=0.01` -> (("rl", "kl", "coef"), 0.01). The value is read as YAML, as in the file, except that
    a number written `1e-6` is a number (PyYAML's YAML 1.1 reads it as a string; verl's and OpenRLHF's users
    write it so)."""
    key, sep, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise ParamsError(f"override {text!r}: expected key.path=value, e.g. rl.lr=1e-6")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ParamsError(f"override {text!r}: the value is not valid YAML ({err})") from None
    if isinstance(value, str):
        for number in (int, float):
            try:
                return parts, number(raw.strip())
            except ValueError:
                pass
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str = "params.yaml") -> dict[str, Any]:
    """A copy of `data` with each `key.path=value` set (missing mappings created); the sections they touch are
    validated by whoever reads them, like the file's own values."""
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ParamsError(f"{source}: override {text!r}: {'.'.join(parts[:depth + 1])} is "
                                  f"{type(child).__name__}, not a section")
            node = child
        node[parts[-1]] = value
    return out


def params_with_overrides(params_path: str | Path, overrides: list[str]) -> Path:
    """`params_path` with `overrides` applied, written to a fresh file (its name says so, for error messages),
    and the overrides added to `OVERRIDES_ENV` for the stage's MLflow run; `params_path` itself when there are
    none. The stages' `python -m stages.<name> ... key.path=value` goes through here."""
    if not overrides:
        return Path(params_path)
    data = apply_overrides(read_params_file(params_path), overrides, str(params_path))
    folder = Path(tempfile.mkdtemp(prefix="loupe-params-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the stage's process reads it, then it goes
    target = folder / f"{Path(params_path).stem}+overrides.yaml"
    target.write_text(f"# {params_path} with {' '.join(overrides)}\n" + yaml.safe_dump(data, sort_keys=False))
    os.environ[OVERRIDES_ENV] = " ".join([*filter(None, [os.environ.get(OVERRIDES_ENV, "")]), *overrides])
    return target

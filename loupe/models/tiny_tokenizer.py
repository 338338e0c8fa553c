"""The tiny model's text side: Qwen's special tokens, a BPE trained on protocol text, the chat template.

The tokenizer is a byte-level BPE trained here, offline, with the `tokenizers` library on a corpus generated
from the protocols' own texts (system prompts, observation and error turns, rendered tool calls and answers,
JSON with many numbers, option lines, colour and shape words), so protocol text tokenises compactly and
decodes back exactly. It uses Qwen2's own normaliser and pre-tokenizer split and is wrapped as
`Qwen2TokenizerFast`, with Qwen2.5-VL's 14 special tokens given ids right after the learned vocabulary.

The chat template renders Qwen2.5-VL's chat layout, so the rollout loop (through
`processor.apply_chat_template`), LLaMA-Factory's `qwen2_vl` template (SFT) and vLLM agree on every token.
Per turn::

    <|im_start|>{role}\n{content}<|im_end|>\n

where content is a string, or a list of parts: text parts are written as they are, image parts as
`<|vision_start|><|image_pad|><|vision_end|>` (the processor then repeats `<|image_pad|>` once per merged
patch) and video parts likewise with `<|video_pad|>`. A conversation without a system turn gets the default
system prompt "You are a helpful assistant.", and `add_generation_prompt` appends `<|im_start|>assistant\n`.

Everything is deterministic in the seed: the corpus comes from `random.Random(seed)`, and the `tokenizers` BPE
trainer orders equally frequent pairs by the pair itself, not by hash order, so the same seed gives the same
tokenizer.json in any process (tests/test_tiny_model.py checks the bytes).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Whitespace control (`{%-`, `-%}`) strips every newline between tags, so the only newlines rendered are
# the explicit '\n' strings: the output is exactly the layout above, whatever the template's indentation.
_DEFAULT_SYSTEM_TURN = (
    "    {%- if loop.first and message['role'] != 'system' -%}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}\n"
    "    {%- endif -%}\n"
)
CHAT_TEMPLATE_BODY = (
    "    {{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{- message['content'] -}}\n"
    "    {%- else -%}\n"
    "        {%- for part in message['content'] -%}\n"
    "            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}\n"
    "                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "            {%- elif part['type'] == 'video' or 'video' in part -%}\n"
    "                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "            {%- elif 'text' in part -%}\n"
    "                {{- part['text'] -}}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)


def chat_template(default_system: bool = True) -> str:
    """The template, with Qwen2.5-VL's default system turn when a dialogue opens without one (`default_system`)
    or without it, as Qwen3-VL's and Qwen3.5's templates."""
    loop = "{%- for message in messages -%}\n"
    return loop + (_DEFAULT_SYSTEM_TURN if default_system else "") + CHAT_TEMPLATE_BODY


CHAT_TEMPLATE = chat_template(True)
"""Qwen2.5-VL's layout: the tiny Qwen2.5-VL's template (and the tokenizer's own)."""

# Qwen2.5-VL's special tokens in Qwen's order; they get ids right after the learned BPE vocabulary.
PAD_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = (
    PAD_TOKEN,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    "<|vision_pad|>",
    IMAGE_PAD,
    VIDEO_PAD,
)

# Qwen2's pre-tokenizer split (GPT-4 style, digits one at a time). Training with the very split the
# Qwen tokenizer class uses keeps the learned merges valid however transformers rebuilds the tokenizer.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VOCAB_SIZE = 2048
"""The tokenizer's full size, special tokens included (when the corpus holds enough merges to fill it)."""
BPE_VOCAB_SIZE = VOCAB_SIZE - len(SPECIAL_TOKENS)
"""Learned tokens: 256 byte symbols plus merges."""


_COLOURS = tuple("red green blue yellow orange purple pink brown black white grey gray cyan magenta".split())
_SHAPES = tuple("circle square triangle star diamond cross hexagon".split())
_PLACES = tuple(
    "left right above below top bottom centre center corner middle top-left top-right bottom-left bottom-right "
    "upper lower".split()
)
_SIZES = ("small", "large", "tiny", "big")
# Everyday words for questions and reasoning about pictures, so free text tokenises into whole words too.
_WORDS = tuple(
    """
the a an is are was be of in on at to from by with for and or but not no yes which what where who how many
much this that these those there here it its each every one two three four five six seven eight nine ten
colour color shape object image picture photo region area part side edge zoom look see find search check
target answer question option letter closer detail small text number sign word label person people car bus
tree house window door building road street table chair cup bottle book phone clock bag box ball dog cat
bird flower sky water grass light dark bright front back behind next near far inside outside between under
over wear holding sitting standing first second third last final then now again because so must might
could should think seems appears likely clearly visible hidden blurry unreadable higher resolution original
observation action crop view whole scene background foreground count total left right above below
""".split()
)


CORPUS_PROTOCOLS = ("deepeyes", "loupe", "mini_o3", "single_turn")
"""The protocols whose texts train the tokenizer: a fixed list, not every registered protocol, so adding one
(the `boxed` protocol of EasyR1's recipe) changes neither the embedded model nor its measured learning curve
(docs/learning.md). `boxed` speaks single_turn's words plus `\\boxed{}`, which byte-level BPE spells anyway."""


def _protocol_texts(rng: random.Random) -> Iterator[str]:
    """Everything the protocols say or expect: prompts, observation and error turns, rendered calls/answers."""
    from loupe.protocol import FormatError, FormatErrorKind, ToolCall, get_protocol

    for name in CORPUS_PROTOCOLS:
        protocol = get_protocol(name)
        yield protocol.system_prompt()
        if protocol.multi_turn:
            for index in range(1, 33):
                yield protocol.observation_text(index)
        # Real error details, from feeding each protocol the kinds of broken turns models write.
        open_tag, close_tag = protocol.call_open or "<grounding>", protocol.call_close or "</grounding>"
        broken_turns = (
            "I think it is red.",
            "<answer></answer>",
            "<answer>B</answer> trailing",
            f"{open_tag}{{not json{close_tag}",
            f"{open_tag}[1, 2]{close_tag}",
            f'{open_tag}{{"bbox_2d": [0.5, 0.5, 0.2, 0.9], "source": "original_image"}}{close_tag}',
            f'{open_tag}{{"bbox_2d": [0.5, 0.5, 1.2, 0.9], "source": "original_image"}}{close_tag}',
            f'{open_tag}{{"bbox_2d": [0.1, 0.2, 0.3, 0.4], "source": "observation_7"}}{close_tag}',
            f'{open_tag}{{"bbox_2d": [0.1, 0.2, 0.3]}}{close_tag}',
            f'{open_tag}{{"source": "original_image"}}{close_tag}',
            f'{open_tag}{{"bbox_2d": [0.1, 0.2, 0.3, NaN], "source": "original_image"}}{close_tag}',
            f'{open_tag}{{"name": "other_tool", "arguments": {{}}}}{close_tag}',
            f"{open_tag}{{}}{close_tag}{open_tag}{{}}{close_tag}",
            f"{open_tag}{{}}",
            f"{open_tag}{{}}{close_tag}<answer>A</answer>",
        )
        errors = [protocol.parse(turn, num_observations=2).error for turn in broken_turns]
        errors += [FormatError(kind, kind.value.replace("_", " ")) for kind in FormatErrorKind]
        for error in errors:
            if error is not None:
                yield protocol.error_text(error)
        for _ in range(40):
            think = _think_sentence(rng)
            try:
                yield protocol.render_call(think, ToolCall("crop", _random_call_arguments(rng)))
            except NotImplementedError:  # a protocol without tools
                pass
            yield protocol.render_answer(think, rng.choice((_option_letter(rng), rng.choice(_COLOURS))))


def _option_letter(rng: random.Random) -> str:
    return chr(ord("A") + rng.randrange(26))


def _random_box(rng: random.Random) -> list[float]:
    x0, x1 = sorted(rng.random() for _ in range(2))
    y0, y1 = sorted(rng.random() for _ in range(2))
    return [x0, y0, x1, y1]


def _random_call_arguments(rng: random.Random) -> dict[str, Any]:
    source = "original_image" if rng.random() < 0.5 else f"observation_{rng.randrange(1, 12)}"
    if rng.random() < 0.5:
        return {"bbox_2d": _random_box(rng), "source": source, "frame": "relative"}
    return {
        "bbox_2d": [v * rng.choice((640, 1024, 2048, 4096)) for v in _random_box(rng)],
        "source": "original_image",
        "frame": "absolute",
    }


def _think_sentence(rng: random.Random) -> str:
    colour, shape, place = rng.choice(_COLOURS), rng.choice(_SHAPES), rng.choice(_PLACES)
    templates = (
        f"The {colour} {shape} should be in the {place} part of the image. I will zoom in there.",
        f"I cannot see the {shape} clearly; it may be {place} of the {rng.choice(_COLOURS)} {rng.choice(_SHAPES)}.",
        f"Observation {rng.randrange(1, 12)} shows a {rng.choice(_SIZES)} {colour} {shape} at the {place}.",
        f"The target is not where I expected. Look at the {place} instead.",
        f"The {shape} is {colour}, so the answer is ({_option_letter(rng)}).",
    )
    return rng.choice(templates)


def _question_lines(rng: random.Random) -> Iterator[str]:
    colour, shape, place = rng.choice(_COLOURS), rng.choice(_SHAPES), rng.choice(_PLACES)
    yield rng.choice(
        (
            f"What is the colour of the {shape}?",
            f"Which shape is {place} the {colour} {shape}?",
            f"Is the {colour} {shape} on the left or right side of the image?",
            f"What colour is the {rng.choice(_SIZES)} {shape} in the {place} corner?",
            f"How many {colour} {shape}s are there?",
        )
    )
    yield "Options:"
    for index in range(rng.randrange(2, 6)):
        yield f"({chr(ord('A') + index)}) {rng.choice(_COLOURS + _SHAPES + _PLACES)}"
    yield "Answer with the option's letter."
    yield f"The answer is ({_option_letter(rng)}). The answer is {rng.choice(_COLOURS)}."


def _number_lines(rng: random.Random) -> Iterator[str]:
    # JSON exactly as json.dumps writes it, as the protocols render calls, with many numbers.
    box = [round(v, rng.choice((1, 2, 3))) for v in _random_box(rng)]
    yield json.dumps({"bbox_2d": box, "source": rng.choice(("original_image", f"observation_{rng.randrange(12)}"))})
    yield json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [rng.randrange(4096) for _ in range(4)]}})
    yield " ".join(str(rng.randrange(10 ** rng.randrange(1, 5))) for _ in range(8))
    yield " ".join(_random_letters(rng) for _ in range(6))


def _random_letters(rng: random.Random) -> str:
    return "".join(chr(ord("A") + rng.randrange(26)) for _ in range(rng.randrange(1, 4)))


def training_corpus(seed: int) -> list[str]:
    """The tokenizer's training text: deterministic in `seed`, covering the protocol vocabulary."""
    rng = random.Random(seed)
    tags = ("think", "answer", "grounding", "tool_call", "tool_response")
    # Fixed text repeats so each of its words is frequent enough (min_frequency) to become whole tokens.
    fixed = [DEFAULT_SYSTEM_PROMPT, "system\n", "user\n", "assistant\n", "<image>", "The answer is"]
    fixed += [f"<{tag}></{tag}>" for tag in tags]
    fixed += [
        " ".join(_COLOURS),
        " ".join(_SHAPES),
        " ".join(_PLACES),
        " ".join(_WORDS),
        "0123456789",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "abcdefghijklmnopqrstuvwxyz",
    ]
    lines = fixed * 8 + list(_protocol_texts(rng)) * 2
    for _ in range(600):
        lines += _question_lines(rng)
        lines += _number_lines(rng)
        lines.append(" ".join(rng.choice(_WORDS + _COLOURS + _SHAPES + _PLACES) for _ in range(12)))
    return lines


def train_tokenizer(seed: int = 0, vocab_size: int = BPE_VOCAB_SIZE):
    """A byte-level BPE over Qwen2's pre-tokenizer, wrapped as `Qwen2TokenizerFast` with Qwen's special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2TokenizerFast

    # The same normaliser, split and byte mapping as `Qwen2TokenizerFast.__init__` builds, because on reload
    # transformers keeps only the vocabulary and merges from tokenizer.json and rebuilds the rest.
    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, so nothing is ever unknown
    )
    corpus = training_corpus(seed)
    bpe.train_from_iterator(corpus, trainer, length=len(corpus))
    model = json.loads(bpe.to_str())["model"]
    learned = len(model["vocab"])
    # Passing the special tokens with their ids makes transformers add them in Qwen's order right after the
    # learned vocabulary (otherwise it adds eos/unk/pad first, in its own attribute order).
    added_tokens = {
        learned + i: AddedToken(token, special=True, normalized=False) for i, token in enumerate(SPECIAL_TOKENS)
    }
    tokenizer = Qwen2TokenizerFast(
        vocab=model["vocab"],
        merges=[tuple(pair) for pair in model["merges"]],
        unk_token=PAD_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        added_tokens_decoder=added_tokens,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, IM_END)],
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must give back text exactly
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )
    for token_id, token in added_tokens.items():
        got = tokenizer.convert_tokens_to_ids(token.content)
        if got != token_id:  # a transformers change in how added tokens are numbered; fail loudly
            raise RuntimeError(f"special token {token.content} got id {got}, expected {token_id}")
    return tokenizer

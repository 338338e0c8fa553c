"""The `transformers` engine: batched multi-turn generation with any Hugging Face VLM, on CPU or GPU.

Token-in/token-out: the prompt is rendered with the model's chat template once; after that every turn is
appended as tokens. A user turn's markup (closing the assistant turn, opening the user turn, the image
markers, opening the next assistant turn) is learnt from the chat template itself at start-up by rendering
two small dialogues and taking their difference, so no model's template is hard-coded here.

All live dialogues of a round go through one `generate` call per `batch_size` chunk: rows are left-padded,
and the images of every row are concatenated in row order, which is how Qwen2-VL-family models batch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from loupe.protocol import IMAGE_PLACEHOLDER, split_on_images
from loupe.rollout.engine import Engine, Generation, TokenTrace

_MARK = "\x00LOUPE\x00"


@dataclass(frozen=True)
class TurnMarkup:
    """Text the chat template puts around a user turn once the dialogue has started."""

    close_assistant: str
    """What follows an assistant message's text (e.g. '<|im_end|>\\n')."""
    user_prefix: str
    """From the start of a user turn to its content (e.g. '<|im_start|>user\\n')."""
    user_suffix: str
    """From the end of the user content through the next assistant turn's opening."""
    image: str
    """How one image renders inside a message (e.g. '<|vision_start|><|image_pad|><|vision_end|>')."""


def learn_turn_markup(processor: Any) -> TurnMarkup:
    """Derive the per-turn markup from the processor's chat template."""

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(t: str) -> dict[str, Any]:
        return {"type": "text", "text": t}

    base = [
        {"role": "system", "content": [text("S")]},
        {"role": "user", "content": [text("Q")]},
        {"role": "assistant", "content": [text(_MARK)]},
    ]
    closed = render(base, False)
    close_assistant = closed[closed.rindex(_MARK) + len(_MARK) :]
    extended = render(base + [{"role": "user", "content": [text(_MARK)]}], True)
    if not extended.startswith(closed):
        raise ValueError("the chat template re-renders earlier turns; token-in/token-out needs a prefix-stable template")
    user_prefix, user_suffix = extended[len(closed) :].split(_MARK)
    with_image = render(base + [{"role": "user", "content": [{"type": "image"}, text(_MARK)]}], True)
    image = with_image[len(closed) + len(user_prefix) : with_image.rindex(_MARK)]
    if not image:
        raise ValueError("the chat template renders no image marker")
    return TurnMarkup(close_assistant, user_prefix, user_suffix, image)


@dataclass
class _State:
    trace: TokenTrace
    last_finish: str = ""

    @property
    def pixel_values(self) -> list[torch.Tensor]:
        return self.trace.extras.setdefault("pixel_values", [])

    @property
    def grid_thw(self) -> list[torch.Tensor]:
        return self.trace.extras.setdefault("image_grid_thw", [])


class TokenContextEngine(Engine):
    """Keeps each dialogue as token ids built with a Hugging Face processor; subclasses generate.

    The ids hold each image's placeholder already expanded to its patch count, exactly as the model's
    forward pass (and the RL learner) consumes them.
    """

    def __init__(self, processor: Any, stop: tuple[str, ...], temperature: float, top_p: float, batch_size: int):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.stop = tuple(stop)
        self.temperature = temperature
        self.top_p = top_p
        self.batch_size = batch_size
        self.markup = learn_turn_markup(processor)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        end_ids = {self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        end_ids.add(self.tokenizer.eos_token_id)
        self.end_ids = sorted(i for i in end_ids if isinstance(i, int) and i >= 0 and i != self.tokenizer.unk_token_id)
        self._last_prompt: tuple | None = None
        # A sampled image or video marker would claim an image that does not exist: the next turn's forward
        # pass fails ("image features and image tokens do not match"). No engine lets the model write them.
        markers = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        ids = {self.tokenizer.convert_tokens_to_ids(m) for m in markers}
        self.suppressed = sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != self.tokenizer.unk_token_id)

    # --- building the context -------------------------------------------------------------------------------

    def _encode(self, text: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        if images:
            batch = self.processor(text=[text], images=images, return_tensors="pt")
            return batch["input_ids"][0].tolist(), batch["pixel_values"], batch["image_grid_thw"]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], None, None

    def begin(self, system: str, question: str, images: list[Image.Image]) -> _State:
        # The K samples of a task start from the same prompt: encode it once (the processor call is the
        # costly part of a small model's first turn), then give each sample its own copy.
        key = (system, question, tuple(id(image) for image in images))
        if self._last_prompt is None or self._last_prompt[0] != key:
            messages = [
                {"role": "system", "content": [{"type": "text", "text": system}]},
                {"role": "user", "content": split_on_images(question, images)},
            ]
            prompt = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            self._last_prompt = (key, self._encode(prompt, images), list(images))
        _, (ids, pixels, grid), kept_images = self._last_prompt
        state = _State(TokenTrace(images=list(kept_images)))
        state.trace.append(ids, generated=False)
        if pixels is not None:
            state.pixel_values.append(pixels)
            state.grid_thw.append(grid)
        return state

    def add_user_turn(self, state: _State, text: str, images: list[Image.Image]) -> None:
        close = self.markup.close_assistant
        if state.last_finish == "eos":
            # The model already wrote its end-of-turn token; only what follows it is still missing.
            eos_text = self.tokenizer.decode(state.trace.input_ids[-1:])
            close = close[len(eos_text) :] if close.startswith(eos_text) else close
        body = text.replace(IMAGE_PLACEHOLDER, self.markup.image)
        ids, pixels, grid = self._encode(close + self.markup.user_prefix + body + self.markup.user_suffix, images)
        state.trace.append(ids, generated=False)
        state.trace.images += images
        if pixels is not None:
            state.pixel_values.append(pixels)
            state.grid_thw.append(grid)

    def context_length(self, state: _State) -> int:
        return len(state.trace)

    def trace(self, state: _State) -> TokenTrace:
        return state.trace

    # --- weights from the learner (loupe.rollout.weight_sync) -------------------------------------------------

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the learner's weight-sync group as `rank` (this engine's first rank)."""
        raise NotImplementedError(f"the {self.name} engine cannot take weights from a learner")

    def receive_weights(self, manifest: list) -> int:
        """Receive one broadcast of the policy (`manifest`'s buckets) and load it; returns the tensors loaded."""
        raise NotImplementedError(f"the {self.name} engine cannot take weights from a learner")

    def sleep(self) -> None:
        """Give the device's memory back while a colocated learner updates (engines that hold any)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` gave (["weights"] before a weight sync, ["kv_cache"] after it, None for all)."""

    def weights_format(self) -> tuple[str, str]:
        """(dtype, device type) of the engine's weights: the learner sends floating tensors in that dtype, and
        over NCCL when both sides are on CUDA."""
        raise NotImplementedError

    def weights_digest(self) -> str:
        """A hash of the engine's weights (tests compare it with the learner's)."""
        raise NotImplementedError

    def _record(self, state: _State, ids: list[int], logprobs: list[float], finish: str) -> Generation:
        state.trace.append(ids, generated=True, logprobs=logprobs)
        state.last_finish = finish
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(text=text, finish=finish, num_tokens=len(ids))


class TransformersEngine(TokenContextEngine):
    """Generates with `model.generate`; keeps each dialogue's ids, generated-token mask and log-probs."""

    name = "transformers"

    def __init__(
        self,
        model: Any,
        processor: Any,
        stop: tuple[str, ...] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 64,
        seed: int = 0,
    ):
        super().__init__(processor, stop, temperature, top_p, batch_size)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        # Qwen2-VL-family models place image tokens with 3D (mrope) positions only when told which tokens are
        # image tokens; without it generation silently falls back to 1D positions, unlike training and vLLM.
        self.image_token_id = getattr(model.config, "image_token_id", None)
        self.types_image_tokens = "mm_token_type_ids" in inspect.signature(model.forward).parameters
        torch.manual_seed(seed)
        self.sync_group: Any = None

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        from loupe.rollout.weight_sync import SyncGroup

        self.sync_group = SyncGroup(host, port, rank, world_size, backend, timeout_s, self.device)

    def receive_weights(self, manifest: list) -> int:
        from loupe.rollout.weight_sync import load_into_module, receive_weights

        if self.sync_group is None:
            raise RuntimeError("weight sync: receive_weights before init_weight_sync")
        return load_into_module(self.model, receive_weights(self.sync_group, manifest))

    def weights_format(self) -> tuple[str, str]:
        from loupe.rollout.weight_sync import dtype_name

        return dtype_name(self.model.dtype), self.device.type

    def weights_digest(self) -> str:
        from loupe.rollout.weight_sync import module_digest

        return module_digest(self.model)

    def close(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
            self.sync_group = None

    def generate(self, states: list[_State], max_new_tokens: int) -> list[Generation]:
        out: list[Generation] = []
        for start in range(0, len(states), self.batch_size):
            out += self._generate_batch(states[start : start + self.batch_size], max_new_tokens)
        return out

    @torch.inference_mode()
    def _generate_batch(self, states: list[_State], max_new_tokens: int) -> list[Generation]:
        self.model.eval()  # the module may be a colocated learner's, which trains in train mode between rollouts
        width = max(len(s.trace) for s in states)
        input_ids = torch.full((len(states), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(states), width), dtype=torch.long)
        for row, state in enumerate(states):
            ids = state.trace.input_ids
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        inputs: dict[str, Any] = {"input_ids": input_ids.to(self.device), "attention_mask": attention.to(self.device)}
        pixel_values = [p for s in states for p in s.pixel_values]
        if pixel_values:
            inputs["pixel_values"] = torch.cat(pixel_values).to(self.device, self.model.dtype)
            inputs["image_grid_thw"] = torch.cat([g for s in states for g in s.grid_thw]).to(self.device)
            if self.types_image_tokens and self.image_token_id is not None:
                inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).long()
        sampling: dict[str, Any] = {"do_sample": False}
        if self.temperature > 0:
            sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
        result = self.model.generate(
            **inputs,
            **sampling,
            max_new_tokens=max_new_tokens,
            stop_strings=list(self.stop) or None,
            tokenizer=self.tokenizer,
            eos_token_id=self.end_ids,
            pad_token_id=self.pad_id,
            suppress_tokens=self.suppressed or None,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = result.sequences[:, width:]
        scale = self.temperature if self.temperature > 0 else 1.0
        # One step at a time: a (batch, steps, vocab) tensor would not fit for a 152k vocabulary.
        chosen_logprobs = torch.stack(
            [
                step.float().div(scale).log_softmax(-1).gather(1, new_tokens[:, t : t + 1]).squeeze(1)
                for t, step in enumerate(result.logits)
            ],
            dim=1,
        ).cpu()
        new_tokens = new_tokens.cpu()
        generations = []
        for row, state in enumerate(states):
            ids, finish = self._cut(new_tokens[row].tolist())
            generations.append(self._record(state, ids, chosen_logprobs[row, : len(ids)].tolist(), finish))
        return generations

    def _cut(self, ids: list[int]) -> tuple[list[int], str]:
        """The row's own tokens (through its end token or stop string) and why it stopped.

        Rows that stopped early are padded with the pad token, which may also be an end token, so a stop
        string found before the first end token wins.
        """
        eos_at = next((i for i, token in enumerate(ids) if token in self.end_ids), None)
        own = ids if eos_at is None else ids[:eos_at]
        if self.stop and any(s in self.tokenizer.decode(own, skip_special_tokens=True) for s in self.stop):
            for i in range(len(own)):
                if any(s in self.tokenizer.decode(own[: i + 1], skip_special_tokens=True) for s in self.stop):
                    return own[: i + 1], "stop"
        if eos_at is not None:
            return ids[: eos_at + 1], "eos"
        return ids, "length"

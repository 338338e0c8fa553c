"""The `transformers` engine: batched multi-turn generation with any Hugging Face VLM, on CPU or GPU.

Token-in/token-out: the prompt is rendered with the model's chat template once; after that every turn is
appended as tokens. A user turn's markup (closing the assistant turn, opening the user turn, the image
markers, opening the next assistant turn) is learnt from the chat template itself at start-up by rendering
two small dialogues and taking their difference, so no model's template is hard-coded here.

`TransformersEngine` decodes up to `batch_size` turns together and keeps each dialogue's keys and values
from one turn to the next (kv_batch.py), so a turn prefills only its new tokens and images; a row leaves the
batch when its turn ends and a queued turn takes its place at the next admission (`poll`). Rows are
left-padded and their new images concatenated in row order, which is how Qwen2-VL-family models batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from transformers import DynamicCache

from loupe.protocol import IMAGE_PLACEHOLDER, split_on_images
from loupe.rollout.engine import Engine, Generation, TokenTrace
from loupe.rollout.kv_batch import (
    SPARE_COLUMNS,
    Batch,
    BufferedLayer,
    DialogueCache,
    Positions,
    Row,
    buffered,
    cache_layers,
    grouped_attention,
    keep_rows,
    linear_layer,
    merge,
    right_aligned,
    row_layers,
    sample,
)
from loupe.rollout.linear_attention import continuing
from loupe.rollout.turn_markup import learn_turn_markup

_STOP_WINDOW = 16
"""Tokens at the end of a turn decoded to look for a stop string (every stop string is far shorter)."""
_ADMIT_FREE = 0.25
"""Queued turns join the running batch once this fraction of its slots is free (or it is empty)."""


@dataclass
class _State:
    trace: TokenTrace
    last_finish: str = ""
    cache: DialogueCache = field(default_factory=DialogueCache)
    """Keys and values the transformers engine keeps between turns (unused by the vllm engine)."""

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
        self.top_k = 0
        """Top-k sampling (RolloutParams.top_k); set after construction by `make_engine`."""
        self.batch_size = batch_size
        self.markup = learn_turn_markup(processor)
        from loupe.models.family import processor_grid, processor_pixels

        self.image_factor = processor_grid(processor)
        self.image_pixels = processor_pixels(processor)
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
        self._suppressed_index: torch.Tensor | None = None
        self._expands_placeholders = self._check_direct_encoding()

    def suppress_unused_ids(self, vocab_size: int) -> None:
        """Never sample the ids past the tokenizer's, up to the model's `vocab_size`: embedding rows no token names
        (Qwen2.5-VL-7B: 151,665 to 152,063). Mini-o3's engine drops such an id from a turn after vLLM samples it
        (vllm_async_engine.py:677-679, ids above 151,664); here none is drawn, so in both no turn shows or trains
        one."""
        known = len(self.tokenizer)
        if vocab_size > known:
            self.suppressed = sorted(set(self.suppressed) | set(range(known, vocab_size)))

    def _suppressed_on(self, device: torch.device) -> torch.Tensor:
        """`suppressed` as an index tensor on `device`, built once: the decode step masks it every token (a
        7B's unnamed rows are about 400 ids)."""
        cached = self._suppressed_index
        if cached is None or cached.device != device or cached.numel() != len(self.suppressed):
            cached = torch.tensor(self.suppressed, dtype=torch.long, device=device)
            self._suppressed_index = cached
        return cached

    # --- building the context -------------------------------------------------------------------------------

    def _encode(self, text: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        if images and self._expands_placeholders:
            return self._encode_direct(text, images)
        if images:
            batch = self.processor(text=[text], images=images, return_tensors="pt")
            return batch["input_ids"][0].tolist(), batch["pixel_values"], batch["image_grid_thw"]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], None, None

    def _encode_direct(self, text: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """What a Qwen2-VL-family processor's `__call__` returns (transformers' `processing_qwen2_5_vl.py`): the
        image processor's pixels and grids, and the text with each image token repeated once per merged patch,
        tokenized. Done here because `__call__` validates its keyword arguments by building dataclasses on every
        call (4 ms against 0.7 ms for the two parts on the tiny model), once per observation turn; used only
        where `_check_direct_encoding` found it gives the processor's own output."""
        pixels = self.processor.image_processor(images=images, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        counts = (grid.prod(-1) // self.processor.image_processor.merge_size**2).tolist()
        token = self.processor.image_token
        pieces = text.split(token)
        if len(pieces) != len(counts) + 1:
            raise ValueError(f"{len(pieces) - 1} image markers in a turn with {len(counts)} images")
        expanded = pieces[0] + "".join(token * count + piece for count, piece in zip(counts, pieces[1:]))
        return self.tokenizer(expanded, add_special_tokens=False)["input_ids"], pixels["pixel_values"], grid

    def _check_direct_encoding(self) -> bool:
        """Whether `_encode_direct` gives exactly the processor's ids, pixels and grids on a probe turn."""
        if not (hasattr(self.processor, "image_token") and hasattr(getattr(self.processor, "image_processor", None), "merge_size")):
            return False
        probe = Image.new("RGB", (64, 48), (200, 30, 90))
        text = self.markup.user_prefix + "A " + self.markup.image + " and " + self.markup.image + self.markup.user_suffix
        try:
            ids, pixels, grid = self._encode_direct(text, [probe, probe])
        except (ValueError, KeyError, TypeError):
            return False
        reference = self.processor(text=[text], images=[probe, probe], return_tensors="pt")
        return (ids == reference["input_ids"][0].tolist() and torch.equal(pixels, reference["pixel_values"])
                and torch.equal(grid, reference["image_grid_thw"]))

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
            close = close.removeprefix(eos_text)
        body = text.replace(IMAGE_PLACEHOLDER, self.markup.image)
        ids, pixels, grid = self._encode(close + self.markup.user_prefix + body + self.markup.user_suffix, images)
        state.trace.append(ids, generated=False)
        state.trace.images += images
        if pixels is not None:
            state.pixel_values.append(pixels)
            state.grid_thw.append(grid)

    def add_assistant_text(self, state: _State, text: str) -> None:
        state.trace.append(self.tokenizer(text, add_special_tokens=False)["input_ids"], generated=False)
        state.last_finish = "stop"

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

    receives_in_process = False
    """Whether the model that takes the weights lives in this object's process (the transformers engine), so a
    learner in the same process hands them over directly (`load_weights`) with no transport. vLLM's model lives
    in its engine-core and worker processes."""

    def load_weights(self, weights: Any) -> int:
        """Load named tensors handed over in this process (`weight_sync.cast_weights`); returns the count."""
        raise NotImplementedError(f"the {self.name} engine takes weights only through the weight-sync group")

    def weights_changed(self) -> None:
        """The weights changed under the engine (a colocated learner updated its module): drop what it cached."""

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

    def device_identity(self) -> list[str]:
        """The (node, device) key of each process that receives weights (weight_sync.device_identity)."""
        from loupe.rollout.weight_sync import device_identity

        return [device_identity(getattr(self, "device", "cpu"))]

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
        compute_dtype: torch.dtype | None = None,
    ):
        """`compute_dtype`: generate under `torch.autocast` to this dtype, for a module whose weights are float32
        (a colocated learner's, bf16 on a GPU: the learner's own forward runs the same autocast, so the engine's
        and the learner's log-probs round alike). None runs the module in its own dtype."""
        super().__init__(processor, stop, temperature, top_p, batch_size)
        self.model = model.eval()
        head = model.get_output_embeddings()
        if head is not None:
            self.suppress_unused_ids(head.weight.shape[0])
        self.compute_dtype = compute_dtype
        self.device = next(model.parameters()).device
        # Qwen2-VL-family models place image tokens with 3D (mrope) positions, as in training and vLLM: every
        # forward pass here is given them explicitly (kv_batch.Positions).
        self.image_token_id = getattr(model.config, "image_token_id", None)
        self.positions = Positions(model, self.image_token_id)
        from loupe.models.family import LINEAR_ATTENTION, layer_kinds

        self.linear = [kind == LINEAR_ATTENTION for kind in layer_kinds(model.config)]
        """Per text layer, whether it keeps a linear-attention state (Qwen3.5) rather than keys and values."""
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._running: Batch | None = None
        self._stop_tokens: dict[int, bool] = {}
        self._prompt_cache: tuple[Any, DialogueCache] | None = None
        self.sync_group: Any = None

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def _autocast(self) -> Any:
        """The compute-dtype region around a whole prefill or poll, not each forward: autocast caches its casts of
        the float32 weights until the outermost region ends, so a poll's decode steps share one cast."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @torch.inference_mode()
    def begin(self, system: str, question: str, images: list[Image.Image]) -> _State:
        """A new dialogue whose prompt is already in the cache but for its last token: the K samples of a task
        share one prefill of the prompt (its image through the vision tower once, not K times)."""
        state = super().begin(system, question, images)
        key = self._last_prompt[0] if self._last_prompt is not None else None
        if self._prompt_cache is None or self._prompt_cache[0] != key:
            with self._autocast():
                self._prompt_cache = (key, self._prefill_prompt(state))
        state.cache = self._prompt_cache[1]
        return state

    def _prefill_prompt(self, state: _State) -> DialogueCache:
        """The prompt's keys and values through its second-to-last token (the last is fed at the first turn, whose
        logits it gives). The tensors are shared by the samples: a turn's end gives each dialogue new ones."""
        ids = state.trace.input_ids[:-1]
        grid = torch.cat(state.grid_thw) if state.grid_thw else None
        positions, next_position = self.positions.segment(ids, grid, 0)
        inputs: dict[str, Any] = {
            "input_ids": torch.tensor([ids], device=self.device),
            "attention_mask": torch.ones((1, len(ids)), dtype=torch.long, device=self.device),
            "position_ids": self.positions.batch([positions]).to(self.device),
            "past_key_values": self._empty_cache(),
        }
        if state.pixel_values:
            inputs["pixel_values"] = torch.cat(state.pixel_values).to(self.device, self.model.dtype)
            inputs["image_grid_thw"] = grid.to(self.device)
        self.model.eval()
        with grouped_attention(self.model):
            output = self.model(**inputs, use_cache=True, logits_to_keep=1)
        layers = [(keys[0], values[0]) for keys, values in cache_layers(output.past_key_values)]
        return DialogueCache(layers, len(ids), next_position, len(state.pixel_values))

    def _empty_cache(self) -> DynamicCache:
        """A cache for a first prefill: transformers' own layers of each kind for a hybrid model."""
        return DynamicCache(config=self.model.config) if any(self.linear) else DynamicCache()

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        from loupe.rollout.weight_sync import SyncGroup

        self.sync_group = SyncGroup(host, port, rank, world_size, backend, timeout_s, self.device)

    def receive_weights(self, manifest: list) -> int:
        from loupe.rollout.weight_sync import load_into_module, receive_weights

        if self.sync_group is None:
            raise RuntimeError("weight sync: receive_weights before init_weight_sync")
        self.weights_changed()
        with self.sync_group.reporting():
            return load_into_module(self.model, receive_weights(self.sync_group, manifest))

    receives_in_process = True

    def load_weights(self, weights: Any) -> int:
        from loupe.rollout.weight_sync import load_into_module

        self.weights_changed()
        return load_into_module(self.model, weights)

    def weights_changed(self) -> None:
        self._prompt_cache = None  # keys and values the old weights computed

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

    # --- generation: rows of a running batch, each with its dialogue's cache (kv_batch.py) ------------------

    def turn_budget(self, state: _State, max_new_tokens: int) -> int:
        """New tokens the state's next turn may take (a benchmark's scripted policy draws its own)."""
        return max_new_tokens

    @torch.inference_mode()
    def poll(self) -> list[tuple[int, Generation]]:
        """Decode the running rows until at least one turn ends; queued turns join the batch as rows leave it.

        Queued turns are admitted first in, first out whenever a quarter of the batch is free (or nothing
        runs): each admission is one prefill forward pass, so joining one row at a time would spend a pass a
        row.
        """
        with self._autocast():
            return self._poll()

    def _poll(self) -> list[tuple[int, Generation]]:
        queue = self._queue().turns
        if not queue and self._running is None:
            raise RuntimeError(f"{self.name} engine: poll with no turn submitted")
        self.model.eval()  # the module may be a colocated learner's, which trains in train mode between rollouts
        running = len(self._running.rows) if self._running is not None else 0
        free = self.batch_size - running
        finished: list[tuple[int, Generation]] = []
        if queue and (running == 0 or free >= max(1, int(self.batch_size * _ADMIT_FREE))):
            joining = [Row(ticket, state, self.turn_budget(state, budget)) for ticket, state, budget in queue[:free]]
            del queue[:free]
            self._running = merge(self._running, self._prefill(joining))
            self._running, finished = self._settle(self._running)
        while not finished and self._running is not None:
            self._decode_step(self._running)
            self._running, finished = self._settle(self._running)
        return finished

    def cancel(self) -> None:
        super().cancel()
        self._running = None

    def discard(self, tickets: set[int]) -> None:
        super().discard(tickets)
        if self._running is not None and any(row.ticket in tickets for row in self._running.rows):
            self._running = keep_rows(self._running, [i for i, row in enumerate(self._running.rows)
                                                      if row.ticket not in tickets])

    @torch.inference_mode()
    def generate(self, states: list[_State], max_new_tokens: int) -> list[Generation]:
        """Static batching, as `model.generate` batches: each `batch_size` chunk is prefilled together and
        decoded until its longest turn ends; a row whose turn ended keeps its slot (fed padding, its output
        dropped) and no turn joins. The round-synchronous baseline of `benchmarks/rollout_throughput.py`."""
        self.model.eval()
        with self._autocast():
            return self._generate(states, max_new_tokens)

    def _generate(self, states: list[_State], max_new_tokens: int) -> list[Generation]:
        out: dict[int, Generation] = {}
        for start in range(0, len(states), self.batch_size):
            rows = [Row(start + i, state, self.turn_budget(state, max_new_tokens))
                    for i, state in enumerate(states[start : start + self.batch_size])]
            batch = self._prefill(rows)
            batch.cache = buffered(batch.cache)
            while True:
                for index, row in enumerate(batch.rows):
                    if row.finish and row.ticket not in out:
                        out[row.ticket] = self._end_turn(batch, index)
                if all(row.finish for row in batch.rows):
                    break
                self._decode_step(batch)
        return [out[i] for i in range(len(states))]

    def _prefill(self, rows: list[Row]) -> Batch:
        """One forward pass over each row's uncached tail (the last turn's final token, the new user turn and
        its images) on top of its cached keys; samples each row's first token."""
        segments, positions, pixels, grids = [], [], [], []
        for row in rows:
            state, cache = row.state, row.state.cache
            segment = state.trace.input_ids[cache.cached :]
            new_grids = state.grid_thw[cache.images_cached :]
            grid = torch.cat(new_grids) if new_grids else None
            position, row.position = self.positions.segment(segment, grid, cache.next_position)
            segments.append(segment)
            positions.append(position)
            pixels += state.pixel_values[cache.images_cached :]
            grids += new_grids
        past = max(row.state.cache.cached for row in rows)
        width = max(len(s) for s in segments)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), past + width), dtype=torch.bool)
        for i, (row, segment) in enumerate(zip(rows, segments)):
            input_ids[i, width - len(segment) :] = torch.tensor(segment)
            mask[i, past - row.state.cache.cached : past] = True
            mask[i, past + width - len(segment) :] = True
        inputs: dict[str, Any] = {
            "input_ids": input_ids.to(self.device),
            "attention_mask": mask.long().to(self.device),
            "position_ids": self.positions.batch(positions).to(self.device),
            "past_key_values": self._past(rows, past, width + SPARE_COLUMNS),
        }
        if pixels:
            inputs["pixel_values"] = torch.cat(pixels).to(self.device, self.model.dtype)
            inputs["image_grid_thw"] = torch.cat(grids).to(self.device)
        with grouped_attention(self.model), continuing(self.model, mask[:, past:]):
            output = self.model(**inputs, use_cache=True, logits_to_keep=1)
        batch = Batch(rows, output.past_key_values, mask.to(self.device))
        self._take_sample(batch, output.logits[:, -1])
        return batch

    def _past(self, rows: list[Row], length: int, room: int) -> DynamicCache:
        """The rows' cached keys and values, left-padded to `length`, as one cache with `room` columns to grow
        (empty at a first turn)."""
        if length == 0:
            return self._empty_cache()
        template = next(row.state.cache.layers for row in rows if row.state.cache.layers)
        cache = DynamicCache()
        for index, (keys, values) in enumerate(template):
            if self.linear[index]:  # every row continues its own state: nothing to align
                cache.layers.append(linear_layer(torch.stack([row.state.cache.layers[index][0] for row in rows]),
                                                 torch.stack([row.state.cache.layers[index][1] for row in rows])))
                continue
            empty = keys.new_zeros((1, keys.shape[0], 0, keys.shape[2]))
            per_row = [tuple(t.unsqueeze(0) for t in row.state.cache.layers[index]) if row.state.cache.layers
                       else (empty, empty) for row in rows]
            cache.layers.append(BufferedLayer(right_aligned([k for k, _ in per_row], length, room),
                                              right_aligned([v for _, v in per_row], length, room), length))
        return cache

    def _decode_step(self, batch: Batch) -> None:
        """Feed every row its last sampled token and sample the next."""
        rows = batch.rows
        input_ids = torch.tensor([[self.pad_id if row.finish else row.new_ids[-1]] for row in rows], device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(rows), 1))], dim=1)
        position = torch.tensor([[row.position] for row in rows])
        with grouped_attention(self.model):
            output = self.model(
                input_ids=input_ids,
                attention_mask=batch.mask.long(),
                position_ids=(position.expand(3, -1, -1) if self.positions.dims == 3 else position).to(self.device),
                past_key_values=batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        batch.cache = output.past_key_values
        for row in rows:
            row.position += 1
        self._take_sample(batch, output.logits[:, -1])

    def _take_sample(self, batch: Batch, logits: torch.Tensor) -> None:
        temperature: float | torch.Tensor = self.temperature
        if self.later_temperature is not None:  # one per row: a dialogue's first turn, or a later one
            temperature = torch.tensor([[self.temperature_for(not any(row.state.trace.generated))]
                                        for row in batch.rows], device=logits.device)
        tokens, logprobs = sample(logits, temperature, self.top_p, self._suppressed_on(logits.device), self.generator,
                                  self.top_k)
        for row, token, logprob in zip(batch.rows, tokens.tolist(), logprobs.tolist()):
            if row.finish:  # a static batch's ended row, fed padding until the batch ends
                continue
            row.new_ids.append(token)
            row.logprobs.append(logprob)
            row.finish = self._finish_reason(row)

    def _finish_reason(self, row: Row) -> str:
        """Why the row's turn ends at its newest token: a stop string ends it first (it is kept), then the
        end-of-turn token, then the budget; "" while it goes on."""
        if self.stop and self._may_end_stop(row.new_ids[-1]):
            tail = self.tokenizer.decode(row.new_ids[-_STOP_WINDOW:], skip_special_tokens=True)
            if any(s in tail for s in self.stop):
                return "stop"
        if row.new_ids[-1] in self.end_ids:
            return "eos"
        return "length" if len(row.new_ids) >= row.budget else ""

    def _end_turn(self, batch: Batch, index: int) -> Generation:
        """Record the row's turn; its dialogue keeps the row's keys and values for its next turn."""
        row = batch.rows[index]
        state = row.state
        # The last sampled token was never fed: the cache ends one token short of the turn.
        state.cache = DialogueCache(row_layers(batch, index), len(state.trace) + len(row.new_ids) - 1,
                                    row.position, len(state.pixel_values))
        return self._record(state, row.new_ids, row.logprobs, row.finish)

    def _may_end_stop(self, token: int) -> bool:
        """Whether the token's text holds the last character of a stop string (decoding the turn's tail at
        every step for every row costs more than the step's attention on a small model)."""
        found = self._stop_tokens.get(token)
        if found is None:
            piece = self.tokenizer.decode([token])
            found = self._stop_tokens[token] = any(s[-1] in piece for s in self.stop)
        return found

    def _settle(self, batch: Batch) -> tuple[Batch | None, list[tuple[int, Generation]]]:
        """Take the ended rows out of the batch."""
        finished = [(row.ticket, self._end_turn(batch, index)) for index, row in enumerate(batch.rows) if row.finish]
        if not finished:
            return batch, []
        return keep_rows(batch, [i for i, row in enumerate(batch.rows) if not row.finish]), finished

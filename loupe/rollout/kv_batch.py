"""The transformers engine's running batch: dialogues decoding together, each keeping its KV cache between turns.

`TransformersEngine` (hf.py) used to call `model.generate` once per batch of turns, which re-reads the whole
dialogue every turn: every earlier token is prefilled again and every earlier image goes through the vision
tower again, so a trajectory's k-th turn costs O(k) images. Here each dialogue keeps its keys and values
(`DialogueCache`) from one turn to the next, so a turn prefills only what is new (the closing of the last
turn, the observation and its image), and the rows of a batch are independent: one leaves as soon as its turn
ends and another joins at the next step (continuous batching at token granularity, as vLLM and SGLang
schedule, on a plain padded cache).

Why by hand: `transformers.generate` runs a fixed batch from one prefill to the end of its longest row, and
its continuous-batching manager (`transformers.generation.continuous_batching`) takes text token ids only,
with no images and no 3D (mrope) positions. What this module needs from the model is its forward pass with
`past_key_values`, a 2D attention mask and explicit `position_ids`, which every decoder-only HF model accepts.

Layout: one `DynamicCache` for the batch, rows left-padded to a common length; the attention mask marks every
position a row never wrote (left padding, or the padding inside a prefilled segment) so it is never attended.
A linear-attention layer (Qwen3.5's Gated DeltaNet) keeps a fixed-size state a row instead of keys and values,
stacked along the batch dimension with nothing to pad (linear_attention.py), so a hybrid model's rows join,
leave and keep their state between turns the same way.
Positions are given explicitly per row: for Qwen2-VL-family models the segment's 3D positions come from the
model's own `get_rope_index` (transformers' `modeling_qwen2_5_vl.py`, `Qwen2_5_VLModel.get_rope_index`), run on
the new segment alone and shifted by the dialogue's next position, which is what the full sequence gives
because that function only ever accumulates a running position; other models get 1D positions.
`tests/test_hf_engine.py` checks the recorded log-probs against one fresh forward pass over the whole dialogue.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


@dataclass
class DialogueCache:
    """A dialogue's keys and values between turns, and where its uncached tail starts."""

    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per layer (keys, values), each (kv_heads, cached, head_dim): no padding, no holes; a linear-attention
    layer's (convolution inputs (channels, kernel), recurrent state (heads, key dim, value dim)) instead."""
    cached: int = 0
    """Tokens of the dialogue's ids the layers hold; the rest is prefilled at its next turn."""
    next_position: int = 0
    """The (text) position of token `cached`."""
    images_cached: int = 0
    """Images whose tokens are among the cached ones (their pixels need not be encoded again)."""


@dataclass
class Row:
    """One turn being generated: the dialogue, its budget and what it has produced so far."""

    ticket: int
    state: Any
    """The engine's dialogue state: `state.trace` (TokenTrace) and `state.cache` (DialogueCache)."""
    budget: int
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    position: int = 0
    """Position of the last sampled token, the next one to be fed."""
    finish: str = ""


@dataclass
class Batch:
    """Rows decoding together and their cache: every layer (rows, kv_heads, length, head_dim), left-padded."""

    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor
    """(rows, length) bool: True where the row wrote a key (its attention layers' columns)."""


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views into buffers with room to grow.

    `DynamicLayer.update` concatenates, copying the whole batch's cache at every decode step (a third of a
    step's time on the tiny model); here a step writes one column in place and the buffers double when full.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int | None = None):
        """`keys`/`values` hold the first `length` columns; given `length`, they are taken as the buffers
        themselves (spare columns beyond it), otherwise copied into new buffers with room to grow."""
        super().__init__()
        self.lazy_initialization(keys, values)
        if length is None:
            self.length = keys.shape[2]
            self._keys = self._grown(keys, self.length + SPARE_COLUMNS)
            self._values = self._grown(values, self.length + SPARE_COLUMNS)
        else:
            self.length, self._keys, self._values = length, keys, values
        self._view()

    @staticmethod
    def _grown(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[2] = capacity
        buffer = tensor.new_empty(shape)
        buffer[:, :, : tensor.shape[2]] = tensor
        return buffer

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[2]
        if end > self._keys.shape[2]:
            self._keys = self._grown(self.keys, 2 * end)
            self._values = self._grown(self.values, 2 * end)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values


SPARE_COLUMNS = 64
"""Columns a batch's cache buffers hold beyond its current length when they are (re)built."""


def is_linear(layer: Any) -> bool:
    """Whether a cache layer keeps a linear-attention state rather than keys and values."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def linear_layer(conv: torch.Tensor, recurrent: torch.Tensor) -> LinearAttentionLayer:
    """transformers' linear-attention cache layer holding these states (rows first) as a continued dialogue's:
    its next one-token step reads them (`has_previous_state`)."""
    layer = LinearAttentionLayer()
    layer.dtype, layer.device = conv.dtype, conv.device
    layer.max_batch_size, layer.conv_kernel_size = conv.shape[0], conv.shape[-1]
    layer.conv_states, layer.recurrent_states = conv, recurrent
    layer.is_conv_states_initialized = layer.is_recurrent_states_initialized = layer.has_previous_state = True
    return layer


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), or a linear-attention layer's (convolution inputs, recurrent state)."""
    return [(layer.conv_states, layer.recurrent_states) if is_linear(layer) else (layer.keys, layer.values)
            for layer in cache.layers]


def make_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], linear: list[bool]) -> DynamicCache:
    """A cache of these per-layer tensors (rows first); `linear` says which layers are linear-attention states."""
    cache = DynamicCache()
    cache.layers = [linear_layer(a, b) if is_state else BufferedLayer(a, b)
                    for (a, b), is_state in zip(layers, linear, strict=True)]
    return cache


def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def right_aligned(parts: list[torch.Tensor], length: int, room: int) -> torch.Tensor:
    """`parts` (rows, heads, columns, dim) stacked row-wise in one new buffer of `length + room` columns, each
    part ending at column `length` and zero to its left: one copy of each part, where padding with `torch.cat`
    and then moving into a growable buffer copied the batch three times."""
    first = parts[0]
    buffer = first.new_empty((sum(p.shape[0] for p in parts), first.shape[1], length + room, first.shape[3]))
    row = 0
    for part in parts:
        rows, columns = part.shape[0], part.shape[2]
        buffer[row : row + rows, :, : length - columns].zero_()  # never attended, but must not be NaN
        buffer[row : row + rows, :, length - columns : length] = part
        row += rows
    return buffer


def buffered(cache: DynamicCache) -> DynamicCache:
    """The cache with every attention layer a `BufferedLayer`: as it is where it already is, copied where not
    (linear-attention layers as they are)."""
    if all(isinstance(layer, BufferedLayer) or is_linear(layer) for layer in cache.layers):
        return cache
    return make_cache(cache_layers(cache), [is_linear(layer) for layer in cache.layers])


def merge(first: Batch | None, second: Batch) -> Batch:
    """One batch of both, in buffers with room to grow: the shorter is padded on the left."""
    if first is None or not first.rows:
        return Batch(second.rows, buffered(second.cache), second.mask)
    length = max(first.mask.shape[1], second.mask.shape[1])
    cache = DynamicCache()
    cache.layers = [linear_layer(torch.cat([a.conv_states, b.conv_states]),
                                 torch.cat([a.recurrent_states, b.recurrent_states])) if is_linear(a)
                    else BufferedLayer(right_aligned([a.keys, b.keys], length, SPARE_COLUMNS),
                                       right_aligned([a.values, b.values], length, SPARE_COLUMNS), length)
                    for a, b in zip(first.cache.layers, second.cache.layers)]
    mask = torch.cat([left_pad(first.mask, length, 1), left_pad(second.mask, length, 1)])
    return Batch(first.rows + second.rows, cache, mask)


def keep_rows(batch: Batch, keep: list[int]) -> Batch | None:
    """The batch without the other rows, and without the leading columns no remaining row uses."""
    if not keep:
        return None
    index = torch.tensor(keep, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    used = mask.any(0).nonzero()
    start = int(used[0]) if len(used) else mask.shape[1]
    cache = DynamicCache()
    for layer in batch.cache.layers:
        if is_linear(layer):
            cache.layers.append(linear_layer(layer.conv_states.index_select(0, index),
                                             layer.recurrent_states.index_select(0, index)))
        elif isinstance(layer, BufferedLayer):
            # One copy: the kept rows' buffers, spare columns included, from the first column still used.
            cache.layers.append(BufferedLayer(layer._keys[:, :, start:].index_select(0, index),
                                              layer._values[:, :, start:].index_select(0, index), layer.length - start))
        else:
            cache.layers.append(BufferedLayer(layer.keys.index_select(0, index)[:, :, start:],
                                              layer.values.index_select(0, index)[:, :, start:]))
    return Batch([batch.rows[i] for i in keep], cache, mask[:, start:])


def row_layers(batch: Batch, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `row`'s keys and values with its padding removed, or its linear-attention states (copied: the
    batch's own are updated in place by its next steps), what its dialogue keeps to the next turn."""
    where = batch.mask[row]
    return [(layer.conv_states[row].clone(), layer.recurrent_states[row].clone()) if is_linear(layer)
            else (layer.keys[row][:, where], layer.values[row][:, where]) for layer in batch.cache.layers]


class Positions:
    """Positions for a new segment of a dialogue: 3D (mrope) through the model's `get_rope_index` where the
    model has one, 1D otherwise."""

    def __init__(self, model: Any, image_token_id: int | None):
        inner = getattr(model, "model", None)
        self.rope_index = getattr(inner, "get_rope_index", None) if image_token_id is not None else None
        self.image_token_id = image_token_id
        self.types_tokens = self.rope_index is not None and "mm_token_type_ids" in inspect.signature(self.rope_index).parameters

    @property
    def dims(self) -> int:
        """1 for plain positions, 3 for mrope's (temporal, height, width)."""
        return 3 if self.rope_index is not None else 1

    def segment(self, ids: list[int], grids: torch.Tensor | None, start: int) -> tuple[torch.Tensor, int]:
        """(dims, len(ids)) positions of `ids` placed after `start` positions, and the position after them."""
        if self.rope_index is None or grids is None:
            positions = torch.arange(start, start + len(ids)).expand(self.dims, -1)
            return positions, start + len(ids)
        tokens = torch.tensor([ids])
        kwargs: dict[str, Any] = {"image_grid_thw": grids.cpu()}
        if self.types_tokens:
            kwargs["mm_token_type_ids"] = (tokens == self.image_token_id).long()
        positions, _ = self.rope_index(tokens, **kwargs)
        positions = positions[:, 0].cpu() + start
        return positions, int(positions.max()) + 1

    def batch(self, per_row: list[torch.Tensor]) -> torch.Tensor:
        """Rows' (dims, n) positions left-padded to one (dims, rows, width) tensor, or (rows, width) in 1D."""
        width = max(p.shape[1] for p in per_row)
        stacked = torch.stack([left_pad(p, width, 1) for p in per_row], dim=1)
        return stacked if self.dims == 3 else stacked[0]


def sample(logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float, suppressed: list[int] | torch.Tensor,
           generator: torch.Generator, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens of (rows, vocab) logits and their log-probs.

    The log-prob is the sampled token's under the temperature-scaled distribution of the raw logits (what the
    learner recomputes); the draw itself never picks a suppressed token and, with `top_p` < 1, keeps to the
    nucleus (transformers' `TopPLogitsWarper`: drop the least likely tokens whose mass is at most 1 - top_p) and,
    with `top_k` > 0, to the k likeliest tokens (`TopKLogitsWarper`, applied first, as transformers orders them).
    Temperature 0 is greedy. `temperature` may be a (rows, 1) tensor, one per row (a dialogue's first turn and
    its later ones sample at different temperatures: `rollout.later_turn_temperature`).
    """
    if isinstance(temperature, torch.Tensor):
        per_row = temperature.to(logits.device, torch.float32).reshape(-1, 1)
        scale, greedy_rows = torch.where(per_row > 0, per_row, torch.ones_like(per_row)), per_row[:, 0] <= 0
        if bool(greedy_rows.all()) or not bool(greedy_rows.any()):
            temperature = 0.0 if bool(greedy_rows.all()) else 1.0  # one kind of row: the scalar path below
        else:
            greedy_tokens, greedy_logprobs = sample(logits / scale, 0.0, top_p, suppressed, generator, top_k)
            drawn_tokens, drawn_logprobs = sample(logits / scale, 1.0, top_p, suppressed, generator, top_k)
            return (torch.where(greedy_rows, greedy_tokens, drawn_tokens),
                    torch.where(greedy_rows, greedy_logprobs, drawn_logprobs))
        logits = logits.float() / scale
    scale = temperature if temperature > 0 else 1.0
    logprobs = (logits.float() / scale).log_softmax(-1)
    scores = logprobs.clone()
    if len(suppressed):
        scores[:, suppressed] = float("-inf")
    if temperature <= 0:
        tokens = scores.argmax(-1)
    else:
        if 0 < top_k < scores.shape[-1]:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if top_p < 1.0:
            ordered, order = scores.sort(-1)
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        tokens = torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


GQA_SDPA = "loupe_sdpa_gqa"
"""The attention the engine's text decoder runs (registered with transformers under this name)."""


def sdpa_gqa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, with grouped key/value heads handed to torch as they are (`enable_gqa`).

    transformers' own (`integrations/sdpa_attention.py`, `use_gqa_in_sdpa`) repeats every key/value head to the
    query heads' count whenever an attention mask is given, which a padded batch always gives: a copy of the
    whole cache at every layer of every step, three times the attention's own time on CPU at 2,000 cached
    tokens. `enable_gqa` (torch >= 2.5) reads the grouped heads in place and gives the same numbers.

    On a GPU no fused kernel takes a masked grouped call (flash takes no mask; the memory-efficient kernel
    refuses grouped heads, torch's `sdp_utils_cpp.h`, `check_batch_size_and_num_heads_dense`), so it runs in
    the math kernel, which still reads the cache once. Measured by `benchmarks/gpu_check.py` on an H200 (torch
    2.11.0+cu130) at Qwen2.5-VL-7B's heads (28 of 128, 4 key/value heads), 4,096 cached tokens: a decode step of
    32 rows took 0.084 ms this way against 2.32 ms with the heads repeated into the memory-efficient kernel, an
    image prefill (4 x 1,024 queries) 0.74 ms against 1.01 ms. The math kernel's score matrix is the price: one
    layer's (rows x 28 x queries x keys) at a time, 0.9 GB for that prefill.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    grouped = key.shape[1] != query.shape[1]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=query.shape[2] > 1 and attention_mask is None and causal,
        enable_gqa=grouped,
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, sdpa_gqa_attention)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


@contextlib.contextmanager
def grouped_attention(model: Any) -> Iterator[None]:
    """While inside, the model's text decoder runs `sdpa_gqa_attention` where it ran `sdpa` (a colocated learner
    shares the module, so it is switched back after); other implementations are left alone."""
    config = getattr(model.config, "text_config", model.config)
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    config._attn_implementation = GQA_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before

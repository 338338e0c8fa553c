"""Linear-attention layers (Qwen3.5's Gated DeltaNet) in the transformers engine's running batch.

A Gated DeltaNet layer keeps two tensors a dialogue instead of keys and values (transformers'
`LinearAttentionLayer`, `cache_utils.py`): the convolution's last `conv_kernel_size` inputs, (channels, K), and the
recurrent state, (value heads, key dim, value dim). Both are a fixed size whatever the dialogue's length, so a row
of a batch is one slice of each along the batch dimension: rows join with `torch.cat` and leave with
`index_select`, as the attention layers' keys do (kv_batch.py), with no padding to align.

Why a forward of its own for new turns: transformers' `Qwen3_5GatedDeltaNet.forward` (models/qwen3_5/
modeling_qwen3_5.py) reads a layer's cached state only for a one-token step; a longer input (a new turn's closing
tokens, the observation and its image) restarts the convolution from zeros and the recurrence from no state, as if
the dialogue began there. The engine prefills each new turn on top of the cached dialogue, so `continue_turn`
below computes the same layer over several new tokens with the cached state as its start, in a left-padded batch:

- the convolution runs over each row's own last K - 1 cached inputs followed by its new tokens (padding never
  enters a window); its new state is the last K inputs of that sequence;
- the recurrence starts from the cached state (`chunk_gated_delta_rule`'s `initial_state`, which transformers'
  kernels take but the layer does not pass), and a padding position is a no-op: its gate `g` is 0 (no decay) and
  its `beta` is 0 (no write), so the state passes through it unchanged, and its query, key and value are zero.

Everything else (projections, gating, normalisation, output) is the module's own, called as transformers calls it.
`tests/test_hf_engine.py` checks the engine's log-probs against one fresh forward over the whole dialogue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def is_gated_deltanet(module: Any) -> bool:
    """Whether `module` is a Gated DeltaNet layer as transformers writes them (Qwen3.5, Qwen3.5-MoE)."""
    return all(hasattr(module, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d",
                                                   "A_log", "dt_bias", "chunk_gated_delta_rule", "layer_idx"))


def continue_turn(layer: Any, real: torch.Tensor, hidden_states: torch.Tensor, cache: Any) -> torch.Tensor:
    """`layer`'s output over a left-padded batch of new tokens (`real`: (rows, length) True where a row has a
    token), continuing each row's cached state in `cache.layers[layer.layer_idx]`, which it updates."""
    state = cache.layers[layer.layer_idx]
    rows, length, _ = hidden_states.shape
    real = real.to(hidden_states.device)
    hidden_states = hidden_states * real[..., None].to(hidden_states.dtype)
    mixed = layer.in_proj_qkv(hidden_states).transpose(1, 2)  # (rows, channels, length)
    z = layer.in_proj_z(hidden_states).reshape(rows, length, -1, layer.head_v_dim)
    b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)

    kernel = layer.conv_kernel_size
    window = mixed.new_zeros(rows, mixed.shape[1], kernel - 1 + length)
    for row, count in enumerate(real.sum(1).tolist()):
        start = length - count  # the row's first token: its cached inputs go right before it
        window[row, :, start : start + kernel - 1] = state.conv_states[row, :, 1:].to(mixed.dtype)
        window[row, :, start + kernel - 1 :] = mixed[row, :, start:]
    new_conv = window[:, :, -kernel:].clone()
    mixed = F.silu(F.conv1d(window, layer.conv1d.weight, layer.conv1d.bias, groups=layer.conv_dim))
    mixed = (mixed * real[:, None, :].to(mixed.dtype)).transpose(1, 2)

    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(rows, length, -1, layer.head_k_dim)
    key = key.reshape(rows, length, -1, layer.head_k_dim)
    value = value.reshape(rows, length, -1, layer.head_v_dim)
    beta = b.sigmoid() * real[..., None]
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias) * real[..., None]
    if layer.num_v_heads // layer.num_k_heads > 1:
        query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
        key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
    out, recurrent = layer.chunk_gated_delta_rule(query, key, value, g=g, beta=beta,
                                                  initial_state=state.recurrent_states, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    state.conv_states = new_conv.to(state.conv_states.dtype)
    state.recurrent_states = recurrent.to(state.recurrent_states.dtype)
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(rows, length, -1))


@contextlib.contextmanager
def continuing(model: Any, real: torch.Tensor) -> Iterator[None]:
    """While inside, the model's Gated DeltaNet layers continue cached rows over several new tokens
    (`continue_turn`, `real` the segment's (rows, length) token mask); a one-token step, and a layer with no
    cached state (a first prefill), run transformers' own forward. Switched back after: a colocated learner
    shares the module."""
    layers = [module for module in model.modules() if is_gated_deltanet(module)]

    def forward_of(layer: Any, original: Any) -> Any:
        def forward(hidden_states: torch.Tensor, cache_params: Any = None, attention_mask: Any = None) -> torch.Tensor:
            if (cache_params is None or hidden_states.shape[1] == 1
                    or not cache_params.has_previous_state(layer.layer_idx)):
                return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask)
            return continue_turn(layer, real, hidden_states, cache_params)
        return forward

    for layer in layers:
        layer.forward = forward_of(layer, layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's own again

"""Check (a): the SamplingParams loupe's VLLMEngine builds, as vLLM 0.33 constructs, validates and applies them.

Runs in .venv-vllm: python tests/vllm_checks/sampling_params.py --model TINY_MODEL_DIR

The engine generates for real on vLLM's front end (`_harness.replay_engine`): its SamplingParams go through
`LLM.enqueue`, vLLM's InputProcessor (validation against the model config, generation-config EOS ids) and the
msgpack hop to the engine core. Fields are read back at each stage. The logit bias is also run through vLLM's
V1 logit-bias processor on CPU (the V2 model runner's, the GPU default, is a Triton kernel that adds the same
bias in the same place: before temperature).
"""

from __future__ import annotations

import copy

import _harness

_harness.select_cpu_platform()


def fields(params) -> dict:
    return {
        "type": f"{type(params).__module__}.{type(params).__qualname__}",
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "skip_special_tokens": params.skip_special_tokens,
        "logprobs": params.logprobs,
        "seed": params.seed,
        "logit_bias": None if params.logit_bias is None else [[type(k).__name__, k, v] for k, v in params.logit_bias.items()],
        "eos_token_id": params.eos_token_id,
        "all_stop_token_ids": sorted(params.all_stop_token_ids),
    }


def check(result: dict) -> None:
    model_path = _harness.model_dir()

    import dialogue
    import torch
    from vllm import SamplingParams

    result["versions"] = _harness.versions()
    engine, core = _harness.replay_engine(model_path, temperature=0.7, top_p=0.95, seed=5)
    model_config = core.vllm_config.model_config
    tokenizer = engine.tokenizer
    result["vocab_size"] = model_config.get_vocab_size()
    result["suppressed"] = {tokenizer.convert_ids_to_tokens(i): i for i in engine.suppressed}
    result["end_ids"] = engine.end_ids
    result["stop"] = list(engine.stop)
    result["logprobs_mode"] = model_config.logprobs_mode

    captured = []
    enqueue = engine.llm.enqueue

    def spy(prompts, sampling_params=None, **kwargs):
        captured.append(copy.deepcopy(sampling_params))  # as built, before LLM marks it FINAL_ONLY
        return enqueue(prompts, sampling_params, **kwargs)

    engine.llm.enqueue = spy
    images = dialogue.turn_images(dialogue.protocol_params())
    states = [engine.begin(dialogue.SYSTEM, dialogue.QUESTION, images[0]) for _ in range(2)]
    words = tokenizer("a b c d e f g h", add_special_tokens=False)["input_ids"]
    core.scripts = [(words, [-1.0] * len(words))] * 2
    first = len(core.requests)
    engine.generate(states, 8)
    result["built"] = [fields(p) for p in captured]
    result["after_input_processor_and_msgpack"] = [fields(r.sampling_params) for r in core.requests[first:]]
    for params in captured:
        params.verify(model_config, None, None, tokenizer)  # raises on an out-of-vocabulary id
    result["verify_passed"] = True
    # Where generation stops: the transformers engine stops on `end_ids` (plus the tokenizer's EOS); vLLM's
    # InputProcessor adds the EOS ids of the model's generation_config.json to every request.
    result["stop_ids_transformers_engine"] = sorted(set(engine.end_ids) | {tokenizer.eos_token_id})
    result["stop_ids_vllm"] = sorted(core.requests[first].sampling_params.all_stop_token_ids)
    eos = model_config.try_get_generation_config().get("eos_token_id")
    result["generation_config_eos"] = [eos] if isinstance(eos, int) else eos

    # The rl worker's setting (seed None: vLLM's own generator) and eval's greedy decoding.
    engine.seed, engine.temperature = None, 0.0
    captured.clear()
    core.scripts = [(words, [-1.0] * len(words))] * 2
    engine.generate(states, 4)
    result["seedless_greedy"] = [fields(p) for p in captured]

    # A request vLLM ends without finishing it (here: aborted; "error" likewise) is not recorded as a turn.
    core.scripts = [(words, [-1.0] * len(words)), (words[:2], [-1.0] * 2)]  # the second runs dry: aborted
    before = [len(s.trace) for s in states]
    try:
        engine.generate(states, 4)
        result["unfinished_request_raises"] = False
    except RuntimeError as error:
        result["unfinished_request_raises"] = str(error)
    result["traces_untouched_by_unfinished"] = [len(s.trace) for s in states] == before

    # vLLM's validation is live: an id past the vocabulary is refused.
    try:
        SamplingParams(logit_bias={result["vocab_size"] + 3: -100.0}).verify(model_config, None, None, tokenizer)
        result["out_of_vocab_bias_refused"] = False
    except Exception as error:  # noqa: BLE001 - its type and message are the result
        result["out_of_vocab_bias_refused"] = f"{type(error).__name__}: {error}"[:200]
    # from_optional (the OpenAI server's path) converts string keys and clamps to [-100, 100]; the constructor
    # the engine calls takes the dict as given.
    clamped = SamplingParams.from_optional(logit_bias={"7": -1000.0, 8: 5.0}).logit_bias
    result["from_optional_logit_bias"] = [[type(k).__name__, k, v] for k, v in clamped.items()]

    # The bias as vLLM's V1 logit-bias processor applies it, on CPU, to two requests' logits.
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    processor = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    bias = result["built"][0]["logit_bias"]
    params = SamplingParams(logit_bias={k: v for _, k, v in bias})
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=[(0, params, [], []), (1, SamplingParams(), [], [])], moved=[]))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, result["vocab_size"], generator=generator) * 3
    raw = logits.clone()
    out = processor.apply(logits)
    delta = out - raw
    ids = [k for _, k, _ in bias]
    result["bias_applied"] = {
        "delta_at_suppressed": delta[0, ids].tolist(),
        "other_entries_untouched": bool(delta[0].clone().index_fill_(0, torch.tensor(ids), 0).abs().max() == 0),
        "unbiased_request_untouched": bool(delta[1].abs().max() == 0),
        "suppressed_probability_after": float(out[0].softmax(-1)[ids].sum()),
        "suppressed_probability_before": float(raw[0].softmax(-1)[ids].sum()),
    }


if __name__ == "__main__":
    _harness.main(check)

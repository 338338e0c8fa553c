"""Check (d): the prompt vLLM builds for a multi-turn, multi-image dialogue, token for token against the trace.

Runs in .venv-vllm: python tests/vllm_checks/prompt_tokens.py --model TINY_MODEL_DIR

1. The transformers engine (the rl image's transformers) runs `dialogue.run` on the tiny model: three turns,
   four images, `SAMPLES` dialogues sampled side by side. Its TokenTrace is what the learner trains on.
2. loupe's VLLMEngine runs the same dialogue on vLLM's real front end (`_harness.replay_engine`), the engine
   core replaying the transformers engine's sampled tokens (plus surplus tokens the real model could have gone
   on with, so a stop vLLM missed would show). Each request's prompt, as vLLM's renderer and Qwen2.5-VL
   multimodal processor expanded `_collapse_image_pads(ids)` + `multi_modal_data`, and after its msgpack hop to
   the engine core, is compared with the trace's ids at that turn; so are the image placeholder ranges, the
   image grids and pixel values, how each turn ended, and the final traces.
3. A scripted dialogue (fixed assistant tokens ending by eos, stop string and length) runs the same way; its
   trace is printed for the pytest side to compare with the project venv's transformers engine.
"""

from __future__ import annotations


import _harness

_harness.select_cpu_platform()

SURPLUS = 5
"""Tokens appended after each replayed turn: a real model does not stop where the replay ends."""


def image_runs(ids: list[int], pad: int) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, token in enumerate(ids + [None]):
        if token == pad and start is None:
            start = i
        elif token != pad and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def hf_images(state) -> list[tuple[list[int], object]]:
    """(grid, pixel rows) of every image of a transformers-engine state, in dialogue order."""
    out = []
    for pixels, grids in zip(state.pixel_values, state.grid_thw):
        row = 0
        for grid in grids.tolist():
            count = grid[0] * grid[1] * grid[2]
            out.append((grid, pixels[row : row + count]))
            row += count
    return out


def check(result: dict) -> None:
    model_path = _harness.model_dir()

    import dialogue
    import torch

    from loupe.models import load_model, load_processor
    from loupe.protocol import get_protocol
    from loupe.rollout.hf import TransformersEngine

    result["versions"] = _harness.versions()
    processor = load_processor(model_path)
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    filler = tokenizer("and so on and so on", add_special_tokens=False)["input_ids"]

    # 1. The transformers engine's dialogue, with each turn's prompt and sampled tokens kept.
    torch.manual_seed(0)
    hf = TransformersEngine(load_model(model_path, device="cpu", dtype="float32"), processor, get_protocol(dialogue.PROTOCOL).stop,
                            temperature=1.0, top_p=1.0, batch_size=8, seed=0)
    hf_turns: list[dict] = []

    def hf_generate(states, max_new_tokens):
        prompts = [list(s.trace.input_ids) for s in states]
        gens = hf.generate(states, max_new_tokens)
        hf_turns.append({
            "prompts": prompts,
            "tokens": [s.trace.input_ids[len(p):] for s, p in zip(states, prompts)],
            "logprobs": [s.trace.logprobs[len(p):] for s, p in zip(states, prompts)],
            "finish": [g.finish for g in gens],
        })
        return gens

    hf_states = dialogue.run(hf, hf_generate)

    # 2. The same dialogue through VLLMEngine on vLLM's front end, replaying those tokens.
    engine, core = _harness.replay_engine(model_path, temperature=1.0, top_p=1.0, seed=0)
    vllm_turns: list[dict] = []

    def vllm_generate(states, max_new_tokens):
        turn = hf_turns[len(vllm_turns)]
        core.scripts = [(ids + filler[:SURPLUS], lps + [-1.0] * SURPLUS) for ids, lps in zip(turn["tokens"], turn["logprobs"])]
        first = len(core.requests)
        gens = engine.generate(states, max_new_tokens)
        vllm_turns.append({"requests": core.requests[first:], "finish": [g.finish for g in gens]})
        return gens

    vllm_states = dialogue.run(engine, vllm_generate)

    turns_report = []
    for t, (h, v) in enumerate(zip(hf_turns, vllm_turns)):
        rows = []
        for s, (prompt, request) in enumerate(zip(h["prompts"], v["requests"])):
            ids = list(request.prompt_token_ids)
            features = request.mm_features or []
            runs = image_runs(prompt, pad)
            ranges = [(f.mm_position.offset, f.mm_position.length) for f in features]
            first_diff = next((i for i, (a, b) in enumerate(zip(ids, prompt)) if a != b), None)
            rows.append({
                "prompt_tokens": len(prompt),
                "sent_tokens": len(engine._collapse_image_pads(prompt)),
                "vllm_tokens": len(ids),
                "equal": ids == prompt,
                "first_difference": first_diff,
                "images": len(features),
                "image_runs": runs,
                "placeholder_ranges": ranges,
                "ranges_equal_runs": ranges == runs,
                "finish_hf": h["finish"][s],
                "finish_vllm": v["finish"][s],
            })
        turns_report.append(rows)
    result["turns"] = turns_report
    result["all_prompts_equal"] = all(r["equal"] for rows in turns_report for r in rows)
    result["all_ranges_equal"] = all(r["ranges_equal_runs"] for rows in turns_report for r in rows)
    result["all_finishes_equal"] = all(r["finish_hf"] == r["finish_vllm"] for rows in turns_report for r in rows)
    result["images_per_request"] = [[r["images"] for r in rows] for rows in turns_report]
    result["finishes"] = sorted({r["finish_hf"] for rows in turns_report for r in rows})
    result["ran_dry"] = list(core.ran_dry)
    result["traces_equal"] = [a.trace.input_ids == b.trace.input_ids for a, b in zip(hf_states, vllm_states)]
    result["generated_masks_equal"] = [a.trace.generated == b.trace.generated for a, b in zip(hf_states, vllm_states)]
    result["logprobs_max_abs_diff"] = max(
        abs(x - y) for a, b in zip(hf_states, vllm_states) for x, y in zip(a.trace.logprobs, b.trace.logprobs)
    )
    result["trace_lengths"] = [len(s.trace) for s in hf_states]

    # Image grids and pixel values: vLLM's processed items against the transformers engine's own.
    last = vllm_turns[-1]["requests"][0]
    hf_items = hf_images(hf_states[0])
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm

    # vLLM 0.33 sends raw uint8 pixels and normalises them on the device (mm_device_do_normalize, on by
    # default for Qwen2.5-VL): apply its own normalisation module before comparing.
    with set_current_vllm_config(core.vllm_config):
        norm = build_mm_input_norm(core.vllm_config.model_config)
    result["device_normalize"] = type(norm).__name__
    grids, pixels, raw_dtypes = [], [], []
    seen = {}
    for turn in vllm_turns:
        for request in turn["requests"]:
            for k, feature in enumerate(request.mm_features or []):
                if feature.data is not None and k not in seen:
                    seen[k] = feature.data
    for k, (grid, rows) in enumerate(hf_items):
        data = seen.get(k)
        if data is None:
            grids.append(None)
            pixels.append(None)
            continue
        grids.append(data["image_grid_thw"].data.tolist() == grid)
        raw = data["pixel_values"].data
        raw_dtypes.append(str(raw.dtype))
        vllm_pixels = norm.forward_native(raw, torch.float32) if raw.dtype == torch.uint8 else raw
        pixels.append(float((vllm_pixels.float() - rows.float()).abs().max()) if vllm_pixels.shape == rows.shape else f"shape {list(vllm_pixels.shape)} vs {list(rows.shape)}")
    result["image_grids"] = [g for g, _ in hf_items]
    result["grids_equal"] = grids
    result["pixel_max_abs_diff"] = pixels
    result["pixel_dtypes_sent"] = raw_dtypes
    result["last_request_images"] = len(last.mm_features or [])

    # 3. The scripted dialogue, for the comparison across environments (and here against transformers 5.20).
    core.scripts = []
    scripted_turns: list[list[str]] = []
    scripted_prompts_equal: list[bool] = []

    def scripted_vllm(states, max_new_tokens):
        turn = len(scripted_turns)
        scripts = [dialogue.scripted_tokens(tokenizer, s, turn) for s in range(len(states))]
        core.scripts = [(ids + filler[:SURPLUS], [-0.5] * (len(ids) + SURPLUS)) for ids, _ in scripts]
        prompts = [list(s.trace.input_ids) for s in states]
        first = len(core.requests)
        gens = engine.generate(states, max_new_tokens)
        scripted_turns.append([f"{kind}/{g.finish}" for (_, kind), g in zip(scripts, gens)])
        scripted_prompts_equal.extend(list(r.prompt_token_ids) == p for r, p in zip(core.requests[first:], prompts))
        return gens

    vllm_scripted = dialogue.run(engine, scripted_vllm, dialogue.SCRIPTED_MAX_NEW_TOKENS)
    hf_scripted = dialogue.run(hf, dialogue.scripted_generate(hf), dialogue.SCRIPTED_MAX_NEW_TOKENS)
    result["scripted_finishes"] = scripted_turns
    result["scripted_prompts_equal"] = scripted_prompts_equal
    result["scripted_finishes_match"] = all(kind == finish for turn in scripted_turns for kind, finish in (x.split("/") for x in turn))
    result["scripted_traces_equal_here"] = [a.trace.input_ids == b.trace.input_ids for a, b in zip(hf_scripted, vllm_scripted)]
    result["scripted_vllm_traces"] = [s.trace.input_ids for s in vllm_scripted]
    result["scripted_vllm_generated"] = [s.trace.generated for s in vllm_scripted]
    result["ran_dry_scripted"] = list(core.ran_dry)


if __name__ == "__main__":
    _harness.main(check)

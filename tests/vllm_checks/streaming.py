"""Check (f): turns stream out of vLLM as they end, and a new turn joins while others decode.

Runs in .venv-vllm: python tests/vllm_checks/streaming.py --model TINY_MODEL_DIR

loupe's VLLMEngine on vLLM's real front end (`_harness.replay_engine`: `LLM.enqueue`, `LLMEngine.add_request`,
`LLMEngine.step` and vLLM's output processor; the engine core replays scripted tokens, one a step). Three
dialogues: the first turn ends by its end token after 3 steps, the second by its budget after 8, the third is
submitted after the first returns and ends after 2 more steps. `poll` must hand back each turn at the step it
ends, the third before the second; `cancel` must abort what is in flight.
"""

from __future__ import annotations


import _harness

_harness.select_cpu_platform()


def check(result: dict) -> None:
    model_path = _harness.model_dir()

    import dialogue

    result["versions"] = _harness.versions()
    engine, core = _harness.replay_engine(model_path, temperature=1.0, seed=3)
    tokenizer = engine.tokenizer
    words = tokenizer("a b c d e f g h", add_special_tokens=False)["input_ids"]
    end = engine.end_ids[0]
    images = dialogue.turn_images(dialogue.protocol_params())
    states = [engine.begin(dialogue.SYSTEM, dialogue.QUESTION, images[0]) for _ in range(4)]

    def returned(polled) -> list:
        return [[ticket, generation.finish, generation.num_tokens] for ticket, generation in polled]

    core.scripts = [(words[:2] + [end], [-0.5] * 3), (words, [-0.25] * len(words)), (words[:1] + [end], [-0.75] * 2)]
    first_ticket = engine.submit(states[0], 8)
    second_ticket = engine.submit(states[1], 8)
    result["tickets"] = [first_ticket, second_ticket]
    result["first"] = returned(engine.poll())
    result["active_after_first"] = len(core.active)
    result["third_ticket"] = engine.submit(states[2], 8)
    result["second"] = returned(engine.poll())
    result["active_after_second"] = len(core.active)
    result["third"] = returned(engine.poll())
    result["in_flight_after_all"] = len(engine._in_flight)
    result["unfinished_after_all"] = engine.llm.llm_engine.has_unfinished_requests()
    # What each dialogue recorded: its turn's tokens and log-probs, generated-flagged.
    result["recorded"] = [
        {"ids": s.trace.input_ids[-n:], "logprobs": s.trace.logprobs[-n:], "generated": s.trace.generated[-n:]}
        for s, n in zip(states[:3], (3, 8, 2))
    ]
    result["scripted"] = [words[:2] + [end], words, words[:1] + [end]]

    core.scripts = [(words, [-1.0] * len(words))]
    engine.submit(states[3], 8)
    before = len(states[3].trace)
    engine.cancel()
    result["aborted"] = len(core.aborted)
    result["after_cancel"] = {"in_flight": len(engine._in_flight),
                              "unfinished": engine.llm.llm_engine.has_unfinished_requests(),
                              "trace_untouched": len(states[3].trace) == before}
    try:
        engine.poll()
        result["poll_after_cancel"] = "returned"
    except RuntimeError as error:
        result["poll_after_cancel"] = str(error)


if __name__ == "__main__":
    _harness.main(check)

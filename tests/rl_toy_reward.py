"""The learning test's reward: 1 when the first response contains the right option letter (always "B").

A randomly initialised model almost never writes `<answer>B</answer>`, so the letter cascade would score every
sample 0 and GRPO would have nothing to learn from. Any response containing the letter earns the reward
instead: about one in ten random 4-token responses does, so the groups carry signal from the first step, and
the reward reaches 1 only if the gradient raises the sampled tokens that earned it.
"""


def letter_in_response(task, trajectory=None, **kwargs):
    response = next((turn.text for turn in trajectory.turns if turn.role == "assistant"), "")
    return 1.0 if task.solution in response else 0.0

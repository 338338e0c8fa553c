"""What of a scored trajectory the learner trains: whether it trains at all and counts in its group's statistics
(`_trainable`: invalid rewards, over-turn masking, DAPO's overlong filter, a sampled vision marker), and its
token trace as a `TrainSequence` with the trained positions (`to_sequence`: model-generated tokens only, a last
turn that did not end with the end of turn masked under rl.cut_turn: masked)."""

from __future__ import annotations

import torch

from loupe.trajectory import Trajectory
from stages.rl.batching import TrainSequence
from stages.rl.params import RLParams


def wrote_vision_marker(t: Trajectory, markers: frozenset[int]) -> bool:
    """Whether the model itself sampled an image/video marker token.

    The learner could not replay such a trajectory: the marker would claim an image that does not exist
    ("image features and image tokens do not match"). The transformers engine never samples them; other
    engines might.
    """
    trace = t.trace
    return trace is not None and any(g and i in markers for i, g in zip(trace.input_ids, trace.generated))


def reward_valid(t: Trajectory) -> bool:
    """Whether the trajectory's reward was computed: a judge that failed leaves it invalid or without a total."""
    return bool(t.rewards.get("valid", True)) and t.rewards.get("total") is not None


def _trainable(t: Trajectory, params: RLParams, markers: frozenset[int] = frozenset()) -> tuple[bool, bool]:
    """(trained?, counted in its group's statistics?) for a scored trajectory."""
    valid = reward_valid(t)
    over = t.end_reason == "over_turn"
    # DAPO's overlong filter masks the loss of a cut trajectory; its reward still counts in the group's statistics,
    # as verl's DAPO trainer computes them over every sample.
    cut = params.overlong.filter and t.end_reason == "length"
    trained = valid and not (params.over_turn_masking and over) and not cut and not wrote_vision_marker(t, markers)
    counted = valid and (not over or not params.over_turn_masking or params.over_turn_in_group_stats)
    return trained, counted


def to_sequence(t: Trajectory, trained: bool, group: str, mask_cut_turn: bool = False,
                end_of_turn_id: int | None = None) -> TrainSequence:
    """The learner's view of a trajectory: its token trace, trained positions, the sampler's log-probs and the
    images the model saw (the trace's own uint8 objects; the learner computes their pixel values itself, so
    no float32 pixels travel to its ranks, and the engine's `trace.extras` is never read). `mask_cut_turn`
    (`rl.cut_turn: masked`): the generated tokens of the last turn are not trained when it was cut (a `length`
    trajectory) or, given `end_of_turn_id`, when it ended on another token than that one (<|endoftext|>)."""
    trace = t.trace
    if trace is None:
        raise ValueError(f"trajectory {t.traj_id} has no token trace; the rl stage needs the transformers or vllm engine")
    ids = torch.tensor(trace.input_ids, dtype=torch.long)
    generated = torch.tensor(trace.generated, dtype=torch.bool)
    generated[0] = False  # the first token has no logit predicting it (never generated anyway)
    unfinished = end_of_turn_id is not None and bool(generated[-1]) and trace.input_ids[-1] != end_of_turn_id
    if mask_cut_turn and (t.end_reason == "length" or unfinished):
        last = len(generated)
        while last > 0 and generated[last - 1]:  # the cut turn: the trace's final run of generated tokens
            last -= 1
        generated[last:] = False
    positions = generated.nonzero().squeeze(1) if trained else torch.zeros(0, dtype=torch.long)
    return TrainSequence(
        input_ids=ids,
        positions=positions,
        advantage=0.0,
        old_logprobs=torch.tensor(trace.logprobs, dtype=torch.float32)[positions],
        images=list(trace.images),
        traj_id=t.traj_id,
        group=group,
    )

"""The rl stage's advantage estimators and dynamic-sampling filter (pure functions, no model)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stages.rl.advantages import compute_advantages, groups_with_signal


def test_grpo_is_group_normalised_with_bessel_std():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    groups = ["a", "a", "a", "a", "b", "b"]
    adv = compute_advantages(rewards, groups, "grpo")
    std = np.std([1, 0, 0, 0], ddof=1)
    assert adv[:4] == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert adv[4:] == pytest.approx([0.0, 0.0])  # a group that agrees carries no signal


def test_dr_grpo_subtracts_the_mean_only():
    adv = compute_advantages([3.0, 1.0, 2.0, 2.0], ["a", "a", "b", "b"], "dr_grpo")
    assert adv == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_rloo_uses_the_other_members_as_baseline():
    adv = compute_advantages([1.0, 0.0, 0.0], ["g"] * 3, "rloo")
    assert adv == pytest.approx([1.0, -0.5, -0.5])


def test_reinforce_pp_whitens_over_the_batch():
    rewards = [1.0, 0.0, 1.0, 1.0]
    adv = compute_advantages(rewards, ["a", "a", "b", "b"], "reinforce_pp")
    expected = (np.array(rewards) - 0.75) / (np.std(rewards, ddof=1) + 1e-6)
    assert adv == pytest.approx(expected)
    # a group that agrees still gets a non-zero advantage: the baseline is the batch's
    assert adv[2] > 0


def test_members_left_out_of_stats_do_not_move_the_baseline():
    rewards = [1.0, 0.0, 0.0, 1.0]
    groups = ["g"] * 4
    with_all = compute_advantages(rewards, groups, "dr_grpo")
    without_last = compute_advantages(rewards, groups, "dr_grpo", in_stats=[True, True, True, False])
    assert with_all[0] == pytest.approx(0.5)
    assert without_last[0] == pytest.approx(1.0 - 1.0 / 3.0)
    # the excluded member is still given an advantage against its group's counted baseline
    assert without_last[3] == pytest.approx(1.0 - 1.0 / 3.0)


def test_a_group_with_one_counted_member_has_no_baseline():
    adv = compute_advantages([1.0, 0.0], ["g", "g"], "grpo", in_stats=[True, False])
    assert adv == pytest.approx([0.0, 0.0])


def test_unknown_estimator_and_mismatched_lengths_are_errors():
    with pytest.raises(ValueError, match="unknown estimator"):
        compute_advantages([1.0, 0.0], ["g", "g"], "ppo")
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages([1.0, 0.0], ["g"], "grpo")


def test_groups_with_signal_keeps_only_groups_that_disagree():
    rewards = [1, 1, 0, 1, 0, 0, 1, 0]
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert groups_with_signal(rewards, groups) == {"b", "d"}
    # a disagreement only among members left out of the statistics does not count
    assert groups_with_signal(rewards, groups, in_stats=[1, 1, 1, 1, 1, 1, 1, 0]) == {"b"}


@given(
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12),
    st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_group_advantages_sum_to_zero_and_order_like_rewards(rewards, estimator):
    adv = compute_advantages(rewards, ["g"] * len(rewards), estimator)
    assert abs(adv.sum()) < 1e-6 * max(1.0, np.abs(adv).max()) * len(rewards) + 1e-9
    order = np.argsort(rewards, kind="stable")
    assert all(adv[order[i]] <= adv[order[i + 1]] + 1e-9 for i in range(len(order) - 1))


def test_reinforce_baseline_subtracts_the_group_mean_then_whitens_over_the_batch():
    """OpenRLHF's reinforce_baseline on two groups of four, equal lengths: [.58,.58,.58,-1.73 | 1.73,-.58,-.58,-.58]
    (group means .75 and .25; the centred rewards' biased std over the batch is sqrt(.1875))."""
    rewards = [1, 1, 1, 0, 1, 0, 0, 0]
    groups = ["a"] * 4 + ["b"] * 4
    out = compute_advantages(rewards, groups, "reinforce_baseline", token_counts=[10] * 8)
    expected = np.array([0.25, 0.25, 0.25, -0.75, 0.75, -0.25, -0.25, -0.25]) / np.sqrt(0.1875)
    np.testing.assert_allclose(out, expected, atol=1e-9)
    np.testing.assert_allclose(out[[0, 3, 4, 5]], [0.577, -1.732, 1.732, -0.577], atol=1e-3)
    # Not grpo's per-group answer, nor reinforce_pp's global baseline.
    assert not np.allclose(out, compute_advantages(rewards, groups, "grpo"))
    assert not np.allclose(out, compute_advantages(rewards, groups, "reinforce_pp"))


def test_reinforce_baseline_weighs_sequences_by_their_tokens_as_openrlhf_whitens_tokens():
    rewards, groups = [1, 0, 1, 0], ["a", "a", "b", "b"]
    lengths = [30, 10, 10, 10]
    out = compute_advantages(rewards, groups, "reinforce_baseline", token_counts=lengths)
    tokens = np.repeat([0.5, -0.5, 0.5, -0.5], lengths)  # each token carries its sequence's centred reward
    expected = (np.array([0.5, -0.5, 0.5, -0.5]) - tokens.mean()) / tokens.std()
    np.testing.assert_allclose(out, expected, atol=1e-9)
    assert out[0] != -out[1]  # the long sequence moved the batch mean

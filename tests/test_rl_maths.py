"""Advantage, return and KL maths against plain reference loops (hypothesis-generated inputs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexrl.rl import maths

finite = st.floats(-5, 5, allow_nan=False, width=32)


def reference_group_advantages(rewards, group_size, scale):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out += [(r - mean) / (std + maths.EPS) if scale else r - mean for r in group]
    return out


def reference_gae(rewards, values, gamma, lam):
    advantages = []
    for t in range(len(rewards)):
        total = 0.0
        for k in range(t, len(rewards)):
            next_value = values[k + 1] if k + 1 < len(values) else 0.0
            delta = rewards[k] + gamma * next_value - values[k]
            total += (gamma * lam) ** (k - t) * delta
        advantages.append(total)
    return advantages


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.data(), st.booleans())
def test_group_advantages_match_reference(group_size, groups, data, scale):
    rewards = data.draw(st.lists(finite, min_size=group_size * groups, max_size=group_size * groups))
    expected = reference_group_advantages(rewards, group_size, scale)
    np.testing.assert_allclose(maths.group_advantages(rewards, group_size, scale), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rewards, group_size, expected", [
    ([1, 1, 0, 0], 2, [False, False]),
    ([1, 0, 0, 0], 2, [True, False]),
    ([0.1, 0.1, 0.1, 1.0, 0.1, 0.1], 3, [False, True]),
], ids=["all-flat", "first-varied", "shaped-rewards"])
def test_varied_groups(rewards, group_size, expected):
    assert maths.varied_groups(rewards, group_size).tolist() == expected


def test_flat_group_has_zero_advantage_not_nan():
    assert maths.group_advantages([1.0, 1.0, 1.0], 3).tolist() == [0.0, 0.0, 0.0]


def test_ungroupable_batch_names_the_sizes():
    with pytest.raises(ValueError, match="5 rewards cannot be split into groups of 2"):
        maths.group_advantages([0.0] * 5, 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=12), st.floats(0, 1), st.floats(0, 1))
def test_gae_matches_reference(pairs, gamma, lam):
    rewards, values = [p[0] for p in pairs], [p[1] for p in pairs]
    advantages, returns = maths.gae(rewards, values, gamma, lam)
    np.testing.assert_allclose(advantages, reference_gae(rewards, values, gamma, lam), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(returns, np.array(advantages) + values)


def test_gae_with_lambda_one_is_return_minus_value():
    rewards, values = [0.0, 0.0, 1.0], [0.2, 0.5, 0.7]
    advantages, _ = maths.gae(rewards, values, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(advantages, [0.8, 0.5, 0.3])


@settings(max_examples=100, deadline=None)
@given(st.lists(finite, max_size=12), st.floats(0, 1))
def test_discounted_returns_match_reference(rewards, gamma):
    expected = [sum(gamma ** (k - t) * rewards[k] for k in range(t, len(rewards))) for t in range(len(rewards))]
    np.testing.assert_allclose(maths.discounted_returns(rewards, gamma), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator, reference", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
    ("k3", lambda lp, ref: math.exp(ref - lp) - 1 - (ref - lp)),
])
def test_kl_estimators_match_their_formulas(estimator, reference):
    logprobs, ref_logprobs = [-0.1, -2.0, -0.5], [-0.3, -1.0, -0.5]
    expected = [reference(a, b) for a, b in zip(logprobs, ref_logprobs)]
    np.testing.assert_allclose(maths.kl_penalty(logprobs, ref_logprobs, estimator), expected, rtol=1e-9)


def test_kl_estimators_are_unbiased_in_expectation():
    """Sampling from p, E[k1] and E[k3] both equal KL(p||q); 200k draws put the error near 0.003."""
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.4, 0.4, 0.2])
    exact = float(np.sum(p * np.log(p / q)))
    draws = np.random.default_rng(0).choice(3, size=200_000, p=p)
    for estimator in ("k1", "k3"):
        estimate = maths.kl_penalty(np.log(p[draws]), np.log(q[draws]), estimator).mean()
        assert abs(estimate - exact) < 0.01, f"{estimator}: {estimate} vs exact {exact}"


def test_unknown_kl_estimator_is_named():
    with pytest.raises(ValueError, match="'k4' is unknown"):
        maths.kl_penalty([0.0], [0.0], "k4")


def test_token_rewards_put_the_reward_on_the_last_token():
    np.testing.assert_allclose(maths.token_rewards(1.0, [0.5, 0.0, 1.0], 0.1), [-0.05, 0.0, 0.9])
    assert maths.token_rewards(1.0, [], 0.1).size == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(finite, min_size=2, max_size=30))
def test_whiten_matches_reference(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    np.testing.assert_allclose(maths.whiten(values), [(v - mean) / (std + maths.EPS) for v in values], rtol=1e-6, atol=1e-6)


def test_reverse_kl_advantage_sign():
    """A token the teacher likes more than the student gets a positive advantage."""
    np.testing.assert_allclose(maths.reverse_kl_advantages([-2.0, -0.1], [-0.5, -1.0]), [1.5, -0.9])

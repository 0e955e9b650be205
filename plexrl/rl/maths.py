"""The numbers RL algorithms compute between model calls: advantages, returns, KL penalties.

Pure numpy (no torch, no clock, no I/O), so every formula is tested against a plain loop.
Conventions: an episode's per-token arrays cover only the tokens the policy sampled, in order;
`rewards` of a batch are flat, grouped consecutively (`group_size` samples per prompt).
Invariants: outputs have the shapes of their inputs; a group or batch with no spread gets
advantages of exactly 0 (never NaN); masked-out tokens keep advantage 0.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-6
KL_ESTIMATORS = ("k1", "k2", "k3")


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True) -> np.ndarray:
    """GRPO: each reward minus its group's mean, divided by the group's std when `scale`."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, keepdims=True) + EPS)
    return centred.reshape(-1)


def varied_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """DAPO dynamic sampling: True for each group whose rewards are not all equal.

    A group of equal rewards has zero advantage everywhere, so it carries no gradient.
    """
    groups = _grouped(np.asarray(rewards, dtype=np.float64), group_size)
    return groups.max(axis=1) > groups.min(axis=1)


def kl_penalty(logprobs: np.ndarray, ref_logprobs: np.ndarray, estimator: str = "k3") -> np.ndarray:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    k1 = log r, k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r, with log r = logp - ref_logp
    (Schulman's estimators; k3 is unbiased and never negative).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is unknown (expected one of {KL_ESTIMATORS})")
    log_ratio = np.asarray(logprobs, dtype=np.float64) - np.asarray(ref_logprobs, dtype=np.float64)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return np.expm1(-log_ratio) + log_ratio


def token_rewards(final_reward: float, kl: np.ndarray, kl_coef: float) -> np.ndarray:
    """Per-token rewards: -kl_coef * kl on every token, plus the episode's reward on the last."""
    rewards = -kl_coef * np.asarray(kl, dtype=np.float64)
    if rewards.size:
        rewards[-1] += final_reward
    return rewards


def discounted_returns(rewards: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """G_t = r_t + gamma * G_{t+1}, with G after the last token 0."""
    returns = np.zeros(len(rewards), dtype=np.float64)
    following = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        following = rewards[t] + gamma * following
        returns[t] = following
    return returns


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float = 1.0, lam: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one episode ending after its last token.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the end is 0); A_t = delta_t + gamma*lam*A_{t+1}.
    Returns (advantages, returns = advantages + values), the critic's regression target.
    """
    rewards, values = np.asarray(rewards, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if rewards.shape != values.shape:
        raise ValueError(f"gae: rewards {rewards.shape} and values {values.shape} (expected the same shape)")
    next_values = np.append(values[1:], 0.0)
    deltas = rewards + gamma * next_values - values
    advantages = discounted_returns(deltas, gamma * lam)
    return advantages, advantages + values


def whiten(values: np.ndarray) -> np.ndarray:
    """Global advantage normalisation (REINFORCE++): zero mean, unit std over the whole batch."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values
    return (values - values.mean()) / (values.std() + EPS)


def reverse_kl_advantages(student_logprobs: np.ndarray, teacher_logprobs: np.ndarray) -> np.ndarray:
    """On-policy distillation: per-token advantage teacher_logp - student_logp = -(reverse KL sample).

    Maximising it moves the student towards the teacher on the student's own samples.
    """
    return np.asarray(teacher_logprobs, dtype=np.float64) - np.asarray(student_logprobs, dtype=np.float64)


def _grouped(rewards: np.ndarray, group_size: int) -> np.ndarray:
    if group_size < 1 or rewards.size % group_size:
        raise ValueError(f"{rewards.size} rewards cannot be split into groups of {group_size} "
                         "(expected a positive group size dividing the batch)")
    return rewards.reshape(-1, group_size)

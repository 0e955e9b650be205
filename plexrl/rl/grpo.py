"""GRPO: group-relative advantages, clipped importance ratio, optional KL to a frozen reference.

Each step: sample `group_size` answers per problem; every token of an answer gets its group's
normalised advantage, minus `kl_coef` times its KL estimate to the reference when one is used
(folding the KL into the advantage, as Tinker's cookbook does, keeps the built-in `ppo` loss);
one clipped update; weight sync.
"""

from __future__ import annotations

import numpy as np

from plexrl.rl import maths
from plexrl.rl.job import Job, StepStats, token_scale
from plexrl.rl.rollout import Episode, policy_datum


class GRPO:
    def __init__(self, job: Job):
        self.job = job
        self.reference = reference_model(job)

    def train_step(self, step: int) -> StepStats:
        episodes = self.job.rollout(step)
        rewards = np.array([e.reward for e in episodes])
        advantages = maths.group_advantages(rewards, self.job.spec.group_size)
        metrics = self.job.update(group_datums(self.job, self.reference, episodes, advantages))
        return StepStats(float(rewards.mean()), metrics)


def reference_model(job: Job):
    """The frozen starting model, served for log-probs; only needed when a KL term is on."""
    return job.service.create_sampling_client(base_model=job.base_model, name="reference") if job.spec.kl_coef else None


def group_datums(job: Job, reference, episodes: list[Episode], advantages: np.ndarray) -> list:
    """Policy datums with one advantage per episode, KL-penalised per token, at token-mean scale."""
    kls = kl_to_reference(job, reference, episodes)
    scale = token_scale(episodes)
    return [policy_datum(e, scale * (a - job.spec.kl_coef * kl)) for e, a, kl in zip(episodes, advantages, kls)]


def kl_to_reference(job: Job, reference, episodes: list[Episode]) -> list[np.ndarray]:
    if reference is None:
        return [np.zeros(len(e.policy_positions)) for e in episodes]
    ref_logprobs = job.logprobs_of(reference, episodes)
    return [maths.kl_penalty(e.policy_logprobs, ref, job.spec.kl_estimator) for e, ref in zip(episodes, ref_logprobs)]

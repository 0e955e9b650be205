"""REINFORCE++: per-token returns with a token-level KL penalty, normalised over the whole batch.

No critic and no groups: each sampled token's reward is `-kl_coef * KL_t` (to the frozen
reference), plus the episode's task reward on its last token; the advantage is the return from
that token on, whitened over every token of the batch (global normalisation, which keeps the
update scale steady without per-prompt groups).
"""

from __future__ import annotations

import numpy as np

from plexrl.rl import maths
from plexrl.rl.grpo import kl_to_reference
from plexrl.rl.job import Job, StepStats, token_scale
from plexrl.rl.rollout import policy_datum


class ReinforcePP:
    def __init__(self, job: Job):
        self.job = job
        self.reference = job.service.create_sampling_client(base_model=job.base_model, name="reference")

    def train_step(self, step: int) -> StepStats:
        spec = self.job.spec
        episodes = self.job.rollout(step)
        kls = kl_to_reference(self.job, self.reference, episodes)
        returns = [maths.discounted_returns(maths.token_rewards(e.reward, kl, spec.kl_coef), spec.gamma)
                   for e, kl in zip(episodes, kls)]
        advantages = split_like(maths.whiten(np.concatenate(returns)), returns)
        scale = token_scale(episodes)
        metrics = self.job.update([policy_datum(e, scale * a) for e, a in zip(episodes, advantages)])
        metrics["kl"] = float(np.concatenate(kls).mean()) if kls else 0.0
        return StepStats(float(np.mean([e.reward for e in episodes])), metrics)


def split_like(flat: np.ndarray, parts: list[np.ndarray]) -> list[np.ndarray]:
    """Cut `flat` back into pieces of the lengths of `parts`."""
    return np.split(flat, np.cumsum([len(p) for p in parts])[:-1])

"""PPO with a critic: the critic is a second trainable model of the same job.

Each step: sample; the critic's values for every sampled token (a `forward` pass, no gradient);
per-token rewards (task reward on the last token, optional KL penalty); GAE advantages, whitened
over the batch; one clipped policy update and one value-regression update of the critic onto the
GAE returns, submitted together so the runtime may run them back to back.
"""

from __future__ import annotations

import numpy as np

from plexrl.rl import maths
from plexrl.rl.grpo import kl_to_reference, reference_model
from plexrl.rl.job import Job, StepStats, collect, submit_update, token_scale
from plexrl.rl.reinforce_pp import split_like
from plexrl.rl.rollout import Episode, policy_datum, value_datum


class PPO:
    def __init__(self, job: Job):
        self.job = job
        self.critic = job.service.create_training_client(base_model=job.base_model, seed=job.spec.seed + 1,
                                                          name="critic")
        self.reference = reference_model(job)

    def train_step(self, step: int) -> StepStats:
        spec = self.job.spec
        episodes = self.job.rollout(step)
        values = self.values(episodes)
        kls = kl_to_reference(self.job, self.reference, episodes)
        estimates = [maths.gae(maths.token_rewards(e.reward, kl, spec.kl_coef), v, spec.gamma, spec.lam)
                     for e, v, kl in zip(episodes, values, kls)]
        advantages = split_like(maths.whiten(np.concatenate([a for a, _ in estimates])), values)
        scale = token_scale(episodes)
        value_targets = [value_datum(e, returns) for e, (_, returns) in zip(episodes, estimates)]
        critic_update = submit_update(self.critic, value_targets, spec.critic_learning_rate, "value_mse")
        metrics = self.job.update([policy_datum(e, scale * a) for e, a in zip(episodes, advantages)])
        metrics["value_loss"] = collect(critic_update)["loss:sum"]
        return StepStats(float(np.mean([e.reward for e in episodes])), metrics)

    def values(self, episodes: list[Episode]) -> list[np.ndarray]:
        """The critic's value before each sampled token (read where that token is predicted)."""
        datums = [value_datum(e, np.zeros(len(e.policy_positions))) for e in episodes]
        outputs = self.critic.forward(datums, loss_fn="value_mse").result().loss_fn_outputs
        return [out["values"].to_numpy().astype(np.float64)[e.policy_positions - 1]
                for out, e in zip(outputs, episodes)]

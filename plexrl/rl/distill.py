"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

The per-token advantage is teacher_logp - student_logp (a sample of the negative reverse KL),
trained with the `importance_sampling` loss; no task reward enters the update. The reward curve
reports the task reward of the student's samples, so distillation is judged on the same scale
as RL. The teacher is the same tiny model warmed up for more SFT steps.
"""

from __future__ import annotations

import numpy as np

from plexrl.rl import maths
from plexrl.rl.job import Job, StepStats, token_scale
from plexrl.rl.rollout import policy_datum


class Distill:
    def __init__(self, job: Job, teacher_model: str):
        self.job = job
        self.teacher = job.service.create_sampling_client(base_model=teacher_model, name="teacher")

    def train_step(self, step: int) -> StepStats:
        episodes = self.job.rollout(step)
        teacher = self.job.logprobs_of(self.teacher, episodes)
        advantages = [maths.reverse_kl_advantages(e.policy_logprobs, t) for e, t in zip(episodes, teacher)]
        scale = token_scale(episodes)
        metrics = self.job.update([policy_datum(e, scale * a) for e, a in zip(episodes, advantages)],
                                  loss_fn="importance_sampling")
        metrics["reverse_kl"] = float(-np.concatenate(advantages).mean())
        return StepStats(float(np.mean([e.reward for e in episodes])), metrics)

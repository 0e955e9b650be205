"""DAPO-style dynamic sampling on top of GRPO, with the decoupled "clip-higher" upper bound.

Groups whose rewards are all equal have zero advantage and teach nothing, so they are dropped
and more problems are sampled (up to `max_sampling_rounds` rounds) until the batch holds
`problems_per_step` groups with spread, or the rounds run out. The reward curve counts every
episode sampled in the first round, so it stays comparable with GRPO's.
"""

from __future__ import annotations

import numpy as np

from plexrl.rl import maths
from plexrl.rl.grpo import group_datums, reference_model
from plexrl.rl.job import Job, StepStats


class DAPO:
    def __init__(self, job: Job):
        self.job = job
        self.reference = reference_model(job)

    def train_step(self, step: int) -> StepStats:
        spec = self.job.spec
        kept, first_round_rewards, rounds = [], None, 0
        while len(kept) < spec.problems_per_step and rounds < spec.max_sampling_rounds:
            episodes = self.job.rollout(step, round_=rounds)
            rewards = np.array([e.reward for e in episodes])
            first_round_rewards = rewards if first_round_rewards is None else first_round_rewards
            groups = [episodes[i:i + spec.group_size] for i in range(0, len(episodes), spec.group_size)]
            kept += [g for g, varied in zip(groups, maths.varied_groups(rewards, spec.group_size)) if varied]
            rounds += 1
        metrics = {"sampling_rounds": float(rounds), "varied_groups": float(len(kept))}
        kept = kept[: spec.problems_per_step]
        if kept:  # every group flat after all rounds: nothing to learn this step
            episodes = [e for group in kept for e in group]
            rewards = np.array([e.reward for e in episodes])
            advantages = maths.group_advantages(rewards, spec.group_size)
            metrics.update(self.job.update(group_datums(self.job, self.reference, episodes, advantages)))
        return StepStats(float(first_round_rewards.mean()), metrics)

"""A running job as its algorithm sees it: its clients, its task, and the moves every algorithm makes.

`Job` owns the policy's training client and its current sampler, draws each step's problems
from a generator seeded by (job seed, step, round), and applies one update: forward_backward
and optim_step submitted back to back (one wait, not two), then a weight sync. Algorithms add
their own models (critic, reference, teacher) through `job.service`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plexrl.rl.codec import Codec
from plexrl.rl.rollout import Episode, rollout
from plexrl.rl.spec import JobSpec
from plexrl.tasks import Problem, make_task
from plexrl.types import AdamParams, Datum, ModelInput, SamplingParams


@dataclass
class StepStats:
    reward: float  # mean task reward of this step's on-policy rollouts: the reward curve
    metrics: dict[str, float] = field(default_factory=dict)


class Job:
    def __init__(self, service, spec: JobSpec, base_model: str):
        self.service, self.spec, self.base_model = service, spec, str(base_model)
        self.task = make_task(spec.task)
        self.codec = Codec.from_model(base_model)
        self.trainer = service.create_training_client(base_model=self.base_model, seed=spec.seed)
        self.sampler = self.trainer.save_weights_and_get_sampling_client()

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.spec.max_tokens, temperature=self.spec.temperature,
                              stop=(self.codec.turn_end,))

    def problems(self, step: int, round_: int = 0) -> list[Problem]:
        rng = np.random.default_rng([self.spec.seed, step, round_])
        return [self.task.sample_problem(rng) for _ in range(self.spec.problems_per_step)]

    def rollout(self, step: int, round_: int = 0, group_size: int | None = None) -> list[Episode]:
        return rollout(self.sampler, self.codec, self.task, self.problems(step, round_),
                       group_size or self.spec.group_size, self.sampling_params,
                       (self.spec.seed, step, round_))

    def update(self, datums: list[Datum], loss_fn: str = "ppo", loss_fn_config: dict | None = None) -> dict[str, float]:
        """One optimiser step of the policy on `datums`, then a weight sync for the next rollout."""
        if loss_fn_config is None and loss_fn == "ppo":
            loss_fn_config = {"clip_low_threshold": self.spec.clip_low, "clip_high_threshold": self.spec.clip_high}
        metrics = train_on(self.trainer, datums, self.spec.learning_rate, loss_fn, loss_fn_config)
        self.sampler = self.trainer.save_weights_and_get_sampling_client()
        return metrics

    def logprobs_of(self, client, episodes: list[Episode]) -> list[np.ndarray]:
        """Per episode, `client`'s log-probs of the tokens the policy sampled (reference, teacher)."""
        futures = [client.compute_logprobs(ModelInput.from_ints(e.tokens)) for e in episodes]
        return [np.array(f.result(), dtype=object)[e.policy_positions].astype(np.float64)
                for f, e in zip(futures, episodes)]


def train_on(trainer, datums: list[Datum], learning_rate: float, loss_fn: str,
             loss_fn_config: dict | None = None) -> dict[str, float]:
    """forward_backward + optim_step, submitted together; returns the loss metrics."""
    return collect(submit_update(trainer, datums, learning_rate, loss_fn, loss_fn_config))


def submit_update(trainer, datums: list[Datum], learning_rate: float, loss_fn: str,
                  loss_fn_config: dict | None = None) -> tuple:
    """Queue one update without waiting: calls of one model run in submission order."""
    backward = trainer.forward_backward(datums, loss_fn=loss_fn, loss_fn_config=loss_fn_config)
    return backward, trainer.optim_step(AdamParams(learning_rate=learning_rate))


def collect(update: tuple) -> dict[str, float]:
    backward, step = update
    metrics = dict(backward.result().metrics)
    metrics.update(step.result().metrics)
    return metrics


def token_scale(episodes: list[Episode]) -> float:
    """1 / (sampled tokens in the batch): turns the summed losses into a token-level mean."""
    return 1.0 / max(1, sum(len(e.policy_positions) for e in episodes))

"""The whole RL loop of one job: build its algorithm, then step it, marking each step boundary.

    job = Job(cluster.service_client(name), spec, base_model)   # policy + sampler
    algorithm = GRPO(job) | PPO(job) | ...                        # adds critic / reference / teacher
    for step in range(spec.steps):
        stats = algorithm.train_step(step)                        # rollout -> rewards -> update -> sync
        cluster.report_step(job=name, step=step)

Nothing here depends on how many other jobs share the cluster: with the same seeds and a
transparent runtime, a job's reward curve is the same alone or multiplexed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from plexrl.rl.dapo import DAPO
from plexrl.rl.distill import Distill
from plexrl.rl.grpo import GRPO
from plexrl.rl.job import Job, StepStats
from plexrl.rl.ppo import PPO
from plexrl.rl.reinforce_pp import ReinforcePP
from plexrl.rl.spec import JobSpec

ALGORITHMS = {"grpo": GRPO, "ppo": PPO, "reinforce_pp": ReinforcePP, "dapo": DAPO}


@dataclass
class JobResult:
    name: str
    algorithm: str
    rewards: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0


def make_algorithm(job: Job, teacher_model: str | None = None):
    if job.spec.algorithm == "distill":
        if teacher_model is None:
            raise ValueError(f"job {job.spec.name!r}: algorithm 'distill' needs a teacher model (got none)")
        return Distill(job, teacher_model)
    return ALGORITHMS[job.spec.algorithm](job)


def run_job(cluster, spec: JobSpec, base_model: str, teacher_model: str | None = None,
            on_step: Callable[[str, int, StepStats], None] | None = None) -> JobResult:
    started = time.perf_counter()
    result = JobResult(spec.name, spec.algorithm)
    with cluster.service_client(spec.name, slack=spec.slack, steps=spec.steps) as service:  # its states are freed when it ends
        job = Job(service, spec, base_model)
        algorithm = make_algorithm(job, teacher_model)
        for step in range(spec.steps):
            step_started = time.perf_counter()
            stats = algorithm.train_step(step)
            cluster.report_step(job=spec.name, step=step, reward=stats.reward)
            result.rewards.append(stats.reward)
            result.step_s.append(time.perf_counter() - step_started)
            result.metrics.append(stats.metrics)
            if on_step is not None:
                on_step(spec.name, step, stats)
        result.wall_s = time.perf_counter() - started
    return result

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

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from plexrl.rl.dapo import DAPO
from plexrl.rl.distill import Distill
from plexrl.rl.grpo import GRPO
from plexrl.rl.job import Job, StepStats
from plexrl.rl.ppo import PPO
from plexrl.rl.reinforce_pp import ReinforcePP
from plexrl.rl.spec import JobSpec

CONTROLLER_NICE = 10  # what `nice` adds by default


def controllers(count: int) -> ThreadPoolExecutor:
    """Threads for `count` job controllers (`run_job`), each at a lower CPU priority
    (`CONTROLLER_NICE`) than the device processes. On CPU the machine's cores are the devices; on
    a cluster the controllers run on CPU hosts of their own and never slow a GPU down, so here a
    device's computation takes a core first and the controllers use what is left. `plexrl run`
    and both of `plexrl demo`'s schedules run their controllers this way."""
    return ThreadPoolExecutor(count, thread_name_prefix="controller", initializer=_lower_priority)


def _lower_priority() -> None:
    if hasattr(os, "nice"):  # Linux: per thread; the runtime's threads keep theirs (runtime/threads.py)
        os.nice(CONTROLLER_NICE)


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

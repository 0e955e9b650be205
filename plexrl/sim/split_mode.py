"""Split baseline: each job owns a rollout pool and a disjoint training pool.

The rollout pool (`max(1, dp // 2)` workers) holds the sampler; the training pool (the other
workers, at least one) holds the trainer and the reference model. Synchronous on-policy RL:
the pools take turns, and the job is charged for both pools for its whole wall time.
"""

from __future__ import annotations

from plexrl.sim.latency import job_costs
from plexrl.sim.phases import REF, SAMPLER, TRAINER, states_of
from plexrl.sim.runner import Mode
from plexrl.sim.service import SimJob
from plexrl.sim.workload import Job


def pool_sizes(job: Job) -> tuple[int, int]:
    rollout = max(1, job.dp // 2)
    return rollout, max(1, job.dp - rollout)


class SplitMode(Mode):
    name = "split"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_gpus = self.cluster.gpus

    def costs_for(self, job: Job):
        return job_costs(job, self.cluster, train_workers=pool_sizes(job)[1])

    def gpus_of(self, job: Job) -> int:
        return job.tp * sum(pool_sizes(job))

    def place(self, job: SimJob) -> bool:
        spec = job.spec
        gpus = self.gpus_of(spec)
        if gpus > self.free_gpus:
            return False
        rollout, train = pool_sizes(spec)
        rollout_pool = [self.new_worker(spec.tp, job.costs.worker_bytes) for _ in range(rollout)]
        train_pool = [self.new_worker(spec.tp, job.costs.worker_bytes) for _ in range(train)]
        self.attach(job, SAMPLER, rollout_pool)
        for state in states_of(spec):
            if state in (REF, TRAINER):
                self.attach(job, state, train_pool)
        self.free_gpus -= gpus
        return True

    def release(self, job: SimJob) -> None:
        self.free_gpus += self.gpus_of(job.spec)

    def charged_gpu_s(self, job: SimJob, end: float) -> float:
        if job.started is None:
            return 0.0
        return self.gpus_of(job.spec) * ((job.finished if job.finished is not None else end) - job.started)

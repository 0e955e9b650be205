"""Split baseline: each job owns a rollout pool and a disjoint training pool.

The job's workers are cut in two: a rollout pool holding the sampler and a training pool
holding the trainer and the reference model, half and half, except that the training pool
grows (and the rollout pool shrinks, to at least one worker) until the training state fits. Synchronous on-policy RL:
the pools take turns, and the job is charged for both pools for its whole wall time.
"""

from __future__ import annotations

from plexrl.sim.latency import job_costs
from plexrl.sim.phases import REF, SAMPLER, TRAINER, states_of
from plexrl.sim.runner import Mode
from plexrl.sim.service import SimJob
from plexrl.sim.workload import Job


def pool_sizes(workers: int, train_state_bytes: int, arena_bytes: int) -> tuple[int, int]:
    """(rollout workers, training workers)."""
    train = max(workers - workers // 2, -(-train_state_bytes // arena_bytes), 1)
    return max(1, workers - train), train


class SplitMode(Mode):
    name = "split"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_gpus = self.cluster.gpus

    def pools(self, job: Job) -> tuple[int, int]:
        whole = job_costs(job, self.cluster, train_workers=1)
        return pool_sizes(self.workers_of(job), whole.trainer_bytes, whole.worker_bytes)

    def costs_for(self, job: Job):
        return job_costs(job, self.cluster, train_workers=self.pools(job)[1])

    def gpus_of(self, job: Job) -> int:
        return self.cluster.worker_gpus * sum(self.pools(job))

    def place(self, job: SimJob) -> bool:
        spec = job.spec
        gpus = self.gpus_of(spec)
        if gpus > self.free_gpus:
            return False
        rollout, train = self.pools(spec)
        rollout_pool = [self.new_worker() for _ in range(rollout)]
        train_pool = [self.new_worker() for _ in range(train)]
        self.attach(job, SAMPLER, rollout_pool)
        for state in states_of(spec):
            if state in (REF, TRAINER):
                self.attach(job, state, train_pool)
        self.free_gpus -= gpus
        return True

    def release(self, job: SimJob) -> None:
        self.free_gpus += self.gpus_of(job.spec)

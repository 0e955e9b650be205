"""Split baseline: each job owns a rollout pool and a disjoint training pool.

The job's replicas (`tp` GPUs each) are cut in two: a rollout pool holding the sampler and a
training pool holding the trainer and the reference model, half and half, except that the
training pool grows (and the rollout pool shrinks, to at least one replica) until the training
state fits its GPUs. Synchronous on-policy RL: the pools take turns, and the job is charged for
both pools for its whole wall time.
"""

from __future__ import annotations

from plexrl.sim.latency import job_costs
from plexrl.sim.phases import REF, SAMPLER, TRAINER, states_of
from plexrl.sim.runner import Mode
from plexrl.sim.service import SimJob
from plexrl.sim.workload import WorkloadJob


def pool_sizes(replicas: int, tp: int, train_state_bytes: int, gpu_bytes: int) -> tuple[int, int]:
    """(rollout GPUs, training GPUs), both whole replicas."""
    need = -(-train_state_bytes // gpu_bytes)  # GPUs the sharded training state needs
    train = max(replicas - replicas // 2, -(-need // tp), 1)
    return tp * max(1, replicas - train), tp * train


class SplitMode(Mode):
    name = "split"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_gpus = self.cluster.gpus

    def pools(self, job: WorkloadJob) -> tuple[int, int]:
        whole = job_costs(job, self.cluster, train_gpus=1)
        return pool_sizes(job.dp, job.tp, whole.trainer_bytes, whole.gpu_bytes)

    def costs_for(self, job: WorkloadJob):
        return job_costs(job, self.cluster, train_gpus=self.pools(job)[1])

    def gpus_of(self, job: WorkloadJob) -> int:
        return sum(self.pools(job))

    def place(self, job: SimJob) -> bool:
        spec = job.spec
        gpus = self.gpus_of(spec)
        if gpus > self.free_gpus:
            return False
        rollout, _ = self.pools(spec)
        workers = self.new_group(gpus)
        self.attach(job, SAMPLER, workers[:rollout])
        for state in states_of(spec):
            if state in (REF, TRAINER):
                self.attach(job, state, workers[rollout:])
        self.free_gpus -= gpus
        return True

    def release(self, job: SimJob) -> None:
        self.free_gpus += self.gpus_of(job.spec)

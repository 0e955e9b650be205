"""PlexRL: jobs share node groups; each worker time-slices the jobs placed on it.

A node group (`cluster.group_nodes` nodes) is split into workers of `tp` GPUs, the tp of the
first job placed on it, kept until the group empties; a job takes `dp` workers of one group and
its state shards stay there (affinity: no migration). Requests are scheduled per worker by the
request policy (`fcfs`, `sjf`, `hrrn`, `plexrl`), and a job is charged what it consumed:
execution plus the switch-in its dispatches caused.

Placement here is *first-fit*: the first group where the job's memory fits and where the
projected mean demand of its workers stays within capacity; within the group, the least-loaded
workers. Demand is the job's busy share of a solo step, from its first step's plan (a given
profile, DESIGN §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plexrl.sim.phases import plan_step, solo_step_s, states_of, step_rng
from plexrl.sim.runner import Mode
from plexrl.sim.service import SimJob
from plexrl.sim.worker import SimWorker

MAX_LOAD = 1.0  # projected mean busy share a worker may carry


@dataclass(eq=False)
class NodeGroup:
    gid: int
    gpus: int
    tp: int | None = None
    workers: list[SimWorker] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    host_used: list[int] = field(default_factory=list)
    jobs: dict[str, list[int]] = field(default_factory=dict)


def solo_demand(job: SimJob) -> float:
    """Mean share of a step each of the job's workers is busy when it runs alone."""
    spec = job.spec
    phases = plan_step(spec, job.costs, step_rng(job.seed, job.index, 0), spec.dp, spec.dp)
    busy = sum(sum(p.shard_s) / len(p.shard_s) for p in phases if p.state)
    return busy / solo_step_s(phases)


def host_bytes(job: SimJob) -> int:
    c = job.costs
    sizes = {"sampler": c.sampler_bytes, "ref": c.ref_bytes, "trainer": c.trainer_bytes}
    return sum(sizes[s] for s in states_of(job.spec))


class PlexRLMode(Mode):
    name = "plexrl"
    charges_reserved = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.cluster
        self.groups = [NodeGroup(g, c.group_gpus) for g in range(c.groups)]
        self.placed: dict[str, tuple[NodeGroup, list[int], float]] = {}

    def place(self, job: SimJob) -> bool:
        spec, demand, need = job.spec, solo_demand(job), host_bytes(job)
        for group in self.groups:
            chosen = self._fit(group, spec.tp, spec.dp, demand, need, job.costs.worker_bytes)
            if chosen is not None:
                self._bind(job, group, chosen, demand, need)
                return True
        return False

    def _fit(self, group: NodeGroup, tp: int, dp: int, demand: float, need: int, arena: int) -> list[int] | None:
        if group.tp is None and tp * dp <= group.gpus:
            group.tp = tp
            group.workers = [self.new_worker(tp, arena) for _ in range(group.gpus // tp)]
            group.load = [0.0] * len(group.workers)
            group.host_used = [0] * len(group.workers)
        if group.tp != tp or len(group.workers) < dp:
            return None
        order = sorted(range(len(group.workers)), key=lambda i: (group.load[i], i))[:dp]
        fits = all(
            group.load[i] + demand <= MAX_LOAD and group.host_used[i] + need <= group.workers[i].host_bytes
            for i in order
        )
        if not fits and not group.jobs:
            group.tp, group.workers, group.load, group.host_used = None, [], [], []
        return order if fits else None

    def _bind(self, job: SimJob, group: NodeGroup, chosen: list[int], demand: float, need: int) -> None:
        workers = [group.workers[i] for i in chosen]
        for state in states_of(job.spec):
            self.attach(job, state, workers)
        for i in chosen:
            group.load[i] += demand
            group.host_used[i] += need
        group.jobs[job.name] = chosen
        self.placed[job.name] = (group, chosen, demand)

    def release(self, job: SimJob) -> None:
        group, chosen, demand = self.placed.pop(job.name)
        need = host_bytes(job)
        for i in chosen:
            group.load[i] -= demand
            group.host_used[i] -= need
            group.workers[i].remove_job(job.name)
        del group.jobs[job.name]
        if not group.jobs:
            group.tp, group.workers, group.load, group.host_used = None, [], [], []

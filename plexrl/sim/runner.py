"""What every mode shares: job expansion and arrivals, the admission queue, the run, the record.

A mode decides where a job's state shards live (`place`), what it gives back when the job ends
(`release`) and what the job is charged (`charged_gpu_s`). Jobs that do not fit wait in an
admission queue, retried in arrival order whenever a job ends, in every mode, so queueing delay
and makespan compare fairly. Arrival times and every random draw depend only on the workload
seed, so all modes see the same jobs, response lengths and tool waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from plexrl.policy import Policy
from plexrl.sim.engine import EventLoop
from plexrl.sim.group import Group
from plexrl.sim.latency import gpu_arena_bytes, job_costs
from plexrl.sim.phases import StepPlans
from plexrl.sim.placement_memo import PlacementMemo
from plexrl.sim.service import SimJob, SimService
from plexrl.sim.worker import SimWorker
from plexrl.sim.workload import GB, WorkloadJob, SimCluster, Workload


def expand_jobs(workload: Workload) -> list[WorkloadJob]:
    """One `WorkloadJob` per copy, named `name-i` when count > 1, with its arrival time. Poisson arrivals
    (`PoissonArrivals`) go to the copies in an order drawn after the gaps (`mixed`), so a listed
    order and a mixed one see the same arrival times."""
    rng = np.random.default_rng((workload.seed, 0xA11))
    jobs: list[WorkloadJob] = []
    for spec in workload.jobs:
        for i in range(spec.count):
            name = spec.name if spec.count == 1 else f"{spec.name}-{i}"
            jobs.append(spec.model_copy(update={"name": name, "count": 1, "arrival_s": spec.arrival_s + i * spec.arrival_every_s}))
    if workload.poisson is not None:
        gaps = rng.exponential(3600.0 / workload.poisson.rate_per_h, size=len(jobs))
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
        if workload.poisson.order == "mixed":
            jobs = [jobs[i] for i in rng.permutation(len(jobs))]
        jobs = [j.model_copy(update={"arrival_s": float(a)}) for j, a in zip(jobs, arrivals)]
    return sorted(jobs, key=lambda j: j.arrival_s)


@dataclass
class SimJobRecord:
    name: str
    gpus: int
    arrival: float
    started: float | None
    finished: float | None
    steps: int
    step_times: list[float]
    charged_gpu_s: float  # reserved (baselines) or consumed (PlexRL)
    switch_gpu_s: float
    submitted: int
    served: int
    slack: float = 0.0  # the job's SLO: tolerated step slowdown
    solo_s: float = 0.0  # what its completed steps take alone on its GPUs, every state resident
    predicted_inflation: float | None = None  # the placer's prediction, averaged over its steps (PlexRL modes)
    shared: bool = False  # it shared a GPU with another job at some time (PlexRL modes)
    kind: str = ""  # its class: the workload entry it is one of (`JobSpec.name`)
    placed: float | None = None  # when its GPUs became its own (PlexRL: before its phase shift)
    devices: tuple[int, ...] = ()  # the GPUs it held from then, or from its last move (ids of the mode's workers)
    moves: tuple[tuple[float, tuple[int, ...]], ...] = ()  # (when, the GPUs it held until then) per move
    busy_gpu_s: float = 0.0  # GPU-seconds its calls executed (switches excluded): the work of its completed steps
    planned_steps: int = 0  # the steps it declared (`WorkloadJob.steps`)

    @property
    def realised_inflation(self) -> float | None:
        """Its completed steps' time over their solo time, minus 1: what co-tenancy (and
        switching) cost it, the figure the placer's inflation model predicts."""
        return sum(self.step_times) / self.solo_s - 1 if self.step_times and self.solo_s > 0 else None

    @property
    def queue_delay(self) -> float | None:
        return None if self.started is None else self.started - self.arrival

    @property
    def mean_step_s(self) -> float:
        return float(np.mean(self.step_times)) if self.step_times else float("nan")


@dataclass
class ModeResult:
    mode: str
    cluster_gpus: int
    records: list[SimJobRecord]
    end_s: float  # virtual time the run ended (last job end, or the horizon)
    events: int
    wall_s: float
    busy_gpu_s: float
    switch_gpu_s: float
    busy_intervals: tuple[np.ndarray, np.ndarray, np.ndarray] = field(repr=False, default=None)
    ledger: dict = field(repr=False, default_factory=dict)


class Mode:
    name = "mode"
    charges_reserved = True  # baselines pay for reserved devices; PlexRL for consumed ones
    consolidates_tail = False  # a job that owns its devices frees nothing by consolidating
    exclusive_groups = True  # each group serves one job (the baselines): no request ever competes

    def __init__(self, workload: Workload, cluster: SimCluster, policy: Policy = Policy.PLEXRL):
        self.workload, self.cluster, self.policy = workload, cluster, policy
        self.loop = EventLoop()
        self.service = SimService(self.loop, policy, self._job_done, exclusive=self.exclusive_groups)
        self.waiting: list[SimJob] = []
        self.jobs: list[SimJob] = []
        self._next_wid = 0
        self._next_gid = 0

    # --- to be provided by each mode -------------------------------------------------------------
    def place(self, job: SimJob) -> bool:
        raise NotImplementedError

    def release(self, job: SimJob) -> None:
        raise NotImplementedError

    # --- shared mechanics --------------------------------------------------------------------------
    def new_worker(self) -> SimWorker:
        """One GPU: its arena, its share of its node's host memory and disk, its own host link."""
        c = self.cluster
        worker = SimWorker(
            wid=self._next_wid,
            arena_bytes=gpu_arena_bytes(c),
            host_bytes=int(c.host_memory_gb * GB / c.gpus_per_node),
            link_bytes_per_s=c.device.host_link_gb_s * GB,
            disk_bytes_per_s=c.disk_gb_s * GB / c.gpus_per_node,
        )
        self._next_wid += 1
        return worker

    def new_group(self, gpus: int) -> list[SimWorker]:
        """`gpus` fresh GPUs under one scheduler (a job's own GPUs in the baselines)."""
        workers = [self.new_worker() for _ in range(gpus)]
        Group(self._next_gid, workers)
        self._next_gid += 1
        return workers

    def attach(self, job: SimJob, state: str, workers: list[SimWorker]) -> None:
        """Add the job's `state` to each of `workers`. A sampler keeps no host buffer of its
        own: its weights are its trainer's, and a load copies only them (its KV reserve is
        allocated on the device, never copied in or out: vLLM's sleep level 1). Samplers and
        reference models are read-only: offloading one copies nothing (the runtime lets a clean
        copy go)."""
        costs = job.costs
        nbytes = {"sampler": costs.sampler_bytes, "ref": costs.ref_bytes, "trainer": costs.trainer_bytes}[state]
        host = 0 if state == "sampler" else nbytes
        loaded = costs.ref_bytes if state == "sampler" else nbytes  # the weights alone
        for w in workers:
            w.add_state(job.state_id(state), job.name, nbytes, host, loaded, read_only=state != "trainer")
        job.hold(state, workers)

    def costs_for(self, job: WorkloadJob):
        return job_costs(job, self.cluster)

    def gpus_of(self, job: WorkloadJob) -> int:
        """GPUs the mode gives the job (reserved by the baselines)."""
        return job.gpus

    def run(self, plans: StepPlans | None = None, placements: PlacementMemo | None = None) -> ModeResult:
        """Simulate the workload; `plans` shares planned steps, `placements` the placer's answers
        (modes that place with the policy's placer), with other modes of the same workload."""
        t0 = time.perf_counter()
        plans = plans if plans is not None else StepPlans()
        for index, spec in enumerate(expand_jobs(self.workload)):
            self.cluster.check_job(spec)
            job = SimJob(spec, index, self.workload.seed, self.costs_for(spec), spec.arrival_s,
                         consolidate_tail=self.consolidates_tail, plans=plans)
            self.jobs.append(job)
            self.loop.at(spec.arrival_s, self._arrive, job)
        horizon = self.workload.horizon_s or float("inf")
        self.loop.run(until=horizon)
        self.service.finish(horizon)
        end = self.loop.now if horizon == float("inf") else horizon
        return self._result(end, time.perf_counter() - t0)

    def _arrive(self, job: SimJob) -> None:
        self.waiting.append(job)
        self._admit()

    def _admit(self) -> None:
        for job in list(self.waiting):
            if self.place(job):
                self.waiting.remove(job)
                self.service.start(job)

    def _job_done(self, job: SimJob) -> None:
        self.release(job)
        self._admit()

    def predicted(self, job: SimJob, end: float) -> tuple[float | None, bool]:
        """(the placer's predicted inflation of the job averaged over its steps, whether it shared GPUs);
        modes without a placer predict nothing."""
        return None, False

    def charged_gpu_s(self, job: SimJob, end: float) -> float:
        if job.started is None:
            return 0.0
        if self.charges_reserved:
            return self.gpus_of(job.spec) * ((job.finished if job.finished is not None else end) - job.started)
        usage = self.service.ledger.jobs.get(job.name)
        return 0.0 if usage is None else usage.consumed_device_s

    def _result(self, end: float, wall_s: float) -> ModeResult:
        ledger = self.service.ledger
        records = []
        for job in self.jobs:
            usage = ledger.jobs.get(job.name)
            predicted, shared = self.predicted(job, end)
            records.append(SimJobRecord(
                job.name, self.gpus_of(job.spec), job.arrival, job.started, job.finished, job.step,
                list(job.step_times), self.charged_gpu_s(job, end),
                0.0 if usage is None else usage.switch_s, job.submitted, job.served,
                job.spec.slack, job.solo_s(), predicted, shared, job.spec.name, job.placed,
                tuple(sorted({w.wid for workers in job.workers.values() for w in workers})), tuple(job.moves),
                0.0 if usage is None else usage.exec_s, job.spec.steps,
            ))
        s = self.service
        start, stop, gpus = np.frombuffer(s.busy, dtype=np.float64).reshape(-1, 3).T.copy()
        busy = float(np.sum((np.minimum(stop, end) - np.minimum(start, end)) * gpus))
        switch = sum(r.switch_gpu_s for r in records)
        return ModeResult(self.name, self.cluster.gpus, records, end, self.loop.events, wall_s, busy, switch,
                          (start, stop, gpus), ledger.summary())

"""The simulated service: job controllers issue calls, workers run them, the policy decides.

Every mode (colocated, split, PlexRL) runs on this one mechanism; modes differ only in which
workers a job's states are placed on and in what the job is charged. The loop per call:
  1) a controller submits one call per shard of its current phase, each pinned to the worker
     that holds that shard of the state (affinity);
  2) a free worker asks `plexrl.policy.choose` which ready call runs next (only when more than
     one is ready: with one candidate every policy picks it), makes its state resident with
     `plexrl.policy.plan_load`, and runs it non-preemptively: busy for switch + execution;
  3) the `Ledger` charges the job the execution and the switch-in its dispatch caused;
  4) when every shard of a phase is done the controller moves on (idle phases are timers).
Execution estimates for the priority are learned online (`ExecEstimator`), as in the runtime.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

from plexrl.policy import ExecEstimator, Ledger, Policy, choose
from plexrl.policy.types import Tier
from plexrl.sim.engine import EventLoop
from plexrl.sim.latency import JobCosts
import numpy as np

from plexrl.sim.phases import Phase, StepDraws, draw_steps, job_rng, plan_step
from plexrl.sim.worker import Request, SimWorker
from plexrl.sim.workload import Job

DEVICE = Tier.DEVICE


@dataclass(eq=False)
class SimJob:
    spec: Job
    index: int
    seed: int
    costs: JobCosts
    arrival: float
    replicas_per_worker: int
    workers: dict[str, list[SimWorker]] = field(default_factory=dict)  # state -> one worker per shard
    started: float | None = None
    finished: float | None = None
    step: int = 0
    step_start: float = 0.0
    step_times: list[float] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    phase_i: int = 0
    outstanding: int = 0
    submitted: int = 0
    served: int = 0
    rng: np.random.Generator | None = None
    consolidate_tail: bool = False  # PlexRL: finish each rollout's long tail on one worker
    draws: list[StepDraws] = field(default_factory=list)  # the next steps' draws, last step first

    def __post_init__(self) -> None:
        self.rng = job_rng(self.seed, self.index)

    @property
    def name(self) -> str:
        return self.spec.name

    def state_id(self, state: str) -> str:
        return f"{self.spec.name}/{state}"

    def next_phases(self) -> list[Phase]:
        rollout = len(self.workers["sampler"])
        train = len(self.workers["trainer"])
        if not self.draws:
            self.draws = draw_steps(self.spec, self.rng)[::-1]
        return plan_step(self.spec, self.costs, self.draws.pop(), rollout, train, self.replicas_per_worker,
                         self.consolidate_tail)

    def shard_workers(self, phase: Phase) -> list[SimWorker]:
        """The workers a phase's shards run on: all of its state's workers, or for a phase of
        fewer shards (a consolidated tail), a window rotating with the step to spread the load."""
        workers = self.workers[phase.state]
        k = len(phase.shard_s)
        if k == len(workers):
            return workers
        first = (self.step + self.phase_i) % len(workers)
        return (workers[first:] + workers[:first])[:k]


class Service:
    def __init__(self, loop: EventLoop, policy: Policy, on_job_done: Callable[[SimJob], None], prior_s: float = 60.0):
        self.loop = loop
        self.policy = policy
        self.on_job_done = on_job_done
        self.ledger = Ledger()
        self.estimator = ExecEstimator(prior_s=prior_s)
        self.busy_start, self.busy_end, self.busy_gpus = array("d"), array("d"), array("d")
        self._seq = 0
        self.jobs_by_name: dict[str, SimJob] = {}

    # --- controllers --------------------------------------------------------------------------
    def start(self, job: SimJob) -> None:
        job.started = self.loop.now
        self.jobs_by_name[job.name] = job
        self._begin_step(job)

    def _begin_step(self, job: SimJob) -> None:
        job.step_start = self.loop.now
        job.phases, job.phase_i = job.next_phases(), 0
        self._advance(job)

    def _advance(self, job: SimJob) -> None:
        now = self.loop.now
        while job.phase_i < len(job.phases):
            phase = job.phases[job.phase_i]
            job.phase_i += 1
            if phase.state is None:
                if phase.idle_s > 0:
                    self.loop.at(now + phase.idle_s, self._advance, job)
                    return
                continue
            sid = job.state_id(phase.state)
            workers = job.shard_workers(phase)
            job.outstanding = len(workers)
            for worker, exec_s in zip(workers, phase.shard_s, strict=True):
                self._submit(worker, Request(job.name, sid, phase.fn, exec_s, now, worker.gpus))
            job.submitted += len(workers)
            return
        job.step_times.append(now - job.step_start)
        job.step += 1
        if job.step < job.spec.steps:
            self._begin_step(job)
        else:
            job.finished = now
            self.on_job_done(job)

    # --- workers ------------------------------------------------------------------------------
    def _submit(self, worker: SimWorker, req: Request) -> None:
        if not worker.busy and not len(worker.queue):
            # fast path: an idle worker with nothing else ready runs the call at once, as every
            # policy would; the ready queue and its estimates are only built when calls compete
            self._run(worker, req)
            return
        sid = req.state_id
        worker.waiting[sid] = req
        resident = worker.wid if worker.states[sid].tier is DEVICE else -1
        est = self.estimator.estimate(sid, req.fn)
        worker.queue.add(sid, req.arrival, est, worker.load_estimate_s(sid), resident, self._seq)
        self._seq += 1
        if not worker.busy:
            self._dispatch(worker)

    def _dispatch(self, worker: SimWorker) -> None:
        queue = worker.queue
        n = len(queue)
        if n == 0:
            return
        sid = queue.key_at(0) if n == 1 else choose(self.policy, queue, worker.wid, worker.offload_estimate_s(), self.loop.now)
        queue.remove(sid)
        self._run(worker, worker.waiting.pop(sid))

    def _run(self, worker: SimWorker, req: Request) -> None:
        """Make the call's state resident, charge the job, and hold the worker until it ends."""
        now = self.loop.now
        sid = req.state_id
        state = worker.states[sid]
        switch_s = 0.0
        if state.tier is not DEVICE:
            for move in worker.make_resident(sid, now):
                self.ledger.charge_transition(req.job, worker.wid, move.kind.value, move.nbytes, move.seconds)
                switch_s += move.seconds
        state.last_used = now
        worker.current = sid
        self.ledger.record_wait(req.job, now - req.arrival)
        self.ledger.charge_exec(req.job, worker.wid, req.exec_s)
        end = now + switch_s + req.exec_s
        worker.busy = True
        worker.busy_s += switch_s + req.exec_s
        self.busy_start.append(now)
        self.busy_end.append(end)
        self.busy_gpus.append(worker.gpus)
        self.loop.at(end, self._done, (worker, req))

    def _done(self, arg: tuple[SimWorker, Request]) -> None:
        worker, req = arg
        worker.busy = False
        self.estimator.observe(req.state_id, req.fn, req.exec_s)
        job = self.jobs_by_name[req.job]
        job.served += 1
        job.outstanding -= 1
        if job.outstanding == 0:
            self._advance(job)
        if not worker.busy:
            self._dispatch(worker)

"""The simulated service: job controllers issue calls, GPU groups run them, the policy decides.

Every mode (colocated, split, PlexRL) runs on this one mechanism; modes differ only in which
GPUs a job's states are placed on, how GPUs are grouped, and what the job is charged. Per call:
  1) a controller submits one call per shard of its current phase, each pinned to its gang:
     the GPUs that hold that shard of the state (affinity) — a replica for a rollout call, all
     of the job's training GPUs for a collective;
  2) the gang's `Group` picks the calls to start by the request policy (`group.py`); a call
     with nothing to compete against starts at once, as under every policy;
  3) each GPU of the gang makes the state resident with `plexrl.policy.plan_load`; the gang
     starts together once the slowest GPU's switch is done, and runs non-preemptively;
  4) the `Ledger` charges the job, per GPU, the execution and the switch-in its dispatch
     caused (a GPU that waits in the gang for a slower GPU's switch is occupied too);
  5) when every shard of a phase is done the controller moves on (idle phases are timers).
Execution estimates for the priority are learned online (`ExecEstimator`), as in the runtime.
Elastic rollouts (PlexRL jobs that share their GPUs): a sample phase is not one call per replica
but one `Rollout` that decodes on the replicas no call runs on or waits for (`elastic_rollouts.py`).
Invariant (tested): per GPU, ledger busy time == the busy intervals recorded here.
Speed: this is the simulator's hot loop (one start and one `_done` per call). A call that
starts at once with its state resident on its whole gang (most) is started inline by
`_submit_phase` (`_hold` without a switch: no planning); the hold and the ledger charge are one
pass over the gang (`occupy_gang`, bit-identical to the Ledger's methods, tested); such a call
travels as a plain tuple (a `SimRequest` only when it queues) that carries the two moving averages
its end updates (`ExecEstimator.ewmas`: looked up once per phase, not per call). In the baselines (`exclusive`:
each group serves one job, so nothing competes and no estimate is read) a phase's calls start
together and end in one event that stands for all of them (`_run_together`; tested equal to
one event per call). Shared groups keep one event per call: ending their phases together was
measured at most 8% faster on scale-1024 even with no estimator updates at all (the calls'
starts, not their ends, dominate), and exactness would need every end in order anyway.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

from plexrl.policy import ExecEstimator, Ledger, Policy, StepClock
from plexrl.policy.types import Tier

from plexrl.sim.elastic_rollouts import ElasticRollouts, short_of_replicas
from plexrl.sim.engine import EventLoop
from plexrl.sim.group import Group
from plexrl.sim.latency import JobCosts
from plexrl.sim.phases import Phase, StepPlans, part_lengths, solo_step_s
from plexrl.sim.rollout import Decode
from plexrl.sim.worker import KIND_NAME, SimRequest, SimWorker, mark_used
from plexrl.sim.workload import WorkloadJob

DEVICE = Tier.DEVICE


@dataclass(eq=False)
class SimJob:
    spec: WorkloadJob
    index: int
    seed: int
    costs: JobCosts
    arrival: float
    workers: dict[str, list[SimWorker]] = field(default_factory=dict)  # state -> its GPUs, replicas contiguous
    placed: float | None = None  # when its GPUs became its own (PlexRL: placed; it starts after its phase shift)
    moves: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)  # (when, the GPUs it left): PlexRL's moves
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
    consolidate_tail: bool = False  # PlexRL: finish each rollout's long tail on a few replicas (its next steps)
    elastic: bool = False  # PlexRL, while it shares: its rollouts decode on whichever replicas it may use (`rollout.py`)
    tail_steps: list[bool] = field(default_factory=list)  # `consolidate_tail` as each step began
    clock: StepClock = field(default_factory=StepClock.none)  # its slack in the step (PlexRL: slack x profile period)
    phase_start: float = 0.0
    plans: StepPlans = field(default_factory=StepPlans)  # shared with other modes of the workload: planned once
    _units: dict[tuple[str, int], list[tuple[SimWorker, ...]]] = field(default_factory=dict)
    _sids: dict[str, str] = field(default_factory=dict)
    _decodes: dict[tuple[int, int], Decode] = field(default_factory=dict)  # this step's, by part (`decode`)

    def __post_init__(self) -> None:
        self._name = self.spec.name  # read on every call; the spec is a pydantic model

    @property
    def name(self) -> str:
        return self._name

    def hold(self, state: str, workers: list[SimWorker]) -> None:
        """Its `state` lives on `workers` from now on (placed or moved): the gangs cut from the
        GPUs it had go with them."""
        self.workers[state] = workers
        self._units.clear()

    def state_id(self, state: str) -> str:
        sid = self._sids.get(state)
        if sid is None:
            sid = self._sids[state] = f"{self.spec.name}/{state}"
        return sid

    def next_phases(self) -> list[Phase]:
        return self.plans.step(self.spec, self.seed, self.index, self.costs, self.step,
                               len(self.workers["sampler"]), len(self.workers["trainer"]), self.consolidate_tail)

    def solo_s(self) -> float:
        """Seconds its completed steps take alone on its GPUs with every state resident."""
        if "sampler" not in self.workers:
            return 0.0
        rollout, train = len(self.workers["sampler"]), len(self.workers["trainer"])
        return sum(solo_step_s(self.plans.step(self.spec, self.seed, self.index, self.costs, k, rollout, train,
                                               self.tail_steps[k]))
                   for k in range(self.step))

    def decode(self, part: int) -> Decode:
        """How a sample phase of `part` decodes in one turn of the current step: every turn of a
        step decodes the same lengths (`phases.part_lengths`), so it is built once per step."""
        key = (self.step, part)
        found = self._decodes.get(key)
        if found is None:
            draws = self.plans.draws(self.spec, self.seed, self.index, self.step)
            if self._decodes and next(iter(self._decodes))[0] != self.step:
                self._decodes.clear()
            found = self._decodes[key] = Decode(part_lengths(self.spec, draws, part), self.costs)
        return found

    def gangs(self, phase: Phase) -> list[tuple[SimWorker, ...]]:
        """The gang of each of a phase's shards: consecutive runs of `shard_gpus` of the state's
        GPUs; a phase of fewer shards (a consolidated tail) takes a window of them that rotates
        with the step, to spread the load."""
        units = self._units.get((phase.state, phase.shard_gpus))
        if units is None:
            gpus, g = self.workers[phase.state], phase.shard_gpus
            units = [tuple(gpus[i:i + g]) for i in range(0, len(gpus) - g + 1, g)]
            self._units[(phase.state, phase.shard_gpus)] = units
        k = len(phase.shard_s)
        if k == len(units):
            return units
        first = (self.step + self.phase_i) % len(units)
        return (units[first:] + units[:first])[:k]


class SimService:
    """The calls of every job of a mode on its GPUs: controllers, gangs, switches and charges,
    with the elastic rollouts of shared jobs beside them (`rollouts`)."""

    def __init__(self, loop: EventLoop, policy: Policy, on_job_done: Callable[[SimJob], None], prior_s: float = 60.0,
                 exclusive: bool = False):
        self.loop = loop
        self.exclusive = exclusive  # every group serves one job: no decision is ever made (baselines)
        self._together: dict[SimJob, tuple[list[float], list[tuple[SimWorker, ...]]]] = {}  # (ends, gangs)
        self.policy = policy
        self.on_job_done = on_job_done
        # called as each step of a job ends; a number it returns is seconds before the next step
        # begins (a job moved at its step boundary: its state crossing to its new GPUs)
        self.on_step: Callable[[SimJob], float | None] | None = None
        self.ledger = Ledger()
        self.estimator = ExecEstimator(prior_s=prior_s)
        self.busy = array("d")  # every call's (start, end, GPUs), flat
        self._seq = 0
        self.record = None  # a `SimRecorder` (recorder.py) when the run's events are wanted
        self.rollouts = ElasticRollouts(self)

    # --- controllers --------------------------------------------------------------------------
    def start(self, job: SimJob) -> None:
        job.started = self.loop.now
        if job.placed is None:
            job.placed = job.started
        self._begin_step(job)

    def _begin_step(self, job: SimJob, pause_s: float | None = None) -> None:
        """The job's next step begins now; its phases after `pause_s` (a move), which counts
        in the step's time."""
        job.step_start = self.loop.now
        job.clock.begin(self.loop.now)
        if pause_s:
            self.loop.at(self.loop.now + pause_s, self._phases, job)
        else:
            self._phases(job)

    def _phases(self, job: SimJob) -> None:
        job.tail_steps.append(job.consolidate_tail)
        job.phases, job.phase_i = job.next_phases(), 0
        self.advance(job)

    def advance(self, job: SimJob) -> None:
        """The job's controller moves on: its next phase, or its next step, or it is done."""
        now = self.loop.now
        while job.phase_i < len(job.phases):
            phase = job.phases[job.phase_i]
            job.phase_i += 1
            if phase.state is None:
                if phase.idle_s > 0:
                    self.loop.at(now + phase.idle_s, self.advance, job)
                    return
                continue
            self._submit_phase(job, phase)
            return
        job.step_times.append(now - job.step_start)
        job.step += 1
        if self.record is not None:
            self.record.step(job.name, job.step, now)
        pause_s = self.on_step(job) if self.on_step is not None else None
        if job.step < job.spec.steps:
            self._begin_step(job, pause_s)
        else:
            job.finished = now
            self.on_job_done(job)

    # --- groups and GPUs ------------------------------------------------------------------------
    def _submit_phase(self, job: SimJob, phase: Phase) -> None:
        if phase.fn == "sample" and job.elastic and job.tail_steps[-1]:
            self.rollouts.start(job, phase)
            return
        loop, estimator = self.loop, self.estimator
        now, sid, fn = loop.now, job.state_id(phase.state), phase.fn
        gangs = job.gangs(phase)
        n = len(gangs)
        job.outstanding = n
        job.phase_start = now
        job.submitted += n
        est_s = estimator.estimate(sid, fn)  # no call ends while a phase is submitted
        if self.exclusive and self._run_together(job, sid, fn, gangs, phase.shard_s, est_s, now):
            return
        ewmas = estimator.ewmas(sid, fn)  # the estimates each call's end updates (`_done`)
        # call i, when it starts now, ends under sequence number first + i: the numbers its
        # `loop.at` would have taken (a queued call's end is scheduled later, after all of them)
        first, ends = loop.reserve(n), []
        done, ledger, name, fast = self._done, self.ledger, job.name, self.record is None
        busy_extend = self.busy.extend
        queued: dict[int, Group] = {}  # insertion-ordered: determinism
        for i, (gang, exec_s) in enumerate(zip(gangs, phase.shard_s, strict=True)):
            group = gang[0].group
            if not group.waiting:
                for w in gang:
                    if w.busy:
                        break
                else:  # nothing to compete with: every policy starts it now
                    # most calls: `_hold` without a switch, inlined (the same floats); all of them when recorded
                    if fast and mark_used(gang, sid, now):
                        end = now + exec_s
                        occupy_gang(ledger, name, gang, exec_s, 0.0, now + est_s)
                        group.idle -= len(gang)
                        busy_extend((now, end, len(gang)))
                    else:
                        end = self._hold(job, sid, gang, exec_s, now, est_s, fn)
                    ends.append((end, first + i, done, (job, sid, fn, exec_s, gang, ewmas)))
                    continue
            req = SimRequest(job, sid, fn, exec_s, now, gang)
            group.add(self._seq, req, est_s, job.clock.deadline(now))
            self._seq += 1
            queued[group.gid] = group
        loop.at_all_reserved(ends)
        for group in queued.values():
            self.dispatch(group)

    def dispatch(self, group: Group) -> None:
        estimator, now = self.estimator, self.loop.now
        for req in group.select(self.policy, now):
            job, sid, fn, exec_s, gang = req.job, req.state_id, req.fn, req.exec_s, req.gang
            end = self._hold(job, sid, gang, exec_s, req.arrival, estimator.estimate(sid, fn), fn)
            self.loop.at(end, self._done, (job, sid, fn, exec_s, gang, estimator.ewmas(sid, fn)))

    def _hold(self, job: SimJob, sid: str, gang: tuple[SimWorker, ...], exec_s: float, arrival: float,
              est_s: float, fn: str) -> float:
        """Make the call's state resident on every GPU of its gang, charge the job, and hold
        the gang; returns when the call ends. `est_s` is the call's current execution estimate."""
        now = self.loop.now
        resident = mark_used(gang, sid, now)
        switch_s = 0.0 if resident else self.switch_in(gang, job.name, sid, now)  # resident everywhere: most calls
        expected_end = now + switch_s + est_s
        occupy_gang(self.ledger, job.name, gang, exec_s, now - arrival, expected_end)
        gang[0].group.idle -= len(gang)
        end = now + switch_s + exec_s
        self.busy.extend((now, end, len(gang)))
        if self.record is not None:
            self.record.call(job.name, sid, fn, gang, arrival, now, switch_s, end)
        return end

    def switch_in(self, gang: tuple[SimWorker, ...], job: str, sid: str, now: float) -> float:
        """Make state `sid` resident on every GPU of the gang where it is not; charge `job` each
        GPU's moves, and a GPU held in the gang while a slower GPU switches its wait; returns
        the gang's switch seconds."""
        switch = [self._load(w, job, sid, now) if w.states[sid].tier is not DEVICE else 0.0 for w in gang]
        switch_s = max(switch)
        for w, own_s in zip(gang, switch):
            if own_s < switch_s:  # held in the gang while a slower GPU switches
                self.ledger.charge_transition(job, w.wid, "gang_wait", 0, switch_s - own_s)
        return switch_s

    def _load(self, worker: SimWorker, job: str, sid: str, now: float) -> float:
        seconds = 0.0
        moves = worker.make_resident(sid, now)
        for move in moves:
            self.ledger.charge_transition(job, worker.wid, KIND_NAME[move.kind], move.nbytes, move.seconds)
            seconds += move.seconds
        if self.record is not None:
            self.record.moves(worker, job, now, moves)
        return seconds

    def _run_together(self, job: SimJob, sid: str, fn: str, gangs: list[tuple[SimWorker, ...]],
                      shard_s: tuple[float, ...], est_s: float, now: float) -> bool:
        """Exclusive groups: start every call of the phase now and end them in one event, at
        the last call's end and sequence number, which is where that call's `_done` would run.
        Nothing else reads these GPUs in between and no decision reads the estimates, so only
        the event count (`EventLoop.count`) and `served` need the earlier ends. False, with
        nothing started, when some gang is not free."""
        for gang in gangs:
            if gang[0].group.waiting or not _all_idle(gang):
                return False
        hold = self._hold
        ends = [hold(job, sid, gang, exec_s, now, est_s, fn) for gang, exec_s in zip(gangs, shard_s, strict=True)]
        first = self.loop.reserve(len(ends))  # call i's end takes sequence number first + i
        last = 0  # the latest end; a tie goes to the later call (the larger sequence number)
        for i in range(1, len(ends)):
            if ends[i] >= ends[last]:
                last = i
        self._together[job] = (ends, gangs)
        self.loop.at_reserved(ends[last], first + last, self._done_together, job)
        return True

    def _done_together(self, job: SimJob) -> None:
        ends, gangs = self._together.pop(job)
        for gang in gangs:
            for w in gang:
                w.busy = False
            gang[0].group.idle += len(gang)
        self.loop.count(len(ends) - 1)  # this handler is the last call's end; the others ended before
        job.served += len(ends)
        job.outstanding = 0
        self.advance(job)

    def finish(self, until: float) -> None:
        """At the horizon: count the calls of phases ending together that ended by `until`, and
        charge the rollouts' segments running then up to it."""
        self.rollouts.finish(until)
        for job, (ends, _) in self._together.items():
            ended = sum(1 for end in ends if end <= until)
            job.served += ended
            self.loop.count(ended)

    def _done(self, call: tuple) -> None:
        """One call's end; `call` is (job, state id, function, execution seconds, gang, and the
        two moving averages its duration updates: `ExecEstimator.ewmas`)."""
        job, _, _, exec_s, gang, (own, shared) = call
        for w in gang:
            w.busy = False
        group = gang[0].group
        group.idle += len(gang)
        own.update(exec_s)  # `ExecEstimator.observe`, with its two look-ups done at submission
        shared.update(exec_s)
        job.served += 1
        job.outstanding -= 1
        if job.outstanding == 0:
            job.clock.delayed(self.loop.now - job.phase_start - max(job.phases[job.phase_i - 1].shard_s))
            self.advance(job)
        if group.waiting:  # `select` starts nothing from an empty queue
            self.dispatch(group)
        if group.rollouts and short_of_replicas(group.rollouts):
            self.rollouts.rebalance(group)


def occupy_gang(ledger: Ledger, job: str, gang: tuple[SimWorker, ...], exec_s: float, wait_s: float,
                expected_end: float) -> None:
    """Hold every GPU of the gang (busy, expected to end at `expected_end`) and charge the job: `Ledger.charge_exec` on every GPU, then `Ledger.record_wait`,
    inlined for the hot path: the same additions in the same order, so the figures are
    bit-identical (tested against the Ledger's own methods)."""
    usage, device_busy = ledger.jobs[job], ledger.device_busy_s
    total, wall = usage.exec_s, usage.exec_wall_s  # summed in locals: the same additions, fewer writes
    for w in gang:
        total += exec_s
        wall += exec_s
        device_busy[w.wid] += exec_s
        w.busy = True
        w.expected_end = expected_end
    usage.exec_s, usage.exec_wall_s = total, wall
    usage.queue_wait_s += wait_s
    usage.requests += 1


def _all_idle(gang: tuple[SimWorker, ...]) -> bool:
    for w in gang:
        if w.busy:
            return False
    return True

"""PlexRL: jobs share node groups; each worker time-slices the jobs placed on it.

Placement is the policy's: `plexrl.policy.Placer` (phase shift, the default) or `FirstFit`,
fed the job's demand profile (`profiles.py`) through the policy's `AdmissionQueue`, which
retries waiting jobs whenever a job ends. The placer's *devices* are GPUs (our workers) and
its node groups are the cluster's; each node group is one `Group` whose scheduler dispatches
the requests of every job placed on it (`group.py`). A job's state shards stay on the GPUs it
was placed on (affinity), laid out node by node so a replica's `tp` GPUs share a node whenever
the placer gave the job whole replicas per node, until it moves at a step boundary: while jobs
wait, a job alone on its GPUs moves when that lets a waiting job start on what it leaves, onto
GPUs nobody uses or into a share every tenant's judgement accepts; while none waits, a job
that shares GPUs moves onto GPUs nobody uses where there are some (`_on_step`,
`AdmissionQueue.move`); `plexrl-nomove` never moves one. A placement's phase shift
delays the job's first step by that much. The loop is closed: as a job's steps end, its
measured inflation goes back to the placer (`Placer.observe`), which judges its tenants by it
when the next job asks for their devices. A job is charged what it consumed: execution plus
the switch-in its dispatches caused, per GPU. Each rollout call is one replica, so GPUs come
back as their replicas finish. A job that shares its GPUs with another job consolidates each
rollout's long tail onto `TAIL_REPLICAS` replicas (`latency.consolidated_shards`): the other
replicas' GPUs go to its co-tenants instead of idling through the tail. A job alone on its GPUs
consolidates too when that is its own bargain and nobody else pays for it (a job's slack is its
own): its solo step with the tail consolidated is slower (the tail's re-prefill and its larger
batch per replica, ~3%) by no more than its slack and spends fewer busy GPU-seconds (the bill it
pays, for the same tokens) by more than its slower step holds its GPUs longer (`tail_pays`), and
no job waits for a place: while one does, the longer hold of its GPUs would delay the queue, and
the GPUs its tail frees serve nobody unless the placer puts a job beside it (its profile for the
placer is the consolidated one, so they are offered; then it shares, and consolidates for that).
The choice is made as each step begins, from who is placed on the job's GPUs and whether a job
waits (`Tail.SHARED`); `plexrl-alltail` consolidates every step of every job (`Tail.ALWAYS`),
`plexrl-wholetail` none (`Tail.NEVER`). A step that consolidates while it shares is also elastic
(`rollout.py`; alone its rollouts are dealt once, as the baselines' are):
each rollout turn decodes on whichever of the job's replicas no call runs on or waits for, and
the replicas move between the group's rollouts as they come and go (`plexrl-pinned`: dealt
once to every replica, as the baselines do). A job's profile for the placer says which of its
calls are elastic rollouts (`profiles.call_moments`; not in `plexrl-pinned` nor
`plexrl-wholetail`), so the co-tenancy model lets its turns share a co-tenant's rollouts'
replicas instead of waiting for them (`placement.cotenancy.wait_s`; `plexrl bench cotenancy`).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable

from plexrl.policy import StepClock
from plexrl.policy.admission import AdmissionQueue, Forecast, measured_inflation
from plexrl.policy.placement import Placement, Placer
from plexrl.policy.profile import JobProfile
from plexrl.policy.resources import ResourceView
from plexrl.sim.group import Group
from plexrl.sim.latency import gpu_arena_bytes
from plexrl.sim.phases import StepPlans, states_of
from plexrl.sim.placement_memo import MemoPlacer, PlacementMemo
from plexrl.sim.profiles import job_profile
from plexrl.sim.runner import Mode, ModeResult
from plexrl.sim.service import SimJob
from plexrl.errors import ConfigError
from plexrl.sim.workload import GB, SimCluster


class Tail(str, Enum):
    """When a job's rollouts consolidate their long tail."""

    SHARED = "shared"  # while another job is placed on its GPUs (the default)
    ALWAYS = "always"
    NEVER = "never"


SLOT_S = 5.0  # placer horizon slot: 1,024 slots cover ~85 minutes, a few steps of most jobs
HORIZON_SLOTS = 1024


def resource_view(cluster: SimCluster) -> ResourceView:
    c = cluster
    return ResourceView.uniform(
        pods=c.pods,
        groups_per_pod=c.nodes_per_pod // c.group_nodes,
        nodes_per_group=c.group_nodes,
        devices_per_node=c.gpus_per_node,
        device_bytes=gpu_arena_bytes(c),
        host_bytes=int(c.host_memory_gb * GB),
    )


def replica_order(devices: tuple[int, ...], gpus_per_node: int, tp: int) -> list[int]:
    """The job's GPUs ordered so each run of `tp` is one replica: whole replicas node by node
    first, then the leftovers (a replica that must span nodes, only when the placer split the
    job unevenly over nodes)."""
    by_node: dict[int, list[int]] = {}
    for d in sorted(devices):
        by_node.setdefault(d // gpus_per_node, []).append(d)
    whole, rest = [], []
    for gpus in by_node.values():
        cut = len(gpus) - len(gpus) % tp
        whole += gpus[:cut]
        rest += gpus[cut:]
    return whole + rest


def tail_pays(whole: JobProfile, consolidated: JobProfile) -> bool:
    """Whether a job alone on its GPUs consolidates its rollouts' tails (`whole`, `consolidated`:
    its solo step without and with): its slower step then stays within its slack, and the busy
    GPU-seconds it no longer spends (its bill, for the same tokens) exceed the GPU-seconds its
    slower step holds longer (its GPUs times the extra seconds), so the cluster gets GPU-time back.
    A 30B job whose tail idles most of its replicas saves several times what it holds longer; a 7B
    job saves less than it holds."""
    extra_held = whole.devices * (consolidated.period_s - whole.period_s)
    return (whole.busy_device_s - consolidated.busy_device_s > extra_held
            and consolidated.period_s <= whole.period_s * (1.0 + whole.slack))


class PlexRLMode(Mode):
    name = "plexrl"
    charges_reserved = False
    exclusive_groups = False  # jobs share node groups: every call goes through the request policy

    def __init__(self, *args, placer: Callable[..., Placer] = Placer, tail: Tail = Tail.SHARED,
                 feedback: bool = True, elastic: bool = True, move_jobs: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.tail = Tail(tail)
        self.elastic = elastic
        view = resource_view(self.cluster)
        self.empty_view = resource_view(self.cluster)
        self.workers = {d: self.new_worker() for g in view.groups for d in g.devices}
        for gid, g in enumerate(view.groups):
            Group(gid, [self.workers[d] for d in g.devices])
        self.admission = AdmissionQueue(placer(view, HORIZON_SLOTS, SLOT_S, pack_limit=self.workload.pack_limit,
                                                     by_effect=self.workload.pack_by_effect))
        self.by_name: dict[str, SimJob] = {}
        self.forecasts: dict[str, Forecast] = {}  # placed jobs' predicted inflation over time
        self.measured: dict[str, float] = {}  # the inflation last told to the placer, per job
        self.profiles: dict[str, JobProfile] = {}
        self.lone_tail: dict[str, bool] = {}  # whether the job consolidates its tails alone too (`tail_pays`)
        self.queued = False  # some job waits for a place (then no job consolidates alone)
        self.feedback, self.move_jobs = feedback, move_jobs
        if feedback or move_jobs:
            self.service.on_step = self._on_step

    @property
    def moves(self) -> int:
        """Moves of jobs at their step boundaries (to let a waiting job start, or out of a share)."""
        return sum(len(job.moves) for job in self.by_name.values())

    @property
    def consolidates_tail(self) -> bool:
        """Whether jobs may consolidate: their profile for the placer is the job as it shares."""
        return self.tail is not Tail.NEVER

    def run(self, plans: StepPlans | None = None, placements: PlacementMemo | None = None) -> ModeResult:
        if placements is not None:
            self.admission.placer = MemoPlacer(self.admission.placer, placements)
        return super().run(plans)

    def _arrive(self, job: SimJob) -> None:
        self.by_name[job.name] = job
        profile = job_profile(job.spec, job.costs, job.seed, job.index, self.consolidates_tail, job.plans,
                              elastic=self.elastic)
        if len(self.empty_view.feasible_groups(profile)) == 0:
            raise ConfigError(f"job {job.name!r} can never be placed, even on an empty cluster: "
                              f"{self.empty_view.shortfall(profile)}")
        if self.consolidates_tail:
            whole = job_profile(job.spec, job.costs, job.seed, job.index, False, job.plans)
            self.lone_tail[job.name] = self.tail is Tail.SHARED and tail_pays(whole, profile)
        self.profiles[job.name] = profile
        job.clock = StepClock(job.spec.slack, profile.period_s)
        decision = self.admission.submit(profile, self.loop.now)
        if isinstance(decision, Placement):
            self._launch(job, decision)
        self._queue_changed()

    def _job_done(self, job: SimJob) -> None:
        tenants = self._cotenants(job)
        for worker in job.workers["trainer"]:
            worker.remove_job(job.name)
        now = self.loop.now
        self.forecasts[job.name].close(now)
        admissions = self.admission.release(job.name, now)
        self._cotenants_changed(tenants)
        for admission in admissions:
            self._launch(self.by_name[admission.job], admission.placement)
        self._queue_changed()

    def _launch(self, job: SimJob, placement: Placement) -> None:
        workers = [self.workers[d] for d in replica_order(placement.devices, self.cluster.gpus_per_node, job.spec.tp)]
        for state in states_of(job.spec):
            self.attach(job, state, workers)
        self.forecasts[job.name] = Forecast(self.loop.now)
        job.placed = self.loop.now
        self._cotenants_changed(self._cotenants(job) | {job.name})
        self.loop.at(self.loop.now + placement.phase_shift_s, self.service.start, job)

    def _on_step(self, job: SimJob) -> float | None:
        """A step of `job` ended: the closed loop's measurement, then a move (the seconds its
        next step waits for it; `AdmissionQueue.move`): while jobs wait, if moving it lets one
        start, which is launched on the GPUs it leaves at once; while none does, out of a share
        onto GPUs nobody uses (sharing lasts as long as it lets jobs start, and a shared job runs
        slower than alone)."""
        if self.feedback:
            self._measure(job)
        if not self.move_jobs or job.step >= job.spec.steps:
            return None
        found = self.admission.move(job.name, self.loop.now)
        if found is None:
            return None
        moved, admission = found
        pause_s = self._move(job, moved)
        if admission is not None:
            self._launch(self.by_name[admission.job], admission.placement)
            self._queue_changed()
        return pause_s

    def _move(self, job: SimJob, moved: Placement) -> float:
        """`job` goes to `moved` at its step boundary; the seconds its next step waits. Its host
        copies (trainer, reference) cross to its new nodes at `network_gb_s` per GPU, a pause
        before its next step that counts in that step's time; each state then loads onto its
        new GPUs at its first call (a switch). Its old and new co-tenants are told."""
        before = self._cotenants(job)
        old = job.workers["trainer"]  # every state of a PlexRL job is on the same GPUs (wid = device id)
        pause_s = 0.0
        if set(old) != {self.workers[d] for d in moved.devices}:
            job.moves.append((self.loop.now, tuple(sorted(w.wid for w in old))))
            node = self.cluster.gpus_per_node
            if {d // node for d in moved.devices} - {w.wid // node for w in old}:  # it left its nodes
                host = sum(r.host_nbytes for r in old[0].states.values() if r.job == job.name)  # per GPU
                pause_s = host / (self.cluster.network_gb_s * GB)
            for worker in old:
                worker.remove_job(job.name)
            workers = [self.workers[d] for d in replica_order(moved.devices, self.cluster.gpus_per_node, job.spec.tp)]
            for state in states_of(job.spec):
                self.attach(job, state, workers)
            self.measured.pop(job.name, None)
        self._cotenants_changed(before | self._cotenants(job) | {job.name})
        return max(pause_s, moved.phase_shift_s)

    def _measure(self, job: SimJob) -> None:
        """Closed loop: tell the placer the job's measured inflation, its last `policy.MEASURED_STEPS`
        steps against its profile's period (what a runtime measures too), when it moved by a
        point or more."""
        inflation = measured_inflation(job.step_times, self.profiles[job.name].period_s)
        if self.measured.get(job.name) != inflation:
            self.measured[job.name] = inflation
            self.admission.placer.observe(job.name, inflation)

    def _cotenants(self, job: SimJob) -> set[str]:
        return {r.job for w in job.workers["trainer"] for r in w.states.values()} - {job.name}

    def _cotenants_changed(self, jobs: set[str]) -> None:
        """For each of `jobs`, whose co-tenants changed: record what the placer now predicts for
        it, and whether it consolidates its rollouts' tails from its next step on."""
        placer, now = self.admission.placer, self.loop.now
        for name in sorted(jobs):
            job = self.by_name[name]
            shared = bool(self._cotenants(job))
            forecast = self.forecasts[name]
            if forecast.closed is None:
                forecast.update(now, placer.inflation_of(name), shared)
            self._set_tail(job, shared)

    def _set_tail(self, job: SimJob, shared: bool) -> None:
        """Whether `job` consolidates its rollouts' tails from its next step on (module docstring);
        its rollouts are elastic only while it shares (alone they are dealt once, as the baselines'
        are: no job runs faster than alone)."""
        alone_pays = self.lone_tail.get(job.name, False) and not self.queued
        job.consolidate_tail = self.tail is Tail.ALWAYS or (self.tail is Tail.SHARED and (shared or alone_pays))
        job.elastic = self.elastic and job.consolidate_tail and (shared or self.tail is Tail.ALWAYS)

    def _queue_changed(self) -> None:
        """Whether a job waits may have changed: the placed jobs alone whose tails pay decide again."""
        queued = self.admission.queued > 0
        if queued == self.queued:
            return
        self.queued = queued
        for name, forecast in self.forecasts.items():
            if forecast.closed is None and self.lone_tail.get(name, False):
                job = self.by_name[name]
                self._set_tail(job, bool(self._cotenants(job)))

    def predicted(self, job: SimJob, end: float) -> tuple[float | None, bool]:
        forecast = self.forecasts.get(job.name)
        return (None, False) if forecast is None else (forecast.mean(end), forecast.shared)

    def waiting_reasons(self) -> dict[str, str]:
        return {w.profile.job: w.reason for w in self.admission.waiting}


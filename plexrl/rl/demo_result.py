"""What `plexrl demo` reports: its figures as typed records, and the one JSON object they make.

`DemoSummary` is the whole report; its groups (`PlacerFigures`, `ScheduleFigures`,
`DeviceFigures`, `RunSettings`) and each job's `JobFigures` are plain dataclasses, built by
`demo_figures.summarise` from the runs and read by the views (`demo_view`, `demo_plots`).
Invariants: `DemoSummary.as_json()` is the object `plexrl demo --json` prints and summary.json
holds, flat, with its keys in the order of the fields below (a group's fields where the group
stands); these keys are documented (docs/guides/run-jobs.md) and read by tests and scripts, so
a field renamed here renames a published figure. Values are JSON's own types: no dataclass,
enum or numpy value reaches `as_json()`'s output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict


class ScheduleRow(TypedDict):
    """One job in an exclusive schedule (run or computed): its device and its seconds from the
    schedule's start."""

    name: str
    device: int
    start_s: float
    end_s: float


class PairRun(TypedDict):
    """One pair of runs, the exclusive schedule then the multiplexed one (`--repeat`)."""

    makespan_mux_s: float
    makespan_exclusive_s: float
    makespan_mux_vs_exclusive: float
    device_busy_mux_vs_exclusive: float
    identical_rewards: bool


@dataclass
class JobFigures:
    """One job: rewards and step times in each run, its slowdown against its slack, what the
    placer predicted for it, and the device time it consumed (multiplexed) or reserved (alone)."""

    name: str
    algorithm: str
    task: str
    steps: int
    reward_first: float  # the mean reward of the first quarter of its multiplexed steps
    reward_last: float  # ... and of the last quarter
    reward_window_steps: int
    identical_rewards: bool  # dedicated, exclusive and multiplexed
    rewards_mux: list[float]
    rewards_dedicated: list[float]
    step_s_mux: float
    step_s_dedicated: float
    step_s_exclusive: float
    # its SLO: the mean step multiplexed against alone, minus 1, and whether that stays within its slack
    slack: float
    slowdown: float
    within_slack: bool
    # the part of the slowdown that is waiting for devices held by other jobs; the rest is its calls
    # and its controller running slower on a host shared with the others (here: the devices' cores)
    slowdown_waiting: float
    slowdown_other: float
    # the placer's co-tenancy model for it: the step inflation it predicted, averaged over the
    # job's time placed with a measured profile (None: never measured); whether its placement
    # is still the provisional one, made on a guess without a slack check (a job brought no profile)
    inflation_predicted: float | None
    placement_provisional: bool | None
    replacement_refused: str | None  # the placer's reason, when it kept the job put
    # the devices its calls keep busy alone (its dedicated run), and the placer's model on the
    # profiles measured alone (`demo_figures.predicted_from_alone`)
    busy_share_dedicated: float | None
    inflation_predicted_alone: float | None
    consumed_device_s: float
    switch_s: float
    queue_wait_s: float
    reserved_device_s: float  # one device, held for the job's whole run
    dedicated_busy_s: float


@dataclass
class PlacerFigures:
    """The placer's predicted inflation against the realised slowdown, as `plexrl sim` reports
    it, and against the part of it that is waiting for devices (what the co-tenancy model is a
    model of); the same model on the profiles measured alone, and the devices the jobs' calls
    keep busy alone, together (the pool has `MUX_DEVICES`). None: nothing to compare."""

    inflation_mae: float | None
    inflation_mae_waiting: float | None
    inflation_mae_waiting_alone: float | None
    busy_shares_dedicated: float | None
    profiles_unmeasured: int
    placements_provisional: int


@dataclass
class ScheduleFigures:
    """Makespans and job completion times (every job arrives at the start: queueing for a device
    plus its run), multiplexed against the exclusive schedule run on the same devices, and
    against exclusive schedules computed from the dedicated runs (each had the other core for
    its controller, at another time)."""

    makespan_mux_s: float
    makespan_exclusive_s: float
    makespan_mux_vs_exclusive: float
    device_busy_mux_vs_exclusive: float
    makespan_exclusive_computed_s: float
    makespan_mux_vs_exclusive_computed: float
    makespan_exclusive_longest_first_s: float  # had the jobs arrived longest first: a stronger baseline
    makespan_sequential_s: float  # one after another on one device
    exclusive_schedule: list[ScheduleRow]
    exclusive_schedule_computed: list[ScheduleRow]
    jct_mux_s: dict[str, float]
    jct_exclusive_s: dict[str, float]
    jct_mean_mux_s: float
    jct_mean_exclusive_s: float
    jct_mean_mux_vs_exclusive: float


@dataclass
class DeviceFigures:
    """Where the devices' time went. Device-seconds held: multiplexed, both devices for the whole
    makespan; exclusive, either the devices for its makespan (a cluster reserved for the batch)
    or only each job's own device for its run (devices handed back the moment a job ends). The
    same calls' device time (charged: on CPU devices their CPU) in each run: the three runs happen
    one after another, so when the host's speed moves between them (a shared machine) the
    makespans carry it (`device_busy_mux_vs_exclusive`: above 1, the multiplexed run's devices
    computed the same work slower). On a CPU machine this process's CPU over the multiplexed run
    (controllers, the runtime's dispatch) competes with the devices for the same cores."""

    devices: int
    device_s_held_mux: float
    device_s_held_exclusive: float
    device_s_held_exclusive_jobs: float
    switches: int
    device_budget: dict  # per device: its reserve, and what states may use (`demo_figures.budget_split`)
    switch_overhead: float
    device_utilisation_mux: float
    host_cpu_s_mux: float
    host_cpu_s_exclusive: float
    cpu_cores: int
    device_busy_s_dedicated: float
    device_busy_s_exclusive: float
    device_busy_s_mux: float
    makespan_mux_floor_s: float


@dataclass
class RunSettings:
    """How the demo ran: its options, and the read replicas as the multiplexed cluster resolved them."""

    policy: str
    read_replicas: bool
    engine: str
    quick: bool
    out: str


@dataclass
class DemoSummary:
    """The demo's report: per job, then the groups, then every pair of runs (`--repeat`).
    `identical_rewards`: every job's rewards the same dedicated, exclusive and multiplexed, in
    every pair of runs; `within_slack`: the share of jobs within their SLO."""

    jobs: list[JobFigures]
    cost_reduction: float
    identical_rewards: bool
    within_slack: float
    placer: PlacerFigures
    schedules: ScheduleFigures
    device_use: DeviceFigures
    settings: RunSettings
    repeats: list[PairRun]  # the first pair's figures are the summary's own
    makespan_mux_vs_exclusive_median: float

    def as_json(self) -> dict:
        """The flat JSON object: each group's fields in its place."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                out.update(dataclasses.asdict(value))
            elif f.name == "jobs":
                out["jobs"] = [dataclasses.asdict(job) for job in value]
            else:
                out[f.name] = value
        return out

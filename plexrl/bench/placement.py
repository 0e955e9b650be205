"""`plexrl bench placement [--json]`: how long a placement decision takes, and what phase shift buys.

1. Decision time: jobs with random RL-like profiles are placed one after another (time moves
   on between arrivals) on a cluster of pods x node groups, with a horizon of H slots; each
   `place` call (decide + commit) is timed. Default: 200 jobs, 256 node groups, 1,024 slots;
   the target is under 20 ms per decision. `--runtime`: the same jobs admitted through the
   runtime's control plane instead (`runtime.job_placer.JobPlacer.admit`, its placer pooled
   as the runtime builds it, a job that must wait refused at once), each admission timed.
2. Contention: the same random mixes are placed by the Placer, by the Placer without phase
   shifts and by first-fit, on a cluster whose host memory forces jobs to share groups; the
   projected overload (device-seconds over the horizon) of each is reported, and the ratio
   placer / first-fit (lower is better).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from plexrl.bench.common import emit
from plexrl.policy.placement import FirstFit, Placement, Placer
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import ResourceView

GiB = 2**30


def random_profile(rng: np.random.Generator, job: str, devices: int, period_slots: int,
                   slot_s: float = 1.0, host_bytes: int = 40 * GiB, slack: float = 0.10) -> JobProfile:
    """An RL step: a rollout phase whose busy devices trail off (the long tail), an idle gap
    (rewards, sandboxes), then a short training phase on all devices."""
    rollout = int(rng.integers(period_slots // 5, period_slots // 2 + 1))
    train = int(rng.integers(max(1, period_slots // 10), period_slots // 4 + 1))
    tail = np.linspace(1.0, rng.uniform(0.1, 0.5), rollout) ** 2
    demand = np.zeros(period_slots)
    demand[:rollout] = devices * tail
    demand[period_slots - train:] = devices
    models = (ModelMemory("policy", 20 * GiB, host_bytes), ModelMemory("reference", 8 * GiB, 0))
    return JobProfile(job, period_slots * slot_s, tuple(demand), devices, models, slack)


def time_decisions(jobs: int = 200, pods: int = 16, groups_per_pod: int = 16, slots: int = 1024,
                   seed: int = 0, runtime: bool = False) -> dict:
    """Place `jobs` random jobs one by one (through the runtime's `JobPlacer.admit` with
    `runtime`); return per-decision times and outcomes."""
    rng = np.random.default_rng(seed)
    view = ResourceView.uniform(pods, groups_per_pod, nodes_per_group=2, devices_per_node=4,
                                device_bytes=80 * GiB, host_bytes=512 * GiB)
    place = _runtime_admission(view, slots) if runtime else Placer(view, horizon_slots=slots, slot_s=1.0).place
    times_ms, placed = [], 0
    for i in range(jobs):
        devices = int(rng.choice([1, 2, 4, 8]))
        profile = random_profile(rng, f"job{i}", devices, int(rng.integers(16, 257)))
        now = 5.0 * i
        t0 = time.perf_counter()
        decision = place(profile, now)
        times_ms.append((time.perf_counter() - t0) * 1e3)
        placed += isinstance(decision, Placement)
    ms = np.asarray(times_ms)
    return {
        "jobs": jobs, "node_groups": pods * groups_per_pod, "horizon_slots": slots, "runtime": runtime,
        "placed": placed, "waited": jobs - placed,
        "decision_ms_p50": float(np.percentile(ms, 50)), "decision_ms_p99": float(np.percentile(ms, 99)),
        "decision_ms_max": float(ms.max()), "decision_ms_mean": float(ms.mean()),
    }


def _runtime_admission(view: ResourceView, slots: int):
    """`place(profile, now)` through the runtime's control plane: `JobPlacer.admit` as the
    runtime's `Control` builds it (`ClusterConfig`'s defaults), a job that must wait refused
    at once (timeout 0) and answered as a Wait."""
    from plexrl.api.errors import AdmissionTimeout
    from plexrl.policy.placement import Wait
    from plexrl.runtime.config import ClusterConfig
    from plexrl.runtime.job_placer import JobPlacer

    config = ClusterConfig()
    admission = JobPlacer(view, horizon_slots=slots, slot_s=1.0, placement=config.placement,
                          profile_steps=config.profile_steps, pack_limit=config.pack_limit)

    def place(profile: JobProfile, now: float):
        try:
            return admission.admit(profile, profile.slack, False, lambda: now, 0.0, ends=True)
        except AdmissionTimeout as refused:
            return Wait(str(refused))
    return place


def contention(seeds: int = 5, groups: int = 8, jobs_per_group: int = 3, slots: int = 512) -> dict:
    """Projected overload of phase-shift placement vs no shift vs first-fit on random mixes.

    Every group has 4 devices and host room for exactly `jobs_per_group` jobs of 4 devices, and
    that many jobs arrive, so all three fill every group; only who shares a group, and with
    what shift, differs. Slack is unlimited so nobody waits and the same jobs are compared.
    """
    totals = {"placer": 0.0, "no_shift": 0.0, "first_fit": 0.0}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        mix = [random_profile(rng, f"job{i}", 4, int(rng.choice([16, 24, 32, 48, 64])),
                              host_bytes=100 * GiB, slack=np.inf)
               for i in range(groups * jobs_per_group)]
        for name, make in (("placer", Placer), ("no_shift", _no_shift), ("first_fit", FirstFit)):
            view = ResourceView.uniform(1, groups, 1, 4, 80 * GiB, jobs_per_group * 4 * 100 * GiB)
            placer = make(view, horizon_slots=slots, slot_s=1.0)
            for profile in mix:
                assert isinstance(placer.place(profile, 0.0), Placement)
            totals[name] += placer.overload_s()
    return {
        "overload_device_s": totals,
        "contention_ratio_vs_first_fit": totals["placer"] / totals["first_fit"],
        "contention_ratio_no_shift_vs_first_fit": totals["no_shift"] / totals["first_fit"],
    }


def _no_shift(view: ResourceView, **kwargs) -> Placer:
    return Placer(view, max_shifts=1, **kwargs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench placement", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--groups-per-pod", type=int, default=16)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=5, help="random mixes for the contention comparison")
    parser.add_argument("--runtime", action="store_true",
                        help="time admission through the runtime's control plane (JobPlacer.admit)")
    args = parser.parse_args(argv)
    result = time_decisions(args.jobs, args.pods, args.groups_per_pod, args.slots, runtime=args.runtime)
    result.update(contention(seeds=args.seeds))
    result["target_ms"] = 20.0
    emit("placement", result, args.json, _print_table)
    return 0


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    where = "the runtime's admission" if result["runtime"] else "the placer"
    table = Table(title=f"placement ({where}): {result['jobs']} jobs, {result['node_groups']} node groups, "
                        f"{result['horizon_slots']}-slot horizon")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("decision_ms_p50", "decision_ms_p99", "decision_ms_max", "target_ms"):
        table.add_row(key, f"{result[key]:.2f}")
    table.add_row("placed / waited", f"{result['placed']} / {result['waited']}")
    for name, value in result["overload_device_s"].items():
        table.add_row(f"overload device-s, {name}", f"{value:.0f}")
    table.add_row("contention ratio placer / first-fit", f"{result['contention_ratio_vs_first_fit']:.3f}")
    table.add_row("contention ratio no-shift / first-fit", f"{result['contention_ratio_no_shift_vs_first_fit']:.3f}")
    Console().print(table)

"""The demo's figures, computed from its runs (`demo_experiment.DemoRuns`) into a `DemoSummary`.

Compare: reward curves (must be identical: every sample has an explicit seed), device-seconds
consumed vs reserved, makespan multiplexed vs exclusive on the same devices (and vs one after
another on one device), each job's completion time (every job arrives at the start, so
queueing for a device is part of it) and their mean under both schedules, device-seconds held
by each, and the placer's predicted inflation against the realised one.
Invariants: pure functions of what the runs measured (no clock, no I/O; `mux_floor` reads the
machine's usable cores); a ratio whose denominator is zero is reported as 0, a figure with
nothing to measure as None.
"""

from __future__ import annotations

import statistics
from typing import Mapping

from plexrl.policy import Forecast, ModelMemory, profile_from_events, waited_s
from plexrl.policy.placement.cotenancy import pooled_inflation
from plexrl.rl.demo_experiment import MUX_DEVICES, DemoRuns, ExclusiveRun, MuxRun
from plexrl.rl.demo_result import (DemoSummary, DeviceFigures, JobFigures, PairRun, PlacerFigures, RunSettings,
                                   ScheduleFigures, ScheduleRow)
from plexrl.rl.spec import JobSpec
from plexrl.rl.train import JobResult
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.threads import usable_cpus

PAIR_FIGURES = ("makespan_mux_s", "makespan_exclusive_s", "makespan_mux_vs_exclusive", "device_busy_mux_vs_exclusive")


def summarise(runs: DemoRuns, args) -> DemoSummary:
    """The whole report: the first pair of runs in full, every pair's makespans (`repeats`)."""
    specs, dedicated = runs.specs, runs.dedicated.results
    exclusive, mux = runs.pairs[0]
    waits = {s.name: (waited_s(runs.dedicated.events, s.name), waited_s(mux.events, s.name)) for s in specs}
    alone = predicted_from_alone(specs, runs.dedicated.events, mux.metrics["jct_s"])
    jobs = [job_row(spec, *dedicated[spec.name], in_exclusive, mux.results[spec.name],
                    mux.metrics["jobs"].get(spec.name, {}), mux.metrics["placement"].get(spec.name, {}),
                    waits[spec.name], alone[spec.name])
            for spec, (_, in_exclusive) in zip(specs, exclusive.jobs, strict=True)]
    consumed = sum(j.consumed_device_s for j in jobs)
    reserved = sum(j.reserved_device_s for j in jobs)
    pairs = [{**pair_figures(e, m), "identical_rewards": identical_rewards(specs, dedicated, e, m)}
             for e, m in runs.pairs]
    repeats = repeated(pairs[0], pairs[1:])
    return DemoSummary(
        jobs=jobs,
        cost_reduction=1.0 - consumed / reserved,
        identical_rewards=repeats["identical_rewards"],
        within_slack=mean([1.0 if j.within_slack else 0.0 for j in jobs]),
        placer=placer_figures(jobs),
        schedules=schedule_figures(specs, dedicated, exclusive, mux),
        device_use=device_figures(dedicated, exclusive, mux, args),
        settings=RunSettings(policy=args.policy, read_replicas=mux.metrics["read_replicas"], engine=args.engine,
                             quick=args.quick, out=str(args.out)),
        repeats=repeats["repeats"],
        makespan_mux_vs_exclusive_median=repeats["makespan_mux_vs_exclusive_median"],
    )


def identical_rewards(specs, dedicated: dict[str, tuple[JobResult, float]], exclusive: ExclusiveRun,
                      mux: MuxRun) -> bool:
    """Whether every job's rewards in both runs of a pair are its dedicated run's."""
    return all(mux.results[s.name].rewards == dedicated[s.name][0].rewards == result.rewards
               for s, (_, result) in zip(specs, exclusive.jobs, strict=True))


def pair_figures(exclusive: ExclusiveRun, mux: MuxRun) -> dict:
    """The figures of one pair of runs (`PAIR_FIGURES`): both makespans and their ratio, and the
    ratio of the same calls' device time in the two."""
    makespan_exclusive = max(row["end_s"] for row, _ in exclusive.jobs)
    metrics = mux.metrics
    return {"makespan_mux_s": metrics["makespan_s"], "makespan_exclusive_s": makespan_exclusive,
            "makespan_mux_vs_exclusive": metrics["makespan_s"] / makespan_exclusive,
            "device_busy_mux_vs_exclusive": metrics["device_busy_s"] / exclusive.device_busy_s}


def repeated(first: Mapping, again: list[PairRun]) -> dict:
    """The summary's fields over every pair of runs (the first, whose figures the summary holds,
    and `again`): each pair's makespans (`repeats`), the median ratio, and identical rewards only
    when they were so in every run."""
    first = {key: first[key] for key in (*PAIR_FIGURES, "identical_rewards")}
    runs = [first, *again]
    return {"repeats": runs, "makespan_mux_vs_exclusive_median": statistics.median(
                run["makespan_mux_vs_exclusive"] for run in runs),
            "identical_rewards": all(run["identical_rewards"] for run in runs)}


def placer_figures(jobs: list[JobFigures]) -> PlacerFigures:
    predicted = [j for j in jobs if j.inflation_predicted is not None]
    alone_unmeasured = any(j.inflation_predicted_alone is None for j in jobs)
    return PlacerFigures(
        inflation_mae=mean([abs(j.inflation_predicted - j.slowdown) for j in predicted]) if predicted else None,
        inflation_mae_waiting=mean([abs(j.inflation_predicted - j.slowdown_waiting) for j in predicted])
        if predicted else None,
        inflation_mae_waiting_alone=None if alone_unmeasured else
        mean([abs(j.inflation_predicted_alone - j.slowdown_waiting) for j in jobs]),
        busy_shares_dedicated=None if alone_unmeasured else sum(j.busy_share_dedicated for j in jobs),
        profiles_unmeasured=len(jobs) - len(predicted),
        placements_provisional=sum(bool(j.placement_provisional) for j in jobs),
    )


def schedule_figures(specs, dedicated: dict[str, tuple[JobResult, float]], exclusive: ExclusiveRun,
                     mux: MuxRun) -> ScheduleFigures:
    pair = pair_figures(exclusive, mux)
    rows = [row for row, _ in exclusive.jobs]
    computed = exclusive_schedule([(s.name, dedicated[s.name][0].wall_s) for s in specs], MUX_DEVICES)
    makespan_computed = max(row["end_s"] for row in computed)
    longest_first = sorted(((s.name, dedicated[s.name][0].wall_s) for s in specs), key=lambda job: -job[1])
    jct_exclusive = {row["name"]: row["end_s"] for row in rows}
    jct_mux = mux.metrics["jct_s"]
    return ScheduleFigures(
        **pair,
        makespan_exclusive_computed_s=makespan_computed,
        makespan_mux_vs_exclusive_computed=mux.metrics["makespan_s"] / makespan_computed,
        makespan_exclusive_longest_first_s=max(row["end_s"] for row in exclusive_schedule(longest_first, MUX_DEVICES)),
        makespan_sequential_s=sum(result.wall_s for result, _ in dedicated.values()),
        exclusive_schedule=rows,
        exclusive_schedule_computed=computed,
        jct_mux_s=jct_mux,
        jct_exclusive_s=jct_exclusive,
        jct_mean_mux_s=mean(jct_mux.values()),
        jct_mean_exclusive_s=mean(jct_exclusive.values()),
        jct_mean_mux_vs_exclusive=mean(jct_mux.values()) / mean(jct_exclusive.values()),
    )


def device_figures(dedicated: dict[str, tuple[JobResult, float]], exclusive: ExclusiveRun, mux: MuxRun,
                   args) -> DeviceFigures:
    metrics, busy = mux.metrics, mux.metrics["device_busy_s"]
    rows = [row for row, _ in exclusive.jobs]
    return DeviceFigures(
        devices=MUX_DEVICES,
        device_s_held_mux=MUX_DEVICES * metrics["makespan_s"],
        device_s_held_exclusive=MUX_DEVICES * max(row["end_s"] for row in rows),
        device_s_held_exclusive_jobs=sum(row["end_s"] - row["start_s"] for row in rows),
        switches=metrics["switches"],
        device_budget=budget_split(metrics),
        switch_overhead=metrics["transition_s"] / busy if busy else 0.0,
        device_utilisation_mux=busy / (MUX_DEVICES * metrics["makespan_s"]),
        host_cpu_s_mux=metrics["host_cpu_s"],
        host_cpu_s_exclusive=exclusive.host_cpu_s,
        cpu_cores=usable_cpus(),
        device_busy_s_dedicated=sum(busy_s for _, busy_s in dedicated.values()),
        device_busy_s_exclusive=exclusive.device_busy_s,
        device_busy_s_mux=busy,
        makespan_mux_floor_s=mux_floor(busy, metrics["host_cpu_s"], args.device, args.engine),
    )


def job_row(spec: JobSpec, dedicated: JobResult, dedicated_busy_s: float, exclusive: JobResult, mux: JobResult,
            usage: dict, placed: dict, waits: tuple[float, float], alone: dict) -> JobFigures:
    window = max(1, spec.steps // 4)  # single steps are noisy: compare the first and last quarter
    slowed = slowdown(mux.step_s, dedicated.step_s)
    waiting = (waits[1] - waits[0]) / sum(dedicated.step_s) if sum(dedicated.step_s) > 0 else 0.0
    return JobFigures(
        name=spec.name, algorithm=spec.algorithm, task=spec.task, steps=spec.steps,
        reward_first=mean(mux.rewards[:window]), reward_last=mean(mux.rewards[-window:]),
        reward_window_steps=window,
        identical_rewards=mux.rewards == dedicated.rewards == exclusive.rewards,
        rewards_mux=mux.rewards, rewards_dedicated=dedicated.rewards,
        step_s_mux=mean(mux.step_s), step_s_dedicated=mean(dedicated.step_s),
        step_s_exclusive=mean(exclusive.step_s),
        slack=spec.slack, slowdown=slowed, within_slack=slowed <= spec.slack,
        slowdown_waiting=waiting, slowdown_other=slowed - waiting,
        inflation_predicted=placed.get("inflation_predicted"), placement_provisional=placed.get("provisional"),
        replacement_refused=placed.get("replacement_refused"),
        busy_share_dedicated=alone["busy_share"], inflation_predicted_alone=alone["inflation_predicted"],
        consumed_device_s=usage.get("consumed_device_s", 0.0),
        switch_s=usage.get("switch_s", 0.0),
        queue_wait_s=usage.get("queue_wait_s", 0.0),
        reserved_device_s=dedicated.wall_s * 1,
        dedicated_busy_s=dedicated_busy_s,
    )


def predicted_from_alone(specs, dedicated_events: list[dict], ends: dict[str, float],
                         slot_s: float = ClusterConfig.slot_s) -> dict[str, dict]:
    """The placer's model of the multiplexed devices (`pooled_inflation`) on the jobs' profiles
    measured alone (their dedicated runs) instead of while sharing. Per job: `busy_share`, the
    devices its calls keep busy alone, and `inflation_predicted`, beside the jobs not yet done
    (every job starts at once; `ends`: seconds from the start to each job's end), averaged over
    its steps as the runtime's prediction is (`Forecast`). It tells the model's error from the
    error of what the runtime measured: while sharing, a job is profiled with its waits for
    devices cut out, but everything else it waited for (here: its controller for a core) stays in.
    None for every job when a job has no complete step to profile."""
    profiles = {}
    for spec in specs:
        try:  # memory plays no part in the prediction; a profile needs a model, so it gets an empty one
            profiles[spec.name] = profile_from_events(dedicated_events, spec.name, slot_s,
                                                      [ModelMemory(spec.name, 0, 0)])
        except ValueError:  # not one complete step to measure (`--steps 1`)
            return {s.name: {"busy_share": None, "inflation_predicted": None} for s in specs}
    out = {}
    for name, profile in profiles.items():
        forecast = Forecast(0.0)
        for t in [0.0, *sorted(end for job, end in ends.items() if end < ends[name])]:
            others = [p for job, p in profiles.items() if job != name and ends[job] > t]
            forecast.update(t, pooled_inflation(profile, others, MUX_DEVICES), bool(others))
        forecast.close(ends[name])
        out[name] = {"busy_share": profile.busy_device_s / profile.period_s,
                     "inflation_predicted": forecast.mean(ends[name])}
    return out


def exclusive_schedule(durations: list[tuple[str, float]], devices: int) -> list[ScheduleRow]:
    """List scheduling in arrival order: each job takes the device that frees first, for its whole run."""
    free_at = [0.0] * devices
    rows = []
    for name, duration in durations:
        device = min(range(devices), key=lambda d: (free_at[d], d))
        rows.append({"name": name, "device": device, "start_s": free_at[device], "end_s": free_at[device] + duration})
        free_at[device] += duration
    return rows


def mux_floor(device_busy_s: float, host_cpu_s: float, torch_device: str, engine: str) -> float:
    """The multiplexed makespan had every device been busy for the whole run with what it computed
    in it and, where the devices are this machine's cores (CPU devices), every core also busy with
    what this process used beside them (controllers, dispatch): a floor for the work the run did,
    which tells devices left idle from a host that computed slowly. (The local engine's devices are
    threads of this process: its CPU holds theirs already.)"""
    from plexrl.runtime.cuda import resolve_device

    floor = device_busy_s / MUX_DEVICES
    if resolve_device(torch_device) == "cpu":
        on_cores = host_cpu_s if engine == "local" else device_busy_s + host_cpu_s
        floor = max(floor, on_cores / usable_cpus())
    return floor


def budget_split(metrics: dict) -> dict:
    """Device 0's budget as it was while the jobs ran: the split `metrics()` gives once they are
    gone has no model left to keep a reserve for, so the reserve is the largest one measured."""
    split = dict(metrics["device_budget"][0])
    reserves = metrics["activation_reserves"]
    if reserves and not split["activation_reserve_bytes"]:
        largest = max(sorted(reserves), key=reserves.get)
        split["activation_reserve_bytes"], split["activation_reserve_of"] = reserves[largest], largest
        split["state_bytes"] = (split["device_memory_bytes"] - split["activation_reserve_bytes"]
                                - split["engine_bytes"] - split["shared_bytes"])
    return split


def slowdown(mux_step_s: list[float], dedicated_step_s: list[float]) -> float:
    alone = mean(dedicated_step_s)
    return mean(mux_step_s) / alone - 1.0 if alone > 0 else 0.0


def mean(values) -> float:
    return sum(values) / len(values) if values else 0.0

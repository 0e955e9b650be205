"""Metrics of simulated runs, compared against the colocated baseline, and their plots.

Cost is GPU-hours per step: reserved GPUs x wall time for the baselines, consumed GPU time
(execution + switch-in) for PlexRL, summed over jobs and divided by the steps they completed.
The cost reduction prices each job's completed steps at its class's colocated cost per step
(`cost_reduction`), so a mode is not charged for completing a costlier mix of steps.
Slowdown is a job's mean step time over its colocated mean step time (queueing excluded).
A job that never started counts its queueing delay up to the end of the run; a job that did
not finish counts its completion time (queueing + run) up to the end of the run.

The operator's figures (docs/design.md §7): steps completed, mean job completion time, cluster
GPU-hours per completed step (every GPU of the cluster over the run, busy or not) and
`capacity_vs_colocated`, steps per cluster GPU-hour relative to colocated's, and the share of
the cluster no job held while jobs waited for a place (`stranded_gpus`).
Bounds (beside every mode's figures; `bounds`, `gain_captured`): what no schedule beats on
makespan, mean JCT and steps. The `alone` bound: every job on GPUs of its own from its
arrival, at its colocated speed (the `alone` mode's run, or colocated's own step times when it
finished every job). The fluid bound: each job's work, its busy GPU-seconds per step at its
alone speed (the least any mode of the run spent on a step of it: consolidating a rollout tail
spends less) times its steps, packed perfectly into the cluster's GPUs from its arrival, and no
job faster than alone: the makespan no earlier than the last arrival t plus the work arriving
from t over the cluster's GPUs; the mean JCT no less than the preemptive shortest-remaining-work
order gives on one machine as fast as the whole cluster (optimal for that relaxation, and at
every time the most jobs done); the steps by the horizon no more than the cheapest steps the
cluster's GPU-time holds, each job at most its `alone` steps. `gain_captured` =
(colocated - mode) / (colocated - bound) per figure, against the tighter of the two bounds: the
share of the headroom a mode takes (None where colocated is at the bound).
Co-tenancy (PlexRL modes): per job the placer's predicted step inflation (averaged over the
steps of its placement, `Forecast`) against the realised one (its steps' time over their solo time, minus 1), and
their mean absolute error, over all placed jobs and over the jobs that shared a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plexrl.sim.runner import ModeResult


def gpu_hours_per_step(result: ModeResult) -> float:
    steps = sum(r.steps for r in result.records)
    return sum(r.charged_gpu_s for r in result.records) / max(steps, 1) / 3600


def cost_reduction(result: ModeResult, baseline: ModeResult) -> float:
    """The user's saving against colocated on the steps this mode completed: 1 - what it
    charged for them over what colocated charges for the same steps, each job's steps priced
    at its class's colocated GPU-hours per step (`SimJobRecord.kind`). When every job completes
    its steps in both modes this is 1 - `gpu_hours_per_step` over colocated's; when the run's
    end cuts jobs off, the modes complete different mixes (one that starts more 235B-class jobs
    completes more of the costliest steps), and the ratio of the two averages would count that
    mix as a price. Jobs of a class colocated completed no step of are left out of both sides."""
    charged, steps = {}, {}
    for r in baseline.records:
        charged[r.kind] = charged.get(r.kind, 0.0) + r.charged_gpu_s
        steps[r.kind] = steps.get(r.kind, 0) + r.steps
    price = {kind: charged[kind] / n for kind, n in steps.items() if n > 0}
    priced = [r for r in result.records if r.kind in price]
    at_colocated = sum(r.steps * price[r.kind] for r in priced)
    return 1.0 - sum(r.charged_gpu_s for r in priced) / at_colocated if at_colocated > 0 else 0.0


def queue_delays(result: ModeResult) -> np.ndarray:
    return np.array([r.queue_delay if r.started is not None else result.end_s - r.arrival for r in result.records])


def makespan_s(result: ModeResult) -> float:
    first = min(r.arrival for r in result.records)
    ends = [r.finished for r in result.records if r.finished is not None]
    done = len(ends) == len(result.records)
    return (max(ends) if done else result.end_s) - first


def makespan_floor_s(baseline: ModeResult) -> float | None:
    """The makespan no schedule beats while no job runs faster than it does alone: every job
    starting on arrival and running at its colocated speed (the baseline's own step times; a
    colocated job runs alone on its GPUs), max over jobs of arrival + run, from the first
    arrival. None when the baseline did not finish every job."""
    if any(r.finished is None for r in baseline.records):
        return None
    first = min(r.arrival for r in baseline.records)
    return max(r.arrival + sum(r.step_times) for r in baseline.records) - first


def slowdowns(result: ModeResult, baseline: ModeResult) -> np.ndarray:
    base = {r.name: r.mean_step_s for r in baseline.records if r.step_times}
    return np.array([r.mean_step_s / base[r.name] for r in result.records if r.step_times and r.name in base])


def completion_times(result: ModeResult) -> np.ndarray:
    """Per job, queueing + run: its end (or the run's end, if it did not finish) - its arrival."""
    return np.array([(r.finished if r.finished is not None else result.end_s) - r.arrival for r in result.records])


def cluster_gpu_hours_per_step(result: ModeResult) -> float:
    steps = sum(r.steps for r in result.records)
    return result.cluster_gpus * result.end_s / 3600 / steps if steps else float("inf")


def stranded_gpus(result: ModeResult) -> tuple[float, float | None]:
    """(GPU-hours, share) of the cluster's GPUs that no job held while jobs waited for a place:
    the integral, over the times at least one job had arrived and was not yet placed, of the
    cluster's GPUs less those held by a placed job (each GPU once, however many jobs share it),
    and that over the cluster's GPU-time in those stretches (None when no job ever waited). A
    job holds its GPUs from its placement (a PlexRL job's phase shift is its own wait, not the
    queue's), and a moved job the GPUs it left until each move. What a mode leaves unused for
    want of a fit: GPUs free but too few in one place for a waiting job (a node group's
    fragments, which PlexRL's moves mend where they can), or left free because sharing them
    would break a job's slack."""
    changes: list[tuple[float, int, tuple[int, ...]]] = []  # (time, +1 / -1, GPUs held; () for a wait)
    for r in result.records:
        placed = r.placed  # set whenever the job started (`SimService.start`)
        if placed is None:
            changes += [(r.arrival, 1, ()), (result.end_s, -1, ())]
            continue
        if placed > r.arrival:
            changes += [(r.arrival, 1, ()), (placed, -1, ())]
        since = placed
        for moved, left in r.moves:  # a moved job held other GPUs until each move
            changes += [(since, 1, left), (moved, -1, left)]
            since = moved
        changes += [(since, 1, r.devices), (r.finished if r.finished is not None else result.end_s, -1, r.devices)]
    changes.sort(key=lambda c: c[0])
    holders: dict[int, int] = {}  # GPU -> placed jobs on it
    waiting, stranded, queued_gpu_s, t = 0, 0.0, 0.0, 0.0
    for when, sign, gpus in changes:
        when = min(when, result.end_s)
        if waiting > 0 and when > t:
            queued_gpu_s += result.cluster_gpus * (when - t)
            stranded += max(result.cluster_gpus - len(holders), 0) * (when - t)
        t = when
        if not gpus:
            waiting += sign
        for g in gpus:
            holders[g] = holders.get(g, 0) + sign
            if holders[g] == 0:
                del holders[g]
    return stranded / 3600, (stranded / queued_gpu_s if queued_gpu_s > 0 else None)


def within_slack(result: ModeResult, baseline: ModeResult) -> float | None:
    """Share of the jobs that ran a step whose mean slowdown against colocated is within their slack."""
    base = {r.name: r.mean_step_s for r in baseline.records if r.step_times}
    ok = [r.mean_step_s / base[r.name] - 1 <= r.slack + 1e-9 for r in result.records if r.step_times and r.name in base]
    return float(np.mean(ok)) if ok else None


def cotenancy(result: ModeResult) -> dict:
    """Predicted against realised inflation of the jobs the placer placed and that ran a step."""
    pairs = [(r.predicted_inflation, r.realised_inflation, r.shared) for r in result.records
             if r.predicted_inflation is not None and r.realised_inflation is not None]
    if not pairs:
        return {}
    pred, real, shared = (np.array(x) for x in zip(*pairs))
    err = np.abs(pred - real)
    return {
        "inflation_predicted_mean": float(pred.mean()),
        "inflation_realised_mean": float(real.mean()),
        "inflation_mae": float(err.mean()),
        "inflation_mae_shared": float(err[shared].mean()) if shared.any() else None,
        "jobs_shared": int(shared.sum()),
    }


BOUND_FIGURES = ("makespan_s", "jct_mean_s", "steps")  # figures with bounds; steps is the one larger is better


def bounds(alone: ModeResult, runs: list[ModeResult], horizon_s: float | None) -> dict:
    """{"makespan_s", "jct_mean_s", "steps"} -> {"alone": bound, "fluid": bound, "bound": the tighter}
    (module docstring). `alone`: the `alone` mode's run (every job on GPUs of its own from its
    arrival), or colocated's when it finished every job (its step times are the jobs' alone; its
    queueing is left out); `runs`: every mode's run of the same workload (a job's busy
    GPU-seconds per step is the least any of them spent)."""
    gpus = alone.cluster_gpus
    per_step: dict[str, float] = {}
    for run in runs:
        for r in run.records:
            if r.steps > 0 and r.busy_gpu_s > 0:
                per_step[r.name] = min(per_step.get(r.name, float("inf")), r.busy_gpu_s / r.steps)
    jobs = [(r.arrival, _alone_run_s(r), per_step.get(r.name, 0.0) * r.planned_steps, r) for r in alone.records]
    end = float("inf") if horizon_s is None else horizon_s
    first = min(a for a, _, _, _ in jobs)
    by_arrival = sorted(jobs, key=lambda j: j[0])
    work_from, fluid_span = 0.0, 0.0
    for arrival, _, work, _ in reversed(by_arrival):
        work_from += work
        fluid_span = max(fluid_span, arrival + work_from / gpus)
    fluid_span = min(fluid_span, end) - first
    srpt = _srpt_completions([(a, w / gpus) for a, _, w, _ in jobs], end)
    fluid_jct = sum(min(c, end) - a for c, (a, _, _, _) in zip(srpt, jobs)) / len(jobs)
    alone_span = min(max(a + run for a, run, _, _ in jobs), end) - first
    alone_jct = sum(min(a + run, end) - a for a, run, _, _ in jobs) / len(jobs)
    out = {"makespan_s": {"alone": alone_span, "fluid": fluid_span},
           "jct_mean_s": {"alone": alone_jct, "fluid": fluid_jct},
           "steps": {"alone": sum(r.steps for r in alone.records),
                     "fluid": _fluid_steps([(per_step.get(r.name, 0.0), r.steps) for r in alone.records],
                                           gpus * (end - first))}}
    for figure, b in out.items():
        b["bound"] = min(b["alone"], b["fluid"]) if figure == "steps" else max(b["alone"], b["fluid"])
    return out


def _alone_run_s(record) -> float:
    """A job's run alone: its step times (those of the steps it ran before the run's end, when
    that cut it off: still no more than its whole run)."""
    return sum(record.step_times)


def _srpt_completions(jobs: list[tuple[float, float]], end: float) -> list[float]:
    """Completion times of (arrival, processing seconds) jobs on one machine, preemptive shortest
    remaining processing time first (inf for those not done by `end`)."""
    import heapq

    order = sorted(range(len(jobs)), key=lambda k: jobs[k][0])
    done, ready, t, i = [float("inf")] * len(jobs), [], 0.0, 0
    while i < len(order) or ready:
        if not ready:
            t = max(t, jobs[order[i]][0])
        while i < len(order) and jobs[order[i]][0] <= t:
            heapq.heappush(ready, (jobs[order[i]][1], order[i]))
            i += 1
        left, k = heapq.heappop(ready)
        until = jobs[order[i]][0] if i < len(order) else float("inf")
        if t + left <= until:
            t += left
            if t > end:
                break
            done[k] = t
        else:
            heapq.heappush(ready, (left - (until - t), k))
            t = until
        if t >= end:
            break
    return done


def _fluid_steps(jobs: list[tuple[float, int]], gpu_s: float) -> float:
    """The most steps `gpu_s` GPU-seconds hold, cheapest first: (busy GPU-s per step, most steps) per job."""
    steps = 0.0
    for cost, most in sorted(jobs):
        take = most if cost <= 0 else min(most, gpu_s / cost)
        steps += take
        gpu_s -= take * cost
        if gpu_s <= 0:
            break
    return steps


def gain_captured(summary: dict, colocated: dict, bound: dict) -> dict:
    """Per figure of `BOUND_FIGURES`: (colocated - mode) / (colocated - bound), None where
    colocated is at the bound."""
    out = {}
    for figure in BOUND_FIGURES:
        room = colocated[figure] - bound[figure]["bound"]
        out[figure] = (colocated[figure] - summary[figure]) / room if abs(room) > 1e-9 * max(1.0, abs(room)) else None
    return out


def summarize(result: ModeResult, baseline: ModeResult) -> dict:
    cost = gpu_hours_per_step(result)
    slow = slowdowns(result, baseline)
    delays = queue_delays(result)
    jct = completion_times(result)
    span = makespan_s(result)
    cluster_cost, base_cluster_cost = cluster_gpu_hours_per_step(result), cluster_gpu_hours_per_step(baseline)
    stranded_hours, stranded_share = stranded_gpus(result)
    return {
        "gpu_hours_per_step": cost,
        "cost_reduction_vs_colocated": cost_reduction(result, baseline),
        "slowdown_mean": float(slow.mean() - 1) if len(slow) else float("nan"),
        "slowdown_p95": float(np.percentile(slow, 95) - 1) if len(slow) else float("nan"),
        "makespan_s": span,
        "makespan_floor_s": makespan_floor_s(baseline),
        "queue_delay_p50_s": float(np.percentile(delays, 50)),
        "queue_delay_p99_s": float(np.percentile(delays, 99)),
        "utilization": result.busy_gpu_s / (result.cluster_gpus * result.end_s) if result.end_s > 0 else 0.0,
        "switch_overhead_share": result.switch_gpu_s / result.busy_gpu_s if result.busy_gpu_s > 0 else 0.0,
        "steps": sum(r.steps for r in result.records),
        "jobs_finished": sum(r.finished is not None for r in result.records),
        "jct_mean_s": float(jct.mean()),
        "jct_p99_s": float(np.percentile(jct, 99)),
        "cluster_gpu_hours_per_step": cluster_cost,
        "capacity_vs_colocated": base_cluster_cost / cluster_cost if cluster_cost > 0 else 0.0,
        "within_slack": within_slack(result, baseline),
        "stranded_gpu_hours": stranded_hours,
        "stranded_gpu_share": stranded_share,
        "jobs_moved": sum(len(r.moves) for r in result.records),  # moves at step boundaries (PlexRL)
        **cotenancy(result),
        "events": result.events,
        "wall_s": result.wall_s,
        "jobs": {
            r.name: {
                "gpu_hours_per_step": r.charged_gpu_s / max(r.steps, 1) / 3600,
                "mean_step_s": r.mean_step_s,
                "queue_delay_s": float(d),
                "jct_s": float(c),
                "steps": r.steps,
                "slack": r.slack,
                "inflation_predicted": r.predicted_inflation,
                "inflation_realised": r.realised_inflation,
                "shared": r.shared,
            }
            for r, d, c in zip(result.records, delays, completion_times(result))
        },
    }


def utilization_series(result: ModeResult, bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Busy share of the cluster per time bin: (bin centres in hours, share)."""
    start, stop, gpus = result.busy_intervals
    edges = np.linspace(0.0, max(result.end_s, 1e-9), bins + 1)
    length = stop - start
    busy_before = np.array([np.sum(np.clip(e - start, 0.0, length) * gpus) for e in edges])
    share = np.diff(busy_before) / (np.diff(edges) * result.cluster_gpus)
    return (edges[:-1] + edges[1:]) / 2 / 3600, share


def plot(results: dict[str, ModeResult], summaries: dict[str, dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    modes = list(results)

    fig, ax = plt.subplots(figsize=(10, 4))
    jobs = list(summaries[modes[0]]["jobs"])
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        vals = [summaries[mode]["jobs"][j]["gpu_hours_per_step"] for j in jobs]
        ax.bar(np.arange(len(jobs)) + k * width, vals, width, label=mode)
    ax.set_xticks(np.arange(len(jobs)) + 0.4 - width / 2, jobs, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GPU-hours per step")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "cost_per_step.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    _delay_cdf(ax, results, modes)
    paths.append(_save(fig, out / "queue_delay_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    _makespans(ax, summaries, modes)
    paths.append(_save(fig, out / "makespan.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    for mode in modes:
        x, y = utilization_series(results[mode])
        ax.plot(x, y, label=mode, lw=1)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("busy share of cluster GPUs")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "utilization.png"))
    paths.append(_policies_figure(results, summaries, out / "fig8_policies.png"))
    paths.append(_inflation_figure(results, out / "inflation_predicted_vs_realised.png"))
    return paths


REQUEST_POLICY_MODES = ("colocated", "plexrl", "plexrl-hrrn", "plexrl-sjf", "plexrl-fcfs")


def _policies_figure(results: dict[str, ModeResult], summaries: dict[str, dict], path: Path) -> Path:
    """The paper's Fig. 8: job queueing-delay CDF and makespan per request scheduling policy."""
    import matplotlib.pyplot as plt

    modes = [m for m in REQUEST_POLICY_MODES if m in results]
    fig, (cdf, span) = plt.subplots(1, 2, figsize=(10, 4))
    _delay_cdf(cdf, results, modes)
    _makespans(span, summaries, modes)
    return _save(fig, path)


def _delay_cdf(ax, results: dict[str, ModeResult], modes: list[str]) -> None:
    for mode in modes:
        d = np.sort(queue_delays(results[mode])) / 3600
        ax.step(d, np.arange(1, len(d) + 1) / len(d), where="post", label=mode)
    ax.set_xlabel("job queueing delay (h)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)


def _makespans(ax, summaries: dict[str, dict], modes: list[str]) -> None:
    ax.bar(modes, [summaries[m]["makespan_s"] / 3600 for m in modes])
    ax.set_ylabel("makespan (h)")
    ax.tick_params(axis="x", rotation=30)


def _inflation_figure(results: dict[str, ModeResult], path: Path) -> Path:
    """Per job, the placer's predicted step inflation against the realised one, per PlexRL mode."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    top = 0.05
    for mode, result in results.items():
        pairs = [(r.predicted_inflation, r.realised_inflation) for r in result.records
                 if r.predicted_inflation is not None and r.realised_inflation is not None]
        if pairs:
            x, y = zip(*pairs)
            ax.scatter(x, y, s=8, label=mode)
            top = max(top, *x, *y)
    ax.plot([0, top], [0, top], color="grey", lw=0.8)
    ax.set_xlabel("predicted step inflation")
    ax.set_ylabel("realised step inflation")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

"""The demo's figures (matplotlib, Agg): reward curves, the device timeline, cost bars.

Each function takes plain data (the demo's summary and the event log) and writes one PNG.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

TRANSITION_KINDS = ("load", "offload")


def reward_curves(summary: dict, path: Path) -> Path:
    jobs = summary["jobs"]
    figure, axes = plt.subplots(1, len(jobs), figsize=(4 * len(jobs), 3.2), squeeze=False)
    for axis, job in zip(axes[0], jobs):
        axis.plot(job["rewards_dedicated"], label="dedicated", linewidth=3, alpha=0.5)
        axis.plot(job["rewards_mux"], label="multiplexed", linestyle="--", marker=".")
        axis.set_title(f"{job['name']} ({job['algorithm']})")
        axis.set_xlabel("step")
        axis.set_ylabel("mean reward")
        axis.legend()
    figure.suptitle("identical reward curves" if summary["identical_rewards"] else "reward curves DIFFER")
    return _save(figure, path)


def device_timeline(events: list[dict], path: Path) -> Path:
    """Gantt chart: one row per device, a bar per executed function coloured by job; switches in black."""
    spans, started = [], {}
    for event in events:
        if event.get("event") == "start" and event.get("device") is not None:
            started[event["request_id"]] = event
        elif event.get("event") == "end" and event.get("request_id") in started:
            begin = started.pop(event["request_id"])
            spans.append((begin["device"], begin["t"], event["t"] - begin["t"], begin["job"]))
    moves = [(e["device"], e["t"], e["seconds"]) for e in events
             if e.get("event") == "transition" and e.get("kind") in TRANSITION_KINDS and e.get("device") is not None]
    jobs = sorted({job for *_, job in spans})
    colours = {job: plt.cm.tab10(i % 10) for i, job in enumerate(jobs)}
    figure, axis = plt.subplots(figsize=(12, 1.2 + 0.8 * len({d for d, *_ in spans} or {0})))
    for device, start, width, job in spans:
        axis.broken_barh([(start, width)], (device - 0.35, 0.7), color=colours[job])
    for device, start, width in moves:
        axis.broken_barh([(start, max(width, 1e-3))], (device - 0.45, 0.9), color="black")
    axis.set_yticks(sorted({d for d, *_ in spans}))
    axis.set_yticklabels([f"device {d}" for d in sorted({d for d, *_ in spans})])
    axis.set_xlabel("time (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[j]) for j in jobs] + [plt.Rectangle((0, 0), 1, 1, color="black")]
    axis.legend(handles, jobs + ["load/offload (switch)"], loc="upper right", fontsize=8)
    axis.set_title("multiplexed device timeline")
    return _save(figure, path)


def cost_bars(summary: dict, path: Path) -> Path:
    jobs = summary["jobs"]
    names = [job["name"] for job in jobs]
    figure, (cost, makespan, held) = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [3, 1.4, 1.4]})
    positions = range(len(jobs))
    cost.bar([p - 0.2 for p in positions], [j["reserved_device_s"] for j in jobs], 0.4, label="reserved (dedicated)")
    cost.bar([p + 0.2 for p in positions], [j["consumed_device_s"] for j in jobs], 0.4, label="consumed (multiplexed)")
    cost.set_xticks(list(positions))
    cost.set_xticklabels(names)
    cost.set_ylabel("device-seconds")
    cost.set_title(f"cost: {summary['cost_reduction']:.0%} lower multiplexed")
    cost.legend()
    devices = summary["devices"]
    makespan.bar([f"one after\nanother\n(1 device)", f"exclusive\n({devices} devices)", f"multiplexed\n({devices} devices)"],
                 [summary["makespan_sequential_s"], summary["makespan_exclusive_s"], summary["makespan_mux_s"]],
                 color=["tab:gray", "tab:blue", "tab:orange"])
    makespan.set_ylabel("seconds")
    makespan.set_title(f"makespan, {len(jobs)} jobs: {summary['makespan_mux_vs_exclusive']:.2f}x exclusive", fontsize=10)
    held.bar([f"exclusive\n{devices} x makespan", "exclusive\njobs' own runs", f"multiplexed\n{devices} x makespan"],
             [summary["device_s_held_exclusive"], summary["device_s_held_exclusive_jobs"], summary["device_s_held_mux"]],
             color=["tab:blue", "tab:cyan", "tab:orange"])
    held.set_ylabel("device-seconds held")
    held.set_title("devices held", fontsize=10)
    for axis in (makespan, held):
        axis.tick_params(axis="x", labelsize=8)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path

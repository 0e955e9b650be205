"""`plexrl bench scale [--json] [--sizes 256,1024,4096,10240] [--plot FILE]`: how the simulator and the
placer scale with the cluster.

For each size (GPUs, a multiple of 256: one pod of 32 nodes of 8 H200s), the shipped `scale-10k`
workload and `h200-10240` cluster cut to that many pods, with the jobs and their arrival rate cut
in proportion (1,200 jobs at 60 per hour on 10,240 GPUs: the same load per GPU at every size), are
simulated for `--hours` of virtual time in each of `--modes`. Reported per size and mode: wall
time, events, events per second of wall time, and the wall time of the placement decisions the
admission queue asks for (p50, p99, max; PlexRL modes). A table, and a plot written to `--plot`.

Targets (issue #58): the 10,240-GPU day in <= 60 s per default mode; >= 100k events/s at 10,240
GPUs, and wall time per event there within 2x of that at 1,024.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from plexrl.bench.common import emit
from plexrl.sim.modes import make_mode
from plexrl.sim.plexrl_mode import PlexRLMode
from plexrl.sim.workload import load_cluster, load_workload

GPUS_PER_POD = 256  # 32 nodes of 8 GPUs
FULL_GPUS = 10240  # the size the shipped workload's job count and rate are for


class TimedPlacer:
    """A placer whose `place` calls are timed (the admission queue's decisions); the rest is its."""

    def __init__(self, placer):
        self.placer, self.times_s = placer, []

    def place(self, profile, now):
        t0 = time.perf_counter()
        decision = self.placer.place(profile, now)
        self.times_s.append(time.perf_counter() - t0)
        return decision

    def __getattr__(self, name: str):
        if name == "placer":
            raise AttributeError(name)
        return getattr(self.placer, name)


def scaled(gpus: int, hours: float):
    """(workload, cluster) of `gpus` GPUs: `scale-10k` with its job counts and rate in proportion."""
    if gpus % GPUS_PER_POD or gpus <= 0:
        raise ValueError(f"--sizes: {gpus} GPUs is not a positive multiple of {GPUS_PER_POD} (one pod)")
    fraction = gpus / FULL_GPUS
    workload = load_workload("scale-10k")
    jobs = [j.model_copy(update={"count": max(1, round(j.count * fraction))}) for j in workload.jobs]
    poisson = workload.poisson.model_copy(update={"rate_per_h": workload.poisson.rate_per_h * fraction})
    workload = workload.model_copy(update={"jobs": jobs, "poisson": poisson, "horizon_s": hours * 3600.0})
    cluster = load_cluster(workload.cluster)
    cluster = cluster.model_copy(update={"name": f"h200-{gpus}", "pods": gpus // GPUS_PER_POD})
    return workload, cluster


def run_one(gpus: int, mode_name: str, hours: float) -> dict:
    workload, cluster = scaled(gpus, hours)
    mode = make_mode(mode_name, workload, cluster)
    timed = None
    if isinstance(mode, PlexRLMode):
        timed = mode.admission.placer = TimedPlacer(mode.admission.placer)
    result = mode.run()
    row = {"gpus": gpus, "mode": mode_name, "jobs": sum(j.count for j in workload.jobs), "hours": hours,
           "wall_s": result.wall_s, "events": result.events,
           "events_per_s": result.events / result.wall_s if result.wall_s > 0 else 0.0,
           "us_per_event": 1e6 * result.wall_s / max(1, result.events)}
    if timed is not None and timed.times_s:
        ms = 1e3 * np.asarray(timed.times_s)
        row.update({"decisions": len(ms), "decision_ms_p50": float(np.percentile(ms, 50)),
                    "decision_ms_p99": float(np.percentile(ms, 99)), "decision_ms_max": float(ms.max())})
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", default="256,1024,4096,10240", help="cluster sizes in GPUs (multiples of 256)")
    parser.add_argument("--modes", default="colocated,plexrl", help="simulator modes to time at each size")
    parser.add_argument("--hours", type=float, default=24.0, help="virtual hours simulated at each size")
    parser.add_argument("--plot", default="bench-scale.png", help="where the plot is written ('' for none)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows = [run_one(gpus, mode, args.hours) for gpus in sizes for mode in args.modes.split(",") if mode]
    result = {"rows": rows, "targets": {"wall_s_at_10240": 60.0, "events_per_s_at_10240": 1e5,
                                        "us_per_event_10240_over_1024": 2.0, "decision_ms_p99": 50.0}}
    if args.plot:
        plot(rows, args.plot)
        result["plot"] = args.plot
    emit("scale", result, args.json, _print_table)
    return 0


def plot(rows: list[dict], path: str) -> None:
    """Wall time per event and placement p99 against cluster size, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        left.plot([r["gpus"] for r in mine], [r["us_per_event"] for r in mine], marker="o", label=mode)
        timed = [r for r in mine if "decision_ms_p99" in r]
        if timed:
            right.plot([r["gpus"] for r in timed], [r["decision_ms_p99"] for r in timed], marker="o", label=mode)
    for ax, label in ((left, "wall time per event (us)"), (right, "placement decision p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cluster GPUs")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="scale: scale-10k cut to each cluster size (jobs and rate in proportion)")
    for column in ("GPUs", "mode", "jobs", "wall s", "events", "events/s", "us/event", "place p50 ms",
                   "place p99 ms"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(str(r["gpus"]), r["mode"], str(r["jobs"]), f"{r['wall_s']:.1f}", str(r["events"]),
                      f"{r['events_per_s']:,.0f}", f"{r['us_per_event']:.1f}",
                      f"{r['decision_ms_p50']:.2f}" if "decision_ms_p50" in r else "-",
                      f"{r['decision_ms_p99']:.2f}" if "decision_ms_p99" in r else "-")
    Console().print(table)
    if "plot" in result:
        Console().print(f"plot: {result['plot']}")

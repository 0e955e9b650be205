"""A digest of what the simulator decides on every shipped workload: one line per workload and mode,
the SHA-256 of its summary (every figure but wall time and events/s) and of its job records
(arrivals, starts, ends, step times, charges, devices, moves). Two trees that print the same lines
make the same decisions; a restructuring or a speed-up shows that it changed nothing by diffing
this output before and after.

    python scripts/sim_digest.py [WORKLOAD ...] [--modes colocated,plexrl,...] [--processes N]

Default: every workload in plexrl/sim/workloads/ (on its own cluster) but those in `DAY_LONG`,
whose every mode takes minutes (name them, or pass --all), and every default mode plus the `alone` bound.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

from plexrl.sim.simulate import BOUNDS, MODES, simulate
from plexrl.sim.workload import load_cluster, load_workload

WALL_CLOCK = {"wall_s", "events_per_s", "events_per_process_s"}
WORKLOADS = Path(__file__).resolve().parent.parent / "plexrl" / "sim" / "workloads"
DAY_LONG = ("scale-10k",)  # 10,240 GPUs for a day: minutes per mode, not part of a quick before/after


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _summary(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in WALL_CLOCK}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", help="shipped names or paths (default: every shipped workload)")
    parser.add_argument("--modes", default=",".join((*MODES, *BOUNDS)))
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--all", action="store_true", help=f"the day-long workloads {DAY_LONG} too")
    args = parser.parse_args()
    names = args.workloads or sorted(p.stem for p in WORKLOADS.glob("*.yaml") if args.all or p.stem not in DAY_LONG)
    for name in names:
        workload = load_workload(name)
        t0 = time.perf_counter()
        out = simulate(workload, load_cluster(workload.cluster), tuple(args.modes.split(",")), processes=args.processes)
        for mode, summary in out["results"].items():
            records = [dataclasses.asdict(r) for r in out["runs"][mode].records]
            print(f"{name:16s} {mode:18s} summary {_digest(_summary(summary))} records {_digest(records)}", flush=True)
        print(f"# {name}: {out['events']} events in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

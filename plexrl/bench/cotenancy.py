"""`plexrl bench cotenancy [WORKLOAD] [--tenants K] [--mode M] [--json]`: the placer's co-tenancy model
against the simulator, one combination of job classes at a time.

For every multiset of 2..K of the workload's job classes (classes of one size only: those that
fill the same whole nodes), the simulator runs exactly those jobs on a cluster of one node group
that size, so the placer must put them on the same devices (each with a slack large enough that
it is never refused, no pack limit, and more steps than the horizon holds, so every job shares through the
whole run). Per job it reports the step inflation the placer predicted (`Placer.inflation_of`,
averaged over the run's steps, what `plexrl sim` reports as `inflation_predicted`) and the one the
simulator realised (mean step against the job alone, `inflation_realised`): the reference
measured in the same run. The summary is the mean absolute error over all jobs, and per number
of tenants. `plexrl sim` gives the same error for whole workloads, where each job's co-tenants
change as jobs come and go; this isolates which combinations the model gets wrong.
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict

import numpy as np

from plexrl.bench.common import emit
from plexrl.errors import ConfigError
from plexrl.sim.latency import job_costs
from plexrl.sim.profiles import job_profile
from plexrl.sim.simulate import MODES, simulate
from plexrl.sim.workload import WorkloadJob, SimCluster, Workload, load_cluster, load_workload

NEVER_REFUSED = 1e3  # slack of every job: the placer co-places whatever fits in memory
PERIODS = 25  # the horizon, in solo steps of the combination's slowest job
MODE = "plexrl"  # the default; `--mode plexrl-pinned` realises the same with rollouts pinned to their replicas
PLEXRL_MODES = tuple(m for m in MODES if m.startswith("plexrl"))
_SET_HERE = {"name", "count", "arrival_s", "arrival_every_s", "slack", "steps"}


def classes_by_size(workload: Workload, cluster: SimCluster) -> tuple[dict[int, list[WorkloadJob]], list[str]]:
    """The workload's job classes grouped by GPUs, those that fill whole nodes; and why the
    others are left out. Classes that differ only in when and how often they arrive, their slack
    and their steps (which this benchmark sets) count once, by their first name."""
    sizes: dict[int, list[WorkloadJob]] = defaultdict(list)
    skipped, seen = [], set()
    for job in workload.jobs:
        key = job.model_dump_json(exclude=_SET_HERE)
        if key in seen:
            continue
        seen.add(key)
        if job.gpus % cluster.gpus_per_node:
            skipped.append(f"{job.name}: {job.gpus} GPUs is not whole nodes of {cluster.gpus_per_node}")
        else:
            sizes[job.gpus].append(job)
    return dict(sizes), skipped


def one_group(cluster: SimCluster, gpus: int) -> SimCluster:
    nodes = gpus // cluster.gpus_per_node
    return cluster.model_copy(update={"name": f"{cluster.name}-1x{gpus}", "pods": 1, "nodes_per_pod": nodes,
                                      "group_nodes": nodes})


def run_combination(workload: Workload, cluster: SimCluster, combo: tuple[WorkloadJob, ...], mode: str = MODE) -> dict:
    """The jobs of `combo` alone on one node group in PlexRL mode `mode`: per job, predicted and
    realised inflation."""
    jobs = [spec.model_copy(update={"name": f"{spec.name}.{i}", "count": 1, "arrival_s": float(i),
                                    "arrival_every_s": 0.0, "slack": NEVER_REFUSED, "steps": 10**6})
            for i, spec in enumerate(combo)]
    slowest = max(job_profile(j, job_costs(j, cluster), workload.seed, 0).period_s for j in jobs)
    sim = Workload(name="+".join(j.name for j in combo), seed=workload.seed, cluster=cluster.name,
                   horizon_s=PERIODS * slowest, jobs=jobs, pack_limit=None,
                   pack_by_effect=False)  # each job's slack alone: every combination shares, to be measured
    out = simulate(sim, cluster, modes=(mode,))["results"][mode]["jobs"]
    rows = [{"job": j.name, "class": spec.name, "shared": bool(out[j.name]["shared"]),
             "predicted": out[j.name]["inflation_predicted"], "realised": out[j.name]["inflation_realised"]}
            for j, spec in zip(jobs, combo)]
    return {"combination": [spec.name for spec in combo], "tenants": len(combo), "jobs": rows,
            "co_placed": all(r["shared"] and r["predicted"] is not None for r in rows)}


def cotenancy(workload: Workload, cluster: SimCluster, tenants: int = 3, mode: str = MODE) -> dict:
    if tenants < 2:
        raise ValueError(f"--tenants {tenants}: expected at least 2 (a job alone has nobody to share with)")
    if mode not in PLEXRL_MODES:
        raise ValueError(f"--mode {mode!r}: expected one of the PlexRL modes {list(PLEXRL_MODES)}")
    sizes, skipped = classes_by_size(workload, cluster)
    combinations = []
    for gpus, classes in sorted(sizes.items()):
        group = one_group(cluster, gpus)
        for k in range(2, tenants + 1):
            for combo in itertools.combinations_with_replacement(classes, k):
                combinations.append(run_combination(workload, group, combo, mode))
    errors: dict[int, list[float]] = defaultdict(list)
    for c in combinations:
        if c["co_placed"]:
            errors[c["tenants"]] += [abs(r["predicted"] - r["realised"]) for r in c["jobs"]]
    every = [e for errs in errors.values() for e in errs]
    return {
        "workload": workload.name, "cluster": cluster.name, "mode": mode,
        "combinations": combinations, "skipped": skipped,
        "not_co_placed": [c["combination"] for c in combinations if not c["co_placed"]],
        "mae": float(np.mean(every)) if every else None,
        "mae_by_tenants": {str(k): float(np.mean(v)) for k, v in sorted(errors.items())},
        "target_mae": 0.05,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench cotenancy", description=__doc__.splitlines()[0])
    parser.add_argument("workload", nargs="?", default="crowded-256", help="shipped name or YAML path")
    parser.add_argument("--cluster", help="cluster YAML or shipped name (default: the workload's)")
    parser.add_argument("--tenants", type=int, default=3, help="largest number of jobs sharing devices")
    parser.add_argument("--mode", default=MODE, help=f"the PlexRL mode that realises them (default {MODE}; "
                        "plexrl-pinned: rollouts pinned to their replicas)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        workload = load_workload(args.workload)
        result = cotenancy(workload, load_cluster(args.cluster or workload.cluster), args.tenants, args.mode)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    emit("co-tenancy", result, args.json, _print_table)
    return 0


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"co-tenancy model vs simulator ({result['mode']}): {result['workload']} job classes, "
                        "one node group each")
    for column in ("jobs sharing devices", "job", "predicted", "realised", "error"):
        table.add_column(column, justify="left" if column in ("jobs sharing devices", "job") else "right")
    for c in result["combinations"]:
        for k, r in enumerate(c["jobs"]):
            label = " + ".join(c["combination"]) if k == 0 else ""
            if not c["co_placed"]:
                table.add_row(label, r["class"], "not co-placed", "", "")
                continue
            table.add_row(label, r["class"], f"{r['predicted']:.1%}", f"{r['realised']:.1%}",
                          f"{r['predicted'] - r['realised']:+.1%}")
    console = Console()
    console.print(table)
    by = ", ".join(f"{k} jobs {v:.1%}" for k, v in result["mae_by_tenants"].items())
    mae = "n/a" if result["mae"] is None else f"{result['mae']:.1%}"
    console.print(f"mean absolute error {mae} ({by}); target {result['target_mae']:.0%}")
    for reason in result["skipped"]:
        console.print(f"left out: {reason}")

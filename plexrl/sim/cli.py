"""`plexrl sim WORKLOAD [--cluster FILE] [--json] [--plots DIR] [--modes a,b] [--seeds N] [--pack-limit X|none|effect]
[--processes N] [--trace DIR]` and
`plexrl sim calibrate EVENTS.jsonl [--device-bytes N] [--policy P] [--json]`.

WORKLOAD is a YAML path or a shipped name (`paper-mix`, `scale-1024`); the cluster comes from
the workload's `cluster` field unless `--cluster` overrides it. `--json` prints one JSON object
and nothing else on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from plexrl.errors import ConfigError
from plexrl.policy import Policy
from plexrl.runtime.threads import usable_cpus
from plexrl.sim.calibrate import calibrate
from plexrl.sim.report import plot
from plexrl.sim.modes import make_mode
from plexrl.sim.simulate import BOUNDS, MODES, over_seeds
from plexrl.sim.trace import load_trace
from plexrl.sim.workload import load_cluster, load_workload


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plexrl sim", description="simulate a workload on a cluster at scale")
    p.add_argument("workload", help="workload YAML file or shipped name (e.g. paper-mix)")
    p.add_argument("--cluster", help="cluster YAML file or shipped name (default: the workload's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (default: all of them), and the bound "
                        f"{','.join(BOUNDS)} (every job on GPUs of its own from its arrival: what no schedule beats)")
    p.add_argument("--seeds", type=int, default=1,
                   help="run seeds seed..seed+N-1 and add per-mode mean/worst figures as 'over_seeds' (default 1)")
    p.add_argument("--pack-limit", type=pack_limit, default=None, metavar="X|none|effect",
                   help="how a shared placement is judged: 'effect' (sharing only where it lowers the jobs' summed "
                        "completion time, within every job's slack), a fixed largest step slowdown, e.g. 0.333, or "
                        "'none' (each job's own slack alone) (default: the workload's, 'effect' unless it sets one)")
    p.add_argument("--trace", type=Path, metavar="DIR",
                   help="also write each mode's run (the first seed's) as MODE.events.jsonl, the runtime's event log "
                        "format, and MODE.trace.json, what plexrl trace writes (ui.perfetto.dev opens it)")
    p.add_argument("--processes", type=int, default=usable_cpus(),
                   help="run the modes in this many processes; the results do not depend on it "
                        f"(default: the CPUs this process may use, {usable_cpus()})")
    return p.parse_args(argv)


_NO_LIMIT, _BY_EFFECT = "none", "effect"


def pack_limit(text: str) -> float | str:
    """`--pack-limit`: a fraction of a step >= 0, 'none' or 'effect'."""
    if text.strip().lower() in (_NO_LIMIT, _BY_EFFECT):
        return text.strip().lower()
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a step slowdown >= 0 (e.g. 0.333), 'none' or 'effect'")
    return value


def packing(choice: float | str) -> dict:
    """The workload's placement fields for `--pack-limit` `choice`."""
    if choice == _BY_EFFECT:
        return {"pack_limit": None, "pack_by_effect": True}
    return {"pack_limit": None if choice == _NO_LIMIT else choice, "pack_by_effect": False}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        return calibrate_main(argv[1:])
    args = parse(argv)
    err = Console(stderr=True)
    try:
        workload = load_workload(args.workload)
        if args.pack_limit is not None:
            workload = workload.model_copy(update=packing(args.pack_limit))
        cluster = load_cluster(args.cluster or workload.cluster)
        modes = tuple(m for m in args.modes.split(",") if m)
        runs = len(set(modes) | {"colocated"}) * args.seeds
        columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("modes"), TimeElapsedColumn(), TextColumn("{task.description}"))
        # refreshed by hand, when a mode ends: no refresh thread is running when the modes' processes fork
        with Progress(*columns, console=err, transient=True, auto_refresh=False) as progress:
            task = progress.add_task("", total=runs)
            progress.refresh()
            seeds = over_seeds(workload, cluster, args.seeds, modes, processes=args.processes,
                               on_mode=lambda m: progress.update(task, advance=1, description=f"{m} done", refresh=True))
        out = seeds["runs"][0]
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]plexrl sim:[/red] {exc}")
        return 2
    if args.trace:
        for path in traced(workload, cluster, tuple(out["runs"]), args.trace):
            err.print(f"trace: {path}")
    if args.plots:
        paths = plot(out["runs"], out["results"], args.plots)
        err.print(f"plots: {', '.join(str(p) for p in paths)}")
    doc = {k: out[k] for k in ("events_per_s", "events_per_process_s", "wall_s", "events", "processes")}
    doc.update(workload=workload.name, cluster=cluster.name, gpus=cluster.gpus, results=out["results"])
    if args.seeds > 1:
        doc["over_seeds"] = {"seeds": seeds["seeds"], "modes": seeds["modes"]}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        show(doc, Console())
    return 0


def traced(workload, cluster, modes: tuple[str, ...], folder: Path) -> list[Path]:
    """Run `modes` again with a recorder (each mode is a pure function of the workload: the same
    run as reported) and write each one's event log and trace into `folder`."""
    from plexrl.observe.perfetto import write_trace
    from plexrl.runtime.events import write_jsonl
    from plexrl.sim.recorder import SimRecorder

    written = []
    for name in modes:
        mode = make_mode(name, workload, cluster)
        mode.service.record = SimRecorder()
        mode.run()
        records = mode.service.record.sorted_records()
        written.append(write_jsonl(records, folder / f"{name}.events.jsonl"))
        write_trace(records, folder / f"{name}.trace.json")
        written.append(folder / f"{name}.trace.json")
    return written


# The report's tables, each narrow enough for an 80-column terminal: (title, columns), where a
# column is (header, result key). Every table starts with the mode.
USER_TABLES = (
    ("the user's side", [("GPU-h/step", "gpu_hours_per_step"), ("cost cut", "cost_reduction_vs_colocated"),
                         ("slowdown mean", "slowdown_mean"), ("p95", "slowdown_p95"), ("in slack", "within_slack")]),
    ("time (hours)", [("makespan", "makespan_s"), ("floor", "makespan_floor_s"), ("queue p50", "queue_delay_p50_s"),
                      ("p99", "queue_delay_p99_s"), ("util", "utilization"), ("switch share", "switch_overhead_share")]),
    ("the operator's side", [("steps", "steps"), ("JCT mean h", "jct_mean_s"),
                             ("cluster GPU-h/step", "cluster_gpu_hours_per_step"),
                             ("capacity vs colocated", "capacity_vs_colocated"),
                             ("free while queued", "stranded_gpu_share"), ("moves", "jobs_moved")]),
    ("against the bounds: the tighter of alone and fluid packing; gain = (colocated - mode) / (colocated - bound)",
     [("makespan h", "makespan_s"), ("bound", "makespan_bound_s"), ("gain", "gain_makespan"),
      ("JCT mean h", "jct_mean_s"), ("bound", "jct_mean_bound_s"), ("gain", "gain_jct_mean")]),
    ("steps against their bound", [("steps", "steps"), ("alone", "steps_alone"), ("fluid", "steps_fluid"),
                                   ("gain", "gain_steps")]),
    ("the placer's inflation model: predicted vs realised",
     [("predicted", "inflation_predicted_mean"), ("realised", "inflation_realised_mean"), ("MAE", "inflation_mae"),
      ("MAE shared", "inflation_mae_shared"), ("jobs shared", "jobs_shared")]),
)
SEED_TABLES = (
    ("cost and speed", [("cost cut mean", "cost_reduction_mean"), ("min", "cost_reduction_min"),
                        ("slowdown mean", "slowdown_mean_mean"), ("worst", "slowdown_mean_max"),
                        ("worst p95", "slowdown_p95_max"), ("in slack min", "within_slack_min")]),
    ("work", [("steps mean", "steps_mean"), ("capacity mean", "capacity_vs_colocated_mean"),
              ("JCT mean h", "jct_mean_s_mean"), ("makespan mean h", "makespan_s_mean"),
              ("free while queued", "stranded_gpu_share_mean"), ("MAE mean", "inflation_mae_mean")]),
    ("against the bounds", [("makespan gain", "gain_makespan_mean"), ("JCT gain", "gain_jct_mean_mean"),
                            ("steps gain", "gain_steps_mean"), ("makespan bound h", "makespan_bound_s_mean"),
                            ("JCT bound h", "jct_mean_bound_s_mean"), ("steps bound", "steps_bound_mean")]),
)


def show(doc: dict, console: Console) -> None:
    console.print(f"[bold]{doc['workload']}[/bold] on {doc['cluster']} ({doc['gpus']} GPUs)")
    for title, cols in USER_TABLES:
        console.print(_table(title, cols, doc["results"]))
    console.print(f"{doc['events']:,} events in {doc['wall_s']:.2f} s wall: {doc['events_per_s']:,.0f} events/s "
                  f"({doc['processes']} processes; {doc['events_per_process_s']:,.0f} events/s per process)")
    if "over_seeds" in doc:
        for title, cols in SEED_TABLES:
            console.print(_table(f"over seeds {doc['over_seeds']['seeds']}: {title}", cols, doc["over_seeds"]["modes"]))


def _table(title: str, cols: list[tuple[str, str]], results: dict) -> Table:
    """One row per mode. A column is as wide as its widest figure or header word: headers wrap to
    it, so the table is as narrow as it can be, and no figure or mode name shrinks to an ellipsis."""
    rows = [(mode, *(_cell(key, s.get(key)) for _, key in cols)) for mode, s in results.items()]
    table = Table(title=title)
    for k, name in enumerate(["mode", *(name for name, _ in cols)]):
        widest = max([len(row[k]) for row in rows] + [len(word) for word in name.split()])
        table.add_column(textwrap.fill(name, widest), justify="left" if k == 0 else "right", min_width=widest)
    for row in rows:
        table.add_row(*row)
    return table


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    for suffix in ("_mean", "_min", "_max"):  # a figure over seeds is shown as the figure
        if key.endswith(suffix) and key not in ("inflation_predicted_mean", "inflation_realised_mean"):
            key = key[: -len(suffix)]
    if key.endswith("_s"):
        return f"{v / 3600:.2f}"
    if key in ("steps", "jobs_shared", "jobs_moved", "steps_bound", "steps_alone", "steps_fluid"):
        return f"{v:,.0f}"
    if key in ("gpu_hours_per_step", "cluster_gpu_hours_per_step", "capacity_vs_colocated"):
        return f"{v:.3f}"
    return f"{v:.1%}"


def parse_calibrate(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plexrl sim calibrate",
                                description="replay a runtime event log through the simulator and report its error")
    p.add_argument("events", type=Path, help="events.jsonl written by the runtime (e.g. plexrl demo --out DIR)")
    p.add_argument("--device-bytes", type=int, help="device budget of the run (default: the peak the log shows)")
    p.add_argument("--policy", default="plexrl", help="request policy the run used (default plexrl)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def calibrate_main(argv: list[str]) -> int:
    args = parse_calibrate(argv)
    err = Console(stderr=True)
    try:
        doc = calibrate(load_trace(args.events), args.device_bytes, Policy.parse(args.policy))
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]plexrl sim calibrate:[/red] {exc}")
        return 2
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        show_calibration(doc, Console())
    return 0


def show_calibration(doc: dict, console: Console) -> None:
    for profile in ("profile", "exact"):
        res = doc[profile]
        table = Table(title=f"calibration ({profile} times): simulated vs real, target |error| <= {doc['target']:.0%}")
        for name in ("job", "steps", "step s real", "sim", "error", "device-s real", "sim", "error"):
            table.add_column(name, justify="right")
        for job, j in res["jobs"].items():
            table.add_row(job, str(j["steps"]), f"{j['step_s_real']:.3f}", f"{j['step_s_sim']:.3f}",
                          f"{j['step_s_error']:+.1%}", f"{j['device_s_real']:.3f}", f"{j['device_s_sim']:.3f}",
                          f"{j['device_s_error']:+.1%}")
        console.print(table)
        verdict = "within target" if res["within_target"] else "OUTSIDE target"
        console.print(f"max |error| {res['max_abs_error']:.1%}: {verdict}")
    decode = doc["decode"]
    if decode["batches"]:
        console.print(f"decode model from {decode['batches']} batched sample calls: step {decode['step_s'] * 1e3:.3f} ms "
                      f"+ {decode['row_s'] * 1e6:.2f} us per live row + {decode['prefill_token_s'] * 1e6:.2f} us per "
                      f"prompt token (|error| median {decode['median_abs_error']:.1%}, max {decode['max_abs_error']:.1%})")
    inferred = " (inferred: peak in the log)" if doc["device_bytes_inferred"] else ""
    console.print(f"{doc['calls']} calls on {doc['devices']} devices, budget {doc['device_bytes']:,} B{inferred}, "
                  f"load {doc['load_gb_s']:.2f} GB/s, offload {doc['offload_gb_s']:.2f} GB/s")

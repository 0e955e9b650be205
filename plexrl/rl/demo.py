"""`plexrl demo`: three RL jobs (or `--jobs N`) multiplexed on 2 devices vs each on its own device.

The command: its options, then the experiment (`demo_experiment`: dedicated, exclusive and
multiplexed runs), its figures (`demo_figures` into a `demo_result.DemoSummary`) and their views
(`demo_view`: the live and final tables or `--json`, summary.json and the plots in `--out`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plexrl import engines
from plexrl.observe.web import add_metrics_port
from plexrl.rl import demo_view
from plexrl.rl.demo_experiment import demo_jobs, run_experiment
from plexrl.rl.demo_figures import summarise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = demo_jobs(args.quick, args.steps, args.jobs)
    progress = demo_view.Progress(specs, enabled=not args.json)
    runs = run_experiment(specs, args, progress, out)
    summary = summarise(runs, args)
    demo_view.write_outputs(summary, runs.pairs[0][1].events, out)
    if args.json:
        demo_view.print_json(summary)
    else:
        progress.final_table(summary)
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="plexrl demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a first look; tests)")
    parser.add_argument("--steps", type=positive_int, default=None, help="steps per job (default 24; 6 with --quick)")
    parser.add_argument("--jobs", type=positive_int, default=None,
                        help="number of jobs (default 3); more cycle through the three with new names and seeds")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the final figures, nothing else")
    parser.add_argument("--out", default="plexrl-demo", help="folder for plots, events and summary (default ./plexrl-demo)")
    parser.add_argument("--policy", default="plexrl", help="scheduling policy of the multiplexed cluster (default plexrl)")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="run the exclusive and the multiplexed schedules this many times, one after the other "
                             "(default 1): the makespan ratio of each pair and their median (this machine's timings "
                             "swing); every other figure is the first pair's")
    parser.add_argument("--read-replicas", choices=("auto", "on", "off"), default="auto",
                        help="the multiplexed cluster's read replicas (a snapshot's calls on both devices at once): "
                             "auto (default) on except on the local engine")
    add_metrics_port(parser, "the multiplexed cluster")
    engines.add_engine_option(parser)
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)

"""How `plexrl demo` shows itself: a live table while it runs, the final report on the terminal,
or one JSON object (`--json`); and the files it leaves in `--out` (summary.json, plots).

Invariants: with `--json` nothing but that one object reaches stdout (the live table writes to
/dev/null); the JSON object and summary.json are `DemoSummary.as_json()`, the same in both.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from plexrl.rl import demo_plots
from plexrl.rl.demo_experiment import MUX_DEVICES
from plexrl.rl.demo_result import DemoSummary
from plexrl.rl.spec import JobSpec

MiB = 1 << 20


class Progress:
    """A rich live table of every job's step and reward; silent when disabled (--json)."""

    def __init__(self, specs: list[JobSpec], enabled: bool):
        from rich.console import Console

        self.specs, self.enabled, self.mode = specs, enabled, "warm start"
        self.console = Console(file=sys.stdout if enabled else open("/dev/null", "w"))
        self.rows: dict[tuple[str, str], tuple[int, float]] = {}
        self.cluster_line = ""
        self.lock = threading.Lock()
        self.live = None

    def __enter__(self):
        from rich.live import Live

        if self.enabled:
            self.live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(*exc)
            if not self.console.is_terminal:  # rich ends a live display's last render without a
                self.console.line()           # newline off a terminal: the next print would join it

    def say(self, text: str) -> None:
        self.console.print(text)

    def step(self, job: str, step: int, stats) -> None:
        with self.lock:
            self.rows[(self.mode, job)] = (step + 1, stats.reward)
        self._update()

    def refresh(self, metrics: dict, elapsed: float) -> None:
        busy = metrics.get("device_busy_s", 0.0)
        places = ", ".join(f"{sid}: {where}" for sid, where in sorted(metrics.get("residency", {}).items())
                           if "@" not in sid)
        with self.lock:
            self.cluster_line = (f"utilisation {busy / (MUX_DEVICES * max(elapsed, 1e-9)):.0%}  "
                                 f"switches {metrics.get('switches', 0)}\n{places}")
        self._update()

    def _update(self) -> None:
        if self.live is not None:
            self.live.update(self.render())

    def render(self):
        from rich.console import Group
        from rich.table import Table

        table = Table(title=f"plexrl demo: {self.mode}")
        for column in ("mode", "job", "step", "reward"):
            table.add_column(column)
        with self.lock:
            for (mode, job), (step, reward) in sorted(self.rows.items()):
                total = next(s.steps for s in self.specs if s.name == job)
                table.add_row(mode, job, f"{step}/{total}", f"{reward:.3f}")
            return Group(table, self.cluster_line)

    def final_table(self, summary: DemoSummary) -> None:
        self.console.print(jobs_table(summary))
        self.console.print(figures_text(summary))
        runs = summary.repeats
        if len(runs) > 1:
            pairs = ", ".join(f"{run['makespan_mux_vs_exclusive']:.2f}x (device time {run['device_busy_mux_vs_exclusive']:.2f}x)"
                              for run in runs)
            self.console.print(
                f"{len(runs)} runs of both schedules, one pair after another (--repeat): makespan multiplexed vs "
                f"exclusive {pairs}; median "
                f"{summary.makespan_mux_vs_exclusive_median:.2f}x; identical rewards in all: "
                f"{summary.identical_rewards}")


def jobs_table(summary: DemoSummary):
    """Per job: rewards, step times and device-seconds multiplexed against dedicated."""
    from rich.table import Table

    table = Table(title=f"PlexRL demo: {len(summary.jobs)} jobs, multiplexed on {MUX_DEVICES} devices vs dedicated", caption=(
        "reward: first vs last quarter of steps; step s: multiplexed/dedicated;\n"
        "dev-s: consumed multiplexed (execution + switch-in) vs reserved dedicated (1 device x wall)"))
    for column, justify in (("job", "left"), ("algorithm", "left"), ("steps", "right"), ("reward", "right"),
                            ("step s\nmux/ded", "right"), ("dev-s\nmux", "right"), ("dev-s\nded", "right"),
                            ("same\nrewards", "center")):
        table.add_column(column, justify=justify, no_wrap=column in ("job", "reward") or "/" in column)
    for j in summary.jobs:
        table.add_row(j.name, j.algorithm, str(j.steps),
                      f"{j.reward_first:.2f}→{j.reward_last:.2f}",
                      f"{j.step_s_mux:.2f}/{j.step_s_dedicated:.2f}",  # multiplexed / dedicated
                      f"{j.consumed_device_s:.1f}", f"{j.reserved_device_s:.1f}",
                      "yes" if j.identical_rewards else "NO")
    return table


def figures_text(summary: DemoSummary) -> str:
    """The report's figures under the table: cost, makespans, completion times, devices held,
    the device budget, slack and the placer's error, switches."""
    s, d, p = summary.schedules, summary.device_use, summary.placer
    split = d.device_budget
    return (
        f"cost reduction {summary.cost_reduction:.1%}   makespan on {MUX_DEVICES} devices: "
        f"{s.makespan_mux_s:.1f} s multiplexed vs {s.makespan_exclusive_s:.1f} s exclusive "
        f"run (each job holding one device, arrival order) = {s.makespan_mux_vs_exclusive:.2f}x "
        f"({s.makespan_mux_vs_exclusive_computed:.2f}x the {s.makespan_exclusive_computed_s:.1f} s "
        f"computed from the dedicated runs); {s.makespan_sequential_s:.1f} s one after another on one device\n"
        f"the same calls' device time: {d.device_busy_s_mux:.1f} s multiplexed vs "
        f"{d.device_busy_s_exclusive:.1f} s exclusive ({s.device_busy_mux_vs_exclusive:.2f}x); "
        f"the multiplexed run's work fills its devices (and cores) for {d.makespan_mux_floor_s:.1f} s\n"
        f"mean job completion time (queueing + run): {s.jct_mean_mux_s:.1f} s multiplexed vs "
        f"{s.jct_mean_exclusive_s:.1f} s exclusive = {s.jct_mean_mux_vs_exclusive:.2f}x\n"
        f"device-s held: {d.device_s_held_mux:.1f} multiplexed ({MUX_DEVICES} x makespan) vs "
        f"{d.device_s_held_exclusive:.1f} exclusive ({MUX_DEVICES} x makespan) or "
        f"{d.device_s_held_exclusive_jobs:.1f} (each job's device for its run only)\n"
        f"device budget {split['device_memory_bytes'] / MiB:.1f} MiB: {split['state_bytes'] / MiB:.1f} for states, "
        f"{split['activation_reserve_bytes'] / MiB:.1f} activation reserve (measured)\n"
        f"jobs within their slack (mean step multiplexed vs alone): {summary.within_slack:.0%}   "
        f"placer's predicted inflation vs realised: mean error {_percent(p.inflation_mae)}, "
        f"{_percent(p.inflation_mae_waiting)} vs its waiting for devices "
        f"({p.profiles_unmeasured} of {len(summary.jobs)} jobs never measured); "
        f"{_percent(p.inflation_mae_waiting_alone)} on their profiles measured alone"
        + ("" if p.busy_shares_dedicated is None else
           f" (together {p.busy_shares_dedicated:.2f} devices busy)") + "\n"
        f"switches {d.switches} (overhead {d.switch_overhead:.1%} of busy time)   "
        f"identical rewards: {summary.identical_rewards}\n"
        f"plots, events.jsonl and summary.json in {summary.settings.out}/")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def print_json(summary: DemoSummary) -> None:
    """`--json`: the report as one object on stdout."""
    print(json.dumps(summary.as_json()))


def write_outputs(summary: DemoSummary, events: list[dict], out: Path) -> None:
    """summary.json and the plots beside the event logs in `out`."""
    report = summary.as_json()
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    demo_plots.reward_curves(report, out / "rewards.png")
    demo_plots.device_timeline(events, out / "timeline.png")
    demo_plots.cost_bars(report, out / "cost.png")

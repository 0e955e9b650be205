"""`plexrl demo`: three RL jobs (or `--jobs N`) multiplexed on 2 devices vs each on its own device.

1) warm-start (or reuse from the cache) one tiny model per task;
2) dedicated: each job alone on a 1-device cluster, one after another (the colocated pattern:
   the job reserves its device for its whole wall time): each job's step times and rewards alone;
   from these runs also comes the exclusive schedule computed (each run had the machine's other
   core for its controller, which flatters that baseline; but it ran at another time, which on
   a shared machine moves its figures as much);
3) exclusive, run: the same 2 devices, each job holding one of them (a 1-device cluster each)
   for its whole run, jobs taking the first free device in arrival order (list scheduling); its
   jobs compete for the host's cores as the multiplexed ones do, so the two schedules are
   compared under the same conditions;
4) multiplexed: the three controllers run concurrently (threads) on one 2-device cluster whose
   device budget holds about one job's working set per device (next to the activation reserve the
   dedicated runs measured), so states must be swapped;
   both clusters on the same engine (`--engine`): by default a process per device, so that the
   two devices compute in parallel and are charged their own CPU time, as GPUs would be — worker
   threads of one interpreter would take turns on its lock (`--engine local` shows that); in
   both, the controllers run at a lower CPU priority than the devices (`train.controllers`);
5) compare: reward curves (must be identical: every sample has an explicit seed), device-seconds
   consumed vs reserved, makespan multiplexed vs exclusive on the same devices (and vs one after
   another on one device), each job's completion time (every job arrives at the start, so
   queueing for a device is part of it) and their mean under both schedules, device-seconds
   held by each; write plots, the event log and
   summary.json into --out (the dedicated runs' event log as events-dedicated.jsonl).

Device idle time inside a job is real: tool calls wait on the sandbox service (a latency, as a
service elsewhere in the cluster: `plexrl.tasks.sandbox`), rewards and advantages are computed
in the controller, and the controller waits on each result before the next call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from plexrl import engines
from plexrl.observe.web import add_metrics_port, watched
from plexrl.models.tiny import parameter_count
from plexrl.policy import Forecast, ModelMemory, profile_from_events, waited_s
from plexrl.policy.placement.cotenancy import pooled_inflation
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.threads import usable_cpus
from plexrl.rl import demo_plots
from plexrl.rl.spec import JobSpec
from plexrl.rl.train import JobResult, controllers, run_job
from plexrl.rl.warm_start import warm_model

MUX_DEVICES = 2
MiB = 1 << 20
# A trainable state holds weights, gradients and two Adam moments: 4x its weights on a device.
TRAINABLE_COPIES = 4
# Budget per device for states, in units of one model's weights: one job's policy + sampler (+ a
# little), not two jobs', so multiplexing really swaps states between device and host. The device
# budget is that plus the activation reserve the runtime measures (runtime/activation.py).
DEVICE_BUDGET_WEIGHTS = 6


def demo_jobs(quick: bool, steps: int | None = None, jobs: int | None = None) -> list[JobSpec]:
    """The three demo jobs; `jobs=N` cycles through them (job i: its own name, seed i + 1)."""
    steps = steps or (6 if quick else 24)
    base = [
        JobSpec(name="addition-grpo", algorithm="grpo", task="addition", steps=steps, seed=1,
                problems_per_step=16, group_size=8, learning_rate=2e-4),
        JobSpec(name="countdown-ppo", algorithm="ppo", task="countdown", steps=steps, seed=2,
                problems_per_step=16, group_size=4, learning_rate=2e-4),
        JobSpec(name="tools-rpp", algorithm="reinforce_pp", task="tool_use", steps=steps, seed=3,
                problems_per_step=4, group_size=4, learning_rate=2e-4, kl_coef=0.01, max_tokens=16),
    ]
    count = jobs or len(base)
    return [base[i] if i < len(base) else
            base[i % len(base)].model_copy(update={"name": f"{base[i % len(base)].name}-{i // len(base) + 1}", "seed": i + 1})
            for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = demo_jobs(args.quick, args.steps, args.jobs)
    progress = Progress(specs, enabled=not args.json)
    progress.say("warm start (cached after the first run)...")
    models = {spec.name: str(warm_model(spec.task, spec.model)) for spec in specs}
    states = DEVICE_BUDGET_WEIGHTS * 4 * max(parameter_count(m) for m in models.values())
    with progress, engines.session(args.engine, MUX_DEVICES):
        dedicated, reserves, dedicated_events = run_dedicated(specs, models, args, progress, out)
        exclusive, exclusive_use = run_exclusive(specs, models, args, progress)
        budget = states + max(reserves.values())  # what states may use, and activations beside them
        mux, metrics, events = run_multiplexed(specs, models, args, budget, progress, out / "events.jsonl")
        again = [run_again(specs, models, args, budget, progress, dedicated) for _ in range(args.repeat - 1)]
    waits = {s.name: (waited_s(dedicated_events, s.name), waited_s(events, s.name)) for s in specs}
    alone = predicted_from_alone(specs, dedicated_events, metrics["jct_s"])
    summary = summarise(specs, dedicated, exclusive, mux, metrics, args, waits, alone, exclusive_use)
    summary.update(repeated(summary, again))
    write_outputs(summary, events, out)
    if args.json:
        print(json.dumps(summary))
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


# ---------------------------------------------------------------------------- the two modes

def run_dedicated(specs, models, args, progress: "Progress", out: Path):
    """Each job alone on one device, one after another: its result and the device-seconds it
    used (the rest of its wall time its reserved device sat idle), by job; and the activation
    reserve the runtime measured for each model folder."""
    progress.mode = "dedicated"
    with engines.open_cluster(args.engine, 1, policy=args.policy, torch_device=args.device,
                              precision=args.precision) as cluster:
        warm_up(cluster, models.values())
        with controllers(1) as pool:  # one job at a time, its controller as niced as the multiplexed ones
            results = {s.name: pool.submit(run_job, cluster, s, models[s.name], on_step=progress.step).result()
                       for s in specs}
        metrics = cluster.metrics()
        cluster.write_events(out / "events-dedicated.jsonl")
        used = metrics["jobs"]
        return ({name: (result, used[name]["consumed_device_s"]) for name, result in results.items()},
                metrics["activation_reserves"], cluster.events())


def run_exclusive(specs, models, args, progress: "Progress") -> tuple[list[tuple[dict, JobResult]], dict]:
    """The exclusive schedule on `MUX_DEVICES` devices, run: each device a 1-device cluster of its
    own (the process engine pins device d's to the d-th core or GPU), each job holding one for its
    whole run, in arrival order on the first free device. Per job, in `specs` order: its row
    (device, start_s, end_s from the schedule's start) and its result; and the run's
    `device_busy_s` (the devices' time charged, summed) and `host_cpu_s` (this process's CPU),
    as `run_multiplexed` measures them."""
    progress.mode = "exclusive"
    pinned = (lambda d: {"first_device": d}) if args.engine == "process" else (lambda d: {})
    with ExitStack() as stack:
        clusters = [stack.enter_context(engines.open_cluster(
            args.engine, 1, policy=args.policy, torch_device=args.device, precision=args.precision, **pinned(d)))
            for d in range(MUX_DEVICES)]
        for cluster in clusters:
            warm_up(cluster, models.values())
        waiting, lock, done = list(specs), threading.Lock(), {}
        started, cpu_started = time.perf_counter(), time.process_time()

        def serve(device: int) -> None:  # one device: the next job in arrival order, until none is left
            while True:
                with lock:
                    if not waiting:
                        return
                    spec, start = waiting.pop(0), time.perf_counter() - started
                result = run_job(clusters[device], spec, models[spec.name], on_step=progress.step)
                row = {"name": spec.name, "device": device, "start_s": start, "end_s": time.perf_counter() - started}
                done[spec.name] = (row, result)

        with controllers(MUX_DEVICES) as pool:
            for future in [pool.submit(serve, d) for d in range(MUX_DEVICES)]:
                future.result()
        host_cpu_s = time.process_time() - cpu_started
        device_busy_s = sum(cluster.metrics()["device_busy_s"] for cluster in clusters)
    return [done[s.name] for s in specs], {"device_busy_s": device_busy_s, "host_cpu_s": host_cpu_s}


def run_multiplexed(specs, models, args, budget, progress, events_path: Path | None):
    """All jobs at once on `MUX_DEVICES` devices: their results, the cluster's metrics (with the
    makespan, each job's completion time and the process's CPU), and the event log (written to
    `events_path` unless None)."""
    progress.mode = "multiplexed"
    replicas = {"auto": None, "on": True, "off": False}[args.read_replicas]
    with engines.open_cluster(args.engine, MUX_DEVICES, device_memory_bytes=budget, policy=args.policy,
                              torch_device=args.device, precision=args.precision, read_replicas=replicas) as cluster, \
            watched(cluster, args.metrics_port):
        warm_up(cluster, models.values())
        started, cpu_started = time.perf_counter(), time.process_time()
        finished: dict[str, float] = {}  # job -> seconds from the batch's start to its end (its JCT)
        with controllers(len(specs)) as pool:
            futures = {s.name: pool.submit(run_job, cluster, s, models[s.name], on_step=progress.step) for s in specs}
            for name, future in futures.items():
                future.add_done_callback(lambda _, name=name: finished.setdefault(name, time.perf_counter() - started))
            while not all(f.done() for f in futures.values()):
                progress.refresh(cluster.metrics(), time.perf_counter() - started)
                time.sleep(0.25)
            results = {name: f.result() for name, f in futures.items()}
        metrics = cluster.metrics()
        metrics["makespan_s"] = time.perf_counter() - started
        metrics["jct_s"] = {s.name: finished[s.name] for s in specs}
        metrics["host_cpu_s"] = time.process_time() - cpu_started
        if events_path is not None:
            cluster.write_events(events_path)
        return results, metrics, cluster.events()


def run_again(specs, models, args, budget, progress, dedicated) -> dict:
    """One more pair of runs, the exclusive schedule then the multiplexed one (`--repeat`): their
    makespans, and whether every job's rewards in both are its dedicated run's."""
    exclusive, exclusive_use = run_exclusive(specs, models, args, progress)
    mux, metrics, _ = run_multiplexed(specs, models, args, budget, progress, None)
    return {**pair_figures(exclusive, exclusive_use, metrics),
            "identical_rewards": all(mux[s.name].rewards == dedicated[s.name][0].rewards == result.rewards
                                     for s, (_, result) in zip(specs, exclusive, strict=True))}


PAIR_FIGURES = ("makespan_mux_s", "makespan_exclusive_s", "makespan_mux_vs_exclusive", "device_busy_mux_vs_exclusive")


def pair_figures(exclusive_run: list[tuple[dict, JobResult]], exclusive_use: dict, metrics: dict) -> dict:
    """The figures of one pair of runs (`PAIR_FIGURES`), from the exclusive schedule's
    (`run_exclusive`: its rows and results, and its device time) and the multiplexed cluster's
    metrics (`run_multiplexed`): both makespans and their ratio, and the ratio of the same calls'
    device time in the two."""
    makespan_exclusive = max(row["end_s"] for row, _ in exclusive_run)
    return {"makespan_mux_s": metrics["makespan_s"], "makespan_exclusive_s": makespan_exclusive,
            "makespan_mux_vs_exclusive": metrics["makespan_s"] / makespan_exclusive,
            "device_busy_mux_vs_exclusive": metrics["device_busy_s"] / exclusive_use["device_busy_s"]}


def repeated(summary: dict, again: list[dict]) -> dict:
    """The summary's fields over every pair of runs (the first, whose figures the summary holds,
    and `again`): each pair's makespans (`repeats`), the median ratio, and identical rewards only
    when they were so in every run."""
    first = {key: summary[key] for key in (*PAIR_FIGURES, "identical_rewards")}
    runs = [first, *again]
    return {"repeats": runs, "makespan_mux_vs_exclusive_median": statistics.median(
                run["makespan_mux_vs_exclusive"] for run in runs),
            "identical_rewards": all(run["identical_rewards"] for run in runs)}


def warm_up(cluster, models) -> None:
    """Load each base model once before any clock starts: engine start-up (a Ray worker process
    importing the model's code, building its architecture) is the service's, not a job's, and
    would otherwise be billed to whichever job comes first. Nothing runs on a device."""
    with cluster.service_client("warm-up") as service:
        for i, model in enumerate(sorted(set(models))):
            service.create_training_client(base_model=model, name=f"model-{i}")


# ---------------------------------------------------------------------------- the comparison

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


def summarise(specs, dedicated: dict[str, tuple[JobResult, float]], exclusive_run: list[tuple[dict, JobResult]],
              mux: dict[str, JobResult], metrics: dict, args, waits: dict[str, tuple[float, float]],
              alone: dict[str, dict], exclusive_use: dict) -> dict:
    """`exclusive_run`: per job (in `specs` order), its row of the exclusive schedule run and its
    result there; `waits`: per job, the seconds it waited for a device held by others
    (`policy.waited_s`), dedicated and multiplexed; `alone`: `predicted_from_alone`;
    `exclusive_use`: the exclusive run's device time and host CPU (`run_exclusive`)."""
    jobs = [job_row(spec, *dedicated[spec.name], in_exclusive, mux[spec.name], metrics["jobs"].get(spec.name, {}),
                    metrics["placement"].get(spec.name, {}), waits[spec.name], alone[spec.name])
            for spec, (_, in_exclusive) in zip(specs, exclusive_run, strict=True)]
    predicted = [j for j in jobs if j["inflation_predicted"] is not None]
    alone_unmeasured = any(j["inflation_predicted_alone"] is None for j in jobs)
    consumed = sum(j["consumed_device_s"] for j in jobs)
    reserved = sum(j["reserved_device_s"] for j in jobs)
    busy = metrics["device_busy_s"]
    exclusive = [row for row, _ in exclusive_run]
    pair = pair_figures(exclusive_run, exclusive_use, metrics)
    makespan_exclusive = pair["makespan_exclusive_s"]
    computed = exclusive_schedule([(s.name, dedicated[s.name][0].wall_s) for s in specs], MUX_DEVICES)
    makespan_computed = max(row["end_s"] for row in computed)
    # The same, had the jobs arrived longest first (durations known in advance): a stronger baseline.
    longest_first = sorted(((s.name, dedicated[s.name][0].wall_s) for s in specs), key=lambda job: -job[1])
    makespan_longest_first = max(row["end_s"] for row in exclusive_schedule(longest_first, MUX_DEVICES))
    # Job completion time (every job arrives at the start): queueing for a device plus its run.
    jct_exclusive = {row["name"]: row["end_s"] for row in exclusive}
    jct_mux = metrics["jct_s"]
    return {
        "jobs": jobs,
        "cost_reduction": 1.0 - consumed / reserved,
        "identical_rewards": all(j["identical_rewards"] for j in jobs),  # dedicated, exclusive and multiplexed
        "within_slack": mean([1.0 if j["within_slack"] else 0.0 for j in jobs]),  # share of jobs within their SLO
        # the placer's predicted inflation against the realised slowdown, as `plexrl sim` reports it, and
        # against the part of it that is waiting for devices (what the co-tenancy model is a model of)
        "inflation_mae": mean([abs(j["inflation_predicted"] - j["slowdown"]) for j in predicted]) if predicted else None,
        "inflation_mae_waiting": mean([abs(j["inflation_predicted"] - j["slowdown_waiting"]) for j in predicted])
        if predicted else None,
        # the same model on the profiles measured alone (`predicted_from_alone`), and the devices the
        # jobs' calls keep busy alone, together (the pool has MUX_DEVICES)
        "inflation_mae_waiting_alone": None if alone_unmeasured else
        mean([abs(j["inflation_predicted_alone"] - j["slowdown_waiting"]) for j in jobs]),
        "busy_shares_dedicated": None if alone_unmeasured else sum(j["busy_share_dedicated"] for j in jobs),
        "profiles_unmeasured": len(jobs) - len(predicted),
        "placements_provisional": sum(bool(j["placement_provisional"]) for j in jobs),
        **pair,  # the exclusive schedule's makespan is the one run
        # computed from the dedicated runs (each had the other core for its controller, at another time)
        "makespan_exclusive_computed_s": makespan_computed,
        "makespan_mux_vs_exclusive_computed": metrics["makespan_s"] / makespan_computed,
        "makespan_exclusive_longest_first_s": makespan_longest_first,
        "makespan_sequential_s": sum(result.wall_s for result, _ in dedicated.values()),  # one device
        "exclusive_schedule": exclusive,
        "exclusive_schedule_computed": computed,
        "jct_mux_s": jct_mux,
        "jct_exclusive_s": jct_exclusive,
        "jct_mean_mux_s": mean(jct_mux.values()),
        "jct_mean_exclusive_s": mean(jct_exclusive.values()),
        "jct_mean_mux_vs_exclusive": mean(jct_mux.values()) / mean(jct_exclusive.values()),
        "devices": MUX_DEVICES,
        # Device-seconds held: multiplexed, both devices for the whole makespan; exclusive, either
        # the devices for its makespan (a cluster reserved for the batch) or only each job's own
        # device for its run (devices handed back the moment a job ends): both are reported.
        "device_s_held_mux": MUX_DEVICES * metrics["makespan_s"],
        "device_s_held_exclusive": MUX_DEVICES * makespan_exclusive,
        "device_s_held_exclusive_jobs": sum(row["end_s"] - row["start_s"] for row in exclusive),
        "switches": metrics["switches"],
        "device_budget": budget_split(metrics),  # per device: its reserve, and what states may use
        "switch_overhead": metrics["transition_s"] / busy if busy else 0.0,
        "device_utilisation_mux": busy / (MUX_DEVICES * metrics["makespan_s"]),
        # Where the devices' time goes on a CPU machine: this process's CPU over the multiplexed
        # run (controllers, the runtime's dispatch) competes with the devices for the same cores.
        "host_cpu_s_mux": metrics["host_cpu_s"],
        "host_cpu_s_exclusive": exclusive_use["host_cpu_s"],
        "cpu_cores": usable_cpus(),
        # The same calls' device time (charged: on CPU devices their CPU) in each run. The three runs
        # happen one after another; when the host's speed moves between them (a shared machine),
        # the makespans carry it (`device_busy_mux_vs_exclusive`, above: above 1, the multiplexed
        # run's devices computed the same work slower).
        "device_busy_s_dedicated": sum(busy_s for _, busy_s in dedicated.values()),
        "device_busy_s_exclusive": exclusive_use["device_busy_s"],
        "device_busy_s_mux": busy,
        "makespan_mux_floor_s": mux_floor(busy, metrics["host_cpu_s"], args.device, args.engine),
        "policy": args.policy,
        "read_replicas": metrics["read_replicas"],  # as the multiplexed cluster ran (--read-replicas auto: by engine)
        "engine": args.engine,
        "quick": args.quick,
        "out": str(args.out),
    }


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


def exclusive_schedule(durations: list[tuple[str, float]], devices: int) -> list[dict]:
    """List scheduling in arrival order: each job takes the device that frees first, for its whole run."""
    free_at = [0.0] * devices
    rows = []
    for name, duration in durations:
        device = min(range(devices), key=lambda d: (free_at[d], d))
        rows.append({"name": name, "device": device, "start_s": free_at[device], "end_s": free_at[device] + duration})
        free_at[device] += duration
    return rows


def job_row(spec: JobSpec, dedicated: JobResult, dedicated_busy_s: float, exclusive: JobResult, mux: JobResult,
            usage: dict, placed: dict, waits: tuple[float, float], alone: dict) -> dict:
    window = max(1, spec.steps // 4)  # single steps are noisy: compare the first and last quarter
    slowed = slowdown(mux.step_s, dedicated.step_s)
    # the part of the slowdown that is waiting for devices held by other jobs; the rest is its calls
    # and its controller running slower on a host shared with the others (here: the devices' cores)
    waiting = (waits[1] - waits[0]) / sum(dedicated.step_s) if sum(dedicated.step_s) > 0 else 0.0
    return {
        "name": spec.name, "algorithm": spec.algorithm, "task": spec.task, "steps": spec.steps,
        "reward_first": mean(mux.rewards[:window]), "reward_last": mean(mux.rewards[-window:]),
        "reward_window_steps": window,
        "identical_rewards": mux.rewards == dedicated.rewards == exclusive.rewards,
        "rewards_mux": mux.rewards, "rewards_dedicated": dedicated.rewards,
        "step_s_mux": mean(mux.step_s), "step_s_dedicated": mean(dedicated.step_s),
        "step_s_exclusive": mean(exclusive.step_s),
        # its SLO: the mean step multiplexed against alone, minus 1, and whether that stays within its slack
        "slack": spec.slack, "slowdown": slowed, "within_slack": slowed <= spec.slack,
        "slowdown_waiting": waiting, "slowdown_other": slowed - waiting,
        # the placer's co-tenancy model for it: the step inflation it predicted, averaged over the
        # job's time placed with a measured profile (None: never measured); whether its placement
        # is still the provisional one, made on a guess without a slack check (a job brought no profile)
        "inflation_predicted": placed.get("inflation_predicted"), "placement_provisional": placed.get("provisional"),
        "replacement_refused": placed.get("replacement_refused"),  # the placer's reason, when it kept the job put
        # the devices its calls keep busy alone (its dedicated run), and the placer's model on the
        # profiles measured alone (`predicted_from_alone`)
        "busy_share_dedicated": alone["busy_share"], "inflation_predicted_alone": alone["inflation_predicted"],
        "consumed_device_s": usage.get("consumed_device_s", 0.0),
        "switch_s": usage.get("switch_s", 0.0),
        "queue_wait_s": usage.get("queue_wait_s", 0.0),
        "reserved_device_s": dedicated.wall_s * 1,  # one device, held for the job's whole run
        "dedicated_busy_s": dedicated_busy_s,
    }


def slowdown(mux_step_s: list[float], dedicated_step_s: list[float]) -> float:
    alone = mean(dedicated_step_s)
    return mean(mux_step_s) / alone - 1.0 if alone > 0 else 0.0


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def mean(values) -> float:
    return sum(values) / len(values) if values else 0.0


def write_outputs(summary: dict, events: list[dict], out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    demo_plots.reward_curves(summary, out / "rewards.png")
    demo_plots.device_timeline(events, out / "timeline.png")
    demo_plots.cost_bars(summary, out / "cost.png")


# ---------------------------------------------------------------------------- live progress

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

    def final_table(self, summary: dict) -> None:
        from rich.table import Table

        split = summary["device_budget"]
        table = Table(title=f"PlexRL demo: {len(summary['jobs'])} jobs, multiplexed on {MUX_DEVICES} devices vs dedicated", caption=(
            "reward: first vs last quarter of steps; step s: multiplexed/dedicated;\n"
            "dev-s: consumed multiplexed (execution + switch-in) vs reserved dedicated (1 device x wall)"))
        for column, justify in (("job", "left"), ("algorithm", "left"), ("steps", "right"), ("reward", "right"),
                                ("step s\nmux/ded", "right"), ("dev-s\nmux", "right"), ("dev-s\nded", "right"),
                                ("same\nrewards", "center")):
            table.add_column(column, justify=justify, no_wrap=column in ("job", "reward") or "/" in column)
        for j in summary["jobs"]:
            table.add_row(j["name"], j["algorithm"], str(j["steps"]),
                          f"{j['reward_first']:.2f}→{j['reward_last']:.2f}",
                          f"{j['step_s_mux']:.2f}/{j['step_s_dedicated']:.2f}",  # multiplexed / dedicated
                          f"{j['consumed_device_s']:.1f}", f"{j['reserved_device_s']:.1f}",
                          "yes" if j["identical_rewards"] else "NO")
        self.console.print(table)
        self.console.print(
            f"cost reduction {summary['cost_reduction']:.1%}   makespan on {MUX_DEVICES} devices: "
            f"{summary['makespan_mux_s']:.1f} s multiplexed vs {summary['makespan_exclusive_s']:.1f} s exclusive "
            f"run (each job holding one device, arrival order) = {summary['makespan_mux_vs_exclusive']:.2f}x "
            f"({summary['makespan_mux_vs_exclusive_computed']:.2f}x the {summary['makespan_exclusive_computed_s']:.1f} s "
            f"computed from the dedicated runs); {summary['makespan_sequential_s']:.1f} s one after another on one device\n"
            f"the same calls' device time: {summary['device_busy_s_mux']:.1f} s multiplexed vs "
            f"{summary['device_busy_s_exclusive']:.1f} s exclusive ({summary['device_busy_mux_vs_exclusive']:.2f}x); "
            f"the multiplexed run's work fills its devices (and cores) for {summary['makespan_mux_floor_s']:.1f} s\n"
            f"mean job completion time (queueing + run): {summary['jct_mean_mux_s']:.1f} s multiplexed vs "
            f"{summary['jct_mean_exclusive_s']:.1f} s exclusive = {summary['jct_mean_mux_vs_exclusive']:.2f}x\n"
            f"device-s held: {summary['device_s_held_mux']:.1f} multiplexed ({MUX_DEVICES} x makespan) vs "
            f"{summary['device_s_held_exclusive']:.1f} exclusive ({MUX_DEVICES} x makespan) or "
            f"{summary['device_s_held_exclusive_jobs']:.1f} (each job's device for its run only)\n"
            f"device budget {split['device_memory_bytes'] / MiB:.1f} MiB: {split['state_bytes'] / MiB:.1f} for states, "
            f"{split['activation_reserve_bytes'] / MiB:.1f} activation reserve (measured)\n"
            f"jobs within their slack (mean step multiplexed vs alone): {summary['within_slack']:.0%}   "
            f"placer's predicted inflation vs realised: mean error {_percent(summary['inflation_mae'])}, "
            f"{_percent(summary['inflation_mae_waiting'])} vs its waiting for devices "
            f"({summary['profiles_unmeasured']} of {len(summary['jobs'])} jobs never measured); "
            f"{_percent(summary['inflation_mae_waiting_alone'])} on their profiles measured alone"
            + ("" if summary["busy_shares_dedicated"] is None else
               f" (together {summary['busy_shares_dedicated']:.2f} devices busy)") + "\n"
            f"switches {summary['switches']} (overhead {summary['switch_overhead']:.1%} of busy time)   "
            f"identical rewards: {summary['identical_rewards']}\n"
            f"plots, events.jsonl and summary.json in {summary['out']}/")
        runs = summary["repeats"]
        if len(runs) > 1:
            pairs = ", ".join(f"{run['makespan_mux_vs_exclusive']:.2f}x (device time {run['device_busy_mux_vs_exclusive']:.2f}x)"
                              for run in runs)
            self.console.print(
                f"{len(runs)} runs of both schedules, one pair after another (--repeat): makespan multiplexed vs "
                f"exclusive {pairs}; median "
                f"{summary['makespan_mux_vs_exclusive_median']:.2f}x; identical rewards in all: "
                f"{summary['identical_rewards']}")

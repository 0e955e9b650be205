"""The demo's experiment: the same RL jobs run dedicated, exclusive and multiplexed; what each run measured.

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
4) multiplexed: the controllers run concurrently (threads) on one 2-device cluster whose
   device budget holds about one job's working set per device (next to the activation reserve the
   dedicated runs measured), so states must be swapped;
   both clusters on the same engine (`--engine`): by default a process per device, so that the
   two devices compute in parallel and are charged their own CPU time, as GPUs would be — worker
   threads of one interpreter would take turns on its lock (`--engine local` shows that); in
   both, the controllers run at a lower CPU priority than the devices (`train.controllers`);
5) `--repeat N`: the exclusive and the multiplexed schedules again, one pair after another.

Device idle time inside a job is real: tool calls wait on the sandbox service (a latency, as a
service elsewhere in the cluster: `plexrl.tasks.sandbox`), rewards and advantages are computed
in the controller, and the controller waits on each result before the next call.
Invariants: every sample has an explicit seed, so a job's rewards are the same in every run;
every clock starts after the clusters are warmed up (`warm_up`). Nothing here computes a figure
(`demo_figures`) or prints one (`demo_view`); each run reports progress through `on_step`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from plexrl import engines
from plexrl.models.tiny import parameter_count
from plexrl.observe.web import watched
from plexrl.rl.demo_result import ScheduleRow
from plexrl.rl.spec import JobSpec
from plexrl.rl.train import JobResult, controllers, run_job
from plexrl.rl.warm_start import warm_model

MUX_DEVICES = 2
# Budget per device for states, in units of one model's weights: one job's policy + sampler (+ a
# little), not two jobs', so multiplexing really swaps states between device and host. The device
# budget is that plus the activation reserve the runtime measures (runtime/activation.py).
DEVICE_BUDGET_WEIGHTS = 6


class RunProgress(Protocol):
    """What the runs tell as they go (`demo_view.Progress`)."""

    mode: str

    def say(self, text: str) -> None: ...

    def step(self, job: str, step: int, stats) -> None: ...

    def refresh(self, metrics: dict, elapsed: float) -> None: ...


@dataclass
class DedicatedRun:
    """Each job alone on one device, one after another."""

    results: dict[str, tuple[JobResult, float]]  # per job: its result, the device-seconds it used
    reserves: dict[str, int]  # the activation reserve the runtime measured, per model folder
    events: list[dict]


@dataclass
class ExclusiveRun:
    """The exclusive schedule run on `MUX_DEVICES` devices."""

    jobs: list[tuple[ScheduleRow, JobResult]]  # per job, in arrival order: its row and its result
    device_busy_s: float  # the devices' time charged, summed
    host_cpu_s: float  # this process's CPU over the run


@dataclass
class MuxRun:
    """Every job at once on one `MUX_DEVICES`-device cluster."""

    results: dict[str, JobResult]
    metrics: dict  # the cluster's, with `makespan_s`, `jct_s` (per job) and `host_cpu_s` added
    events: list[dict]


@dataclass
class DemoRuns:
    """Everything the experiment ran: the dedicated runs, and each pair of exclusive and
    multiplexed runs (the first is the one reported in full; its event log is written)."""

    specs: list[JobSpec]
    dedicated: DedicatedRun
    pairs: list[tuple[ExclusiveRun, MuxRun]]


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


def run_experiment(specs: list[JobSpec], args, progress: RunProgress, out: Path) -> DemoRuns:
    """Every run of the demo, in order, with the event logs written into `out`
    (events-dedicated.jsonl, events.jsonl: the first multiplexed run's)."""
    progress.say("warm start (cached after the first run)...")
    models = {spec.name: str(warm_model(spec.task, spec.model)) for spec in specs}
    states = DEVICE_BUDGET_WEIGHTS * 4 * max(parameter_count(m) for m in models.values())
    with progress, engines.session(args.engine, MUX_DEVICES):
        dedicated = run_dedicated(specs, models, args, progress, out)
        budget = states + max(dedicated.reserves.values())  # what states may use, and activations beside them
        pairs = []
        for k in range(args.repeat):
            exclusive = run_exclusive(specs, models, args, progress)
            pairs.append((exclusive, run_multiplexed(specs, models, args, budget, progress,
                                                     out / "events.jsonl" if k == 0 else None)))
    return DemoRuns(specs, dedicated, pairs)


def run_dedicated(specs, models, args, progress: RunProgress, out: Path) -> DedicatedRun:
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
        return DedicatedRun({name: (result, used[name]["consumed_device_s"]) for name, result in results.items()},
                            metrics["activation_reserves"], cluster.events())


def run_exclusive(specs, models, args, progress: RunProgress) -> ExclusiveRun:
    """The exclusive schedule on `MUX_DEVICES` devices, run: each device a 1-device cluster of its
    own (the process engine pins device d's to the d-th core or GPU), each job holding one for its
    whole run, in arrival order on the first free device; the devices' time and this process's
    CPU as `run_multiplexed` measures them."""
    progress.mode = "exclusive"
    pinned = (lambda d: {"first_device": d}) if args.engine == "process" else (lambda d: {})
    with ExitStack() as stack:
        clusters = [stack.enter_context(engines.open_cluster(
            args.engine, 1, policy=args.policy, torch_device=args.device, precision=args.precision, **pinned(d)))
            for d in range(MUX_DEVICES)]
        with ThreadPoolExecutor(len(clusters)) as pool:  # each cluster's own device: both at once
            list(pool.map(lambda cluster: warm_up(cluster, models.values()), clusters))
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
    return ExclusiveRun([done[s.name] for s in specs], device_busy_s, host_cpu_s)


def run_multiplexed(specs, models, args, budget, progress: RunProgress, events_path: Path | None) -> MuxRun:
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
        return MuxRun(results, metrics, cluster.events())


def warm_up(cluster, models) -> None:
    """Load each base model once before any clock starts: engine start-up (a Ray worker process
    importing the model's code, building its architecture) is the service's, not a job's, and
    would otherwise be billed to whichever job comes first. Nothing runs on a device."""
    with cluster.service_client("warm-up") as service:
        for i, model in enumerate(sorted(set(models))):
            service.create_training_client(base_model=model, name=f"model-{i}")

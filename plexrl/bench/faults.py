"""`plexrl bench faults`: device processes killed at random points of a multi-job run, and how
long each job took to get going again, against the job's own step time in the same run without kills.

Several deterministic RL-like jobs (sample with explicit seeds, old log-probs, an
importance-sampling update, a weight sync, a step mark) share a 2-device process engine whose
budget holds one trainer and one snapshot per device, so they keep switching. A `Killer` thread
SIGKILLs a device's process at random moments (a seeded generator: short delays land mid-call or
in a switch, long ones between calls) a bounded number of times; the engine restarts the process.

The job loop (`run_job`) retries each *step* as a unit. Which calls of a step changed the state
when one failed is not knowable from outside (a call whose reply was lost may have been written
through), so each step starts from a checkpoint (`save_state`, with the optimizer: gradients are
zero at a step's start) and a retriable failure anywhere in it (`WorkerFailed`; `StateLost` when
the kill tore a host copy being written back) loads that checkpoint and runs the step again.
Seeds are explicit, so a redone step is bitwise the step an uninterrupted run takes.

Figures: per kill, the seconds from the SIGKILL to the next completed step of each job it
interrupted (the worst of them); their median and max; the jobs' mean step time without kills
and the ratio. tests/test_faults.py runs the same functions and asserts bitwise equality.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from plexrl.api import errors
from plexrl.api.client import SamplingClient
from plexrl.api.types import AdamParams, Datum, ModelInput, SamplingParams
from plexrl.bench.common import emit, median

MiB = 1 << 20
RETRIABLE = (errors.WorkerFailed, errors.StateLost)
SEEDS = (1, 2, 3)


@dataclass(frozen=True)
class Kill:
    t: float  # time.perf_counter() of the SIGKILL
    device: int
    live: bool  # the process was running when it was killed (not already dead)
    moment: str  # "mid-call" (a call dispatched to the device, not ended), "switch" (such a call loading), "between calls"


@dataclass
class FaultLog:
    """What the jobs saw, on time.perf_counter()'s axis: (t, job, step, error name or None)."""

    records: list[tuple[float, str, int, str | None]] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, job: str, step: int, error: BaseException | None = None) -> None:
        with self.lock:
            self.records.append((time.perf_counter(), job, step, None if error is None else type(error).__name__))

    def finish(self, job: str) -> None:
        with self.lock:
            self.finished.add(job)

    def snapshot(self) -> list[tuple[float, str, int, str | None]]:
        with self.lock:
            return list(self.records)

    def slowest(self, jobs: int) -> int:
        """Steps completed by the job that completed fewest, of `jobs` jobs."""
        with self.lock:
            done = [sum(j == job and error is None for _, j, _, error in self.records)
                    for job in {job for _, job, _, _ in self.records}]
        return min(done) if len(done) == jobs else 0

    def settled(self, since: float) -> bool:
        """Every job has finished or completed a step after `since`."""
        with self.lock:
            jobs = {job for _, job, _, _ in self.records} - self.finished
            return all(any(j == job and error is None and t > since for t, j, _, error in self.records) for job in jobs)


# -- the job -------------------------------------------------------------------------------------
def rl_step(cluster, trainer, step: int, seed: int, timeout: float) -> None:
    """One step of a small policy-gradient loop, every future bounded by `timeout`."""
    prompt = [5 + seed, 6, 7]
    snapshot = trainer.save_weights_for_sampler("sampler").result(timeout)
    sampler = SamplingClient(cluster, snapshot, seed)
    out = sampler.sample(ModelInput.from_ints(prompt), num_samples=3,
                         sampling_params=SamplingParams(max_tokens=5, seed=100 * seed + step)).result(timeout)
    rewards = np.array([float(sum(s.tokens) % 7) for s in out.sequences])
    data = []
    for seq, adv in zip(out.sequences, rewards - rewards.mean()):
        ids = prompt + seq.tokens
        old = sampler.compute_logprobs(ModelInput.from_ints(ids)).result(timeout)
        advantages = np.zeros(len(ids) - 1, dtype=np.float32)
        advantages[len(prompt) - 1:] = adv
        data.append(Datum(ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:], "advantages": advantages,
                                                          "logprobs": np.array(old[1:], dtype=np.float32)}))
    trainer.forward_backward(data, loss_fn="importance_sampling").result(timeout)
    trainer.optim_step(AdamParams(learning_rate=1e-2)).result(timeout)


def run_job(trainer, job: str, seed: int, steps: int, log: FaultLog, timeout: float = 60) -> None:
    """`steps` steps of `rl_step` on `trainer`, each retried as a unit from its starting checkpoint."""
    cluster = trainer.cluster
    checkpoints: dict[int, str] = {}
    step, restore = 0, False
    while step < steps:
        try:
            if restore:
                trainer.load_state_with_optimizer(checkpoints[step]).result(timeout)
                restore = False
            else:
                checkpoints[step] = trainer.save_state(f"step-{step}").result(timeout).path
            rl_step(cluster, trainer, step, seed, timeout)
        except RETRIABLE as failure:
            log.note(job, step, failure)
            if step not in checkpoints and step > 0:  # its checkpoint was never written: redo the step before
                step -= 1
            restore = step in checkpoints
            continue
        cluster.report_step(job, step)
        log.note(job, step)
        step += 1
    log.finish(job)


def run_jobs(cluster, model_dir: str, steps: int, log: FaultLog, seeds=SEEDS, timeout: float = 60,
             on_ready=lambda: None) -> dict:
    """Every job's model created, then `on_ready()`, then every job on its own thread; {job: final
    flat weights}. A job's error is raised here."""
    trainers = {f"job-{s}": cluster.service_client(job=f"job-{s}").create_training_client(base_model=model_dir, seed=s)
                for s in seeds}
    on_ready()
    failures = {}

    def body(job, seed):
        try:
            run_job(trainers[job], job, seed, steps, log, timeout)
        except BaseException as exc:  # raised below, in the caller's thread
            failures[job] = exc

    threads = [threading.Thread(target=body, args=(f"job-{s}", s), name=f"job-{s}") for s in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout * steps)
    hung = [t.name for t in threads if t.is_alive()]
    if hung or failures:
        raise RuntimeError(f"jobs did not finish: hung {hung}, failed {failures}") from next(iter(failures.values()), None)
    return {job: cluster.fetch_weights(t.state) for job, t in sorted(trainers.items())}


# -- the faults ----------------------------------------------------------------------------------
class Killer(threading.Thread):
    """SIGKILLs a random device process `kills` times until `stop` is set, one fault at a time
    (each recovery measured alone): a kill once every job got past the previous one and the
    slowest job completed 1-2 more steps, after a random delay (short ones land mid-call or in a
    switch, longer ones between calls too) cut short when the slowest job completes one step
    more, so that every kill lands within a step of its due one however fast the jobs run. A
    kill may hit a process still starting after an earlier kill nobody felt. A kill between
    calls is not felt (the process is restarted before its next call), so when no job felt any
    kill before the last one, the last waits until its device runs a call: a run then always
    has a kill some job recovers from."""

    def __init__(self, cluster, kills: int, seed: int, stop: threading.Event, log: FaultLog, jobs: int,
                 timeout: float = 120):
        super().__init__(name="fault-killer", daemon=True)
        self.cluster, self.kills, self.stop, self.log, self.jobs, self.timeout = cluster, kills, stop, log, jobs, timeout
        self.rng = np.random.default_rng(seed)
        self.done: list[Kill] = []

    def run(self) -> None:
        devices = sorted(self.cluster.workers)
        for _ in range(self.kills):
            delay = self.rng.uniform(0, 0.05) if self.rng.random() < 0.5 else self.rng.uniform(0.1, 0.4)
            device = devices[int(self.rng.integers(len(devices)))]
            due = self.log.slowest(self.jobs) + int(self.rng.integers(1, 3))
            self._await(lambda: self.log.slowest(self.jobs) >= due)
            # the delay, but no later than the slowest job's next step: a job left to run alone
            # takes a few ms a step, and a delay of many steps would outlast the run
            self._await(lambda: self.log.slowest(self.jobs) > due, timeout=delay)
            if len(self.done) == self.kills - 1 and not self._felt():
                self._await(lambda: device_moment(self.cluster.events(), device) != "between calls")
            if self.stop.is_set():
                return
            kill = self._kill(device)
            self.done.append(kill)
            self._await(lambda: self.log.settled(kill.t))

    def _felt(self) -> bool:
        """Some job saw a call fail since the first kill."""
        return bool(self.done) and any(error for t, _, _, error in self.log.snapshot() if t >= self.done[0].t)

    def _await(self, condition, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline and not self.stop.is_set() and not condition():
            time.sleep(0.005)

    def _kill(self, device: int) -> Kill:
        moment = device_moment(self.cluster.events(), device)
        process = self.cluster.workers[device]._process
        live = process.poll() is None
        t = time.perf_counter()
        os.kill(process.pid, signal.SIGKILL)
        return Kill(t, device, live, moment)


def device_moment(events: list[dict], device: int) -> str:
    """What `device` was doing, from the event log: a call dispatched and not ended (loading a
    switched-in state first: "switch"), or nothing."""
    for event in reversed(events):
        if event.get("device") != device or event["event"] not in ("dispatch", "end"):
            continue
        if event["event"] == "end":
            return "between calls"
        return "switch" if event.get("switch") else "mid-call"
    return "between calls"


def recovery_seconds(kills: list[Kill], records: list[tuple[float, str, int, str | None]]) -> list[float | None]:
    """Per kill: seconds to the first step completed after their failure by each job that failed
    between this kill and the next (the worst of them); None when no job felt it."""
    out = []
    for i, kill in enumerate(kills):
        until = kills[i + 1].t if i + 1 < len(kills) else float("inf")
        hit = {job: t for t, job, _, error in reversed(records) if error and kill.t <= t < until}
        ends = [min((t for t, job, _, error in records if job == victim and error is None and t > failed),
                    default=None) for victim, failed in hit.items()]
        out.append(max(t - kill.t for t in ends) if ends and None not in ends else None)
    return out


def cluster_settings(model_dir: str) -> dict:
    """Room for one trainer and one snapshot per device: the jobs keep switching."""
    from plexrl.runtime.activation import reserve_of
    from plexrl.runtime.state import ModelState, load_module

    trainer_bytes = ModelState("x/p", "x", "p", load_module(model_dir), True, model_dir).device_bytes
    reserve = reserve_of(model_dir)  # what the cluster keeps beside the states for activations
    return {"devices": 2, "device_memory_bytes": trainer_bytes + trainer_bytes // 4 + 4096 + reserve,
            "host_memory_bytes": 256 * MiB}


@dataclass(frozen=True)
class FaultyRun:
    weights: dict  # job -> final flat weights
    kills: list[Kill]
    log: FaultLog
    metrics: dict  # the cluster's, at the end
    process_restarts: int  # how many times the host restarted a device process


def faulty_run(model_dir: str, steps: int, kills: int, seed: int, workdir: str, seeds=SEEDS,
               timeout: float = 60) -> FaultyRun:
    """The jobs on a process engine with a Killer."""
    from plexrl.engines.process import ProcessCluster

    log, stop = FaultLog(), threading.Event()
    with ProcessCluster(**cluster_settings(model_dir), workdir=workdir) as cluster:
        killer = Killer(cluster, kills, seed, stop, log, len(seeds), timeout=timeout)
        try:
            weights = run_jobs(cluster, model_dir, steps, log, seeds, timeout, on_ready=killer.start)
        finally:
            stop.set()
            if killer.is_alive():
                killer.join(timeout)
        return FaultyRun(weights, killer.done, log, cluster.metrics(), sum(w.restarts for w in cluster.workers.values()))


def clean_run(model_dir: str, steps: int, workdir: str, seeds=SEEDS, timeout: float = 60, engine: str = "process"):
    """(weights by job, fault log) of the same jobs without kills, on `engine`."""
    from plexrl import engines

    log = FaultLog()
    with engines.engine_class(engine)(**cluster_settings(model_dir), workdir=workdir) as cluster:
        return run_jobs(cluster, model_dir, steps, log, seeds, timeout), log


def mean_step_s(records: list[tuple[float, str, int, str | None]]) -> float:
    """A job's mean time per step: its completions' spacing (all of the jobs run concurrently)."""
    spans = []
    for job in sorted({r[1] for r in records}):
        ends = [t for t, j, _, error in records if j == job and error is None]
        spans += list(np.diff(ends))
    return float(np.mean(spans))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench faults", description=__doc__)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40, help="steps per job")
    parser.add_argument("--seed", type=int, default=0, help="the killer's generator")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from plexrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        model = str(make_tiny_model(f"{folder}/model", seed=0))
        reference, clean = clean_run(model, args.steps, f"{folder}/clean")
        run = faulty_run(model, args.steps, args.kills, args.seed, f"{folder}/faulty")
    kills, log = run.kills, run.log
    recovered = [s for s in recovery_seconds(kills, log.snapshot()) if s is not None]
    step_s = mean_step_s(clean.snapshot())
    result = {
        "kills": len(kills),
        "kills_felt": len(recovered),
        "moments": ",".join(k.moment for k in kills),
        "recovery_s": [round(s, 3) for s in recovered],
        "recovery_s_median": median(recovered) if recovered else float("nan"),
        "recovery_s_max": max(recovered) if recovered else float("nan"),
        "step_s_mean": step_s,
        "ratio_median": (median(recovered) / step_s) if recovered else float("nan"),
        "worker_restarts": run.metrics["recovery"]["worker_restarts"],
        "process_restarts": run.process_restarts,
        "redone_steps": sum(1 for r in log.snapshot() if r[3] is not None),
        "bitwise_equal": all(np.array_equal(run.weights[j], reference[j]) for j in reference),
    }
    emit("faults: seconds from a device process's SIGKILL to its jobs' next step, vs the step time", result,
         args.json)
    return 0

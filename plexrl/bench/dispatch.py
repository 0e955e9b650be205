"""`plexrl bench dispatch`: what the runtime adds per request, and what a decision costs.

- overhead per no-op request: submit -> router -> group queue -> worker -> future, awaited one
  at a time (latency) and pipelined (throughput), against the physical reference of a bare
  thread handoff (a request and a reply through two `queue.Queue`s) measured in the same run;
- the same on the process engine (the worker in a process of its own), awaited one at a time,
  with this process's CPU time per request, against a bare round trip of a call's message
  through a `multiprocessing` pipe to an echoing process;
- scheduler decision time: `choose` (switch-aware HRRN) over 1,000 ready requests.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue
import tempfile
import threading
import time

import numpy as np

from plexrl.bench.common import emit, median, percentile
from plexrl.policy import Policy, ReadyQueue, choose, offload_estimate


def noop_overhead_ms(cluster, state, n: int) -> tuple[float, float]:
    """(awaited one at a time, pipelined) milliseconds per no-op call on a resident `state`."""
    cluster.submit(state, "noop", None).result()  # warm: the state is resident now
    t0 = time.perf_counter()
    for _ in range(n):
        cluster.submit(state, "noop", None).result()
    latency = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    futures = [cluster.submit(state, "noop", None) for _ in range(n)]
    for future in futures:
        future.result()
    pipelined = (time.perf_counter() - t0) / n
    return latency * 1e3, pipelined * 1e3


def local_noop_overhead_ms(n: int) -> tuple[float, float]:
    """The local engine's no-op figures, on a frozen micro model (the call's size is nil)."""
    from plexrl.engines.local import LocalCluster

    with _micro_cluster(LocalCluster) as (cluster, state):
        return noop_overhead_ms(cluster, state, n)


def process_noop_ms(n: int) -> tuple[float, float]:
    """(ms per no-op call awaited one at a time, ms of this process's CPU per call) on the process engine."""
    from plexrl.engines.process import ProcessCluster

    with _micro_cluster(ProcessCluster) as (cluster, state):
        noop_overhead_ms(cluster, state, max(n // 10, 1))  # warm both paths
        cpu, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            cluster.submit(state, "noop", None).result()
        return (time.perf_counter() - t0) / n * 1e3, (time.process_time() - cpu) / n * 1e3


@contextlib.contextmanager
def _micro_cluster(engine):
    from plexrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(f"{folder}/micro", seed=0, hidden_size=16, num_layers=1, num_heads=2)
        with engine(devices=1, device_memory_bytes=16 << 20, host_memory_bytes=64 << 20) as cluster:
            yield cluster, cluster.service_client("bench").create_sampling_client(model).state


def _echo(conn) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def pipe_round_trip_ms(n: int) -> float:
    """A call's message (steps, function, payload, state, prefetch steps) to a spawned process
    and back through a pipe: what a process-engine call cannot avoid."""
    ours, theirs = multiprocessing.Pipe()
    echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(theirs,), daemon=True)
    echo.start()
    message = ([], "noop", None, "bench/model-0", [])
    ours.send(message), ours.recv()
    elapsed_ms = _round_trips_ms(lambda: ours.send(message), ours.recv, n)
    ours.send(None)
    echo.join()
    return elapsed_ms


def thread_handoff_ms(n: int) -> float:
    requests, replies = queue.Queue(), queue.Queue()

    def serve() -> None:
        while (item := requests.get()) is not None:
            replies.put(item)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    elapsed_ms = _round_trips_ms(lambda: requests.put(0), replies.get, n)
    requests.put(None)
    server.join()
    return elapsed_ms


def _round_trips_ms(send, receive, n: int) -> float:
    """Milliseconds per message sent and its reply received, over `n` in a row."""
    t0 = time.perf_counter()
    for _ in range(n):
        send()
        receive()
    return (time.perf_counter() - t0) / n * 1e3


def decision_us(n_ready: int, repeats: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    ready = ReadyQueue(capacity=n_ready)
    for i in range(n_ready):
        ready.add(i, arrival=float(rng.uniform(0, 100)), est=float(rng.uniform(0.01, 5)),
                  load_s=float(rng.uniform(0, 1)), resident_on=int(rng.integers(-1, 4)), seq=i,
                  nbytes=int(rng.integers(1, 1 << 30)))
    times = []
    for r in range(repeats):
        now = 100.0 + r * 1e-3
        t0 = time.perf_counter()
        choose(Policy.PLEXRL, ready, 0, offload_estimate(ready, 1 << 29, 10e9), now)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench dispatch", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    latency_ms, pipelined_ms = local_noop_overhead_ms(args.requests)
    handoff_ms = thread_handoff_ms(args.requests)
    process_ms, process_cpu_ms = process_noop_ms(args.requests)
    pipe_ms = pipe_round_trip_ms(args.requests)
    decisions = decision_us(args.queued, 2000)
    result = {
        "overhead_ms_per_request": latency_ms,
        "pipelined_ms_per_request": pipelined_ms,
        "thread_handoff_ms": handoff_ms,
        "overhead_ratio_to_handoff": latency_ms / handoff_ms,
        "process_ms_per_request": process_ms,
        "process_cpu_ms_per_request": process_cpu_ms,
        "pipe_round_trip_ms": pipe_ms,
        "process_ratio_to_pipe": process_ms / pipe_ms,
        "queued_requests": args.queued,
        "decision_us_p50": median(decisions),
        "decision_us_p99": percentile(decisions, 99),
    }
    emit("dispatch: per-request overhead (local and process engines) and scheduler decision time", result, args.json)
    return 0

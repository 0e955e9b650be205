"""`plexrl bench observe`: what watching a cluster costs.

1. scraping `/metrics` every second, A/B in one run: `plexrl bench serve`'s call (a forward of 3
   tokens on a micro model, over the bare protocol, on its engine: `--engine`, default process) made in alternating blocks without a scraper
   (A) and with a thread scraping `/metrics` once a second (B), A B then B A, over `--rounds`
   rounds so that drift of the machine's speed falls on both; the added latency is B / A - 1 of
   the means, of the medians, and per round of its two blocks' medians (the median and quartiles
   of those: a shared machine's load moves whole blocks); beside it the scrape's own time and the
   interpreter time one takes, which bounds what it can take from the calls (that, once a second);
2. the dashboard for 8 devices and 20 jobs: a local cluster of 8 devices where 20 jobs (a micro
   trainer each) make `--job-calls` calls, then `/dashboard/data` (default window) and `/metrics`
   asked `--asks` times over HTTP: milliseconds per answer;
3. `plexrl trace` on a 1,000,000-record event log: the event log of (2) tiled (times and request
   ids shifted) to `--records` records, written as JSON lines, then converted in this process as
   the command does (read, convert, write): wall seconds, and this process's CPU seconds (what the
   wall time is on an idle machine: on a shared one others' work stretches the wall time).
Every loop is bounded by a count and a deadline; servers bind 127.0.0.1 on free ports.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from plexrl import engines
from plexrl.api.types import Datum, ModelInput
from plexrl.bench.common import emit, percentile
from plexrl.bench.serve import raw_call, sequential_ms, summary, world
from plexrl.engines.local import LocalCluster
from plexrl.models.tiny import make_tiny_model
from plexrl.observe.perfetto import no_collection, write_trace
from plexrl.observe.prometheus import exposition
from plexrl.observe.web import serve_cluster
from plexrl.runtime.events import write_jsonl
from plexrl.sim.trace import read_events

SCRAPE_EVERY_S = 1.0


class Scraper:
    """A thread scraping `url` every `every_s` seconds while on: what Prometheus does."""

    def __init__(self, url: str, every_s: float = SCRAPE_EVERY_S):
        self.url, self.every_s, self.times_ms = url, every_s, []
        self._on, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                if self._on.wait(0.05):
                    t0 = time.perf_counter()
                    answer = http.get(self.url)
                    answer.raise_for_status()
                    self.times_ms.append((time.perf_counter() - t0) * 1e3)
                    self._stop.wait(self.every_s)

    def scraping(self, on: bool) -> None:
        (self._on.set if on else self._on.clear)()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def scrape_ab(calls: int, rounds: int, budget_s: float, engine: str) -> dict:
    with world(engine) as w, raw_call(w.url, w.model) as call:
        scraper = Scraper(f"{w.url}/metrics")
        plain, scraped, paired = [], [], []
        try:
            sequential_ms(call, 0, budget_s, warmup=20)
            for k in range(rounds):  # A B, then B A: neither arm always goes first
                blocks = {}
                for scraping in ((False, True) if k % 2 == 0 else (True, False)):
                    scraper.scraping(scraping)
                    blocks[scraping] = sequential_ms(call, calls, budget_s, warmup=0)
                    (scraped if scraping else plain).extend(blocks[scraping])
                scraper.scraping(False)
                paired.append(statistics.median(blocks[True]) / statistics.median(blocks[False]) - 1)
            scrape_cpu_ms = interpreter_ms(exposition(w.cluster.metrics), 50)
        finally:
            scraper.close()
    return {**summary("call_unscraped", plain), **summary("call_scraped", scraped),
            "scrape_added_mean": statistics.fmean(scraped) / statistics.fmean(plain) - 1,
            "scrape_added_median": statistics.median(scraped) / statistics.median(plain) - 1,
            "scrape_added_paired_median": statistics.median(paired),
            "scrape_added_paired_p25": percentile(paired, 25), "scrape_added_paired_p75": percentile(paired, 75),
            "scrapes": len(scraper.times_ms), "scrape_ms_mean": statistics.fmean(scraper.times_ms or [float("nan")]),
            "scrape_cpu_ms": scrape_cpu_ms, "scrape_interpreter_share": scrape_cpu_ms / (SCRAPE_EVERY_S * 1e3),
            "calls_per_arm": len(plain)}


def interpreter_ms(work, n: int) -> float:
    """CPU milliseconds of one `work()` in this thread (the interpreter time a scrape holds)."""
    work()
    t0 = time.thread_time()
    for _ in range(n):
        work()
    return (time.thread_time() - t0) / n * 1e3


def twenty_jobs(root: str, job_calls: int, asks: int, budget_s: float) -> tuple[dict, list[dict]]:
    folder = str(make_tiny_model(f"{root}/micro", seed=0, hidden_size=16, num_layers=1, num_heads=2))
    tokens = (5, 6, 7, 8)
    datum = Datum(ModelInput.from_ints(tokens[:-1]), {"target_tokens": np.array(tokens[1:]),
                                                      "weights": np.ones(len(tokens) - 1, np.float32)})
    with LocalCluster(devices=8, checkpoint_dir=f"{root}/scratch") as cluster:
        def job(i: int) -> None:
            training = cluster.service_client(f"job-{i:02d}").create_training_client(folder, seed=i)
            end = time.perf_counter() + budget_s
            for _ in range(job_calls):
                if time.perf_counter() > end:
                    break
                training.forward([datum], "cross_entropy").result(60)

        threads = [threading.Thread(target=job, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(budget_s + 60)
        server = serve_cluster(cluster, 0)
        try:
            with httpx.Client(base_url=server.url, timeout=30) as http:
                data_ms = timed_gets(http, "/dashboard/data", asks, budget_s)
                metrics_ms = timed_gets(http, "/metrics", asks, budget_s)
                doc = http.get("/dashboard/data").json()
        finally:
            server.stop()
        events = cluster.events()
    spans = sum(len(d["spans"]) for d in doc["devices"])
    return {**summary("dashboard_data", data_ms), **summary("metrics_scrape", metrics_ms),
            "dashboard_devices": len(doc["devices"]), "dashboard_jobs": len(doc["jobs"]), "dashboard_spans": spans,
            "dashboard_bytes": len(httpx.Response(200, json=doc).content)}, events


def timed_gets(http: httpx.Client, path: str, n: int, budget_s: float) -> list[float]:
    http.get(path).raise_for_status()
    times, end = [], time.perf_counter() + budget_s
    while len(times) < n and time.perf_counter() < end:
        t0 = time.perf_counter()
        http.get(path).raise_for_status()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def tiled(events: list[dict], records: int) -> list[dict]:
    """`events` repeated, each copy later by the log's span and with fresh request ids, to `records`."""
    span = events[-1]["t"] - events[0]["t"] + 0.01
    ids = max(e.get("request_id", 0) for e in events) + 1
    out, k = [], 0
    while len(out) < records:
        for e in events[: records - len(out)]:
            copy = {**e, "t": e["t"] + k * span}
            if "request_id" in copy:
                copy["request_id"] = e["request_id"] + k * ids
            out.append(copy)
        k += 1
    return out


def trace_seconds(events: list[dict], records: int, root: str) -> dict:
    log = write_jsonl(tiled(events, records), Path(root) / "events.jsonl")
    t0, cpu0 = time.perf_counter(), time.process_time()
    with no_collection():  # as `plexrl trace` reads
        read = read_events(log)
    counts = write_trace(read, Path(root) / "trace.json")
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    return {"trace_records": records, "trace_s": seconds, "trace_cpu_s": cpu_s, "trace_calls": counts["calls"],
            "trace_bytes": (Path(root) / "trace.json").stat().st_size}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench observe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per block of the scrape A/B")
    parser.add_argument("--rounds", type=int, default=6, help="pairs of blocks (unscraped, scraped)")
    parser.add_argument("--job-calls", type=int, default=40, help="calls each of the 20 jobs makes")
    parser.add_argument("--asks", type=int, default=100, help="dashboard data and metrics requests timed")
    parser.add_argument("--records", type=int, default=1_000_000, help="records of the event log traced")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds any one loop may run")
    parser.add_argument("--engine", default="process", choices=list(engines.ENGINES),
                        help="the served cluster's engine in the scrape A/B, as plexrl bench serve's (default process)")
    parser.add_argument("--quick", action="store_true", help="a few of everything (tests)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.rounds, args.job_calls, args.asks, args.records, args.budget = 10, 1, 2, 3, 2000, 5.0
    result = {"engine": args.engine, **scrape_ab(args.calls, args.rounds, args.budget, args.engine)}
    with tempfile.TemporaryDirectory() as root:
        dashboard, events = twenty_jobs(root, args.job_calls, args.asks, args.budget)
        result.update(dashboard)
        result.update(trace_seconds(events, args.records, root))
    emit("observe: /metrics scraped every second (A/B), the dashboard's data for 8 devices and 20 jobs, "
         "plexrl trace on a large log", result, args.json)
    return 0


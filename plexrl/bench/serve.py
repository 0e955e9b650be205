"""`plexrl bench serve`: what `plexrl serve` adds to a call over loopback, against a bare FastAPI
echo served the same way in the same run.

The call is a forward (cross_entropy, no gradients) of one datum of 3 input tokens on a micro
model (hidden 16, 1 layer, full-parameter): the smallest call the HTTP API offers that runs on a
device and brings a result back (a no-op is not an endpoint). One server on a one-device local
cluster serves every figure; the in-process calls run on that same cluster.

Figures (milliseconds unless named otherwise):
1. the call made `--calls` times one after another (a) through the in-process job API
   (`TrainingClient.forward(...).result()`), (b) through the Tinker SDK against `plexrl serve`,
   (c) as the protocol's bare minimum with httpx (POST, then retrieve_future polls until the
   result). added = (b) - (a), split into the SDK's client side (b) - (c) and the protocol
   (c) - (a); the protocol part is HTTP round trips (counted on the server per call, each
   priced at the echo's round trip) plus the service's own work (the rest);
2. long-poll wake-up: a poll held on a request (seq_id n+1, which waits for n) answers the
   client how long after the service resolves the request's future, once n is sent;
3. calls per second from 8 threads, each with its own SDK client, session and model (and, without
   --quick, from 8 processes, each with its own, against 8 echo client processes);
4. the reference: a FastAPI app whose one endpoint parses a small JSON body and answers it, on
   the same `Server` class: its sequential round trip and its requests/s from 8 httpx clients.
   Every figure above is also given as a ratio to it;
5. sampled tokens a second from 8 threads sharing one sampler (4 sequences of 16 tokens a call,
   no stop), through the SDK and, as its reference, through the in-process job API on the same
   cluster: concurrent calls on one sampler are coalesced by the node into batched decodes.

Clients and servers share this one process (and its GIL), as they do in tests; the cluster's
device work runs where `--engine` puts it (process, the default: a process of its own; local: a
thread here, competing with the HTTP round trips for the interpreter). The split is of means,
not of disjoint intervals. Every loop is bounded
by a count and a deadline; both servers bind 127.0.0.1 on free ports and are stopped at the end.
The figures swing with what else runs on the machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import tinker  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import request_conv  # noqa: E402

from plexrl.api.types import Datum, ModelInput  # noqa: E402
from plexrl.bench.common import emit, percentile  # noqa: E402
from plexrl import engines  # noqa: E402
from plexrl.models.tiny import make_tiny_model  # noqa: E402
from plexrl.serve.app import create_app  # noqa: E402
from plexrl.serve.server import Server  # noqa: E402
from plexrl.serve.service import TinkerService  # noqa: E402
from plexrl.serve.store import Store  # noqa: E402
from plexrl.serve.tenants import Tenants  # noqa: E402

TOKENS = (5, 6, 7, 8)  # the datum: input 5 6 7, targets 6 7 8
CLIENTS = 8
RESULT_S = 60.0  # longest any one call may take
API_KEY = "tml-bench-0123456789abcdef"  # the server is open (one tenant): any key is that tenant's


# ---------------------------------------------------------------------------- servers

class Counting:
    """An ASGI wrapper that counts HTTP requests and the retrieve_future polls held right now."""

    def __init__(self, app):
        self.app = app
        self.requests = 0
        self.polls_open = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.requests += 1
        poll = scope["path"].endswith("/retrieve_future")
        self.polls_open += poll
        try:
            return await self.app(scope, receive, send)
        finally:
            self.polls_open -= poll


def echo_app() -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/echo")
    async def echo(request: Request):
        return await request.json()

    return app


@dataclass
class World:
    url: str
    echo_url: str
    model: str  # the served name
    folder: str
    cluster: object
    service: object
    counter: Counting


@contextlib.contextmanager
def world(engine: str = "local"):
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        folder = str(make_tiny_model(f"{root}/micro", seed=0, hidden_size=16, num_layers=1, num_heads=2))
        stack.enter_context(engines.session(engine, 1))
        cluster = stack.enter_context(engines.open_cluster(engine, 1, checkpoint_dir=f"{root}/scratch"))
        store = Store(f"{root}/state")
        stack.callback(store.close)
        service = TinkerService(cluster, store, {"micro": folder}, Tenants())
        stack.callback(service.close)
        counter = Counting(create_app(service))
        served = stack.enter_context(Server(counter))
        echo = stack.enter_context(Server(echo_app()))
        yield World(served.url, echo.url, "micro", folder, cluster, service, counter)


# ---------------------------------------------------------------------------- the calls

def inprocess_call(cluster, folder: str):
    training = cluster.service_client("bench-inprocess").create_training_client(folder)
    datum = Datum(ModelInput.from_ints(TOKENS[:-1]), {"target_tokens": np.array(TOKENS[1:]),
                                                     "weights": np.ones(len(TOKENS) - 1, np.float32)})
    return lambda: training.forward([datum], "cross_entropy").result(RESULT_S)


@contextlib.contextmanager
def sdk_call(url: str, model: str):
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        training = client.create_lora_training_client(model, rank=0).result(RESULT_S)
        datum = types.Datum(model_input=types.ModelInput.from_ints(list(TOKENS[:-1])),
                            loss_fn_inputs={"target_tokens": list(TOKENS[1:]), "weights": [1.0] * (len(TOKENS) - 1)})
        yield lambda: training.forward([datum], "cross_entropy").result(RESULT_S)
    finally:
        client.close("success").result(RESULT_S)


class RawModel:
    """A session and a model spoken to with bare httpx: the protocol's round trips and nothing else."""

    def __init__(self, url: str, model: str):
        self.http = httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=RESULT_S)
        self.session = self.http.post("/api/v1/create_session", json={
            "tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
        created = self.post("/api/v1/create_model", json={"session_id": self.session, "model_seq_id": 0,
                                                          "base_model": model, "lora_config": {"rank": 0}})
        self.model_id = self.result(created).json()["model_id"]
        self.next_seq = 1
        self.datum = types.Datum(model_input=types.ModelInput.from_ints(list(TOKENS[:-1])),
                                 loss_fn_inputs={"target_tokens": list(TOKENS[1:]),
                                                 "weights": [1.0] * (len(TOKENS) - 1)})

    def post(self, path: str, **kwargs) -> str:
        answer = self.http.post(path, **kwargs)
        answer.raise_for_status()
        return answer.json()["request_id"]

    def forward_body(self, seq: int) -> bytes:
        """The bytes the SDK POSTs for this forward (its own encoder)."""
        request = types.ForwardBackwardRequest(model_id=self.model_id, seq_id=seq, forward_backward_input=(
            types.ForwardBackwardInput(data=[self.datum], loss_fn="cross_entropy")))
        return request_conv.forward_backward_request_to_proto(request).SerializeToString()

    def submit(self, body: bytes) -> str:
        return self.post("/api/v1/forward", content=body, headers={"content-type": "application/x-protobuf"})

    def result(self, request_id: str, deadline_s: float = RESULT_S):
        end = time.perf_counter() + deadline_s
        while time.perf_counter() < end:
            answer = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            answer.raise_for_status()
            if answer.headers.get("content-type", "").startswith("application/json"):
                body = answer.json()
                if body.get("type") == "try_again":
                    continue
                if "error" in body:
                    raise RuntimeError(f"request {request_id} failed: {body['error']}")
            return answer
        raise TimeoutError(f"request {request_id} unfinished after {deadline_s} s")

    def call(self) -> None:
        body = self.forward_body(self.next_seq)
        self.next_seq += 1
        self.result(self.submit(body))

    def close(self) -> None:
        self.http.post(f"/api/v1/sessions/{self.session}/finish", json={})
        self.http.close()


# ---------------------------------------------------------------------------- measurements

def sequential_ms(call, n: int, budget_s: float, warmup: int = 10) -> list[float]:
    """Milliseconds of each of up to `n` calls made one after another (within `budget_s`)."""
    for _ in range(warmup):
        call()
    times, end = [], time.perf_counter() + budget_s
    while len(times) < n and time.perf_counter() < end:
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def counted_ms(counter: Counting, call, n: int, budget_s: float) -> tuple[list[float], float]:
    """`sequential_ms`, and the HTTP requests the server saw per call meanwhile."""
    for _ in range(10):
        call()
    before = counter.requests
    times = sequential_ms(call, n, budget_s, warmup=0)
    return times, (counter.requests - before) / len(times)


def wakeup_ms(w: World, rounds: int, budget_s: float) -> list[float]:
    """Resolve-to-answer milliseconds of a held retrieve_future poll, per round."""
    raw = RawModel(w.url, w.model)
    times, end = [], time.perf_counter() + budget_s
    try:
        raw.call()  # the model's first call (seq 1) outside the rounds
        seq = 2
        while len(times) < rounds and time.perf_counter() < end:
            first, second = raw.forward_body(seq), raw.forward_body(seq + 1)
            held = raw.submit(second)  # waits in the service for `seq`
            resolved: list[float] = []
            pending = w.service.requests.future(w.service.tenant(API_KEY), held)
            pending.future.add_done_callback(lambda _: resolved.append(time.perf_counter()))
            answered: list[float] = []
            poll = threading.Thread(target=lambda: answered.append(raw_poll(w.url, held)))
            open_before = w.counter.polls_open
            poll.start()
            wait_until(lambda: w.counter.polls_open > open_before, 5.0)
            time.sleep(0.005)  # the poll's handler reaches its wait (the event loop is otherwise idle)
            if pending.future.done():
                raise RuntimeError("the held request finished before its predecessor was sent")
            raw.result(raw.submit(first))
            poll.join(RESULT_S)
            if resolved and answered:
                times.append((answered[0] - resolved[0]) * 1e3)
            seq += 2
    finally:
        raw.close()
    return times


def raw_poll(url: str, request_id: str) -> float:
    """One retrieve_future poll on a connection of its own: the time its answer was in."""
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=RESULT_S) as http:
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        answered = time.perf_counter()
        answer.raise_for_status()
    return answered


def wait_until(condition, timeout_s: float) -> None:
    end = time.perf_counter() + timeout_s
    while not condition():
        if time.perf_counter() > end:
            raise TimeoutError(f"not so after {timeout_s} s")
        time.sleep(0.0005)


def concurrent_rps(make_calls, clients: int, per_client: int, budget_s: float) -> float:
    """Calls per second from `clients` threads, each making up to `per_client` calls (for at most
    `budget_s`) with the call `make_calls()` yields it, all starting together once all are warm."""
    done = [0] * clients
    failures: list[BaseException] = []
    start, finish = threading.Barrier(clients + 1), threading.Barrier(clients + 1)

    def client(i: int) -> None:
        try:
            with make_calls() as call:
                call()  # warm: its model is placed, its connection open
                start.wait(RESULT_S)
                end = time.perf_counter() + budget_s
                while done[i] < per_client and time.perf_counter() < end:
                    call()
                    done[i] += 1
                finish.wait(RESULT_S + budget_s)
        except BaseException as exc:  # raised below, after every thread is joined
            failures.append(exc)
            start.abort()
            finish.abort()

    threads = [threading.Thread(target=client, args=(i,), name=f"bench-client-{i}", daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    elapsed = math.nan
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(RESULT_S * 2)
        t0 = time.perf_counter()
        finish.wait(RESULT_S + budget_s * 2)
        elapsed = time.perf_counter() - t0
    for thread in threads:
        thread.join(RESULT_S)
    if failures:
        raise failures[0]
    return sum(done) / elapsed


def concurrent_tokens(call, threads: int, budget_s: float) -> float:
    """Tokens a second from `threads` threads calling `call()` (which returns the tokens it sampled)
    one call after another for `budget_s`, all sharing one sampler: the cookbook's concurrent
    sample calls, which the node coalesces into batched device calls."""
    tokens, failures = [0] * threads, []
    start = threading.Barrier(threads + 1)

    def run(i: int) -> None:
        try:
            start.wait(RESULT_S)
            end = time.perf_counter() + budget_s
            while time.perf_counter() < end:
                tokens[i] += call(i)
        except BaseException as exc:  # raised below, after every thread is joined
            failures.append(exc)

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait(RESULT_S)
    t0 = time.perf_counter()
    for worker in workers:
        worker.join(budget_s + RESULT_S)
    elapsed = time.perf_counter() - t0
    if failures:
        raise failures[0]
    return sum(tokens) / elapsed


SAMPLES, SAMPLED = 4, 16  # each sample call: 4 sequences of 16 tokens (no stop: every one is sampled whole)


def inprocess_sampler(cluster, folder: str):
    from plexrl.api.types import SamplingParams

    sampler = cluster.service_client("bench-sampler").create_sampling_client(folder)
    prompt = ModelInput.from_ints(TOKENS)

    def call(i: int) -> int:
        params = SamplingParams(max_tokens=SAMPLED, seed=i, stop=())
        return sum(len(s.tokens) for s in sampler.sample(prompt, SAMPLES, params).result(RESULT_S).sequences)

    return call


@contextlib.contextmanager
def sdk_sampler(url: str, model: str):
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        sampler = client.create_sampling_client(base_model=model).result(RESULT_S)
        prompt = types.ModelInput.from_ints(list(TOKENS))

        def call(i: int) -> int:
            params = types.SamplingParams(max_tokens=SAMPLED, seed=i, stop=[])
            return sum(len(s.tokens) for s in sampler.sample(prompt, SAMPLES, params).result(RESULT_S).sequences)

        yield call
    finally:
        client.close("success").result(RESULT_S)


def process_rps(kind: str, url: str, model: str, clients: int, per_client: int, budget_s: float) -> float:
    """`concurrent_rps` with each client in a process of its own (`kind`: "sdk" or "echo"), so the
    clients' own work does not share the server's interpreter, as with real users."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    start, finish, counts = context.Barrier(clients + 1), context.Barrier(clients + 1), context.Queue()
    processes = [context.Process(target=_client_process, args=(kind, url, model, per_client, budget_s, start, finish,
                                                               counts), daemon=True) for _ in range(clients)]
    for process in processes:
        process.start()
    elapsed = math.nan
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(RESULT_S * 4)  # spawned processes import torch and transformers first
        t0 = time.perf_counter()
        finish.wait(RESULT_S + budget_s * 2)
        elapsed = time.perf_counter() - t0
    done = [counts.get(timeout=RESULT_S) for _ in processes]
    for process in processes:
        process.join(RESULT_S)
    if any(n < 0 for n in done):
        raise RuntimeError(f"{done.count(-1)} of {clients} client processes failed")
    return sum(done) / elapsed


def _client_process(kind, url, model, per_client, budget_s, start, finish, counts) -> None:
    made = -1
    try:
        with (sdk_call(url, model) if kind == "sdk" else echo_call(url)) as call:
            call()  # warm
            start.wait(RESULT_S * 4)
            made, end = 0, time.perf_counter() + budget_s
            while made < per_client and time.perf_counter() < end:
                call()
                made += 1
            finish.wait(RESULT_S + budget_s * 2)
    except BaseException:  # the parent counts it a failure
        start.abort()
        finish.abort()
        made = -1
    counts.put(made)


@contextlib.contextmanager
def echo_call(url: str):
    with httpx.Client(base_url=url, timeout=RESULT_S) as http:
        body = {"request_id": "r1-0123abcd"}  # the size of a retrieve_future poll

        def call() -> None:
            answer = http.post("/echo", json=body)
            answer.raise_for_status()

        yield call


@contextlib.contextmanager
def raw_call(url: str, model: str):
    raw = RawModel(url, model)
    try:
        yield raw.call
    finally:
        raw.close()


def summary(name: str, times: list[float]) -> dict:
    return {f"{name}_ms_mean": statistics.fmean(times), f"{name}_ms_p50": percentile(times, 50),
            f"{name}_ms_p95": percentile(times, 95)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="sequential calls per path (and in all, per "
                        "concurrent run; a tenth of it wake-up rounds)")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds any one loop may run")
    parser.add_argument("--quick", action="store_true", help="a few calls per figure (tests)")
    parser.add_argument("--engine", default="process", choices=list(engines.ENGINES),
                        help="the cluster's engine, as `plexrl serve --engine` (its default: process, the device's "
                        "work in a process of its own; local: on a thread of the server's process)")
    parser.add_argument("--tenants", type=int, metavar="N",
                        help="instead: N tenants train at once against a `plexrl serve` process, in rounds, then one "
                        "abuses its quota (plexrl/bench/serve_load.py)")
    parser.add_argument("--clients", type=int, default=2, help="with --tenants: training clients per tenant")
    parser.add_argument("--steps", type=int, default=20, help="with --tenants: steps per training client and round")
    parser.add_argument("--max-json-mib", type=int, help="with --tenants: the server's --max-json-mib (default: its own)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.tenants is not None:
        from plexrl.bench import serve_load

        if args.tenants < 1 or args.clients < 1 or args.steps < 1:
            parser.error("--tenants, --clients and --steps must be >= 1")
        flags = () if args.max_json_mib is None else ("--max-json-mib", str(args.max_json_mib))
        result = serve_load.run(args.tenants, args.clients, 2 if args.quick else args.steps, args.budget * 6,
                                engine=args.engine, server_flags=flags)
        emit(f"serve: {args.tenants} tenants at once, then one abusing its quota", result, args.json)
        return 0
    calls, budget = (20, 2.0) if args.quick else (args.calls, args.budget)
    with world(args.engine) as w:
        # 4) the reference: the same Server class and client library with nothing behind them
        with echo_call(w.echo_url) as call:
            echo = sequential_ms(call, calls, budget)
        echo_rps = concurrent_rps(lambda: echo_call(w.echo_url), CLIENTS, max(1, calls // CLIENTS), budget)
        # 1) one call at a time, three ways
        inprocess = sequential_ms(inprocess_call(w.cluster, w.folder), calls, budget)
        with sdk_call(w.url, w.model) as call:
            sdk, sdk_trips = counted_ms(w.counter, call, calls, budget)
        with raw_call(w.url, w.model) as call:
            raw, raw_trips = counted_ms(w.counter, call, calls, budget)
        # 2) wake-up of a held poll; 3) eight clients at once
        wakeup = wakeup_ms(w, max(5, calls // 10), budget)
        sdk_rps = concurrent_rps(lambda: sdk_call(w.url, w.model), CLIENTS, max(1, calls // CLIENTS), budget)
        # 5) sampled tokens a second, 8 callers sharing one sampler: in-process and through the SDK
        sampled_inprocess = concurrent_tokens(inprocess_sampler(w.cluster, w.folder), CLIENTS, budget)
        with sdk_sampler(w.url, w.model) as call:
            sampled_sdk = concurrent_tokens(call, CLIENTS, budget)
        if not args.quick:  # spawning clients costs seconds each (they import torch)
            echo_rps_processes = process_rps("echo", w.echo_url, w.model, CLIENTS, max(1, calls // CLIENTS), budget)
            sdk_rps_processes = process_rps("sdk", w.url, w.model, CLIENTS, max(1, calls // CLIENTS), budget)
    echo_ms = statistics.fmean(echo)
    added = statistics.fmean(sdk) - statistics.fmean(inprocess)
    protocol = statistics.fmean(raw) - statistics.fmean(inprocess)
    result = {
        "call": f"forward, 1 datum of {len(TOKENS) - 1} tokens, micro model",
        "engine": args.engine,
        "calls": len(sdk),
        **summary("inprocess", inprocess), **summary("sdk", sdk), **summary("raw_http", raw),
        "added_ms": added,
        "added_ratio_to_echo": added / echo_ms,
        "sdk_client_side_ms": statistics.fmean(sdk) - statistics.fmean(raw),
        "protocol_ms": protocol,
        "sdk_round_trips_per_call": sdk_trips,
        "raw_round_trips_per_call": raw_trips,
        "protocol_http_floor_ms": raw_trips * echo_ms,
        "protocol_service_ms": protocol - raw_trips * echo_ms,
        **summary("wakeup", wakeup),
        "wakeup_ratio_to_echo": statistics.fmean(wakeup) / echo_ms,
        "sdk_rps_8_clients": sdk_rps,
        "sdk_rps_ratio_to_echo": sdk_rps / echo_rps,
        **summary("echo", echo),
        "echo_rps_8_clients": echo_rps,
        "sampled_tokens_per_s_8_inprocess": sampled_inprocess,
        "sampled_tokens_per_s_8_sdk": sampled_sdk,
        "sampled_sdk_vs_inprocess": sampled_sdk / sampled_inprocess,
    }
    if not args.quick:
        result.update(sdk_rps_8_client_processes=sdk_rps_processes, echo_rps_8_client_processes=echo_rps_processes,
                      sdk_rps_processes_ratio_to_echo=sdk_rps_processes / echo_rps_processes)
    emit("serve: what the HTTP API adds to a call, against a bare FastAPI echo", result, args.json)
    return 0

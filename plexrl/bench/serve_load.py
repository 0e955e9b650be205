"""`plexrl bench serve --tenants N`: N tenants train at once against one `plexrl serve` process, in
rounds on the same server, and then one of them abuses its quota while the others train.

Each tenant holds one SDK session with two training clients (full-parameter, the micro model of
`plexrl bench serve`); each client runs `--steps` steps of forward_backward, optim_step and sample
(2 sequences of 8 tokens from a sampler of its initial weights), one call after another, every
client in a thread of its own, all tenants at once. Rounds:
1. and 2. every tenant trains (twice in a row on one server: every call must complete, and the
   server's resident memory after round 2 is reported beside round 1's);
3. to 6. alternately calm (every tenant trains, tenant 0 too) and abused: tenant 0 abuses its
   quota instead (`abuse`: JSON bodies of 4 MiB, nesting past the depth limit, num_samples past
   the sample limit, sparse-tensor bombs, a forward_backward of 1.2M tokens (the SDK's 5 MB
   chunk), refused creations with long names, and its queue filled with calls held for a seq_id
   it never sends), from a process of its own, while the others train.
Figures: per call type the p50/p95 (ms) of the other tenants' calls in the calm and the abused
rounds, the ratio of abused to calm p95 (what the abuse moves the others' latency by; the target
is <= 1.25), the abuser's requests by answer, and the server's RSS after the rounds.

The server runs in a process of its own (`plexrl serve` on a free loopback port, `--engine` as
given, a key file of N tenants); the trainers are threads of this process, the abuser a second process,
so neither the clients' work nor the abuse shares the server's interpreter. Every loop is bounded
by a count and a deadline; the server is stopped at the end.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plexrl.bench.common import percentile

RESULT_S = 120.0  # longest any one call may take
CALLS = ("forward_backward", "optim_step", "sample")


# ---------------------------------------------------------------------------- a server process

@dataclass
class ServerProcess:
    """`plexrl serve` in a child process; `url` once it listens."""

    process: subprocess.Popen
    url: str
    log: Path

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal it and wait for it to exit (killed if it outlives `timeout_s`); its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        return self.process.returncode


def start_server(state_dir: Path, models: dict[str, str], keys: dict[str, str] | None = None,
                 engine: str = "local", extra: tuple[str, ...] = (), timeout_s: float = 120.0) -> ServerProcess:
    """`plexrl serve` (one device) on a free loopback port, with a key file of `keys` (tenant ->
    key) or none; returns once it prints its URL."""
    state_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "plexrl.cli", "serve", "--engine", engine, "--devices", "1", "--port", "0",
               "--state-dir", str(state_dir), *extra]
    for name, folder in models.items():
        command += ["--model", f"{name}={folder}"]
    if keys:
        key_file = state_dir / "keys.txt"
        key_file.write_text("".join(f"{tenant} {key}\n" for tenant, key in keys.items()))
        command += ["--api-keys", str(key_file)]
    log = state_dir / f"serve-{time.time_ns()}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"})
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = re.search(r"plexrl serve: (http://\S+)", log.read_text())
        if found:
            return ServerProcess(process, found.group(1), log)
        if process.poll() is not None:
            raise RuntimeError(f"plexrl serve exited with {process.returncode} before listening:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"plexrl serve did not listen within {timeout_s} s:\n{log.read_text()[-3000:]}")


# ---------------------------------------------------------------------------- tenants that train

@dataclass
class Latencies:
    by_call: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, call: str, ms: float) -> None:
        with self.lock:
            self.by_call[call].append(ms)


def train(url: str, key: str, model: str, clients: int, steps: int, into: Latencies, deadline: float) -> int:
    """One tenant: a session with `clients` training clients, each running `steps` steps of
    forward_backward, optim_step and sample in a thread of its own; the calls made."""
    import tinker
    from tinker import types

    ids = [5, 6, 7, 8, 9, 10]
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    prompt = types.ModelInput.from_ints(ids)
    params = types.SamplingParams(max_tokens=8, seed=1)
    service = tinker.ServiceClient(base_url=url, api_key=key)
    made = [0] * clients
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            training = service.create_lora_training_client(model, rank=0, seed=i).result(RESULT_S)
            sampler = training.save_weights_and_get_sampling_client().result(RESULT_S)
            for _ in range(steps):
                if time.monotonic() > deadline:
                    break
                for call, make in (("forward_backward", lambda: training.forward_backward([datum], "cross_entropy")),
                                   ("optim_step", lambda: training.optim_step(types.AdamParams(learning_rate=1e-3))),
                                   ("sample", lambda: sampler.sample(prompt, 2, params))):
                    started = time.perf_counter()
                    make().result(RESULT_S)
                    into.add(call, (time.perf_counter() - started) * 1e3)
                    made[i] += 1
        except BaseException as exc:  # raised below, after every thread is joined
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, deadline - time.monotonic() + RESULT_S))
    finally:
        service.close("success").result(RESULT_S)
    if failures:
        raise failures[0]
    return sum(made)


def train_all(url: str, keys: list[str], model: str, clients: int, steps: int, budget_s: float,
              record: list[str] | None = None) -> tuple[Latencies, int]:
    """Every key's tenant trains at once; the latencies of those in `record` (default: all)
    together, and the calls made."""
    latencies, ignored, deadline = Latencies(), Latencies(), time.monotonic() + budget_s
    made, failures = [0] * len(keys), []

    def tenant(i: int, key: str) -> None:
        try:
            into = latencies if record is None or key in record else ignored
            made[i] = train(url, key, model, clients, steps, into, deadline)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=tenant, args=(i, key), daemon=True) for i, key in enumerate(keys)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(budget_s + 3 * RESULT_S)
    if failures:
        raise failures[0]
    return latencies, sum(made)


def _merge(into: Latencies, other: Latencies) -> None:
    for call, values in other.by_call.items():
        into.by_call[call].extend(values)


# ---------------------------------------------------------------------------- a tenant that abuses

def abused_round(url: str, abuser_key: str, victims: list[str], clients: int, steps: int, budget_s: float,
                 result: dict) -> Latencies:
    """The victims train while the abuser (a process of its own) abuses; the victims' latencies.
    The abuser's answers by status are added up in `result["abuser_answers"]`."""
    with multiprocessing.Manager() as manager:
        answers, stop = manager.dict(), manager.Event()
        abuser = multiprocessing.get_context("spawn").Process(target=abuse, args=(url, abuser_key, "micro",
                                                                                  budget_s, answers, stop))
        abuser.start()
        try:
            time.sleep(2.0)  # its session and model exist, its abuse runs
            latencies, _ = train_all(url, victims, "micro", clients, steps, budget_s)
        finally:
            stop.set()
            abuser.join(2 * RESULT_S)
            if abuser.is_alive():
                abuser.kill()
        counts = result.setdefault("abuser_answers", {})
        for status, count in answers.items():
            counts[status] = counts.get(status, 0) + count
    return latencies


def abuse(url: str, key: str, model: str, seconds: float, answers, stop) -> None:
    """Requests at or past every limit, as fast as two threads send them, for at most `seconds`
    or until `stop` is set; the count of answers by status goes to `answers` (run in a process of
    its own)."""
    import httpx
    from tinker.proto import tinker_public_pb2 as pb

    end = time.monotonic() + seconds
    counts: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=RESULT_S) as h:
        session = h.post("/api/v1/create_session", json={}).json()["session_id"]
        created = h.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": model})
        model_id = _poll(h, created.json()["request_id"])["model_id"]
        sampler = h.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                                  "base_model": model}).json()["sampling_session_id"]
        bomb = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
        datum = bomb.data.add()
        datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype=np.int32).tobytes()
        for name in ("weights", "advantages", "logprobs"):
            datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1 << 24], sparse_csr=pb.SparseCsr(
                values=b"", crow_indices=np.array([0, 0], dtype=np.int64).tobytes(), col_indices=b"")))
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
        chunk = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")  # the SDK's 5 MB chunk
        chunk.data.add().model_input.add().encoded_text.tokens = np.ones(1_200_000, dtype=np.int32).tobytes()
        bodies = [
            ("json", "/api/v1/create_model", b'{"session_id": [' + b"0," * ((4 << 20) // 2 - 16) + b'0]}'),
            ("json", "/api/v1/optim_step", b"[" * 100_000),
            ("json", "/api/v1/create_model", b'{"session_id": "' + session.encode() + b'", "model_seq_id": 9, '
                                              b'"base_model": "' + b"m" * 4000 + b'"}'),
            ("json", "/api/v1/asample", _json({"sampling_session_id": sampler, "num_samples": 10 ** 7, "prompt": prompt,
                                               "sampling_params": {"max_tokens": 8}})),
            ("proto", "/api/v1/forward_backward", bomb.SerializeToString()),
            ("proto", "/api/v1/forward_backward", chunk.SerializeToString()),
        ]
        held = iter(range(2, 10 ** 6))  # calls held for seq_id 1, which never comes: the queue fills to its limit

        def send() -> None:
            i = 0
            while time.monotonic() < end and not stop.is_set():
                kind, path, body = bodies[i % len(bodies)] if i % 3 else ("proto", "/api/v1/forward", None)
                if body is None:
                    bomb_free = pb.ForwardBackwardRequest(model_id=model_id, seq_id=next(held), loss_fn="cross_entropy")
                    bomb_free.data.add().CopyFrom(datum)
                    bomb_free.data[0].ClearField("loss_fn_inputs")
                    body = bomb_free.SerializeToString()
                kind = {"json": "application/json", "proto": "application/x-protobuf"}[kind]
                try:
                    status = str(h.post(path, content=body, headers={"content-type": kind}).status_code)
                except httpx.HTTPError as exc:  # a body refused before it was read whole: the server closed on it
                    status = type(exc).__name__
                with lock:
                    counts[status] += 1
                i += 1

        threads = [threading.Thread(target=send, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + RESULT_S)
        h.post(f"/api/v1/sessions/{session}/finish", json={})
    answers.update(counts)


def _json(value) -> bytes:
    import json

    return json.dumps(value).encode()


def _poll(h, request_id: str, polls: int = 100) -> dict:
    for _ in range(polls):
        answer = h.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if answer.get("type") != "try_again":
            return answer
    raise TimeoutError(f"request {request_id} unfinished after {polls} polls")


# ---------------------------------------------------------------------------- the rounds

def keys_for(tenants: int) -> dict[str, str]:
    return {f"tenant{i}": f"tml-bench-tenant{i}-0123456789abcdef" for i in range(tenants)}


def summary(latencies: Latencies) -> dict[str, float]:
    out = {}
    for call in CALLS:
        values = latencies.by_call.get(call, [])
        if values:
            out[f"{call}_ms_p50"], out[f"{call}_ms_p95"] = percentile(values, 50), percentile(values, 95)
    return out


def run(tenants: int, clients: int, steps: int, budget_s: float, abuse_rounds: bool = True,
        engine: str = "process", server_flags: tuple[str, ...] = ()) -> dict:
    from plexrl.models.tiny import make_tiny_model

    keys = keys_for(tenants)
    with tempfile.TemporaryDirectory() as root:
        folder = str(make_tiny_model(f"{root}/models/a/micro", seed=0, hidden_size=16, num_layers=1, num_heads=2))
        server = start_server(Path(root) / "state", {"micro": folder}, keys, engine, server_flags)
        try:
            result: dict = {"tenants": tenants, "clients_per_tenant": clients, "steps_per_client": steps,
                            "engine": engine, "server_limits": re.search(r"bodies up to [^)]*", server.log.read_text())[0]}
            rounds = []
            for number in (1, 2):
                latencies, made = train_all(server.url, list(keys.values()), "micro", clients, steps, budget_s)
                rounds.append(latencies)
                result[f"round{number}_calls"] = made
                result[f"round{number}_server_rss_mib"] = server.rss_bytes() / (1 << 20)
            if abuse_rounds and tenants > 1:
                # the others train with tenant 0 training too (calm) and with tenant 0 abusing, alternated:
                # calm, abused, calm, abused; each figure pools the two rounds of its kind
                victims, calm, abused = list(keys.values())[1:], Latencies(), Latencies()
                for _ in range(2):
                    _merge(calm, train_all(server.url, list(keys.values()), "micro", clients, steps, budget_s,
                                           record=victims)[0])
                    _merge(abused, abused_round(server.url, list(keys.values())[0], victims, clients, steps, budget_s,
                                                result))
                result.update({f"calm_{k}": v for k, v in summary(calm).items()})
                result.update({f"abused_{k}": v for k, v in summary(abused).items()})
                for call in CALLS:
                    if f"calm_{call}_ms_p95" in result and f"abused_{call}_ms_p95" in result:
                        result[f"{call}_p95_abused_vs_calm"] = (result[f"abused_{call}_ms_p95"]
                                                                / result[f"calm_{call}_ms_p95"])
            result.update({f"round2_{k}": v for k, v in summary(rounds[1]).items()})
            result["server_rss_mib_after_abuse"] = server.rss_bytes() / (1 << 20)
        finally:
            server.stop()
    return result

"""The state of `plexrl serve`: tenants' sessions, models, sampling sessions and futures, on one
PlexRL cluster. plexrl/serve/app.py is its HTTP face; this module knows no HTTP.

A Tinker session is a PlexRL job (placed, admitted, multiplexed and accounted like any other);
a Tinker training client is a trainable model state of that job (LoRA through peft, or full
parameters for `rank=0`); a sampling session is a sampler snapshot (a weight sync) or a frozen
model. Each request becomes one call of the job-side API (plexrl/api/client.py), so it is checked
and scheduled exactly as a local job's call is.

Invariants:
- a POST only enqueues: it answers with a request id at once, and the result is fetched with
  `retrieve_future` (long-polled); what takes time (placing a model, loading a checkpoint) runs
  on the service's threads;
- calls on one model reach the runtime in `seq_id` order (the SDK numbers them and sends
  chunks of one forward_backward in parallel): a call waits for the ones numbered before it, for
  at most `gap_s` (a number the SDK reserved and never sent must not stall the model forever);
- a submission repeated with the same natural key ((model_id, seq_id), (session_id,
  model_seq_id), (session_id, sampling_session_seq_id), (sampling_session_id, seq_id)) returns
  the first one's request id and never runs twice;
- everything is looked up with the caller's tenant: another tenant's session, model, sampler,
  future, run or checkpoint is `NotFound`, exactly as one that does not exist;
- sampling without a seed draws from a seed derived from the request's numbers (sampling
  session, seq_id), never from arrival order: a run repeated with the same seeds samples the
  same tokens whatever else the server runs;
- what a tenant holds is bounded (`Limits`): requests queued and their payload bytes, request
  records kept (refusals included), open sessions; past a bound a request is refused (429), and
  a refusal's message is cut short, never echoing a large value;
- session ids come from a counter in the state directory, so they are unique across restarts
  and across servers sharing it; a run record is never overwritten.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from plexrl.api import errors
from plexrl.api.client import SamplingClient, ServiceClient, TrainingClient
from plexrl.api.cluster import StateHandle
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig, ModelInput, shown
from plexrl.serve import wire
from plexrl.serve.edge import EdgeLimits
from plexrl.serve.sequencer import Sequencer
from plexrl.serve.store import KINDS, CheckpointRecord, Run, Store, folder_bytes
from plexrl.serve.tenants import Tenants

log = logging.getLogger("plexrl.serve")

SNAPSHOT_SLOTS = 2  # sampler snapshots kept in memory per training model: the current and the one before


# ---------------------------------------------------------------------------- errors and outcomes

class ServeError(Exception):
    """An HTTP-level answer (app.py turns it into its status and a JSON body naming the problem)."""

    status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ServeError):
    status = 400


class Unauthorized(ServeError):
    status = 401


class NotFound(ServeError):
    status = 404


class Gone(ServeError):
    status = 410


class TooMany(ServeError):
    status = 429


MESSAGE_CHARS = 2000  # a failure's message is cut to this: a refusal never echoes a large value


@dataclass(frozen=True)
class Outcome:
    """A finished request: protobuf bytes, a JSON body, or a failure with its Tinker category."""

    proto: bytes | None = None
    json: dict | None = None
    error: str | None = None
    category: str = "server"  # "user" for bad input, "server" otherwise

    @classmethod
    def failed(cls, exc: BaseException) -> "Outcome":
        if isinstance(exc, (errors.InvalidInput, wire.WireError, ServeError, FileExistsError)):
            return cls(error=_message(exc), category="user")
        log.warning("request failed: %s: %s", type(exc).__name__, exc)
        return cls(error=_cut(f"{type(exc).__name__}: {exc}"), category="server")


def _message(exc: BaseException) -> str:
    if isinstance(exc, FileExistsError):
        return f"checkpoint {exc.args[0]} exists; save under another name or with overwrite=True"
    return _cut(str(exc))


def _cut(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + f"... ({len(text):,} characters)"


@dataclass
class Pending:
    """A request's future, as retrieve_future sees it."""

    request_id: str
    tenant: str
    session_id: str
    future: concurrent.futures.Future  # of Outcome
    waiting_for: Callable[[], str]  # what it waits for now (try-again's queue_state_reason)
    created: float = 0.0
    retrieved_at: float | None = None  # when its result was first answered to a poll
    nbytes: int = 0  # the payload it holds while queued (counted against the tenant's queued_bytes)


# ---------------------------------------------------------------------------- records

@dataclass
class Model:
    model_id: str
    tenant: str
    session_id: str
    run: Run
    sequencer: Sequencer
    client: TrainingClient | None = None  # set once placed
    syncs: int = 0  # sampler snapshots made
    last_touch: float = float("-inf")  # when its run's last request time was last written
    failed: BaseException | None = None  # placing it failed: every call fails with this


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    seed_base: int
    client: SamplingClient | None = None
    ready: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    snapshot_of: tuple["Model", int] | None = None  # (training model, its sync number) when on a snapshot slot
    folder: str | None = None  # the named sampler checkpoint it samples, once its slot is reused
    _seen: dict[str, int] = field(default_factory=dict)  # prompt digest -> samples asked for it so far
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def superseded(self) -> bool:
        """Its snapshot slot holds a later sync's weights now (a slot is rewritten in place)."""
        return self.snapshot_of is not None and _rewritten(*self.snapshot_of)

    def next_seed(self, prompt: list[int], seq: int | None) -> int:
        """The seed of a request that gives none: from the sampler, the prompt and the request's
        number in its sampling session (`seq_id`, which the SDK gives in submission order, not
        arrival order), or without one, how many requests for that prompt came before."""
        digest = hashlib.sha256(_token_bytes(prompt)).hexdigest()
        if seq is not None:
            return _seed(str(self.seed_base), digest, f"seq{seq}")
        with self._lock:
            k = self._seen.get(digest, 0)
            self._seen[digest] = k + 1
        return _seed(str(self.seed_base), digest, str(k))


@dataclass
class Session:
    session_id: str
    tenant: str
    job: str
    client: ServiceClient
    last_beat: float
    user_metadata: dict | None
    models: dict[int, str] = field(default_factory=dict)  # model_seq_id -> model_id
    samplers: dict[int, str] = field(default_factory=dict)  # sampling_session_seq_id -> sampler id
    steps: int = 0  # optim_steps so far: the job's step marks
    finished: bool = False
    finished_at: float | None = None


@dataclass(frozen=True)
class Limits:
    sessions_per_tenant: int = 16
    queued_per_tenant: int = 1024  # requests submitted and not yet finished
    queued_bytes_per_tenant: int = 1 << 30  # the payloads (bodies) of those requests, in bytes
    kept_per_tenant: int = 4096  # request records held (queued, and finished ones kept for polls)
    seq_window: int = 1024  # a model's seq_id may run at most this far ahead of the next one it expects
    metadata_bytes: int = 16 << 10  # a user_metadata object, as JSON
    session_timeout_s: float = 120.0  # a session without heartbeats this long is finished
    poll_hold_s: float = 25.0  # retrieve_future holds a poll this long before try-again (< 45 s)
    gap_s: float = 30.0  # a model's missing seq_id is waited for this long
    retention_s: float = 300.0  # a result is kept this long after it was retrieved (the SDK may poll again after
    # a transport error, and a retried submission returns it); one never retrieved, 12 times as long

    def validate(self) -> None:
        bad = [f"{name}={getattr(self, name)!r}" for name in self.__dataclass_fields__
               if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0)]
        if bad:
            raise errors.ConfigError(f"serve limits {', '.join(bad)}; expected numbers > 0")


class Service:
    def __init__(self, cluster, store: Store, models: dict[str, str], tenants: Tenants,
                 limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
                 client_flags: dict[str, Any] | None = None, edge: EdgeLimits = EdgeLimits()):
        """`models`: served name -> local Hugging Face folder. `client_flags`: what
        /client/config tells the SDK (empty: its defaults, which this server supports).
        `edge`: what a request's body may be (plexrl/serve/edge.py)."""
        if not models:
            raise errors.ConfigError("no model to serve; give --model PATH (or NAME=PATH) at least once")
        self.cluster = cluster
        self.store = store
        self.served = dict(models)
        self.tenants = tenants
        limits.validate()
        self.limits = limits
        edge.validate()
        self.edge = edge
        self.clock = clock
        self.client_flags = dict(client_flags or {})
        self.sessions: dict[str, Session] = {}
        self.model_table: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.pending: dict[str, Pending] = {}
        self._keys: dict[tuple, str] = {}  # (tenant, kind, natural key...) -> request id
        self._queued: dict[str, int] = {}  # tenant -> requests submitted and not finished
        self._queued_bytes: dict[str, int] = {}  # tenant -> the payload bytes those hold
        self._kept: dict[str, int] = {}  # tenant -> request records held (pending, queued or finished)
        self._closers: list[Callable[[], None]] = []
        self._opening: dict[str, int] = {}  # tenant -> sessions being created right now
        self._capabilities: dict | None = None
        # (tenant, tinker path) -> (snapshot, its model, its sync number): a named sampler still in a slot
        self._snapshots: dict[tuple[str, str], tuple[StateHandle, Model, int]] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._boot = secrets.token_hex(3)  # request ids of this server's life: a restarted server never reuses one
        self._work = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="plexrl-serve")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="plexrl-serve-reaper", daemon=True)
        self._reaper.start()

    def on_close(self, closer: Callable[[], None]) -> None:
        """Something to close with the service (the HTTP edge's thread pool)."""
        self._closers.append(closer)

    def close(self) -> None:
        self._stop.set()
        for session in list(self.sessions.values()):
            self._finish(session)
        self._work.shutdown(wait=True, cancel_futures=True)
        for closer in self._closers:
            closer()

    # -- identity ---------------------------------------------------------------------------------
    def tenant(self, key: str | None) -> str:
        tenant = self.tenants.tenant_of(key)
        if tenant is None:
            raise Unauthorized("missing or unknown API key; send a key this server knows in the X-API-Key header")
        return tenant

    # -- sessions ---------------------------------------------------------------------------------
    def create_session(self, tenant: str, body: dict) -> dict:
        metadata = self._metadata(body.get("user_metadata"))
        with self._lock:
            live = sum(1 for s in self.sessions.values() if s.tenant == tenant and not s.finished)
            live += self._opening.get(tenant, 0)
            if live >= self.limits.sessions_per_tenant:
                raise TooMany(f"tenant {tenant!r} has {live} open sessions, the most this server allows "
                              f"({self.limits.sessions_per_tenant}); finish one first")
            self._opening[tenant] = self._opening.get(tenant, 0) + 1
        try:
            session_id = f"s{self.store.next_number('session')}-{secrets.token_hex(4)}"  # unique across restarts
            client = self.cluster.service_client(session_id)
            session = Session(session_id, tenant, session_id, client, self.clock(), metadata)
            with self._lock:
                self.sessions[session_id] = session
        finally:
            with self._lock:
                self._opening[tenant] -= 1
        log.info("session %s opened for tenant %s", session_id, tenant)
        return {"type": "create_session", "session_id": session_id}

    def _metadata(self, value: Any) -> dict | None:
        """A user_metadata object as stored: str keys and values (others as their str), at most
        `metadata_bytes` as JSON. Its strings are valid Unicode: the edge refused any other."""
        metadata = _str_dict(value)
        if metadata is not None:
            size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            if size > self.limits.metadata_bytes:
                raise errors.InvalidInput(f"user_metadata is {size:,} bytes as JSON; expected at most "
                                          f"{self.limits.metadata_bytes:,}")
        return metadata

    def _session(self, tenant: str, session_id: Any) -> Session:
        session = _owned(self.sessions, tenant, session_id, "session")
        if session.finished:
            raise Gone(f"session {shown(session_id)} has finished")
        return session

    def heartbeat(self, tenant: str, body: dict) -> dict:
        session = self._session(tenant, body.get("session_id"))
        session.last_beat = self.clock()
        return {"type": "session_heartbeat"}

    def finish_session(self, tenant: str, session_id: str) -> dict:
        self._finish(_owned(self.sessions, tenant, session_id, "session"))
        return {}

    def _finish(self, session: Session) -> None:
        with self._lock:
            if session.finished:
                return
            session.finished = True
            model_ids = list(session.models.values())
            sampler_ids = list(session.samplers.values())
        try:
            session.client.close()  # frees the job's states and lets waiting jobs in
        except Exception as exc:  # the cluster closing under us: nothing more to free
            log.warning("finishing session %s: %s: %s", session.session_id, type(exc).__name__, exc)
        with self._lock:
            for model_id in model_ids:
                self.model_table.pop(model_id, None)
            for sampler_id in sampler_ids:
                self.samplers.pop(sampler_id, None)
            for sampler_id in [s.sampler_id for s in self.samplers.values() if s.session_id == session.session_id]:
                self.samplers.pop(sampler_id, None)
            for request_id in [p.request_id for p in self.pending.values() if p.session_id == session.session_id]:
                self._drop(request_id)
            session.finished_at = self.clock()
            self._keys = {k: v for k, v in self._keys.items() if v in self.pending}
        log.info("session %s finished", session.session_id)

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            now = self.clock()
            for session in list(self.sessions.values()):
                if not session.finished and now - session.last_beat > self.limits.session_timeout_s:
                    log.info("session %s sent no heartbeat for %.0f s: finishing it", session.session_id,
                             now - session.last_beat)
                    self._finish(session)
            with self._lock:
                models = list(self.model_table.values())
            for model in models:
                model.sequencer.drain()  # skips a seq_id gap that outlived gap_s
            self._expire(now)

    # -- futures ----------------------------------------------------------------------------------
    def _enqueue(self, tenant: str, session: Session, key: tuple | None,
                 submit: Callable[[concurrent.futures.Future], Callable[[], str]],
                 unblocks: bool = False, nbytes: int = 0) -> tuple[str, bool]:
        """A new request (or the one already made under `key`): (request id, whether it is new).
        `submit(future)` starts the work, resolving `future` with an Outcome, and returns what
        tells the request's state; `nbytes` is the payload it holds until it finishes. A request
        that `unblocks` queued ones (the seq_id they wait for) is let in past the tenant's limits
        on queued requests: refusing it would stall them."""
        with self._lock:
            if key is not None:
                known = self._keys.get((tenant, *key))
                if known is not None and known in self.pending:
                    return known, False
            queued, held = self._queued.get(tenant, 0), self._queued_bytes.get(tenant, 0)
            if queued >= self.limits.queued_per_tenant and not unblocks:
                raise TooMany(f"tenant {tenant!r} has {queued} requests queued, the most this server allows "
                              f"({self.limits.queued_per_tenant}); wait for some to finish")
            if held + nbytes > self.limits.queued_bytes_per_tenant and held and not unblocks:
                raise TooMany(f"tenant {tenant!r} has {held:,} bytes of requests queued and this one adds {nbytes:,}, "
                              f"more than this server holds for a tenant ({self.limits.queued_bytes_per_tenant:,}); "
                              "wait for some to finish")
            self._make_room(tenant)
            pending = self._new_pending(tenant, session.session_id, nbytes)
            if key is not None:
                self._keys[(tenant, *key)] = pending.request_id
            self._queued[tenant] = queued + 1
            self._queued_bytes[tenant] = held + nbytes
        pending.future.add_done_callback(lambda _: self._finished_one(tenant, nbytes))
        try:
            pending.waiting_for = submit(pending.future)
        except Exception as exc:
            _resolve(pending.future, Outcome.failed(exc))
        return pending.request_id, True

    def _new_pending(self, tenant: str, session_id: str, nbytes: int) -> Pending:
        """A request record, counted against the tenant's kept records (call with the lock held)."""
        request_id = f"r{next(self._ids)}-{self._boot}{secrets.token_hex(3)}"
        pending = Pending(request_id, tenant, session_id, concurrent.futures.Future(), lambda: "queued", self.clock(),
                          nbytes=nbytes)
        self.pending[request_id] = pending
        self._kept[tenant] = self._kept.get(tenant, 0) + 1
        return pending

    def _make_room(self, tenant: str) -> None:
        """Room for one more of the tenant's records: past `kept_per_tenant` its oldest retrieved
        results go first; with none retrieved, TooMany (call with the lock held)."""
        over = self._kept.get(tenant, 0) + 1 - self.limits.kept_per_tenant
        if over <= 0:
            return
        retrieved = sorted((p.retrieved_at, p.request_id) for p in self.pending.values()
                           if p.tenant == tenant and p.retrieved_at is not None)
        for _, request_id in retrieved[:over]:
            self._drop(request_id)
        if self._kept.get(tenant, 0) + 1 > self.limits.kept_per_tenant:
            raise TooMany(f"tenant {tenant!r} holds {self._kept[tenant]} requests and results not yet retrieved, the "
                          f"most this server keeps ({self.limits.kept_per_tenant}); retrieve or wait for some")

    def _drop(self, request_id: str) -> None:
        """Forget a request record (call with the lock held; its natural key goes with it)."""
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            self._kept[pending.tenant] -= 1

    def _finished_one(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self._queued[tenant] -= 1
            self._queued_bytes[tenant] -= nbytes

    def queue_state(self, pending: Pending) -> tuple[str, str]:
        """A try-again's queue state and reason: what the request waits for, and since when."""
        reason = pending.waiting_for()
        state = "paused_capacity" if "room on the cluster" in reason else "active"
        if state == "paused_capacity":
            placer = self._placer_reason(pending.session_id)
            reason += f": {placer}" if placer else ""
        waited = max(0.0, self.clock() - pending.created)
        since = datetime.fromtimestamp(time.time() - waited, timezone.utc).strftime("%H:%M:%S UTC")
        return state, f"{reason} (since {since}, {waited:.0f} s)"

    def _placer_reason(self, job: str) -> str:
        """Why the placer keeps a job waiting, if it says."""
        try:
            return str(self.cluster.metrics()["placement"][job].get("waiting_reason") or "")
        except Exception:  # a cluster without placement figures: the reason stays general
            return ""

    def retrieved(self, pending: Pending) -> None:
        """A poll answered the request's result: it is kept `retention_s` more, then dropped."""
        if pending.retrieved_at is None:
            pending.retrieved_at = self.clock()

    def _expire(self, now: float) -> None:
        keep = self.limits.retention_s
        with self._lock:
            old = [p.request_id for p in self.pending.values() if p.future.done() and (
                (p.retrieved_at is not None and now - p.retrieved_at > keep)
                or (p.retrieved_at is None and now - p.created > 12 * keep))]
            for request_id in old:
                self._drop(request_id)
            gone = [s.session_id for s in self.sessions.values()
                    if s.finished and s.finished_at is not None and now - s.finished_at > keep]
            for session_id in gone:  # a finished session answers 410 for a while, then 404
                del self.sessions[session_id]
            if old:
                self._keys = {k: v for k, v in self._keys.items() if v in self.pending}

    def failed(self, tenant: str, exc: BaseException) -> str:
        """A request refused before it started (bad input): its future fails with the message
        (cut short). It counts against the tenant's kept records like any other: TooMany past them."""
        with self._lock:
            self._make_room(tenant)
            pending = self._new_pending(tenant, "", 0)
        pending.waiting_for = lambda: "failed"
        pending.future.set_result(Outcome.failed(exc))
        return pending.request_id

    def future(self, tenant: str, request_id: Any) -> Pending:
        return _owned(self.pending, tenant, request_id, "request")

    # -- models -----------------------------------------------------------------------------------
    def _folder(self, base_model: Any) -> str:
        folder = self.served.get(base_model) if isinstance(base_model, str) else None
        if folder is None:
            raise errors.InvalidInput(f"base_model={shown(base_model)} is not served here; expected one of "
                                      f"{sorted(self.served)}")
        return folder

    def create_model(self, tenant: str, body: dict) -> str:
        session = self._session(tenant, body.get("session_id"))
        seq = _int(body, "model_seq_id")
        optimizer = body.get("optimizer_config") or {}
        if isinstance(optimizer, dict) and optimizer.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config.type={shown(optimizer.get('type'))}; PlexRL trains with 'adamw' only")
        lora = _lora(body.get("lora_config"))
        self._folder(body.get("base_model"))
        run = Run(_model_id(session, seq), tenant, body["base_model"], lora.rank if lora else 0,
                  *(_lora_flags(lora)), user_metadata=self._metadata(body.get("user_metadata")))

        def start(future):
            model = self._new_model(session, seq, run, next_seq=1)
            self._work.submit(self._place, model, lora, future, None)
            return lambda: model.sequencer.waiting_for(None) or "the model is placed"

        request_id, _ = self._enqueue(tenant, session, ("create_model", session.session_id, seq), start)
        return request_id

    def _new_model(self, session: Session, seq: int, run: Run, next_seq: int) -> Model:
        model = Model(run.run_id, session.tenant, session.session_id, run,
                      Sequencer(next_seq, self.limits.gap_s, self.clock, self.limits.seq_window))
        with self._lock:
            if run.run_id in self.model_table:
                raise errors.InvalidInput(f"model_seq_id={seq} is already a model of session {session.session_id!r}")
            self.model_table[run.run_id] = model
            session.models[seq] = run.run_id
        return model

    def _place(self, model: Model, lora: LoraConfig | None, future, checkpoint: tuple[CheckpointRecord, bool] | None):
        """On a service thread: add the model to the cluster (waiting for admission), load a
        checkpoint into it if asked, record its run, then let its queued calls go."""
        try:
            session = self.sessions.get(model.session_id)
            if session is None or session.finished:
                raise Gone(f"session {model.session_id!r} finished while its model was being placed")
            folder = self._folder(model.run.base_model)
            name = model.model_id.split(":", 1)[1]  # "train:N"
            seed = lora.seed if lora else 0
            if lora is not None:
                model.client = session.client.create_lora_training_client(
                    folder, lora.rank, seed=seed, name=name, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                    train_unembed=lora.train_unembed)
            else:
                model.client = session.client.create_training_client(folder, seed=seed, name=name)
            if checkpoint is not None:
                record, with_optimizer = checkpoint
                load = model.client.load_state_with_optimizer if with_optimizer else model.client.load_state
                load(record.folder).result()
            self.store.add_run(model.run)
            if checkpoint is None:
                outcome = Outcome(json={"model_id": model.model_id, "type": "create_model"})
            else:
                outcome = Outcome(json={"path": checkpoint[0].tinker_path, "type": "load_weights"})
        except Exception as exc:
            model.failed = exc
            outcome = Outcome.failed(exc)
        model.sequencer.open()
        _resolve(future, outcome)

    def _model(self, tenant: str, model_id: Any) -> Model:
        return _owned(self.model_table, tenant, model_id, "model")

    def get_info(self, tenant: str, body: dict) -> dict:
        model = self._model(tenant, body.get("model_id"))
        folder = self.served[model.run.base_model]
        return {"type": "get_info", "model_id": model.model_id, "model_name": model.run.base_model,
                "model_data": {"arch": _arch(folder), "model_name": model.run.base_model, "tokenizer_id": folder},
                "is_lora": model.run.lora_rank > 0, "lora_rank": model.run.lora_rank or None}

    def _model_call(self, tenant: str, model_id: Any, seq: int | None, kind: str,
                    call: Callable[[Model], APIFuture], finish: Callable[[Model, Any], Outcome],
                    inline: bool = False, nbytes: int = 0) -> str:
        """A call on a training model, run in seq order: `call(model)` submits it to the runtime
        and `finish(model, result)` makes its outcome: on the runtime's thread that delivered the
        result when `inline` (a `finish` that only encodes), else on a service thread (one that
        moves files or waits for another call)."""
        model = self._model(tenant, model_id)
        session = self._session(tenant, model.session_id)

        def start(future):
            state = {"submitted": False}

            def go():
                if model.failed is not None:
                    _resolve(future, Outcome.failed(errors.InvalidInput(
                        f"model {model.model_id!r} could not be created: {model.failed}")))
                    return
                state["submitted"] = True
                try:
                    api_future = call(model)
                except Exception as exc:
                    _resolve(future, Outcome.failed(exc))
                    return
                if inline:
                    api_future.add_done_callback(lambda done: _finish_call(done, model, finish, future))
                else:
                    api_future.add_done_callback(lambda done: self._work.submit(_finish_call, done, model, finish, future))

            model.sequencer.arrive(seq, go)
            return lambda: (model.sequencer.waiting_for(seq) or self._runtime_state(model, state["submitted"]))

        key = (kind, model.model_id, seq) if seq is not None else None
        with self._lock:
            retried = key is not None and self._keys.get((tenant, *key)) in self.pending
        if not retried:
            model.sequencer.check(seq)
        self.store_touch(model)
        request_id, _ = self._enqueue(tenant, session, key, start, nbytes=nbytes,
                                      unblocks=seq is not None and seq == model.sequencer.next_seq)
        return request_id

    def store_touch(self, model: Model) -> None:
        """The run's last request time, written at most once a second a model, off the caller's thread."""
        now = self.clock()
        if now - model.last_touch < 1.0:
            return
        model.last_touch = now
        self._work.submit(self._touch, model.run.run_id)

    def _touch(self, run_id: str) -> None:
        try:
            self.store.touch_run(run_id)
        except Exception as exc:  # a busy database must not fail a call; the next touch catches up
            log.warning("recording the last request of %s: %s", run_id, exc)

    def _runtime_state(self, model: Model, submitted: bool) -> str:
        if not submitted:
            return "queued"
        client = model.client
        try:
            where = self.cluster.residency().get(client.state.state_id, "")
        except Exception:
            where = ""
        if where.startswith("device"):
            return f"queued or running on {where} (requests of other jobs may run first)"
        if where:
            return f"waiting for its state to be switched in (now on {where})"
        return "queued in the runtime"

    def forward(self, tenant: str, body: bytes) -> str:
        return self.forward_backward(tenant, body, forward_only=True)

    def forward_backward(self, tenant: str, body: bytes, forward_only: bool | None = None) -> str:
        request = wire.decode_forward_backward(body, self.edge.max_request_values)
        only = request.forward_only if forward_only is None else forward_only

        def call(model: Model) -> APIFuture:
            run = model.client.forward if only else model.client.forward_backward
            return run(request.data, request.loss_fn, request.loss_fn_config or None)

        def finish(model: Model, output) -> Outcome:
            output = type(output)(output.loss_fn_outputs, wire.tinker_metrics(output.metrics))
            return Outcome(proto=wire.encode_forward_backward_output(output))

        return self._model_call(tenant, request.model_id, request.seq_id, "forward_backward", call, finish, inline=True,
                                nbytes=len(body))

    def optim_step(self, tenant: str, body: dict) -> str:
        # Checks of a numbered call run in its turn (inside `call`): a refused call still moves its model's sequence on.
        def call(model: Model) -> APIFuture:
            return model.client.optim_step(wire.adam_params(body.get("adam_params") or body.get("optim_params") or {}))

        def finish(model: Model, response) -> Outcome:
            self._work.submit(self._step_mark, model)
            return Outcome(json={"type": "optim_step", "metrics": wire.tinker_metrics(response.metrics)})

        return self._model_call(tenant, body.get("model_id"), _opt_int(body, "seq_id"), "optim_step", call, finish,
                                inline=True)

    def _step_mark(self, model: Model) -> None:
        """A session's optim_step is its job's step boundary (profiling, checkpoints, re-placement)."""
        session = self.sessions.get(model.session_id)
        if session is None or session.finished:
            return
        session.steps += 1
        try:
            session.client.report_step(session.steps)
        except Exception as exc:
            log.warning("step mark of %s: %s: %s", session.job, type(exc).__name__, exc)

    # -- checkpoints ------------------------------------------------------------------------------
    def save_weights(self, tenant: str, body: dict) -> str:
        seq = _opt_int(body, "seq_id")
        name = body.get("path") or f"{seq or 0:06d}"
        kind = "weights"
        return self._save(tenant, body, seq, name, kind, with_optimizer=True)

    def _save(self, tenant: str, body: dict, seq: int | None, name: Any, kind: str, with_optimizer: bool,
              extra: Callable[[Model, dict], dict] | None = None) -> str:
        overwrite = bool(body.get("overwrite", False))
        metadata = body.get("user_metadata")

        def call(model: Model) -> APIFuture:
            _check_checkpoint_name(name)
            self._metadata(metadata)
            return model.client.save_state(f"serve-{kind}-{name}", with_optimizer=with_optimizer)

        def finish(model: Model, response) -> Outcome:
            folder = self.store.folder_for(tenant, model.run.run_id, kind, name)
            written = Path(response.path)
            record = CheckpointRecord(model.run.run_id, kind, name, tenant, str(folder), time.time(),
                                      folder_bytes(written), with_optimizer, self._metadata(metadata))
            self.store.add_checkpoint(record, written, overwrite)
            answer = {"path": record.tinker_path}
            if extra is not None:
                answer = extra(model, answer)
            return Outcome(json=answer)

        return self._model_call(tenant, body.get("model_id"), seq, f"save_{kind}", call, finish)

    def save_weights_for_sampler(self, tenant: str, body: dict) -> str:
        seq = _opt_int(body, "seq_id")
        model = self._model(tenant, body.get("model_id"))
        name = body.get("path")
        sampler_seq = body.get("sampling_session_seq_id")
        if name is None and sampler_seq is None:
            raise BadRequest("save_weights_for_sampler needs 'path' (a named checkpoint) or "
                             "'sampling_session_seq_id' (an unnamed sampler)")

        def sync(model: Model) -> tuple[StateHandle, int]:
            """A weight sync into one of the model's snapshot slots (the runtime's fast path), and its
            number: the slot is rewritten in place by the sync SNAPSHOT_SLOTS later."""
            model.syncs += 1
            slot = f"sampler{model.syncs % SNAPSHOT_SLOTS}"
            return model.client.save_weights_for_sampler(slot).result(), model.syncs

        if name is not None:
            def extra(model: Model, answer: dict) -> dict:
                handle, number = sync(model)
                with self._lock:
                    self._snapshots[(tenant, answer["path"])] = (handle, model, number)
                return answer

            return self._save(tenant, body, seq, name, "sampler_weights", with_optimizer=False, extra=extra)

        session = self._session(tenant, model.session_id)
        sampler_seq = _int(body, "sampling_session_seq_id")

        def call(model: Model) -> APIFuture:
            return self._work.submit(lambda: sync(model))

        def finish(model: Model, synced: tuple[StateHandle, int]) -> Outcome:
            sampler = self._new_sampler(session, sampler_seq, model.run.base_model, None)
            sampler.client = SamplingClient(self.cluster, synced[0], sampler.seed_base)
            sampler.snapshot_of = (model, synced[1])
            sampler.ready.set_result(None)
            return Outcome(json={"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})

        return self._model_call(tenant, model.model_id, seq, "save_weights_for_sampler", _as_api(call), finish)

    def load_weights(self, tenant: str, body: dict) -> str:
        path = body.get("path")
        with_optimizer = bool(body.get("optimizer", False))

        def checkpoint() -> CheckpointRecord:
            record = self._checkpoint(tenant, path)
            if with_optimizer and not record.with_optimizer:
                raise errors.InvalidInput(f"checkpoint {path} was saved without its optimizer state "
                                          "(save_weights_for_sampler); load it with optimizer=False")
            return record

        if body.get("model_id") is not None:
            def call(model: Model) -> APIFuture:
                record = checkpoint()
                load = model.client.load_state_with_optimizer if with_optimizer else model.client.load_state
                return load(record.folder)

            return self._model_call(tenant, body.get("model_id"), _opt_int(body, "seq_id"), "load_weights", call,
                                    lambda model, _: Outcome(json={"type": "load_weights", "path": path}))
        session = self._session(tenant, body.get("session_id"))
        seq = _int(body, "model_seq_id")
        record = checkpoint()
        source = self.store.run(tenant, record.run_id)
        if source is None:
            raise NotFound(f"no training run {record.run_id!r} for checkpoint {path}")
        lora = LoraConfig(rank=source.lora_rank, train_mlp=source.train_mlp, train_attn=source.train_attn,
                          train_unembed=source.train_unembed) if source.lora_rank else None
        run = Run(_model_id(session, seq), tenant, source.base_model, source.lora_rank, source.train_mlp,
                  source.train_attn, source.train_unembed, user_metadata=self._metadata(body.get("user_metadata"))
                  or source.user_metadata)

        def start(future):
            model = self._new_model(session, seq, run, next_seq=1)
            self._work.submit(self._place, model, lora, future, (record, with_optimizer))
            return lambda: model.sequencer.waiting_for(None) or "loading the checkpoint"

        request_id, _ = self._enqueue(tenant, session, ("load_weights_create", session.session_id, seq), start)
        return request_id

    def _checkpoint(self, tenant: str, path: Any) -> CheckpointRecord:
        run_id, kind, name = parse_tinker_path(path)
        record = self.store.checkpoint(tenant, run_id, kind, name)
        if record is None:
            raise NotFound(f"no checkpoint {shown(path)}")
        return record

    # -- sampling ---------------------------------------------------------------------------------
    def _new_sampler(self, session: Session, seq: int, base_model: str, model_path: str | None) -> Sampler:
        with self._lock:
            if seq in session.samplers:
                raise errors.InvalidInput(f"sampling_session_seq_id={seq} is already a sampler of session "
                                          f"{session.session_id!r}")
            sampler_id = f"{session.session_id}:sample:{seq}"
            seed_base = _seed(str(seq), model_path.rsplit("/", 1)[-1] if model_path else base_model)
            sampler = Sampler(sampler_id, session.tenant, session.session_id, base_model, model_path, seed_base)
            self.samplers[sampler_id] = sampler
            session.samplers[seq] = sampler_id
        return sampler

    def create_sampling_session(self, tenant: str, body: dict) -> concurrent.futures.Future:
        """Direct (not a future): the SDK waits for the id. Returns a future of the JSON answer."""
        session = self._session(tenant, body.get("session_id"))
        seq = _int(body, "sampling_session_seq_id")
        with self._lock:
            known = session.samplers.get(seq)
        if known is not None:  # a retried creation
            return _done({"type": "create_sampling_session", "sampling_session_id": known})
        model_path, base_model = body.get("model_path"), body.get("base_model")
        if model_path is not None:
            record = self._checkpoint(tenant, model_path)
            run = self.store.run(tenant, record.run_id)
            base_model = run.base_model if run else base_model
            snapshot = self._snapshots.get((tenant, model_path))
        else:
            self._folder(base_model)
            record, snapshot = None, None
        sampler = self._new_sampler(session, seq, base_model, model_path)

        def build():
            sampler.folder = record.folder if record is not None else None
            if snapshot is not None and not _rewritten(*snapshot[1:]):
                handle, model, number = snapshot
                sampler.client, sampler.snapshot_of = SamplingClient(self.cluster, handle, sampler.seed_base), (model, number)
            else:
                self._load_frozen(session, sampler, sampler.folder or self._folder(base_model))
            sampler.ready.set_result(None)
            return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

        answer = self._work.submit(build)
        answer.add_done_callback(lambda f: f.exception() and not sampler.ready.done()
                                 and sampler.ready.set_exception(f.exception()))
        return answer

    def _load_frozen(self, session: Session, sampler: Sampler, folder: str) -> None:
        """The sampler's weights as a frozen model of the session's job, loaded from `folder` (on a
        service thread: it waits for admission)."""
        name = "sampler:" + sampler.sampler_id.rsplit(":", 1)[1]
        sampler.client = session.client.create_sampling_client(folder, name=name, seed=sampler.seed_base)
        sampler.snapshot_of = None

    def _off_reused_slot(self, session: Session, sampler: Sampler) -> None:
        """A sampler whose snapshot slot a later sync rewrote samples its own checkpoint from now
        on; an unnamed one has none and fails clearly."""
        with sampler._lock:
            if not sampler.superseded():
                return
            if sampler.folder is None:
                raise errors.InvalidInput(
                    f"sampling session {sampler.sampler_id!r} samples weights of an unnamed save_weights_for_sampler "
                    f"that {SNAPSHOT_SLOTS} later syncs of its model have replaced; save named sampler weights "
                    "(save_weights_for_sampler(path)) to sample them later")
            self._load_frozen(session, sampler, sampler.folder)

    def sampler_info(self, tenant: str, sampler_id: str) -> dict:
        sampler = self._sampler(tenant, sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def _sampler(self, tenant: str, sampler_id: Any) -> Sampler:
        return _owned(self.samplers, tenant, sampler_id, "sampling session")

    def sample(self, tenant: str, body: dict) -> dict:
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:
            raise BadRequest("asample needs 'sampling_session_id' (create one with create_sampling_session)")
        sampler = self._sampler(tenant, sampler_id)
        session = self._session(tenant, sampler.session_id)
        seq = _opt_int(body, "seq_id")
        for unsupported in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(unsupported):
                raise errors.InvalidInput(f"{unsupported}={shown(body[unsupported])}; PlexRL does not compute top-k "
                                          "log-probs: expected 0")
        if body.get("target_prompt_logprobs") is not None:
            raise errors.InvalidInput("target_prompt_logprobs is not supported by PlexRL; expected None")
        prompt: ModelInput = wire.model_input(body.get("prompt"))
        params = wire.sampling_params(body.get("sampling_params") or {})
        if body.get("record_stability_info"):
            raise errors.InvalidInput("record_stability_info=True (for the stable_reinforce loss) is not supported by "
                                      "PlexRL; train with loss_fn importance_sampling, ppo, cispo or dro")
        num_samples = self._num_samples(body.get("num_samples", 1), prompt.length, params.max_tokens)
        if params.seed is None:
            params = type(params)(**{**params.__dict__, "seed": sampler.next_seed(prompt.to_ints(), seq)})
        with_prompt = bool(body.get("prompt_logprobs") or False)
        box: dict[str, Any] = {}

        def submit(future):
            def go(_):
                if sampler.ready.exception() is not None:
                    _resolve(future, Outcome.failed(sampler.ready.exception()))
                elif sampler.superseded():
                    self._work.submit(reload_then_run)  # loading a model waits: not on the caller's thread
                else:
                    run()

            def reload_then_run():
                try:
                    self._off_reused_slot(session, sampler)
                except Exception as exc:
                    _resolve(future, Outcome.failed(exc))
                    return
                run()

            def run():
                api_future = sampler.client.sample(prompt, num_samples, params, include_prompt_logprobs=with_prompt)
                box["submitted"] = True
                api_future.add_done_callback(lambda done: _finish_sample(done, future))  # encodes only

            sampler.ready.add_done_callback(go)
            return lambda: ("queued in the runtime" if box.get("submitted")
                            else "the sampling session's model is being loaded")

        request_id, _ = self._enqueue(tenant, session, ("sample", sampler_id, seq) if seq is not None else None,
                                      submit, nbytes=8 * prompt.length)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(num_samples)]}

    def _num_samples(self, value: Any, prompt_tokens: int, max_tokens: int) -> int:
        """num_samples checked before anything is built for it: an integer from 1 to what the
        cluster's `max_sampled_tokens` allows for this prompt and max_tokens."""
        limit = getattr(getattr(self.cluster, "config", None), "max_sampled_tokens", 1 << 16)
        most = max(1, limit // max(1, prompt_tokens + max_tokens))
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise errors.InvalidInput(
                f"num_samples={shown(value)}; expected an integer from 1 to {most:,} (max_sampled_tokens={limit:,} over "
                f"a prompt of {prompt_tokens:,} tokens + max_tokens={max_tokens:,})")
        return value

    # -- runs, checkpoints (REST) -----------------------------------------------------------------
    def training_run(self, tenant: str, run_id: str) -> dict:
        run = self.store.run(tenant, run_id)
        if run is None:
            raise NotFound(f"no training run {shown(run_id)}")
        return self._run_json(run)

    def _run_json(self, run: Run) -> dict:
        last = self.store.last_checkpoint(run.tenant, run.run_id, "weights")
        last_sampler = self.store.last_checkpoint(run.tenant, run.run_id, "sampler_weights")
        return {"training_run_id": run.run_id, "base_model": run.base_model, "model_owner": run.tenant,
                "is_lora": run.lora_rank > 0, "corrupted": False, "lora_rank": run.lora_rank or None,
                "last_request_time": _iso(run.last_request),
                "last_checkpoint": None if last is None else _checkpoint_json(last),
                "last_sampler_checkpoint": None if last_sampler is None else _checkpoint_json(last_sampler),
                "user_metadata": run.user_metadata}

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict:
        runs, total = self.store.runs(tenant, limit, offset)
        return {"training_runs": [self._run_json(run) for run in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def checkpoints(self, tenant: str, run_id: str) -> dict:
        if self.store.run(tenant, run_id) is None:
            raise NotFound(f"no training run {shown(run_id)}")
        records = self.store.checkpoints(tenant, run_id)
        return {"checkpoints": [_checkpoint_json(r) for r in records],
                "cursor": {"offset": 0, "limit": len(records), "total_count": len(records)}}

    def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS or not name:
            raise NotFound(f"no checkpoint {shown(checkpoint_id)}; expected weights/NAME or sampler_weights/NAME")
        if not self.store.delete_checkpoint(tenant, run_id, kind, name):
            raise NotFound(f"no checkpoint tinker://{run_id}/{checkpoint_id}")
        with self._lock:
            self._snapshots.pop((tenant, f"tinker://{run_id}/{checkpoint_id}"), None)

    def weights_info(self, tenant: str, body: dict) -> dict:
        record = self._checkpoint(tenant, body.get("tinker_path"))
        run = self.store.run(tenant, record.run_id)
        if run is None:
            raise NotFound(f"no training run {record.run_id!r}")
        return {"base_model": run.base_model, "is_lora": run.lora_rank > 0, "lora_rank": run.lora_rank or None,
                "train_unembed": run.train_unembed if run.lora_rank else None,
                "train_mlp": run.train_mlp if run.lora_rank else None,
                "train_attn": run.train_attn if run.lora_rank else None}

    def capabilities(self) -> dict:
        """The served models (read from their folders once: they do not change while serving)."""
        if self._capabilities is None:
            self._capabilities = {"supported_models": [
                {"model_name": name, "max_context_length": _context(folder), "trainable": True, "sampleable": True}
                for name, folder in sorted(self.served.items())]}
        return self._capabilities


# ---------------------------------------------------------------------------- helpers

def _owned(table: dict, tenant: str, key: Any, what: str):
    """`table[key]` when it is the tenant's; NotFound otherwise, the same for another tenant's
    record as for one that does not exist."""
    record = table.get(key) if isinstance(key, str) else None
    if record is None or record.tenant != tenant:
        raise NotFound(f"no {what} {shown(key)}")
    return record


def _resolve(future: concurrent.futures.Future, outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


def _done(value) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _as_api(call: Callable[[Model], concurrent.futures.Future]) -> Callable[[Model], APIFuture]:
    """A service-thread future as an APIFuture (for calls that are several runtime calls)."""
    def wrapped(model: Model) -> APIFuture:
        api = APIFuture()
        inner = call(model)
        inner.add_done_callback(lambda f: api.set_exception(f.exception()) if f.exception() else api.set_result(f.result()))
        return api

    return wrapped


def _finish_call(done: APIFuture, model: Model, finish: Callable[[Model, Any], Outcome], future) -> None:
    try:
        outcome = finish(model, done.result())
    except Exception as exc:
        outcome = Outcome.failed(exc)
    _resolve(future, outcome)


def _finish_sample(done: APIFuture, future) -> None:
    try:
        outcome = Outcome(proto=wire.encode_sample_response(done.result()))
    except Exception as exc:
        outcome = Outcome.failed(exc)
    _resolve(future, outcome)


def _rewritten(model: "Model", number: int) -> bool:
    """The snapshot slot of `model`'s sync `number` holds a later sync's weights (slots are rewritten in place)."""
    return model.syncs >= number + SNAPSHOT_SLOTS


def parse_tinker_path(path: Any) -> tuple[str, str, str]:
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise errors.InvalidInput(f"path={shown(path)}; expected tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise errors.InvalidInput(f"path={shown(path)}; expected tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
    return parts[0], parts[1], parts[2]


def _check_checkpoint_name(name: Any) -> None:
    from plexrl.api import validation

    validation.check_checkpoint_name(name)


def _model_id(session: Session, seq: int) -> str:
    return f"{session.session_id}:train:{seq}"


def _int(body: dict, name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{name}={shown(value)}; expected an integer >= 0")
    return value


def _opt_int(body: dict, name: str) -> int | None:
    return None if body.get(name) is None else _int(body, name)


def _lora(config: Any) -> LoraConfig | None:
    """Tinker's lora_config as PlexRL's; rank 0 (or no lora_config) is a full-parameter model."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise BadRequest(f"lora_config={shown(config)}; expected an object with 'rank'")
    rank = config.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise errors.InvalidInput(f"lora_config.rank={shown(rank)}; expected an integer >= 1 (or 0 for full-parameter training)")
    if rank == 0:
        return None
    seed = config.get("seed")
    return LoraConfig(rank=rank, seed=0 if seed is None else seed, train_mlp=config.get("train_mlp", True),
                      train_attn=config.get("train_attn", True), train_unembed=config.get("train_unembed", True))


def _lora_flags(lora: LoraConfig | None) -> tuple[bool, bool, bool]:
    if lora is None:
        return True, True, True
    return lora.train_mlp, lora.train_attn, lora.train_unembed


def _str_dict(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"user_metadata={shown(value)}; expected an object of strings")
    return {str(k): v if isinstance(v, str) else str(v) for k, v in value.items()}


def _token_bytes(tokens: list[int]) -> bytes:
    return ",".join(map(str, tokens)).encode()


def _seed(*parts: str) -> int:
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _arch(folder: str) -> str:
    try:
        return (json.loads((Path(folder) / "config.json").read_text()).get("architectures") or ["unknown"])[0]
    except (OSError, ValueError):
        return "unknown"


def _context(folder: str) -> int | None:
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _checkpoint_json(record: CheckpointRecord) -> dict:
    return {"checkpoint_id": f"{record.kind}/{record.name}",
            "checkpoint_type": "training" if record.kind == "weights" else "sampler",
            "time": _iso(record.time), "tinker_path": record.tinker_path, "size_bytes": record.size_bytes,
            "public": False, "user_metadata": record.user_metadata}


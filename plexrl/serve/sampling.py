"""Sampling sessions on `plexrl serve`: a sampler is either a snapshot of a training model (a
weight sync into one of the model's `SNAPSHOT_SLOTS` snapshot slots, the runtime's fast path) or
a frozen model of the session's job loaded from a checkpoint or a served base model.

Invariants:
- a snapshot slot is rewritten in place by the sync `SNAPSHOT_SLOTS` later: a sampler whose
  slot was rewritten samples its own named checkpoint from then on, and an unnamed one fails
  clearly; it never samples another sync's weights;
- a named sampler checkpoint still in its slot is sampled from the slot, not reloaded;
- sampling without a seed draws from a seed derived from the request's numbers (sampling
  session, seq_id), never from arrival order: a run repeated with the same seeds samples the
  same tokens whatever else the server runs;
- a sampler of another tenant is `NotFound`, as one that does not exist.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from plexrl.api import errors
from plexrl.api.client import SamplingClient
from plexrl.api.cluster import StateHandle
from plexrl.api.futures import APIFuture
from plexrl.serve import wire
from plexrl.serve.bodies import CreateSamplingSession, Sample
from plexrl.serve.catalog import Catalog
from plexrl.serve.futures import Outcome, RequestTable, resolve
from plexrl.serve.models import Model
from plexrl.serve.refusals import owned
from plexrl.serve.runs import Runs
from plexrl.serve.sessions import Session, Sessions

SNAPSHOT_SLOTS = 2  # sampler snapshots kept in memory per training model: the current and the one before


def rewritten(model: Model, number: int) -> bool:
    """The snapshot slot of `model`'s sync `number` holds a later sync's weights (slots are rewritten in place)."""
    return model.syncs >= number + SNAPSHOT_SLOTS


def sync(model: Model) -> tuple[StateHandle, int]:
    """A weight sync into one of the model's snapshot slots (the runtime's fast path), and its
    number: the slot is rewritten in place by the sync SNAPSHOT_SLOTS later."""
    model.syncs += 1
    slot = f"sampler{model.syncs % SNAPSHOT_SLOTS}"
    return model.client.save_weights_for_sampler(slot).result(), model.syncs


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
    snapshot_of: tuple[Model, int] | None = None  # (training model, its sync number) when on a snapshot slot
    folder: str | None = None  # the named sampler checkpoint it samples, once its slot is reused
    _seen: dict[str, int] = field(default_factory=dict)  # prompt digest -> samples asked for it so far
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def superseded(self) -> bool:
        """Its snapshot slot holds a later sync's weights now (a slot is rewritten in place)."""
        return self.snapshot_of is not None and rewritten(*self.snapshot_of)

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

    def on_snapshot(self, cluster, handle: StateHandle, model: Model, number: int) -> None:
        self.client, self.snapshot_of = SamplingClient(cluster, handle, self.seed_base), (model, number)

    def load_frozen(self, session: Session, folder: str) -> None:
        """Its weights as a frozen model of the session's job, loaded from `folder` (on a service
        thread: it waits for admission)."""
        name = "sampler:" + self.sampler_id.rsplit(":", 1)[1]
        self.client = session.client.create_sampling_client(folder, name=name, seed=self.seed_base)
        self.snapshot_of = None

    def off_reused_slot(self, session: Session) -> None:
        """Once a later sync rewrote its snapshot slot, it samples its own checkpoint; an unnamed
        one has none and fails clearly."""
        with self._lock:
            if not self.superseded():
                return
            if self.folder is None:
                raise errors.InvalidInput(
                    f"sampling session {self.sampler_id!r} samples weights of an unnamed save_weights_for_sampler "
                    f"that {SNAPSHOT_SLOTS} later syncs of its model have replaced; save named sampler weights "
                    "(save_weights_for_sampler(path)) to sample them later")
            self.load_frozen(session, self.folder)


@dataclass
class SampleRun:
    """One asample, from its sampler being ready to its outcome in `future`."""

    sampler: Sampler
    session: Session
    request: Sample
    future: concurrent.futures.Future
    work: concurrent.futures.Executor
    submitted: bool = False  # reached the runtime

    def start(self) -> Callable[[], str]:
        self.sampler.ready.add_done_callback(self._ready)
        return self.waiting_for

    def waiting_for(self) -> str:
        return "queued in the runtime" if self.submitted else "the sampling session's model is being loaded"

    def _ready(self, _) -> None:
        if self.sampler.ready.exception() is not None:
            resolve(self.future, Outcome.failed(self.sampler.ready.exception()))
        elif self.sampler.superseded():
            self.work.submit(self._reload_then_run)  # loading a model waits: not on the caller's thread
        else:
            self._run()

    def _reload_then_run(self) -> None:
        try:
            self.sampler.off_reused_slot(self.session)
        except Exception as exc:
            resolve(self.future, Outcome.failed(exc))
            return
        self._run()

    def _run(self) -> None:
        asked = self.request
        api_future = self.sampler.client.sample(asked.prompt, asked.num_samples, asked.params,
                                                include_prompt_logprobs=asked.prompt_logprobs)
        self.submitted = True
        api_future.add_done_callback(self._finished)  # encodes only

    def _finished(self, done: APIFuture) -> None:
        try:
            outcome = Outcome(proto=wire.encode_sample_response(done.result()))
        except Exception as exc:
            outcome = Outcome.failed(exc)
        resolve(self.future, outcome)


class Samplers:
    """The sampling sessions this server holds, by id, and the named sampler checkpoints still in
    a snapshot slot."""

    def __init__(self, cluster, catalog: Catalog, runs: Runs, sessions: Sessions, requests: RequestTable,
                 lock: threading.RLock, work: concurrent.futures.Executor):
        self.cluster = cluster
        self.catalog = catalog
        self.runs = runs
        self.sessions = sessions
        self.requests = requests
        self.lock = lock
        self.work = work
        self.by_id: dict[str, Sampler] = {}
        # (tenant, tinker path) -> (snapshot, its model, its sync number): a named sampler still in a slot
        self.snapshots: dict[tuple[str, str], tuple[StateHandle, Model, int]] = {}

    def owned(self, tenant: str, sampler_id) -> Sampler:
        return owned(self.by_id, tenant, sampler_id, "sampling session")

    def new(self, session: Session, seq: int, base_model: str, model_path: str | None) -> Sampler:
        with self.lock:
            if seq in session.samplers:
                raise errors.InvalidInput(f"sampling_session_seq_id={seq} is already a sampler of session "
                                          f"{session.session_id!r}")
            sampler_id = f"{session.session_id}:sample:{seq}"
            seed_base = _seed(str(seq), model_path.rsplit("/", 1)[-1] if model_path else base_model)
            sampler = Sampler(sampler_id, session.tenant, session.session_id, base_model, model_path, seed_base)
            self.by_id[sampler_id] = sampler
            session.samplers[seq] = sampler_id
        return sampler

    def from_sync(self, session: Session, seq: int, model: Model, synced: tuple[StateHandle, int]) -> Sampler:
        """An unnamed sampler on the snapshot a save_weights_for_sampler just synced."""
        sampler = self.new(session, seq, model.run.base_model, None)
        sampler.on_snapshot(self.cluster, synced[0], model, synced[1])
        sampler.ready.set_result(None)
        return sampler

    def remember(self, tenant: str, path: str, model: Model, synced: tuple[StateHandle, int]) -> None:
        """A named sampler checkpoint whose weights are in a snapshot slot too."""
        with self.lock:
            self.snapshots[(tenant, path)] = (synced[0], model, synced[1])

    def forget_snapshot(self, tenant: str, path: str) -> None:
        with self.lock:
            self.snapshots.pop((tenant, path), None)

    def forget_session(self, session: Session, sampler_ids: list[str]) -> None:
        """Drop a finished session's samplers (call with the lock held)."""
        for sampler_id in sampler_ids:
            self.by_id.pop(sampler_id, None)
        for sampler_id in [s.sampler_id for s in self.by_id.values() if s.session_id == session.session_id]:
            self.by_id.pop(sampler_id, None)

    def create(self, tenant: str, body: CreateSamplingSession) -> concurrent.futures.Future:
        """Direct (not a future): the SDK waits for the id. Returns a future of the JSON answer."""
        session = self.sessions.live(tenant, body.session_id)
        seq = body.sampling_session_seq_id
        with self.lock:
            known = session.samplers.get(seq)
        if known is not None:  # a retried creation
            return _done({"type": "create_sampling_session", "sampling_session_id": known})
        model_path, base_model = body.model_path, body.base_model
        if model_path is not None:
            record = self.runs.checkpoint(tenant, model_path)
            run = self.runs.store.run(tenant, record.run_id)
            base_model = run.base_model if run else base_model
            snapshot = self.snapshots.get((tenant, model_path))
        else:
            self.catalog.folder(base_model)
            record, snapshot = None, None
        sampler = self.new(session, seq, base_model, model_path)

        def build():
            sampler.folder = record.folder if record is not None else None
            if snapshot is not None and not rewritten(*snapshot[1:]):
                sampler.on_snapshot(self.cluster, *snapshot)
            else:
                sampler.load_frozen(session, sampler.folder or self.catalog.folder(base_model))
            sampler.ready.set_result(None)
            return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

        answer = self.work.submit(build)
        answer.add_done_callback(lambda f: f.exception() and not sampler.ready.done()
                                 and sampler.ready.set_exception(f.exception()))
        return answer

    def info(self, tenant: str, sampler_id: str) -> dict:
        sampler = self.owned(tenant, sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def sample(self, tenant: str, request: Sample) -> dict:
        sampler = self.owned(tenant, request.sampling_session_id)
        session = self.sessions.live(tenant, sampler.session_id)
        if request.params.seed is None:
            seed = sampler.next_seed(request.prompt.to_ints(), request.seq_id)
            request = replace(request, params=type(request.params)(**{**request.params.__dict__, "seed": seed}))
        key = ("sample", request.sampling_session_id, request.seq_id) if request.seq_id is not None else None

        def submit(future):
            return SampleRun(sampler, session, request, future, self.work).start()

        request_id, _ = self.requests.enqueue(tenant, session.session_id, key, submit, nbytes=8 * request.prompt.length)
        return {"request_id": request_id,
                "sample_sequence_ids": [f"{request_id}:{i}" for i in range(request.num_samples)]}


def _done(value) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _token_bytes(tokens: list[int]) -> bytes:
    return ",".join(map(str, tokens)).encode()


def _seed(*parts: str) -> int:
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

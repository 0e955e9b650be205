"""The state of `plexrl serve`: tenants' sessions, models, sampling sessions and futures, on one
PlexRL cluster. plexrl/serve/app.py is its HTTP face; this module and the parts it builds know no HTTP.

A Tinker session is a PlexRL job (sessions.py); a Tinker training client is a trainable model
state of that job (models.py, its calls model_calls.py, its saves and loads checkpoints.py); a
sampling session is a sampler snapshot or a frozen model (sampling.py); every request is a
future in the request table (futures.py); runs and checkpoints are read from the store (runs.py).
`TinkerService` builds these parts over one lock and one thread pool, finishes sessions across
them, and runs the reaper.

Invariants:
- what takes time (placing a model, loading a checkpoint) runs on the service's threads, never
  on the caller's;
- everything is looked up with the caller's tenant: another tenant's session, model, sampler,
  future, run or checkpoint is `NotFound`, exactly as one that does not exist;
- finishing a session (by the caller, or by the reaper after `session_timeout_s` without a
  heartbeat) closes its job and drops its models, samplers and requests; a run record is never
  overwritten.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from plexrl.serve.catalog import Catalog
from plexrl.serve.checkpoints import Checkpoints
from plexrl.serve.edge import EdgeLimits
from plexrl.serve.futures import RequestTable
from plexrl.serve.limits import Limits
from plexrl.serve.model_calls import ModelCalls
from plexrl.serve.models import Models
from plexrl.serve.refusals import Unauthorized
from plexrl.serve.runs import Runs
from plexrl.serve.sampling import Samplers
from plexrl.serve.sessions import Session, Sessions
from plexrl.serve.store import Store
from plexrl.serve.tenants import Tenants

log = logging.getLogger("plexrl.serve")


class TinkerService:
    def __init__(self, cluster, store: Store, models: dict[str, str], tenants: Tenants,
                 limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
                 client_flags: dict[str, Any] | None = None, edge: EdgeLimits = EdgeLimits()):
        """`models`: served name -> local Hugging Face folder. `client_flags`: what
        /client/config tells the SDK (empty: its defaults, which this server supports).
        `edge`: what a request's body may be (plexrl/serve/edge.py)."""
        self.catalog = Catalog(models)
        self.cluster = cluster
        self.store = store
        self.tenants = tenants
        limits.validate()
        self.limits = limits
        edge.validate()
        self.edge = edge
        self.clock = clock
        self.client_flags = dict(client_flags or {})
        self._closers: list[Callable[[], None]] = []
        self._lock = threading.RLock()
        self._work = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="plexrl-serve")
        self._build_parts()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="plexrl-serve-reaper", daemon=True)
        self._reaper.start()

    def _build_parts(self) -> None:
        lock, work, clock, limits = self._lock, self._work, self.clock, self.limits
        self.sessions = Sessions(self.cluster, self.store, limits, clock, lock)
        self.requests = RequestTable(limits, clock, lock, self._placer_reason)
        self.models = Models(self.store, self.catalog, self.sessions, self.requests, limits, clock, lock, work)
        self.calls = ModelCalls(self.cluster, self.store, self.models, self.sessions, self.requests, clock, work)
        self.runs = Runs(self.store, on_delete=lambda tenant, path: self.samplers.forget_snapshot(tenant, path))
        self.samplers = Samplers(self.cluster, self.catalog, self.runs, self.sessions, self.requests, lock, work)
        self.checkpoints = Checkpoints(self.calls, self.models, self.samplers, self.sessions, self.runs, limits, work)

    @property
    def pending(self) -> dict:
        """Every request record held, by id."""
        return self.requests.pending

    @property
    def max_sampled_tokens(self) -> int:
        """The most tokens one asample may produce in all (the cluster's limit)."""
        return getattr(getattr(self.cluster, "config", None), "max_sampled_tokens", 1 << 16)

    def on_close(self, closer: Callable[[], None]) -> None:
        """Something to close with the service (the HTTP edge's thread pool)."""
        self._closers.append(closer)

    def close(self) -> None:
        self._stop.set()
        for session in list(self.sessions.values()):
            self.finish(session)
        self._work.shutdown(wait=True, cancel_futures=True)
        for closer in self._closers:
            closer()

    def tenant(self, key: str | None) -> str:
        tenant = self.tenants.tenant_of(key)
        if tenant is None:
            raise Unauthorized("missing or unknown API key; send a key this server knows in the X-API-Key header")
        return tenant

    def finish_session(self, tenant: str, session_id: str) -> dict:
        self.finish(self.sessions.owned(tenant, session_id))
        return {}

    def finish(self, session: Session) -> None:
        """Close the session's job, then drop its models, samplers and requests."""
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
            self.models.forget(model_ids)
            self.samplers.forget_session(session, sampler_ids)
            self.requests.forget_session(session.session_id)
            session.finished_at = self.clock()
        log.info("session %s finished", session.session_id)

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            now = self.clock()
            for session in self.sessions.timed_out(now):
                log.info("session %s sent no heartbeat for %.0f s: finishing it", session.session_id,
                         now - session.last_beat)
                self.finish(session)
            self.models.drain()  # skips a seq_id gap that outlived gap_s
            self.requests.expire(now)
            self.sessions.forget_finished(now)

    def _placer_reason(self, job: str) -> str:
        """Why the placer keeps a job waiting, if it says."""
        try:
            return str(self.cluster.metrics()["placement"][job].get("waiting_reason") or "")
        except Exception:  # a cluster without placement figures: the reason stays general
            return ""

"""The request table of `plexrl serve`: every request a POST enqueued, its future, its natural
key and what it counts against its tenant's limits, until its result is retrieved and retained
long enough.

Invariants:
- a POST only enqueues: it answers with a request id at once, and the result is fetched with
  `retrieve_future` (long-polled);
- a submission repeated with the same natural key ((model_id, seq_id), (session_id,
  model_seq_id), (session_id, sampling_session_seq_id), (sampling_session_id, seq_id)) returns
  the first one's request id and never runs twice;
- what a tenant holds is bounded (`Limits`): requests queued and their payload bytes, request
  records kept (refusals included); past a bound a request is refused (429);
- request ids carry the server's boot token: a restarted server never reuses one;
- a result is kept `retention_s` after it was first retrieved (12 times as long if never), then
  dropped with its natural key.

The table shares the service's lock (methods named "call with the lock held" expect it taken).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from plexrl.api import errors
from plexrl.serve import wire
from plexrl.serve.limits import Limits
from plexrl.serve.refusals import ServeError, TooMany, cut, owned

log = logging.getLogger("plexrl.serve")


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
        return cls(error=cut(f"{type(exc).__name__}: {exc}"), category="server")


def _message(exc: BaseException) -> str:
    if isinstance(exc, FileExistsError):
        return f"checkpoint {exc.args[0]} exists; save under another name or with overwrite=True"
    return cut(str(exc))


def resolve(future: concurrent.futures.Future, outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


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


Submit = Callable[[concurrent.futures.Future], Callable[[], str]]


class RequestTable:
    """Requests by id, their natural keys, and each tenant's counts of queued requests, queued
    bytes and kept records. `why_waiting(job)` is the placer's reason a job waits, if it says."""

    def __init__(self, limits: Limits, clock: Callable[[], float], lock: threading.RLock,
                 why_waiting: Callable[[str], str]):
        self.limits = limits
        self.clock = clock
        self.lock = lock
        self.why_waiting = why_waiting
        self.pending: dict[str, Pending] = {}
        self.keys: dict[tuple, str] = {}  # (tenant, kind, natural key...) -> request id
        self.queued: dict[str, int] = {}  # tenant -> requests submitted and not finished
        self.queued_bytes: dict[str, int] = {}  # tenant -> the payload bytes those hold
        self.kept: dict[str, int] = {}  # tenant -> request records held (pending, queued or finished)
        self._ids = itertools.count(1)
        self._boot = secrets.token_hex(3)  # request ids of this server's life: a restarted server never reuses one

    def known(self, tenant: str, key: tuple | None) -> bool:
        """Whether a request under `key` is held (a retried submission)."""
        with self.lock:
            return key is not None and self.keys.get((tenant, *key)) in self.pending

    def enqueue(self, tenant: str, session_id: str, key: tuple | None, submit: Submit,
                unblocks: bool = False, nbytes: int = 0) -> tuple[str, bool]:
        """A new request (or the one already made under `key`): (request id, whether it is new).
        `submit(future)` starts the work, resolving `future` with an Outcome, and returns what
        tells the request's state; `nbytes` is the payload it holds until it finishes. A request
        that `unblocks` queued ones (the seq_id they wait for) is let in past the tenant's limits
        on queued requests: refusing it would stall them."""
        with self.lock:
            if key is not None:
                known = self.keys.get((tenant, *key))
                if known is not None and known in self.pending:
                    return known, False
            queued, held = self.queued.get(tenant, 0), self.queued_bytes.get(tenant, 0)
            if not unblocks:
                self._check_queue(tenant, queued, held, nbytes)
            self._make_room(tenant)
            pending = self._new_pending(tenant, session_id, nbytes)
            if key is not None:
                self.keys[(tenant, *key)] = pending.request_id
            self.queued[tenant] = queued + 1
            self.queued_bytes[tenant] = held + nbytes
        pending.future.add_done_callback(lambda _: self._finished_one(tenant, nbytes))
        try:
            pending.waiting_for = submit(pending.future)
        except Exception as exc:
            resolve(pending.future, Outcome.failed(exc))
        return pending.request_id, True

    def _check_queue(self, tenant: str, queued: int, held: int, nbytes: int) -> None:
        if queued >= self.limits.queued_per_tenant:
            raise TooMany(f"tenant {tenant!r} has {queued} requests queued, the most this server allows "
                          f"({self.limits.queued_per_tenant}); wait for some to finish")
        if held + nbytes > self.limits.queued_bytes_per_tenant and held:
            raise TooMany(f"tenant {tenant!r} has {held:,} bytes of requests queued and this one adds {nbytes:,}, "
                          f"more than this server holds for a tenant ({self.limits.queued_bytes_per_tenant:,}); "
                          "wait for some to finish")

    def _new_pending(self, tenant: str, session_id: str, nbytes: int) -> Pending:
        """A request record, counted against the tenant's kept records (call with the lock held)."""
        request_id = f"r{next(self._ids)}-{self._boot}{secrets.token_hex(3)}"
        pending = Pending(request_id, tenant, session_id, concurrent.futures.Future(), lambda: "queued", self.clock(),
                          nbytes=nbytes)
        self.pending[request_id] = pending
        self.kept[tenant] = self.kept.get(tenant, 0) + 1
        return pending

    def _make_room(self, tenant: str) -> None:
        """Room for one more of the tenant's records: past `kept_per_tenant` its oldest retrieved
        results go first; with none retrieved, TooMany (call with the lock held)."""
        over = self.kept.get(tenant, 0) + 1 - self.limits.kept_per_tenant
        if over <= 0:
            return
        retrieved = sorted((p.retrieved_at, p.request_id) for p in self.pending.values()
                           if p.tenant == tenant and p.retrieved_at is not None)
        for _, request_id in retrieved[:over]:
            self._drop(request_id)
        if self.kept.get(tenant, 0) + 1 > self.limits.kept_per_tenant:
            raise TooMany(f"tenant {tenant!r} holds {self.kept[tenant]} requests and results not yet retrieved, the "
                          f"most this server keeps ({self.limits.kept_per_tenant}); retrieve or wait for some")

    def _drop(self, request_id: str) -> None:
        """Forget a request record (call with the lock held; its natural key goes with it)."""
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            self.kept[pending.tenant] -= 1

    def _finished_one(self, tenant: str, nbytes: int) -> None:
        with self.lock:
            self.queued[tenant] -= 1
            self.queued_bytes[tenant] -= nbytes

    def failed(self, tenant: str, exc: BaseException) -> str:
        """A request refused before it started (bad input): its future fails with the message
        (cut short). It counts against the tenant's kept records like any other: TooMany past them."""
        with self.lock:
            self._make_room(tenant)
            pending = self._new_pending(tenant, "", 0)
        pending.waiting_for = lambda: "failed"
        pending.future.set_result(Outcome.failed(exc))
        return pending.request_id

    def future(self, tenant: str, request_id: Any) -> Pending:
        return owned(self.pending, tenant, request_id, "request")

    def queue_state(self, pending: Pending) -> tuple[str, str]:
        """A try-again's queue state and reason: what the request waits for, and since when."""
        reason = pending.waiting_for()
        state = "paused_capacity" if "room on the cluster" in reason else "active"
        if state == "paused_capacity":
            placer = self.why_waiting(pending.session_id)
            reason += f": {placer}" if placer else ""
        waited = max(0.0, self.clock() - pending.created)
        since = datetime.fromtimestamp(time.time() - waited, timezone.utc).strftime("%H:%M:%S UTC")
        return state, f"{reason} (since {since}, {waited:.0f} s)"

    def retrieved(self, pending: Pending) -> None:
        """A poll answered the request's result: it is kept `retention_s` more, then dropped."""
        if pending.retrieved_at is None:
            pending.retrieved_at = self.clock()

    def forget_session(self, session_id: str) -> None:
        """Drop a finished session's requests and their keys (call with the lock held)."""
        for request_id in [p.request_id for p in self.pending.values() if p.session_id == session_id]:
            self._drop(request_id)
        self.keys = {k: v for k, v in self.keys.items() if v in self.pending}

    def expire(self, now: float) -> None:
        """Drop the finished requests kept past their retention."""
        keep = self.limits.retention_s
        with self.lock:
            old = [p.request_id for p in self.pending.values() if p.future.done() and (
                (p.retrieved_at is not None and now - p.retrieved_at > keep)
                or (p.retrieved_at is None and now - p.created > 12 * keep))]
            for request_id in old:
                self._drop(request_id)
            if old:
                self.keys = {k: v for k, v in self.keys.items() if v in self.pending}

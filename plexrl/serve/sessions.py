"""Tinker sessions on `plexrl serve`: each is a PlexRL job (placed, admitted, multiplexed and
accounted like any other), opened by `create_session` and kept alive by heartbeats.

Invariants:
- a tenant has at most `sessions_per_tenant` sessions open, counting those being opened;
- session ids come from a counter in the state directory, so they are unique across restarts
  and across servers sharing it;
- a session of another tenant is `NotFound`, as one that does not exist; a finished one is
  `Gone` (410) for `retention_s`, then forgotten (404);
- finishing a session (plexrl/serve/service.py) closes its job and drops its models,
  samplers and requests; `timed_out` names the ones whose heartbeats stopped.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from plexrl.api.client import ServiceClient
from plexrl.api.types import shown
from plexrl.serve.limits import Limits
from plexrl.serve.refusals import Gone, TooMany, owned

log = logging.getLogger("plexrl.serve")


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


class Sessions(Mapping):
    """The sessions this server holds, by id (a read-only mapping), and their lifecycle."""

    def __init__(self, cluster, store, limits: Limits, clock: Callable[[], float], lock: threading.RLock):
        self.cluster = cluster
        self.store = store
        self.limits = limits
        self.clock = clock
        self.lock = lock
        self._by_id: dict[str, Session] = {}
        self._opening: dict[str, int] = {}  # tenant -> sessions being created right now

    def __getitem__(self, session_id: str) -> Session:
        return self._by_id[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def create(self, tenant: str, metadata: dict | None) -> dict:
        with self.lock:
            live = sum(1 for s in self._by_id.values() if s.tenant == tenant and not s.finished)
            live += self._opening.get(tenant, 0)
            if live >= self.limits.sessions_per_tenant:
                raise TooMany(f"tenant {tenant!r} has {live} open sessions, the most this server allows "
                              f"({self.limits.sessions_per_tenant}); finish one first")
            self._opening[tenant] = self._opening.get(tenant, 0) + 1
        try:
            session_id = f"s{self.store.next_number('session')}-{secrets.token_hex(4)}"  # unique across restarts
            client = self.cluster.service_client(session_id)
            session = Session(session_id, tenant, session_id, client, self.clock(), metadata)
            with self.lock:
                self._by_id[session_id] = session
        finally:
            with self.lock:
                self._opening[tenant] -= 1
        log.info("session %s opened for tenant %s", session_id, tenant)
        return {"type": "create_session", "session_id": session_id}

    def owned(self, tenant: str, session_id: Any) -> Session:
        """The tenant's session, finished or not."""
        return owned(self._by_id, tenant, session_id, "session")

    def live(self, tenant: str, session_id: Any) -> Session:
        """The tenant's session, Gone once finished."""
        session = self.owned(tenant, session_id)
        if session.finished:
            raise Gone(f"session {shown(session_id)} has finished")
        return session

    def heartbeat(self, tenant: str, session_id: Any) -> dict:
        self.live(tenant, session_id).last_beat = self.clock()
        return {"type": "session_heartbeat"}

    def timed_out(self, now: float) -> list[Session]:
        """Open sessions without a heartbeat for `session_timeout_s`."""
        return [s for s in list(self._by_id.values())
                if not s.finished and now - s.last_beat > self.limits.session_timeout_s]

    def forget_finished(self, now: float) -> None:
        """A finished session answers 410 for `retention_s`, then 404."""
        keep = self.limits.retention_s
        with self.lock:
            gone = [s.session_id for s in self._by_id.values()
                    if s.finished and s.finished_at is not None and now - s.finished_at > keep]
            for session_id in gone:
                del self._by_id[session_id]

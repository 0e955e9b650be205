"""A group of GPUs that requests compete for, its ready queue, and its gang dispatch.

A request needs its whole gang at once: one replica's `tp` GPUs for a rollout call, or all of
a job's training GPUs for a collective (log-probs, update, weight sync). Whenever GPUs free up
or requests arrive, `select` decides which ready requests start:
  1) rank every ready request by the request policy (`plexrl.policy.priorities`). For the
     switch-aware priority a request's state counts as resident when it is DEVICE-resident on
     every GPU of its gang, and its T_offload is for the bytes its tightest GPU must free;
  2) walk the ranking: a request starts when every GPU of its gang is idle and unclaimed;
     either way its GPUs are claimed, so no lower-ranked request takes them (gang
     reservation: a collective is never starved by a stream of small requests, and one
     scheduler per group cannot deadlock) — except by backfill: a lower-ranked request whose
     idle gang is claimed may start if, by the estimates, it ends before any claimer of its
     GPUs is expected to start (EASY backfilling). A claimed GPU that idles is charged to nobody.
With one ready request every policy picks it; the ranking is only computed when requests
compete, which is where the policies differ.

Invariants (tested): a GPU runs at most one request at a time; a request starts only with its
whole gang; a request starts on a GPU that a higher-ranked waiting request needs only if it
is expected to end before that request is expected to start.
"""

from __future__ import annotations

import numpy as np

from plexrl.policy import Policy, ReadyQueue, offload_estimate, priorities
from plexrl.policy.types import Tier
from plexrl.sim.worker import SimRequest, SimWorker

DEVICE = Tier.DEVICE
_RESIDENT, _NOT_RESIDENT = 0, -1  # `resident_on` values against the gang as device 0


class Group:
    def __init__(self, gid: int, workers: list[SimWorker]):
        self.gid = gid
        self.workers = workers
        self.idle = len(workers)
        self.queue = ReadyQueue(16)
        self.waiting: dict[int, SimRequest] = {}
        self.rollouts: list = []  # elastic rollouts of jobs placed here, in start order (`sim/rollout.py`)
        for w in workers:
            w.group = self

    def add(self, key: int, req: SimRequest, est_s: float, deadline: float = np.inf) -> None:
        """Queue `req`; `deadline`: when its job's slack for the step runs out (the priority's slack term)."""
        lead = req.gang[0]
        nbytes = lead.states[req.state_id].nbytes
        self.queue.add(key, req.arrival, est_s, lead.load_estimate_s(req.state_id), _NOT_RESIDENT, key, nbytes,
                       deadline)
        self.waiting[key] = req

    def pending_states(self, worker: SimWorker) -> set[str]:
        """States with a queued request that needs `worker`."""
        return {r.state_id for r in self.waiting.values() if worker in r.gang}

    def select(self, policy: Policy, now: float) -> list[SimRequest]:
        """The ready requests to start now (removed from the queue), in rank order."""
        queue, n = self.queue, len(self.queue)
        if n == 0 or self.idle == 0:
            return []
        order = (0,) if n == 1 else self._ranking(policy, now)
        deadline: dict[int, float] = {}  # claimed GPU -> when its claimer is expected to start
        chosen: list[int] = []
        taken = 0
        for slot in order:
            key = queue.key_at(int(slot))
            req = self.waiting[key]
            gang = req.gang
            if any(w.busy for w in gang):
                start = max(w.expected_end for w in gang if w.busy)
                self._claim(gang, deadline, max(start, now))
            elif all(w.wid not in deadline for w in gang) or self._fits_before(req, int(slot), deadline, now):
                chosen.append(key)
                self._claim(gang, deadline, now)  # taken: nobody else may use them in this pass
                taken += len(gang)
                if taken == self.idle:
                    break
            else:
                self._claim(gang, deadline, now)  # waits for higher claimers: no backfill here
        for key in chosen:
            queue.remove(key)
        return [self.waiting.pop(key) for key in chosen]

    @staticmethod
    def _claim(gang: tuple[SimWorker, ...], deadline: dict[int, float], start: float) -> None:
        for w in gang:
            deadline.setdefault(w.wid, start)

    def _fits_before(self, req: SimRequest, slot: int, deadline: dict[int, float], now: float) -> bool:
        """Backfill: an idle gang whose GPUs are claimed by higher-ranked requests may start if
        it is expected to end before any of those claimers is expected to start (estimates
        only: the claimers' running GPUs' expected ends and this request's service estimate)."""
        service = self.queue.est[slot]
        if not all(w.states[req.state_id].tier is DEVICE for w in req.gang):
            service += self.queue.load_s[slot]
        limit = min(deadline.get(w.wid, float("inf")) for w in req.gang)
        return now + service <= limit

    def _ranking(self, policy: Policy, now: float) -> np.ndarray:
        queue, n = self.queue, len(self.queue)
        offload_s: float | np.ndarray = 0.0
        if policy is Policy.PLEXRL:
            free = np.empty(n)
            for slot in range(n):
                key = queue.key_at(slot)
                req = self.waiting[key]
                sid = req.state_id
                resident = all(w.states[sid].tier is DEVICE for w in req.gang)
                queue.set_resident(key, _RESIDENT if resident else _NOT_RESIDENT)
                free[slot] = min(w.free_bytes() for w in req.gang)
            offload_s = offload_estimate(queue, free, self.workers[0].bandwidth.bytes_per_s("offload"))
        score = priorities(policy, queue, _RESIDENT, offload_s, now)
        return np.lexsort((queue.seq[:n], -score))

"""A group of GPUs that requests compete for, its ready queue, and its gang dispatch.

A request needs its whole gang at once: one replica's `tp` GPUs for a rollout call, or all of
a job's training GPUs for a collective (log-probs, update, weight sync). Whenever GPUs free up
or requests arrive, `select` decides which ready requests start:
  1) rank every ready request by the request policy (`plexrl.policy.priorities`). For the
     switch-aware priority a request's state counts as resident when it is DEVICE-resident on
     every GPU of its gang, and its T_offload is for the bytes its tightest GPU must free;
  2) walk the ranking: a request starts when every GPU of its gang is idle and unclaimed;
     either way its GPUs are claimed, so no lower-ranked request takes them (conservative gang
     reservation: a collective is never starved by a stream of small requests, and one
     scheduler per group cannot deadlock). A claimed GPU that idles is charged to nobody.
With one ready request every policy picks it; the ranking is only computed when requests
compete, which is where the policies differ.

Invariants (tested): a GPU runs at most one request at a time; a request starts only with its
whole gang; a request never starts on a GPU that a higher-ranked waiting request needs.
"""

from __future__ import annotations

import numpy as np

from plexrl.policy import Policy, ReadyQueue, offload_estimate, priorities
from plexrl.policy.types import Tier
from plexrl.sim.worker import Request, SimWorker

DEVICE = Tier.DEVICE
_RESIDENT, _NOT_RESIDENT = 0, -1  # `resident_on` values against the gang as device 0


class Group:
    def __init__(self, gid: int, workers: list[SimWorker]):
        self.gid = gid
        self.workers = workers
        self.idle = len(workers)
        self.queue = ReadyQueue(16)
        self.waiting: dict[int, Request] = {}
        for w in workers:
            w.group = self

    def add(self, key: int, req: Request, est_s: float) -> None:
        lead = req.gang[0]
        nbytes = lead.states[req.state_id].nbytes
        self.queue.add(key, req.arrival, est_s, lead.load_estimate_s(req.state_id), _NOT_RESIDENT, key, nbytes)
        self.waiting[key] = req

    def pending_states(self, worker: SimWorker) -> set[str]:
        """States with a queued request that needs `worker`."""
        return {r.state_id for r in self.waiting.values() if worker in r.gang}

    def select(self, policy: Policy, now: float) -> list[Request]:
        """The ready requests to start now (removed from the queue), in rank order."""
        queue, n = self.queue, len(self.queue)
        if n == 0 or self.idle == 0:
            return []
        order = (0,) if n == 1 else self._ranking(policy, now)
        claimed: set[int] = set()
        claimed_idle, chosen = 0, []
        for slot in order:
            key = queue.key_at(int(slot))
            gang = self.waiting[key].gang
            startable = True
            for w in gang:
                if w.busy or w.wid in claimed:
                    startable = False
                if w.wid not in claimed:
                    claimed.add(w.wid)
                    claimed_idle += not w.busy
            if startable:
                chosen.append(key)
            if claimed_idle == self.idle:
                break
        for key in chosen:
            queue.remove(key)
        return [self.waiting.pop(key) for key in chosen]

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

"""Elastic rollouts: one turn of a job's generation, decoding on whichever of its replicas it may
use, as the service's router moves its responses between them (ours, after the paper's small-DP
rollouts, Fig. 7c, and RLix's generation that shrinks and grows between jobs).

A pinned rollout (the baselines, and a PlexRL job alone on its GPUs) deals its responses to
its replicas once and waits for the slowest (`latency.decode_shards`). A job that shares its
GPUs instead decodes its turn as one batch spread evenly over the replicas it holds, and that
set changes as its co-tenants' calls and rollouts come and go (`elastic_rollouts.ElasticRollouts.rebalance`,
`policy.share_replicas`): it starts on the replicas no call runs on or waits for (it does not
wait for all of them), grows onto replicas that free up, and gives some up to a co-tenant's
rollout that begins. Device functions are neither preempted by it nor overtaken: a call that
needs a replica a rollout holds waits for that stretch of the rollout (a `RolloutSegment`) to end, at
the turn's end, its consolidation cut or the next sharing out.

Decoding (the same model as `latency`): every live response advances one token per decode
step, and a step on r replicas with n live responses takes `t0 + c * n / r`. With responses
sorted by length L_1 <= ... <= L_N, going from step k1 to k2 takes
    t0 * (k2 - k1) + (c / r) * (tokens(k2) - tokens(k1)),  tokens(k) = sum_i min(L_i, k),
piecewise linear in k, so the step reached after a given time is found exactly
(`Decode.reach`). Once at most `tail_batch * TAIL_REPLICAS` responses are left (the
consolidation cut of `latency.consolidated_shards`), the rollout wants only `TAIL_REPLICAS`
replicas. Moving responses costs what the pinned consolidation charges: a moved response
re-reads its prompt and the tokens decoded so far (`prefill_token_s` per token) on its new
replica, unless its KV cache is still on the replica it stays on (the sampler resident there
since it decoded). The first segment of a turn pays no such cost (prompt prefill is not
modelled, as in `latency`).
"""

from __future__ import annotations

import numpy as np

from plexrl.policy import DecodeModel
from plexrl.sim.latency import TAIL_REPLICAS, JobCosts, tail_cut


class Decode:
    """The decode of one turn's responses: how many are live at a step, and how long steps take."""

    __slots__ = ("lengths", "count", "_prefix", "_tokens_at", "t0", "c")

    def __init__(self, lengths: np.ndarray, costs: JobCosts):
        ordered = np.sort(np.asarray(lengths, dtype=np.float64))
        n = len(ordered)
        self.lengths, self.count = ordered, n
        self._prefix = np.concatenate(([0.0], np.cumsum(ordered)))
        # tokens(L_j): the responses shorter than L_j in full, the rest up to L_j
        self._tokens_at = self._prefix[:-1] + ordered * (n - np.arange(n))
        self.t0, self.c = costs.decode_step_s, costs.decode_seq_s

    @property
    def last(self) -> float:
        """The step at which the longest response ends."""
        return float(self.lengths[-1]) if self.count else 0.0

    def live(self, k: float) -> int:
        """Responses still decoding after `k` steps."""
        return self.count - int(np.searchsorted(self.lengths, k, side="right"))

    def tokens(self, k: float) -> float:
        j = int(np.searchsorted(self.lengths, k, side="right"))
        return float(self._prefix[j] + k * (self.count - j))

    def seconds(self, k1: float, k2: float, replicas: int) -> float:
        """Decoding from step `k1` to `k2` on `replicas` replicas (`reach` inverts it)."""
        return DecodeModel(self.t0, self.c / replicas).seconds(k2 - k1, self.tokens(k2) - self.tokens(k1))

    def reach(self, k1: float, seconds: float, replicas: int, limit: float) -> float:
        """The step reached after decoding `seconds` from `k1` on `replicas` replicas, at most `limit`."""
        if seconds <= 0.0:
            return k1
        if self.seconds(k1, limit, replicas) <= seconds:
            return limit
        per_token = self.c / replicas
        target = self.t0 * k1 + per_token * self.tokens(k1) + seconds
        values = self.t0 * self.lengths + per_token * self._tokens_at  # value of each breakpoint
        j = int(np.searchsorted(values, target, side="left"))  # target lies in (L_{j-1}, L_j]
        base_k, base_v = k1, self.t0 * k1 + per_token * self.tokens(k1)
        if j > 0 and self.lengths[j - 1] > k1:
            base_k, base_v = float(self.lengths[j - 1]), float(values[j - 1])
        slope = self.t0 + per_token * (self.count - j)
        return min(limit, base_k + (target - base_v) / slope)


class RolloutSegment:
    """A stretch of a rollout on a fixed set of replicas, from `start` to at most `end`: its
    sampler loads where it is not resident (`switch_s`), its live responses move (`moving_s`),
    then it decodes from step `k0` towards `k_end`. `token` tells its end event from a stale one."""

    __slots__ = ("units", "start", "switch_s", "moving_s", "k0", "k_end", "end", "token")

    def __init__(self, units, start, switch_s, moving_s, k0, k_end, end, token):
        self.units, self.start, self.switch_s, self.moving_s = units, start, switch_s, moving_s
        self.k0, self.k_end, self.end, self.token = k0, k_end, end, token

    @property
    def decoding_from(self) -> float:
        return self.start + self.switch_s + self.moving_s


class Rollout:
    """One turn of one job's generation, elastic over its replicas (`units`, each a gang of
    workers). `solo_s` is what the turn takes pinned to all of them, alone: what its delay in
    the step is measured against."""

    __slots__ = ("job", "sid", "units", "keys", "decode", "k", "cut", "started", "solo_s", "segment", "kv_units")

    def __init__(self, job, sid: str, units: list[tuple], decode: Decode, started: float, solo_s: float):
        self.job, self.sid, self.units = job, sid, units
        self.keys = [tuple(w.wid for w in unit) for unit in units]  # each unit as `policy.share_replicas` names it
        self.decode = decode
        self.k = 0.0
        # the consolidation cut of the pinned rollout (`latency.consolidated_shards`): None when its
        # replicas are no more than the tail takes or its responses fit the tail
        self.cut = (tail_cut(decode.lengths, job.costs.tail_batch * TAIL_REPLICAS)
                    if len(units) > TAIL_REPLICAS else None)
        self.started, self.solo_s = started, solo_s
        self.segment: RolloutSegment | None = None
        self.kv_units: tuple = ()  # the units its live responses were last spread over

    @property
    def done(self) -> bool:
        return self.k >= self.decode.last

    def want(self) -> int:
        """Replicas it can use: all of them until the consolidation cut, then `TAIL_REPLICAS`."""
        if self.cut is not None and self.k >= self.cut:
            return TAIL_REPLICAS
        return len(self.units)

    def target(self) -> float:
        """Where the next segment stops at the latest: the cut (its want drops there) or the end."""
        if self.cut is not None and self.k < self.cut:
            return self.cut
        return self.decode.last

    def segment_end(self, start: float, switch_s: float, moving_s: float, replicas: int) -> tuple[float, float]:
        """(the step a segment starting at `start` decodes to, when it gets there)."""
        k_end = self.target()
        return k_end, start + switch_s + moving_s + self.decode.seconds(self.k, k_end, replicas)

    def moving_s(self, units: tuple, kept: tuple) -> float:
        """Seconds to move its live responses onto `units` (spread evenly), the ones on `kept`
        (units of its last spread whose sampler still holds their KV cache) staying put."""
        if not self.kv_units:
            return 0.0
        n = self.decode.live(self.k)
        stay = min(n / len(self.kv_units), n / len(units)) * len(kept)
        moved = max(0.0, n - stay)
        prompt = self.job.spec.rollout.prompt_tokens
        return self.job.costs.prefill_token_s * (prompt + self.k) * moved / len(units)

"""Elastic rollouts on the simulated service: the turns of generation that decode on whichever
of their job's replicas no call runs on or waits for (the model of a turn: `rollout.py`).

A job that shares its GPUs (PlexRL, `SimJob.elastic`) runs a sample phase not as one call per
replica but as one `Rollout`, started here (`start`). The replicas of a group are shared out
among its rollouts by `policy.share_replicas` whenever a call or a rollout segment ends or a
rollout begins (`rebalance`); a segment runs non-preemptively to its rollout's consolidation cut
or end, or until the replicas are shared out again, and is charged per GPU when it stops.
Invariants (tested): a rollout never takes a GPU a queued call waits for (it may keep one it
held: calls do not preempt it), and nothing starts on a busy GPU; its segments' busy time goes
into the service's busy intervals and ledger as a call's would.

It runs inside one `SimService` and uses its clock, ledger, busy intervals and recorder, and
its calls' mechanism: a segment's switch-in (`SimService.switch_in`), the dispatch of calls
that a freed replica lets start (`SimService.dispatch`) and the job's controller once a turn
ends (`SimService.advance`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plexrl.policy import share_replicas
from plexrl.policy.types import Tier
from plexrl.sim.group import Group
from plexrl.sim.phases import Phase
from plexrl.sim.rollout import Rollout, RolloutSegment
from plexrl.sim.worker import SimWorker, mark_used

if TYPE_CHECKING:
    from plexrl.sim.service import SimJob, SimService

DEVICE = Tier.DEVICE


class ElasticRollouts:
    """The elastic rollouts in progress on one service, and how the replicas move between them."""

    def __init__(self, service: "SimService"):
        self.service = service
        self.loop, self.ledger, self.busy = service.loop, service.ledger, service.busy
        self.active: dict[Rollout, None] = {}  # elastic rollouts in progress, in start order
        self.segments = 0  # rollout segments started: each end event carries its number

    def finish(self, until: float) -> None:
        """At the horizon: charge the rollouts' segments running then up to it."""
        for rollout in list(self.active):
            seg = rollout.segment
            if seg is not None and seg.start < until:
                self._stop_segment(rollout, max(until, seg.start + seg.switch_s))

    def start(self, job: SimJob, phase: Phase) -> None:
        """A turn of the job's generation begins: it decodes on whichever of its replicas it
        may use (its pinned consolidated tail, the next phase, is part of it)."""
        now = self.loop.now
        solo_s = max(phase.shard_s)
        if job.phase_i < len(job.phases) and job.phases[job.phase_i].fn == "sample_tail":
            solo_s += max(job.phases[job.phase_i].shard_s)
            job.phase_i += 1
        units = job.gangs(phase)
        rollout = Rollout(job, job.state_id(phase.state), units, job.decode(phase.part), now, solo_s)
        job.outstanding, job.phase_start = 1, now
        self.active[rollout] = None
        group = units[0][0].group
        group.rollouts.append(rollout)
        self.rebalance(group)

    def rebalance(self, group: Group) -> None:
        """Share the replicas no call runs on or waits for among the group's rollouts
        (`policy.share_replicas`), and move each rollout whose share changed."""
        now = self.loop.now
        claimed = {w for r in group.waiting.values() for w in r.gang} if group.waiting else set()
        holder: dict[SimWorker, Rollout] = {}
        fixed: list[Rollout] = []  # loading its replicas: keeps them until the load is done
        for rollout in group.rollouts:
            seg = rollout.segment
            if seg is None:
                continue
            if now < seg.start + seg.switch_s:
                fixed.append(rollout)
            for unit in seg.units:
                for w in unit:
                    holder[w] = rollout
        movable = [r for r in group.rollouts if r not in fixed]
        if not movable:
            return
        wants, usable, held, by_key = [], [], [], []
        for rollout in movable:
            keys = {}
            for key, unit in zip(rollout.keys, rollout.units):
                for w in unit:  # it keeps what it holds; takes what is free or another rollout's, unless a call waits
                    owner = holder.get(w)
                    if owner is not rollout and (w in claimed or owner in fixed or (owner is None and w.busy)):
                        break
                else:
                    keys[key] = unit
            by_key.append(keys)
            usable.append(list(keys))
            seg = rollout.segment
            held.append([key for key, unit in zip(rollout.keys, rollout.units) if unit in seg.units]
                        if seg is not None else [])
            wants.append(rollout.want())
        shares = share_replicas(wants, usable, held)
        moves = []
        for rollout, share, mine, keys in zip(movable, shares, held, by_key):
            if set(share) != set(mine):
                moves.append((rollout, tuple(keys[key] for key in share)))
        freed = False  # a replica a call waits for, given up: the call may start
        for rollout, _ in moves:
            if rollout.segment is not None:
                freed = freed or any(w in claimed for unit in rollout.segment.units for w in unit)
                self._stop_segment(rollout, now)
        for rollout, units in moves:
            if units:
                self._start_segment(rollout, units, now)
        if freed:
            self.service.dispatch(group)

    def _start_segment(self, rollout: Rollout, units: tuple, now: float) -> None:
        job, sid = rollout.job, rollout.sid
        kept = tuple(u for u in units if u in rollout.kv_units and all(w.states[sid].tier is DEVICE for w in u))
        own = [0.0 if mark_used(unit, sid, now) else self.service.switch_in(unit, job.name, sid, now) for unit in units]
        switch_s = max(own)
        for unit, unit_s in zip(units, own):  # held while a slower replica of the segment loads
            if unit_s < switch_s:
                for w in unit:
                    self.ledger.charge_transition(job.name, w.wid, "gang_wait", 0, switch_s - unit_s)
        moving_s = rollout.moving_s(units, kept)
        k_end, end = rollout.segment_end(now, switch_s, moving_s, len(units))
        token = self.segments
        self.segments += 1
        rollout.segment = RolloutSegment(units, now, switch_s, moving_s, rollout.k, k_end, end, token)
        gpus = 0
        for unit in units:
            for w in unit:
                w.busy, w.expected_end = True, end
            gpus += len(unit)
        units[0][0].group.idle -= gpus
        job.submitted += len(units)
        self.loop.at(end, self._segment_end, (rollout, token))

    def _stop_segment(self, rollout: Rollout, now: float) -> None:
        """End the rollout's segment at `now` (at or after its load): how far it decoded, and
        the charge for it."""
        seg, job = rollout.segment, rollout.job
        rollout.segment = None
        decoding = now - seg.decoding_from
        if now >= seg.end:
            rollout.k = seg.k_end
        elif decoding > 0:
            rollout.k = rollout.decode.reach(seg.k0, decoding, len(seg.units), seg.k_end)
        if now >= seg.decoding_from:  # its live responses are spread over these replicas now
            rollout.kv_units = seg.units
        exec_s = now - seg.start - seg.switch_s
        usage, device_busy = self.ledger.jobs[job.name], self.ledger.device_busy_s
        gpus = 0
        for unit in seg.units:
            if self.service.record is not None:  # the segment's decode on this replica: a sample call from its start
                self.service.record.call(job.name, rollout.sid, "sample", unit, seg.start, seg.start, seg.switch_s, now)
            for w in unit:
                w.busy = False
                device_busy[w.wid] += exec_s
            usage.exec_s += exec_s * len(unit)
            usage.exec_wall_s += exec_s * len(unit)
            usage.requests += 1
            self.busy.extend((seg.start, now, len(unit)))
            gpus += len(unit)
        seg.units[0][0].group.idle += gpus
        job.served += len(seg.units)

    def _segment_end(self, arg: tuple) -> None:
        rollout, token = arg
        seg = rollout.segment
        if seg is None or seg.token != token:  # stopped earlier, or moved on
            return
        group = seg.units[0][0].group
        self._stop_segment(rollout, self.loop.now)
        if rollout.done:
            self._finish_rollout(rollout)
        else:  # at its consolidation cut: it goes on at once on the replicas it keeps
            self._start_segment(rollout, seg.units[:rollout.want()], self.loop.now)
        if group.waiting:
            self.service.dispatch(group)
        if group.rollouts and short_of_replicas(group.rollouts):
            self.rebalance(group)

    def _finish_rollout(self, rollout: Rollout) -> None:
        job, now = rollout.job, self.loop.now
        group = rollout.units[0][0].group
        group.rollouts.remove(rollout)
        del self.active[rollout]
        job.outstanding = 0
        job.clock.delayed(max(0.0, now - rollout.started - rollout.solo_s))
        self.service.advance(job)


def short_of_replicas(rollouts: list[Rollout]) -> bool:
    """Whether a rollout holds fewer replicas than it wants: only then can GPUs that free up
    change how the group's replicas are shared (a rollout that begins shares them out itself)."""
    for rollout in rollouts:
        seg = rollout.segment
        if seg is None or len(seg.units) < rollout.want():
            return True
    return False

"""The co-tenancy model: how much a job's step slows when it shares devices with others
(docs/design.md §6). Pure functions of `JobProfile`s; the placer judges placements by them
(`judgement.py`), and `plexrl bench cotenancy` measures how well they predict
(docs/benchmarks.md).

The call model (ours), when every profile involved knows its calls (`JobProfile.barriers`,
`residual_s`): non-preemptive sharing. A device runs one call at a time, to its end. Each of
a job's phases (a barrier: its calls must all end before the step moves on) that starts while
a co-tenant's call holds a shared device waits for that call's rest. With the jobs' relative
phases taken as uniform (phase alignment drifts once a wait has moved a job's steps), a
co-tenant k busy with calls of lengths r_i over a period P_k is found mid-call with
probability sum r_i / P_k, and the rest of that call averages sum r_i^2 / (2 sum r_i): the
expected wait per arrival on one of its devices is `residual_s` = sum r_i^2 / (2 P_k)
(mean residual life). A barrier ends with its last call, and a co-tenant's phase holds all
its devices at once (its calls start together), so a barrier that shares one device with k
waits for the rest of k's call as long as one that shares them all: a job j sharing any of
its devices with k slows by
    barriers_j * sum_k residual_s_k / period_j                    (`wait_inflation`)
whatever fraction of its devices it shares. The wait falls on whoever arrives second, so a job
of many short phases (agentic turns) loses more than a fluid split says, and a job of few long
calls with long idle (code with sandboxes) less. Two jobs whose busy shares fit the devices take
turns instead where that slows them less (`_pair_inflations`). With three or more jobs on the
devices a phase also waits for the calls queued ahead of it (`_inflations`, the arrival
theorem). Whatever the waits, no set of jobs is predicted to keep its devices busy more than all
the time (`_conserving`: two jobs busy 75% each run 50% slow or more). Out of scope (first
order): a slowed co-tenant's calls come less often, and the request priority lets short calls
overtake long ones.

Elastic rollouts (the simulator's PlexRL jobs while they share, `sim/rollout.py`): a rollout
turn does not wait for a co-tenant's rollout but takes a share of its replicas, so of a
profile's barriers its rollout turns (`JobProfile.rollout_barriers`) wait only for the rest of
the co-tenant's other calls (`residual_s - rollout_residual_s`), and its seconds on all its
replicas (`rollout_s`) are slowed by the time they meet the co-tenant's (two random intervals
of lengths s_j and s_k in k's period overlap s_j * s_k / P_k on average, and in the overlap the
two split the replicas, so its decoding there takes twice as long): `wait_s`. A co-tenant's
call still waits for a rollout's stretch to end (its segment: `residual_s` counts it). A
profile that names no rollouts (a runtime's measured one, `plexrl-pinned`) is judged by the
pinned model above.

Pooled devices (ours), `Placer(pooled=True)`: the runtime's group scheduler runs a state on
whichever device of its group is free, so a job's co-tenants are every job of its group, and
`pooled_inflation` replaces `wait_inflation`: a phase waits only while the co-tenants' calls
hold all the group's devices (the chance of that from their demand profiles, independent
phases), for the first of those calls to end. Two jobs that run one call at a time never wait
on two devices; a third waits while both others run.

Fallback inflation model (ours), for profiles without calls: fluid processor sharing per
device. In a slot where a device's demand L + d exceeds 1, every busy share on it progresses at
1 / (L + d), so work there stretches by the overload. A job's step is as slow as its most
contended device (its collectives and the end of its rollout wait for every device), so its
inflation is the largest over its devices of
    sum_i d_i * overload_i  /  sum_i d_i.
First order: it ignores that a stretched phase moves the job's later phases.

Invariants (tested in tests/test_placement_cotenancy.py): every answer is a function of the
profiles alone (a memo keyed by them gives the answers of none), and no set of jobs is
predicted to keep its devices busy more than all the time (`_conserving`).
"""

from __future__ import annotations

import functools

import numpy as np

from plexrl.policy.profile import JobProfile

TINY = 1e-9  # devices; overload or demand below this is float residue, not contention


def wait_inflation(profile: JobProfile, tenants, memo: dict | None = None) -> float:
    """Step inflation of `profile`'s job from sharing devices with `tenants`, (profile,
    fraction of the job's devices shared) pairs; a tenant counts whole on any share (see the
    module docstring; each wait is `wait_s`: elastic rollout turns share a tenant's rollouts'
    replicas instead of waiting for them). Jobs whose device
    busy shares sum to at most 1 interleave (each collision pushes the later one into the
    other's idle time) and lock onto the slowest period; others meet at random phases and
    wait for the rest of the call they find, and for the calls of tenants queued ahead
    (`_queued_ahead`). `memo` keeps answers across calls (a placer's: it asks about the same
    sets of jobs in decision after decision); by default one call's."""
    tenants = [tenant for tenant, fraction in tenants if fraction > 0]
    if not tenants:
        return 0.0
    return _inflations((profile, *tenants), {} if memo is None else memo)[0]


_QUEUED_TENANTS = 4  # beyond this many tenants, the first-order wait only (2^n subsystems otherwise)
_MEMO_ENTRIES = 1 << 16  # an `_inflations` memo kept across calls is emptied when it holds this many


def _inflations(jobs: tuple[JobProfile, ...], memo: dict) -> list[float]:
    """Each job's inflation among `jobs`, all on the same devices: `wait_inflation`'s rules.

    Queued ahead (the arrival theorem of closed queueing networks, for one call of each job at a
    time): a phase of job x arriving at the device finds the others as they are in the system
    without x. Each other job k is then mid-call (the rest of its call: `residual_s`, its busy
    share thinned by how much the others slow it there, 1 / (1 + i_k)) or queued, waiting for
    a device (the share i_k / (1 + i_k) of its slowed step), and then x waits for k's whole call
    too (its mean phase, busy / barriers), first come first served. With one co-tenant this is
    the first-order wait. Without the queued term, three tenants on a device are under-predicted
    nearly always: a phase waiting for a second job's call also waits for a third's queued ahead.
    More than `_QUEUED_TENANTS` tenants: the first-order wait only.

    `memo` maps the ids of a set's profiles to (the profiles, their inflations): the answer is a
    function of the profiles alone, and the entry keeps them alive, so no id in its key can
    be another profile's while it stands."""
    key = tuple(map(id, jobs))
    hit = memo.get(key)
    if hit is not None:
        return hit[1]
    if len(jobs) == 1:
        out = [0.0]
    elif len(jobs) == 2:
        out = list(_pair_inflations(*jobs))
    elif interleave(jobs[0], list(jobs[1:])):  # the same for every job of the set
        slowest = max(job.period_s for job in jobs)
        out = [max(0.0, slowest / job.period_s - 1.0) for job in jobs]
    else:
        out = []
        for x, job in enumerate(jobs):
            others = jobs[:x] + jobs[x + 1:]
            if len(others) > _QUEUED_TENANTS:
                out.append(sum(wait_s(job, t) for t in others) / job.period_s)
                continue
            without = _inflations(others, memo)  # the others as x finds them
            wait = sum(wait_s(job, t, 1 / (1 + i), _queued_ahead(t, i)) for t, i in zip(others, without))
            out.append(wait / job.period_s)
    out = _conserving([busy_s(j) / j.period_s for j in jobs], out, 1.0)
    if len(memo) >= _MEMO_ENTRIES:
        memo.clear()
    memo[key] = (jobs, out)
    return out


def _conserving(busy: list[float], inflations: list[float], capacity: float) -> list[float]:
    """`inflations` of jobs that keep `busy` devices busy alone (on average; each on the same
    devices, or a pool of `capacity`), raised where the devices would have to run more than all
    the time: slowed, a job keeps b / (1 + i) of them busy, and those cannot sum past `capacity`.
    Past it every (1 + i) is stretched by the same factor, the sum over `capacity`, so they sum
    to it (two jobs busy 75% each run 50% slow or more, however short their calls)."""
    load = sum(b / (1.0 + i) for b, i in zip(busy, inflations)) / capacity
    if load <= 1.0:
        return inflations
    return [(1.0 + i) * load - 1.0 for i in inflations]


def wait_s(job: JobProfile, tenant: JobProfile, scale: float = 1.0, queued: float = 0.0) -> float:
    """Seconds per step `job` waits for `tenant` on the devices they share: each of its phases
    waits for the rest of the tenant's call it finds running (`residual_s`, times `scale`: the
    share of time the tenant is found running rather than queued) and for the tenant's calls
    queued ahead (`queued`). An elastic rollout turn of the job (`JobProfile.rollout_barriers`)
    does not wait for the tenant's rollouts: it takes a share of their replicas (`sim/rollout.py`,
    `policy.share_replicas`), so it waits only for the rest of the tenant's other calls, and its
    time on all its replicas (`rollout_s`) is slowed while the tenant's rollouts want all theirs
    too (the share of the tenant's step they do, `rollout_s / period_s`): the two then split the
    replicas, and its decoding in that overlap takes twice as long. Without rollouts known (a
    runtime's measured profile, pinned rollouts) this is `barriers * residual_s` (first order)."""
    calls = job.barriers - job.rollout_barriers
    wait = calls * (tenant.residual_s * scale + queued)
    if job.rollout_barriers:
        others = max(0.0, tenant.residual_s - tenant.rollout_residual_s)
        wait += job.rollout_barriers * (others * scale + queued)
        wait += job.rollout_s * tenant.rollout_s / tenant.period_s * scale
    return wait


def least_wait(newcomer: JobProfile, tenant: JobProfile) -> float:
    """A lower bound of what `newcomer` waits per step for `tenant`, with any others: `wait_s`
    first order alone, and with others (`_inflations`) with its rests and overlap scaled by
    s = 1 / (1 + i) and the tenant's mean phase queued ahead for each barrier with weight 1 - s.
    That is linear in s, so over any i >= 0 it is at least the smaller of its ends: the first
    order (s = 1) and every barrier waiting one mean phase (s -> 0)."""
    if tenant.barriers <= 0:
        return wait_s(newcomer, tenant)
    return min(wait_s(newcomer, tenant), newcomer.barriers * _mean_phase_s(tenant))


def _queued_ahead(job: JobProfile, inflation: float) -> float:
    """The expected wait for `job`'s calls queued ahead: the share of its slowed step it waits
    for a device, times its mean phase."""
    if job.barriers <= 0:
        return 0.0
    return inflation / (1 + inflation) * _mean_phase_s(job)


def _mean_phase_s(job: JobProfile) -> float:
    """Seconds of one of the job's phases on a device, on average (busy time per barrier)."""
    return busy_s(job) / job.barriers


def pooled_inflation(profile: JobProfile, tenants, devices: int) -> float:
    """Step inflation of `profile`'s job among `tenants` (profiles) on a pool of `devices` that
    run any tenant's call on whichever is free (a runtime's group scheduler: states float over
    their group's devices). A phase of the job waits only when its co-tenants' calls hold every
    device: with their relative phases uniform, co-tenant k holds n devices with the chance its
    demand profile spends there (a slot of fractional demand d holding floor(d) or floor(d) + 1),
    independently of the others, and the phase waits for the first of the held devices to
    free, the rest of a call of mean `_mean_rest_s` each, as if memoryless (the least of
    several residuals: 1 / sum 1/rest). Two one-call-at-a-time jobs on two devices never wait
    for each other; a third waits only while both others run. First order as `wait_inflation`
    (a phase that needs several devices is taken to wait for one). The jobs together are held to
    the pool's capacity (`_conserving`: three jobs busy 90% each run 35% slow on two devices or
    more, whatever their waits)."""
    tenants = [t for t in tenants if t.busy_device_s > 0]
    if not tenants or profile.barriers <= 0:
        return 0.0
    jobs = [profile, *tenants]
    waits = [_pooled_wait(job, jobs[:k] + jobs[k + 1:], devices) for k, job in enumerate(jobs)]
    return _conserving([j.busy_device_s / j.period_s for j in jobs], waits, float(devices))[0]


def _pooled_wait(profile: JobProfile, tenants: list[JobProfile], devices: int) -> float:
    """`pooled_inflation`'s wait of `profile`'s job for `tenants` (busy ones) to free a device."""
    if profile.barriers <= 0:
        return 0.0
    held = np.ones(1)  # held[n]: chance the co-tenants hold n devices at a random moment
    for tenant in tenants:
        held = np.convolve(held, _occupancy(tenant))
    blocked = float(held[devices:].sum())
    rests = [rest for rest in map(_mean_rest_s, tenants) if rest > 0]
    rest = 1.0 / sum(1.0 / r for r in rests) if rests else 0.0
    return profile.barriers * blocked * rest / profile.period_s


def _occupancy(profile: JobProfile) -> np.ndarray:
    """p[n]: the chance the job's calls hold n devices at a moment of its step drawn uniformly."""
    demand = np.minimum(np.asarray(profile.demand), profile.devices)
    low = np.floor(demand).astype(np.int64)
    frac = demand - low
    p = np.zeros(profile.devices + 2)
    np.add.at(p, low, 1.0 - frac)
    np.add.at(p, low + 1, frac)
    return p[: profile.devices + 1] / len(demand)


def _mean_rest_s(profile: JobProfile) -> float:
    """The mean rest of the job's call found running at a random moment: sum r^2 / (2 sum r)."""
    busy = busy_s(profile)
    return profile.residual_s * profile.period_s / busy if busy > 0 else 0.0


def interleave(profile: JobProfile, tenants: list[JobProfile], margin: float = 0.0) -> bool:
    """Whether the jobs can take turns on their devices: their busy shares sum to at most 1
    (+ `margin`) and, with three or more, for each one the others' busy time per device
    together fits in its longest idle stretch (each of three jobs fitting another's gap alone is
    not enough: three code jobs of 31% busy share whose rollouts each fit a sandbox gap, but
    not two of them, ran 46% slow where pairwise fits predicted 0-11%). Two jobs may take turns
    whenever their shares fit (`_pair_inflations`)."""
    jobs = [profile, *tenants]
    if sum(busy_s(j) / j.period_s for j in jobs) > 1.0 + margin:
        return False
    if len(jobs) == 2:
        return True
    busy = [busy_s(j) for j in jobs]
    total = sum(busy)
    return all(total - mine <= _idle_gap_s(j) for j, mine in zip(jobs, busy))


def _pair_inflations(a: JobProfile, b: JobProfile) -> tuple[float, float]:
    """(a's inflation, b's) when the two share devices. Meeting at random phases, each of a job's
    barriers waits for the rest of the other's call found running (`residual_s`). When their busy
    shares fit the devices (`interleave`) they may take turns instead: each runs its busy time
    while the other idles, and after its longest idle stretch waits for the rest of the other's
    busy time; the faster is held to the slower. Where each busy time fits the other's stretch
    they always take turns (each collision pushes the later one into the other's idle time).
    Where it overflows a little, the pair takes turns when that slows them less than meeting
    at random: two code-7b jobs, each busy ~620 s of a ~1,300 s step around a ~610 s sandbox
    gap, were predicted at 22-26% meeting at random and ran 4-9% slow; taking turns they lock
    at 1-3%."""
    at_random = (wait_s(a, b) / a.period_s, wait_s(b, a) / b.period_s)
    if not interleave(a, [b]):
        return at_random
    a_over, b_over = max(0.0, busy_s(b) - _idle_gap_s(a)), max(0.0, busy_s(a) - _idle_gap_s(b))
    period = max(a.period_s + a_over, b.period_s + b_over)
    turns = (period / a.period_s - 1.0, period / b.period_s - 1.0)
    if a_over <= 0.0 and b_over <= 0.0:
        return turns
    return turns if max(turns) < max(at_random) else at_random


def busy_s(profile: JobProfile) -> float:
    """Seconds per step that one of the job's devices is busy."""
    return profile.busy_device_s / profile.devices


@functools.lru_cache(maxsize=4096)
def _idle_gap_s(profile: JobProfile) -> float:
    """The longest stretch of a step (wrapping into the next) in which the job uses no device."""
    idle = np.asarray(profile.demand) <= TINY
    if idle.all():
        return profile.period_s
    run = best = 0
    for slot_idle in np.concatenate([idle, idle]):
        run = run + 1 if slot_idle else 0
        best = max(best, run)
    return best * profile.slot_s


def knows_calls(profile: JobProfile, tenants: dict[str, tuple[JobProfile, float]]) -> bool:
    return profile.barriers > 0 and all(t.barriers > 0 for t, _ in tenants.values())


def step_inflation(load: np.ndarray, demand: np.ndarray, capacity: float) -> float:
    """Estimated step inflation of a job with `demand` joining `load` on `capacity` devices,
    slot by slot (fluid sharing, see the module docstring)."""
    busy = demand.sum()
    if busy <= 0:
        return 0.0
    overload = np.maximum(load + demand - capacity, 0.0)
    return float((demand * overload).sum() / capacity / busy)


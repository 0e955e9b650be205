"""The placer's co-tenancy model with call moments (`wait_inflation`) and the closed loop
(`Placer.observe`): named cases with the arithmetic written out, and the fallback to fluid
sharing when a profile does not know its calls."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hypothesis import given, settings, strategies as st

from plexrl.policy.placement import Placement, Placer, Wait, cotenancy
from plexrl.policy.placement.cotenancy import pooled_inflation, wait_inflation, wait_s
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import ResourceView

GiB = 2**30


def view(groups: int = 1) -> ResourceView:
    return ResourceView.uniform(1, groups, 1, 2, 10 * GiB, 100 * GiB)


def job(name: str, demand, barriers: int = 0, residual_s: float = 0.0, slack: float = 0.10,
        period_s: float | None = None, **rollouts) -> JobProfile:
    """`rollouts`: `JobProfile.rollout_barriers`, `rollout_residual_s`, `rollout_s` (elastic rollouts)."""
    return JobProfile(name, float(period_s or len(demand)), tuple(demand), 2, (ModelMemory("m", GiB, GiB),), slack,
                      barriers=barriers, residual_s=residual_s, **rollouts)


BUSY = (2, 2, 2, 2, 2, 2, 0, 0)  # busy 6 of 8 s per device: two such jobs cannot take turns
HALF = (2, 2, 2, 0, 0, 0, 0, 0)  # busy 3 of 8 s: next to BUSY the devices would be 112.5% busy
# busy 3 of 8 s in three 1 s calls, longest idle stretch 2 s: two such jobs fit the devices
# (75% busy together), but each one's 3 s overflows the other's idle stretch by 1 s
SCATTERED = (2, 0, 2, 0, 0, 2, 0, 0)
SHORT = (2, 2, 0, 0, 0, 0, 0, 0)  # busy 2 s, idle 6 s: two such jobs take turns
# busy 3 + 3 of 20 s (30%), longest idle stretch 11 s: one other's 6 s fits it, two others' 12 s do not
SPLIT = (2, 2, 2, 0, 0, 0, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
SPLIT_RESIDUAL = (3.0**2 + 3.0**2) / (2 * 20)


WAITS = {
    # name: (job, [(tenant, fraction shared)], expected inflation)
    "alone": (job("a", BUSY, 4, 1.0), [], 0.0),
    # 4 barriers x (1.0 s residual x all devices shared) / 8 s period
    "random phases: each barrier waits the tenant's mean residual": (
        job("a", BUSY, 4, 1.0), [(job("b", HALF, 3, 1.0), 1.0)], 4 * 1.0 / 8),
    # a barrier waits for its last call: one shared device holds it up as long as all of them
    "half the devices shared: the whole wait": (
        job("a", BUSY, 4, 1.0), [(job("b", HALF, 3, 1.0), 0.5)], 4 * 1.0 / 8),
    "a tenant on none of the devices does not count": (
        job("a", BUSY, 4, 1.0), [(job("b", BUSY, 3, 1.0), 0.0)], 0.0),
    # without a, b waits for c: 3 x 2.0 / 8 = 75%, c for b 3 x 1.0 / 8 = 37.5%. a finds each mid-call
    # (its residual thinned by that slowdown) or queued (75% / 175% of b's step, then b's whole 6 / 3 s
    # phase; 37.5% / 137.5% of c's, then c's 3 / 3 s)
    "two tenants add up, and one queued ahead is waited for whole": (
        job("a", BUSY, 4, 1.0), [(job("b", BUSY, 3, 1.0), 1.0), (job("c", HALF, 3, 2.0), 1.0)],
        4 * (1.0 / 1.75 + 0.75 / 1.75 * 2.0 + 2.0 / 1.375 + 0.375 / 1.375 * 1.0) / 8),
    # waits of 4 x 0.1 / 8 = 5% each would have the devices busy 75% / 105% x 2 = 143% of the time:
    # each (1 + i) stretches to the devices' capacity, 1.05 x 1.43 = 1.5
    "two near-always-busy jobs are held to the devices' capacity": (
        job("a", BUSY, 4, 0.1), [(job("b", BUSY, 4, 0.1), 1.0)], 0.75 + 0.75 - 1),
    # meeting at random: 3 x 1.0 / 8 = 37.5% each; taking turns each waits 1 s a step: 9 / 8 - 1
    "two that fit take turns where turns cost less than meeting at random": (
        job("a", SCATTERED, 3, 1.0), [(job("b", SCATTERED, 3, 1.0), 1.0)], 9 / 8 - 1),
    # short calls: meeting at random costs 3 x 0.1 / 8 = 3.75%, less than turns' 12.5%
    "and meet at random where that costs less": (
        job("a", SCATTERED, 3, 0.1), [(job("b", SCATTERED, 3, 0.1), 1.0)], 3 * 0.1 / 8),
    # busy 2 s each, idle stretch 6 s: they take turns and the faster one locks onto the slower's period
    "interleaving jobs lock onto the slower period": (
        job("a", SHORT, 2, 1.0), [(job("b", SHORT, 2, 1.0, period_s=10.0), 1.0)], 10.0 / 8 - 1),
    "the slower of two interleaving jobs is not slowed": (
        job("a", SHORT, 2, 1.0, period_s=10.0), [(job("b", SHORT, 2, 1.0), 1.0)], 0.0),
    "two split-phase jobs take turns": (
        job("a", SPLIT, 2, SPLIT_RESIDUAL), [(job("b", SPLIT, 2, SPLIT_RESIDUAL), 1.0)], 0.0),
    # elastic rollouts: a's 2 calls wait b's whole 1.0 s residual, its 2 turns only the 0.4 s of
    # b's calls that are not rollouts, and its 2 s on all replicas meet b's (2 s of b's 8 s step)
    "an elastic turn does not wait for a tenant's rollout, it shares the replicas": (
        job("a", BUSY, 4, 1.0, rollout_barriers=2, rollout_residual_s=0.5, rollout_s=2.0),
        [(job("b", HALF, 3, 1.0, rollout_barriers=1, rollout_residual_s=0.6, rollout_s=2.0), 1.0)],
        (2 * 1.0 + 2 * (1.0 - 0.6) + 2.0 * 2.0 / 8) / 8),
    "pinned rollouts (none named) wait for everything": (
        job("a", BUSY, 4, 1.0), [(job("b", HALF, 3, 1.0, rollout_barriers=1, rollout_residual_s=0.6,
                                      rollout_s=2.0), 1.0)], 4 * 1.0 / 8),
    # 90% busy together, but no job's idle stretch holds both others' busy time: random phases
    "three do not, though each pair would": (
        job("a", SPLIT, 2, SPLIT_RESIDUAL),
        [(job("b", SPLIT, 2, SPLIT_RESIDUAL), 1.0), (job("c", SPLIT, 2, SPLIT_RESIDUAL), 1.0)],
        2 * (2 * SPLIT_RESIDUAL) / 20),
}


@pytest.mark.parametrize("name", WAITS)
def test_wait_inflation_table(name):
    profile, tenants, expected = WAITS[name]
    assert wait_inflation(profile, tenants) == pytest.approx(expected)


@st.composite
def call_profiles(draw, name: str) -> JobProfile:
    period = draw(st.sampled_from([4, 8, 12]))
    demand = tuple(draw(st.lists(st.integers(0, 2), min_size=period, max_size=period)))
    barriers = draw(st.integers(1, 6))  # the call model reads only profiles that know their calls
    residual = draw(st.floats(0.0, 3.0))
    rollouts = {}
    if draw(st.booleans()):
        rollouts = {"rollout_barriers": draw(st.integers(0, barriers)),
                    "rollout_residual_s": residual * draw(st.floats(0.0, 1.0)),
                    "rollout_s": period * draw(st.floats(0.0, 1.0))}
    return job(name, demand, barriers, residual, **rollouts)


@settings(max_examples=300, deadline=None)
@given(call_profiles("x"), call_profiles("t"), st.floats(0.0, 50.0))
def test_least_wait_bounds_every_wait_the_model_can_give(newcomer, tenant, inflation):
    """`_least_wait`, which the refusal without a search rests on, is no more than the wait of
    the first-order model nor of the queued-ahead one at any tenant inflation."""
    least = cotenancy.least_wait(newcomer, tenant)
    assert least <= wait_s(newcomer, tenant) + 1e-9
    queued = cotenancy._queued_ahead(tenant, inflation)
    assert least <= wait_s(newcomer, tenant, 1 / (1 + inflation), queued) + 1e-9



@settings(max_examples=60, deadline=None)
@given(st.lists(call_profiles("j"), min_size=2, max_size=6), st.integers(0, 2**16))
def test_a_memo_kept_across_calls_answers_as_a_fresh_one(profiles, seed):
    """A placer keeps `wait_inflation`'s memo across its decisions (keyed by the profiles'
    ids). Its answers equal a fresh computation's for every set asked, also when profiles that
    were asked about are dropped and new ones (which may be given their ids) are asked about,
    and across the memo emptying when full."""
    import random

    rng = random.Random(seed)
    memo: dict = {}
    for round_ in range(4):
        # new profiles each round, made after the last round's are dropped: CPython hands them
        # the freed ids (the memo's entries keep the profiles they were asked about alive)
        asked = [replace(p, job=f"j{i}", residual_s=p.residual_s * (1 + round_), rollout_residual_s=0.0)
                 for i, p in enumerate(profiles)]
        orders = [rng.sample(range(len(asked)), rng.randint(2, len(asked))) for _ in range(6)]
        for order in orders + orders:
            first, *tenants = (asked[i] for i in order)
            assert wait_inflation(first, [(t, 1.0) for t in tenants], memo) == \
                wait_inflation(first, [(t, 1.0) for t in tenants])
        del asked, first, tenants


def test_a_memo_kept_across_calls_is_emptied_when_full(monkeypatch):
    monkeypatch.setattr(cotenancy, "_MEMO_ENTRIES", 3)
    a, b, c = job("a", BUSY, 4, 1.0), job("b", HALF, 3, 1.0), job("c", SHORT, 2, 0.5)
    memo: dict = {}
    expected = wait_inflation(a, [(b, 1.0), (c, 1.0)])
    assert wait_inflation(a, [(b, 1.0), (c, 1.0)], memo) == expected
    assert len(memo) <= 3
    assert wait_inflation(a, [(b, 1.0), (c, 1.0)], memo) == expected

def test_rollout_figures_beyond_the_calls_are_clear_errors():
    for bad, says in (({"rollout_barriers": 5}, "rollout_barriers must lie in [0, barriers=4]"),
                      ({"rollout_residual_s": 2.0}, "rollout_residual_s must lie in [0, residual_s=1.0]"),
                      ({"rollout_s": 9.0}, "rollout_s must lie in [0, period_s=8.0]")):
        with pytest.raises(ValueError, match=re.escape(says)):
            job("a", BUSY, 4, 1.0, **bad)


def test_admission_uses_the_call_model_when_every_profile_knows_its_calls():
    placer = Placer(view(), horizon_slots=64, slot_s=1.0)
    assert isinstance(placer.place(job("a", SCATTERED, 4, 0.1), 0.0), Placement)
    # fluid sharing sees b's busy slots dovetail with a's at a shift and predicts 0; each of b's
    # 4 barriers may find a's call running (residual 0.1 s): 4 x 0.1 s / 8 s = 5%
    decision = placer.place(job("b", SCATTERED, 4, 0.1), 0.0)
    assert isinstance(decision, Placement) and decision.inflation == pytest.approx(0.05)
    assert placer.inflation_of("a") == pytest.approx(0.05)
    fluid = Placer(view(), horizon_slots=64, slot_s=1.0)
    fluid.place(job("a", SCATTERED), 0.0)
    decision = fluid.place(job("b", SCATTERED), 0.0)
    assert isinstance(decision, Placement) and decision.inflation == 0.0
    # two jobs busy 6 of 8 s cannot both run 5% slow, short calls or not: the devices would be
    # busy 143% of the time (`wait_inflation`'s capacity bound: 50% each, beyond 10%)
    busy = Placer(view(), horizon_slots=64, slot_s=1.0)
    busy.place(job("a", BUSY, 4, 0.1), 0.0)
    decision = busy.place(job("b", BUSY, 4, 0.1), 0.0)
    assert isinstance(decision, Wait) and "would be slowed by 50%" in decision.reason


def test_long_calls_make_a_newcomer_wait():
    placer = Placer(view(), horizon_slots=64, slot_s=1.0)
    placer.place(job("a", BUSY, 4, 1.0), 0.0)
    decision = placer.place(job("b", BUSY, 4, 1.0), 0.0)  # 4 x 1.0 / 8 = 50%
    assert isinstance(decision, Wait) and "slowed by 50%" in decision.reason


def test_a_tenant_measured_past_its_slack_takes_nobody_onto_its_devices():
    placer = Placer(view(), horizon_slots=64, slot_s=1.0)
    placer.place(job("a", SCATTERED, 4, 0.1), 0.0)
    newcomer = job("b", SCATTERED, 4, 0.1, slack=1.0)
    assert isinstance(placer.decide(newcomer, 0.0), Placement)  # predicted: a 5% slow with b, within 10%
    placer.observe("a", 0.12)  # a runs 12% slow (measured): beyond its 10% slack
    decision = placer.decide(newcomer, 0.0)
    assert isinstance(decision, Wait) and "would slow job 'a'" in decision.reason


def test_a_measured_tenant_stays_measured_when_it_is_reprofiled_or_refused_a_move():
    """What a job was measured at where it runs holds while it stays there: a new profile of it
    (`reprofile`), or a re-placement that finds no better place (`replace` -> Wait), keeps
    admission judging its devices by the measurement, not by the model's prediction again."""
    newcomer = job("b", SCATTERED, 4, 0.1, slack=1.0)
    for keep in ("reprofile", "replace"):
        placer = Placer(view(), horizon_slots=64, slot_s=1.0)
        placer.place(job("a", SCATTERED, 4, 0.1), 0.0)
        assert isinstance(placer.decide(newcomer, 0.0), Placement)  # predicted: a 5% slow with b
        placer.observe("a", 0.08)  # a runs 8% slow alone (measured): with b's 5 points, past its 10%
        if keep == "reprofile":
            placer.reprofile(job("a", SCATTERED, 4, 0.1))
        else:  # too big for any group now: it keeps its place
            huge = replace(job("a", SCATTERED, 4, 0.1), models=(ModelMemory("m", 20 * GiB, GiB),))
            assert isinstance(placer.replace(huge, 0.0), Wait)
        decision = placer.decide(newcomer, 0.0)
        assert isinstance(decision, Wait) and "would slow job 'a'" in decision.reason, keep


def test_a_tenant_measured_under_its_prediction_makes_room():
    placer = Placer(view(), horizon_slots=64, slot_s=1.0)
    placer.place(job("a", SCATTERED, 4, 0.1, slack=0.12), 0.0)
    placer.place(job("b", SCATTERED, 4, 0.1, slack=1.0), 0.0)  # a predicted at 5%
    # with c, a finds b and c each mid-call (0.1 s thinned by the 5% they slow each other) or queued
    # (5% / 105% of the time, then a whole 0.75 s phase): 4 x (2 x 0.1 / 1.05 + 2 x 0.05 / 1.05 x 0.75) / 8
    third = job("c", SCATTERED, 4, 0.1, slack=1.0)
    with_c = 4 * (2 * 0.1 / 1.05 + 2 * 0.05 / 1.05 * 0.75) / 8
    assert with_c == pytest.approx(0.131, abs=1e-3)
    assert wait_inflation(placer.profile_of("a"), [(placer.profile_of("b"), 1.0), (third, 1.0)]) == pytest.approx(with_c)
    assert isinstance(placer.decide(third, 0.0), Wait)  # would add 8.1 points: 13.1% > a's 12%
    placer.observe("a", 0.01)  # measured: 1%, so 1% + 8.1% fits its 12%
    assert isinstance(placer.decide(third, 0.0), Placement)


def ending(profile: JobProfile) -> JobProfile:
    """The job with a known length (`JobProfile.ends`), as the simulator's jobs and a runtime job
    that declared its steps."""
    return replace(profile, ends=True)


def test_a_pack_limit_caps_the_slack_a_shared_placement_of_jobs_that_end_is_judged_by():
    """`pack_limit` (an option, off by default; e.g. `PACKING_PAYS`): a job tolerating a doubled step is still not placed
    where it would be slowed by more than the limit, nor where it would slow a tenant by more,
    when both end; within the limit nothing changes, and a job alone is never refused."""
    from plexrl.policy.placement import PACKING_PAYS

    assert PACKING_PAYS == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="pack_limit must be >= 0"):
        Placer(view(), 64, 1.0, pack_limit=-1.0)
    assert Placer(view(), 64, 1.0).pack_limit is None
    free, capped = Placer(view(), 64, 1.0), Placer(view(), 64, 1.0, pack_limit=PACKING_PAYS)
    for placer in (free, capped):
        assert isinstance(placer.place(ending(job("a", BUSY, 4, 1.0, slack=1.0)), 0.0), Placement)  # alone: 0%
    newcomer = ending(job("b", BUSY, 4, 1.0, slack=1.0))  # 4 barriers x 1.0 s / 8 s = 50% each way
    assert isinstance(free.decide(newcomer, 0.0), Placement)
    decision = capped.decide(newcomer, 0.0)
    assert isinstance(decision, Wait)
    assert "slowed by 50%" in decision.reason and "its slack is 100%" in decision.reason and "33%" in decision.reason
    light = ending(job("c", BUSY, 4, 0.5, slack=1.0))  # slowed 4 x 1.0 / 8 = 50% by a or more; slows a by 25% or more
    assert isinstance(capped.decide(light, 0.0), Wait)
    small = ending(job("d", HALF, 1, 0.5, slack=1.0))  # slowed 1 x 1.0 / 8 = 12.5%, slows a by 4 x 0.5 / 8 = 25%
    assert isinstance(capped.decide(small, 0.0), Placement)
    tiny_tenant = Placer(view(), 64, 1.0, pack_limit=0.2)
    tiny_tenant.place(ending(job("a", BUSY, 4, 1.0, slack=1.0)), 0.0)
    decision = tiny_tenant.decide(small, 0.0)  # a would be at 25% > 20%: a's sake
    assert isinstance(decision, Wait) and "would slow job 'a'" in decision.reason


def test_the_pack_limit_never_keeps_a_job_waiting_on_an_open_ended_one():
    """The limit's premise is that the tenant waited for finishes: next to an open-ended tenant
    (a service session) a newcomer that ends is judged by its own slack, and so is the tenant;
    an open-ended newcomer is judged by its own slack next to anyone, and so are its tenants."""
    from plexrl.policy.placement import PACKING_PAYS

    session = Placer(view(), 64, 1.0, pack_limit=PACKING_PAYS)
    session.place(job("s", BUSY, 4, 1.0, slack=1.0), 0.0)  # open-ended: `ends` False
    assert isinstance(session.decide(ending(job("b", BUSY, 4, 1.0, slack=1.0)), 0.0), Placement)  # 50% <= 100%
    finite = Placer(view(), 64, 1.0, pack_limit=PACKING_PAYS)
    finite.place(ending(job("a", BUSY, 4, 1.0, slack=1.0)), 0.0)
    assert isinstance(finite.decide(ending(job("b", BUSY, 4, 1.0, slack=1.0)), 0.0), Wait)  # both end: 50% > 33%
    assert isinstance(finite.decide(job("b", BUSY, 4, 1.0, slack=1.0), 0.0), Placement)  # b open-ended: 50% <= 100%
    released = Placer(view(), 64, 1.0, pack_limit=PACKING_PAYS)
    released.place(job("s", BUSY, 4, 1.0, slack=1.0), 0.0)
    released.release("s")  # the open-ended job left: the limit holds again
    released.place(ending(job("a", BUSY, 4, 1.0, slack=1.0)), 0.0)
    assert isinstance(released.decide(ending(job("b", BUSY, 4, 1.0, slack=1.0)), 0.0), Wait)


def test_observations_of_a_released_job_are_forgotten():
    placer = Placer(view(), horizon_slots=64, slot_s=1.0)
    placer.place(job("a", SCATTERED, 4, 0.1), 0.0)
    placer.observe("a", 0.5)
    placer.release("a")
    placer.place(job("a", SCATTERED, 4, 0.1), 0.0)
    assert isinstance(placer.decide(job("b", SCATTERED, 4, 0.1), 0.0), Placement)


def test_profiles_without_calls_keep_fluid_sharing():
    with_calls, without = Placer(view(), 64, 1.0), Placer(view(), 64, 1.0)
    with_calls.place(job("a", BUSY, 4, 0.1), 0.0)
    without.place(job("a", BUSY), 0.0)
    mixed = with_calls.decide(replace(job("b", BUSY), slack=1.0), 0.0)  # b does not know its calls
    fluid = without.decide(replace(job("b", BUSY), slack=1.0), 0.0)
    assert mixed == fluid


# -- pooled devices (the runtime: a group's states run on whichever of its devices is free) ------

def one(name: str, busy: int, period: int = 10, call_s: float = 1.0, slack: float = 0.10) -> JobProfile:
    """A one-call-at-a-time job: `busy` of `period` s busy, in calls of `call_s` (one device)."""
    demand = (1.0,) * busy + (0.0,) * (period - busy)
    calls = busy / call_s
    return JobProfile(name, float(period), demand, 1, (ModelMemory("m", GiB, GiB),), slack,
                      barriers=int(calls), residual_s=calls * call_s**2 / (2 * period))


POOLED = {
    # name: (job, tenants, devices, expected)
    "alone": (one("a", 5), [], 2, 0.0),
    "two one-call jobs on two devices never wait": (one("a", 5), [one("b", 9)], 2, 0.0),
    # a waits only while b and c both run: 0.5 x 0.5; then for the first of their calls to end:
    # each has 0.5 s of its 1 s call left on average, the first of two 1 / (1/0.5 + 1/0.5) = 0.25 s;
    # 5 phases per 10 s step
    "a third waits while both others run": (one("a", 5), [one("b", 5), one("c", 5)], 2, 5 * 0.25 * 0.25 / 10),
    # one device: a waits whenever b runs (half the time), for the rest of b's 2 s calls (1 s)
    "one device": (one("a", 5), [one("b", 5, call_s=2.0)], 1, 5 * 0.5 * 1.0 / 10),
    # each waits 9 x (0.9 x 0.9) x 0.25 / 10 = 18%, but 3 x 90% busy / 1.18 would be 2.28 devices
    # of 2: held to the pool, 2.7 / 2 - 1
    "three near-always-busy jobs are held to two devices": (one("a", 9), [one("b", 9), one("c", 9)], 2, 2.7 / 2 - 1),
}


@pytest.mark.parametrize("name", POOLED)
def test_pooled_inflation_table(name):
    profile, tenants, devices, expected = POOLED[name]
    assert pooled_inflation(profile, tenants, devices) == pytest.approx(expected)


def test_a_pooled_placer_counts_every_job_of_the_group():
    """Pinned, jobs on different devices of a group do not meet; pooled, they do, and the
    prediction is the pooled model's over the group's devices."""
    pooled, pinned = Placer(view(), 64, 1.0, pooled=True), Placer(view(), 64, 1.0)
    for placer in (pooled, pinned):
        for name in "abc":
            assert isinstance(placer.place(one(name, 5, slack=1.0), 0.0), Placement)
    assert pooled.inflation_of("a") == pytest.approx(POOLED["a third waits while both others run"][3])
    assert pinned.inflation_of("a") != pooled.inflation_of("a")


def test_reprofile_keeps_the_place_and_judges_by_the_new_profile():
    placer = Placer(view(), 64, 1.0, pooled=True)
    placed = placer.place(one("a", 5, slack=1.0), 0.0)
    placer.place(one("b", 5, slack=1.0), 0.0)
    placer.reprofile(one("a", 9, slack=1.0))
    assert placer.placements()["a"] == placed and placer.profile_of("a").busy_device_s == 9.0
    with pytest.raises(ValueError, match="needs a re-placement"):
        placer.reprofile(replace(job("a", BUSY), slack=1.0))  # 2 devices where it has 1


def test_a_forecast_averages_over_the_steps_it_predicts():
    """`Forecast`: the mean of a step function over the job's steps (dt seconds at inflation x
    hold dt / (1 + x) of them), as the realised slowdown is a mean over steps; a stretch with None
    (the runtime holding a guess) counts neither way, and a forecast never given a value has none."""
    from plexrl.policy import Forecast

    f = Forecast(0.0)
    f.update(0.0, None, False)
    f.update(2.0, 0.5, True)  # [0, 2): no prediction
    f.update(5.0, 0.0, True)  # [2, 5) at 0.5: 2 steps' worth of its time alone
    assert f.mean(7.0) == pytest.approx((0.5 * 2 + 0.0 * 2) / 4)  # [5, 7) at 0: 2 more
    f.close(6.0)
    assert f.mean(100.0) == pytest.approx(0.5 * 2 / 3)
    never = Forecast(0.0)
    never.update(0.0, None, False)
    assert never.mean(5.0) is None
    plain = Forecast(1.0)  # the simulator's use: a value from the start
    plain.update(3.0, 1.0, False)  # [1, 3) at 0: 2 steps' worth; then 1.0 for [3, 7): 2 more
    assert plain.mean(7.0) == pytest.approx(1.0 * 2 / 4)
    steady = Forecast(0.0)
    steady.update(0.0, 0.3, True)
    assert steady.mean(10.0) == pytest.approx(0.3)

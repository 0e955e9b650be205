"""Packing by effect (`placement/judgement.py`): a placement that shares devices is taken only
when it lowers the summed completion time of the jobs involved, weighed per decision from their
profiles; the operator's fixed pack limit stays an option. Named cases with the arithmetic
written out, on one device set of two devices.

Every case: tenant `a` and newcomer `b` are BUSY jobs (busy 6 of 8 s, 4 phases of mean
residual 1.0 s) on the same two devices: each slows the other by 4 x 1.0 / 8 = 50% (the call
model), within a slack of 100%. With L the newcomer's run left and R the tenant's, sharing
costs 0.5 L + 0.5 R of completion time and waiting costs the newcomer R: it shares when
R > 0.5 L + 0.5 R, i.e. R > L."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plexrl.policy.placement import PACKING_PAYS, Placement, Placer, Wait
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import ResourceView

GiB = 2**30
BUSY = (2, 2, 2, 2, 2, 2, 0, 0)


def view() -> ResourceView:
    return ResourceView.uniform(1, 1, 1, 2, 10 * GiB, 100 * GiB)


def job(name: str, steps: int, slack: float = 1.0) -> JobProfile:
    """A BUSY job of `steps` steps of 8 s (its run: 8 x steps s alone); steps 0: not declared."""
    return JobProfile(name, 8.0, BUSY, 2, (ModelMemory("m", GiB, GiB),), slack, barriers=4, residual_s=1.0,
                      ends=steps > 0, steps=steps)


def placer(**options) -> Placer:
    return Placer(view(), horizon_slots=64, slot_s=1.0, **options)


def with_tenant(steps: int = 100, **options) -> Placer:
    p = placer(**options)
    assert isinstance(p.place(job("a", steps), 0.0), Placement)
    return p


CASES = {
    # name: (tenant's steps, when the newcomer asks, newcomer's steps, shares?)
    # L = 80 s, R = 800 s: 0.5 x 80 + 0.5 x 800 = 440 s of slowing < 800 s of waiting
    "a short newcomer shares with a long tenant": (100, 0.0, 10, True),
    # L = 800 s, R = 800 s: 400 + 400 = 800 s of slowing, not less than 800 s of waiting
    "a newcomer as long as the tenant waits": (100, 0.0, 100, False),
    # L = 80 s, R = 100 s: 40 + 50 = 90 s < 100 s
    "late in the tenant's run, a shorter newcomer still shares": (100, 700.0, 10, True),
    # L = 80 s, R = 48 s: 40 + 24 = 64 s > 48 s: better to wait for the tenant to leave
    "a tenant about to leave is waited for": (100, 752.0, 10, False),
}


@pytest.mark.parametrize("name", CASES)
def test_sharing_is_decided_by_its_effect(name):
    tenant_steps, now, steps, shares = CASES[name]
    p = with_tenant(tenant_steps)
    decision = p.decide(job("b", steps), now)
    assert isinstance(decision, Placement if shares else Wait), decision
    if not shares:
        assert "would cost the jobs involved" in decision.reason and "waiting" in decision.reason
    else:
        assert decision.inflation == pytest.approx(0.5)


def test_the_effect_is_the_arithmetic_of_the_docstring():
    p = with_tenant(100)
    p.decide(job("b", 10), 700.0)  # sets the decision's time
    rows = [p.view.device_rows[d] for d in p.placements()["a"].devices]
    share = p.search.shifted_share(job("b", 10), 700.0, p.search.shift_slots(job("b", 10)))[0]
    cost, wait = p.judgement.effect(job("b", 10), rows, 0.5, share)
    assert cost == pytest.approx(0.5 * 80 + 0.5 * 100) and wait == pytest.approx(100)


def test_a_measured_slow_tenant_is_waited_for_longer():
    """What is left of a tenant's run is its work left (elapsed over 1 + its inflation), at the
    speed it runs at now: a tenant measured 100% slow at 400 s has done 200 s of its 800 s, and
    holds its devices 2 x 600 s more; sharing costs 0.5 x 80 + 0.5 x 600 = 340 s < 1,200 s."""
    p = placer()
    p.place(job("a", 100, slack=2.0), 0.0)  # 100% measured + 50% more stays within its 200%
    p.observe("a", 1.0)
    p.judgement.now = 400.0
    assert p.judgement.left_s("a", job("a", 100), 1.0) == pytest.approx(600)
    assert isinstance(p.decide(job("b", 10), 400.0), Placement)


def test_runs_not_declared_leave_the_decision_to_the_slack():
    """A newcomer or a tenant without declared steps (a service session, a runtime job's profile):
    no effect is weighed, and the slack alone decides (50% within 100%)."""
    assert isinstance(with_tenant(100).decide(job("b", 0), 0.0), Placement)
    assert isinstance(with_tenant(0).decide(job("b", 100), 0.0), Placement)


def test_without_the_effect_rule_each_job_is_judged_by_its_slack_alone():
    p = with_tenant(100, by_effect=False)
    assert isinstance(p.decide(job("b", 100), 0.0), Placement)  # the case the effect rule makes wait
    assert isinstance(with_tenant(100).decide(job("b", 100, slack=0.4), 0.0), Wait)  # 50% > 40%: slack first


def test_the_operators_pack_limit_is_still_honoured():
    """`pack_limit` (off by default): a job that ends is judged by at most the limit, effect rule or
    not; a share the effect rule takes is refused at 50% > 1/3."""
    assert placer().pack_limit is None and placer().by_effect
    for by_effect in (True, False):
        capped = with_tenant(100, pack_limit=PACKING_PAYS, by_effect=by_effect)
        decision = capped.decide(job("b", 10), 0.0)
        assert isinstance(decision, Wait) and "33%" in decision.reason
    assert isinstance(with_tenant(100, pack_limit=0.6, by_effect=False).decide(job("b", 100), 0.0), Placement)
    assert isinstance(with_tenant(100, pack_limit=0.6).decide(job("b", 10), 0.0), Placement)


def test_when_a_run_began_outlives_its_moves_but_not_its_release():
    """A re-placement (and a move: both leave and place again) keeps when the job's run began, so
    what is left of it is judged from there; a release forgets it."""
    p = with_tenant(100)
    p.replace(replace(job("a", 100), period_s=8.0), 300.0)
    assert p.judgement.started["a"] == 0.0
    p.release("a")
    assert "a" not in p.judgement.started
    assert isinstance(p.place(job("a", 100), 400.0), Placement)
    assert p.judgement.started["a"] == 400.0


def test_a_decision_changes_nothing():
    p = with_tenant(100)
    before = (dict(p.judgement.started), p.placements())
    for now in (0.0, 700.0, 752.0):
        p.decide(job("b", 10), now)
    assert (dict(p.judgement.started), p.placements()) == before

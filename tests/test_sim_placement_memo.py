"""Placement answers shared between modes are the answers fresh placers give, run for run.

Workload: the pinned one, except that `code` has no slack, so it waits for ever (every release
retries it) while the other jobs stack on shared GPUs and end at times that depend on the
request policy. So the modes' placement histories agree at first (answers replayed) and part
once a job ends at another time (answers asked). Reference: each mode run alone with no memo,
its own placer answering every question.
"""

from __future__ import annotations

import pytest

from plexrl.policy import Policy
from plexrl.policy.placement import FirstFit
from plexrl.sim.modes import make_mode
from plexrl.sim.phases import StepPlans
from plexrl.sim.placement_memo import MemoPlacer, PlacementMemo
from plexrl.sim.plexrl_mode import PlexRLMode

from test_sim_together import figures
from test_sim_pinned import CLUSTER, WORKLOAD

PARTING = WORKLOAD.model_copy(update={"jobs": [j.model_copy(update={"slack": 0.0 if j.name == "code" else 1.0})
                                               for j in WORKLOAD.jobs]})
MODES = {  # in run order: name -> (mode, questions the placer itself answers when run after the ones above)
    "plexrl": (lambda: PlexRLMode(PARTING, CLUSTER, Policy.PLEXRL), 9),
    "sjf": (lambda: PlexRLMode(PARTING, CLUSTER, Policy.SJF), 0),  # asks nothing new: its jobs end when plexrl's do
    "fcfs": (lambda: PlexRLMode(PARTING, CLUSTER, Policy.FCFS), 0),  # ends jobs as plexrl does
    "firstfit": (lambda: make_mode("plexrl-firstfit", PARTING, CLUSTER), 7),  # another placer: its own questions
    "firstfit-sjf": (lambda: PlexRLMode(PARTING, CLUSTER, Policy.SJF, placer=FirstFit), 2),  # parts after its first release
}


@pytest.fixture(scope="module")
def shared():
    memo, plans, runs, asked = PlacementMemo(), StepPlans(), {}, {}
    for name, (mode, _) in MODES.items():
        before = memo.asked
        runs[name] = mode().run(plans, memo)
        asked[name] = memo.asked - before
    return runs, asked


@pytest.mark.parametrize("name", MODES)
def test_a_mode_sharing_answers_runs_as_it_does_alone(shared, name):
    runs, _ = shared
    alone = MODES[name][0]().run(StepPlans())
    assert figures(runs[name]) == figures(alone)


@pytest.mark.parametrize("name", MODES)
def test_the_placer_is_asked_only_where_the_history_is_new(shared, name):
    _, asked = shared
    assert asked[name] == MODES[name][1]


def test_a_long_history_keeps_its_keys_flat():
    """Thousands of observations (a long saturated run) once nested the key past Python's
    recursion limit; history ids keep it one level deep, and equal histories equal ids."""
    from plexrl.policy.placement import Placer
    from plexrl.sim.plexrl_mode import resource_view
    from plexrl.sim.profiles import job_profile
    from plexrl.sim.latency import job_costs

    memo = PlacementMemo()
    spec = WORKLOAD.jobs[0].model_copy(update={"name": "math-0", "count": 1})
    profile = job_profile(spec, job_costs(spec, CLUSTER), 0, 0)
    placers = [MemoPlacer(Placer(resource_view(CLUSTER), 64, 5.0), memo) for _ in range(2)]
    for placer in placers:
        placer.place(profile, 0.0)
        for k in range(5000):
            placer.observe("math-0", k / 100)
        placer.release("math-0")
        placer.place(profile, 10.0)
    assert memo.asked == 2 and placers[0]._history == placers[1]._history

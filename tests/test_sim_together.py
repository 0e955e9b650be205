"""Phases ended together are the per-call path, figure for figure.

The baselines' groups each serve one job (`SimService.exclusive`): every call of a phase starts at
once and the phase ends in one event that stands for all of its calls' ends. The reference is
the same mode with that switched off (one `_done` event per call, as every PlexRL mode runs);
records, event counts, the ledger and the busy intervals must be identical, with and without a
horizon that cuts phases in the middle (calls that ended by the horizon still count).
"""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.sim.colocated_mode import ColocatedMode
from plexrl.sim.split_mode import SplitMode

from test_sim_pinned import CLUSTER, WORKLOAD


def per_call(mode_class):
    return type(f"PerCall{mode_class.__name__}", (mode_class,), {"exclusive_groups": False})


def figures(result):
    records = [(r.name, r.started, r.finished, r.steps, r.step_times, r.charged_gpu_s, r.switch_gpu_s,
                r.submitted, r.served) for r in result.records]
    return result.events, result.end_s, records, result.ledger, [a.tolist() for a in result.busy_intervals]


CASES = {
    "colocated": ColocatedMode,
    "split": SplitMode,
}


@pytest.mark.parametrize("horizon", [None, 290.0, 1286.0], ids=["whole-run", "cut-first-rollout", "cut-later"])
@pytest.mark.parametrize("name", CASES)
def test_phases_ended_together_match_one_event_per_call(name, horizon):
    workload = WORKLOAD.model_copy(update={"horizon_s": horizon})
    fast = CASES[name](workload, CLUSTER)
    assert fast.service.exclusive
    got = figures(fast.run())
    want = figures(per_call(CASES[name])(workload, CLUSTER).run())
    assert got == want


def test_a_cut_run_counts_calls_that_ended_before_the_horizon():
    """At t=290 two of the eight replicas of math-0's first rollout have ended (at ~275 s and
    ~283.5 s; the phase ends at ~301.5 s): those calls are served and counted as events."""
    horizon = 290.0
    result = ColocatedMode(WORKLOAD.model_copy(update={"horizon_s": horizon}), CLUSTER).run()
    math = next(r for r in result.records if r.name == "math-0")
    assert (math.submitted, math.served) == (8, 2)
    assert sum(r.served for r in result.records) == int(np.sum(result.busy_intervals[1] <= horizon))

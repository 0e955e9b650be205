"""The bounds beside every mode's figures (`sim/report.py`: `bounds`, `gain_captured`): no mode
beats them, the `alone` bound computed from colocated's step times is the `alone` mode's own
figures, and the gain is the share of the headroom taken. Reference cases for the fluid
relaxation's pieces (shortest remaining work first on one machine; the cheapest steps first)."""

from __future__ import annotations

import pytest

from plexrl.sim.report import _fluid_steps, _srpt_completions, gain_captured
from plexrl.sim.simulate import simulate

from test_sim_pinned import CLUSTER, WORKLOAD

MODES = ("colocated", "split", "plexrl", "plexrl-pack", "plexrl-nomove", "alone")
SLACK_ALONE = WORKLOAD.model_copy(update={"pack_by_effect": True})  # the default placement, sharing where it pays
CUT = WORKLOAD.model_copy(update={"horizon_s": 6000.0})  # the run's end cuts jobs off


@pytest.fixture(scope="module", params=["pinned", "default", "cut"])
def results(request):
    workload = {"pinned": WORKLOAD, "default": SLACK_ALONE, "cut": CUT}[request.param]
    return simulate(workload, CLUSTER, MODES)["results"]


def test_no_mode_beats_the_bounds(results):
    """Every schedule on the cluster's GPUs; `alone` (GPUs without limit) only its own bound."""
    for mode, r in results.items():
        kinds = ("alone",) if mode == "alone" else ("alone", "fluid", "bound")
        for name in ("makespan", "jct_mean"):
            for which in kinds:
                assert r[f"{name}_s"] >= r[f"{name}_{which}_s"] * (1 - 1e-9), (mode, name, which)
        for which in kinds:
            assert r["steps"] <= r[f"steps_{which}"] * (1 + 1e-9) + 1e-9, (mode, which)


def test_the_bound_is_the_tighter_one_and_every_mode_reports_the_same(results):
    first = results["colocated"]
    for r in results.values():
        assert r["makespan_bound_s"] == max(r["makespan_alone_s"], r["makespan_fluid_s"])
        assert r["jct_mean_bound_s"] == max(r["jct_mean_alone_s"], r["jct_mean_fluid_s"])
        assert r["steps_bound"] == min(r["steps_alone"], r["steps_fluid"])
        assert all(r[k] == first[k] for k in first if "_alone" in k or "_fluid" in k or "_bound" in k)


def test_the_alone_bound_is_the_alone_modes_figures(results):
    alone = results["alone"]
    assert alone["makespan_s"] == pytest.approx(alone["makespan_alone_s"])
    assert alone["jct_mean_s"] == pytest.approx(alone["jct_mean_alone_s"])
    assert alone["steps"] == alone["steps_alone"]


def test_gain_captured_is_the_share_of_the_headroom_taken(results):
    colocated = results["colocated"]
    for mode, r in results.items():
        for name, key in (("makespan", "makespan_s"), ("jct_mean", "jct_mean_s"), ("steps", "steps")):
            bound = r[f"{name}_bound_s"] if key.endswith("_s") else r[f"{name}_bound"]
            room = colocated[key] - bound
            if abs(room) > 1e-6:
                assert r[f"gain_{name}"] == pytest.approx((colocated[key] - r[key]) / room), (mode, name)
    assert colocated["gain_makespan"] == 0.0


def test_gain_captured_arithmetic():
    bound = {"makespan_s": {"bound": 60.0}, "jct_mean_s": {"bound": 30.0}, "steps": {"bound": 120}}
    colocated = {"makespan_s": 100.0, "jct_mean_s": 50.0, "steps": 100}
    mode = {"makespan_s": 90.0, "jct_mean_s": 30.0, "steps": 110}
    assert gain_captured(mode, colocated, bound) == pytest.approx(
        {"makespan_s": 10 / 40, "jct_mean_s": 1.0, "steps": -10 / -20})
    at_bound = {**bound, "steps": {"bound": 100}}
    assert gain_captured(mode, colocated, at_bound)["steps"] is None  # colocated at the bound: no headroom


def test_shortest_remaining_work_first_on_one_machine():
    # a (0 s, 10 s) runs until b (2 s, 1 s) arrives and preempts it: b done at 3, a at 11; c (20 s, 5 s) alone
    assert _srpt_completions([(0.0, 10.0), (2.0, 1.0), (20.0, 5.0)], float("inf")) == [11.0, 3.0, 25.0]
    assert _srpt_completions([(0.0, 10.0), (2.0, 1.0)], 5.0) == [float("inf"), 3.0]  # cut off at 5 s


def test_the_cheapest_steps_fill_the_gpu_time_first():
    # 100 GPU-s: 10 steps of 2 GPU-s (20), then 80 / 10 = 8 of the 10 steps of 10 GPU-s
    assert _fluid_steps([(10.0, 10), (2.0, 10)], 100.0) == pytest.approx(18.0)
    assert _fluid_steps([(2.0, 10)], 1e9) == 10

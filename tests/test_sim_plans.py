"""`StepPlans` (the modes of one workload share planned steps) plans exactly what each job would
plan on its own: the same phases for every step, across draw blocks and for every shape, and
the placer's profile from it equals the one drawn afresh."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.sim.latency import job_costs
from plexrl.sim.phases import DRAW_BLOCK, StepPlans, draw_steps, job_rng, plan_step
from plexrl.sim.profiles import job_profile
from plexrl.sim.workload import WorkloadJob, SimCluster

CLUSTER = SimCluster(name="plans")
JOB = WorkloadJob(name="j", params_b=7, dp=4, steps=DRAW_BLOCK + 5,
          rollout={"prompts": 8, "turns": 2, "tool_s": 5, "refill_fraction": 0.5})

SHAPES = {  # (rollout GPUs, training GPUs, consolidate tail)
    "plexrl": (4, 4, True),
    "colocated": (4, 4, False),
    "split": (2, 2, False),
}


def alone(job: WorkloadJob, seed: int, index: int, rollout: int, train: int, tail: bool) -> list:
    rng, costs, steps = job_rng(seed, index), job_costs(job, CLUSTER), []
    while len(steps) < job.steps:
        steps += [plan_step(job, costs, d, rollout, train, tail) for d in draw_steps(job, rng)]
    return steps[: job.steps]


@pytest.mark.parametrize("shape", SHAPES)
def test_shared_plans_equal_each_job_planning_alone(shape):
    plans, costs = StepPlans(), job_costs(JOB, CLUSTER)
    for other in SHAPES:  # the other shapes planned first must not disturb this one
        if other != shape:
            plans.step(JOB, 3, 1, costs, DRAW_BLOCK, *SHAPES[other])
    want = alone(JOB, 3, 1, *SHAPES[shape])
    got = [plans.step(JOB, 3, 1, costs, step, *SHAPES[shape]) for step in range(JOB.steps)]
    assert got == want
    assert plans.step(JOB, 3, 1, costs, 0, *SHAPES[shape]) is got[0], "planned once, then reused"


def test_another_job_index_or_seed_plans_afresh():
    plans, costs = StepPlans(), job_costs(JOB, CLUSTER)
    first = plans.step(JOB, 3, 1, costs, 0, *SHAPES["plexrl"])
    assert plans.step(JOB, 3, 2, costs, 0, *SHAPES["plexrl"]) == alone(JOB, 3, 2, *SHAPES["plexrl"])[0] != first
    assert plans.step(JOB, 4, 1, costs, 0, *SHAPES["plexrl"]) == alone(JOB, 4, 1, *SHAPES["plexrl"])[0] != first


@pytest.mark.parametrize("tail", [True, False])
def test_profile_from_shared_plans_equals_the_drawn_one(tail):
    costs = job_costs(JOB, CLUSTER)
    assert job_profile(JOB, costs, 3, 1, tail, StepPlans()) == job_profile(JOB, costs, 3, 1, tail)


LONG = JOB.model_copy(update={"rollout": JOB.rollout.model_copy(update={"max_tokens": 100_000, "length_scale": 4.0})})


@pytest.mark.parametrize("job, packed", [(JOB, np.uint16), (LONG, np.float64)], ids=["uint16", "too-long-for-uint16"])
def test_packed_draws_unpack_to_the_drawn_floats(job, packed):
    """Lengths are kept as uint16 between shapes when they fit: unpacked they must be the very
    floats drawn."""
    from plexrl.sim.phases import _length_type

    assert _length_type(job) is packed
    rng, plans = job_rng(3, 1), StepPlans()
    drawn = draw_steps(job, rng) + draw_steps(job, rng)
    for step, d in enumerate(drawn):
        back = plans.draws(job, 3, 1, step)
        assert back.lengths.dtype == np.float64 and np.array_equal(back.lengths, d.lengths)
        assert np.array_equal(back.refill, d.refill) and np.array_equal(back.tool_waits, d.tool_waits)
        assert back.reward_factor == d.reward_factor
    (store,) = plans._draws.values()
    assert all(b.lengths.dtype == packed and b.refill.dtype == packed for b in store.blocks)


def test_an_elastic_profile_counts_each_turn_once_and_names_its_rollouts():
    """`call_moments`: pinned, every device phase is a barrier; elastic, a turn and its
    consolidated tail are one, and the rollouts' residual and seconds on all replicas are given."""
    from plexrl.sim.phases import Phase
    from plexrl.sim.profiles import call_moments
    phases = [Phase("sample", "sampler", (10.0, 8.0)), Phase("sample_tail", "sampler", (3.0,)),
              Phase("tools", None, idle_s=5.0),
              Phase("sample", "sampler", (10.0, 9.0)), Phase("sample_tail", "sampler", (2.0,)),
              Phase("logprobs", "trainer", (4.0,), shard_gpus=2), Phase("update", "trainer", (6.0,), shard_gpus=2)]
    squares = (10.0**2 + 3.0**2 + 10.0**2 + 2.0**2 + 4.0**2 + 6.0**2) / (2 * 50.0)
    assert call_moments(phases, 50.0) == {"barriers": 6, "residual_s": pytest.approx(squares)}
    elastic = call_moments(phases, 50.0, elastic=True)
    assert elastic == {"barriers": 4, "residual_s": pytest.approx(squares), "rollout_barriers": 2,
                       "rollout_residual_s": pytest.approx((10.0**2 + 3.0**2 + 10.0**2 + 2.0**2) / 100.0),
                       "rollout_s": 20.0}

"""Step draws come in blocks from each job's own generator: a job's n-th step sees the same
draws whatever the mode, and the placer's profile sees the run's first step."""

from __future__ import annotations

import numpy as np

from plexrl.sim.phases import DRAW_BLOCK, draw_steps, first_step, job_rng
from plexrl.sim.service import SimJob
from plexrl.sim.workload import WorkloadJob

JOB = WorkloadJob(name="j", params_b=7, steps=DRAW_BLOCK + 5, rollout={"prompts": 4, "turns": 2, "tool_s": 5, "refill_fraction": 0.5})


def test_sim_job_walks_blocks_in_step_order():
    rng = job_rng(3, 1)
    expected = draw_steps(JOB, rng) + draw_steps(JOB, rng)
    job = SimJob(JOB, 1, 3, None, 0.0)
    for step, want in enumerate(expected[: JOB.steps]):
        got = job.plans.draws(JOB, job.seed, job.index, step)
        assert np.array_equal(got.lengths, want.lengths), step
        assert np.array_equal(got.tool_waits, want.tool_waits) and got.reward_factor == want.reward_factor
        assert np.array_equal(got.refill, want.refill)


def test_profile_sees_the_first_step_of_the_run():
    run = draw_steps(JOB, job_rng(3, 1))[0]
    assert np.array_equal(first_step(JOB, 3, 1).lengths, run.lengths)


def test_block_shapes():
    block = draw_steps(JOB, job_rng(0, 0))
    assert len(block) == DRAW_BLOCK
    assert block[0].lengths.shape == (JOB.rollout.responses,) and block[0].tool_waits.shape == (2,)
    assert block[0].refill.shape == (round(0.5 * JOB.rollout.responses),)
    assert len({float(b.lengths.sum()) for b in block}) == DRAW_BLOCK, "every step draws afresh"

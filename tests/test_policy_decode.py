"""The decode model (policy/decode.py): one function for the scheduler's estimate of a batched
call, the simulator's decode and the fit `plexrl sim calibrate` makes from `batch` events."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy import DecodeModel
from plexrl.sim.latency import JobCosts, decode_rows

MODEL = DecodeModel(step_s=2e-3, row_s=5e-5, prefill_token_s=1e-5)


def figures(model, calls):
    return [(steps, rows, prompt, float(model.seconds(steps, rows, prompt))) for steps, rows, prompt in calls]


CALLS = [(32, 32, 10), (32, 2048, 640), (8, 64, 80), (40, 1000, 300), (16, 256, 0)]


def test_fit_recovers_the_model_that_made_the_figures():
    fitted = DecodeModel.fit(figures(MODEL, CALLS))
    assert fitted.step_s == pytest.approx(MODEL.step_s, rel=1e-9)
    assert fitted.row_s == pytest.approx(MODEL.row_s, rel=1e-9)
    assert fitted.prefill_token_s == pytest.approx(MODEL.prefill_token_s, rel=1e-9)


FITS = {
    # name: (figures, expected (step_s, row_s, prefill_token_s))
    "no figures": ([], None),
    "no prompts: their coefficient is 0": (figures(DecodeModel(1e-3, 1e-4), [(c[0], c[1], 0) for c in CALLS]),
                                           (1e-3, 1e-4, 0.0)),
    "a negative coefficient is dropped and the rest refitted": (
        [(10, 10, 0, 0.1), (10, 100, 0, 0.05), (20, 20, 0, 0.2)], None),
}


@pytest.mark.parametrize("data, expected", FITS.values(), ids=FITS.keys())
def test_fit_cases(data, expected):
    fitted = DecodeModel.fit(data)
    if not data:
        assert fitted is None
        return
    assert min(fitted.step_s, fitted.row_s, fitted.prefill_token_s) >= 0
    if expected is not None:
        assert (fitted.step_s, fitted.row_s, fitted.prefill_token_s) == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_a_batch_of_waves_costs_its_waves_longest_rows():
    model = DecodeModel(1.0, 0.01, 0.001)
    rows = [(2, 5, 10), (1, 3, 4), (3, 7, 6)]  # (num_samples, prompt, max_tokens): lengths 10,10,4,6,6,6
    assert model.batch_s(rows, slots=8) == pytest.approx(1.0 * 10 + 0.01 * 42 + 0.001 * 15)
    assert model.batch_s(rows, slots=2) == pytest.approx(1.0 * (10 + 6 + 6) + 0.01 * 42 + 0.001 * 15)  # waves 10,10 6,6 6,4


def test_the_simulator_decodes_with_the_same_function():
    costs = JobCosts(decode_step_s=0.03, decode_seq_s=0.002, forward_token_s=0, update_token_s=0, weight_sync_s=0,
                     prefill_token_s=0, sampler_bytes=0, ref_bytes=0, trainer_bytes=0, gpu_bytes=0)
    lengths = np.array([[5.0, 9.0, 2.0, 7.0]])
    got = decode_rows(costs, lengths, replicas=2)
    expected = [DecodeModel(0.03, 0.002).seconds(9.0, 14.0), DecodeModel(0.03, 0.002).seconds(7.0, 9.0)]
    assert got[0].tolist() == expected
    assert costs.decode_s(9.0, 14.0) == expected[0]

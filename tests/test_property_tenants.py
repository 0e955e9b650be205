"""Property (issue "Tenants kept apart"): over random mixes of good and malformed calls from
several jobs at once, no call hangs, every future resolves (good calls with results, bad ones
with an InvalidInput or ExecutionError), and every job's weights equal the same job run with
its good calls only."""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plexrl
from plexrl import errors
from tests.helpers import datum

MiB = 1 << 20
TIMEOUT_S = 60
GOOD = ("fb", "step", "sample")
BAD = ("token", "loss", "nan_advantage", "lr_inf", "temperature", "datum_type", "checkpoint_name",
       "num_samples", "raising_loss", "shape")


def _raising_loss(datums, logprobs):
    raise ArithmeticError("a tenant's broken loss")


def submit(trainer, op: str, step: int):
    """The future of one call of kind `op` (good calls are deterministic in `step`)."""
    ids = [5, 6, 7, 8]
    if op == "fb":
        return trainer.forward_backward([datum(ids, weights=[1.0, 0.5, 0.25])])
    if op == "step":
        return trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2))
    if op == "sample":
        return trainer.save_weights_and_get_sampling_client().sample(
            plexrl.ModelInput.from_ints(ids), 2, plexrl.SamplingParams(max_tokens=3, seed=step))
    bad = {
        "token": lambda: trainer.forward_backward([datum([5, 6, 10**7])]),
        "loss": lambda: trainer.forward_backward([datum(ids)], loss_fn="bogus"),
        "nan_advantage": lambda: trainer.forward_backward(
            [datum(ids, logprobs=[-1.0] * 3, advantages=[math.nan, 1.0, 1.0])], loss_fn="importance_sampling"),
        "lr_inf": lambda: trainer.optim_step(plexrl.AdamParams(learning_rate=math.inf)),
        "temperature": lambda: trainer.save_weights_and_get_sampling_client().sample(
            plexrl.ModelInput.from_ints(ids), 1, plexrl.SamplingParams(temperature="hot")),
        "datum_type": lambda: trainer.forward_backward([[5, 6, 7]]),
        "checkpoint_name": lambda: trainer.save_state("../elsewhere"),
        "num_samples": lambda: trainer.save_weights_and_get_sampling_client().sample(
            plexrl.ModelInput.from_ints(ids), 10**7, plexrl.SamplingParams(max_tokens=8)),
        "raising_loss": lambda: trainer.forward_backward_custom([datum(ids)], _raising_loss),
        "shape": lambda: trainer.forward_backward([datum(ids, weights=[1.0])]),
    }
    return bad[op]()


@pytest.fixture(scope="module")
def cluster():
    with plexrl.LocalCluster(devices=2, device_memory_bytes=32 * MiB, host_memory_bytes=256 * MiB) as c:
        yield c


_names = itertools.count()


def run_jobs(cluster, model: str, scripts: list[list[str]], with_bad: bool) -> list[np.ndarray]:
    """Each script on its own job, all jobs at once; every future awaited; their weights."""
    trainers = [cluster.service_client(f"t{next(_names)}").create_training_client(base_model=model, seed=i)
                for i in range(len(scripts))]
    outcomes: list[list] = [[] for _ in scripts]

    def run(i: int) -> None:
        futures = [(op, submit(trainers[i], op, step)) for step, op in enumerate(scripts[i])
                   if with_bad or op in GOOD]
        for op, future in futures:
            try:
                outcomes[i].append((op, future.result(TIMEOUT_S)))
            except Exception as exc:  # noqa: BLE001 - classified below
                outcomes[i].append((op, exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(scripts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 4)
    assert not any(t.is_alive() for t in threads), "a call hung"
    for i, script in enumerate(scripts):
        ran = [op for op in script if with_bad or op in GOOD]
        assert [op for op, _ in outcomes[i]] == ran, "a future was lost"
        for op, outcome in outcomes[i]:
            if op in GOOD:
                assert not isinstance(outcome, BaseException), (op, outcome)
            else:
                assert isinstance(outcome, (errors.InvalidInput, errors.ExecutionError)), (op, outcome)
    return [cluster.fetch_weights(t.state) for t in trainers]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(GOOD + BAD), min_size=1, max_size=8), min_size=2, max_size=3))
def test_bad_calls_never_change_a_good_job(cluster, micro_model, scripts):
    mixed = run_jobs(cluster, micro_model, scripts, with_bad=True)
    clean = run_jobs(cluster, micro_model, scripts, with_bad=False)
    for i, (a, b) in enumerate(zip(mixed, clean)):
        np.testing.assert_array_equal(a, b, err_msg=f"job {i}'s bad calls changed its weights: {scripts[i]}")

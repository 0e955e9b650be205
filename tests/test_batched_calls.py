"""A node coalesces a state's queued `sample` and `compute_logprobs` calls into one device call
(runtime/call_batching.py `coalesce`, step_runner.py, functions.py `sample_batch`).

Checked: calls queued together run as one device call (one `batch` event) and each returns
exactly what it returns alone; the call's device time is shared out by tokens and adds up to
the batch's; the event log's batches fit the decode model (`plexrl sim calibrate`); a call with
a bad payload fails alone, the others of its batch succeed.
The device is held (GroupScheduler.hold) while the calls are submitted, so that they are all
queued when it takes the first: what is coalesced does not depend on timing.
"""

from __future__ import annotations

import pytest

import plexrl
from plexrl import errors
from plexrl.runtime.node import Call
from plexrl.runtime.payloads import LogprobsPayload
from plexrl.sim.calibrate import decode_fit
from plexrl.sim.trace import build_trace

TIMEOUT_S = 120


def submit_held(cluster, submit):
    """Run `submit()` (which queues calls) with the node's device held, then let it run them."""
    node = cluster.nodes[0].target
    with node.lock:
        node.scheduler.hold([0])
    try:
        return submit()
    finally:
        with node.lock:
            node.scheduler.hold([0], held=False)


def lazy_calls(sampler):
    """Eight samples of varied params and three log-prob calls, each made when next asked for."""
    for i in range(8):
        yield sampler.sample(plexrl.ModelInput.from_ints([5, 6, 7 + i]), 1 + i % 3,
                             plexrl.SamplingParams(max_tokens=4 + i, seed=i, temperature=[1.0, 0.0, 0.7][i % 3],
                                                   top_k=[-1, 5][i % 2], stop=[None, (9,)][i % 2]))
    for i in range(3):
        yield sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7, 8 + i]))


def calls(sampler):
    return list(lazy_calls(sampler))


def results(futures):
    return [f.result(TIMEOUT_S) for f in futures]


def test_queued_calls_run_as_one_device_call_with_the_results_of_each_alone(tiny_model):
    with plexrl.LocalCluster(devices=1) as c:
        sampler = c.service_client("job").create_training_client(base_model=tiny_model, seed=0) \
            .save_weights_and_get_sampling_client()
        together = results(submit_held(c, lambda: calls(sampler)))
        batches = [e for e in c.events() if e["event"] == "batch"]
        ends = [e for e in c.events() if e["event"] == "end" and e["fn"] in ("sample", "compute_logprobs")]
        alone = [f.result(TIMEOUT_S) for f in calls_one_by_one(sampler)]
        metrics = c.metrics()
        fit = decode_fit(build_trace(c.events()))
    assert together == alone
    assert batches[0]["calls"] == 11, "every queued call joined the first device call"
    assert batches[0]["row_steps"] >= batches[0]["steps"] > 0
    first = ends[:11]
    assert sum(e["device_s"] for e in first) == pytest.approx(batches[0]["device_s"], rel=1e-9)
    job = metrics["jobs"]["job"]
    assert job["consumed_device_s"] == pytest.approx(metrics["device_busy_s"], rel=1e-9)
    # the decode model `plexrl sim calibrate` fits: one figure per batched call (12: the batch, then 11 alone)
    assert fit["batches"] == 12 and min(fit["step_s"], fit["row_s"], fit["prefill_token_s"]) >= 0


def calls_one_by_one(sampler):
    """The same calls, each waited for before the next is made (every device call runs one)."""
    done = []
    for future in lazy_calls(sampler):
        future.result(TIMEOUT_S)
        done.append(future)
    return done


def test_a_bad_call_fails_alone_in_its_batch(tiny_model):
    with plexrl.LocalCluster(devices=1) as c:
        sampler = c.service_client("job").create_training_client(base_model=tiny_model, seed=0) \
            .save_weights_and_get_sampling_client()
        node, state_id = c.nodes[0].target, sampler.state.state_id

        def submit():
            good = sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7]))
            bad = node.enqueue(Call(10**6, "job", state_id, "compute_logprobs", LogprobsPayload([5, 10**6]), 99, 0))
            other = sampler.sample(plexrl.ModelInput.from_ints([5, 6]), 2, plexrl.SamplingParams(max_tokens=3, seed=1))
            return good, bad, other

        good, bad, other = submit_held(c, submit)
        assert len(good.result(TIMEOUT_S)) == 3 and len(other.result(TIMEOUT_S).sequences) == 2
        with pytest.raises(errors.InvalidInput, match="1000000"):
            bad.result(TIMEOUT_S)
        assert [e["calls"] for e in c.events() if e["event"] == "batch"][0] == 3

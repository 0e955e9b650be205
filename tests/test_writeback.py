"""Write-through writes back only what a call changed (device_worker.py, functions.py).

Invariants checked:
- after every call, a state's host copy equals its device copy bitwise, on every segment
  (weights, gradients, both Adam moments), whatever the call wrote back;
- the bytes written back per call are what its declaration says: forward_backward 4 B/param
  (its gradients), optim_step 12 B/param copied (weights, moments) and 4 B/param of gradients
  zeroed on the host in place, sample / compute_logprobs / forward nothing; a refused
  optim_step copies back all 16 B/param and zeroes nothing (its gradients stay as they were);
- the node's metrics count them (`writebacks`, `writeback_bytes`, `writeback_zeroed_bytes`,
  `writeback_s`), and the write-through's materialize event carries the bytes it copied.
The local engine holds the node and the worker in this process, so the test reads both copies.
"""

from __future__ import annotations

import pytest
import torch

import plexrl
from plexrl import errors
from plexrl.runtime.functions import FUNCTIONS, Segment
from tests.helpers import datum

MiB = 1 << 20
TIMEOUT_S = 120
STEP = plexrl.AdamParams(learning_rate=1e-2)
PROMPT = plexrl.ModelInput.from_ints([5, 6, 7])


@pytest.fixture(scope="module")
def cluster():
    from plexrl.engines.local import LocalCluster

    with LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        yield c


def copies(cluster, state_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(host copy, device copy) of a resident state, read from the node and from its worker."""
    node = cluster.nodes[0].target
    worker = cluster.workers[0].target
    return node.sm.states[state_id].host, worker.states[state_id].current().cpu()


def written(cluster) -> tuple[int, int, int]:
    m = cluster.metrics()
    return m["writebacks"], m["writeback_bytes"], m["writeback_zeroed_bytes"]


# name: (the call, params' bytes copied back per parameter, zeroed per parameter, writebacks)
CASES = {
    "forward_backward: its gradients": (lambda t: t.forward_backward([datum([5, 6, 7, 8])]), 4, 0, 1),
    "optim_step: weights and moments, gradients zeroed": (lambda t: t.optim_step(STEP), 12, 4, 1),
    "forward: nothing": (lambda t: t.forward([datum([5, 6, 7, 8])]), 0, 0, 0),
    "compute_logprobs: nothing": (lambda t: t.cluster.submit(t.state, "compute_logprobs", {"tokens": [5, 6, 7]}),
                                  0, 0, 0),
    "refused optim_step: every segment, nothing zeroed": (
        lambda t: t.optim_step(plexrl.AdamParams(learning_rate=1e38)), 16, 0, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_call_writes_back_what_it_declares(cluster, tiny_model, case):
    call, copied, zeroed, count = CASES[case]
    trainer = cluster.service_client(job=f"wb{list(CASES).index(case)}").create_training_client(
        base_model=tiny_model, seed=0)
    trainer.forward_backward([datum([5, 6, 7, 8, 9])]).result(TIMEOUT_S)  # gradients not zero: a zeroing shows
    numel = trainer.state.device_bytes // 16
    before = written(cluster)
    try:
        call(trainer).result(TIMEOUT_S)
    except errors.NonFiniteUpdate:
        assert "refused" in case, f"{case}: the call failed"
    after = written(cluster)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (count, copied * numel, zeroed * numel), (
        f"{case}: (writebacks, bytes copied, bytes zeroed) changed by "
        f"{tuple(a - b for a, b in zip(after, before))}; expected ({count}, {copied * numel}, {zeroed * numel})")
    host, device = copies(cluster, trainer.state.state_id)
    assert torch.equal(host, device), f"{case}: the host copy differs from the device copy after the call"


def test_a_sample_writes_back_nothing(cluster, tiny_model):
    sampler = cluster.service_client(job="wb-sample").create_sampling_client(tiny_model)
    before = written(cluster)
    sampler.sample(PROMPT, num_samples=2, sampling_params=plexrl.SamplingParams(max_tokens=3, seed=0)).result(TIMEOUT_S)
    assert written(cluster) == before


def test_host_copy_equals_device_copy_through_a_training_loop(cluster, tiny_model):
    """Every segment stays equal call after call, switches (a second tenant) in between."""
    trainer = cluster.service_client(job="wb-loop").create_training_client(base_model=tiny_model, seed=1)
    other = cluster.service_client(job="wb-other").create_training_client(base_model=tiny_model, seed=2)
    for step in range(3):
        for t in (trainer, other):
            t.forward_backward([datum([5, 6, 7, 8 + step])]).result(TIMEOUT_S)
            host, device = copies(cluster, t.state.state_id)
            assert torch.equal(host, device), f"step {step}: the copies differ after forward_backward"
            assert t.optim_step(STEP).result(TIMEOUT_S).metrics["step"] == step + 1
            host, device = copies(cluster, t.state.state_id)
            assert torch.equal(host, device), f"step {step}: the copies differ after optim_step"
            numel = t.state.device_bytes // 16
            assert not host[numel:2 * numel].any(), "gradients are not zero on the host after optim_step"


def test_the_write_through_event_carries_the_bytes_copied(cluster, tiny_model):
    trainer = cluster.service_client(job="wb-events").create_training_client(base_model=tiny_model, seed=0)
    trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
    trainer.optim_step(STEP).result(TIMEOUT_S)
    numel = trainer.state.device_bytes // 16
    writes = [e for e in cluster.events("wb-events") if e["event"] == "transition" and e["kind"] == "materialize"]
    assert [e["bytes"] for e in writes] == [4 * numel, 12 * numel]
    assert all(e["state_bytes"] == 16 * numel for e in writes)


def test_the_declarations():
    """What the table says each function changes (the worker copies exactly these)."""
    assert FUNCTIONS["forward_backward"].write_back(ok=True) == ({Segment.GRADS}, set())
    assert FUNCTIONS["optim_step"].write_back(ok=True) == (
        {Segment.WEIGHTS, Segment.EXP_AVG, Segment.EXP_AVG_SQ}, {Segment.GRADS})
    assert FUNCTIONS["optim_step"].write_back(ok=False) == (set(Segment), set())
    for fn in ("sample", "compute_logprobs", "forward", "noop", "read_weights", "save_state"):
        assert not FUNCTIONS[fn].mutates and FUNCTIONS[fn].write_back(ok=True) == (set(), set()), fn
    assert FUNCTIONS["load_state"].writes == set(Segment)  # `mutates=True` alone: every segment


def test_spans_merge_adjacent_segments(tiny_model):
    from plexrl.runtime.state import ModelState, load_module

    state = ModelState("x/p", "x", "p", load_module(tiny_model), True, tiny_model)
    n = state.numel
    assert state.spans({0, 2, 3}) == [slice(0, n), slice(2 * n, 4 * n)]
    assert state.spans(set(Segment)) == [slice(0, 4 * n)]
    assert state.spans({1}) == [slice(n, 2 * n)]
    frozen = ModelState("x/q", "x", "q", load_module(tiny_model), False, tiny_model)
    assert frozen.spans(set(Segment)) == [slice(0, n)]  # a weights-only state has no other segment
    assert frozen.spans({1, 2, 3}) == []

"""Prefetch: the state a device will likely run next is loaded while its current function runs
(scheduler.py `_plan_prefetch`, policy.plan_prefetch, device_worker.py `_load_ahead`).

Invariants checked:
- a prefetch plan is planned on the residency the running plan leaves: its window never
  overlaps the running state's, it never moves a busy state, a state on disk or on another
  device, and it is None when the state is resident already;
- results do not depend on it: three jobs taking turns on one device whose arena holds two of
  their states end with bitwise the same weights with prefetch on and off, on the local and
  the process engines;
- what it did is counted (`prefetches`, `prefetch_bytes`, `prefetch_s`, `prefetch_exposed_s`):
  the exposed part is never more than the copy, and a prefetched load is charged to its job's
  device time only for its exposed part (its event says how much was hidden).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import plexrl
from plexrl.policy import LoadPlan, ResidencyView, StateInfo, Tier, TransitionKind, plan_load, plan_prefetch
from plexrl.runtime.state import load_module
from tests.helpers import datum

TIMEOUT_S = 120
ROUNDS = 3
CALLS = 2  # forward_backward calls queued per job and round


def info(sid: str, nbytes: int = 100, tier: Tier = Tier.HOST, device: int | None = None, offset: int | None = None,
         busy: bool = False, pending: int = 0) -> StateInfo:
    return StateInfo(state_id=sid, job=sid, device_bytes=nbytes, host_bytes=nbytes, tier=tier, device=device,
                     offset=offset, busy=busy, pending=pending, last_used_s=0.0)


def view(*states: StateInfo, capacity: int = 200) -> ResidencyView:
    return ResidencyView({s.state_id: s for s in states}, {0: capacity, 1: capacity}, 10_000)


def running(v: ResidencyView, sid: str) -> tuple[ResidencyView, LoadPlan]:
    """The view once `sid`'s load on device 0 is planned and claimed (as prepare does)."""
    plan = plan_load(v, sid, 0)
    states = dict(v.states)
    for t in plan.transitions:
        states[t.state_id] = replace(states[t.state_id], busy=True)
    return ResidencyView(states, v.device_capacity, v.host_capacity), plan


def test_a_prefetch_window_never_overlaps_the_running_load():
    v, plan = running(view(info("a"), info("b"), info("c", tier=Tier.DEVICE, device=0, offset=0)), "a")
    ahead = plan_prefetch(v, "b", 0, plan)
    load_a = plan.transitions[-1]
    assert ahead is not None and ahead.transitions[-1].kind is TransitionKind.LOAD
    b = ahead.transitions[-1]
    assert b.offset + b.bytes <= load_a.offset or load_a.offset + load_a.bytes <= b.offset, (
        f"the prefetch window [{b.offset}, {b.offset + b.bytes}) overlaps the running load "
        f"[{load_a.offset}, {load_a.offset + load_a.bytes})")
    assert all(t.state_id != "a" for t in ahead.transitions), "the prefetch moved the running state"


def test_a_prefetch_moves_nothing_busy_nor_off_disk_nor_off_another_device():
    # the arena holds two states; a runs; its neighbour d is busy (another call of this node claimed it)
    v, plan = running(view(info("a"), info("b"), info("d", tier=Tier.DEVICE, device=0, offset=100, busy=True)), "a")
    assert plan_prefetch(v, "b", 0, plan) is None, "a prefetch evicted a busy state"
    v, plan = running(view(info("a"), info("b", tier=Tier.DISK)), "a")
    assert plan_prefetch(v, "b", 0, plan) is None, "a prefetch restored a state from disk"
    v, plan = running(view(info("a"), info("b", tier=Tier.DEVICE, device=1, offset=0)), "a")
    assert plan_prefetch(v, "b", 0, plan) is None, "a prefetch moved a state off another device"
    v, plan = running(view(info("a"), info("b", tier=Tier.DEVICE, device=0, offset=100)), "a")
    assert plan_prefetch(v, "b", 0, plan) is None, "a prefetch of a resident state"
    v, plan = running(view(info("a", nbytes=150), info("b", nbytes=100)), "a")
    assert plan_prefetch(v, "b", 0, plan) is None, "a prefetch that only fits where the running state goes"


def test_a_prefetch_may_evict_an_idle_state_of_its_device():
    v, plan = running(view(info("a"), info("b"), info("c", tier=Tier.DEVICE, device=0, offset=100, pending=1)), "a")
    ahead = plan_prefetch(v, "b", 0, plan)
    assert ahead is not None and [(t.kind, t.state_id) for t in ahead.transitions] == [
        (TransitionKind.OFFLOAD, "c"), (TransitionKind.LOAD, "b")]


def turns(cluster, model: str) -> dict[str, torch.Tensor]:
    """Three jobs taking turns on one device: per round, each queues CALLS forward_backward
    calls and an optim_step without waiting, then all wait. Their final weights."""
    trainers = {job: cluster.service_client(job=job).create_training_client(base_model=model, seed=i)
                for i, job in enumerate(("pa", "pb", "pc"))}
    for step in range(ROUNDS):
        futures = []
        for i, trainer in enumerate(trainers.values()):
            futures += [trainer.forward_backward([datum([5 + i, 6, 7, 8 + c, 9])]) for c in range(CALLS)]
            futures.append(trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)))
        for future in futures:
            future.result(TIMEOUT_S)
    return {job: torch.from_numpy(cluster.fetch_weights(t.state)) for job, t in trainers.items()}


def two_trainers_bytes(model: str) -> int:
    """An arena for two of the three trainers (weights, gradients, Adam moments: 16 B/param)."""
    return 2 * 16 * sum(p.numel() for p in load_module(model).parameters())


@pytest.mark.parametrize("engine", ["local", "process"])
def test_prefetch_changes_no_result_and_is_counted(tiny_model, engine):
    from plexrl.engines.local import LocalCluster
    from plexrl.engines.process import ProcessCluster

    make = {"local": LocalCluster, "process": ProcessCluster}[engine]
    results, metrics = {}, {}
    for prefetch in (False, True):
        with make(devices=1, device_memory_bytes=two_trainers_bytes(tiny_model), host_memory_bytes=64 << 20,
                  activation_reserve_bytes=0, prefetch=prefetch) as cluster:  # the budget is the states' alone
            results[prefetch] = turns(cluster, tiny_model)
            metrics[prefetch] = cluster.metrics()
            events = cluster.events()
    for job in results[False]:
        assert torch.equal(results[False][job], results[True][job]), f"{engine}: job {job}'s weights differ with prefetch"
    off, on = metrics[False], metrics[True]
    assert off["prefetches"] == 0 and off["prefetch_bytes"] == 0
    assert on["prefetches"] > 0, f"{engine}: no prefetch happened in {ROUNDS} rounds of three jobs taking turns"
    assert on["prefetch_bytes"] == on["prefetches"] * two_trainers_bytes(tiny_model) // 2
    assert 0 <= on["prefetch_exposed_s"] <= on["prefetch_s"] + 1e-9
    hidden = [e for e in events if e.get("event") == "transition" and "hidden_s" in e]
    assert len(hidden) == on["prefetches"], "every prefetched load's event says how much of it was hidden"
    assert all(0 <= e["hidden_s"] <= e["seconds"] + 1e-9 for e in hidden)


@pytest.mark.parametrize("start, end, function_end, exposed", [
    (0.0, 1.0, 2.0, 0.0),  # the function outlasted the copy: all of it hidden
    (0.0, 3.0, 2.0, 1.0),  # the copy ran on past the function's end by 1 s
    (2.5, 3.0, 2.0, 0.5),  # its thread started after the function ended: nothing hidden, only 0.5 s long
])
def test_the_exposed_part_of_a_prefetch_is_what_the_function_did_not_overlap(start, end, function_end, exposed):
    from concurrent.futures import Future

    from plexrl.runtime.cuda import Ahead

    copy = Future()
    copy.set_result((start, end))
    assert Ahead(future=copy).wait(function_end, None) == pytest.approx((end - start, exposed))


def test_prefetch_false_is_checked():
    from plexrl.engines.local import LocalCluster

    with pytest.raises(plexrl.errors.ConfigError, match="prefetch"):
        LocalCluster(devices=1, prefetch="yes")

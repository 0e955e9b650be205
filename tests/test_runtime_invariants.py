"""docs/design.md §9 invariants on the real runtime, each checked from the outside (results, event log).

1 transparency: a job multiplexed with others ends bitwise equal to the same job run alone;
2 budgets: device arenas and host memory never exceed their budgets (replayed from the event log,
  also as a property over random request streams); functions execute only on resident states;
3 isolation: one job's calls never read or change another job's state;
4 affinity: a state never leaves its node;
5 completion: every admitted request completes or fails into its future; a failing job stops no other.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plexrl
from tests.helpers import datum, reserve_bytes, rl_job, weights
from plexrl import errors

MiB = 1 << 20


def replay_budgets(events, device_capacity, host_capacity):
    """Reconstruct residency from the event log; return the peak bytes per device and on the host."""
    device_use, host_use = defaultdict(int), 0
    peak_device, peak_host = defaultdict(int), 0
    where: dict[str, int] = {}
    for e in events:
        if e["event"] == "state_added":
            host_use += e["host_bytes"]
        elif e["event"] == "state_removed":
            if e["tier"] != "disk":
                host_use -= e["host_bytes"]
            if e["tier"] == "device":
                device_use[e["device"]] -= e["device_bytes"]
                where.pop(e["state"], None)
        elif e["event"] == "transition":
            kind, sid, size = e["kind"], e["state"], e["state_bytes"]
            if kind == "load":
                device_use[e["device"]] += size
                where[sid] = e["device"]
            elif kind == "offload":
                device_use[where.pop(sid)] -= size
            elif kind == "spill":
                host_use -= size
            elif kind == "restore":
                host_use += size
        for d, used in device_use.items():
            peak_device[d] = max(peak_device[d], used)
        peak_host = max(peak_host, host_use)
    assert all(v <= device_capacity for v in peak_device.values()), (dict(peak_device), device_capacity)
    assert peak_host <= host_capacity, (peak_host, host_capacity)
    return peak_device, peak_host


def test_transparency_multiplexed_equals_alone(tiny_model):
    state_bytes = None
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as alone:
        trainer = rl_job(alone, "job-a", tiny_model, seed=1)
        solo, state_bytes = weights(alone, trainer), trainer.state.device_bytes
        reserve = trainer.state.activation_reserve_bytes
    # Room for one trainer and one snapshot per device next to the activation reserve: three jobs must keep switching.
    budget = state_bytes + state_bytes // 4 + 4096 + reserve
    with plexrl.LocalCluster(devices=2, device_memory_bytes=budget, host_memory_bytes=256 * MiB) as shared:
        results = {}

        def run(job, seed):
            results[job] = weights(shared, rl_job(shared, job, tiny_model, seed))

        threads = [threading.Thread(target=run, args=(j, s))
                   for j, s in (("job-a", 1), ("job-b", 2), ("job-c", 3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = shared.metrics()
        replay_budgets(shared.events(), budget, 256 * MiB)
    assert metrics["switches"] > 6, "the budget was meant to force switches"
    assert torch.equal(results["job-a"], solo), "multiplexing changed job-a's weights"
    assert not torch.equal(results["job-b"], solo)


def test_accounting_adds_up(tiny_model):
    with plexrl.LocalCluster(devices=2, device_memory_bytes=8 * MiB, host_memory_bytes=64 * MiB) as c:
        threads = [threading.Thread(target=rl_job, args=(c, f"job-{i}", tiny_model, i, 2)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = c.metrics()
    consumed = sum(j["consumed_device_s"] for j in m["jobs"].values())
    assert consumed == pytest.approx(m["device_busy_s"], rel=1e-9)
    assert m["device_busy_s"] <= m["uptime_s"] * 2


def test_isolation_one_job_cannot_touch_another(tiny_model):
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        a = c.service_client("job-a").create_training_client(base_model=tiny_model)
        b = c.service_client("job-b").create_training_client(base_model=tiny_model)
        a_weights = weights(c, a)
        for _ in range(3):
            b.forward_backward([datum([5, 6, 7, 8])]).result()
            b.optim_step(plexrl.AdamParams(learning_rate=0.1)).result()
        assert torch.equal(weights(c, a), a_weights)
        assert not torch.equal(weights(c, b), a_weights)
        assert a.state.job == "job-a" and b.state.job == "job-b"
        touched = {e["job"] for e in c.events() if a.model_id in (e.get("model"), e.get("state"))}
        assert touched == {"job-a"}


def test_affinity_states_stay_on_their_node(tiny_model):
    with plexrl.LocalCluster(devices=4, nodes=2, device_memory_bytes=8 * MiB, host_memory_bytes=64 * MiB) as c:
        threads = [threading.Thread(target=rl_job, args=(c, f"job-{i}", tiny_model, i, 2)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        node_of_state = {}
        for e in c.events():
            if e["event"] in ("transition", "state_added"):
                node_of_state.setdefault(e["state"], set()).add(e["node"])
            if e["event"] == "transition" and e["device"] is not None:
                assert e["device"] // 2 == e["node"], "a state was loaded onto another node's device"
        assert all(len(nodes) == 1 for nodes in node_of_state.values()), node_of_state
        assert {c.metrics()["jobs"][f"job-{i}"]["placement"]["node"] for i in range(4)} == {0, 1}


def test_a_failing_job_stops_no_other(tiny_model):
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        good = c.service_client("good").create_training_client(base_model=tiny_model)
        bad = c.service_client("bad").create_training_client(base_model=tiny_model)

        def explode(data, logprobs):
            raise RuntimeError("user loss bug")

        futures = []
        for _ in range(3):
            futures.append(("bad", bad.forward_backward_custom([datum([5, 6, 7])], explode)))
            futures.append(("good", good.forward_backward([datum([5, 6, 7])])))
        for who, f in futures:
            if who == "bad":
                with pytest.raises(errors.ExecutionError, match="user loss bug"):
                    f.result(timeout=60)
            else:
                assert f.result(timeout=60).metrics["loss:sum"] > 0
        assert c.metrics()["jobs"]["bad"]["failed"] == 3


def test_close_fails_queued_calls_and_refuses_new_ones(tiny_model):
    c = plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB)
    trainer = c.service_client("job").create_training_client(base_model=tiny_model)
    futures = [trainer.forward_backward([datum([5, 6, 7, 8, 9, 10])]) for _ in range(20)]
    c.close()
    outcomes = {"ok": 0, "closed": 0}
    for f in futures:
        try:
            f.result(timeout=60)
            outcomes["ok"] += 1
        except errors.ClusterClosed:
            outcomes["closed"] += 1
    assert sum(outcomes.values()) == 20
    with pytest.raises(errors.ClusterClosed):
        trainer.forward_backward([datum([5, 6, 7])]).result(timeout=5)
    with pytest.raises(errors.ClusterClosed):
        c.service_client("other")


@pytest.fixture(scope="module")
def micro_cluster_factory(micro_model):
    return micro_model


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["fb", "step", "lp", "sample", "sync"])),
                       min_size=5, max_size=25),
       policy=st.sampled_from(["fcfs", "sjf", "hrrn", "plexrl"]), read_replicas=st.booleans())
def test_budgets_hold_over_random_request_streams(micro_model, stream, policy, read_replicas):
    """Random interleavings of several jobs' calls under budgets that force offloads and spills,
    with and without read replicas of the snapshots."""
    from plexrl.runtime.state import load_module

    numel = sum(p.numel() for p in load_module(micro_model).parameters())
    trainer_bytes = 16 * numel
    device_budget = trainer_bytes + trainer_bytes // 2 + reserve_bytes(micro_model)  # and the activation reserve
    # Admission fills the node's host memory with the three trainers; their sampler snapshots
    # (a quarter of a trainer each) then only fit by spilling idle states to disk.
    host_budget = 3 * trainer_bytes + trainer_bytes // 4
    with plexrl.LocalCluster(devices=2, device_memory_bytes=device_budget, host_memory_bytes=host_budget,
                             policy=policy, read_replicas=read_replicas) as c:
        trainers = [c.service_client(f"job-{i}", admission_timeout=30).create_training_client(
            base_model=micro_model, seed=i) for i in range(3)]
        samplers: dict[int, plexrl.SamplingClient] = {}
        futures = []
        for job, op in stream:
            t = trainers[job]
            if op == "fb":
                futures.append(t.forward_backward([datum([5, 6, 7, 8])]))
            elif op == "step":
                futures.append(t.optim_step(plexrl.AdamParams(learning_rate=1e-3)))
            elif op == "sync":
                futures.append(t.save_weights_for_sampler())
            elif op == "lp" and job in samplers:
                futures.append(samplers[job].compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7])))
            elif op == "sample":
                samplers[job] = t.save_weights_and_get_sampling_client()
                futures.append(samplers[job].sample(plexrl.ModelInput.from_ints([5, 6]), 2,
                                                    plexrl.SamplingParams(max_tokens=3, seed=1)))
        for f in futures:
            f.result(timeout=120)
        replay_budgets(c.events(), device_budget, host_budget)
        resident: dict[str, int] = {}
        for e in c.events():  # in emission order: a worker emits "start" after its own loads
            if e["event"] == "transition" and e["kind"] == "load":
                resident[e["state"]] = e["device"]
            elif e["event"] == "transition" and e["kind"] == "offload":
                resident.pop(e["state"], None)
            elif e["event"] == "start" and e["device"] is not None:
                assert resident.get(e["model"]) == e["device"], "executed a state not resident on its device"
        # A superseded sampler snapshot goes once its calls drain, even when it was busy (in a
        # transition) as the sync replaced it: each trainer keeps one snapshot per name. A read
        # replica goes with its snapshot.
        versions: dict[str, list[str]] = {}
        residency = c.residency()
        for sid in residency:
            if "@" in sid and "#" not in sid:
                versions.setdefault(sid.rsplit(".v", 1)[0], []).append(sid)
        assert all(len(v) == 1 for v in versions.values()), f"superseded snapshots left: {versions}"
        assert all(sid.split("#")[0] in residency for sid in residency), "a replica outlived its snapshot"


def test_a_snapshot_superseded_while_in_use_is_removed_once_its_call_ends(micro_model):
    """A weight sync finds its sampler snapshot busy (a call of its own holds it), so it writes a
    new version and retires the old one; the old one goes once that call is done, and a call
    naming it that arrives later runs on the new version (`WeightSync.follow_superseded`). (A snapshot
    another call's load evicts is not busy: its clean copy is let go as that call is dispatched,
    tests/test_engines.py.)"""
    with plexrl.LocalCluster(devices=1, prefetch=False) as c:
        a = c.service_client("job-a").create_training_client(base_model=micro_model, seed=0)
        sampler = a.save_weights_and_get_sampling_client()
        handle = sampler.state
        old = handle.state_id
        sm = c.nodes[0].target.sm
        release, in_use, go = sm.release, threading.Event(), threading.Event()

        def held_release(plan, now):  # the snapshot's call ran: keep its state claimed a while
            if plan.state_id == old:
                in_use.set()
                assert go.wait(60)
            release(plan, now)

        sm.release = held_release
        call = sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7]))
        assert in_use.wait(60)
        assert sm.states[old].busy
        new = a.save_weights_for_sampler().result(timeout=60)
        assert new.state_id != old  # busy: a new version, the old one retired
        assert old in c.residency()  # not while its call holds it
        go.set()
        call.result(timeout=60)
        assert old not in c.residency()
        assert new.state_id in c.residency()
        # a call that names the old snapshot and reaches the node only now (made just before the sync
        # ran) follows the sync, as its sampling client does, instead of failing on a retired model
        tokens = plexrl.ModelInput.from_ints([5, 6, 7])
        late = plexrl.SamplingClient(c, handle, seed=0).compute_logprobs(tokens).result(timeout=60)
        assert late == plexrl.SamplingClient(c, new, seed=0).compute_logprobs(tokens).result(timeout=60)


@pytest.mark.parametrize("policy, slack_b, first", [("plexrl", 100.0, "job-a"), ("hrrn", 100.0, "job-b"),
                                                    ("plexrl", 0.0, "job-b")])
def test_a_job_past_its_slack_in_a_step_goes_first(micro_model, policy, slack_b, first):
    """The scheduler counts a job's waits in a step against its slack (docs/design.md §5): job A's step
    marks came back to back, so its step alone is ~0 s and any wait overruns its slack; its call
    goes before job B's older one under `plexrl` while B, with slack to spare, can wait. `hrrn`
    has no slack term: B waited longer. B has no step measured yet: its step so far (from its
    admission, less its waits) stands for its period, so with no slack its older call is past
    its budget too, and goes first by the priority (without that, a job not yet measured had
    no deadline and waited behind A's calls for as long as A stayed past its slack)."""
    with plexrl.LocalCluster(devices=1, policy=policy, prefetch=False) as c:
        service_a = c.service_client("job-a")
        a = service_a.create_training_client(base_model=micro_model, seed=0)
        b = c.service_client("job-b", slack=slack_b).create_training_client(base_model=micro_model, seed=1)
        for t in (a, b):  # both resident-or-not alike: each has run once
            t.forward_backward([datum([5, 6, 7, 8])]).result(timeout=60)
        service_a.report_step(0)
        service_a.report_step(1)
        group = c.nodes[0].target.scheduler
        with group.lock:
            group.hold([0])
        calls = [b.forward_backward([datum([5, 6, 7, 8])])]
        t0 = time.monotonic()
        while len(group._queue.ready) < 1 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        time.sleep(0.05)  # B's call is older
        calls.append(a.forward_backward([datum([5, 6, 7, 8])]))
        while len(group._queue.ready) < 2 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        assert len(group._queue.ready) == 2
        with group.lock:
            group.hold([0], held=False)
        for f in calls:
            f.result(timeout=60)
        order = [e["job"] for e in c.events() if e["event"] == "dispatch" and e["fn"] == "forward_backward"]
        assert order[-2] == first
        service_a.close()  # its states go, and so does what the scheduler tracked of it
        assert "job-a" not in group._slack and "job-b" in group._slack

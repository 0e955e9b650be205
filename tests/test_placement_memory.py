"""Host memory the placer commits (issue 11, item 4): a shared frozen model is one copy per
node, refcounted across jobs; a sampler whose host copy is its trainer's weights costs nothing
more; 235B-class jobs can then share node groups."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy.placement import Placement, Placer
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import ResourceView
from plexrl.sim.latency import job_costs
from plexrl.sim.plexrl_mode import resource_view
from plexrl.sim.profiles import job_profile
from plexrl.sim.workload import WorkloadJob, SimCluster

GiB = 2**30


def view(host: int = 100 * GiB) -> ResourceView:
    return ResourceView.uniform(1, 1, 2, 2, 10 * GiB, host)  # one group of 2 nodes x 2 devices


def job(name: str, own: int, ref: int = 0, key: str = "qwen-7b/ref", devices: int = 2) -> JobProfile:
    models = [ModelMemory("trainer", GiB, own)]
    if ref:
        models.append(ModelMemory("ref", GiB, ref, shared=key))
    return JobProfile(name, 4.0, (1.0,) * 4, devices, tuple(models), slack=10.0)


def test_a_shared_reference_is_counted_once_per_node_and_freed_with_its_last_user():
    v = view()
    a, b = job("a", 4 * GiB, ref=30 * GiB), job("b", 4 * GiB, ref=30 * GiB)
    v.allocate("a", (0, 1), a.host_bytes_per_device, a.shared_host_bytes)  # node 0
    assert v.host_used[0] == 2 * 4 * GiB + 30 * GiB and v.shared_copies(0) == {"qwen-7b/ref": 1}
    v.allocate("b", (0, 2), b.host_bytes_per_device, b.shared_host_bytes)  # nodes 0 and 1
    assert v.host_used.tolist() == [3 * 4 * GiB + 30 * GiB, 4 * GiB + 30 * GiB]
    assert v.shared_copies(0) == {"qwen-7b/ref": 2}
    v.free("a")
    assert v.host_used.tolist() == [4 * GiB + 30 * GiB, 4 * GiB + 30 * GiB]
    v.free("b")
    assert v.host_used.tolist() == [0, 0] and v.shared_copies(0) == {}


def test_a_node_holding_the_shared_copy_takes_a_job_it_could_not_otherwise():
    v = view(host=40 * GiB)
    a = job("a", 4 * GiB, ref=30 * GiB)
    v.allocate("a", (0,), a.host_bytes_per_device, a.shared_host_bytes)  # node 0: 34 GiB used
    same, other = job("b", 3 * GiB, ref=30 * GiB), job("c", 3 * GiB, ref=30 * GiB, key="llama-8b/ref")
    assert v.copies_per_node(same).tolist() == [2, 2]  # node 0: 6 GiB free, 3 GiB per device
    assert v.copies_per_node(other).tolist() == [0, 2]  # another base needs its own 30 GiB


def test_host_is_never_over_committed_and_copies_match_their_users():
    rng = np.random.default_rng(0)
    placer = Placer(view(host=64 * GiB), horizon_slots=16, slot_s=1.0)
    placed: list[str] = []
    for i in range(200):
        if placed and rng.random() < 0.4:
            placer.release(placed.pop(int(rng.integers(len(placed)))))
        else:
            key = ["x/ref", "y/ref", ""][int(rng.integers(3))]
            profile = job(f"j{i}", int(rng.integers(1, 12)) * GiB, ref=20 * GiB if key else 0, key=key or "x/ref",
                          devices=int(rng.integers(1, 3)))
            if isinstance(placer.place(profile, float(i)), Placement):
                placed.append(profile.job)
        v = placer.view
        assert (v.host_used <= v.node_host).all()
        for n in range(len(v.nodes)):
            users = {}
            for name in placed:
                p = placer.profile_of(name)
                if any(v._node_of[d] == n for d in placer.placements()[name].devices):
                    for key in p.shared_host_bytes:
                        users[key] = users.get(key, 0) + 1
            assert v.shared_copies(n) == users


def test_two_235b_jobs_share_a_node_group_once_the_sampler_keeps_no_host_copy():
    cluster = SimCluster(name="h200-64", nodes_per_pod=4, group_nodes=4)  # one group of 4 nodes, 2 TB each
    spec = WorkloadJob(name="math-235b", algorithm="dapo", params_b=235, active_params_b=22, tp=8, dp=4, steps=2)
    costs = job_costs(spec, cluster)
    profile = job_profile(spec, costs, seed=0, index=0)
    assert profile.host_bytes_per_device == costs.trainer_bytes  # sampler: 0, its weights are the trainer's
    v = resource_view(cluster)
    first = v.choose_devices(0, profile)
    v.allocate("a", first, profile.host_bytes_per_device)
    assert len(v.feasible_groups(profile)) == 1, "a second 235B job fits the same group's host memory"
    # before: every device also held its sampler's weights and KV reserve, 1.7 TB per node and job
    with_sampler = costs.trainer_bytes + costs.sampler_bytes
    assert 2 * 8 * with_sampler > cluster.host_memory_gb * 1e9 >= 2 * 8 * costs.trainer_bytes


@pytest.mark.parametrize("algorithm, shared", [("grpo", True), ("dapo", False)])
def test_a_named_base_shares_its_reference(algorithm, shared):
    cluster = SimCluster(name="c", nodes_per_pod=1)
    spec = WorkloadJob(name="j", algorithm=algorithm, params_b=7, dp=8, steps=1, base="qwen2.5-7b")
    profile = job_profile(spec, job_costs(spec, cluster), seed=0, index=0)
    expected = {"qwen2.5-7b/ref": job_costs(spec, cluster).ref_bytes} if shared else {}
    assert profile.shared_host_bytes == expected

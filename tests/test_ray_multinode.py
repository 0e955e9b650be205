"""The Ray engine on a simulated multi-node cluster (ray.cluster_utils.Cluster: 2 nodes x 2 logical GPUs).

Checked: each node group's StateManager and workers run on their own Ray node (node affinity);
every job's states live on the node its placement chose, and nowhere else, for the whole run;
jobs on different nodes both complete.
"""

from __future__ import annotations

import os
import threading

import pytest

import plexrl

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

MiB = 1 << 20
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def two_nodes():
    import tempfile

    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="/tmp/r")  # private and short (socket paths)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 2, "include_dashboard": False, "object_store_memory": 80 * MiB})
    cluster.add_node(num_cpus=1, num_gpus=2, object_store_memory=80 * MiB)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def busy_profile(job):
    from plexrl.policy import JobProfile, ModelMemory

    return JobProfile(job, period_s=1.0, demand=(2.0,) * 20, devices=2, models=(ModelMemory("policy", MiB, MiB),))


def train(service, model_dir, seed):
    trainer = service.create_training_client(base_model=model_dir, seed=seed)
    datum = plexrl.Datum(plexrl.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})
    for _ in range(2):
        trainer.forward_backward([datum]).result(TIMEOUT_S)
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result(TIMEOUT_S)
    sampler = trainer.save_weights_and_get_sampling_client()
    sampler.sample(plexrl.ModelInput.from_ints([5, 6]), sampling_params=plexrl.SamplingParams(max_tokens=3, seed=seed)).result(TIMEOUT_S)


def test_placement_honoured_and_affinity_kept(two_nodes, micro_model):
    from plexrl.engines.ray_cluster import RayCluster

    with RayCluster(address="auto", devices_per_node=2, device_memory_bytes=16 * MiB, host_memory_bytes=64 * MiB) as cluster:
        assert len(cluster.nodes) == 2 and len(set(cluster.node_ids)) == 2
        for group, node_id in enumerate(cluster.node_ids):
            assert ray.get(cluster.nodes[group].where.remote()) == node_id
            for device in (2 * group, 2 * group + 1):
                assert ray.get(cluster.workers[device].where.remote()) == node_id
        # Two jobs that each keep a whole node busy: the Placer must give them different nodes.
        services = {job: cluster.service_client(job, profile=busy_profile(job), admission_timeout=TIMEOUT_S)
                    for job in ("job-0", "job-1")}
        jobs = {job: cluster.metrics()["placement"][job]["group"] for job in services}
        assert sorted(jobs.values()) == [0, 1]
        threads = [threading.Thread(target=train, args=(services[job], micro_model, seed)) for seed, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 3)
        held = cluster.node_states()
        for job, group in jobs.items():
            mine = [sid for sid in held[group] if sid.startswith(job + "/")]
            assert f"{job}/policy" in mine and any("@sampler" in sid for sid in mine)
            assert not [sid for sid in held[1 - group] if sid.startswith(job + "/")], f"{job} has a state on another node"
        metrics = cluster.metrics()
        assert all(metrics["jobs"][job]["requests"] >= 5 and metrics["jobs"][job]["failed"] == 0 for job in jobs)
        transitions = [e for e in cluster.events() if e["event"] == "transition" and e.get("job") in jobs]
        assert transitions and all(e["node"] == jobs[e["job"]] for e in transitions), "a state moved off its node"

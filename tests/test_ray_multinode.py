"""The Ray engine on a simulated multi-node cluster (ray.cluster_utils.Cluster: 2 nodes x 2 logical GPUs).

Checked: each node group's StateManager and workers run on their own Ray node (node affinity);
every job's states live on the node its placement chose, and nowhere else, for the whole run;
jobs on different nodes both complete. Last: a node is lost, and its job is re-placed on the
other node and restored from its checkpoint in the shared checkpoint directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading

import numpy as np
import pytest

import plexrl
from plexrl import errors
from plexrl.runtime.host_buffers import node_folder
from tests.helpers import datum

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


@pytest.fixture(scope="class")
def cluster(two_nodes):
    """One RayCluster for the tests of a class (its six actors, each starting a Python with torch,
    take seconds); closed as the class ends, before the node-loss test opens its own."""
    from plexrl.engines.ray_engine import RayCluster

    with RayCluster(address="auto", devices_per_node=2, device_memory_bytes=16 * MiB, host_memory_bytes=64 * MiB,
                    profile_steps=2) as cluster:
        yield cluster


class TestOneRuntimeOnBothNodes:
    """Two tests on one RayCluster: each closes its jobs, so the other finds both nodes free
    whatever the order."""

    def test_placement_honoured_and_affinity_kept(self, cluster, micro_model):
        assert len(cluster.nodes) == 2 and len(set(cluster.node_ids)) == 2
        for group, node_id in enumerate(cluster.node_ids):
            assert ray.get(cluster.nodes[group].where.remote()) == node_id
            for device in (2 * group, 2 * group + 1):
                assert ray.get(cluster.workers[device].where.remote()) == node_id
        # Two jobs that each keep a whole node busy: the Placer must give them different nodes.
        with contextlib.ExitStack() as closing:
            services = {job: closing.enter_context(cluster.service_client(job, profile=busy_profile(job),
                                                                          admission_timeout=TIMEOUT_S))
                        for job in ("job-0", "job-1")}
            jobs = {job: cluster.metrics()["placement"][job]["group"] for job in services}
            assert sorted(jobs.values()) == [0, 1]
            threads = [threading.Thread(target=train, args=(services[job], micro_model, seed))
                       for seed, job in enumerate(jobs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S * 3)
            held = cluster.node_states()
            for job, group in jobs.items():
                mine = [sid for sid in held[group] if sid.startswith(job + "/")]
                assert f"{job}/policy" in mine and any("@sampler" in sid for sid in mine)
                elsewhere = [sid for sid in held[1 - group] if sid.startswith(job + "/")]
                assert not elsewhere, f"{job} has a state on another node"
            metrics = cluster.metrics()
            assert all(metrics["jobs"][job]["requests"] >= 5 and metrics["jobs"][job]["failed"] == 0 for job in jobs)
            transitions = [e for e in cluster.events() if e["event"] == "transition" and e.get("job") in jobs]
            assert transitions and all(e["node"] == jobs[e["job"]] for e in transitions), "a state moved off its node"

    def test_a_job_migrates_between_nodes_and_is_re_placed_from_its_profile(self, cluster, micro_model):
        migrations = cluster.metrics()["migrations"]  # the other test's jobs migrate none
        with cluster.service_client("mover") as service:
            trainer = service.create_training_client(base_model=micro_model, seed=0)
            reference = service.create_sampling_client(base_model=micro_model)
            for _ in range(2):
                trainer.forward_backward([datum([5, 6, 7, 8])])
                trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
            sampler = trainer.save_weights_and_get_sampling_client()
            before = cluster.fetch_weights(trainer.state)
            source = cluster.metrics()["placement"]["mover"]["group"]

            cluster.migrate("mover", 1 - source)
            held = cluster.node_states()
            assert {"mover/policy", "mover/frozen:micro"} <= set(held[1 - source])
            assert not [sid for sid in held[source] if sid.startswith("mover/")], "a state stayed on the old node"
            np.testing.assert_array_equal(cluster.fetch_weights(trainer.state), before)
            trainer.forward_backward([datum([5, 6, 7, 8])])
            assert trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S).metrics["step"] == 3.0
            out = sampler.sample(plexrl.ModelInput.from_ints([5, 6]),
                                 sampling_params=plexrl.SamplingParams(max_tokens=3, seed=1))
            assert len(out.result(TIMEOUT_S).sequences) == 1
            assert len(reference.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7])).result(TIMEOUT_S)) == 3
            assert cluster.metrics()["migrations"] == migrations + 1

            for step in range(2):  # step marks: the placer measures the job's profile at the second
                trainer.forward_backward([datum([5, 6, 7, 8])])
                trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
                cluster.report_step("mover", step)
            # It looked at the measured profile (whether it then moved the job, kept it, or found no
            # room with the job's slack depends on the measured times).
            assert cluster.metrics()["placement"]["mover"]["replacements"] >= 1


def test_node_loss_restores_the_job_from_its_checkpoint(two_nodes, micro_model, tmp_path):
    """Runs last in this module: it removes the worker node."""
    from plexrl.engines.ray_engine import RayCluster

    worker = next(iter(two_nodes.worker_nodes))
    with RayCluster(address="auto", devices_per_node=2, device_memory_bytes=16 * MiB, host_memory_bytes=64 * MiB,
                    checkpoint_dir=tmp_path / "shared", checkpoint_every_steps=1) as cluster:
        lost = cluster.node_ids.index(worker.node_id)
        services = {job: cluster.service_client(job, profile=busy_profile(job), admission_timeout=TIMEOUT_S)
                    for job in ("job-0", "job-1")}
        placed = {job: cluster.metrics()["placement"][job]["group"] for job in services}
        victim = next(job for job, group in placed.items() if group == lost)
        services[next(job for job in services if job != victim)].close()  # room on the surviving node
        trainer = services[victim].create_training_client(base_model=micro_model, seed=0)
        reference = services[victim].create_sampling_client(base_model=micro_model)
        for step in range(2):
            trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
            trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
            cluster.report_step(victim, step)  # checkpoints every step
        checkpointed = cluster.fetch_weights(trainer.state)
        sampler = trainer.save_weights_and_get_sampling_client()
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)  # work after the checkpoint

        two_nodes.remove_node(worker)
        with pytest.raises(errors.WorkerFailed, match="from its checkpoint of step 1") as failure:
            trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
        assert failure.value.retriable
        point = cluster.recovery_point(victim)
        assert point["group"] != lost and point["step"] == 1
        np.testing.assert_array_equal(cluster.fetch_weights(trainer.state), checkpointed)
        resumed = trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
        assert resumed.metrics["step"] == 3.0, "the Adam step count comes back with the checkpoint"
        out = sampler.sample(plexrl.ModelInput.from_ints([5, 6]), sampling_params=plexrl.SamplingParams(max_tokens=3, seed=1))
        assert len(out.result(TIMEOUT_S).sequences) == 1  # the sampler follows the snapshot synced on restore
        assert len(reference.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7])).result(TIMEOUT_S)) == 3
        held = cluster.node_states()
        assert f"{victim}/policy" in held[point["group"]] and held[lost] == []
        recovery = cluster.metrics()["recovery"]
        assert recovery["node_losses"] == 1 and recovery["lost_work_s"] > 0
        assert recovery["restored_from_checkpoint"] == 1 and recovery["restored_from_base"] == 1  # the reference
        kinds = [e["event"] for e in cluster.events() if e["event"] in ("node_lost", "job_restored")]
        assert kinds == ["node_lost", "job_restored"]
    # The simulated node shares this machine's /dev/shm: remove what its dead runtime left there
    # (a real lost node takes its shared memory with it).
    shutil.rmtree(node_folder(cluster.name, lost), ignore_errors=True)

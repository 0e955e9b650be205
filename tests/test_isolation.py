"""Tenants kept apart, faults contained (issue: "Tenants kept apart"): on every engine, no name can alias another job's state or leave its folder, a failed restore or a dead
idle device fails only the request that needed it, calls queued behind a retriable failure do
not run, sample calls are bounded, and stale shared memory of dead drivers is swept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import plexrl
from plexrl import engines, errors
from plexrl.runtime import host_buffers
from tests.helpers import datum, rl_job

MiB = 1 << 20
TIMEOUT_S = 120
ENGINES = ["local", "process", pytest.param("ray", marks=pytest.mark.ray)]


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_node")  # one Ray instance for the module
    return request.param


def open_engine(engine: str, **settings):
    settings.setdefault("device_memory_bytes", 64 * MiB)
    settings.setdefault("host_memory_bytes", 256 * MiB)
    return engines.open_cluster(engine, settings.pop("devices", 1), **settings)


@pytest.fixture(scope="module", params=ENGINES)
def cluster(request, tmp_path_factory):
    """One cluster per engine, on the defaults, for the tests that need nothing else (a Ray
    cluster's actors take seconds to start): each test closes its jobs, so the next finds it empty."""
    if request.param == "ray":
        request.getfixturevalue("ray_node")
    with open_engine(request.param, workdir=tmp_path_factory.mktemp("cluster"), max_sampled_tokens=4096) as c:
        yield c


@pytest.fixture(scope="module")
def solo(tiny_model):
    """Weights of each job of `rl_job` run alone (seed -> weights), on the local engine."""
    out = {}
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as c:
        for seed in (1, 2, 3):
            out[seed] = c.fetch_weights(rl_job(c, f"solo-{seed}", tiny_model, seed=seed, steps=2).state)
    return out


@pytest.mark.parametrize("job, model", [
    ("x/y", "p"), ("../../../../tmp/esc", "p"), ("b/../a", "p"), ("", "p"), ("a", ".."), ("a", "y/p"),
    ("a", "p@sampler"), ("a" * 129, "p"), (".hidden", "p"),
])
def test_names_that_could_alias_or_escape_are_refused(job, model, tiny_model):
    with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=16 * MiB) as c:
        with pytest.raises(errors.InvalidInput, match=r"expected 1 to 128 letters, digits"):
            c.service_client(job).create_training_client(base_model=tiny_model, name=model)
        assert c.metrics()["residency"] == {}, "nothing was created"


def test_spilled_states_of_look_alike_names_never_share_a_file(engine, tiny_model, solo):
    """Three jobs on one device whose host budget holds ~3.3 states: states spill and restore
    all the time; names that once mapped to one spill file ('x__y'/'p' and 'x'/'y__p') stay apart."""
    with plexrl.LocalCluster(devices=1) as probe:
        state = probe.service_client("probe").create_training_client(base_model=tiny_model).state
    budget = int(state.host_bytes * 3.3)
    with open_engine(engine, device_memory_bytes=state.device_bytes * 2 + state.activation_reserve_bytes,
                     host_memory_bytes=budget) as c:
        results = {}

        def run(job, name, seed):
            trainer = rl_job(c, job, tiny_model, seed=seed, steps=2, name=name)
            results[seed] = c.fetch_weights(trainer.state)

        threads = [threading.Thread(target=run, args=a) for a in (("x__y", "p", 1), ("x", "y__p", 2), ("z", "q", 3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 3)
        moved = c.metrics()["transitions"]
    assert moved.get("spill", 0) > 0 and moved.get("restore", 0) > 0, moved
    for seed in (1, 2, 3):
        np.testing.assert_array_equal(results[seed], solo[seed], err_msg=f"job of seed {seed} changed by the others")


def test_a_job_cannot_load_another_jobs_checkpoint(cluster, tiny_model):
    with cluster.service_client("a") as job_a, cluster.service_client("b") as job_b:
        a = job_a.create_training_client(base_model=tiny_model)
        b = job_b.create_training_client(base_model=tiny_model)
        saved = a.save_state("mine").result(TIMEOUT_S)
        with pytest.raises(errors.InvalidInput, match="another job's"):
            b.load_state_with_optimizer(saved.path).result(TIMEOUT_S)
        assert a.load_state(saved.path).result(TIMEOUT_S).path == saved.path, "its own job may"
        assert b.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S).metrics["loss:sum"] > 0


def test_a_failed_restore_fails_only_its_request(engine, tiny_model, tmp_path):
    """Truncate a spilled state's file: its next call fails with StateLost, the device keeps
    serving the other model, and a checkpoint load revives the state."""
    with plexrl.LocalCluster(devices=1) as probe:
        state = probe.service_client("probe").create_training_client(base_model=tiny_model).state
    with open_engine(engine, device_memory_bytes=state.device_bytes * 3 // 2 + state.activation_reserve_bytes,
                     host_memory_bytes=state.host_bytes * 3 // 2,
                     workdir=tmp_path) as c:
        service = c.service_client("job")  # one job: admission counts host memory, spilling is within a job
        victim = service.create_training_client(base_model=tiny_model, seed=0, name="victim")
        saved = victim.save_state("good").result(TIMEOUT_S)
        other = service.create_training_client(base_model=tiny_model, seed=1, name="other")  # spills the victim
        assert c.metrics()["residency"]["job/victim"] == "disk"
        for spill in (tmp_path / "node0" / "spill").glob("*.safetensors"):
            spill.write_bytes(spill.read_bytes()[:100])
        with pytest.raises(errors.StateLost, match="spill file"):
            victim.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S)
        with pytest.raises(errors.StateLost, match="restore it from a checkpoint"):
            victim.optim_step(plexrl.AdamParams()).result(TIMEOUT_S)
        assert other.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S).metrics["loss:sum"] > 0
        victim.load_state_with_optimizer(saved.path).result(TIMEOUT_S)
        assert victim.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S).metrics["loss:sum"] > 0


def _kill_worker(cluster, device: int) -> None:
    process = cluster.workers[device]._process
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def test_an_idle_device_process_that_dies_is_restarted(tiny_model):
    """Process engine: kill a device's process between calls. The next call fails retriably
    (WorkerFailed), the worker is back, and the retried job ends as if nothing happened: with the
    bits of the same job without the kill (run on the local engine, which gives the process
    engine's bits: test_engines' transparency test)."""
    def train(engine: str, kill: bool):
        with open_engine(engine) as c:
            trainer = c.service_client("job").create_training_client(base_model=tiny_model, seed=0)
            for step in range(3):
                if kill and step == 1:
                    _kill_worker(c, 0)
                for _ in range(2):
                    try:
                        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
                        break
                    except errors.WorkerFailed as failure:
                        assert failure.retriable
                trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
            other = c.service_client("new-job").create_sampling_client(base_model=tiny_model)
            assert other.compute_logprobs(plexrl.ModelInput.from_ints([5, 6])).result(TIMEOUT_S)
            return c.fetch_weights(trainer.state), c.metrics()["recovery"]

    clean, _ = train("local", False)
    recovered, recovery = train("process", True)
    np.testing.assert_array_equal(recovered, clean)
    assert recovery["worker_restarts"] == 1 and recovery["restored_states"] >= 1


def test_calls_queued_behind_a_retriable_failure_do_not_run(tiny_model):
    """forward_backward and optim_step submitted together; the device dies inside forward_backward:
    the queued optim_step fails retriably instead of applying a momentum-only step (the weights
    are those of the same job without the failure, run on the local engine as in the test above)."""
    def dies(datums, logprobs):
        os._exit(1)

    def train(engine: str, kill: bool):
        with open_engine(engine) as c:
            trainer = c.service_client("job").create_training_client(base_model=tiny_model, seed=0)
            trainer.forward_backward([datum([5, 6, 7, 8])])
            trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
            if kill:
                doomed = trainer.forward_backward_custom([datum([5, 6, 7, 8])], dies)
                queued = trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2))
                for future in (doomed, queued):
                    with pytest.raises(errors.WorkerFailed):
                        future.result(TIMEOUT_S)
            trainer.forward_backward([datum([5, 6, 7, 8])])
            assert trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S).metrics["step"] == 2
            return c.fetch_weights(trainer.state)

    np.testing.assert_array_equal(train("process", True), train("local", False))


def test_sample_calls_are_bounded(cluster, tiny_model):
    """The cluster's max_sampled_tokens is 4096."""
    with cluster.service_client("greedy") as service:
        sampler = service.create_sampling_client(base_model=tiny_model)
        t0 = time.perf_counter()
        for num in (10**5, 10**7):
            with pytest.raises(errors.InvalidInput, match=f"num_samples={num}"):
                sampler.sample(plexrl.ModelInput.from_ints([5, 6]), num, plexrl.SamplingParams(max_tokens=8)).result(5)
        assert time.perf_counter() - t0 < 5, "refused before anything ran"
        out = sampler.sample(plexrl.ModelInput.from_ints([5, 6]), 4, plexrl.SamplingParams(max_tokens=4, seed=0))
        assert len(out.result(TIMEOUT_S).sequences) == 4


def test_stale_shared_memory_of_a_dead_driver_is_swept(micro_model):
    """A driver killed with -9 leaves its node folder in /dev/shm; the next cluster removes it."""
    script = (
        "import os, plexrl\n"
        "c = plexrl.ProcessCluster(devices=1, device_memory_bytes=16 << 20, host_memory_bytes=64 << 20)\n"
        f"c.service_client('j').create_training_client(base_model={micro_model!r})\n"
        "print(c.name, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    name = done.stdout.split()[-1]
    left = list(host_buffers.shm_root().glob(f"{name}-node*"))
    assert left, "the killed driver left its host buffers (else this test tests nothing)"
    with plexrl.LocalCluster(devices=1, device_memory_bytes=16 * MiB, host_memory_bytes=64 * MiB):
        assert not any(folder.exists() for folder in left), "swept at start-up"


def test_a_second_controller_of_a_job_owns_only_what_it_created(cluster, tiny_model):
    """Two service clients of one job: closing the second frees its model (and its snapshots)
    only; the first one's model keeps working; the job ends with its last client."""
    c = cluster
    assert c.metrics()["residency"] == {}, "another test left a state behind"
    first, second = c.service_client("shared"), c.service_client("shared")
    try:
        mine = first.create_training_client(base_model=tiny_model, name="p")
        theirs = second.create_training_client(base_model=tiny_model, name="q")
        theirs.save_weights_and_get_sampling_client()
        before = c.fetch_weights(mine.state)
        second.close()
        assert sorted(c.metrics()["residency"]) == ["shared/p"]
        with pytest.raises(errors.UnknownModel):
            theirs.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S)
        np.testing.assert_array_equal(c.fetch_weights(mine.state), before)
        assert mine.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S).metrics["loss:sum"] > 0
        first.close()
        assert c.metrics()["residency"] == {}
    except BaseException:
        c.finish_job("shared")  # what a failed check left: the next test finds the cluster empty
        raise

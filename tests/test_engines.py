"""The one runtime on its three engines (plexrl/engines/*): local (one process), process (a
process per device, no Ray) and Ray (one Ray node with 2 logical GPUs). Every test runs on each
engine where it applies (a device of the local engine is a thread: it cannot die alone).

Invariants checked, as in tests/test_runtime_invariants.py but across processes:
- transparency: a job multiplexed with another ends bitwise equal to the same job run alone on
  the local engine (same seeds, one thread per device);
- calls of one model run in submission order, whatever order they are delivered in;
- a bad call fails through its future and the cluster carries on;
- a worker killed mid-call fails that call with the retriable WorkerFailed, the worker is
  restarted, the state is back to its last completed call, and the job continues.
One cluster per engine for the module (start-up dominates the cost).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import plexrl
from tests.helpers import datum, reserve_bytes, rl_job, weights
from plexrl import errors

MiB = 1 << 20
TIMEOUT_S = 120  # generous: two cores are shared with other test runs


@pytest.fixture(scope="module")
def trainer_bytes(tiny_model):
    from plexrl.runtime.state import ModelState, load_module

    return ModelState("x/p", "x", "p", load_module(tiny_model), True, tiny_model).device_bytes


@pytest.fixture(scope="module", params=["local", "process", pytest.param("ray", marks=pytest.mark.ray)])
def cluster(request, trainer_bytes, tiny_model):
    from plexrl import engines

    if request.param == "ray":
        request.getfixturevalue("ray_node")
    # Room for one trainer and one snapshot per device next to the activation reserve: two jobs must keep switching.
    budget = trainer_bytes + trainer_bytes // 4 + 4096 + reserve_bytes(tiny_model)
    with engines.open_cluster(request.param, 2, device_memory_bytes=budget, host_memory_bytes=256 * MiB) as c:
        yield c


def needs_worker_processes(cluster) -> None:
    if cluster.engine == "local":
        pytest.skip("the local engine's devices are threads of this process: one cannot die alone")


def test_every_function_end_to_end(cluster, tiny_model):
    from transformers import AutoModelForCausalLM

    trainer = cluster.service_client(job="api").create_training_client(base_model=tiny_model, seed=0)
    ids = [5, 6, 7, 8, 9]
    fb = trainer.forward_backward([datum(ids)], loss_fn="cross_entropy")
    step = trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3))
    assert fb.result(TIMEOUT_S).metrics["loss:sum"] > 0
    assert step.result(TIMEOUT_S).metrics["step"] == 1.0
    sampler = trainer.save_weights_and_get_sampling_client()
    out = sampler.sample(plexrl.ModelInput.from_ints(ids), num_samples=2,
                         sampling_params=plexrl.SamplingParams(max_tokens=4, seed=7)).result(TIMEOUT_S)
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in out.sequences)
    scored = sampler.compute_logprobs(plexrl.ModelInput.from_ints(ids)).result(TIMEOUT_S)
    assert scored[0] is None and all(v < 0 for v in scored[1:])
    saved = trainer.save_state("step-1").result(TIMEOUT_S)
    reloaded = AutoModelForCausalLM.from_pretrained(saved.path)
    flat = np.concatenate([p.detach().numpy().reshape(-1) for p in reloaded.parameters()])
    np.testing.assert_array_equal(flat, cluster.fetch_weights(trainer.state))
    metrics = cluster.metrics()
    assert metrics["jobs"]["api"]["requests"] >= 5 and metrics["jobs"]["api"]["failed"] == 0
    assert metrics["engine"] == cluster.engine and metrics["devices"] == 2


def test_transparency_multiplexed_equals_local_alone(cluster, tiny_model, trainer_bytes):
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as local:
        solo = local.fetch_weights(rl_job(local, "job-a", tiny_model, seed=1, steps=2).state)
    switches_before = cluster.metrics()["switches"]
    trainers = {}
    def run(job, seed):
        trainers[job] = rl_job(cluster, job, tiny_model, seed, steps=2)

    threads = [threading.Thread(target=run, args=(j, s))
               for j, s in (("job-a", 1), ("job-b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 4)
    assert cluster.metrics()["switches"] - switches_before > 4, "the budget was meant to force switches"
    np.testing.assert_array_equal(cluster.fetch_weights(trainers["job-a"].state), solo,
                                  err_msg=f"running on the {cluster.engine} engine (multiplexed) changed job-a's weights")
    assert not np.array_equal(cluster.fetch_weights(trainers["job-b"].state), solo)


def test_a_controller_actor_attaches_by_name(cluster, tiny_model):
    """A job's controller as its own Ray actor: it finds the cluster by name (control plane, node
    and worker actors are named), is placed by the same placer, and trains transparently."""
    if cluster.engine != "ray":
        pytest.skip("attaching from another process is the Ray engine's")
    import ray

    from plexrl.engines.ray_engine import RayCluster

    @ray.remote(num_cpus=0)
    class Controller:
        def train(self, name, model_dir):
            front = RayCluster.attach(name)
            weights = front.fetch_weights(rl_job(front, "actor-job", model_dir, seed=1, steps=2).state)
            front.close()  # an attached front stops nothing but itself
            return weights

    controller = Controller.remote()
    weights = ray.get(controller.train.remote(cluster.name, tiny_model), timeout=TIMEOUT_S * 4)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB) as local:
        solo = local.fetch_weights(rl_job(local, "actor-job", tiny_model, seed=1, steps=2).state)
    np.testing.assert_array_equal(weights, solo)
    assert cluster.metrics()["placement"]["actor-job"]["group"] == 0  # placed by the one control plane
    with pytest.raises(plexrl.errors.ConfigError, match="no PlexRL cluster named"):
        RayCluster.attach("no-such-cluster")


def test_calls_of_one_model_run_in_submission_order(cluster, tiny_model):
    trainer = cluster.service_client(job="order").create_training_client(base_model=tiny_model, seed=0)
    futures = [trainer.optim_step(plexrl.AdamParams(learning_rate=1e-4)) for _ in range(12)]
    steps = [f.result(TIMEOUT_S).metrics["step"] for f in futures]
    assert steps == [float(i) for i in range(1, 13)]



@pytest.mark.parametrize("evicted", [False, True], ids=["resident", "evicted"])
def test_a_state_on_a_busy_device_runs_on_an_idle_one_without_waiting(cluster, trainer_bytes, tiny_model, tmp_path,
                                                                      evicted):
    """Job B's snapshot is on device 0 when job A's long call is dispatched there: resident beside
    A's trainer, or evicted by A's load. B's next call goes to idle device 1 and runs at once.
    Resident: device 0's worker lets go of B's clean copy when A's call is done
    (StepRunner._offload_elsewhere). Evicted: the node's view lets go of it as A's call is dispatched
    (StepRunner._let_go_here), where it used to stay claimed until A's call ended. Either offload is
    booked when device 0's worker answers. A's call holds device 0 until the test opens a gate,
    so B's call can only end first if it did not wait for A's. A cluster of its own: where the
    states of other tests lie would decide whether A's load evicts B."""
    if cluster.engine == "ray":
        pytest.skip("holds a device through the node object, which the Ray engine keeps in its actor")
    from plexrl import engines

    snapshot_room = 0 if evicted else trainer_bytes // 4 + 4096
    budget = trainer_bytes + snapshot_room + 4096 + reserve_bytes(tiny_model)
    with engines.open_cluster(cluster.engine, 2, device_memory_bytes=budget, host_memory_bytes=256 * MiB) as own:
        group = own.nodes[0].target.scheduler
        prompt = plexrl.ModelInput.from_ints([5, 6, 7])
        sampler = own.service_client(job="resident-b").create_training_client(
            base_model=tiny_model, seed=0).save_weights_and_get_sampling_client()
        a = own.service_client(job="busy-a").create_training_client(base_model=tiny_model, seed=1)
        gate = tmp_path / "a-may-end"  # a file: the loss runs in the device's worker, a process on some engines
        b_on = lambda: own.residency()[sampler.state.state_id]  # noqa: E731

        def long_loss(datums, logprobs):
            deadline = time.monotonic() + TIMEOUT_S
            while not gate.exists() and time.monotonic() < deadline:  # A holds device 0 (one call at a time)
                time.sleep(0.01)
            return sum(lp.sum() for lp in logprobs), {}

        try:
            with group.lock:
                group.hold([1])
            try:
                sampler.compute_logprobs(prompt).result(TIMEOUT_S)
                assert b_on() == "device:0"
                a_call = a.forward_backward_custom([datum([5, 6, 7, 8])], long_loss)
                dispatched = lambda: any(e["event"] == "dispatch" for e in own.events("busy-a"))  # noqa: E731
                assert wait_for(dispatched), "A's call was not dispatched to device 0"
            finally:
                with group.lock:
                    group.hold([1], held=False)
            expected = "host" if evicted else "device:0"
            assert wait_for(lambda: b_on() == expected), f"B's snapshot is on {b_on()} while A runs, not {expected}"
            sampler.compute_logprobs(prompt).result(TIMEOUT_S)
            assert not a_call.done(), "B's call waited for A's call on the other device"
            assert b_on() == "device:1"
        finally:
            gate.touch()
        a_call.result(TIMEOUT_S)
        offloads = lambda: [e for e in own.events("resident-b" if not evicted else "busy-a")  # noqa: E731
                            if e["event"] == "transition" and e["kind"] == "offload"
                            and e["state"] == sampler.state.state_id and e["device"] == 0]
        assert wait_for(offloads), "the offload on device 0 was not booked"  # when its worker answers, after A's call
        assert offloads()[-1]["bytes"] == 0  # a clean copy: nothing moves
        assert b_on() == "device:1"  # booking the offload on device 0 left B's residency alone


def wait_for(condition, timeout_s: float = TIMEOUT_S):
    """Poll `condition` until it holds (its value) or `timeout_s` passes (its last value)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value

def test_bad_call_fails_through_its_future_and_the_cluster_carries_on(cluster, tiny_model):
    trainer = cluster.service_client(job="bad").create_training_client(base_model=tiny_model, seed=0)

    def broken_loss(datums, logprobs):
        raise ArithmeticError("deliberately broken loss")

    failed = trainer.forward_backward_custom([datum([5, 6, 7])], broken_loss)
    with pytest.raises(errors.ExecutionError, match="deliberately broken loss"):
        failed.result(TIMEOUT_S)
    with pytest.raises(errors.InvalidInput, match="outside the vocabulary"):
        trainer.forward_backward([datum([5, 6, 10**6])]).result(TIMEOUT_S)
    assert trainer.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S).metrics["loss:sum"] > 0


def test_worker_death_fails_the_call_and_the_job_continues(cluster, tiny_model):
    """Kills a worker process (the engine restarts it): the last tests of the module do."""
    needs_worker_processes(cluster)
    trainer = cluster.service_client(job="crash").create_training_client(base_model=tiny_model, seed=0)
    trainer.forward_backward([datum([5, 6, 7, 8])])
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
    before = cluster.fetch_weights(trainer.state)
    restarts = cluster.metrics()["recovery"]["worker_restarts"]

    def dies_mid_call(datums, logprobs):
        os._exit(1)  # the worker process ends inside forward_backward

    with pytest.raises(errors.WorkerFailed) as failure:
        trainer.forward_backward_custom([datum([5, 6, 7, 8])], dies_mid_call).result(TIMEOUT_S)
    assert failure.value.retriable
    np.testing.assert_array_equal(cluster.fetch_weights(trainer.state), before,
                                  err_msg="the state is not back to its last completed call")
    assert trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S).metrics["loss:sum"] > 0
    assert trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S).metrics["step"] == 2.0
    recovery = cluster.metrics()["recovery"]
    assert recovery["worker_restarts"] == restarts + 1 and recovery["restored_states"] >= 1
    assert any(e["event"] == "worker_failed" and e["job"] == "crash" for e in cluster.events())


def set_failpoint(cluster, point) -> None:
    """`fail_at(point)` on every worker; one that died may still be restarting (callers hear of a
    death at once, before the new process is up): wait for it."""
    from plexrl.runtime import remote

    for worker in cluster.workers.values():
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                remote.get(worker.fail_at.remote(point), TIMEOUT_S)
                break
            except Exception as exc:
                if not remote.is_gone(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_a_torn_write_back_loses_the_state_until_it_is_restored(cluster, tiny_model):
    """A worker that dies halfway through writing a state's host copy back leaves that copy torn:
    the runtime must not restore from it. The model fails with StateLost until a checkpoint is
    loaded, then carries on from the checkpoint."""
    needs_worker_processes(cluster)
    trainer = cluster.service_client(job="torn").create_training_client(base_model=tiny_model, seed=0)
    trainer.forward_backward([datum([5, 6, 7, 8])])
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
    saved = trainer.save_state("before-tear").result(TIMEOUT_S)
    checkpointed = cluster.fetch_weights(trainer.state)
    set_failpoint(cluster, "writeback")
    with pytest.raises(errors.StateLost, match="half written"):
        trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
    set_failpoint(cluster, None)
    with pytest.raises(errors.StateLost, match="restore it from a checkpoint"):
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
    trainer.load_state_with_optimizer(saved.path).result(TIMEOUT_S)
    np.testing.assert_array_equal(cluster.fetch_weights(trainer.state), checkpointed)
    trainer.forward_backward([datum([5, 6, 7, 8])])
    assert trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S).metrics["step"] == 2.0
    torn = [e for e in cluster.events() if e["event"] == "worker_failed" and e["job"] == "torn"]
    assert torn and torn[-1]["torn"] == ["torn/policy"]


METRICS_KEYS = {"switches", "device_busy_s", "transition_bytes", "transition_s", "device_busy_s_per_device",
                "transitions", "jobs", "recovery", "residency", "bandwidth_gbps", "policy", "devices", "nodes",
                "engine", "uptime_s", "placement", "migrations", "admission", "writebacks", "writeback_bytes",
                "writeback_zeroed_bytes", "writeback_s", "prefetches", "prefetch_bytes", "prefetch_s",
                "prefetch_exposed_s", "device_budget", "activation_reserves", "read_replicas", "histograms", "queued"}


def test_metrics_have_one_layout_on_every_engine(cluster, tiny_model):
    trainer = cluster.service_client(job="layout").create_training_client(base_model=tiny_model, seed=0)
    trainer.forward_backward([datum([5, 6, 7])]).result(TIMEOUT_S)
    metrics = cluster.metrics()
    assert set(metrics) == METRICS_KEYS
    assert metrics["read_replicas"] is (cluster.engine != "local")  # the default: on where devices are processes
    assert {"worker_restarts", "restored_states", "node_losses"} <= set(metrics["recovery"])
    assert metrics["residency"]["layout/policy"].startswith("device:")
    assert metrics["activation_reserves"][tiny_model] == trainer.state.activation_reserve_bytes > 0
    assert set(metrics["device_budget"]) == {0, 1} and metrics["device_budget"][1]["activation_reserve_of"] == tiny_model
    assert metrics["jobs"]["layout"]["placement"]["node"] == 0


@pytest.mark.parametrize("engine", ["local", "process"])
def test_migration_checkpoints_and_event_log_are_the_same_on_every_engine(engine, tiny_model, tmp_path):
    """Two node groups: a job checkpointed every step, moved by hand between its steps, its events
    written as they happen; its weights those of the job left in place, on the local engine (which
    gives every engine's bits: the transparency test above). (On Ray: tests/test_ray_multinode.py,
    which has two Ray nodes.)"""
    from plexrl import engines

    def train(engine: str, migrate: bool, folder):
        cls = engines.engine_class(engine)
        with cls(devices=2, nodes=2, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB, profile_steps=1000,
                 workdir=folder, checkpoint_every_steps=1, event_log=folder / "events.jsonl") as c:
            trainer = c.service_client("job").create_training_client(base_model=tiny_model, seed=0)
            for step in range(3):
                if migrate and step == 1:
                    c.migrate("job", 1 - c.metrics()["placement"]["job"]["group"])
                trainer.forward_backward([datum([5, 6, 7, 8])]).result(TIMEOUT_S)
                trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
                c.report_step("job", step)
            return c.fetch_weights(trainer.state), c.metrics(), c.events()

    still, _, _ = train("local", False, tmp_path / "still")
    moved, metrics, events = train(engine, True, tmp_path / "moved")
    np.testing.assert_array_equal(still, moved, err_msg="a migration changed the job's results")
    assert metrics["migrations"] == 1 and metrics["engine"] == engine
    assert sorted(p.name for p in (tmp_path / "moved" / "checkpoints" / "job" / "policy").iterdir()) == \
        ["auto-step-2", "migration"], "the latest automatic checkpoint (older ones removed) and the migration's"
    import json

    written = [json.loads(line) for line in (tmp_path / "moved" / "events.jsonl").read_text().splitlines()]
    assert sorted(map(json.dumps, written)) == sorted(map(json.dumps, events)), "the log file has every event"


def test_served_over_the_network_equals_the_in_process_api(cluster, tiny_model, tmp_path):
    """`plexrl serve` on this engine: a Tinker SDK client's training and sampling give the bits
    the in-process API gives on the same cluster."""
    import os

    import numpy as np

    tinker = pytest.importorskip("tinker")
    from tinker import types

    from plexrl.serve.app import create_app
    from plexrl.serve.limits import Limits
    from plexrl.serve.server import Server
    from plexrl.serve.service import TinkerService
    from plexrl.serve.store import Store
    from plexrl.serve.tenants import Tenants

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    ids = [5, 6, 7, 8, 9]
    local = cluster.service_client(job="in-process").create_training_client(base_model=tiny_model, seed=0)
    local.forward_backward([datum(ids)], "cross_entropy").result(TIMEOUT_S)
    local.optim_step(plexrl.AdamParams(learning_rate=1e-2, beta2=0.95, eps=1e-12)).result(TIMEOUT_S)
    expected = local.forward([datum(ids)], "cross_entropy").result(TIMEOUT_S).loss_fn_outputs[0]["logprobs"].to_numpy()

    service = TinkerService(cluster, Store(tmp_path), {tiny_model: tiny_model}, Tenants(), Limits(poll_hold_s=1.0))
    with Server(create_app(service)) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key="tml-engines-0123456789abcdef")
        remote = client.create_lora_training_client(tiny_model, rank=0).result(TIMEOUT_S)
        wire = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
        remote.forward_backward([wire], "cross_entropy").result(TIMEOUT_S)
        remote.optim_step(types.AdamParams(learning_rate=1e-2)).result(TIMEOUT_S)
        got = remote.forward([wire], "cross_entropy").result(TIMEOUT_S).loss_fn_outputs[0]["logprobs"]
        assert np.array_equal(np.asarray(got.data, dtype=np.float32), expected)
        sampler = remote.save_weights_and_get_sampling_client().result(TIMEOUT_S)
        assert len(sampler.sample(types.ModelInput.from_ints(ids), 2, types.SamplingParams(max_tokens=3))
                   .result(TIMEOUT_S).sequences) == 2
        client.close("success").result(TIMEOUT_S)
    service.close()

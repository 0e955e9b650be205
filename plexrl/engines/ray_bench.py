"""What the Ray engine adds per request, next to the process and local engines and to bare Ray,
measured in one run.

- no-op overhead: submit -> driver -> node actor (group queue, policy) -> worker actor -> future,
  on a resident state, awaited one at a time (latency) and pipelined (per request);
- references, timed in the same run: a bare Ray actor method round trip, and a bare chain of the
  engine's shape (driver -> a threaded actor that calls a second actor and waits), the floor of
  two hops per request (driver -> node, node -> worker) with nothing of ours on the path;
- recovery: from a worker's death mid-call to the job's next successful optimizer step, and from
  a node's loss to the next step of its job restored on another node (simulated 2-node cluster).

`python -m plexrl.engines.ray_bench [N]` prints the figures as JSON (starts a local Ray with 2 logical GPUs).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import ray

import plexrl
from plexrl import errors
from plexrl.bench import dispatch
from plexrl.runtime.host_buffers import node_folder


class _Echo:
    def noop(self) -> None:
        return None


class _Relay:
    """A node actor's shape without the node: forward each call to another actor and wait."""

    def __init__(self, target) -> None:
        self.target = target

    def noop(self) -> None:
        return ray.get(self.target.noop.remote())


def _round_trip_ms(actor, n: int) -> float:
    ray.get(actor.noop.remote())
    t0 = time.perf_counter()
    for _ in range(n):
        ray.get(actor.noop.remote())
    return (time.perf_counter() - t0) / n * 1e3


def bare_ray_ms(n: int) -> tuple[float, float]:
    """(one hop, two hops through a threaded relay) in milliseconds per awaited call."""
    echo = ray.remote(_Echo).options(num_cpus=0).remote()
    relay = ray.remote(_Relay).options(num_cpus=0, max_concurrency=8).remote(echo)
    one, two = _round_trip_ms(echo, n), _round_trip_ms(relay, n)
    ray.kill(relay)
    ray.kill(echo)
    return one, two


def recovery_s(trainer, datum) -> float:
    """Seconds from a worker's death (inside a call) to the job's next successful step."""

    def dies(datums, logprobs):
        os._exit(1)

    failed = trainer.forward_backward_custom([datum], dies)
    try:
        failed.result()
    except errors.WorkerFailed:
        pass
    died = time.perf_counter()  # the failure is known; the job retries its step now
    trainer.forward_backward([datum]).result()
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result()
    return time.perf_counter() - died


def _lose_a_node_under_a_job(cluster, lost: int, remove, model_dir: str) -> float:
    """Place two busy jobs (one per node group), keep the one on group `lost`, train it two
    checkpointed steps, `remove()` its node: seconds until its next successful step."""
    from plexrl.policy import JobProfile, ModelMemory

    datum = plexrl.Datum(plexrl.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})
    busy = {job: JobProfile(job, period_s=1.0, demand=(2.0,) * 20, devices=2,
                            models=(ModelMemory("policy", 1 << 20, 1 << 20),)) for job in ("a", "b")}
    services = {job: cluster.service_client(job, profile=profile) for job, profile in busy.items()}
    victim = next(job for job in services if cluster.metrics()["placement"][job]["group"] == lost)
    for job, service in services.items():
        if job != victim:
            service.close()
    trainer = services[victim].create_training_client(base_model=model_dir)
    for step in range(2):
        trainer.forward_backward([datum])
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result()
        cluster.report_step(victim, step)
    removed = time.perf_counter()
    remove()
    try:
        trainer.forward_backward([datum]).result()
    except errors.WorkerFailed:
        pass  # the job resumes from its restored step
    trainer.forward_backward([datum])
    trainer.optim_step(plexrl.AdamParams(learning_rate=1e-3)).result()
    return time.perf_counter() - removed


def node_loss_s(model_dir: str) -> float:
    """Seconds from a node's removal to the next successful step of the job it held, restored on
    the other node from its checkpoint (2 simulated nodes x 2 logical GPUs, a shared folder)."""
    from ray.cluster_utils import Cluster

    from plexrl.engines.ray_engine import RayCluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2, "include_dashboard": False,
                                                          "object_store_memory": 80 << 20})
    worker = nodes.add_node(num_cpus=1, num_gpus=2, object_store_memory=80 << 20)
    ray.init(address=nodes.address, log_to_driver=False)
    nodes.wait_for_nodes()
    try:
        with RayCluster(address="auto", devices_per_node=2, device_memory_bytes=64 << 20, host_memory_bytes=256 << 20,
                        checkpoint_dir=tempfile.mkdtemp(prefix="plexrl-bench-ckpt-"), checkpoint_every_steps=1) as cluster:
            lost = cluster.node_ids.index(worker.node_id)
            seconds = _lose_a_node_under_a_job(cluster, lost, lambda: nodes.remove_node(worker), model_dir)
        shutil.rmtree(node_folder(cluster.name, lost), ignore_errors=True)  # the dead node's (same machine)
        return seconds
    finally:
        ray.shutdown()
        nodes.shutdown()


def run(model_dir: str, n: int = 200) -> dict:
    from plexrl.engines.ray_engine import RayCluster

    with RayCluster(devices_per_node=2, device_memory_bytes=64 << 20, host_memory_bytes=256 << 20) as cluster:
        trainer = cluster.service_client(job="bench").create_training_client(base_model=model_dir)
        latency, pipelined = dispatch.noop_overhead_ms(cluster, trainer.state, n)
        bare, chain = bare_ray_ms(n)
        datum = plexrl.Datum(plexrl.ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8]})
        recovery = recovery_s(trainer, datum)
    from plexrl.engines.process import ProcessCluster

    with ProcessCluster(devices=2, device_memory_bytes=64 << 20, host_memory_bytes=256 << 20) as cluster:
        trainer = cluster.service_client(job="bench").create_training_client(base_model=model_dir)
        process_latency, process_pipelined = dispatch.noop_overhead_ms(cluster, trainer.state, n)
    local_latency, local_pipelined = dispatch.local_noop_overhead_ms(n)
    ray.shutdown()
    lost_node = node_loss_s(model_dir)
    return {"node_loss_to_next_step_s": lost_node, "requests": n, "ray_noop_latency_ms": latency, "ray_noop_pipelined_ms": pipelined,
            "bare_ray_actor_roundtrip_ms": bare, "bare_ray_two_hop_chain_ms": chain,
            "ray_noop_latency_vs_two_hop_chain": latency / chain, "process_noop_latency_ms": process_latency,
            "process_noop_pipelined_ms": process_pipelined, "local_noop_latency_ms": local_latency,
            "local_noop_pipelined_ms": local_pipelined, "worker_death_to_next_step_s": recovery}


def main(argv: list[str] | None = None) -> int:
    """`plexrl bench ray [--requests N] [--json]`."""
    import argparse

    from plexrl.bench.common import emit
    from plexrl.models.tiny import make_tiny_model

    parser = argparse.ArgumentParser(prog="plexrl bench ray", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    model = make_tiny_model(tempfile.mkdtemp(prefix="plexrl-bench-") + "/tiny", seed=0)
    emit("ray engine: per-request overhead and recovery", run(str(model), args.requests), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

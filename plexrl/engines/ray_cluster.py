"""The Ray engine's front: the same job-facing API as LocalCluster, with the runtime in Ray actors.

    RayCluster (driver: admission, routing tables, futures)
      ├ JobPlacer (runtime.job_placer): which node group a job goes to, with its phase shift
      ├ Router (runtime.router): (job, model) -> node group
      └ per node (NodeAffinitySchedulingStrategy): RayNode actor (StateManager + group scheduler)
                                                   DeviceWorker actor per device (num_gpus=1, max_restarts=-1)

Jobs hold the unchanged plexrl.client classes. A call crosses Ray as (function name, payload,
sequence number): never a closure, never model state. The driver never holds tensors of a
state: nodes load models from their source folder (which every node must see) and return only
numbers; weights leave a node only when asked (`fetch_weights`, as numpy).

Failure semantics: a worker that dies mid-call fails that call with errors.WorkerFailed
(retriable; not retried automatically) and the job continues from its last completed call
(see ray_node.py). A lost node: its jobs are re-placed and restored from their latest
checkpoints (ray_recovery.py). Not yet done on this engine: re-placement from measured profiles.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from plexrl import errors
from plexrl.engines import hosting, ray_functions, ray_setup
from plexrl.engines.ray_node import RayNode
from plexrl.engines.ray_recovery import NodeRecovery
from plexrl.engines.ray_shm import shm_root
from plexrl.engines.ray_worker import DeviceWorker
from plexrl.policy import JobProfile, ModelMemory, ResourceView
from plexrl.runtime.events import EventLog, write_jsonl
from plexrl.runtime.futures import APIFuture
from plexrl.runtime.job_placer import JobPlacer, provisional_profile
from plexrl.runtime.local_cluster import LocalCluster, _check_positive, _checked_policy
from plexrl.runtime.router import Router
from plexrl.runtime.telemetry import Telemetry

MiB = 1 << 20
DeviceWorkerActor = ray.remote(DeviceWorker)
RayNodeActor = ray.remote(RayNode)
NODE_CALL_THREADS = 256  # calls block a node thread while queued; more than any test or job keeps in flight


@dataclass(frozen=True)
class StateHandle:
    """What the driver knows of a model state: names and sizes, never tensors."""

    state_id: str
    job: str
    name: str
    source: str
    trainable: bool
    device_bytes: int
    host_bytes: int


class RayCluster(NodeRecovery):
    # Admission and checkpoint naming are the local engine's, unchanged.
    service_client = LocalCluster.service_client
    _admit = LocalCluster._admit
    _check_open = LocalCluster._check_open
    checkpoint_path = LocalCluster.checkpoint_path

    def __init__(
        self,
        address: str | None = None,
        nodes: int | None = None,
        devices_per_node: int = 2,
        device_memory_bytes: int = 256 * MiB,
        host_memory_bytes: int = 2048 * MiB,
        policy: str = "plexrl",
        placement: str = "phase-shift",
        slot_s: float = 0.05,
        horizon_slots: int = 1024,
        profile_steps: int = 3,
        threads_per_device: int = 1,
        workdir: str | Path | None = None,
        torch_device: str = "cpu",
        checkpoint_dir: str | Path | None = None,
        checkpoint_every_steps: int = 0,
    ):
        self.policy = _checked_policy(policy)
        _check_positive(devices_per_node=devices_per_node, device_memory_bytes=device_memory_bytes,
                        host_memory_bytes=host_memory_bytes, threads_per_device=threads_per_device)
        if placement not in ("phase-shift", "first-fit"):
            raise errors.ConfigError(f"placement={placement!r}; expected 'phase-shift' or 'first-fit'")
        self._owns_ray = False
        self.node_ids = self._find_nodes(address, nodes, devices_per_node)
        nodes = len(self.node_ids)
        self._tmp = tempfile.mkdtemp(prefix="plexrl-ray-") if workdir is None else None
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp)
        self._init_recovery(checkpoint_dir, checkpoint_every_steps)
        self.devices = nodes * devices_per_node
        self.telemetry = Telemetry(EventLog())  # the driver's own events: placements
        self._name = f"plexrl-{uuid.uuid4().hex[:8]}"
        self.workers: dict[int, object] = {}  # device -> worker handle (engines/hosting.py)
        self.nodes = [self._start_node(g, node_id, devices_per_node, device_memory_bytes, host_memory_bytes,
                                       threads_per_device, torch_device) for g, node_id in enumerate(self.node_ids)]
        hosting.get([w.ping.remote() for w in self.workers.values()] + [n.state_ids.remote() for n in self.nodes])
        self.router = Router([])  # tables only: requests go to node actors
        view = ResourceView.uniform(pods=1, groups_per_pod=nodes, nodes_per_group=1, devices_per_node=devices_per_node,
                                    device_bytes=device_memory_bytes, host_bytes=host_memory_bytes)
        self.placer = JobPlacer(view, horizon_slots, slot_s, placement == "first-fit", profile_steps)
        self._handles: dict[str, StateHandle] = {}
        self._configs: dict[str, object] = {}
        self._seq: dict[str, int] = defaultdict(int)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def _start_node(self, group: int, node_id: str, per_node: int, device_bytes: int, host_bytes: int,
                    threads: int, torch_device: str):
        ids = list(range(group * per_node, (group + 1) * per_node))
        workers = {d: self._host_worker(node_id, f"{self._name}-worker{d}", (d, device_bytes, threads, torch_device))
                   for d in ids}
        self.workers.update(workers)
        shm = shm_root() / f"{self._name}-node{group}"
        return self._host_node(node_id, f"{self._name}-node{group}", (
            group, ids, workers, device_bytes, host_bytes, self.policy.value, str(self.workdir), str(shm),
            self.telemetry.epoch))

    # -- hosting: Ray actors here; engines/process_cluster.py hosts the same classes without Ray ----
    engine = "ray"

    def _find_nodes(self, address: str | None, nodes: int | None, per_node: int) -> list:
        """Join or start Ray; the ids of the `nodes` Ray nodes to use (all with enough GPUs by default)."""
        self._owns_ray = address is None and not ray.is_initialized()
        ray_setup.connect(address, num_gpus=per_node)
        found = ray_setup.gpu_nodes(per_node)
        nodes = len(found) if nodes is None else nodes
        if not 1 <= nodes <= len(found):
            raise errors.ConfigError(f"nodes={nodes}; expected 1..{len(found)} (Ray nodes with {per_node} GPUs)")
        return [node_id for node_id, _ in found[:nodes]]

    def _host_worker(self, node_id: str, name: str, args: tuple):
        pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return DeviceWorkerActor.options(num_gpus=1, num_cpus=0, max_restarts=-1, scheduling_strategy=pinned,
                                         name=name).remote(*args)

    def _host_node(self, node_id: str, name: str, args: tuple):
        pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return RayNodeActor.options(num_cpus=0, max_concurrency=NODE_CALL_THREADS, scheduling_strategy=pinned,
                                    name=name).remote(*args)

    # -- what clients call -----------------------------------------------------------------------
    def add_model(self, job: str, name: str, base_model: str | Path, trainable: bool,
                  slack: float = 0.10, admission_timeout: float | None = None) -> StateHandle:
        self._check_open()
        source = str(base_model)
        config = self._config(source)
        group = self.router.placement(job)
        if group is None:
            nbytes = _state_bytes(config, trainable)
            memory = [ModelMemory(name, nbytes, nbytes)]
            group = self._admit(provisional_profile(job, memory, self.placer.slot_s), slack, True, admission_timeout)
            self._started.setdefault(job, self.telemetry.now())
        made = _unwrapped(lambda: hosting.get(self.nodes[group].add_model.remote(job, name, source, trainable)))
        return self._bind(StateHandle(made["state_id"], job, name, source, trainable, made["device_bytes"],
                                      made["host_bytes"]), group)

    def _bind(self, handle: StateHandle, group: int) -> StateHandle:
        with self._lock:
            self._handles[handle.state_id] = handle
        self.router.bind(handle.state_id, group)
        return handle

    def submit(self, state: StateHandle, fn: str, payload: dict | None) -> APIFuture:
        """Send one call (function name + payload, see runtime/functions.py) to the state's node."""
        if self._closed:
            return APIFuture.failed(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
        group = self.router.group_of(state.state_id)
        if group in self._lost:  # its node is gone: wait until the job is restored elsewhere
            self._lost[group].wait()
            group = self.router.group_of(state.state_id)
        if group is None:
            return APIFuture.failed(errors.UnknownModel(
                f"model {state.state_id!r} no longer exists on this cluster (a superseded sampler snapshot?)"))
        if fn not in ray_functions.FUNCTIONS and fn not in ray_functions.NODE_FUNCTIONS:
            return APIFuture.failed(errors.InvalidInput(
                f"function {fn!r} is not served by the Ray engine; expected one of "
                f"{sorted([*ray_functions.FUNCTIONS, *ray_functions.NODE_FUNCTIONS])}"))
        payload = payload or {}
        mutates = ray_functions.mutates(fn)
        future = APIFuture(next(self._ids))
        with self._lock:
            seq = self._seq[state.state_id]
            self._seq[state.state_id] += 1
        ref = self.nodes[group].call.remote(future.request_id, state.job, state.state_id, fn, payload, mutates, seq)
        hosting.as_future(ref).add_done_callback(lambda done: self._resolve(done, future, state, fn, group, payload))
        return future

    def _resolve(self, done, future: APIFuture, state: StateHandle, fn: str, group: int, payload: dict) -> None:
        try:
            result = done.result()
        except Exception as exc:
            if self._is_node_loss(exc):  # recover on another thread: this one is Ray's
                threading.Thread(target=self._fail_after_recovery, args=(group, future, state, fn),
                                 name=f"plexrl-recover-g{group}", daemon=True).start()
            else:
                future.set_exception(_user_error(exc))
            return
        if fn == "sync_weights":
            result = self._bind_snapshot(state, result, group)
        elif fn == "save_state":
            self._saved(state, payload)
        future.set_result(result)

    def _bind_snapshot(self, trainer: StateHandle, synced: dict, group: int) -> StateHandle:
        """The driver's side of a weight sync: route the snapshot the node made (or updated)."""
        weights_bytes = trainer.device_bytes // 4  # a snapshot holds weights only
        snapshot = self._bind(StateHandle(synced["state_id"], trainer.job, synced["name"], trainer.source, False,
                                          weights_bytes, weights_bytes), group)
        self.router.set_sampler(trainer.state_id, synced["sync"], snapshot.state_id)
        return snapshot

    def fetch_weights(self, state: StateHandle) -> np.ndarray:
        """A copy of a state's current weights (flat float32), read on the device that holds it."""
        return self.submit(state, "read_weights", None).result()

    def latest_sampler(self, trainer_id: str, name: str) -> StateHandle | None:
        state_id = self.router.sampler(trainer_id, name)
        return None if state_id is None else self._handles.get(state_id)

    def limits(self, state: StateHandle) -> tuple[int, int]:
        config = self._config(state.source)
        return int(config.vocab_size), int(getattr(config, "max_position_embeddings", 1 << 30))

    def stop_token_ids(self, state: StateHandle) -> tuple[int, ...]:
        eos = getattr(self._config(state.source), "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def _config(self, source: str):
        if source not in self._configs:
            self._configs[source] = _load_config(source)
        return self._configs[source]

    def report_step(self, job: str, step: int, **fields) -> None:
        """A job's step boundary: logged, and a checkpoint every `checkpoint_every_steps` steps
        (ray_recovery.py). Re-placement from measured profiles is not done on this engine yet."""
        self.telemetry.events.emit(self.telemetry.now(), "step", job=job, step=step, **fields)
        self._step_mark(job, step)

    def finish_job(self, job: str) -> None:
        group = self.router.placement(job)
        if group is not None and group not in self._lost:
            hosting.get(self.nodes[group].remove_job.remote(job))
            for state_id in [sid for sid, h in list(self._handles.items()) if h.job == job]:
                self.router.unbind(state_id)
            self.router.forget(job)
        self.placer.finish(job, self.telemetry.now())

    # -- observability ---------------------------------------------------------------------------
    def node_states(self) -> list[list[str]]:
        """The state ids each node's StateManager holds (affinity checks)."""
        return [[] if g in self._lost else hosting.get(n.state_ids.remote()) for g, n in enumerate(self.nodes)]

    def events(self) -> list[dict]:
        merged = self.telemetry.events.snapshot()
        for part in hosting.get([n.events.remote() for n in self.live_nodes()]):
            merged += part
        return sorted(merged, key=lambda e: e["t"])

    def write_events(self, path: str | Path) -> Path:
        """Every node's events and the driver's, on one time axis, as JSON lines."""
        return write_jsonl(self.events(), path)

    def metrics(self) -> dict:
        out = merge_summaries(hosting.get([n.summary.remote() for n in self.live_nodes()]))
        out["recovery"] = _add_counts([out["recovery"], self.recovery])
        placements = self.placer.summary()
        for job, usage in out["jobs"].items():
            placed = placements.get(job, {})
            usage["placement"] = {**placed, "node": placed.get("group")}
            usage["phase_shift_s"] = placed.get("phase_shift_s")
            usage["queueing_delay_s"] = placed.get("queueing_delay_s", 0.0)
        out.update(policy=self.policy.value, devices=self.devices, nodes=len(self.nodes), engine=self.engine,
                   uptime_s=self.telemetry.now(), placement=placements, migrations=0)
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        hosting.get([n.close.remote() for n in self.live_nodes()])
        for actor in [*self.nodes, *self.workers.values()]:
            hosting.kill(actor)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SUMMED = ("switches", "device_busy_s", "transition_bytes", "transition_s")


def merge_summaries(parts: list[dict]) -> dict:
    """One cluster-wide summary from the nodes' telemetry summaries (counters add up)."""
    out: dict = {key: sum(p[key] for p in parts) for key in SUMMED}
    out["device_busy_s_per_device"] = {d: s for p in parts for d, s in p["device_busy_s_per_device"].items()}
    out["transitions"] = _add_counts([p["transitions"] for p in parts])
    out["jobs"] = {}
    for part in parts:
        for job, usage in part["jobs"].items():
            out["jobs"][job] = _add_counts([out["jobs"].get(job, {}), usage])
    out["recovery"] = _add_counts([p["recovery"] for p in parts])
    out["residency"] = {sid: tier for p in parts for sid, tier in p["residency"].items()}
    return out


def _add_counts(dicts: list[dict]) -> dict:
    total: dict = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total


def _state_bytes(config, trainable: bool) -> int:
    """Float32 bytes of a state before it is loaded: a provisional estimate for admission
    (the node measures the real size; the placer's profile is replaced by measured ones later)."""
    from transformers import AutoModelForCausalLM
    import torch

    with torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return numel * 4 * (4 if trainable else 1)


def _load_config(source: str):
    from transformers import AutoConfig

    if not (Path(source) / "config.json").is_file():
        raise errors.ModelLoadError(
            f"base model folder {source!r} has no config.json; expected a local Hugging Face model folder "
            "that every Ray node can read")
    return AutoConfig.from_pretrained(source)


def _user_error(exc: BaseException) -> BaseException:
    """The PlexRL error inside a Ray error; a lost node actor reads as a retriable WorkerFailed."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, hosting.WorkerGone)):
        return errors.WorkerFailed(f"the node runtime holding this model is unreachable: {exc}")
    return exc


def _unwrapped(call):
    try:
        return call()
    except ray.exceptions.RayTaskError as exc:
        raise _user_error(exc) from None

"""The Ray engine's front: the same job-facing API as LocalCluster, with the runtime in Ray actors.

    RayCluster (a front: in the driver, or attached from a job's controller actor) — futures, caches
      ├ <name>-control actor (ray_control.py): JobPlacer + Router tables, checkpoints, lost groups
      └ per node (NodeAffinitySchedulingStrategy): <name>-node<g> actor (StateManager + group scheduler)
                                                   <name>-worker<d> actor per device (num_gpus=1, max_restarts=-1)

Jobs hold the unchanged plexrl.client classes. A call crosses Ray as (function name, payload,
sequence number): never a closure, never model state. The driver never holds tensors of a
state: nodes load models from their source folder (which every node must see) and return only
numbers; weights leave a node only when asked (`fetch_weights`, as numpy).

Failure semantics: a worker that dies mid-call fails that call with errors.WorkerFailed
(retriable; not retried automatically) and the job continues from its last completed call
(see ray_node.py). A lost node: its jobs are re-placed and restored from their latest
checkpoints (ray_recovery.py). Re-placement from measured profiles moves a job between its steps
(`migrate`: through the checkpoint directory).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from plexrl import errors
from plexrl.engines import hosting, ray_functions, ray_setup
from plexrl.engines.ray_control import CONTROL_THREADS, Control
from plexrl.engines.ray_node import RayNode
from plexrl.engines.ray_recovery import NodeRecovery
from plexrl.engines.ray_shm import WRITEBACK_FLAGS, node_folder
from plexrl.engines.ray_worker import DeviceWorker
from plexrl.policy import JobProfile, ModelMemory
from plexrl.runtime.events import write_jsonl
from plexrl.api.futures import APIFuture
from plexrl.runtime.job_placer import provisional_profile
from plexrl.runtime.local_cluster import LocalCluster, _check_positive, _checked_policy

MiB = 1 << 20
DeviceWorkerActor = ray.remote(DeviceWorker)
RayNodeActor = ray.remote(RayNode)
ControlActor = ray.remote(Control)
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

    @property
    def is_snapshot(self) -> bool:
        """A sampler snapshot a weight sync made (`trainer@sync`), not a model of its own."""
        return "@" in self.name


class RayCluster(NodeRecovery):
    """The front of a Ray-engine cluster. `RayCluster(...)` starts one (its actors are named
    `<name>-...`, `name` defaults to a fresh id); `RayCluster.attach(name)` joins it from another
    process, e.g. a job's controller running as its own Ray actor (it owns nothing and closes
    nothing but itself)."""

    service_client = LocalCluster.service_client  # admission is the local engine's, unchanged
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
        name: str | None = None,
    ):
        self.policy = _checked_policy(policy)
        _check_positive(devices_per_node=devices_per_node, device_memory_bytes=device_memory_bytes,
                        host_memory_bytes=host_memory_bytes, threads_per_device=threads_per_device)
        if placement not in ("phase-shift", "first-fit"):
            raise errors.ConfigError(f"placement={placement!r}; expected 'phase-shift' or 'first-fit'")
        if checkpoint_every_steps < 0:
            raise errors.ConfigError(f"checkpoint_every_steps={checkpoint_every_steps}; expected 0 (off) or more")
        self._owns_ray = False
        node_ids = self._find_nodes(address, nodes, devices_per_node)
        nodes = len(node_ids)
        tmp = tempfile.mkdtemp(prefix="plexrl-ray-") if workdir is None else None
        workdir = Path(workdir) if workdir is not None else Path(tmp)
        self.name = name or f"plexrl-{uuid.uuid4().hex[:8]}"
        epoch = time.time()
        workers: dict[int, object] = {}
        node_actors = []
        for group, node_id in enumerate(node_ids):
            ids = list(range(group * devices_per_node, (group + 1) * devices_per_node))
            shm = node_folder(self.name, group)
            mine = {d: self._host_worker(node_id, _worker_name(self.name, d), (
                d, device_memory_bytes, threads_per_device, torch_device, str(shm / WRITEBACK_FLAGS))) for d in ids}
            workers.update(mine)
            node_actors.append(self._host_node(node_id, _node_name(self.name, group), (
                group, ids, mine, device_memory_bytes, host_memory_bytes, self.policy.value, str(workdir),
                str(shm), epoch)))
        hosting.get([w.ping.remote() for w in workers.values()] + [n.state_ids.remote() for n in node_actors])
        description = {"node_ids": node_ids, "devices": nodes * devices_per_node,
                       "policy": self.policy.value, "workdir": str(workdir),
                       "checkpoint_dir": str(checkpoint_dir or workdir / "checkpoints"),
                       "checkpoint_every_steps": checkpoint_every_steps, "slot_s": slot_s}
        topology = dict(pods=1, groups_per_pod=nodes, nodes_per_group=1, devices_per_node=devices_per_node,
                        device_bytes=device_memory_bytes, host_bytes=host_memory_bytes)
        control = self._host_control(_control_name(self.name), (description, topology, horizon_slots, slot_s,
                                                               placement == "first-fit", profile_steps, epoch))
        self._join(description, control, node_actors, workers)
        self._owned_actors = [control, *node_actors, *workers.values()]
        self._tmp = tmp

    @classmethod
    def attach(cls, name: str) -> "RayCluster":
        """A front on the running cluster `name` (its actors are found by name in this Ray job's
        namespace): the same API, for a controller in another process."""
        try:
            control = ray.get_actor(_control_name(name))
        except ValueError:
            raise errors.ConfigError(f"no PlexRL cluster named {name!r} in this Ray namespace") from None
        description = ray.get(control.describe.remote())
        front = cls.__new__(cls)
        front.policy = _checked_policy(description["policy"])
        front._owns_ray, front._owned_actors, front._tmp = False, [], None
        front.name = name
        nodes = [ray.get_actor(_node_name(name, g)) for g in range(len(description["node_ids"]))]
        workers = {d: ray.get_actor(_worker_name(name, d)) for d in range(description["devices"])}
        front._join(description, control, nodes, workers)
        return front

    def _join(self, description: dict, control, nodes: list, workers: dict) -> None:
        """Every front's own part: caches of the control plane's tables, call numbering, futures."""
        self.control, self.nodes, self.workers = control, nodes, workers
        self.node_ids = description["node_ids"]
        self.devices = description["devices"]
        self.workdir = Path(description["workdir"])
        self.checkpoint_dir = Path(description["checkpoint_dir"])
        self.checkpoint_every_steps = description["checkpoint_every_steps"]
        self.slot_s = description["slot_s"]
        self.front = hosting.get(control.new_front.remote())
        self._handles: dict[str, StateHandle] = {}  # caches of the control plane's tables
        self._routes: dict[str, int] = {}
        self._samplers: dict[tuple[str, str], str] = {}
        self._configs: dict[str, object] = {}
        self._seq: dict[tuple[str, int], int] = defaultdict(int)  # (model, group) -> next call number
        self._lost_seen: set[int] = set()  # lost groups this front has heard of
        self._bookkeeping = ThreadPoolExecutor(2, thread_name_prefix=f"plexrl-front{self.front}")
        self._ids = itertools.count(self.front * 1_000_000_000 + 1)  # request ids unique across fronts
        self._lock = threading.Lock()
        self._closed = False

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

    def _host_control(self, name: str, args: tuple):
        """On the driver's node: the control plane lives as long as the process that started the cluster."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ControlActor.options(num_cpus=0, max_concurrency=CONTROL_THREADS, name=name,
                                    scheduling_strategy=here).remote(*args)

    def _send(self, group: int, call: tuple):
        """A call to a node actor; a reference to its result."""
        return self.nodes[group].call.remote(*call)

    def _ask(self, method: str, *args):
        """A call to the control plane (placement, tables: never on a call's path)."""
        return hosting.get(getattr(self.control, method).remote(*args))

    # -- what clients call -----------------------------------------------------------------------
    def _admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None) -> int:
        group, shift_s = _unwrapped(lambda: self._ask("admit", profile, slack, provisional, timeout))
        time.sleep(shift_s)  # the job starts shifted
        return group

    def add_model(self, job: str, name: str, base_model: str | Path, trainable: bool,
                  slack: float = 0.10, admission_timeout: float | None = None) -> StateHandle:
        self._check_open()
        source = str(base_model)
        config = self._config(source)
        group = self._ask("placement", job)
        if group is None:
            nbytes = _state_bytes(config, trainable)
            memory = [ModelMemory(name, nbytes, nbytes)]
            group = self._admit(provisional_profile(job, memory, self.slot_s), slack, True, admission_timeout)
        made = _unwrapped(lambda: hosting.get(self.nodes[group].add_model.remote(job, name, source, trainable)))
        return self._bind(StateHandle(made["state_id"], job, name, source, trainable, made["device_bytes"],
                                      made["host_bytes"]), group)

    def _bind(self, handle: StateHandle, group: int, sampler: tuple[str, str] | None = None) -> StateHandle:
        self._ask("bind", handle, group, sampler)
        with self._lock:
            self._handles[handle.state_id] = handle
            self._routes[handle.state_id] = group
        return handle

    def _refresh(self) -> None:
        """Reload the route caches from the control plane (after a node loss moved jobs)."""
        tables = self._ask("tables")
        with self._lock:
            self._handles, self._routes = tables["handles"], tables["groups"]
            self._samplers = tables["samplers"]

    def submit(self, state: StateHandle, fn: str, payload: dict | None) -> APIFuture:
        """Send one call (function name + payload, see runtime/functions.py) to the state's node."""
        if self._closed:
            return APIFuture.failed(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
        group = self._routes.get(state.state_id)
        if group is None or group in self._lost_seen:
            self._await_recoveries()
            self._refresh()
            group = self._routes.get(state.state_id)
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
            seq = self._seq[(state.state_id, group)]
            self._seq[(state.state_id, group)] += 1
        ref = self._send(group, (future.request_id, state.job, state.state_id, fn, payload, mutates, self.front, seq))
        hosting.as_future(ref).add_done_callback(lambda done: self._resolve(done, future, state, fn, group, payload))
        return future

    def _resolve(self, done, future: APIFuture, state: StateHandle, fn: str, group: int, payload: dict) -> None:
        """Runs on Ray's thread that delivers results: nothing here may wait on Ray. Results that
        need the control plane (syncs, saves) and failures that need recovery go to other threads."""
        try:
            result = done.result()
        except Exception as exc:
            if self._is_node_loss(exc):
                threading.Thread(target=self._fail_after_recovery, args=(group, future, state, fn),
                                 name=f"plexrl-recover-g{group}", daemon=True).start()
            else:
                future.set_exception(_user_error(exc))
            return
        if fn in ("sync_weights", "save_state"):
            self._bookkeeping.submit(self._book, future, state, fn, group, payload, result)
        else:
            future.set_result(result)

    def _book(self, future: APIFuture, state: StateHandle, fn: str, group: int, payload: dict, result) -> None:
        try:
            if fn == "sync_weights":
                result = self._bind_snapshot(state, result, group)
            elif fn == "save_state":
                self._saved(state, payload)
        except Exception as exc:
            future.set_exception(_user_error(exc))
            return
        future.set_result(result)

    def _bind_snapshot(self, trainer: StateHandle, synced: dict, group: int) -> StateHandle:
        """The front's side of a weight sync: route the snapshot the node made (or updated)."""
        weights_bytes = trainer.device_bytes // 4  # a snapshot holds weights only
        snapshot = self._bind(StateHandle(synced["state_id"], trainer.job, synced["name"], trainer.source, False,
                                          weights_bytes, weights_bytes), group, (trainer.state_id, synced["sync"]))
        with self._lock:
            self._samplers[(trainer.state_id, synced["sync"])] = snapshot.state_id
        return snapshot

    def fetch_weights(self, state: StateHandle) -> np.ndarray:
        """A copy of a state's current weights (flat float32), read on the device that holds it."""
        return self.submit(state, "read_weights", None).result()

    def latest_sampler(self, trainer_id: str, name: str) -> StateHandle | None:
        state_id = self._samplers.get((trainer_id, name))
        if state_id is None or self._routes.get(state_id) in self._lost_seen:
            self._refresh()
            state_id = self._samplers.get((trainer_id, name))
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
        """A job's step boundary: logged, a checkpoint every `checkpoint_every_steps` steps
        (ray_recovery.py), and the placer's look at its measured profile (`_replace`)."""
        profile_due = self._ask("step", job, step, fields)
        self._step_mark(job, step)
        self._replace(job, profile_due)

    def _replace(self, job: str, profile_due: bool) -> None:
        """Re-placement from the job's measured profile (every `profile_steps` steps, as on the
        local engines): when the placer moves it, the job migrates here, between its steps."""
        models = [ModelMemory(h.name, h.device_bytes, h.host_bytes)
                  for h in list(self._handles.values()) if h.job == job and not h.is_snapshot]
        events = self.events(job) if profile_due else None
        decided = self._ask("on_step", job, models, events)
        if decided is None:
            return
        group, shift_s = decided
        self.migrate(job, group)
        time.sleep(shift_s)  # the job resumes on its new phase

    def migrate(self, job: str, group: int) -> None:
        """Move every model of `job` to node group `group` through the checkpoint directory:
        trainable ones saved (with their optimizer) after their last call, then added on the new
        node and loaded; samplers synced again. Counted in metrics()["migrations"]."""
        source = self._ask("placement", job)
        if source is None or source == group:
            return
        models = [h for h in list(self._handles.values()) if h.job == job and not h.is_snapshot]
        saves = [self.submit(h, "save_state", {"path": str(self.checkpoint_path(h, "migration")), "with_optimizer": True})
                 for h in models if h.trainable]
        for save in saves:
            save.result()
        inputs = self._ask("restore_inputs", job)
        hosting.get(self.nodes[source].remove_job.remote(job))
        self._ask("migrated", job, source, group, [h.state_id for h in models])
        self._reinstate(job, group, inputs)

    def finish_job(self, job: str) -> None:
        group = self._ask("placement", job)
        if group is not None and group not in self._lost_seen:
            hosting.get(self.nodes[group].remove_job.remote(job))
        for state_id in self._ask("finish", job):
            with self._lock:
                self._handles.pop(state_id, None)
                self._routes.pop(state_id, None)

    # -- observability ---------------------------------------------------------------------------
    def live_nodes(self, lost: dict[int, str] | None = None) -> list:
        """The nodes not lost (`lost`: the control plane's lost groups, asked for when not given)."""
        lost = self._ask("lost_groups") if lost is None else lost
        return [node for group, node in enumerate(self.nodes) if group not in lost]

    def node_states(self) -> list[list[str]]:
        """The state ids each node's StateManager holds (affinity checks)."""
        lost = self._ask("lost_groups")
        return [[] if g in lost else hosting.get(n.state_ids.remote()) for g, n in enumerate(self.nodes)]

    def events(self, job: str | None = None) -> list[dict]:
        """The cluster's events on one time axis (only `job`'s when given: filtered where they live)."""
        merged = self._ask("events", job)
        for part in hosting.get([n.events.remote(job) for n in self.live_nodes()]):
            merged += part
        return sorted(merged, key=lambda e: e["t"])

    def write_events(self, path: str | Path) -> Path:
        """Every node's events and the control plane's, on one time axis, as JSON lines."""
        return write_jsonl(self.events(), path)

    def metrics(self) -> dict:
        control = self._ask("summary")
        out = merge_summaries(hosting.get([n.summary.remote() for n in self.live_nodes(control["lost"])]))
        out["recovery"] = _add_counts([out["recovery"], control["recovery"]])
        placements = control["placements"]
        for job, usage in out["jobs"].items():
            placed = placements.get(job, {})
            usage["placement"] = {**placed, "node": placed.get("group")}
            usage["phase_shift_s"] = placed.get("phase_shift_s")
            usage["queueing_delay_s"] = placed.get("queueing_delay_s", 0.0)
        out.update(policy=self.policy.value, devices=self.devices, nodes=len(self.nodes), engine=self.engine,
                   uptime_s=control["now"], placement=placements, migrations=control["migrations"])
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop accepting calls; the front that started the cluster also stops its actors."""
        if self._closed:
            return
        self._closed = True
        self._bookkeeping.shutdown(wait=True)
        if not self._owned_actors:
            return
        hosting.get([n.close.remote() for n in self.live_nodes()])
        for actor in self._owned_actors:
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


def _control_name(cluster: str) -> str:
    return f"{cluster}-control"


def _node_name(cluster: str, group: int) -> str:
    return f"{cluster}-node{group}"


def _worker_name(cluster: str, device: int) -> str:
    return f"{cluster}-worker{device}"


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

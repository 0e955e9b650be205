"""The front: what a job's clients talk to (the `Cluster` protocol of plexrl/api/cluster.py).

    Front (in the driver; on Ray also `RayCluster.attach(name)` in a job's controller actor)
      ├ Control (control.py): JobPlacer + Router tables, checkpoints, lost groups
      └ per node group: Node (node.py: StateManager + group scheduler)
                        DeviceWorker per device (device_worker.py: the arena, the functions)

One front for every engine. An engine (plexrl/engines/) only says where each piece runs — a
thread, a process, a Ray actor — by its `_host_*` methods; everything else happens here, the
same way everywhere: admission and placement, weight sync, checkpoints (recovery.py), migration
and re-placement from measured profiles at step boundaries (step_boundary.py), recovery, the
event log and metrics (cluster_readout.py). What the front knows it keeps in small parts: the
route caches (route_cache.py), the model folders' configs (model_configs.py), the checks a call
passes before it is sent (call_checks.py).

The control plane is called through its typed client (control_plane.py); a call crosses to its
node as a `node.Call` (function name, its payload decoded at `submit` into the function's payload
type of runtime/payloads.py, sequence number): never a closure, never model state. The front
never holds tensors of a state: nodes load models from their source folder (which every node
must see) and return numbers and handles; weights leave a node only when asked
(`fetch_weights`, as numpy).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plexrl.api import errors, validation
from plexrl.api.cluster import StateHandle
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig, SaveStateResponse
from plexrl.policy import JobProfile
from plexrl.runtime import functions, precision, remote
from plexrl.runtime.call_checks import CallChecks, check_new_model, check_service_client, plain_lora
from plexrl.runtime.cluster_readout import ClusterReadout
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.control_plane import ControlClient
from plexrl.runtime.host_buffers import WRITEBACK_FLAGS, node_folder
from plexrl.runtime.job_placer import provisional_profile
from plexrl.runtime.memory_estimates import provisional_memory
from plexrl.runtime.model_configs import ModelConfigs
from plexrl.runtime.node import Call, NodeConfig
from plexrl.runtime.recovery import NodeRecovery
from plexrl.runtime.route_cache import RouteCache
from plexrl.runtime.step_boundary import StepBoundary
from plexrl.runtime.threads import ServicePool
from plexrl.runtime.weight_sync import Synced


@dataclass(frozen=True)
class Description:
    """What every front of one cluster shares: its settings and where its nodes are."""

    config: ClusterConfig
    node_ids: tuple
    workdir: str
    checkpoint_dir: str


class Front(StepBoundary, NodeRecovery):
    """`Front(config, name)` starts a cluster on the engine of the subclass (its pieces are named
    `<name>-...`, `name` defaults to a fresh id)."""

    engine = "abstract"
    devices_share_a_process = False  # the local engine's: its devices are threads of one interpreter

    def __init__(self, config: ClusterConfig, name: str | None = None):
        self.name = name or f"plexrl-{uuid.uuid4().hex[:8]}"
        self._tmp = tempfile.mkdtemp(prefix="plexrl-") if config.workdir is None else None
        workdir = Path(config.workdir or self._tmp)
        torch_device = self._torch_device(config.torch_device)
        self._check_gpus(config, torch_device)
        node_ids = self._find_nodes(config)
        epoch = time.time()
        workers: dict[int, object] = {}
        nodes = []
        for group, node_id in enumerate(node_ids):
            mine = self._start_workers(group, node_id, config, torch_device)
            workers.update(mine)
            nodes.append(self._host_node(node_id, piece_name(self.name, "node", group), NodeConfig(
                node=group, devices=list(mine), workers=mine, device_memory_bytes=config.device_memory_bytes,
                host_memory_bytes=config.host_memory_bytes, policy=config.policy, workdir=str(workdir),
                shm_folder=str(node_folder(self.name, group)), epoch=epoch, event_log=config.event_log,
                prefetch=config.prefetch, precision=precision.resolve(config.precision, torch_device),
                activation_reserve_bytes=config.activation_reserve_bytes,
                activation_probe_tokens=config.activation_probe_tokens, events_kept=config.events_kept,
                read_replicas=self._read_replicas(config))))
        remote.get([w.ping.remote() for w in workers.values()] + [n.state_ids.remote() for n in nodes])
        description = Description(config, tuple(node_ids), str(workdir),
                                  config.checkpoint_dir or str(workdir / "checkpoints"))
        control = self._host_control(piece_name(self.name, "control"), (description, epoch))
        self._join(description, control, nodes, workers)
        self._owned = [control, *nodes, *workers.values()]

    def _read_replicas(self, config: ClusterConfig) -> bool:
        return not self.devices_share_a_process if config.read_replicas is None else config.read_replicas

    def _start_workers(self, group: int, node_id, config: ClusterConfig, torch_device: str) -> dict:
        flags = str(node_folder(self.name, group) / WRITEBACK_FLAGS)
        per_node = config.devices_per_node
        return {d: self._host_worker(node_id, piece_name(self.name, "worker", d), (
            d, config.device_memory_bytes, config.threads_per_device, self._device_name(torch_device, d), flags))
            for d in range(group * per_node, (group + 1) * per_node)}

    def _join(self, description: Description, control, nodes: list, workers: dict) -> None:
        """Every front's own part: caches of the control plane's tables, call numbering, futures.
        `control`: the hosted control plane (the engine's handle), called through `self.plane`."""
        self.control, self.nodes, self.workers = control, nodes, workers
        self.plane = ControlClient(control)
        self.config = description.config
        self.node_ids = list(description.node_ids)
        self.devices = self.config.devices
        self.workdir = Path(description.workdir)
        self.checkpoint_dir = Path(description.checkpoint_dir)
        self.checkpoint_every_steps = self.config.checkpoint_every_steps
        self.precision = precision.resolve(self.config.precision, self._torch_device(self.config.torch_device))
        self.slot_s = self.config.slot_s
        self.front = self.plane.new_front()
        self.models = ModelConfigs()
        self._checks = CallChecks(self.config, self.models, self.precision, self.checkpoint_dir)
        self.readout = ClusterReadout(self.plane, nodes, dict(
            policy=self.config.policy, devices=self.devices, nodes=len(nodes), engine=self.engine,
            read_replicas=self._read_replicas(self.config)))
        self.routes = RouteCache(self.plane)
        self._seq: dict[tuple[str, int], int] = defaultdict(int)  # (model, group) -> next call number
        self._bookkeeping = ServicePool(2, f"plexrl-front{self.front}")
        self._ids = itertools.count(self.front * 1_000_000_000 + 1)  # request ids unique across fronts
        self._lock = threading.Lock()
        self._closed = False

    @property
    def policy(self):
        from plexrl.policy import Policy

        return Policy.parse(self.config.policy)

    # -- hosting: what an engine says (plexrl/engines/) -------------------------------------------
    def _find_nodes(self, config: ClusterConfig) -> list:
        """One id per node group, where its pieces run (None on a single machine)."""
        return [None] * config.nodes

    def _host_worker(self, node_id, name: str, args: tuple):
        raise NotImplementedError

    def _host_node(self, node_id, name: str, config: NodeConfig):
        raise NotImplementedError

    def _host_control(self, name: str, args: tuple):
        raise NotImplementedError

    def _send(self, group: int, call: Call, future: APIFuture | None):
        """Hand a call to its node; a reference to its result. A node in this process resolves
        `future` itself when one is given (and returns it)."""
        return self.nodes[group].target.enqueue(call, future)

    def _torch_device(self, setting: str) -> str:
        """ClusterConfig.torch_device as the workers get it."""
        raise NotImplementedError

    def _check_gpus(self, config: ClusterConfig, torch_device: str) -> None:
        """Refuse devices whose budgets the GPUs the workers see cannot hold."""
        raise NotImplementedError

    def _device_name(self, torch_device: str, index: int) -> str:
        """Device `index`'s torch device, as its worker names it."""
        raise NotImplementedError

    def _is_node_loss(self, exc: BaseException) -> bool:
        """Whether a call's error means its node is gone (only where a node can be lost alone)."""
        return False

    # -- the job-facing entry point ---------------------------------------------------------------
    def service_client(self, job: str, profile: JobProfile | None = None, slack: float = 0.10,
                       admission_timeout: float | None = None, steps: int | None = None):
        """A job's handle. With a `profile` the job is placed now (waiting for room if the placer
        says so, up to `admission_timeout` s, then starting after its phase shift); without one
        it is placed provisionally when its first model is created. `steps`: how many steps the
        job will run, when it knows (an RL run does; a service session does not): a job that ends
        is placed to pay for the sharing it takes (placement's "Packing when it pays")."""
        from plexrl.api.client import ServiceClient

        check_service_client(job, slack, steps)
        self._check_open()
        ends = steps is not None
        if profile is not None:
            if profile.job != job:
                raise errors.InvalidInput(f"profile is for job {profile.job!r}, not {job!r}")
            self._admit(profile, slack, provisional=False, timeout=admission_timeout, ends=ends)
        return ServiceClient(self, job, slack, admission_timeout, owner=self.plane.claim(job), ends=ends)

    def _admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None,
               ends: bool = False) -> int:
        group, shift_s = self.plane.admit(profile, slack, provisional, timeout, ends)
        time.sleep(shift_s)  # the job starts shifted
        self._mark_on_node(group, profile.job, slack)  # its first step starts: its waits count from here
        return group

    # -- what clients call -------------------------------------------------------------------------
    def add_model(self, job: str, name: str, base_model: str | Path, trainable: bool,
                  slack: float = 0.10, admission_timeout: float | None = None, owner: int | None = None,
                  lora: LoraConfig | None = None, sampler: str = "hf", ends: bool = False) -> StateHandle:
        check_new_model(job, name, trainable, sampler)
        self._check_open()
        lora = plain_lora(lora)
        source = str(base_model)
        config = self.models.config(source)
        group = self.plane.placement(job)
        if group is None:
            memory = provisional_memory(config, job, name, source, trainable, lora, self.precision, self.config)
            group = self._admit(provisional_profile(job, memory, self.slot_s), slack, True, admission_timeout, ends)
        handle = remote.unwrapped(lambda: remote.get(self.nodes[group].add_model.remote(job, name, source, trainable,
                                                                                         lora, sampler)))
        if owner is not None:
            self.plane.own(job, owner, handle.state_id)
        return self.routes.bind(handle, group)

    def submit(self, state: StateHandle, fn: str, payload: dict | Any | None) -> APIFuture:
        """Send one call (a function of runtime/functions.py and its payload: a client's dict,
        decoded here into the function's payload type, or one already of that type) to the state's node."""
        if self._closed:
            return APIFuture.failed(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
        try:
            payload = functions.decode(fn, payload)
            self._checks.check(state, fn, payload)
        except errors.InvalidInput as exc:
            return APIFuture.failed(exc)
        group = self._route(state)
        if group is None:
            return APIFuture.failed(errors.UnknownModel(
                f"model {state.state_id!r} no longer exists on this cluster (a superseded sampler snapshot?)"))
        future = APIFuture(next(self._ids))
        with self._lock:
            seq = self._seq[(state.state_id, group)]
            self._seq[(state.state_id, group)] += 1
        call = Call(future.request_id, state.job, state.state_id, fn, payload, self.front, seq)
        booked = fn in ("sync_weights", "save_state")  # their results pass through the control plane
        ref = self._send(group, call, None if booked else future)
        if ref is not future:
            remote.as_future(ref).add_done_callback(lambda done: self._resolve(done, future, state, fn, group, payload))
        return future

    def _route(self, state: StateHandle) -> int | None:
        group = self.routes.groups.get(state.state_id)
        if group is None or group in self.routes.lost_seen:
            self._await_recoveries()
            self.routes.refresh()
            group = self.routes.groups.get(state.state_id)
        return group

    def _resolve(self, done, future: APIFuture, state: StateHandle, fn: str, group: int, payload: Any) -> None:
        """Runs on the thread that delivers results: nothing here may wait on a node. Results that
        need the control plane (syncs, saves) and failures that need recovery go to other threads."""
        try:
            result = done.result()
        except Exception as exc:
            if self._is_node_loss(exc):
                threading.Thread(target=self._fail_after_recovery, args=(group, future, state, fn),
                                 name=f"plexrl-recover-g{group}", daemon=True).start()
            else:
                future.set_exception(remote.user_error(exc))
            return
        if fn in ("sync_weights", "save_state"):
            self._bookkeeping.submit(self._book, future, state, fn, group, payload, result)
        else:
            future.set_result(result)

    def _book(self, future: APIFuture, state: StateHandle, fn: str, group: int, payload: Any, result) -> None:
        try:
            if isinstance(result, Synced):
                result = self.routes.bind(result.snapshot, group, (state.state_id, result.name))
            elif isinstance(result, SaveStateResponse):
                self._saved(state, payload)
        except Exception as exc:
            future.set_exception(remote.user_error(exc))
            return
        future.set_result(result)

    def fetch_weights(self, state: StateHandle) -> np.ndarray:
        """A copy of a state's current weights (flat float32), read from its host copy."""
        return self.submit(state, "read_weights", None).result()

    def latest_sampler(self, trainer_id: str, name: str) -> StateHandle | None:
        return self.routes.latest_sampler(trainer_id, name)

    def limits(self, state: StateHandle) -> tuple[int, int]:
        return self.models.limits(state.source)

    def stop_token_ids(self, state: StateHandle) -> tuple[int, ...]:
        return self.models.stop_token_ids(state.source)

    def checkpoint_path(self, state: StateHandle, name: str) -> Path:
        """CHECKPOINT_DIR/job/model/name (job and model names follow api.cluster.check_name)."""
        validation.check_checkpoint_name(name)
        return self.checkpoint_dir / state.job / state.name / name

    def finish_job(self, job: str, owner: int | None = None) -> None:
        """Free what service client `owner` created; when it was the job's last one (or `owner` is
        None), the job is done: all its states are freed and waiting jobs may be admitted."""
        states, last = self.plane.release(job, owner) if owner is not None else (None, True)
        if last:
            states = None
        group = self.plane.placement(job)
        if group is not None and group not in self.routes.lost_seen:
            remote.get(self.nodes[group].remove_job.remote(job, states))
        freed = self.plane.finish(job) if last else states
        for state_id in freed:
            if not last:
                self.plane.unbind(state_id)
            self.routes.forget(state_id)

    # -- observability (cluster_readout.py) ---------------------------------------------------------
    def live_nodes(self, lost: dict | None = None) -> list:
        return self.readout.live_nodes(lost)

    def node_states(self) -> list[list[str]]:
        return self.readout.node_states()

    def residency(self) -> dict[str, str]:
        return self.readout.residency()

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]:
        return self.readout.events(job, since)

    def recent(self, window_s: float) -> dict:
        return self.readout.recent(window_s)

    def write_events(self, path: str | Path) -> Path:
        return self.readout.write_events(path)

    def metrics(self) -> dict:
        return self.readout.metrics()

    # -- lifecycle -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise errors.ClusterClosed("the cluster is closed; no more calls are accepted")

    def close(self) -> None:
        """Stop accepting calls; the front that started the cluster also stops its pieces."""
        if self._closed:
            return
        self._closed = True
        self._bookkeeping.shutdown(wait=True)
        if not self._owned:
            return
        remote.get([n.close.remote() for n in self.live_nodes()])
        for piece in self._owned:
            remote.kill(piece)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def piece_name(cluster: str, kind: str, index: int | None = None) -> str:
    """The name of one of a cluster's pieces: `<cluster>-control`, `<cluster>-node3`, `<cluster>-worker7`."""
    return f"{cluster}-{kind}" if index is None else f"{cluster}-{kind}{index}"

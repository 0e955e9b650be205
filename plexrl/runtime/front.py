"""The front: what a job's clients talk to (the `Cluster` protocol of plexrl/api/cluster.py).

    Front (in the driver; on Ray also `RayCluster.attach(name)` in a job's controller actor)
      ├ Control (control.py): JobPlacer + Router tables, checkpoints, lost groups
      └ per node group: Node (node.py: StateManager + group scheduler)
                        DeviceWorker per device (device_worker.py: the arena, the functions)

One front for every engine. An engine (plexrl/engines/) only says where each piece runs — a
thread, a process, a Ray actor — by its `_host_*` methods; everything else happens here, the
same way everywhere: admission and placement, weight sync, checkpoints, migration (through the
checkpoint directory), re-placement from measured profiles, recovery, the event log, metrics.

The control plane is called through its typed client (control_plane.py); a call crosses to its
node as a `node.Call` (function name, its payload decoded at `submit` into the function's payload
type, runtime/payloads.py, sequence number): never a closure, never model state. The front never holds tensors of a state: nodes load models from
their source folder (which every node must see) and return numbers and handles; weights leave a
node only when asked (`fetch_weights`, as numpy).
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
from plexrl.api.cluster import StateHandle, check_name
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig, SaveStateResponse, is_integer
from plexrl.policy import JobProfile
from plexrl.runtime import functions, precision, remote
from plexrl.runtime.call_checks import CallChecks
from plexrl.runtime.cluster_readout import ClusterReadout
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.control_plane import ControlClient
from plexrl.runtime.host_buffers import WRITEBACK_FLAGS, node_folder
from plexrl.runtime.job_placer import provisional_profile
from plexrl.runtime.memory_estimates import model_memory, state_bytes, weights_dtype
from plexrl.runtime.model_configs import ModelConfigs
from plexrl.runtime.node import Call, Synced
from plexrl.runtime.payloads import CheckpointPayload
from plexrl.runtime.recovery import NodeRecovery
from plexrl.runtime.threads import ServicePool
from plexrl.runtime.state_manager import BesideStates, check_budgets


@dataclass(frozen=True)
class Description:
    """What every front of one cluster shares: its settings and where its nodes are."""

    config: ClusterConfig
    node_ids: tuple
    workdir: str
    checkpoint_dir: str


class Front(NodeRecovery):
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
            nodes.append(self._host_node(node_id, piece_name(self.name, "node", group), (
                group, list(mine), mine, config.device_memory_bytes, config.host_memory_bytes, config.policy,
                str(workdir), str(node_folder(self.name, group)), epoch, config.event_log, config.prefetch,
                precision.resolve(config.precision, torch_device), config.activation_reserve_bytes,
                config.activation_probe_tokens, config.events_kept, self._read_replicas(config))))
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
        self._handles: dict[str, StateHandle] = {}  # caches of the control plane's tables
        self._routes: dict[str, int] = {}
        self._samplers: dict[tuple[str, str], str] = {}
        self._seq: dict[tuple[str, int], int] = defaultdict(int)  # (model, group) -> next call number
        self._lost_seen: set[int] = set()  # lost groups this front has heard of
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

    def _host_node(self, node_id, name: str, args: tuple):
        raise NotImplementedError

    def _host_control(self, name: str, args: tuple):
        raise NotImplementedError

    def _send(self, group: int, call: Call, future: APIFuture | None):
        """Hand a call to its node; a reference to its result. A node in this process resolves
        `future` itself when one is given (and returns it)."""
        return self.nodes[group].target.enqueue(call, future)

    def _torch_device(self, setting: str) -> str:
        """ClusterConfig.torch_device as the workers get it: resolved here ("auto": CUDA when this
        process sees a GPU), where the workers run on this machine."""
        from plexrl.runtime.cuda import resolve_device

        return resolve_device(setting)

    def _check_gpus(self, config: ClusterConfig, torch_device: str) -> None:
        """On CUDA, the logical devices' budgets fit the GPUs this process sees, which they share
        round robin (runtime/cuda.py: check_gpus_hold); nothing to check on CPU."""
        if not torch_device.startswith("cuda"):
            return
        import torch

        from plexrl.runtime.cuda import check_gpus_hold

        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(max(1, torch.cuda.device_count()))]
        check_gpus_hold(config.devices, config.device_memory_bytes, gpus)

    def _device_name(self, torch_device: str, index: int) -> str:
        """Device `index`'s torch device: logical devices share the GPUs this process sees."""
        if torch_device != "cuda":
            return torch_device
        import torch

        return f"cuda:{index % max(1, torch.cuda.device_count())}"

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

        check_name("job", job)
        if not (isinstance(slack, (int, float)) and not isinstance(slack, bool) and slack >= 0):
            raise errors.InvalidInput(f"slack={slack!r}; expected a fraction of a step >= 0, e.g. 0.1")
        if steps is not None and not (is_integer(steps) and steps >= 1):
            raise errors.InvalidInput(f"steps={steps!r}; expected the job's number of steps (an integer >= 1) or None")
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
        check_name("job", job)
        check_name("model name", name)
        if validation.check_sampler(sampler) != "hf" and trainable:
            raise errors.InvalidInput(f"sampler={sampler!r} for trainable model {name!r}; expected 'hf' (a trainer "
                                      "samples nothing: its snapshots choose their sampler when synced)")
        self._check_open()
        if lora is not None:
            if not isinstance(lora, LoraConfig):
                raise errors.InvalidInput(f"lora={lora!r}; expected None or a plexrl.LoraConfig")
            lora.validate()
            lora = lora.plain()
        source = str(base_model)
        config = self.models.config(source)
        group = self.plane.placement(job)
        if group is None:
            nbytes, shared = state_bytes(config, trainable, lora, self.precision)
            reserve = self.config.activation_reserve_bytes or 0  # a measured one is known once the node measured it
            check_budgets(name, job, trainable, nbytes, nbytes, self.config.device_memory_bytes,
                          self.config.host_memory_bytes, shared, weights_dtype(self.precision, trainable, lora),
                          BesideStates(reserve_bytes=reserve, shared_bytes=shared))
            memory = model_memory(name, source, nbytes + reserve, nbytes, shared)
            group = self._admit(provisional_profile(job, memory, self.slot_s), slack, True, admission_timeout, ends)
        handle = remote.unwrapped(lambda: remote.get(self.nodes[group].add_model.remote(job, name, source, trainable,
                                                                                         lora, sampler)))
        if owner is not None:
            self.plane.own(job, owner, handle.state_id)
        return self._bind(handle, group)

    def _bind(self, handle: StateHandle, group: int, sampler: tuple[str, str] | None = None) -> StateHandle:
        self.plane.bind(handle, group, sampler)
        with self._lock:
            self._handles[handle.state_id] = handle
            self._routes[handle.state_id] = group
            if sampler is not None:
                self._samplers[sampler] = handle.state_id
        return handle

    def _refresh(self) -> None:
        """Reload the route caches from the control plane (after a node loss moved jobs)."""
        tables = self.plane.tables()
        with self._lock:
            self._handles, self._routes, self._samplers = tables.handles, tables.groups, tables.samplers

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
        group = self._routes.get(state.state_id)
        if group is None or group in self._lost_seen:
            self._await_recoveries()
            self._refresh()
            group = self._routes.get(state.state_id)
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
                result = self._bind(result.snapshot, group, (state.state_id, result.name))
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
        state_id = self._samplers.get((trainer_id, name))
        if state_id is None or self._routes.get(state_id) in self._lost_seen:
            self._refresh()
            state_id = self._samplers.get((trainer_id, name))
        return None if state_id is None else self._handles.get(state_id)

    def limits(self, state: StateHandle) -> tuple[int, int]:
        return self.models.limits(state.source)

    def stop_token_ids(self, state: StateHandle) -> tuple[int, ...]:
        return self.models.stop_token_ids(state.source)

    def checkpoint_path(self, state: StateHandle, name: str) -> Path:
        """CHECKPOINT_DIR/job/model/name (job and model names follow api.cluster.check_name)."""
        validation.check_checkpoint_name(name)
        return self.checkpoint_dir / state.job / state.name / name

    # -- step marks, re-placement, migration --------------------------------------------------------
    def report_step(self, job: str, step: int, **fields) -> None:
        """A job's step boundary: logged, a checkpoint every `checkpoint_every_steps` steps
        (recovery.py), and the placer's look at its measured profile (`_replace`)."""
        profile_due, since, group, slack = self.plane.step(job, step, fields)
        if group is not None and slack is not None:
            self._mark_on_node(group, job, slack)
        self._step_mark(job, step)
        self._replace(job, profile_due, since, group, slack)

    def _mark_on_node(self, group: int, job: str, slack: float) -> None:
        """The job's group scheduler starts counting its next step's waits against `slack`; a
        node found gone is left to recovery (its next call finds it)."""
        try:
            remote.get(self.nodes[group].step_mark.remote(job, slack))
        except Exception as exc:
            if not remote.is_gone(exc):
                raise

    def _replace(self, job: str, profile_due: bool, since: float | None, marked: int | None,
                 slack: float | None) -> None:
        """Re-placement from the job's measured profile (every `profile_steps` steps, from its
        events since `since`): when the placer moves it, the job migrates here, between its
        steps, and resumes on its new phase. The step it starts there is marked on its new
        group (its step mark went to `marked`), so that its waits count from the start."""
        models = self.models.memory([h for h in list(self._handles.values()) if h.job == job and not h.is_snapshot])
        events = self.events(job, since) if profile_due else None
        decided = self.plane.on_step(job, models, events)
        if decided is None:
            return
        group, shift_s = decided
        self.migrate(job, group)
        time.sleep(shift_s)
        if group != marked and slack is not None:
            self._mark_on_node(group, job, slack)

    def migrate(self, job: str, group: int) -> None:
        """Move every model of `job` to node group `group` through the checkpoint directory:
        trainable ones saved (with their optimizer) after their last call, then added on the new
        node and loaded; samplers synced again. Counted in metrics()["migrations"]."""
        source = self.plane.placement(job)
        if source is None or source == group:
            return
        models = [h for h in list(self._handles.values()) if h.job == job and not h.is_snapshot]
        saves = [self.submit(h, "save_state", CheckpointPayload(str(self.checkpoint_path(h, "migration")), True))
                 for h in models if h.trainable]
        for save in saves:
            save.result()
        inputs = self.plane.restore_inputs(job)
        remote.get(self.nodes[source].remove_job.remote(job))
        self.plane.migrated(job, source, group, [h.state_id for h in models])
        self._reinstate(job, group, inputs)

    def finish_job(self, job: str, owner: int | None = None) -> None:
        """Free what service client `owner` created; when it was the job's last one (or `owner` is
        None), the job is done: all its states are freed and waiting jobs may be admitted."""
        states, last = self.plane.release(job, owner) if owner is not None else (None, True)
        if last:
            states = None
        group = self.plane.placement(job)
        if group is not None and group not in self._lost_seen:
            remote.get(self.nodes[group].remove_job.remote(job, states))
        freed = self.plane.finish(job) if last else states
        for state_id in freed:
            if not last:
                self.plane.unbind(state_id)
            with self._lock:
                self._handles.pop(state_id, None)
                self._routes.pop(state_id, None)

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

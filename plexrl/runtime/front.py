"""The front: what a job's clients talk to (the `Cluster` protocol of plexrl/api/cluster.py).

    Front (in the driver; on Ray also `RayCluster.attach(name)` in a job's controller actor)
      ├ Control (control.py): JobPlacer + Router tables, checkpoints, lost groups
      └ per node group: Node (node.py: StateManager + group scheduler)
                        DeviceWorker per device (device_worker.py: the arena, the functions)

One front for every engine. An engine (plexrl/engines/) only says where each piece runs — a
thread, a process, a Ray actor — by its `_host_*` methods; everything else happens here, the
same way everywhere: admission and placement, weight sync, checkpoints, migration (through the
checkpoint directory), re-placement from measured profiles, recovery, the event log, metrics.

A call crosses to its node as a `node.Call` (function name, payload, sequence number): never a
closure, never model state. The front never holds tensors of a state: nodes load models from
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

import numpy as np

from plexrl.api import errors, validation
from plexrl.api.cluster import StateHandle, check_name
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig, SaveStateResponse, is_integer
from plexrl.policy import JobProfile, ModelMemory
from plexrl.runtime import functions, precision, remote
from plexrl.runtime.budgets import BesideStates, check_budgets
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.events import write_jsonl
from plexrl.runtime.host_buffers import WRITEBACK_FLAGS, node_folder
from plexrl.runtime.job_placer import provisional_profile
from plexrl.runtime.node import Call, NodeConfig
from plexrl.runtime.recovery import NodeRecovery
from plexrl.runtime.threads import ServicePool
from plexrl.runtime.weight_sync import Synced



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
        """Every front's own part: caches of the control plane's tables, call numbering, futures."""
        self.control, self.nodes, self.workers = control, nodes, workers
        self.config = description.config
        self.node_ids = list(description.node_ids)
        self.devices = self.config.devices
        self.workdir = Path(description.workdir)
        self.checkpoint_dir = Path(description.checkpoint_dir)
        self.checkpoint_every_steps = self.config.checkpoint_every_steps
        self.precision = precision.resolve(self.config.precision, self._torch_device(self.config.torch_device))
        self.slot_s = self.config.slot_s
        self.front = remote.get(control.new_front.remote())
        self._handles: dict[str, StateHandle] = {}  # caches of the control plane's tables
        self._routes: dict[str, int] = {}
        self._samplers: dict[tuple[str, str], str] = {}
        self._configs: dict[str, object] = {}
        self._base_sizes: dict[str, int] = {}
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

    def _host_node(self, node_id, name: str, config: NodeConfig):
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

    def _ask(self, method: str, *args):
        """A call to the control plane (placement, tables: never on a call's path)."""
        return _unwrapped(lambda: remote.get(getattr(self.control, method).remote(*args)))

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
        return ServiceClient(self, job, slack, admission_timeout, owner=self._ask("claim", job), ends=ends)

    def _admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None,
               ends: bool = False) -> int:
        group, shift_s = self._ask("admit", profile, slack, provisional, timeout, ends)
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
        config = self._config(source)
        group = self._ask("placement", job)
        if group is None:
            nbytes, shared = _state_bytes(config, trainable, lora, self.precision)
            reserve = self.config.activation_reserve_bytes or 0  # a measured one is known once the node measured it
            check_budgets(name, job, trainable, nbytes, nbytes, self.config.device_memory_bytes,
                          self.config.host_memory_bytes, shared, weights_dtype(self.precision, trainable, lora),
                          BesideStates(reserve_bytes=reserve, shared_bytes=shared))
            memory = model_memory(name, source, nbytes + reserve, nbytes, shared)
            group = self._admit(provisional_profile(job, memory, self.slot_s), slack, True, admission_timeout, ends)
        handle = _unwrapped(lambda: remote.get(self.nodes[group].add_model.remote(job, name, source, trainable, lora,
                                                                                   sampler)))
        if owner is not None:
            self._ask("own", job, owner, handle.state_id)
        return self._bind(handle, group)

    def _bind(self, handle: StateHandle, group: int, sampler: tuple[str, str] | None = None) -> StateHandle:
        self._ask("bind", handle, group, sampler)
        with self._lock:
            self._handles[handle.state_id] = handle
            self._routes[handle.state_id] = group
            if sampler is not None:
                self._samplers[sampler] = handle.state_id
        return handle

    def _refresh(self) -> None:
        """Reload the route caches from the control plane (after a node loss moved jobs)."""
        tables = self._ask("tables")
        with self._lock:
            self._handles, self._routes = tables["handles"], tables["groups"]
            self._samplers = tables["samplers"]

    def submit(self, state: StateHandle, fn: str, payload: dict | None) -> APIFuture:
        """Send one call (a function of runtime/functions.py and its payload) to the state's node."""
        if self._closed:
            return APIFuture.failed(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
        try:
            functions.spec(fn)
            if fn == "sample":
                self._check_sample_size(state, payload)
            elif fn == "load_state":
                self._check_own_checkpoint(state, payload["path"])
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
        call = Call(future.request_id, state.job, state.state_id, fn, payload or {}, self.front, seq)
        booked = fn in ("sync_weights", "save_state")  # their results pass through the control plane
        ref = self._send(group, call, None if booked else future)
        if ref is not future:
            remote.as_future(ref).add_done_callback(lambda done: self._resolve(done, future, state, fn, group, payload))
        return future

    def _check_sample_size(self, state: StateHandle, payload: dict) -> None:
        """A sample call's tokens are bounded (`max_sampled_tokens`), and so is its KV cache: it
        must fit the device budget (it is memory the call holds on the device besides the state)."""
        num, tokens = payload["num_samples"], num_samples_tokens(payload)
        if tokens > self.config.max_sampled_tokens:
            raise errors.InvalidInput(
                f"num_samples={num} x (prompt + max_tokens) = {tokens:,} tokens in one sample call; expected at most "
                f"max_sampled_tokens={self.config.max_sampled_tokens:,} (a cluster setting): split the call")
        kv = tokens * kv_bytes_per_token(self._config(state.source), compute_dtype(self.precision, state.trainable,
                                                                                    state.lora).itemsize)
        if kv + state.device_bytes > self.config.device_memory_bytes:
            raise errors.InvalidInput(
                f"num_samples={num} needs a {kv:,}-byte KV cache next to its {state.device_bytes:,}-byte model, more "
                f"than a device budget of {self.config.device_memory_bytes:,} bytes: sample fewer sequences at once")

    def _check_own_checkpoint(self, state: StateHandle, path: str) -> None:
        """A job loads its own checkpoints, or folders from outside the cluster's checkpoint
        directory (a base model, an exported run), never another job's."""
        folder, root = Path(path).resolve(), self.checkpoint_dir.resolve()
        if folder.is_relative_to(root) and not folder.is_relative_to(root / state.job):
            raise errors.InvalidInput(
                f"checkpoint {str(path)!r} is another job's (under {str(root)!r} but not under job {state.job!r}'s "
                "folder); expected one of this job's own checkpoints or a folder outside the checkpoint directory")

    def _route(self, state: StateHandle) -> int | None:
        group = self._routes.get(state.state_id)
        if group is None or group in self._lost_seen:
            self._await_recoveries()
            self._refresh()
            group = self._routes.get(state.state_id)
        return group

    def _resolve(self, done, future: APIFuture, state: StateHandle, fn: str, group: int, payload: dict) -> None:
        """Runs on the thread that delivers results: nothing here may wait on a node. Results that
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
            if isinstance(result, Synced):
                result = self._bind(result.snapshot, group, (state.state_id, result.name))
            elif isinstance(result, SaveStateResponse):
                self._saved(state, payload)
        except Exception as exc:
            future.set_exception(_user_error(exc))
            return
        future.set_result(result)

    def _memory(self, handles: list[StateHandle]) -> list[ModelMemory]:
        """What the placer counts of these models: each one's own bytes next to its activation
        reserve and vLLM engine on a device, a LoRA base's once per node."""
        return [m for h in handles for m in model_memory(
            h.name, h.source, h.device_bytes + h.activation_reserve_bytes + h.engine_bytes, h.host_bytes,
            self._base_bytes(h.source) if h.lora else 0)]

    def _base_bytes(self, source: str) -> int:
        """Float32 bytes of `source`'s weights (a LoRA base), from its config."""
        if source not in self._base_sizes:
            self._base_sizes[source] = _state_bytes(self._config(source), False)[0]
        return self._base_sizes[source]

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

    def checkpoint_path(self, state: StateHandle, name: str) -> Path:
        """CHECKPOINT_DIR/job/model/name (job and model names follow api.cluster.check_name)."""
        validation.check_checkpoint_name(name)
        return self.checkpoint_dir / state.job / state.name / name

    # -- step marks, re-placement, migration --------------------------------------------------------
    def report_step(self, job: str, step: int, **fields) -> None:
        """A job's step boundary: logged, a checkpoint every `checkpoint_every_steps` steps
        (recovery.py), and the placer's look at its measured profile (`_replace`)."""
        profile_due, since, group, slack = self._ask("step", job, step, fields)
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
        models = self._memory([h for h in list(self._handles.values()) if h.job == job and not h.is_snapshot])
        events = self.events(job, since) if profile_due else None
        decided = self._ask("on_step", job, models, events)
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
        source = self._ask("placement", job)
        if source is None or source == group:
            return
        models = [h for h in list(self._handles.values()) if h.job == job and not h.is_snapshot]
        saves = [self.submit(h, "save_state", {"path": str(self.checkpoint_path(h, "migration")), "with_optimizer": True})
                 for h in models if h.trainable]
        for save in saves:
            save.result()
        inputs = self._ask("restore_inputs", job)
        remote.get(self.nodes[source].remove_job.remote(job))
        self._ask("migrated", job, source, group, [h.state_id for h in models])
        self._reinstate(job, group, inputs)

    def finish_job(self, job: str, owner: int | None = None) -> None:
        """Free what service client `owner` created; when it was the job's last one (or `owner` is
        None), the job is done: all its states are freed and waiting jobs may be admitted."""
        states, last = self._ask("release", job, owner) if owner is not None else (None, True)
        if last:
            states = None
        group = self._ask("placement", job)
        if group is not None and group not in self._lost_seen:
            remote.get(self.nodes[group].remove_job.remote(job, states))
        freed = self._ask("finish", job) if last else states
        for state_id in freed:
            if not last:
                self._ask("unbind", state_id)
            with self._lock:
                self._handles.pop(state_id, None)
                self._routes.pop(state_id, None)

    # -- observability ---------------------------------------------------------------------------
    def live_nodes(self, lost: dict | None = None) -> list:
        """The nodes not lost (`lost`: the control plane's lost groups, asked for when not given)."""
        lost = self._ask("lost_groups") if lost is None else lost
        return [node for group, node in enumerate(self.nodes) if group not in lost]

    def node_states(self) -> list[list[str]]:
        """The state ids each node's StateManager holds (affinity checks)."""
        lost = self._ask("lost_groups")
        return [[] if g in lost else remote.get(n.state_ids.remote()) for g, n in enumerate(self.nodes)]

    def residency(self) -> dict[str, str]:
        """Where each state is: 'device:N', 'host' or 'disk'."""
        return {sid: tier for n in self.live_nodes() for sid, tier in remote.get(n.summary.remote())["residency"].items()}

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]:
        """The cluster's events on one time axis (only `job`'s when given: filtered where they live;
        with `since`, only what a profile of its steps from `since` on reads: `EventLog.snapshot`)."""
        merged = self._ask("events", job, since)
        for part in remote.get([n.events.remote(job, since) for n in self.live_nodes()]):
            merged += part
        return sorted(merged, key=lambda e: e["t"])

    def recent(self, window_s: float) -> dict:
        """What the dashboard draws (plexrl/observe): per device, its spans of the last `window_s`
        seconds (calls, switches, prefetches); per job, its first arrival and latest end; the clock."""
        now = self._ask("summary")["now"]
        lanes, jobs = {}, {}
        for part in remote.get([n.recent.remote(now - window_s) for n in self.live_nodes()]):
            lanes.update(part["lanes"])
            for job, (first, last) in part["jobs"].items():  # a job that moved has records on two nodes
                seen = jobs.get(job, (first, last))
                jobs[job] = (min(seen[0], first), max(seen[1], last))
        return {"now": now, "lanes": lanes, "jobs": jobs}

    def write_events(self, path: str | Path) -> Path:
        """Every node's events and the control plane's, on one time axis, as JSON lines."""
        return write_jsonl(self.events(), path)

    def metrics(self) -> dict:
        """One layout on every engine: the nodes' counters summed, per job usage with its
        placement, admission (jobs waiting), recovery counts, migrations."""
        control = self._ask("summary")
        out = merge_summaries(remote.get([n.summary.remote() for n in self.live_nodes(control["lost"])]))
        out["recovery"] = _add_counts([out["recovery"], control["recovery"]])
        placements = control["placements"]
        for job, usage in out["jobs"].items():
            placed = placements.get(job, {})
            usage["placement"] = {**placed, "node": placed.get("group")}
            usage["phase_shift_s"] = placed.get("phase_shift_s")
            usage["queueing_delay_s"] = placed.get("queueing_delay_s", 0.0)
        out.update(policy=self.config.policy, devices=self.devices, nodes=len(self.nodes), engine=self.engine,
                   read_replicas=self._read_replicas(self.config), uptime_s=control["now"], placement=placements,
                   migrations=control["migrations"],
                   admission={job: p for job, p in placements.items() if p["group"] is None})
        return out

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


SUMMED = ("switches", "device_busy_s", "transition_bytes", "transition_s",
          "writebacks", "writeback_bytes", "writeback_zeroed_bytes", "writeback_s",
          "prefetches", "prefetch_bytes", "prefetch_s", "prefetch_exposed_s")


def piece_name(cluster: str, kind: str, index: int | None = None) -> str:
    """The name of one of a cluster's pieces: `<cluster>-control`, `<cluster>-node3`, `<cluster>-worker7`."""
    return f"{cluster}-{kind}" if index is None else f"{cluster}-{kind}{index}"


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
    out["histograms"] = [h for p in parts for h in p["histograms"]]  # each node's carry its node label
    out["queued"] = {group: n for p in parts for group, n in p["queued"].items()}
    out["residency"] = {sid: tier for p in parts for sid, tier in p["residency"].items()}
    out["device_budget"] = {d: split for p in parts for d, split in p["device_budget"].items()}
    out["activation_reserves"] = {src: max(p["activation_reserves"].get(src, 0) for p in parts)
                                  for p0 in parts for src in p0["activation_reserves"]}
    out["bandwidth_gbps"] = parts[0]["bandwidth_gbps"] if len(parts) == 1 else {
        k: max(p["bandwidth_gbps"][k] for p in parts) for k in parts[0]["bandwidth_gbps"]}
    return out


def _add_counts(dicts: list[dict]) -> dict:
    total: dict = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total


def num_samples_tokens(payload: dict) -> int:
    """Tokens a sample call holds at its end: every sequence's prompt and completion."""
    return int(payload["num_samples"]) * (len(payload["tokens"]) + int(payload["params"].max_tokens))


def kv_bytes_per_token(config, itemsize: int = 4) -> int:
    """Keys and values of every layer for one token of a Hugging Face decoder config, `itemsize`
    bytes a number (the dtype the model computes in: `compute_dtype`)."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def compute_dtype(resolved: str, trainable: bool, lora: LoraConfig | None):
    """The dtype a state's model computes in (its KV cache's): its autocast dtype, else its weights'."""
    weights, autocast = _state_dtypes(resolved, trainable, lora)
    return autocast or weights


def weights_dtype(resolved: str, trainable: bool, lora: LoraConfig | None):
    """The dtype a state of a cluster of precision `resolved` holds."""
    return _state_dtypes(resolved, trainable, lora)[0]


def _state_dtypes(resolved: str, trainable: bool, lora: LoraConfig | None):
    """`precision.state_dtypes` as a front sees it: "auto" (not known to a Ray front: its nodes
    ask their workers) counts as bf16, the smaller: the node checks the real size."""
    return precision.state_dtypes("bf16" if resolved == "auto" else resolved, trainable, lora)


def _state_bytes(config, trainable: bool, lora: LoraConfig | None = None, resolved: str = "fp32") -> tuple[int, int]:
    """Bytes of a state before it is loaded (its weights in `weights_dtype`), and float32 bytes of
    the shared base it stands on (a LoRA state's; else 0): a provisional estimate for admission
    (the node measures the real size; the placer's profile is replaced by measured ones later)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plexrl.runtime.lora import adapter_numel

    from plexrl.runtime.state import MODEL_BUILD

    with MODEL_BUILD, torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if lora is None:
        if not trainable:
            return -(-numel * weights_dtype(resolved, False, None).itemsize // 4) * 4, 0
        return numel * 4 * 4, 0
    return adapter_numel(config, lora) * 4 * (4 if trainable else 1), numel * 4


def model_memory(name: str, source: str, device_bytes: int, host_bytes: int, shared_bytes: int) -> list[ModelMemory]:
    """A model as the placer counts it: its own bytes and, for a LoRA model, its frozen base as a
    shared model (one copy per node whatever the number of jobs using it; resident next to it)."""
    if not shared_bytes:
        return [ModelMemory(name, device_bytes, host_bytes)]
    return [ModelMemory(name, device_bytes + shared_bytes, host_bytes),
            ModelMemory(f"{name}:base", shared_bytes, shared_bytes, shared=f"lora-base:{source}")]


def _load_config(source: str):
    from transformers import AutoConfig

    if not Path(source).is_dir():
        raise errors.ModelLoadError(
            f"base model folder {source!r} does not exist; expected a local Hugging Face model folder "
            "(config.json + weights), e.g. one written by `plexrl tiny-model FOLDER`")
    if not (Path(source) / "config.json").is_file():
        raise errors.ModelLoadError(
            f"base model folder {source!r} has no config.json; expected a local Hugging Face model folder "
            "(config.json + weights) that every node can read, e.g. one written by `plexrl tiny-model FOLDER`")
    try:
        return AutoConfig.from_pretrained(source)
    except Exception as exc:  # transformers raises many kinds; the user needs one clear message
        raise errors.ModelLoadError(f"could not load {source!r} as a causal LM with AutoModelForCausalLM: "
                                    f"{type(exc).__name__}: {exc}") from exc


def _user_error(exc: BaseException) -> BaseException:
    """The PlexRL error inside a transport's error; an unreachable node reads as a retriable WorkerFailed."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    if remote.is_gone(exc):
        return errors.WorkerFailed(f"the node runtime holding this model is unreachable: {exc}")
    return exc


def _unwrapped(call):
    """The value of a call to a piece; its PlexRL error raised as it is (not wrapped by the transport)."""
    try:
        return call()
    except errors.PlexRLError:
        raise
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise

"""The local engine: every component in one process, one worker thread per device (DESIGN §8).

    LocalCluster ─ JobPlacer (Placer + AdmissionQueue: which node group, which phase shift)
                 └ Router ─┬─ GroupScheduler (node 0) ─ Worker per device
                           │        └─ StateManager (node 0): arenas, host buffers, spill files
                           └─ GroupScheduler (node 1) ...

Each node is one node group. Every job is placed by the Placer before its first state is
created (see job_placer.py: with its own profile, or provisionally and then re-placed from its
measured profile); its states stay on its group's devices and node until a re-placement
migrates them (a spill on the old node and a restore on the new one).

Devices are CUDA devices when `torch_device="cuda"` (arenas in device memory, pinned host
buffers), else logical devices whose arenas live in host memory and make the budget real.
"""

from __future__ import annotations

import itertools
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from plexrl import errors
from plexrl.client import ServiceClient
from plexrl.policy import JobProfile, ModelMemory, Policy, ResourceView, Tier
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.events import EventLog
from plexrl.runtime import checkpoint, functions
from plexrl.api.futures import APIFuture
from plexrl.runtime.job_placer import JobPlacer, admit_and_route, provisional_profile, route_migration
from plexrl.runtime.router import Router
from plexrl.runtime.scheduler import GroupScheduler, Request
from plexrl.runtime.state import ModelState, load_module, skeleton_like
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry
from plexrl.runtime.worker import Worker
from plexrl.types import SaveStateResponse

MiB = 1 << 20


class LocalCluster:
    def __init__(
        self,
        devices: int = 2,
        device_memory_bytes: int = 256 * MiB,
        host_memory_bytes: int = 2048 * MiB,
        policy: str | Policy = "plexrl",
        nodes: int = 1,
        devices_per_node: int | None = None,
        placement: str = "phase-shift",
        slot_s: float = 0.05,
        horizon_slots: int = 1024,
        profile_steps: int = 3,
        threads_per_device: int = 1,
        workdir: str | Path | None = None,
        checkpoint_dir: str | Path | None = None,
        event_log: str | Path | None = None,
        torch_device: str = "auto",
    ):
        self.policy = _checked_policy(policy)
        torch_device = _resolve_device(torch_device)
        if devices_per_node is not None:
            _check_positive(devices_per_node=devices_per_node)
            devices = nodes * devices_per_node
        if placement not in ("phase-shift", "first-fit"):
            raise errors.ConfigError(f"placement={placement!r}; expected 'phase-shift' or 'first-fit'")
        if not slot_s > 0:
            raise errors.ConfigError(f"slot_s={slot_s!r}; expected a positive number of seconds")
        _check_positive(horizon_slots=horizon_slots, profile_steps=profile_steps)
        _check_positive(devices=devices, nodes=nodes, device_memory_bytes=device_memory_bytes,
                        host_memory_bytes=host_memory_bytes, threads_per_device=threads_per_device)
        if devices % nodes:
            raise errors.ConfigError(f"devices={devices} must be a multiple of nodes={nodes}")
        self._tmp = tempfile.TemporaryDirectory(prefix="plexrl-") if workdir is None else None
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else self.workdir / "checkpoints"
        self.telemetry = Telemetry(EventLog(event_log))
        self.devices = devices
        self.device_memory_bytes = device_memory_bytes
        self.host_memory_bytes = host_memory_bytes
        per_node = devices // nodes
        self.state_managers: list[StateManager] = []
        self.schedulers: list[GroupScheduler] = []
        self.workers: list[Worker] = []
        pin = torch_device.startswith("cuda")
        for node in range(nodes):
            ids = list(range(node * per_node, (node + 1) * per_node))
            arenas = {d: DeviceArena(d, device_memory_bytes, _device_name(torch_device, d)) for d in ids}
            sm = StateManager(node, arenas, host_memory_bytes, self.workdir / f"node{node}" / "spill", self.telemetry, pin)
            group = GroupScheduler(node, ids, sm, self.policy, self.telemetry)
            sm.pending = group.pending
            self.state_managers.append(sm)
            self.schedulers.append(group)
            timing = "wall" if torch_device.startswith("cuda") else "thread_cpu"
            self.workers += [Worker(d, group, sm, self.telemetry, threads_per_device, timing) for d in ids]
        self.router = Router(self.schedulers)
        view = ResourceView.uniform(pods=1, groups_per_pod=nodes, nodes_per_group=1, devices_per_node=per_node,
                                    device_bytes=device_memory_bytes, host_bytes=host_memory_bytes)
        self.placer = JobPlacer(view, horizon_slots, slot_s, placement == "first-fit", profile_steps)
        self.migrations = 0
        self.telemetry.events.emit(0.0, "cluster", devices=devices, nodes=nodes, device_memory_bytes=device_memory_bytes,
                                   host_memory_bytes=host_memory_bytes, policy=self.policy.value, placement=placement)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        for worker in self.workers:
            worker.start()

    # -- the job-facing entry point ---------------------------------------------------------------
    def service_client(self, job: str, profile: JobProfile | None = None, slack: float = 0.10,
                       admission_timeout: float | None = None) -> ServiceClient:
        """A job's handle. With a `profile` the job is placed now (waiting for room if the placer
        says so, up to `admission_timeout` s, then starting after its phase shift); without one
        it is placed provisionally when its first model is created."""
        if not job or not isinstance(job, str):
            raise errors.InvalidInput(f"job={job!r}; expected a non-empty name")
        if not (isinstance(slack, (int, float)) and slack >= 0):
            raise errors.InvalidInput(f"slack={slack!r}; expected a fraction of a step >= 0, e.g. 0.1")
        self._check_open()
        if profile is not None:
            if profile.job != job:
                raise errors.InvalidInput(f"profile is for job {profile.job!r}, not {job!r}")
            self._admit(profile, slack, provisional=False, timeout=admission_timeout)
        return ServiceClient(self, job, slack, admission_timeout)

    def _admit(self, profile: JobProfile, slack: float, provisional: bool, timeout: float | None) -> int:
        group, placement, decided = admit_and_route(self.placer, self.router, self.telemetry, profile, slack,
                                                    provisional, timeout)
        _sleep_until(self.telemetry, decided + placement.phase_shift_s)  # the job starts shifted
        return group

    # -- what clients call -------------------------------------------------------------------------
    def add_model(self, job: str, name: str, base_model: str | Path, trainable: bool,
                  slack: float = 0.10, admission_timeout: float | None = None) -> ModelState:
        self._check_open()
        module = load_module(base_model)
        state = ModelState(f"{job}/{name}", job, name, module, trainable, str(base_model))
        self.state_managers[0].check_fits(state)  # every node has the same budgets
        group = self.router.placement(job)
        if group is None:
            memory = [ModelMemory(name, state.device_bytes, state.host_bytes)]
            group = self._admit(provisional_profile(job, memory, self.placer.slot_s), slack, True, admission_timeout)
        self.state_managers[group].add(state)
        self.router.bind(state.state_id, group)
        return state

    def submit(self, state: ModelState, fn: str, payload: dict[str, Any]) -> APIFuture:
        """Queue one call (function name + payload, see runtime/functions.py) for `state`."""
        if self._closed:
            return APIFuture.failed(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
        if self.router.group_of(state.state_id) is None:
            return APIFuture.failed(errors.UnknownModel(
                f"model {state.state_id!r} no longer exists on this cluster (a superseded sampler snapshot?)"))
        function = functions.spec(fn)
        request_id = next(self._ids)
        request = Request(request_id, state.job, state.state_id, fn, self._runner(fn, payload), APIFuture(request_id),
                          self.telemetry.now(), needs_device=function.needs_device, mutates=function.mutates,
                          seq=request_id)
        self.router.route(request)
        return request.future

    def _runner(self, fn: str, payload: dict[str, Any]) -> Callable[[ModelState], Any]:
        if fn == "save_state":
            return lambda s: self._save_state(s, Path(payload["path"]), payload["with_optimizer"])
        if fn == "sync_weights":
            return lambda s: self.sync_sampler(s, payload["name"])
        return lambda s: functions.execute(fn, s, payload)

    def _save_state(self, state: ModelState, path: Path, with_optimizer: bool) -> SaveStateResponse:
        self.materialize(state, lambda: checkpoint.save_state(state, path, with_optimizer))
        return SaveStateResponse(str(path))

    def latest_sampler(self, trainer_id: str, name: str) -> ModelState | None:
        state_id = self.router.sampler(trainer_id, name)
        group = None if state_id is None else self.router.group_of(state_id)
        return None if group is None else self.state_managers[group].states.get(state_id)

    def limits(self, state: ModelState) -> tuple[int, int]:
        config = state.module.config
        return int(config.vocab_size), int(getattr(config, "max_position_embeddings", 1 << 30))

    def stop_token_ids(self, state: ModelState) -> tuple[int, ...]:
        eos = getattr(state.module.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def checkpoint_path(self, state: ModelState, name: str) -> Path:
        if not name or "/" in name or name in (".", ".."):
            raise errors.InvalidInput(f"checkpoint name {name!r}; expected a plain non-empty name")
        return self.checkpoint_dir / state.job / state.name.replace("/", "_") / name

    def materialize(self, state: ModelState, write: Callable[[], int]) -> None:
        self._node_of(state).materialize(state, state.job, write)

    def sync_sampler(self, trainer: ModelState, name: str) -> ModelState:
        """Copy `trainer`'s weights into its sampler snapshot `name` (runs with `trainer` claimed).

        The snapshot is updated in place when nobody is using it (it may even stay resident);
        otherwise a new version is made and the old one retires once its queued calls drain.
        """
        sm = self._node_of(trainer)
        group = self.schedulers[self.router.group_of(trainer.state_id)]
        weights = trainer.flat_weights()
        with sm.lock:
            current = self.router.sampler(trainer.state_id, name)
            snapshot = sm.states.get(current) if current else None
            reusable = (snapshot is not None and not snapshot.busy and group.pending(current) == 0
                        and snapshot.tier is not Tier.DISK)
            if reusable:
                snapshot.busy = True
        if reusable:
            def write() -> int:
                snapshot.host.copy_(weights)
                if snapshot.tier is Tier.DEVICE:
                    snapshot.current().copy_(weights)
                return trainer.numel * 4
            sm.materialize(snapshot, trainer.job, write)
            with sm.lock:
                snapshot.busy = False
                sm.changed.notify_all()
            return snapshot
        version = self.router.next_version(trainer.state_id, name)
        fresh = ModelState(f"{trainer.state_id}@{name}.v{version}", trainer.job, f"{trainer.name}@{name}",
                           skeleton_like(trainer.module), False, trainer.source)
        sm.add(fresh, initial=weights, holding=frozenset({trainer.state_id}))
        self.router.bind(fresh.state_id, self.router.group_of(trainer.state_id))
        self.router.set_sampler(trainer.state_id, name, fresh.state_id)
        if snapshot is not None:
            self._retire(snapshot)
        return fresh

    def _retire(self, state: ModelState) -> None:
        group = self.schedulers[self.router.group_of(state.state_id)]
        sm = self._node_of(state)
        group.retire(state.state_id, lambda: (sm.remove(state.state_id), self.router.unbind(state.state_id)))

    def _node_of(self, state: ModelState) -> StateManager:
        return self.state_managers[self.router.group_of(state.state_id)]

    # -- observability --------------------------------------------------------------------------------
    def report_step(self, job: str, step: int, **fields) -> None:
        """Mark a job's step boundary. The job's demand is profiled from these marks; when it
        must move, the migration happens here, between its steps (the call then returns after
        the new placement's phase shift)."""
        now = self.telemetry.now()
        self.telemetry.events.emit(now, "step", job=job, step=step, **fields)
        decision = self.placer.on_step(job, self.events, self._memory_of(job), now)
        if decision is None:
            return
        group = self.placer.group_index(decision)
        if group != self.router.placement(job):
            self.migrate(job, group)
            _sleep_until(self.telemetry, now + decision.phase_shift_s)

    def _memory_of(self, job: str) -> list[ModelMemory]:
        out = []
        for sm in self.state_managers:
            with sm.lock:
                out += [ModelMemory(s.name, s.device_bytes, s.host_bytes) for s in sm.states.values() if s.job == job]
        return out

    def migrate(self, job: str, group: int) -> None:
        """Move every state of `job` to node group `group`: spill on the old node once idle,
        restore on the new one at first use. Counted in metrics()["migrations"]."""
        old = self.router.placement(job)
        if old is None or old == group:
            return
        source, target = self.state_managers[old], self.state_managers[group]
        moved = [sid for sid, s in list(source.states.items()) if s.job == job]
        for sid in moved:
            target.adopt(source.evict(sid, job))
            self.router.bind(sid, group)
        route_migration(self.router, self.telemetry, job, old, group, moved)
        self.migrations += 1

    def finish_job(self, job: str) -> None:
        """The job is done: its states are freed and waiting jobs may be admitted."""
        group = self.router.placement(job)
        if group is not None:
            sm = self.state_managers[group]
            for sid in [sid for sid, s in list(sm.states.items()) if s.job == job]:
                with sm.changed:
                    while sm.states[sid].busy or sm.pending(sid):
                        sm.changed.wait(0.01)
                    sm.remove(sid)
                self.router.unbind(sid)
            self.router.forget(job)
        self.placer.finish(job, self.telemetry.now())

    def events(self) -> list[dict]:
        return self.telemetry.events.snapshot()

    def write_events(self, path: str | Path) -> Path:
        return self.telemetry.events.write(path)

    def residency(self) -> dict[str, str]:
        out = {}
        for sm in self.state_managers:
            with sm.lock:
                for sid, s in sm.states.items():
                    out[sid] = f"device:{s.device}" if s.tier is Tier.DEVICE else s.tier.value
        return out

    def metrics(self) -> dict:
        out = self.telemetry.summary()
        out["policy"] = self.policy.value
        out["devices"] = self.devices
        out["uptime_s"] = self.telemetry.now()
        out["residency"] = self.residency()
        out["migrations"] = self.migrations
        placements = self.placer.summary()
        for job, usage in out["jobs"].items():
            placed = placements.get(job, {})
            usage["placement"] = {**placed, "node": placed.get("group")}
            usage["phase_shift_s"] = placed.get("phase_shift_s")
            usage["queueing_delay_s"] = placed.get("queueing_delay_s", 0.0)
        out["placement"] = placements
        out["admission"] = {job: p for job, p in placements.items() if p["group"] is None}
        return out

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise errors.ClusterClosed("the cluster is closed; no more calls are accepted")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for group in self.schedulers:
            group.close()
        for worker in self.workers:
            worker.join(timeout=60)
        self.telemetry.events.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sleep_until(telemetry: Telemetry, t: float) -> None:
    delay = t - telemetry.now()
    if delay > 0:
        time.sleep(delay)


def _checked_policy(policy: str | Policy) -> Policy:
    try:
        return Policy.parse(policy)
    except ValueError as exc:
        raise errors.ConfigError(str(exc)) from None


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise errors.ConfigError(f"{name}={value!r}; expected a positive integer")


def _resolve_device(torch_device: str) -> str:
    """"auto": CUDA devices when present, else logical CPU devices."""
    if torch_device not in ("auto", "cpu", "cuda"):
        raise errors.ConfigError(f"torch_device={torch_device!r}; expected 'auto', 'cpu' or 'cuda'")
    if torch_device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if torch_device == "cuda":
        raise errors.ConfigError("torch_device='cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return "cpu"


def _device_name(torch_device: str, index: int) -> str:
    """Logical device `index` on a CUDA machine: one arena per logical device, several logical
    devices may share a GPU (each with its own budget)."""
    if torch_device != "cuda":
        return torch_device
    import torch

    return f"cuda:{index % max(1, torch.cuda.device_count())}"

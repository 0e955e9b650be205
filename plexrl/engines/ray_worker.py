"""The Ray worker: one actor per device (`num_gpus=1`), restarted by Ray when its process dies.

It owns the device arena (runtime.arena.DeviceArena) and, per state it has held, a module
skeleton (runtime.state.ModelState) whose parameters it binds to the state's arena region — the
same objects the local engine's worker threads use, so the backend functions run unchanged.
Decisions are not made here: the node's group scheduler sends each call together with the
transitions planned for it (`run(steps, fn, payload, ...)`).

Invariants:
- the arena is the only device memory a state uses; host copies live in the node's shared
  buffers (engines/ray_shm.py), never in this process alone;
- write-through: after a function that changes its state, the state's host copy equals its
  device copy before the call returns, so a dying worker loses only the call in flight;
- a state's Adam step count is owned by the node: it arrives with each load and leaves with each reply.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from plexrl.engines import ray_functions
from plexrl.engines.ray_shm import map_buffer, map_flags
from plexrl.policy import Tier
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.state import ModelState, load_module, skeleton_like


class DeviceWorker:
    def __init__(self, device: int, capacity_bytes: int, threads: int = 1, torch_device: str = "cpu",
                 writeback_flags: str | None = None, cpu_cores: tuple[int, ...] | None = None):
        """`cpu_cores`: pin this process to them (as a GPU worker is pinned near its GPU)."""
        if cpu_cores:
            os.sched_setaffinity(0, cpu_cores)
        self.device = device
        self._flags_path = writeback_flags  # the node's file (ray_shm.py): mapped at the first write-back
        self._flags = None
        self._failpoint: str | None = None
        self.threads = threads
        self.timing = "wall" if torch_device.startswith("cuda") else "thread_cpu"
        self.arena = DeviceArena(device, capacity_bytes, torch_device)
        self.states: dict[str, ModelState] = {}
        self._templates: dict[str, torch.nn.Module] = {}  # one loaded module per source folder
        self._lock = threading.Lock()
        import transformers.models.auto.modeling_auto  # noqa: F401  (seconds in a fresh process: pay them
        # while the cluster starts, which waits for every worker, not in a job's first call)

    def ping(self) -> int:
        return self.device

    def where(self) -> str:
        """The Ray node id this worker runs on (affinity checks; Ray engine only)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # -- the one call the scheduler makes per request --------------------------------------------
    def run(self, steps: list[dict], fn: str, payload: dict, state_id: str, mutates: bool) -> dict[str, Any]:
        """Run the planned transitions, then the function; report what each took.

        A function's own failure is returned (the transitions before it did happen); only a
        broken transition raises."""
        torch.set_num_threads(self.threads)  # per call: the executing thread is Ray's, not ours
        seconds = [self._transition(step) for step in steps]
        state = self.states[state_id]
        assert state.tier is Tier.DEVICE and state.device == self.device, f"{state_id} is not resident on {self.device}"
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        result, error = None, None
        try:
            result = ray_functions.execute(fn, state, payload)
        except Exception as exc:  # delivered to the caller; the worker carries on
            error = exc
        wall_s = time.perf_counter() - wall0
        device_s = wall_s if self.timing == "wall" else time.thread_time() - cpu0
        writeback_s = self._write_through(state) if mutates else 0.0
        return {"result": result, "error": error, "steps_s": seconds, "wall_s": wall_s, "device_s": device_s,
                "writeback_s": writeback_s, "adam_step": state.adam_step}

    def prepare(self, source: str) -> None:
        """Load a source's module template ahead of its first state here (the node calls this,
        without waiting, when a model is added), so a job's first call does not pay for it."""
        self._template(source)

    def offload(self, state_id: str, dirty: bool) -> float:
        return self._transition({"kind": "offload", "state_id": state_id, "dirty": dirty})

    def forget(self, state_id: str) -> None:
        """The state no longer exists on the node: drop its skeleton."""
        with self._lock:
            self.states.pop(state_id, None)

    # -- transitions ------------------------------------------------------------------------------
    def _transition(self, step: dict) -> float:
        """Seconds the copy took (building a state's module skeleton the first time is not a transition)."""
        if step["kind"] == "load":
            state = self._state(step["spec"])
            t0 = time.perf_counter()
            self._load(state, step)
        elif step["kind"] == "offload":
            t0 = time.perf_counter()
            self._offload(self.states[step["state_id"]], step["dirty"])
        else:
            raise ValueError(f"transition kind {step['kind']!r}; a worker runs only 'load' and 'offload'")
        return time.perf_counter() - t0

    def _load(self, state: ModelState, step: dict) -> None:
        state.host = map_buffer(step["host_path"], state.host_bytes)
        region = self.arena.region(step["offset"], state.device_bytes)
        region.copy_(state.host)
        state.attach(region, self.device, step["offset"])
        state.adam_step = step["adam_step"]

    def _offload(self, state: ModelState, dirty: bool) -> None:
        if dirty:
            state.host.copy_(state.current())
        state.unbind()  # the node's view is authoritative; this process keeps no stale binding
        state._resident, state.host, state.tier, state.device, state.offset = None, None, Tier.HOST, None, None

    def _write_through(self, state: ModelState) -> float:
        """Host copy := device copy, flagged while it runs (a death in between leaves it torn)."""
        t0 = time.perf_counter()
        flags = self._writeback_flags()
        if flags is not None:
            flags[self.device] = 1
        if self._failpoint == "writeback":  # fault injection (tests): die with the copy half done
            half = state.host.numel() // 2
            state.host[:half].copy_(state.current()[:half])
            os._exit(1)
        state.host.copy_(state.current())
        if flags is not None:
            flags[self.device] = 0
        return time.perf_counter() - t0

    def _writeback_flags(self):
        if self._flags is None and self._flags_path is not None:
            self._flags = map_flags(self._flags_path, self.device + 1)
        return self._flags

    def fail_at(self, point: str | None) -> None:
        """Fault injection for tests: 'writeback' makes this worker die halfway through its next write-back."""
        if point not in (None, "writeback"):
            raise ValueError(f"failpoint {point!r}; expected None or 'writeback'")
        self._failpoint = point

    def _template(self, source: str) -> torch.nn.Module:
        if source not in self._templates:
            self._templates[source] = load_module(source)
        return self._templates[source]

    def _state(self, spec: dict) -> ModelState:
        with self._lock:
            state = self.states.get(spec["state_id"])
            if state is None:
                source = spec["source"]
                module = skeleton_like(self._template(source))
                state = ModelState(spec["state_id"], spec["job"], spec["name"], module, spec["trainable"], source)
                self.states[spec["state_id"]] = state
            return state

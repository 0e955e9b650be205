"""The device worker: the one device seam. It owns one device's arena and runs, per request, the
transitions the node planned for it and then the function, on a state resident in the arena.

An engine hosts one per device: in the node's process (`local`), in a process of its own pinned
to a core (`process`), or as a Ray actor with `num_gpus=1` (`ray`). It holds, per state it has
run, a module skeleton (runtime.state.ModelState) whose parameters it binds to the state's arena
region, so the backend functions run unchanged. Decisions are not made here: each call arrives
with its steps (`WorkerStep`) and leaves with a `WorkerReply`.

LoRA states (runtime/lora.py) share this worker's template of their source as their frozen base:
one copy per worker and source, on the worker's torch device, whatever the number of tenants;
only their adapters live in the arena. (On CUDA that base sits outside the arena: the node's
budget leaves its bytes of the arena unused, state_manager.py.)

States whose sampler is vLLM (`StateSpec.sampler`) run `sample` and `compute_logprobs` on this
worker's vLLM engine of their base (samplers/vllm_sampler.py: `self.samplers`), and everything
else as any state; a load also has the engine hold their weights, an offload lets them go.

Invariants:
- the arena is the only device memory a state uses; host copies live in the node's shared
  buffers (host_buffers.py), never in this worker alone;
- write-through: after a function that changes its state, the state's host copy equals its
  device copy before the call returns, so a dying worker loses only the call in flight. Only
  the segments the function declares (functions.py: `writes`, `zeroes`) are written back, with
  the device's write-back flag set from the first byte to the last (a death in between leaves
  the host copy torn, and the node knows);
- a state's Adam step count is owned by the node: it arrives with each load and leaves with each reply.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from plexrl.api.types import LoraConfig
from plexrl.policy import Tier, TransitionKind
from plexrl.runtime import activation, cuda, functions, lora, precision
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.host_buffers import map_buffer, map_flags
from plexrl.runtime.state import FLOAT_BYTES, ModelState, load_module, skeleton_like
from plexrl.samplers.vllm_sampler import VllmSamplers, engine_share_bytes


class NotResident(RuntimeError):
    """A call for a state this worker does not hold: the worker was restarted since the node
    loaded it there (its process died between calls, and every device copy with it)."""


@dataclass(frozen=True)
class StateSpec:
    """What a worker needs to build its own copy of a state's module."""

    state_id: str
    job: str
    name: str
    source: str
    trainable: bool
    lora: LoraConfig | None = None
    sampler: str = "hf"
    dtype: torch.dtype = torch.float32  # of its flat memory (runtime/precision.py)
    autocast: torch.dtype | None = None


@dataclass(frozen=True)
class WorkerStep:
    """One device-side transition: a load (from `host_path` into the arena at `offset`) or an
    offload (back to the host copy, copying only when `dirty`)."""

    kind: TransitionKind
    state_id: str
    spec: StateSpec | None = None
    host_path: str = ""
    offset: int = 0
    adam_step: int = 0
    incarnation: str = ""  # which process of this device's worker answered
    dirty: bool = False
    weights_version: int = 0  # of the state's weights: a vLLM engine holding this version pushes nothing


@dataclass(frozen=True)
class WorkerReply:
    """What a call did: its result or the function's own error, and what each part took."""

    result: Any = None
    error: BaseException | None = None
    steps_s: tuple[float, ...] = ()
    wall_s: float = 0.0
    device_s: float = 0.0
    writeback_s: float = 0.0
    adam_step: int = 0
    incarnation: str = ""  # which process of this device's worker answered
    writeback_bytes: int = 0  # copied from the arena to the host copy
    writeback_zeroed_bytes: int = 0  # zeroed on the host copy in place (segments the call left zero)
    prefetch_s: tuple[float, ...] = ()  # per prefetch step; () when there was none or its load failed
    prefetch_exposed_s: float = 0.0  # of the prefetch's load: the part the function did not hide


class DeviceWorker:
    def __init__(self, device: int, capacity_bytes: int, threads: int = 1, torch_device: str = "cpu",
                 writeback_flags: str | None = None, cpu_cores: tuple[int, ...] | None = None):
        """`cpu_cores`: pin this process to them (as a GPU worker is pinned near its GPU)."""
        if cpu_cores:
            os.sched_setaffinity(0, cpu_cores)
        self.device = device
        self.incarnation = f"{os.getpid()}-{time.monotonic_ns()}"  # tells a restarted worker from its predecessor
        self._flags_path = writeback_flags  # the node's file (host_buffers.py): mapped at the first write-back
        self._flags = None
        self._failpoint: str | None = None
        self.threads = threads
        torch_device = cuda.resolve_device(torch_device)  # "auto" (Ray): this process's GPU when it has one
        self.timing = "cuda_events" if torch_device.startswith("cuda") else "thread_cpu"
        self.torch_device = torch_device
        precision.set_tf32(torch_device, False)  # float32 is IEEE float32 until a bf16 state arrives
        self.streams = cuda.Streams(torch_device)  # copies and clocks (runtime/cuda.py)
        self.arena = DeviceArena(device, capacity_bytes, torch_device)
        self.states: dict[str, ModelState] = {}
        self._mapped: dict[str, tuple[str, torch.Tensor]] = {}  # state id -> (host path, its mapping)
        self._templates: dict[str, torch.nn.Module] = {}  # one loaded module per source folder
        self._reserves: dict[str, int] = {}  # source folder -> its measured activation reserve here
        self._lock = threading.Lock()
        self.samplers = VllmSamplers(torch_device, threads)  # engines of the states that sample on vLLM
        import transformers.models.auto.modeling_auto  # noqa: F401  (seconds in a fresh process: pay them
        # while the cluster starts, which waits for every worker, not in a job's first call)

    def ping(self) -> int:
        return self.device

    def runs_on(self) -> str:
        """The torch device this worker computes on ("auto" resolved where it runs)."""
        return self.torch_device

    def where(self) -> str:
        """The Ray node id this worker runs on (affinity checks; Ray engine only)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # -- the one call the scheduler makes per request --------------------------------------------
    def run(self, steps: list[WorkerStep], fn: str, payload: Any, state_id: str,
            prefetch: list[WorkerStep] = ()) -> WorkerReply:
        """Run the planned transitions, then the function; report what each took. `prefetch`:
        the steps of the next state's load (its victims' offloads, then the load), started
        before the function and overlapping it (the reply says how much of it was hidden).

        A function's own failure is returned (the transitions before it did happen); only a
        broken transition raises. On a logical CPU device the time charged is this thread's CPU
        time (the cores are shared with controllers); on CUDA, the time between CUDA events
        around the function on the compute stream."""
        if torch.get_num_threads() != self.threads:  # per call: the executing thread may be a host's, not ours
            torch.set_num_threads(self.threads)
        with self.streams.computing():  # on CUDA this device's own stream (runtime/cuda.py)
            return self._execute(state_id, fn, payload, steps, prefetch)

    def _execute(self, state_id: str, fn: str, payload, steps, prefetch) -> WorkerReply:
        spans = [self._transition(step) for step in steps]
        state = self.states.get(state_id)
        if state is None or state.tier is not Tier.DEVICE or state.device != self.device:
            raise NotResident(f"{state_id} is not resident on device {self.device} (worker {self.incarnation})")
        ahead = self._load_ahead(prefetch)
        wall0, clock = time.perf_counter(), self.streams.run()
        result, error = None, None
        try:
            result = (self.samplers.execute(fn, state, payload) if self.samplers.serves(fn, state)
                      else functions.execute(fn, state, payload))
        except Exception as exc:  # delivered to the caller; the worker carries on
            error = exc
        clock.stop()
        wall_s = time.perf_counter() - wall0
        elsewhere = self.samplers.serves(fn, state)  # a vLLM engine computes in its own process: wall time
        copied, zeroed = functions.FUNCTIONS[fn].write_back(ok=error is None)
        writeback_s, written, cleared = self._write_through(state, copied, zeroed)
        prefetch_s, exposed_s = ahead(wall0 + wall_s, clock) if ahead is not None else ((), 0.0)
        self.streams.finish()  # every copy and kernel of this call is done: its times can be read
        device_s = wall_s if elsewhere else clock.seconds()
        seconds = tuple(span.seconds() for span in spans)
        return WorkerReply(result, error, seconds, wall_s, device_s, writeback_s, state.adam_step, self.incarnation,
                           writeback_bytes=written, writeback_zeroed_bytes=cleared, prefetch_s=prefetch_s,
                           prefetch_exposed_s=exposed_s)

    def _load_ahead(self, steps: list[WorkerStep]):
        """Run a prefetch's offloads and start its load (the last step); a function of (the
        running function's end on the host clock, its span) -> (seconds per step, exposed
        seconds) that waits for the load. A load that fails leaves its state on the host:
        (`()`, 0) and the node books nothing of it; the running call is not failed for it."""
        if not steps:
            return None
        *offloads, load = steps
        spans = [self._transition(step) for step in offloads]
        state, host, region = self._attach(load)
        pending = self.streams.load_ahead(region, host)

        def wait(function_end_s: float, function: cuda.Span) -> tuple[tuple[float, ...], float]:
            try:
                copy_s, exposed_s = pending.wait(function_end_s, function)
            except Exception:
                self._offload(state, dirty=False)
                return (), 0.0
            return (*(span.seconds() for span in spans), copy_s), exposed_s
        return wait

    def prepare(self, source: str, probe_tokens: int | None = None, measure: bool = True,
                autocast: torch.dtype | None = None) -> tuple[int, int]:
        """Load a source's module template ahead of its first state here (the node calls this
        when a model is added), so a job's first call does not pay for it. Returns what a model
        of it needs on this device beside its state: (its activation reserve, measured once per
        source when `measure` (runtime/activation.py) under the trainers' `autocast`, else 0; a vLLM
        engine's share of it)."""
        template = self._template(source)
        if measure and source not in self._reserves:
            self._reserves[source] = activation.measure_reserve(template, probe_tokens, self.arena.torch_device,
                                                                autocast)
        weights = sum(p.numel() * p.element_size() for p in template.parameters())
        return self._reserves.get(source, 0), engine_share_bytes(self.arena.torch_device, weights)

    def resize(self, capacity_bytes: int) -> None:
        """The node changed what this device keeps beside its states: every device copy goes (the
        node has forgotten them; write-through kept their host copies current) and the arena is let
        go, to be allocated at `capacity_bytes` by the next load."""
        with self._lock:
            for state in self.states.values():
                if state.tier is Tier.DEVICE:
                    self._offload(state, dirty=False)
            self.arena.resize(capacity_bytes)

    def offload(self, state_id: str, dirty: bool) -> float:
        return self._transition(WorkerStep(TransitionKind.OFFLOAD, state_id, dirty=dirty)).seconds()

    def drop(self, state_id: str) -> None:
        """Let go of the state's device copy and host mapping (the node is spilling it; the host
        copy is current): its skeleton stays for the next load."""
        with self._lock:
            state = self.states.get(state_id)
            if state is not None and state.tier is Tier.DEVICE:
                self._offload(state, dirty=False)
            self._unmap(state_id)

    def forget(self, state_id: str) -> None:
        """The state no longer exists on the node: drop its skeleton and its host mapping."""
        self.drop(state_id)
        with self._lock:
            self.states.pop(state_id, None)
        self.samplers.forget(state_id)

    def close(self) -> None:
        """The cluster is closing: stop this worker's vLLM engine processes and let go of what it
        holds. Its host mappings are unregistered (on CUDA a page-locked range whose memory
        is unmapped stays registered in the driver, and a later mapping at those addresses cannot
        be page-locked: error 712, "already mapped", in the next cluster of the same process, as
        the local engine's workers live in the caller's), then its states and arena go (on CUDA
        the memory returns to the device instead of staying in PyTorch's cache, where other
        processes could not have it)."""
        self.samplers.close()  # first: a state let go of below then has no engine to put to sleep
        for state_id in {*self.states, *self._mapped}:  # their views into the arena would keep it alive
            self.forget(state_id)
        self.arena.resize(self.arena.capacity_bytes)

    # -- transitions ------------------------------------------------------------------------------
    def _transition(self, step: WorkerStep) -> cuda.Span:
        """The copy's span (building a state's module skeleton the first time is not a transition)."""
        if step.kind is TransitionKind.LOAD:
            state, host, region = self._attach(step)
            self.samplers.prepare(state)  # starting a vLLM engine is not a transition either
            span = self.streams.load(region, host)
            t0 = time.perf_counter()
            self.samplers.switch_in(state, step.host_path, step.weights_version)  # a push, when the engine needs one
            span.add_elsewhere(time.perf_counter() - t0)  # a switch-in's time includes it
        elif step.kind is TransitionKind.OFFLOAD:
            span = cuda.Span()
            state = self.states.get(step.state_id)
            if state is not None and state.tier is Tier.DEVICE:  # else a restart took it: the host copy is current
                self._offload(state, step.dirty)
            span.stop()
        else:
            raise ValueError(f"transition kind {step.kind.value!r}; a worker runs only 'load' and 'offload'")
        return span

    def _host(self, step: WorkerStep) -> torch.Tensor:
        """The state's host buffer, mapped once per file (a fresh mapping faults on every page)
        and, on CUDA, page-locked where it is until the worker lets it go."""
        known = self._mapped.get(step.state_id)
        if known is None or known[0] != step.host_path:
            self._unmap(step.state_id)
            state = self.states[step.state_id]
            known = (step.host_path, map_buffer(step.host_path, state.host_bytes))
            self.streams.register(known[1])
            self._mapped[step.state_id] = known
        return known[1]

    def _unmap(self, state_id: str) -> None:
        known = self._mapped.pop(state_id, None)
        if known is not None:
            self.streams.unregister(known[1])  # before the mapping goes: the host budget is the files' bytes

    def _attach(self, step: WorkerStep) -> tuple[ModelState, torch.Tensor, torch.Tensor]:
        """A load's state bound to its arena region (views only: the caller copies the host copy
        in, now or ahead of the next function): (the state, its host copy, the region)."""
        state = self._state(step.spec)
        host = self._host(step)
        region = self.arena.region(step.offset, state.device_bytes)
        state.host = host
        state.attach(region, self.device, step.offset)
        state.adam_step = step.adam_step
        return state, host, region

    def _offload(self, state: ModelState, dirty: bool) -> None:
        self.samplers.switch_out(state)
        if dirty:
            self.streams.write_back(state.host, state.current(), [slice(0, state.host.numel())], [])
        state.unbind()  # the node's view is authoritative; this worker keeps no stale binding
        state._resident, state.host, state.tier, state.device, state.offset = None, None, Tier.HOST, None, None

    def _write_through(self, state: ModelState, copied, zeroed) -> tuple[float, int, int]:
        """Host copy := device copy on the segments `copied`, zero on `zeroed`, flagged while it
        runs (a death in between leaves it torn). (Seconds, bytes copied, bytes zeroed.)"""
        copy, clear = state.spans(copied), state.spans(zeroed)
        if not copy and not clear:
            return 0.0, 0, 0
        flags = self._writeback_flags()
        if flags is not None:
            flags[self.device] = 1
        die = (lambda: os._exit(1)) if self._failpoint == "writeback" else None  # fault injection: half done
        span = self.streams.write_back(state.host, state.current(), copy, clear, halfway=die)
        if flags is not None:
            flags[self.device] = 0
        return span.seconds(), _nbytes(copy), _nbytes(clear)

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

    def _base(self, source: str) -> torch.nn.Module:
        """The template of `source` as LoRA states' shared frozen base, on this worker's device."""
        template, device = self._template(source), torch.device(self.arena.torch_device)
        if next(template.parameters()).device != device:
            template.to(device)
        return lora.frozen(template)

    def _state(self, spec: StateSpec) -> ModelState:
        with self._lock:
            state = self.states.get(spec.state_id)
            if state is None:
                module = (skeleton_like(self._template(spec.source)) if spec.lora is None
                          else lora.lora_module(self._base(spec.source), spec.lora))
                state = ModelState(spec.state_id, spec.job, spec.name, module, spec.trainable, spec.source,
                                   lora=spec.lora, sampler=spec.sampler, dtype=spec.dtype, autocast=spec.autocast)
                self.states[spec.state_id] = state
                if precision.computes_in_bf16(spec.dtype, spec.autocast):
                    precision.set_tf32(self.torch_device, True)  # a bf16 cluster: float32 leftovers at TF32
            return state


def _nbytes(spans: list[slice]) -> int:
    return sum(span.stop - span.start for span in spans) * FLOAT_BYTES

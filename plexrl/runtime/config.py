"""One configuration for every engine: `ClusterConfig`, frozen, checked once.

Every engine's constructor takes the same settings (`LocalCluster(devices=2, nodes=1, **settings)`,
and likewise `ProcessCluster`, `RayCluster`) and builds one of these; a bad value raises
ConfigError naming the field, the value and what was expected, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

from plexrl.api import errors
from plexrl.policy import Policy
from plexrl.policy.placement import FirstFit, Placer

MiB = 1 << 20
# `placement` -> the policy's placer that the runtime's JobPlacer builds
PLACEMENTS = {"phase-shift": Placer, "pack-first": partial(Placer, pack_first=True), "first-fit": FirstFit}
TORCH_DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")  # runtime/precision.py says what each means


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int = 1  # node groups (one node each)
    devices_per_node: int = 2  # devices on each node (`devices=N` in an engine's arguments: N in all)
    # Per device: everything PlexRL may use there. States get what is left after the activation reserve,
    # the vLLM engines' shares and shared LoRA bases (runtime/state_manager.py).
    device_memory_bytes: int = 256 * MiB
    host_memory_bytes: int = 2048 * MiB  # per node: every state's host copy
    policy: str = "plexrl"  # request priority: plexrl (switch-aware HRRN), hrrn, sjf, fcfs
    placement: str = "phase-shift"  # or pack-first (`Placer(pack_first=True)`), first-fit
    slot_s: float = 0.05  # the placer's time slot
    horizon_slots: int = 1024  # the placer's cyclic horizon
    profile_steps: int = 3  # step marks between profile measurements
    threads_per_device: int = 1  # intra-op threads of a CPU device (results are bitwise per count)
    torch_device: str = "auto"  # auto: CUDA when present, else logical CPU devices
    # fp32: every state float32. bf16: sampler snapshots and frozen models hold bfloat16 weights
    # (2 B/param), trainers keep float32 master weights, gradients and Adam moments (16 B/param) and
    # run forward/backward under bf16 autocast. auto: bf16 where the devices are CUDA, fp32 on CPU.
    precision: str = "auto"
    workdir: str | None = None  # spill files, default checkpoints (a temporary folder when None)
    checkpoint_dir: str | None = None  # default: WORKDIR/checkpoints
    checkpoint_every_steps: int = 0  # 0: only the job's own save_state calls
    event_log: str | None = None  # a JSON-lines file of every event, written as they happen
    # Records each event log (the control plane's, each node's) keeps in memory for cluster.events()
    # and profiles; past it the oldest half goes (event_log keeps them all). None: every record.
    events_kept: int | None = None
    max_sampled_tokens: int = 1 << 16  # per sample call: num_samples x (prompt + max_tokens)
    # Device memory a function needs beyond its state, per device: None measures it for each base model
    # (runtime/activation.py) on a reference batch of activation_probe_tokens tokens (None: one sequence
    # of the model's positions, at most 4096); an integer is used as it is for every model.
    activation_reserve_bytes: int | None = None
    activation_probe_tokens: int | None = None  # the reference batch's tokens (above)
    prefetch: bool = True  # load the state a device will likely run next while its current function runs
    # A weights-only model's calls that change nothing (sample, compute_logprobs: a sampler snapshot's,
    # a frozen reference's) run on several devices of its node at once, each on a read-only copy.
    # None: on where each device has a process of its own (process, Ray engines); off on the local
    # engine, whose devices are threads of one interpreter (two of them compute no faster than one).
    read_replicas: bool | None = None
    # An option, off by default: the largest slack the placer judges a job by when it shares devices
    # with jobs that end, and ends itself (it declared its steps: `service_client(steps=...)`), e.g.
    # `PACKING_PAYS`. None: each job's own slack, a shared placement taken where it lowers the jobs'
    # summed completion time when their runs are known (policy/placement/judgement.py, "Packing by
    # effect"; the runtime's profiles do not carry their step counts yet, so there the slack decides).
    pack_limit: float | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node", "device_memory_bytes", "host_memory_bytes", "horizon_slots",
                     "profile_steps", "threads_per_device", "max_sampled_tokens"):
            _check(name, getattr(self, name), _is_int(getattr(self, name)) and getattr(self, name) >= 1,
                   "a positive integer")
        _check("checkpoint_every_steps", self.checkpoint_every_steps,
               _is_int(self.checkpoint_every_steps) and self.checkpoint_every_steps >= 0, "0 (off) or a positive integer")
        _check("activation_reserve_bytes", self.activation_reserve_bytes, self.activation_reserve_bytes is None
               or (_is_int(self.activation_reserve_bytes) and self.activation_reserve_bytes >= 0),
               "None (measured per model) or a number of bytes >= 0")
        _check("activation_probe_tokens", self.activation_probe_tokens, self.activation_probe_tokens is None
               or (_is_int(self.activation_probe_tokens) and self.activation_probe_tokens >= 3),
               "None (one sequence of the model's positions) or an integer >= 3")
        _check("slot_s", self.slot_s, isinstance(self.slot_s, (int, float)) and self.slot_s > 0,
               "a positive number of seconds")
        _check("prefetch", self.prefetch, isinstance(self.prefetch, bool), "True or False")
        _check("read_replicas", self.read_replicas, self.read_replicas is None or isinstance(self.read_replicas, bool),
               "None (on where devices are processes), True or False")
        _check("events_kept", self.events_kept, self.events_kept is None or (
            _is_int(self.events_kept) and self.events_kept >= 1), "None (every record) or a positive integer")
        _check("pack_limit", self.pack_limit, self.pack_limit is None or (
            isinstance(self.pack_limit, (int, float)) and not isinstance(self.pack_limit, bool) and self.pack_limit >= 0),
            "None (each job's own slack) or a fraction of a step >= 0, e.g. 0.33")
        _check("placement", self.placement, self.placement in PLACEMENTS, f"one of {list(PLACEMENTS)}")
        _check("torch_device", self.torch_device, self.torch_device in TORCH_DEVICES, f"one of {list(TORCH_DEVICES)}")
        _check("precision", self.precision, self.precision in PRECISIONS, f"one of {list(PRECISIONS)}")
        try:
            Policy.parse(self.policy)
        except ValueError as exc:
            raise errors.ConfigError(f"policy={self.policy!r}: {exc}") from None
        for name in ("workdir", "checkpoint_dir", "event_log"):
            value = getattr(self, name)
            if value is not None:
                _check(name, value, isinstance(value, (str, Path)) and str(value) != "", "a path or None")
                object.__setattr__(self, name, str(value))
        object.__setattr__(self, "policy", Policy.parse(self.policy).value)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @classmethod
    def of(cls, devices: int | None = None, nodes: int = 1, devices_per_node: int | None = None,
           **settings) -> "ClusterConfig":
        """From an engine's arguments: `devices` in all, split evenly over `nodes`, or
        `devices_per_node` on each. Unknown settings are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise errors.ConfigError(f"unknown cluster setting(s) {unknown}; expected some of {sorted(known)}")
        _check("nodes", nodes, _is_int(nodes) and nodes >= 1, "a positive integer")
        if devices_per_node is None:
            devices = 2 * nodes if devices is None else devices
            _check("devices", devices, _is_int(devices) and devices >= 1, "a positive integer")
            if devices % nodes:
                raise errors.ConfigError(f"devices={devices} must be a multiple of nodes={nodes}")
            devices_per_node = devices // nodes
        elif devices is not None and devices != nodes * devices_per_node:
            raise errors.ConfigError(f"devices={devices} but nodes={nodes} x devices_per_node={devices_per_node}; "
                                     "give devices or devices_per_node")
        return cls(nodes=nodes, devices_per_node=devices_per_node, **settings)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise errors.ConfigError(f"{name}={value!r}; expected {expected}")

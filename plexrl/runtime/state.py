"""A model state: one Hugging Face module and the flat memory its tensors live in.

Layout of a trainable state, in float32 elements (N = number of parameters):
    [0, N) weights | [N, 2N) gradients | [2N, 3N) Adam exp_avg | [3N, 4N) Adam exp_avg_sq
A weights-only state (sampling snapshots, frozen reference/teacher models) has just [0, N), in
its `dtype`: float32, or bfloat16 under precision "bf16" (runtime/precision.py), 2 B/param.
The flat buffers a state is given (its host buffer, its arena region) are float32 storage
whatever the state's dtype, and a state's size is rounded up to whole float32 words: the state
views them in its dtype (`typed`, `segment`), so copies between them move bytes and never
convert. Trainable states are always float32 (mixed precision runs them under autocast).
A LoRA state (`lora` set, runtime/lora.py) has the same layout over its adapter's parameters only:
its base weights are a frozen module it shares with every LoRA state of that base, not its memory
(`shared_bytes` says how large that base is, for the budgets that must count it once).

The module's parameters (and gradients) are always *views* into whichever copy is authoritative:
the device arena region while DEVICE-resident, the persistent host buffer otherwise. Moving a
state is a `copy_` between the two followed by `bind`, which re-points the views — no allocation
on the switch path (docs/design.md §4).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plexrl.api import errors
from plexrl.api.types import LoraConfig
from plexrl.policy import Tier

FLOAT_BYTES = 4
# Held while transformers builds a model (from_pretrained, from_config) and peft adds adapters:
# they patch torch globals for the duration (parameter initialisation and creation), so two
# threads of one process building at once break each other's modules ("Parameter.__new__() got
# an unexpected keyword argument '_is_hf_initialized'", seen with two tenants creating models on
# one `plexrl serve`). Re-entrant: a build may call another.
MODEL_BUILD = threading.RLock()


@dataclass
class ModelState:
    state_id: str
    job: str
    name: str
    module: torch.nn.Module
    trainable: bool
    source: str  # the folder it was loaded from
    params: list[torch.nn.Parameter] = field(init=False)
    shapes: list[torch.Size] = field(init=False)  # kept: an unbound parameter has no shape
    numel: int = field(init=False)
    host: torch.Tensor | None = None  # persistent host buffer (None while on DISK)
    tier: Tier = Tier.HOST
    device: int | None = None
    offset: int | None = None
    adam_step: int = 0
    dirty: bool = False  # device copy changed since it was loaded
    busy: bool = False
    unreadable: bool = False  # its spill file could not be read back: only a checkpoint load revives it
    last_used_s: float = 0.0
    spill_path: Path | None = None
    _resident: torch.Tensor | None = field(default=None, repr=False)  # arena region while DEVICE
    lock: threading.Lock = field(default_factory=threading.Lock)
    lora: LoraConfig | None = None  # a LoRA adapter over a shared frozen base; None: full-parameter
    sampler: str = "hf"  # what runs sample and compute_logprobs: "hf" (backends/) or "vllm" (samplers/)
    weights_version: int = 0  # bumped when its weights are rewritten in place (a sync): a vLLM engine pushes anew
    shared_bytes: int = field(init=False)  # float32 bytes of the shared base it stands on (0 if none)
    dtype: torch.dtype = torch.float32  # of its flat memory (bfloat16: a weights-only full-parameter state)
    autocast: torch.dtype | None = None  # its model runs under torch.autocast(dtype) (mixed precision)
    replica_of: str | None = None  # a read replica's primary (state_manager.py): its host copy is the primary's

    def __post_init__(self) -> None:
        params = list(self.module.parameters())  # unique: tied weights appear once
        self.params = [p for p in params if p.requires_grad] if self.lora is not None else params
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.shared_bytes = (sum(p.numel() for p in params) - self.numel) * FLOAT_BYTES if self.lora else 0
        if self.dtype != torch.float32 and (self.trainable or self.lora is not None):
            raise ValueError(f"state {self.state_id}: dtype {self.dtype} for a trainable or LoRA state; expected "
                             "float32 (their master weights, gradients and moments are float32)")

    @property
    def device_bytes(self) -> int:
        """Its flat memory, rounded up to whole float32 words (the arena's and host buffers' unit)."""
        nbytes = self.numel * self.dtype.itemsize * self.segments
        return -(-nbytes // FLOAT_BYTES) * FLOAT_BYTES

    @property
    def host_bytes(self) -> int:
        return self.device_bytes

    @property
    def segments(self) -> int:
        return 4 if self.trainable else 1

    def typed(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat buffer (float32 storage) viewed in this state's dtype."""
        return flat if flat.dtype == self.dtype else flat.view(self.dtype)

    def segment(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        return self.typed(flat)[index * self.numel : (index + 1) * self.numel]

    def spans(self, indices) -> list[slice]:
        """The ranges of the segments `indices` this state has, in float32 words of its flat
        buffer (for copies between buffers), adjacent ones merged (weights and both moments:
        [0, N) and [2N, 4N) for a float32 state)."""
        segment_bytes = self.dtype.itemsize * self.numel
        spans: list[slice] = []
        for i in sorted(i for i in set(indices) if 0 <= i < self.segments):
            start, stop = i * segment_bytes // FLOAT_BYTES, -(-(i + 1) * segment_bytes // FLOAT_BYTES)
            if spans and spans[-1].stop == start:
                start = spans.pop().start
            spans.append(slice(start, stop))
        return spans

    def bind(self, flat: torch.Tensor) -> None:
        """Point every parameter (and gradient) at its place in `flat`, in the state's dtype (a
        bfloat16 state's module runs in bfloat16)."""
        weights = self.segment(flat, 0)
        grads = self.segment(flat, 1) if self.trainable else None
        offset = 0
        for p, shape in zip(self.params, self.shapes):
            n = shape.numel()
            p.data = weights[offset : offset + n].view(shape)
            if grads is not None:
                p.grad = grads[offset : offset + n].view(shape)
            offset += n

    def unbind(self) -> None:
        """While on DISK the module holds no memory; executing it is a bug and fails loudly."""
        empty = torch.empty(0)
        for p in self.params:
            p.data = empty
            p.grad = None

    def current(self) -> torch.Tensor:
        """The authoritative flat copy here: the arena region in a worker that holds the state
        resident, else the host buffer (a node's view: write-through keeps it current)."""
        if self._resident is not None:
            return self._resident
        if self.host is None:
            raise RuntimeError(f"state {self.state_id} is on disk; restore it first")
        return self.host

    def attach(self, region: torch.Tensor, device: int, offset: int) -> None:
        self._resident, self.tier, self.device, self.offset = region, Tier.DEVICE, device, offset
        self.bind(region)
        self._move_buffers(region.device)

    def _move_buffers(self, device: torch.device) -> None:
        """Small non-parameter buffers (rotary frequencies, masks) follow the weights' device."""
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

    def detach_to_host(self) -> None:
        self._resident, self.tier, self.device, self.offset = None, Tier.HOST, None, None
        self.bind(self.host)

    def flat_weights(self) -> torch.Tensor:
        return self.segment(self.current(), 0)

    def zero_grad(self) -> None:
        if self.trainable:
            self.segment(self.current(), 1).zero_()


def load_module(folder: str | Path) -> torch.nn.Module:
    """Load a local Hugging Face causal LM folder in float32; a clear error if it is not one."""
    path = Path(folder)
    if not path.is_dir():
        raise errors.ModelLoadError(
            f"base model folder {str(folder)!r} does not exist; expected a local Hugging Face model "
            "folder (config.json + weights), e.g. one written by `plexrl tiny-model FOLDER`"
        )
    if not (path / "config.json").is_file():
        raise errors.ModelLoadError(
            f"base model folder {str(folder)!r} has no config.json; expected a Hugging Face model folder"
        )
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a runtime's logs are not a terminal
    try:
        with MODEL_BUILD:
            module = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds; the user needs one clear message
        raise errors.ModelLoadError(
            f"could not load {str(folder)!r} as a causal LM with AutoModelForCausalLM: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    module.eval()  # no dropout: results must not depend on what else runs
    return module


def skeleton_like(module: torch.nn.Module) -> torch.nn.Module:
    """A second module of the same architecture whose parameters hold no memory yet.

    Built on the meta device (no initialisation cost); buffers such as rotary frequencies are
    copied from `module` because `to_empty` leaves them uninitialised. It has its own copy of the
    config (transformers' `from_config` would share the object): a batched sample switches its
    module's attention to eager for the call (backends/slot_decode.py), which must not reach a
    call of another module running meanwhile (a worker's activation probe, on another thread).
    """
    from transformers import AutoModelForCausalLM

    with MODEL_BUILD, torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(copy.deepcopy(module.config), dtype=torch.float32)
    twin.to_empty(device="cpu")
    source_buffers = dict(module.named_buffers())
    for name, buffer in twin.named_buffers():
        buffer.copy_(source_buffers[name])
    twin.eval()
    return twin

"""What a job's clients need of a cluster: the `Cluster` protocol, which every front satisfies
(the local, process and Ray engines' `Front`, and a network edge standing in for one).

A model state is known to the job side only by its `StateHandle`: names and sizes, never tensors.
Nothing here imports torch, ray or transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from plexrl.api import errors
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig, shown

NAME_RULE = ("1 to 128 letters, digits and '.', '_', ':', '-', starting with a letter or digit "
             "(no '/', no '..': a name is part of state ids and checkpoint paths)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def check_name(what: str, value: object) -> str:
    """`value` if it is a valid job or model name, else InvalidInput naming `what` and the rule."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise errors.InvalidInput(f"{what}={shown(value)}; expected {NAME_RULE}")
    return value


@dataclass(frozen=True)
class StateHandle:
    """What a front knows of a model state: names and sizes, never tensors."""

    state_id: str
    job: str
    name: str
    source: str  # the base model folder it was loaded from
    trainable: bool
    device_bytes: int  # the state's own bytes: a LoRA state's adapter only (its shared base is the node's)
    host_bytes: int
    lora: LoraConfig | None = None  # None: a full-parameter model
    sampler: str = "hf"  # what runs its sample and compute_logprobs: "hf" or "vllm"
    activation_reserve_bytes: int = 0  # device memory its base model's functions need beyond states
    engine_bytes: int = 0  # device memory its vLLM engine takes (sampler "vllm")

    @property
    def lora_rank(self) -> int:
        """The adapter's rank; 0 for a full-parameter model."""
        return 0 if self.lora is None else self.lora.rank

    @property
    def is_snapshot(self) -> bool:
        """A sampler snapshot a weight sync made (`trainer@sync`), not a model of its own."""
        return "@" in self.name


@runtime_checkable
class Cluster(Protocol):
    """The calls a job's clients make. `submit` never raises for a call's own failure: the
    error reaches the caller through the returned future."""

    def add_model(self, job: str, name: str, base_model: str | Path, trainable: bool, slack: float = 0.10,
                  admission_timeout: float | None = None, owner: int | None = None,
                  lora: LoraConfig | None = None, sampler: str = "hf", ends: bool = False) -> StateHandle:
        """`owner`: the service client's number (`service_client` gives it), whose close frees it.
        `ends`: the job declared its length (`service_client(steps=...)`), for placement.
        `lora`: a LoRA adapter over `base_model`, whose frozen weights the cluster shares between
        every LoRA state of that base (None: a full-parameter model). `sampler`: what runs the
        model's sample and compute_logprobs, "hf" or "vllm" (frozen models only)."""
        ...

    def submit(self, state: StateHandle, fn: str, payload: dict[str, Any] | None) -> APIFuture: ...

    def latest_sampler(self, trainer_id: str, name: str) -> StateHandle | None: ...

    def limits(self, state: StateHandle) -> tuple[int, int]:
        """(vocabulary size, maximum positions) of the state's model."""
        ...

    def stop_token_ids(self, state: StateHandle) -> tuple[int, ...]: ...

    def checkpoint_path(self, state: StateHandle, name: str) -> Path: ...

    def report_step(self, job: str, step: int, **fields) -> None: ...

    def finish_job(self, job: str, owner: int | None = None) -> None:
        """Free what `owner` created (the whole job when None, or when it was the job's last owner)."""
        ...

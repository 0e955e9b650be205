"""What each served function takes: one frozen dataclass per payload, named by its `Function`
in the function table (runtime/functions.py).

A client builds a payload as a plain dict (plexrl/api/client.py: the job side knows no runtime
types); the front decodes it once, at `submit`, into the function's payload type (`decode`).
From there on a call carries the typed payload — to the node, the group scheduler, a device
worker, a sampler engine — and nothing reads a payload by key. Invariants: a payload that
reaches a node has every field of its type; a key the type does not declare, or a field with
no default that the dict lacks, fails the call at `submit` with InvalidInput naming the
function, the key and the expected fields. Values are checked by the client (api/validation.py)
and, where they depend on the model, where the call runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from plexrl.api import errors


@dataclass(frozen=True)
class NoPayload:
    """The payload of a function that takes nothing but its state (noop, read_weights)."""


@dataclass(frozen=True)
class SamplePayload:
    tokens: list[int]
    num_samples: int
    params: Any  # api.types.SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    include_prompt_logprobs: bool

    def positions(self) -> int:
        """Tokens the call holds at its end (its KV cache's positions): every sequence's prompt
        and completion."""
        return int(self.num_samples) * (len(self.tokens) + int(self.params.max_tokens))


@dataclass(frozen=True)
class LogprobsPayload:
    tokens: list[int]


@dataclass(frozen=True)
class ForwardPayload:
    data: list  # api.types.Datum
    loss_fn: Any  # a built-in loss's name or a custom loss (a callable)
    loss_fn_config: dict | None
    backward: bool


@dataclass(frozen=True)
class OptimPayload:
    params: Any  # api.types.AdamParams


@dataclass(frozen=True)
class CheckpointPayload:
    """save_state's and load_state's: a checkpoint folder and whether it carries the optimizer."""

    path: str
    with_optimizer: bool


@dataclass(frozen=True)
class SyncPayload:
    name: str
    sampler: str = "hf"


@dataclass(frozen=True)
class BatchPayload:
    """Calls of functions.BATCHED that a node coalesced into one device call: (function, its
    payload) each, and the KV-cache positions the decode may take."""

    calls: list[tuple[str, Any]]
    kv_tokens: int


@dataclass(frozen=True)
class PayloadFields:
    """A payload type's fields, as `decode` checks a dict against them (computed once per type)."""

    cls: type
    names: frozenset[str]
    required: tuple[str, ...]
    empty: Any  # the payload of no keys (None when some are required): payloads are frozen, one serves all

    @classmethod
    def of(cls, payload_type: type) -> PayloadFields:
        fields = dataclasses.fields(payload_type)
        required = tuple(f.name for f in fields if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        return cls(payload_type, frozenset(f.name for f in fields), required, None if required else payload_type())

    def decode(self, fn: str, payload: Any) -> Any:
        """`payload` (a client's dict, None for none, or already of this type) as this type."""
        if isinstance(payload, self.cls):
            return payload
        if payload is None or (isinstance(payload, dict) and not payload):
            if self.empty is not None:
                return self.empty
            payload = {}
        if not isinstance(payload, dict):
            raise errors.InvalidInput(f"{fn}'s payload is a {type(payload).__name__}; expected a dict with the "
                                      f"fields {self.expected()}")
        for key in payload:
            if key not in self.names:
                raise errors.InvalidInput(f"{fn}'s payload has the key {key!r}, which it does not take; expected "
                                          f"the fields {self.expected()}")
        for key in self.required:
            if key not in payload:
                raise errors.InvalidInput(f"{fn}'s payload lacks the key {key!r}; expected the fields "
                                          f"{self.expected()}")
        return self.cls(**payload)

    def expected(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.cls)]

"""The function API as data: every call is a `Request(fn, payload)` run against one model state.

Each function is declared once, here: what it runs, *where* — on a device worker with the state
resident in its arena (`Where.DEVICE`), or on the node from the state's host copy, which
write-through keeps current (`Where.NODE`) — and which segments of the state it changes
(`writes`; `mutates` says whether it changes any). A device function's write-through copies only
those segments back; the segments it leaves zero when it succeeds (`zeroes`: optim_step's
gradients) are zeroed on the host in place instead of copied (no link bytes for 4 B/param of
zeros). A function that fails copies back every segment it may have touched, zeroed ones too:
a refused optim_step leaves its gradients as they were.
Each function names its payload type (runtime/payloads.py): clients build payloads as dicts
(plain Python, numpy, the Tinker-like types; custom losses as callables, which cross process
boundaries by cloudpickle), and the front decodes each one once (`decode`) into that type, which
is what `run(state, payload)` gets. Every engine runs the same table.

Node functions that produce something the front must route (a weight sync's snapshot) return
it as data; the node itself carries out what spans states (`sync_weights`, see weight_sync.py).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from plexrl.api import errors
from plexrl.api.types import LoadStateResponse, OptimStepResponse, SaveStateResponse
from plexrl.backends import execution
from plexrl.runtime import checkpoint
from plexrl.runtime.payloads import (BatchPayload, CheckpointPayload, ForwardPayload, LogprobsPayload, NoPayload,
                                     OptimPayload, PayloadFields, SamplePayload, SyncPayload)
from plexrl.runtime.state import ModelState


class Where(enum.Enum):
    DEVICE = "device"  # on a worker, the state resident in its arena
    NODE = "node"  # on the node's I/O threads, on the host copy


class Segment(enum.IntEnum):
    """The segments of a state's flat buffer, by index (runtime/state.py's layout)."""

    WEIGHTS = 0
    GRADS = 1
    EXP_AVG = 2
    EXP_AVG_SQ = 3


EVERY_SEGMENT = frozenset(Segment)


@dataclass(frozen=True)
class Function:
    run: Callable[..., Any] | None  # run(state, payload); None: the node carries it out itself
    where: Where = Where.DEVICE
    mutates: bool = False  # alone (no `writes`, no `zeroes`): it may change every segment
    writes: frozenset[Segment] = frozenset()  # segments it may change
    zeroes: frozenset[Segment] = frozenset()  # segments it leaves all zero when it succeeds
    payload: type = NoPayload  # what it takes (runtime/payloads.py)
    fields: PayloadFields = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mutates and not (self.writes or self.zeroes):
            object.__setattr__(self, "writes", EVERY_SEGMENT)
        object.__setattr__(self, "mutates", bool(self.writes or self.zeroes))
        object.__setattr__(self, "fields", PayloadFields.of(self.payload))

    @property
    def needs_device(self) -> bool:
        return self.where is Where.DEVICE

    def write_back(self, ok: bool) -> tuple[frozenset[Segment], frozenset[Segment]]:
        """(segments to copy back, segments to zero on the host) after a call that succeeded (`ok`) or failed."""
        if ok:
            return self.writes - self.zeroes, self.zeroes
        return self.writes | self.zeroes, frozenset()


def _sample(s: ModelState, p: SamplePayload):
    responses, _ = execution.sample_batch(s.module, [_sample_request(s, p)], autocast=s.autocast)
    return responses[0]


def _sample_request(s: ModelState, p: SamplePayload):
    strings = p.params.stop is not None and any(isinstance(stop, str) for stop in p.params.stop)
    return execution.sample_request(s.module, p.tokens, p.num_samples, p.params, seed=p.seed, stop_token_ids=p.stop_ids,
                                    include_prompt_logprobs=p.include_prompt_logprobs,
                                    decode=decoder(s.source) if strings else None)


BATCHED = ("sample", "compute_logprobs")  # the calls a node coalesces into one device call (`sample_batch`)


@dataclass(frozen=True)
class BatchReply:
    """What one coalesced call gives each of its calls: `outcomes[i]` is (result, None) or (None,
    the call's own error); `tokens[i]` the tokens it computed (prompt + sampled), by which the
    call's device time is shared; `stats` what the decode did (slot_decode.DecodeStats; None
    from a vLLM engine, whose steps are its own)."""

    outcomes: list[tuple[Any, BaseException | None]]
    tokens: list[int]
    stats: Any


def _sample_batch(s: ModelState, batch: BatchPayload) -> BatchReply:
    """`batch.calls` (each `sample` or `compute_logprobs` with its payload) in one device call: every
    sample's rows decoded together (execution.sample_batch) in a slot cache of at most
    `batch.kv_tokens` positions, each log-prob call on its own (its shape is its own, so its result is
    as alone). A call whose input is bad fails alone."""
    outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(batch.calls)
    tokens = [0] * len(batch.calls)
    requests, positions = [], []
    for i, (fn, payload) in enumerate(batch.calls):
        try:
            if fn == "sample":
                requests.append(_sample_request(s, payload))
                positions.append(i)
            else:
                outcomes[i] = (execute(fn, s, payload), None)
                tokens[i] = len(payload.tokens)
        except Exception as exc:  # the caller's own error, delivered to it alone
            outcomes[i] = (None, exc)
    responses, stats = execution.sample_batch(s.module, requests, autocast=s.autocast, kv_tokens=batch.kv_tokens)
    for i, request, response, sampled in zip(positions, requests, responses, stats.tokens):
        outcomes[i] = (response, None)
        tokens[i] = len(request.prompt) + sampled
    return BatchReply(outcomes, tokens, stats)


@functools.lru_cache(maxsize=16)
def decoder(source: str) -> Callable[[list[int]], str]:
    """The model folder's tokenizer's `decode`, which stop strings are matched against."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # transformers raises many kinds; the user needs one clear message
        raise errors.InvalidInput(
            f"stop strings need the model's tokenizer, and {source!r} has none that AutoTokenizer loads "
            f"({type(exc).__name__}: {exc}); give stop token ids instead") from exc
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _forward_backward(s: ModelState, p: ForwardPayload):
    return execution.forward_backward(s.module, p.data, p.loss_fn, p.loss_fn_config, backward=p.backward,
                                      autocast=s.autocast)


def _save_state(s: ModelState, p: CheckpointPayload) -> tuple[SaveStateResponse, int]:
    """The response and the bytes written (the node records the materialization)."""
    return SaveStateResponse(str(p.path)), checkpoint.save_state(s, Path(p.path), p.with_optimizer)


def _load_state(s: ModelState, p: CheckpointPayload) -> LoadStateResponse:
    checkpoint.load_state(s, Path(p.path), p.with_optimizer)
    return LoadStateResponse(str(p.path))


def _read_weights(s: ModelState, _: NoPayload):
    return s.flat_weights().detach().float().cpu().numpy().copy()  # float32 whatever the state's dtype


FUNCTIONS: dict[str, Function] = {
    "sample": Function(_sample, payload=SamplePayload),
    "sample_batch": Function(_sample_batch, payload=BatchPayload),  # calls of BATCHED the node coalesced (call_batching.py, step_runner.py)
    "compute_logprobs": Function(lambda s, p: execution.compute_logprobs(s.module, p.tokens, autocast=s.autocast),
                                 payload=LogprobsPayload),
    "forward_backward": Function(_forward_backward, writes=frozenset({Segment.GRADS}), payload=ForwardPayload),
    "forward": Function(_forward_backward, payload=ForwardPayload),
    "optim_step": Function(lambda s, p: OptimStepResponse(checkpoint.adam_step(s, p.params)),
                           writes=frozenset({Segment.WEIGHTS, Segment.EXP_AVG, Segment.EXP_AVG_SQ}),
                           zeroes=frozenset({Segment.GRADS}), payload=OptimPayload),
    "noop": Function(lambda s, _: None),  # the whole request path and nothing else (benchmarks)
    "save_state": Function(_save_state, Where.NODE, payload=CheckpointPayload),
    "load_state": Function(_load_state, Where.NODE, mutates=True, payload=CheckpointPayload),
    "read_weights": Function(_read_weights, Where.NODE),  # a copy of the weights, flat float32 (tests, tools)
    "sync_weights": Function(None, Where.NODE, payload=SyncPayload),  # makes or updates a sampler snapshot: weight_sync.py
}


def spec(fn: str) -> Function:
    """The declaration of `fn`; InvalidInput naming the served functions if there is none."""
    try:
        return FUNCTIONS[fn]
    except KeyError:
        raise errors.InvalidInput(f"function {fn!r} is not served; expected one of {sorted(FUNCTIONS)}") from None


def decode(fn: str, payload: Any) -> Any:
    """A client's payload for `fn` (a dict, or None for none) as `fn`'s payload type: what
    every later step of the call reads. InvalidInput naming the function, the key and the
    expected fields for a key too many or missing; naming the served functions for an unknown `fn`."""
    function = FUNCTIONS.get(fn) or spec(fn)  # spec raises the error of an unknown `fn`
    return function.fields.decode(fn, payload)


def execute(fn: str, state: ModelState, payload: Any) -> Any:
    return FUNCTIONS[fn].run(state, payload)

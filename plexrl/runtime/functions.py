"""The function API as data: every call is (function name, payload), run against one model state.

Clients build payloads (plain Python, numpy, the Tinker-like types; custom losses as callables);
engines decide where a function runs — a worker thread here, a worker actor on Ray — and call
`execute`. Functions that need no device (`needs_device=False`) read and write the state's
authoritative copy wherever it lives; `mutates` marks the ones that change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from plexrl.backends import execution
from plexrl.runtime import checkpoint
from plexrl.runtime.state import ModelState
from plexrl.types import LoadStateResponse, OptimStepResponse


@dataclass(frozen=True)
class Function:
    run: Callable[..., Any]  # run(state, **payload)
    needs_device: bool = True
    mutates: bool = False


def _sample(s: ModelState, tokens, num_samples, params, seed, stop_ids, include_prompt_logprobs):
    return execution.sample(s.module, tokens, num_samples, params, seed=seed, stop_token_ids=stop_ids,
                            include_prompt_logprobs=include_prompt_logprobs)


def _forward_backward(s: ModelState, data, loss_fn, loss_fn_config, backward):
    return execution.forward_backward(s.module, data, loss_fn, loss_fn_config, backward=backward)


def _load_state(s: ModelState, path, with_optimizer) -> LoadStateResponse:
    checkpoint.load_state(s, Path(path), with_optimizer)
    return LoadStateResponse(str(path))


FUNCTIONS: dict[str, Function] = {
    "sample": Function(_sample),
    "compute_logprobs": Function(lambda s, tokens: execution.compute_logprobs(s.module, tokens)),
    "forward_backward": Function(_forward_backward, mutates=True),
    "forward": Function(_forward_backward),
    "optim_step": Function(lambda s, params: OptimStepResponse(checkpoint.adam_step(s, params)), mutates=True),
    "load_state": Function(_load_state, needs_device=False, mutates=True),
    "noop": Function(lambda s: None),  # the whole request path and nothing else (benchmarks)
}
# Engine-level functions: their effect reaches beyond one state, so each engine runs them itself.
# save_state: a materialization the StateManager times; sync_weights: makes or updates a snapshot.
ENGINE_FUNCTIONS = {"save_state": Function(None, needs_device=False),
                    "sync_weights": Function(None, needs_device=False)}


def spec(fn: str) -> Function:
    try:
        return FUNCTIONS[fn] if fn in FUNCTIONS else ENGINE_FUNCTIONS[fn]
    except KeyError:
        raise KeyError(f"unknown function {fn!r}; expected one of {sorted([*FUNCTIONS, *ENGINE_FUNCTIONS])}") from None


def execute(fn: str, state: ModelState, payload: dict[str, Any]) -> Any:
    return FUNCTIONS[fn].run(state, **payload)

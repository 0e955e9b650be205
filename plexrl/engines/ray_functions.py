"""The function API as data: a request crosses Ray as (function name, payload), never as a closure.

The job-facing clients (plexrl.client) build each call as a closure over its arguments. The Ray
engine reads those arguments back (`payload_of`: the closure's captured values, by name) and a
worker runs the same backend call on its own copy of the state (`execute`). Payloads hold plain
Python, numpy arrays and Tinker-like types; custom loss callables travel by Ray's cloudpickle.

Until `cluster.submit` receives the payload explicitly (a hook asked of plexrl.client), the
names below must match the client's closure variables; a mismatch fails loudly here.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable

import numpy as np

from plexrl import errors
from plexrl.backends import execution
from plexrl.runtime import checkpoint
from plexrl.runtime.state import ModelState
from plexrl.types import LoadStateResponse, OptimStepResponse, SaveStateResponse


def _save_state(s: ModelState, path: str, with_optimizer: bool) -> tuple[SaveStateResponse, int]:
    written = checkpoint.save_state(s, Path(path), with_optimizer)
    return SaveStateResponse(str(path)), written


def _read_weights(s: ModelState) -> np.ndarray:
    return s.flat_weights().numpy().copy()


# name -> (payload fields, run(state, **payload)). Results are what the client's future resolves to;
# save_state also returns the bytes it wrote (the node records the materialization).
FUNCTIONS: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "sample": (
        ("tokens", "num_samples", "params", "seed", "stop_ids", "include_prompt_logprobs"),
        lambda s, tokens, num_samples, params, seed, stop_ids, include_prompt_logprobs: execution.sample(
            s.module, tokens, num_samples, params, seed=seed, stop_token_ids=stop_ids,
            include_prompt_logprobs=include_prompt_logprobs),
    ),
    "compute_logprobs": (("tokens",), lambda s, tokens: execution.compute_logprobs(s.module, tokens)),
    "forward_backward": (
        ("data", "loss_fn", "loss_fn_config", "backward"),
        lambda s, data, loss_fn, loss_fn_config, backward: execution.forward_backward(
            s.module, data, loss_fn, loss_fn_config, backward=backward),
    ),
    "optim_step": (("params",), lambda s, params: OptimStepResponse(checkpoint.adam_step(s, params))),
    "save_state": (("path", "with_optimizer"), _save_state),
    "load_state": (
        ("path", "with_optimizer"),
        lambda s, path, with_optimizer: (checkpoint.load_state(s, Path(path), with_optimizer),
                                         LoadStateResponse(str(path)))[1],
    ),
    "read_weights": ((), _read_weights),
    "noop": ((), lambda s: None),  # the whole request path and nothing else (benchmarks)
}
FUNCTIONS["forward"] = FUNCTIONS["forward_backward"]
NODE_FUNCTIONS = {"sync_weights": ("name",)}  # run by the node's StateManager, not on a device


def payload_of(fn: str, run: Callable | None) -> dict[str, Any]:
    """The arguments of a client call, read from the closure the client built for it."""
    fields = FUNCTIONS[fn][0] if fn in FUNCTIONS else NODE_FUNCTIONS.get(fn)
    if fields is None:
        raise errors.InvalidInput(f"function {fn!r} is not served by the Ray engine; expected one of "
                                  f"{sorted([*FUNCTIONS, *NODE_FUNCTIONS])}")
    captured = inspect.getclosurevars(run).nonlocals if run is not None else {}
    missing = [f for f in fields if f not in captured]
    if missing:
        raise errors.InvalidInput(
            f"the client's {fn!r} call captures {sorted(captured)} but the Ray engine needs {list(fields)} "
            f"(missing {missing}); plexrl.client and plexrl.engines.ray_functions disagree")
    return {f: captured[f] for f in fields}


def execute(fn: str, state: ModelState, payload: dict[str, Any]) -> Any:
    return FUNCTIONS[fn][1](state, **payload)

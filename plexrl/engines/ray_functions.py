"""What a Ray worker runs: the runtime's functions (plexrl.runtime.functions), plus the two that
need a worker's view of the state here (save_state returns the bytes it wrote, so the node can
record the materialization; read_weights copies the weights out for the driver).
A request crosses Ray as (function name, payload), never as a closure; payloads hold plain
Python, numpy arrays and Tinker-like types, custom loss callables travel by Ray's cloudpickle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from plexrl.runtime import checkpoint, functions
from plexrl.runtime.state import ModelState
from plexrl.types import SaveStateResponse


def _save_state(s: ModelState, path: str, with_optimizer: bool) -> tuple[SaveStateResponse, int]:
    written = checkpoint.save_state(s, Path(path), with_optimizer)
    return SaveStateResponse(str(path)), written


def _read_weights(s: ModelState) -> np.ndarray:
    return s.flat_weights().numpy().copy()


FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{name: f.run for name, f in functions.FUNCTIONS.items()},
    "save_state": _save_state,
    "read_weights": _read_weights,
}
NODE_FUNCTIONS = ("sync_weights",)  # run by the node's StateManager, not on a device


def mutates(fn: str) -> bool:
    return fn in functions.FUNCTIONS and functions.FUNCTIONS[fn].mutates


def execute(fn: str, state: ModelState, payload: dict[str, Any]) -> Any:
    return FUNCTIONS[fn](state, **payload)

"""A node's spill files: the DISK tier of its states (state_manager.py spills and restores them).

A spilled state's flat memory is one safetensors file in the node's spill folder, in the state's
own dtype, so that it reads back exactly as it was. File names are opaque (`spill-N`), so no two
states' names can make them collide. A file that cannot be read back marks its state
`unreadable`: it comes back zeroed from then on, for the checkpoint load that revives it to fill.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plexrl.api import errors
from plexrl.runtime.state import ModelState


class SpillFiles:
    def __init__(self, folder: Path):
        self.folder = folder
        self._ids = itertools.count()

    def write(self, state: ModelState) -> Path:
        """Write `state`'s host copy to a new spill file; its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"spill-{next(self._ids)}.safetensors"  # opaque: no name can alias
        save_file({"flat": state.typed(state.host)}, str(path),  # in its dtype: read back as it was
                  metadata={"state": state.state_id, "adam_step": str(state.adam_step)})
        return path

    def read(self, state: ModelState, host: torch.Tensor) -> None:
        """Fill `host` from `state`'s spill file (with zeros for an unreadable state); StateLost,
        and the state marked unreadable, when the file cannot be read."""
        try:
            if state.unreadable:
                host.zero_()
            else:
                state.typed(host).copy_(load_file(str(state.spill_path))["flat"])
        except Exception as exc:
            state.unreadable = True
            raise errors.StateLost(
                f"model {state.state_id!r} could not be read back from its spill file ({type(exc).__name__}: {exc}); "
                "restore it from a checkpoint with load_state_with_optimizer(path) (load_state for weights only) "
                "before using it") from exc

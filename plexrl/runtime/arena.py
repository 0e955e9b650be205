"""A device arena: one buffer for the states resident on a device, allocated at its first use.

Its size is the device's budget less what the node keeps free beside it (state_manager.py:
the activation reserve, vLLM engines' shares, shared LoRA bases), so that memory really is free
on CUDA. Resident states are contiguous regions of it (the transition planner picks the offsets),
so the budget cannot be exceeded by accident and no memory is allocated on the switch path.
When the node changes that size (a new model needs a larger reserve) it drops every device copy
first and the buffer is let go (`resize`): the next load allocates it at the new size.
On a CPU-only machine the arena is host memory standing in for a device; on CUDA it is device memory.
"""

from __future__ import annotations

import torch

from plexrl.api import errors
from plexrl.runtime.state import FLOAT_BYTES


class DeviceArena:
    def __init__(self, index: int, capacity_bytes: int, torch_device: str = "cpu"):
        """`capacity_bytes`: the device's budget (device_memory_bytes) until the node `resize`s it."""
        self.index = index
        self.budget_bytes = capacity_bytes
        self.capacity_bytes = capacity_bytes - capacity_bytes % FLOAT_BYTES
        self.torch_device = torch_device
        self._buffer: torch.Tensor | None = None  # allocated lazily: constructors do no heavy work

    def resize(self, capacity_bytes: int) -> None:
        """Let the buffer go (no state may be resident in it: views would keep it alive) and
        allocate the next one at `capacity_bytes`; on CUDA the memory goes back to the device,
        for activations and for engines in other processes."""
        self._buffer = None
        self.capacity_bytes = capacity_bytes - capacity_bytes % FLOAT_BYTES
        if self.torch_device.startswith("cuda"):
            torch.cuda.empty_cache()

    @property
    def buffer(self) -> torch.Tensor:
        """Allocated at the first use. A budget the device cannot hold is a ConfigError naming it
        (on every use until the cluster is set up again), never a CUDA out-of-memory crash later."""
        if self._buffer is None:
            try:
                self._buffer = torch.empty(self.capacity_bytes // FLOAT_BYTES, dtype=torch.float32,
                                           device=self.torch_device)
            except torch.OutOfMemoryError:
                free, total = torch.cuda.mem_get_info(self.torch_device)
                beside = self.budget_bytes - self.capacity_bytes  # kept free for activations and engines
                raise errors.ConfigError(
                    f"device_memory_bytes={self.budget_bytes:,} does not fit device {self.index} "
                    f"({self.torch_device}: {free:,} bytes free of {total:,}): its arena of {self.capacity_bytes:,} "
                    f"bytes (the budget less {beside:,} kept free beside it for activations and engines) does not "
                    f"fit; expected device_memory_bytes <= {free:,}") from None
        return self._buffer

    def region(self, offset_bytes: int, nbytes: int) -> torch.Tensor:
        if offset_bytes < 0 or offset_bytes + nbytes > self.capacity_bytes or offset_bytes % FLOAT_BYTES:
            raise ValueError(
                f"region [{offset_bytes}, {offset_bytes + nbytes}) is outside arena {self.index} "
                f"of {self.capacity_bytes} bytes"
            )
        start = offset_bytes // FLOAT_BYTES
        return self.buffer[start : start + nbytes // FLOAT_BYTES]

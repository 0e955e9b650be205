"""A device arena: one buffer allocated once at the device's budget.

Resident states are contiguous regions of it (the transition planner picks the offsets), so the
device budget cannot be exceeded by accident and no memory is allocated on the switch path.
On a CPU-only machine the arena is host memory standing in for a device; on CUDA it is device memory.
"""

from __future__ import annotations

import torch

from plexrl.api import errors
from plexrl.runtime.state import FLOAT_BYTES


class DeviceArena:
    def __init__(self, index: int, capacity_bytes: int, torch_device: str = "cpu"):
        self.index = index
        self.capacity_bytes = capacity_bytes - capacity_bytes % FLOAT_BYTES
        self.torch_device = torch_device
        self._buffer: torch.Tensor | None = None  # allocated lazily: constructors do no heavy work

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
                raise errors.ConfigError(
                    f"device_memory_bytes={self.capacity_bytes:,} does not fit device {self.index} "
                    f"({self.torch_device}: {free:,} bytes free of {total:,}); expected device_memory_bytes <= "
                    f"{free:,} (each device's arena is allocated once, at its budget)") from None
        return self._buffer

    def region(self, offset_bytes: int, nbytes: int) -> torch.Tensor:
        if offset_bytes < 0 or offset_bytes + nbytes > self.capacity_bytes or offset_bytes % FLOAT_BYTES:
            raise ValueError(
                f"region [{offset_bytes}, {offset_bytes + nbytes}) is outside arena {self.index} "
                f"of {self.capacity_bytes} bytes"
            )
        start = offset_bytes // FLOAT_BYTES
        return self.buffer[start : start + nbytes // FLOAT_BYTES]

"""Host buffers in shared memory: the node owns them, its workers map them.

A state's persistent host buffer is a file under a node-local shared-memory folder (/dev/shm when
present) mapped with `torch.from_file(shared=True)`. The node's StateManager actor creates and
frees the files; a worker process maps a buffer by path to copy between it and its arena. A
worker that dies takes nothing with it but its arena: every host copy outlives it (that is what
recovery restores from).

Invariant: a buffer's file exists from `allocate` until `release`; paths are unique per node.

Room: a file is made at its size without its pages (they are taken when first written), so a
/dev/shm too small for it would let the mapping succeed and kill the process with SIGBUS, no
Python error, at the first write past its room. A buffer is therefore only made when the folder's
free bytes hold it and the untouched rest of this node's other buffers; else a ConfigError says so.

Torn writes: a worker writes a state's host copy back (write-through) with its device's byte of
the node's `writeback.flags` file set, and clears it after; a worker found dead with its byte set
died midway, so that host copy is torn and must not be restored from (worker_health.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Callable

import torch

from plexrl.api import errors

FLOAT_BYTES = 4
WRITEBACK_FLAGS = "writeback.flags"
OWNER = "owner.pid"  # the process that made a node folder; the folder is stale once it is gone


def shm_root() -> Path:
    """/dev/shm when the OS has it (RAM-backed), else the temp folder."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def node_folder(cluster: str, group: int) -> Path:
    """Where node group `group` of cluster `cluster` keeps its shared host buffers."""
    return shm_root() / f"{cluster}-node{group}"


def map_buffer(path: str | Path, nbytes: int) -> torch.Tensor:
    """A float32 view of an existing shared buffer file (writes are seen by every process)."""
    return torch.from_file(str(path), shared=True, size=nbytes // FLOAT_BYTES, dtype=torch.float32)


def map_flags(path: str | Path, count: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=count, dtype=torch.int8)


class SharedHostBuffers:
    """Allocates a node's host buffers as shared-memory files and remembers which file backs which tensor."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._paths: dict[int, Path] = {}  # tensor data_ptr -> backing file
        self._ids = itertools.count()
        # /dev/shm is RAM: files left behind by a process that exits without close() would stay
        # until reboot. At exit (or when this object goes) every file it still owns is removed.
        self._cleanup = weakref.finalize(self, _unlink_all, self._paths, self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / OWNER).write_text(str(os.getpid()))

    def allocate(self, nbytes: int) -> torch.Tensor:
        return self._new(f"host-{next(self._ids)}.f32", nbytes, map_buffer)

    def flags(self, count: int) -> torch.Tensor:
        """The node's write-back flags: `count` bytes, one per device index, all clear."""
        return self._new(WRITEBACK_FLAGS, count, map_flags)

    def _new(self, name: str, nbytes: int, mapping: Callable[[Path, int], torch.Tensor]) -> torch.Tensor:
        """A zeroed file of `nbytes` in the folder, mapped by `mapping`, remembered for release."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._check_room(nbytes)
        path = self.folder / name
        with open(path, "wb") as f:
            os.ftruncate(f.fileno(), nbytes)
        tensor = mapping(path, nbytes)
        self._paths[tensor.data_ptr()] = path
        return tensor

    def _check_room(self, nbytes: int) -> None:
        """ConfigError unless the folder's free bytes hold `nbytes` more and the pages this
        node's buffers have not taken yet (see the module docstring)."""
        stat = os.statvfs(self.folder)
        free = stat.f_bavail * stat.f_frsize
        untaken = 0
        for path in self._paths.values():
            try:
                info = path.stat()
            except OSError:
                continue
            untaken += max(0, info.st_size - 512 * info.st_blocks)
        if nbytes + untaken > free:
            raise errors.ConfigError(
                f"a host buffer of {nbytes:,} bytes does not fit {self.folder}: its file system has {free:,} bytes "
                f"free, {untaken:,} of them promised to this node's other buffers; writing past the room would kill "
                "the process with SIGBUS. Expected a larger /dev/shm (docker run --shm-size=...) or a smaller "
                "host_memory_bytes or states")

    def path_of(self, tensor: torch.Tensor) -> Path:
        try:
            return self._paths[tensor.data_ptr()]
        except KeyError:
            raise KeyError(f"tensor at {tensor.data_ptr():#x} is not a shared host buffer of {self.folder}") from None

    def release(self, tensor: torch.Tensor | None) -> None:
        """Unlink the file; the memory goes once every process has dropped its mapping."""
        if tensor is None:
            return
        path = self._paths.pop(tensor.data_ptr(), None)
        if path is not None:
            path.unlink(missing_ok=True)

    def release_all(self) -> None:
        _unlink_all(self._paths, self.folder)


def _unlink_all(paths: dict[int, Path], folder: Path) -> None:
    for path in paths.values():
        path.unlink(missing_ok=True)
    paths.clear()
    (folder / OWNER).unlink(missing_ok=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove the node folders under `root` (default: shm_root()) whose owner process is gone (a
    driver killed with -9 leaves its host buffers in RAM-backed /dev/shm). Returns what it removed."""
    removed = []
    for folder in (root or shm_root()).glob("plexrl-*-node*"):
        try:
            pid = int((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or being made right now
        if not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True

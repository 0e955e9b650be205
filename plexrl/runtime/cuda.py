"""The CUDA pieces of the device seam, each with a CPU fallback that is the plain behaviour.

A device worker (device_worker.py) moves state bytes between host buffers and its arena and
times what it runs through one `Streams` object for its torch device:

- on CUDA, host buffers are page-locked where they are (`register`: cudaHostRegister of the
  exact mapping, undone by `unregister` when the worker lets the mapping go: a spill or a free),
  so that copies run at link speed and the host budget stays true — `pin_memory=True` would go
  through PyTorch's caching host allocator, which rounds sizes up to a power of two and keeps
  freed blocks. Copies are `non_blocking` on a side stream, ordered with events: a function waits
  for its state's load; a write-back waits for the function's end, and is complete (synchronised)
  before the call returns (write-through). Times come from CUDA events, not from host clocks
  that stop before the device does;
- each worker computes on a CUDA stream of its own (`computing`), not the device's default one:
  several logical devices on one GPU (the local engine's threads) would otherwise queue behind
  each other's kernels, and each one's event times would include the others'. The stream waits
  for the default stream's earlier work when a call starts, and `finish` ends every call with
  its work done, so what runs outside calls (measuring the reserve, reading weights) stays ordered;
- on CPU, copies are plain `copy_`, a function's time is the thread's CPU time (the cores are
  shared with the controllers) and a copy's is wall time: what the runtime always did, bit for bit.

Out of scope here: what is copied (the worker decides) and when (the node plans it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from plexrl.api import errors


def resolve_device(torch_device: str) -> str:
    """"auto": "cuda" when a CUDA device is visible to this process, else "cpu"; "cuda" without
    one is a ConfigError; any other name (e.g. "cuda:1") is kept."""
    if torch_device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch_device.startswith("cuda") and not torch.cuda.is_available():
        raise errors.ConfigError(f"torch_device={torch_device!r} but no CUDA device is available to this process; "
                                 "use 'auto' or 'cpu'")
    return torch_device


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context (the local
# engine's workers of several GPUs share one process)


def register(tensor: torch.Tensor) -> None:
    """Page-lock the memory of a host tensor in place, at its exact size (CUDA only). The runtime's
    buffers are files on a RAM-backed file system (host_buffers.shm_root): the pages of a file
    on disk may not be page-locked (one such test buffer under /tmp was refused on an H200 host)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, HOST_REGISTER_PORTABLE)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes:,}-byte host buffer at "
                           f"{tensor.data_ptr():#x} failed with CUDA error {int(code)} ({_failed(code)}); expected "
                           "a page-lockable mapping (a shared-memory file under /dev/shm)")


def unregister(tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    code = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    if int(code) != 0:
        raise RuntimeError(f"cudaHostUnregister of the host buffer at {tensor.data_ptr():#x} failed with CUDA "
                           f"error {int(code)} ({_failed(code)}); expected a buffer registered by "
                           "plexrl.runtime.cuda.register")


def _failed(code) -> str:
    """The error's name, the error cleared: a failed runtime call stays this thread's last CUDA
    error, which the next kernel launch's check reads and reports as its own (after a refused
    register, an unrelated embedding failed with 'invalid argument'). PyTorch's cudart bindings
    have no cudaGetLastError, so it is called on the runtime library this process loaded (none
    found: the runtime is linked in statically and the error is left as it is)."""
    for path in loaded_libraries("libcudart.so"):
        ctypes.CDLL(path).cudaGetLastError()
    try:
        return torch.cuda.cudart().cudaGetErrorString(code)
    except (AttributeError, TypeError):  # the bindings differ between torch versions
        return "unnamed"


def check_gpus_hold(devices: int, device_memory_bytes: int, gpu_bytes: list[int]) -> None:
    """`devices` logical devices go round robin onto GPUs of `gpu_bytes` each (the local and
    process engines): a ConfigError when the budgets of one GPU's share exceed its memory, naming
    the budget that would fit, instead of an arena that cannot be allocated on the third device."""
    for gpu, total in enumerate(gpu_bytes):
        sharing = len(range(gpu, devices, len(gpu_bytes)))
        if sharing * device_memory_bytes > total:
            raise errors.ConfigError(
                f"{devices} devices of device_memory_bytes={device_memory_bytes:,} on {len(gpu_bytes)} GPU(s): "
                f"GPU {gpu} hosts {sharing} of them, {sharing * device_memory_bytes:,} bytes, more than its "
                f"{total:,}; expected device_memory_bytes <= {total // sharing:,}, or fewer devices")


def loaded_libraries(name: str) -> list[str]:
    """Paths of the shared libraries whose file name starts with `name` mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if name in line}
    except OSError:  # not Linux
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(name))


class Span:
    """One timed piece of work on `stream` (None: the host's clocks): `seconds()` once it is
    `stop`ped and, on CUDA, its stream has reached its end."""

    def __init__(self, stream=None, cpu_time: bool = False):
        self._stream, self._cpu_time, self._s = stream, cpu_time, 0.0
        self._elsewhere_s = 0.0  # part of the work done in another process (a vLLM engine's weight push)
        if stream is None:
            self._t0, self._c0 = time.perf_counter(), time.thread_time()
        else:
            self.begin, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.begin.record(stream)

    def stop(self) -> "Span":
        if self._stream is not None:
            self.end.record(self._stream)
        else:
            self._s = time.thread_time() - self._c0 if self._cpu_time else time.perf_counter() - self._t0
        return self

    def add_elsewhere(self, seconds: float) -> "Span":
        self._elsewhere_s += seconds
        return self

    def seconds(self) -> float:
        here = self.begin.elapsed_time(self.end) / 1e3 if self._stream is not None else self._s
        return here + self._elsewhere_s


class Streams:
    """Copies and clocks for one worker on `torch_device` (CPU: plain; CUDA: a side stream and events)."""

    def __init__(self, torch_device: str):
        self.cuda = torch_device.startswith("cuda")
        self.torch_device = torch_device
        self._copy = None  # the side stream, made on first use (constructors do no device work)
        self._compute = None  # this worker's compute stream (`computing`), made on first use
        self._ahead = None  # CUDA: the prefetch stream; CPU: the prefetch thread (load_ahead)
        self._ahead_thread: ThreadPoolExecutor | None = None

    @property
    def copy_stream(self):
        if self._copy is None:
            self._copy = torch.cuda.Stream(device=self.torch_device)
        return self._copy

    def computing(self):
        """A context in which this worker's calls run: on CUDA its own compute stream is the
        current one (after the default stream's earlier work); on CPU nothing."""
        if not self.cuda:
            return contextlib.nullcontext()
        if self._compute is None:
            self._compute = torch.cuda.Stream(device=self.torch_device)
        self._compute.wait_stream(torch.cuda.default_stream(self.torch_device))
        return torch.cuda.stream(self._compute)

    def register(self, host: torch.Tensor) -> None:
        if self.cuda:
            with torch.cuda.device(self.torch_device):  # a context must be current
                register(host)

    def unregister(self, host: torch.Tensor) -> None:
        if self.cuda:
            with torch.cuda.device(self.torch_device):
                unregister(host)

    def load(self, region: torch.Tensor, host: torch.Tensor) -> Span:
        """region := host; the compute stream's next work waits for it."""
        if not self.cuda:
            span = Span()
            region.copy_(host)
            return span.stop()
        compute, side = torch.cuda.current_stream(self.torch_device), self.copy_stream
        side.wait_stream(compute)  # earlier work on this region (a previous tenant's function) ends first
        span = Span(side)
        with torch.cuda.stream(side):
            region.copy_(host, non_blocking=True)
        span.stop()
        compute.wait_event(span.end)
        return span

    def load_ahead(self, region: torch.Tensor, host: torch.Tensor) -> "Ahead":
        """region := host, overlapping the function this worker runs next (a prefetch). On CUDA
        the copy runs on a stream of its own (not the side stream, whose write-back of the
        running function must not queue behind it); on CPU on a thread of its own (torch's copy
        releases the GIL). Every earlier call on this worker has finished (`finish`), so nothing
        still reads the region."""
        if not self.cuda:
            if self._ahead_thread is None:
                self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="plexrl-prefetch")
            return Ahead(self._ahead_thread.submit(_timed_copy, region, host))
        if self._ahead is None:
            self._ahead = torch.cuda.Stream(device=self.torch_device)
        span = Span(self._ahead)
        with torch.cuda.stream(self._ahead):
            region.copy_(host, non_blocking=True)
        return Ahead(span=span.stop())

    def run(self) -> Span:
        """The span of a function on the compute stream (on CPU: the thread's CPU time)."""
        return Span(torch.cuda.current_stream(self.torch_device) if self.cuda else None, cpu_time=not self.cuda)

    def write_back(self, host: torch.Tensor, device: torch.Tensor, copy: list[slice], clear: list[slice],
                   halfway=None) -> Span:
        """host[copy] := device[copy] and host[clear] := 0, complete when this returns. On CUDA the
        copies wait for the compute stream's end and run on the side stream while the host zeroes
        its part (the span times the copies; the zeroing overlaps them). `halfway` (fault injection):
        called with the first span half copied, instead of the rest."""
        if not self.cuda:
            span = Span()
            _write_back(host, device, copy, clear, halfway)
            return span.stop()
        compute, side = torch.cuda.current_stream(self.torch_device), self.copy_stream
        side.wait_stream(compute)  # the function's end
        span = Span(side)
        with torch.cuda.stream(side):  # the copies are queued first: the host zeroes while they run
            _write_back(host, device, copy, clear, halfway and (lambda: (side.synchronize(), halfway())))
        span.stop()
        side.synchronize()
        return span

    def finish(self) -> None:
        """Every copy and function issued so far is done (a call's times can be read)."""
        if self.cuda:
            self.copy_stream.synchronize()
            if self._ahead is not None:
                self._ahead.synchronize()
            torch.cuda.current_stream(self.torch_device).synchronize()


class Ahead:
    """A prefetch in flight (`Streams.load_ahead`): `wait(function_end_s, function)` once the
    function it overlaps has been issued gives (the copy's seconds, the part of them the function
    did not hide: from the function's end, or the copy's start if later, to the copy's end, or 0;
    a copy that started after the function ended hid nothing, and is not exposed for longer
    than it took)."""

    def __init__(self, future: Future | None = None, span: Span | None = None):
        self._future, self._span = future, span

    def wait(self, function_end_s: float, function: Span) -> tuple[float, float]:
        if self._future is not None:  # CPU: host clocks, from the copy's thread
            start, end = self._future.result()
            return end - start, max(0.0, end - max(start, function_end_s))
        self._span.end.synchronize()
        function.end.synchronize()
        seconds = self._span.seconds()
        return seconds, min(seconds, max(0.0, function.end.elapsed_time(self._span.end) / 1e3))


def _timed_copy(region: torch.Tensor, host: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    region.copy_(host)
    return start, time.perf_counter()


def _write_back(host, device, copy, clear, halfway) -> None:
    if halfway is not None:
        first = (copy or clear)[0]
        half = slice(first.start, (first.start + first.stop) // 2)
        host[half].copy_(device[half], non_blocking=True)
        halfway()
    for part in copy:
        host[part].copy_(device[part], non_blocking=True)
    for part in clear:
        host[part].zero_()

"""Worker health on a node: a worker that died during a call, one found restarted between calls,
and waiting for the host to restart one (node.py's docstring says what a death means for calls).

When a worker dies, its in-flight request fails with errors.WorkerFailed (retriable: nothing is
retried behind the caller's back), every state that was resident on its device falls back to its
host copy, and its device runs nothing until the new worker answers. A worker that died while
writing a host copy back (its write-back flag was set) tore that state's host copy: the request
fails with errors.StateLost instead.

Invariants: each death or restart is counted once in `recovery` and logged once (`worker_failed`,
`worker_restarted`); a torn state takes nothing but a restore (load_state) until one succeeds
(`restored`); a reply from a new worker process moves the node's view of its device back to the
host copies of everything but what that call loaded.
"""

from __future__ import annotations

import threading
import time

from plexrl.api import errors
from plexrl.runtime import remote
from plexrl.runtime.scheduler import Request
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry

RESTART_TIMEOUT_S = 300.0
RESTART_POLL_S = 0.05


class WorkerHealth:
    def __init__(self, node: int, workers: dict, state_manager: StateManager, telemetry: Telemetry,
                 writeback, lock: threading.Condition):
        """`workers`: device index -> DeviceWorker handle; `writeback`: per device, a flag set while
        its worker writes a host copy back; `lock`: the node's lock."""
        self.node = node
        self.workers = workers
        self.sm = state_manager
        self.telemetry = telemetry
        self.writeback = writeback
        self.lock = lock
        self.recovery = {"worker_restarts": 0, "restored_states": 0, "lost_work_s": 0.0}
        self._incarnations: dict[int, str] = {}  # device -> the worker process last heard from
        self._restarting: set[int] = set()  # devices whose dispatcher must wait for their new worker
        self._torn: set[str] = set()  # states whose host copy a dying worker left half written

    def check_incarnation(self, device: int, incarnation: str, loaded_now: set[str]) -> None:
        """A reply from a new worker process (the old one died between calls): whatever the node
        thought resident there, apart from what this call loaded, is gone: back to host copies."""
        known = self._incarnations.setdefault(device, incarnation)
        if known == incarnation:
            return
        self._incarnations[device] = incarnation
        with self.lock:
            gone = [s for s in self.sm.states.resident_on((device,)) if s.state_id not in loaded_now]
            for state in gone:
                self.sm.forget_device_copy(state)
        self.recovery["worker_restarts"] += 1
        self.recovery["restored_states"] += len(gone)
        self.telemetry.events.emit(self.telemetry.now(), "worker_restarted", node=self.node, device=device,
                                   restored=[s.state_id for s in gone], found="idle")

    def died(self, device: int, request: Request, dispatched: float, exc: BaseException) -> errors.PlexRLError:
        """`device`'s worker died running `request`: the error its caller gets."""
        lost_s = self.telemetry.now() - dispatched
        torn = bool(self.writeback[device])
        if torn:
            self.writeback[device] = 0
            self._torn.add(request.state_id)
        restored = [sid for sid in self.sm.lose_device(device) if sid not in self._torn]
        self.recovery["worker_restarts"] += 1
        self.recovery["restored_states"] += len(restored)
        self.recovery["lost_work_s"] += lost_s
        self.telemetry.events.emit(self.telemetry.now(), "worker_failed", node=self.node, device=device,
                                   request_id=request.id, job=request.job, model=request.state_id,
                                   restored=restored, lost_work_s=lost_s, cause=type(exc).__name__,
                                   torn=[request.state_id] if torn else [])
        self._restarting.add(device)
        if torn:
            return errors.StateLost(_torn_message(request.state_id, f"died while writing back {request.fn}'s result"))
        return errors.WorkerFailed(
            f"the worker of device {device} on node {self.node} died while running {request.fn} on "
            f"{request.state_id!r}; the call did not take effect (its state is back to its last completed call) "
            "and may be submitted again")

    def check_not_torn(self, request: Request) -> None:
        """A torn (or unreadable) state takes nothing but a restore (load_state)."""
        if request.fn == "load_state":
            return
        if request.state_id in self._torn:
            raise errors.StateLost(_torn_message(request.state_id, "died earlier"))
        state = self.sm.find(request.state_id)
        if state is not None and state.unreadable:
            raise errors.StateLost(f"model {request.state_id!r} could not be read back from its spill file; restore "
                                   "it from a checkpoint with load_state_with_optimizer(path) before using it")

    def restored(self, state_id: str) -> None:
        """A node function rewrote the state's host copy: it is whole again."""
        self._torn.discard(state_id)

    def restarting(self, device: int) -> bool:
        return device in self._restarting

    def await_restart(self, device: int) -> None:
        """Hold this device's dispatcher until the host has restarted its worker, so that no
        further request is sent to (and failed by) a worker that is not back yet."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                remote.get(self.workers[device].ping.remote(), timeout=RESTART_TIMEOUT_S)
                remote.get(self.workers[device].resize.remote(self.sm.arenas[device].capacity_bytes))  # born at the budget
                self.telemetry.events.emit(self.telemetry.now(), "worker_restarted", node=self.node, device=device)
                self._incarnations.pop(device, None)  # counted at the death: the new process's first reply is not news
                self._restarting.discard(device)
                return
            except Exception as exc:
                if not remote.is_gone(exc):
                    raise
                time.sleep(RESTART_POLL_S)  # the new process is still starting
        raise RuntimeError(f"the worker of device {device} on node {self.node} did not restart "
                           f"within {RESTART_TIMEOUT_S} s")


def _torn_message(state_id: str, what: str) -> str:
    return (f"model {state_id!r} is lost: its worker {what}, leaving its host copy half written; restore it "
            "from a checkpoint with load_state_with_optimizer(path) (load_state for weights only) before using it")

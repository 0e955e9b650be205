"""The simulator's event log: what a simulated run did, as the runtime's event log records it
(`arrival`, `dispatch`, `start`, `end`, `transition`, `step`), so that `plexrl trace` and the
dashboard read a simulated run and a real one alike (`plexrl sim W --trace DIR`).

A `SimService` given a recorder (`service.record`) reports each call it holds on a gang (from its
arrival, through the switch-in its dispatch made, to its end), each move of a switch, each elastic
rollout segment (a `sample` call on the replicas it held) and each step mark. A call on a gang of
several GPUs is one request whose `end` names them all (`devices`); its `device` is the first.
Recording reads the mechanism's values and changes none of them (tested: the same results with
and without a recorder).
"""

from __future__ import annotations

from itertools import count

from plexrl.sim.worker import KIND_NAME


class SimRecorder:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self._ids = count(1)

    def call(self, job: str, sid: str, fn: str, gang: tuple, arrival: float, dispatched: float, switch_s: float,
             end: float) -> None:
        rid = next(self._ids)
        device, node = gang[0].wid, gang[0].group.gid
        common = {"request_id": rid, "job": job, "model": sid, "fn": fn}
        started = dispatched + switch_s
        add = self.records.append
        add({"t": arrival, "event": "arrival", **common, "group": node})
        add({"t": dispatched, "event": "dispatch", **common, "device": device, "node": node, "switch": switch_s > 0})
        add({"t": started, "event": "start", **common, "device": device, "node": node})
        extra = {"devices": [w.wid for w in gang]} if len(gang) > 1 else {}
        add({"t": end, "event": "end", **common, "device": device, "node": node, "ok": True, "wall_s": end - started,
             "device_s": end - started, **extra})

    def moves(self, worker, job: str, start: float, moves: list) -> None:
        """The moves one GPU made for a switch, one after the other from `start`."""
        t = start
        for move in moves:
            self.records.append({"t": t, "event": "transition", "kind": KIND_NAME[move.kind], "state": move.state_id,
                                 "job": job, "device": worker.wid, "node": worker.group.gid, "bytes": move.nbytes,
                                 "seconds": move.seconds, "state_bytes": worker.states[move.state_id].nbytes})
            t += move.seconds

    def step(self, job: str, step: int, t: float) -> None:
        self.records.append({"t": t, "event": "step", "job": job, "step": step})

    def sorted_records(self) -> list[dict]:
        return sorted(self.records, key=lambda r: r["t"])

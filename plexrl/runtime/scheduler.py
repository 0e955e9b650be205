"""The group scheduler: one queue for the jobs placed on a worker group (docs/design.md §5).

Each model state has a FIFO of requests (calls of one model run in submission order); only its
head is *ready*. A free device's dispatcher asks `next_for(device)`; the policy picks among the
ready heads, the StateManager plans and claims the transitions, and the node runs the step
(step_runner.py). Requests for node functions (functions.Where.NODE: save/load state, weight
sync) run on the node's I/O threads as soon as they reach the head of their FIFO, through the
same step.

The scheduler and the node's StateManager share one lock (`lock`, a condition the node makes).

Slack: each job's step marks reach the scheduler (`step_mark`, through the node; the front also
marks the start of a job's first step, at its admission, and of its step on a group it moved to);
it tracks what the job's calls wait in each step against the job's slack (`policy.StepClock`) and
gives each ready head the deadline the `plexrl` policy's slack term ranks by.

Read replicas (`read_replicas`, StateManager's docstring): a call queued behind the head of a
weights-only state, when both change nothing (sample, compute_logprobs), moves to one of the
state's replicas that has none (`_feed`), so that it may run on another device meanwhile; the
state's other calls wait in its FIFO for the next free replica or their turn. Such calls are
pure functions of the weights and their payload (a sample carries its seed), so the order they
run in changes no result.

Batched sampling (call_batching.py `coalesce`): when a device takes a `sample` or
`compute_logprobs` head, the calls of those two kinds queued right behind it join its device call
(`Request.batch`; the node runs them as `sample_batch`, functions.py), up to the KV positions the
device's activation reserve holds (StateManager.decode_positions). Calls arriving
while it runs join the next one. A sample head's E_i is the decode model's estimate of that batch
(policy/decode.py, fitted to the state's batched calls: call_batching.py `decode_estimate`).

Invariants: at most one request per model state is in flight (a batch is one request: its
head, carrying the calls coalesced with it); every submitted request is
completed or failed exactly once, also when the cluster closes (its future gets ClusterClosed).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from plexrl.api import errors
from plexrl.api.futures import APIFuture
from plexrl.policy import GroupQueue, Head, LoadPlan, NoFit, Policy, StepClock, Tier, TransitionKind, choose, offload_estimate
from plexrl.runtime.call_batching import coalesce, decode_estimate
from plexrl.runtime.functions import FUNCTIONS, Function
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry
from plexrl.runtime.threads import ServicePool

_RETRY_S = 0.002  # re-check period while every candidate waits on a state in transit


@dataclass
class Request:
    """One call: data only (what runs it is `functions.FUNCTIONS[fn]`)."""

    id: int
    job: str
    state_id: str
    fn: str
    payload: Any  # the function's payload type (runtime/payloads.py)
    future: APIFuture
    arrival_s: float
    seq: int = 0
    batch: list[Request] | None = None  # a batched call (`sample_batch`): the calls coalesced behind it

    @property
    def function(self) -> Function:
        return FUNCTIONS[self.fn]

    @property
    def calls(self) -> list[Request]:
        """Every call its device call runs: itself, then the ones coalesced with it."""
        return [self, *(self.batch or ())]

    def positions(self) -> int | None:
        """The KV-cache positions it takes in a batched call (sample: every row's prompt +
        max_tokens); None when it is no call of BATCHED with a payload as a client builds it
        (then it runs alone, and fails there if its payload is bad)."""
        try:
            if self.fn == "sample":
                return self.payload.positions()
            return len(self.payload.tokens) if self.fn == "compute_logprobs" else None
        except (TypeError, AttributeError, ValueError):
            return None


class GroupScheduler:
    """The node group's queue (a pure `plexrl.policy.GroupQueue`) with the threads and the lock a
    runtime needs: dispatchers block in `next_for`, node functions run on an I/O pool."""

    def __init__(
        self,
        group: int,
        devices: list[int],
        state_manager: StateManager,
        policy: Policy,
        telemetry: Telemetry,
        lock: threading.Condition,
        run_on_node: Callable[[Request, LoadPlan], None],
        io_threads: int = 2,
        prefetch: bool = True,
        read_replicas: bool = True,
    ):
        """`run_on_node(request, plan)`: the node's step for a node function, called on an I/O
        thread with the state claimed; it must `complete` the request. `prefetch`: with each
        dispatch, also plan loading the state the policy would pick next for that device.
        `read_replicas`: run a weights-only state's calls on several devices at once."""
        self.group = group
        self.sm = state_manager
        self.policy = policy
        self.telemetry = telemetry
        self.lock = lock
        self._run_on_node = run_on_node
        self._queue: GroupQueue[Request] = GroupQueue()
        self._idle: set[int] = set()  # devices whose dispatcher waits in next_for (affinity, see policy.choose)
        self._held: set[int] = set()  # devices given nothing to run while the node resizes their arenas
        self._io = ServicePool(io_threads, f"plexrl-io-g{group}")
        self._slack: defaultdict[str, _JobSlack] = defaultdict(_JobSlack)  # job -> its calls and slack here
        self._closed = False
        self._prefetch = prefetch
        self._replicas = len(devices) - 1 if read_replicas else 0  # per state, at most

    def step_mark(self, job: str, slack: float, now: float) -> None:
        """`job`'s step boundary: its next step's calls may wait `slack` x its step time alone
        before they go first (the slack term of the `plexrl` policy, `StepClock`)."""
        with self.lock:
            self._slack[job].mark(slack, now)

    def forget_job(self, job: str) -> None:
        with self.lock:
            self._slack.pop(job, None)

    def pending(self, state_id: str) -> int:
        return self._queue.pending(state_id)

    # -- submission and completion -------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self.lock:
            if self._closed:
                request.future.set_exception(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
                return
            if self.sm.find(request.state_id) is None:
                request.future.set_exception(errors.UnknownModel(
                    f"model {request.state_id!r} no longer exists on this cluster (a retired sampler snapshot?)"))
                return
            self.telemetry.events.emit(
                request.arrival_s, "arrival", request_id=request.id, job=request.job,
                model=request.state_id, fn=request.fn, group=self.group,
            )
            self._new_head(self._queue.push(request.state_id, request))
            self._feed(request.state_id)
            self.lock.notify_all()

    def complete(self, request: Request, failure: BaseException | None = None) -> None:
        """The head `request` is done. After a retriable `failure` the calls of the same model
        queued behind it fail too (retriably): they were submitted expecting it to succeed."""
        with self.lock:
            assert self._queue.head(request.state_id) is request, "completed a request that was not its model's head"
            self._slack[request.job].move(request, self.telemetry.now(), None)
            following = self._queue.complete(request.state_id)
            while following is not None and failure is not None and failure.retriable:
                self._fail(following, _behind(failure, following), self._queue.fail)
                following = self._queue.head(request.state_id)
            self._new_head(following)
            primary = self.sm.replicas.primary_of(request.state_id)
            self._feed(primary)
            if following is None:
                self._drop_if_retired(primary)
            self.lock.notify_all()

    def retire(self, state_id: str, remove: Callable[[], None]) -> None:
        """Remove a state once nothing is queued for it (superseded sampler snapshots)."""
        with self.lock:
            self._queue.retire(state_id, remove)
            self._drop_if_retired(state_id)

    def released(self, state_ids) -> None:
        """The states `state_ids` are free again (`StateManager.release`, `let_go`, which wake the
        dispatchers): one retired while it was busy (a snapshot a sync superseded as it moved)
        goes now if nothing is queued for it."""
        with self.lock:
            for state_id in {self.sm.replicas.primary_of(s) for s in state_ids}:
                self._drop_if_retired(state_id)

    def _drop_if_retired(self, state_id: str) -> None:
        state = self.sm.find(state_id)
        if (state is not None and not state.busy and self._queue.drained(state_id)
                and not self.sm.replicas.in_use(state_id, self.pending)):
            self._queue.take_retired(state_id)()

    def _feed(self, state_id: str) -> None:
        """Under the lock: hand the calls right behind `state_id`'s head to its replicas, one
        each, while the head and the call behind it both change nothing (docstring)."""
        state = self.sm.find(state_id)
        if not self._replicas or state is None or not self.sm.replicas.replicable(state):
            return
        while _reads(self._queue.head(state_id)) and _reads(self._queue.next(state_id)):
            replica = self.sm.replicas.idle(state_id, self.pending, self._replicas)
            if replica is None:
                return
            request = self._queue.take_next(state_id)
            request.state_id = replica
            self._new_head(self._queue.push(replica, request))

    def _new_head(self, request: Request | None) -> None:
        """A request became its model's head: a node function starts on the I/O pool, a device
        function becomes a candidate for the policy."""
        if request is None or self._closed:
            return
        if not request.function.needs_device:
            self._queue.start(request.state_id)
            self._io.submit(self._serve_io, request)
            return
        state = self.sm.state(request.state_id)
        now, tracked = self.telemetry.now(), self._slack[request.job]
        tracked.move(request, now, Head.READY)
        self._queue.make_ready(
            request.state_id,
            arrival=request.arrival_s,
            est=self._estimate(request),
            load_s=self.telemetry.transfer_seconds("load", state.device_bytes),
            resident_on=state.device if state.tier is Tier.DEVICE else -1,
            seq=request.seq,
            nbytes=state.device_bytes,
            deadline=tracked.deadline(now),
        )

    def _estimate(self, head: Request) -> float:
        """E_i of a head: for a sample call on an HF state, the decode model's estimate of the batch
        `coalesce` would make of it and the calls queued behind it now (call_batching.py); else,
        and until the model is fitted, the running average of the function's measured times."""
        primary = self.sm.replicas.primary_of(head.state_id)
        fallback = self.telemetry.estimate(primary, head.fn)
        if head.fn != "sample" or self.sm.state(head.state_id).sampler != "hf" or head.positions() is None:
            return fallback
        estimate = decode_estimate(self.telemetry, primary, self._queue.queued(head.state_id),
                                   self.sm.decode_positions(head.state_id), self.sm.state(head.state_id))
        return fallback if estimate is None else estimate

    # -- dispatch ---------------------------------------------------------------------------------
    def next_for(self, device: int) -> tuple[Request, LoadPlan, LoadPlan | None] | None:
        """Block until `device` has something to run: (request, its plan, a prefetch plan or
        None); None once the cluster closes."""
        with self.lock:
            self._idle.add(device)
            try:
                while not self._closed:
                    picked = None if device in self._held else self._pick(device)
                    if picked is not None:
                        return picked
                    self.lock.wait(_RETRY_S if self._queue.parked() else None)
                return None
            finally:
                self._idle.discard(device)

    def hold(self, devices, held: bool = True) -> None:
        """Under the lock: give `devices` nothing more to run (`held`), or let them run again."""
        self._held = self._held | set(devices) if held else self._held - set(devices)
        if not held:
            self.lock.notify_all()

    def between_calls(self, device: int) -> bool:
        """Under the lock: whether `device`'s dispatcher waits for its next call (runs none)."""
        return device in self._idle

    def _pick(self, device: int) -> tuple[Request, LoadPlan, LoadPlan | None] | None:
        for _, head in self._queue.unpark(lambda sid: self.sm.state(sid).busy):
            self._new_head(head)
        ready = self._queue.ready
        while len(ready):
            free = self.sm.budgets.free_bytes(device)
            offload_s = offload_estimate(ready, free, self.telemetry.bytes_per_s("offload"))
            state_id = choose(self.policy, ready, device, offload_s, self.telemetry.now(), self._idle)
            if state_id is None:  # every ready request belongs to another idle device: wake it
                self.lock.notify_all()
                return None
            if self.sm.state(state_id).busy:
                self._queue.park(state_id)
                continue
            try:
                plan = self.sm.prepare(state_id, device, self._queue.head(state_id).job, self.pending)
            except Exception as exc:  # a restore that failed fails its request, never the dispatcher
                self._fail(self._queue.head(state_id), as_user_error(exc, self._queue.head(state_id)), self._fail_head)
                continue
            if isinstance(plan, NoFit):
                if self._hopeless():
                    self._fail(self._queue.head(state_id), errors.StateTooLarge(plan.reason), self._fail_head)
                else:
                    self._queue.park(state_id)
                continue
            request = self._queue.dispatch(state_id)
            self._slack[request.job].move(request, self.telemetry.now(), Head.RUNNING)
            coalesce(request, self._queue, self.sm.decode_positions)
            for t in plan.transitions:  # keep the candidates' residency right for the states this plan moves
                if t.state_id in ready:
                    ready.set_resident(t.state_id, -1)
            return request, plan, self._plan_prefetch(device, plan)
        return None

    def _plan_prefetch(self, device: int, running: LoadPlan) -> LoadPlan | None:
        """The load of what the policy would pick next for `device`, to run while `running` does
        (docs/design.md §4: prefetch), claimed; None when there is nothing to gain or nothing safe to do.
        Not while another device is idle: it would take that request now, and a prefetch claims
        the state until the running function ends."""
        ready = self._queue.ready
        if not self._prefetch or not len(ready) or self._idle - {device}:
            return None
        free = self.sm.budgets.free_bytes(device)
        offload_s = offload_estimate(ready, free, self.telemetry.bytes_per_s("offload"))
        state_id = choose(self.policy, ready, device, offload_s, self.telemetry.now(), self._idle)
        if state_id is None or self.sm.state(state_id).tier is not Tier.HOST:
            return None
        plan = self.sm.prepare_prefetch(state_id, device, running, self.pending)
        for t in plan.transitions if plan is not None else ():  # its victims are not resident any more
            if t.kind is not TransitionKind.LOAD and t.state_id in ready:
                ready.set_resident(t.state_id, -1)
        return plan

    def prefetched(self, state_id: str, device: int) -> None:
        """A prefetch put `state_id` on `device`: its waiting head is resident there now."""
        with self.lock:
            if state_id in self._queue.ready:
                self._queue.ready.set_resident(state_id, device)
            self.lock.notify_all()

    def _hopeless(self) -> bool:
        """Nothing in transit on the node: waiting cannot make room."""
        return not self.sm.states.any_busy()

    def _fail_head(self, state_id: str) -> None:
        self._new_head(self._queue.fail(state_id))
        self._feed(self.sm.replicas.primary_of(state_id))

    def _fail(self, request: Request, exc: BaseException, leave: Callable[[str], object]) -> None:
        """Fail a request that never ran: logged as an end, out of the queue (`leave`), future resolved."""
        self.telemetry.failed(request.job)
        self._slack[request.job].move(request, self.telemetry.now(), None)
        self.telemetry.events.emit(
            self.telemetry.now(), "end", request_id=request.id, job=request.job, model=request.state_id,
            fn=request.fn, device=None, ok=False, error=type(exc).__name__,
        )
        leave(request.state_id)
        request.future.set_exception(exc)

    # -- requests for node functions --------------------------------------------------------------
    def _serve_io(self, request: Request) -> None:
        """Wait until the state (and the host room a restore needs) is free, then run the node's step."""
        try:
            plan = self._plan_io(request)
        except Exception as exc:  # a restore that failed fails its request, never the I/O thread
            self.telemetry.failed(request.job)
            self.complete(request)
            request.future.set_exception(as_user_error(exc, request))
            return
        if isinstance(plan, LoadPlan):
            self._run_on_node(request, plan)
            return
        self.telemetry.failed(request.job)
        self.complete(request)
        if self._closed:
            request.future.set_exception(errors.ClusterClosed("the cluster closed before this call ran"))
        else:
            request.future.set_exception(errors.StateTooLarge(plan.reason if plan is not None else "no room"))

    def _plan_io(self, request: Request) -> LoadPlan | NoFit | None:
        with self.lock:
            while True:
                state = self.sm.state(request.state_id)
                held = state.busy or (request.function.mutates  # replicas load from its host copy
                                      and self.sm.replicas.in_use(request.state_id, self.pending))
                plan = None if held else self.sm.prepare(request.state_id, None, request.job, self.pending)
                others_busy = self.sm.states.any_busy()
                if self._closed or not (plan is None or (isinstance(plan, NoFit) and others_busy)):
                    return plan
                self.lock.wait(_RETRY_S)  # the state, or the host room it needs, is in use

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Fail every queued request (in-flight ones finish) and wake the dispatchers so they exit."""
        with self.lock:
            self._closed = True
            for _, request, in_flight in self._queue.items():
                if not in_flight:
                    request.future.set_exception(errors.ClusterClosed("the cluster closed before this call ran"))
            self.lock.notify_all()
        self._io.shutdown(wait=True)


def _reads(request: Request | None) -> bool:
    """A device call that changes nothing (a read replica may run it)."""
    return request is not None and request.function.needs_device and not request.function.mutates


class _JobSlack:
    """One job's device calls on this group and its `StepClock`. The time the job has calls
    ready and none running here is delay the scheduler injected into its step (calls that wait
    side by side count once, as one phase's wait does in the simulator); a step mark charges
    what is pending to the step that ended and starts the next."""

    __slots__ = ("clock", "ready", "running", "since")

    def __init__(self) -> None:
        self.clock = StepClock(0.0)  # its slack arrives with its first mark (admission, a move here, or a step)
        self.ready: set[int] = set()
        self.running: set[int] = set()
        self.since = 0.0  # when it last became blocked

    def _blocked(self) -> bool:
        return bool(self.ready) and not self.running

    def move(self, request: Request, now: float, to: Head | None) -> None:
        """`request` is now ready, running, or gone (None)."""
        was, key = self._blocked(), id(request)  # the object: ids from several fronts may repeat
        self.ready.discard(key)
        self.running.discard(key)
        if to is not None:
            (self.ready if to is Head.READY else self.running).add(key)
        if was and not self._blocked():
            self.clock.delayed(now - self.since)
        elif self._blocked() and not was:
            self.since = now

    def _count_wait(self, now: float) -> None:
        """Charge the wait under way to the step (a stretch blocked since `since`)."""
        if self._blocked():
            self.clock.delayed(now - self.since)
            self.since = now

    def deadline(self, now: float) -> float:
        """The deadline of a call ready at `now`: with the wait under way counted, so that the
        step's run so far (what stands for an unmeasured period) leaves it out."""
        self._count_wait(now)
        return self.clock.deadline(now)

    def mark(self, slack: float, now: float) -> None:
        self._count_wait(now)
        self.clock.slack = slack
        self.clock.begin(now)


def _behind(failure: BaseException, request: Request) -> BaseException:
    exc = type(failure)(f"{request.fn} on {request.state_id!r} was queued behind a call that failed ({failure}); "
                        "it did not run and may be submitted again after that call")
    exc.retriable = True
    return exc


def as_user_error(exc: BaseException, request: Request) -> BaseException:
    if isinstance(exc, errors.PlexRLError):
        return exc
    wrapped = errors.ExecutionError(f"{request.fn} on model {request.state_id!r} failed: {type(exc).__name__}: {exc}")
    wrapped.__cause__ = exc
    return wrapped

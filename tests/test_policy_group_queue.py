"""The group queue's invariants (plexrl/policy/group_queue.py): named cases and a property test
against a plain reference (a dict of lists)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy import GroupQueue, Head


def apply(q: GroupQueue, op: tuple):
    """One call on `q`; ("ready", sid) is `make_ready` with figures that do not matter here."""
    name, *args = op
    if name == "ready":
        return q.make_ready(args[0], arrival=0.0, est=1.0, load_s=0.0, resident_on=-1, seq=0)
    if name == "unpark":
        return q.unpark(lambda s: s in args[0])
    return getattr(q, name)(*args)


def observe(q: GroupQueue, returns: list) -> dict:
    return {"returns": returns, "ready": set(q.ready.keys()), "parked": q.parked(), "items": q.items(),
            "phase": {s: q.phase(s) for s in ("a", "b")}, "pending": {s: q.pending(s) for s in ("a", "b")},
            "drained": {s: q.drained(s) for s in ("a", "b")}}


CASES = {
    # name: (ops, the observations expected after them; only the keys given are compared)
    "push returns only a new head": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("push", "b", "b1")],
        {"returns": ["a1", None, "b1"], "phase": {"a": Head.PENDING, "b": Head.PENDING}, "pending": {"a": 2, "b": 1}}),
    "items keep submission order per state": (
        [("push", "a", "a1"), ("push", "b", "b1"), ("push", "a", "a2"), ("push", "a", "a3")],
        {"items": [("a", "a1", False), ("a", "a2", False), ("a", "a3", False), ("b", "b1", False)]}),
    "only heads are ready": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("ready", "a"), ("push", "b", "b1"), ("ready", "b")],
        {"ready": {"a", "b"}, "phase": {"a": Head.READY, "b": Head.READY}, "pending": {"a": 2, "b": 1}}),
    "dispatch takes the head out of ready": (
        [("push", "a", "a1"), ("ready", "a"), ("dispatch", "a")],
        {"returns": ["a1", None, "a1"], "ready": set(), "phase": {"a": Head.RUNNING, "b": None}}),
    "park sets a ready head aside": (
        [("push", "a", "a1"), ("ready", "a"), ("park", "a")],
        {"ready": set(), "parked": ["a"], "phase": {"a": Head.PARKED, "b": None}}),
    "unpark keeps a head whose state is busy": (
        [("push", "a", "a1"), ("ready", "a"), ("park", "a"), ("unpark", {"a"})],
        {"returns": ["a1", None, None, []], "parked": ["a"], "phase": {"a": Head.PARKED, "b": None}}),
    "unpark hands free heads back in parking order": (
        [("push", "b", "b1"), ("push", "a", "a1"), ("ready", "b"), ("ready", "a"), ("park", "b"), ("park", "a"),
         ("unpark", set())],
        {"returns": ["b1", "a1", None, None, None, None, [("b", "b1"), ("a", "a1")]], "parked": [],
         "phase": {"a": Head.PENDING, "b": Head.PENDING}}),
    "complete advances to the next head": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("ready", "a"), ("dispatch", "a"), ("complete", "a")],
        {"returns": ["a1", None, None, "a1", "a2"], "phase": {"a": Head.PENDING, "b": None}, "pending": {"a": 1, "b": 0}}),
    "complete of the last item empties the state": (
        [("push", "a", "a1"), ("start", "a"), ("complete", "a")],
        {"returns": ["a1", "a1", None], "phase": {"a": None, "b": None}, "items": []}),
    "a head that needs no device starts without being ready": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("start", "a")],
        {"ready": set(), "items": [("a", "a1", True), ("a", "a2", False)]}),
    "fail advances from ready": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("ready", "a"), ("fail", "a")],
        {"returns": ["a1", None, None, "a2"], "ready": set(), "phase": {"a": Head.PENDING, "b": None}}),
    "fail advances from parked": (
        [("push", "a", "a1"), ("ready", "a"), ("park", "a"), ("fail", "a")],
        {"returns": ["a1", None, None, None], "parked": [], "items": []}),
    "fail advances from running": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("start", "a"), ("fail", "a")],
        {"returns": ["a1", None, "a1", "a2"], "items": [("a", "a2", False)]}),
    "retire waits for the drain": (
        [("push", "a", "a1"), ("retire", "a"), ("start", "a")],
        {"drained": {"a": False, "b": False}}),
    "retire after the drain": (
        [("push", "a", "a1"), ("retire", "a"), ("start", "a"), ("complete", "a")],
        {"drained": {"a": True, "b": False}}),
    "retire of a state with nothing queued": (
        [("retire", "b", "token"), ("push", "a", "a1")],
        {"drained": {"a": False, "b": True}}),
    "take_retired returns the token and unmarks": (
        [("retire", "b", "token"), ("take_retired", "b")],
        {"returns": [None, "token"], "drained": {"a": False, "b": False}}),
    "take_next hands over the item behind a running head": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("push", "a", "a3"), ("ready", "a"), ("dispatch", "a"),
         ("next", "a"), ("take_next", "a"), ("push", "b", "a2")],
        {"returns": ["a1", None, None, None, "a1", "a2", "a2", "a2"], "pending": {"a": 2, "b": 1},
         "items": [("a", "a1", True), ("a", "a3", False), ("b", "a2", False)]}),
    "next of a lone head is None": (
        [("push", "a", "a1"), ("next", "a"), ("next", "b")],
        {"returns": ["a1", None, None]}),
    "close lists every item once, in-flight heads marked": (
        [("push", "a", "a1"), ("push", "a", "a2"), ("push", "b", "b1"), ("ready", "a"), ("dispatch", "a"),
         ("ready", "b"), ("push", "b", "b2")],
        {"items": [("a", "a1", True), ("a", "a2", False), ("b", "b1", False), ("b", "b2", False)]}),
}


@pytest.mark.parametrize("ops, expected", CASES.values(), ids=CASES.keys())
def test_cases(ops, expected):
    q = GroupQueue()
    returns = [apply(q, op) for op in ops]
    seen = observe(q, returns)
    assert {k: seen[k] for k in expected} == expected


MISUSE = {
    "dispatch of a pending head": [("push", "a", "a1"), ("dispatch", "a")],
    "complete of a ready head": [("push", "a", "a1"), ("ready", "a"), ("complete", "a")],
    "park of a running head": [("push", "a", "a1"), ("start", "a"), ("park", "a")],
    "make_ready twice": [("push", "a", "a1"), ("ready", "a"), ("ready", "a")],
    "start of an empty state": [("start", "a")],
}


def test_take_next_of_a_lone_head_names_the_state():
    q = GroupQueue()
    q.push("a", "a1")
    with pytest.raises(RuntimeError, match="'a' has no item behind its head"):
        q.take_next("a")


@pytest.mark.parametrize("ops", MISUSE.values(), ids=MISUSE.keys())
def test_misuse_names_the_phase(ops):
    q = GroupQueue()
    for op in ops[:-1]:
        apply(q, op)
    with pytest.raises(RuntimeError, match="the head of 'a' is"):
        apply(q, ops[-1])


class Reference:
    """The same rules written plainly: a dict of lists and each head's phase."""

    def __init__(self):
        self.fifos: dict[str, list[int]] = {}
        self.phase: dict[str, Head] = {}
        self.parked: list[str] = []
        self.left: list[tuple[str, int]] = []

    def heads(self, phase: Head) -> list[str]:
        return sorted(s for s, p in self.phase.items() if p is phase)

    def push(self, sid, item):
        self.fifos.setdefault(sid, []).append(item)
        if len(self.fifos[sid]) == 1:
            self.phase[sid] = Head.PENDING
            return item
        return None

    def leave(self, sid):
        self.left.append((sid, self.fifos[sid].pop(0)))
        if sid in self.parked:
            self.parked.remove(sid)
        if self.fifos[sid]:
            self.phase[sid] = Head.PENDING
            return self.fifos[sid][0]
        del self.fifos[sid], self.phase[sid]
        return None


STATES = ["s0", "s1", "s2"]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_matches_a_plain_reference(data):
    q, ref, pushed = GroupQueue(), Reference(), []
    device = {}  # item -> whether it needs a device

    def resolve(sid, head):  # what a caller does with a new head
        if head is None:
            return
        if device[head]:
            q.make_ready(sid, 0.0, 1.0, 0.0, -1, head)
            ref.phase[sid] = Head.READY
        else:
            assert q.start(sid) == head
            ref.phase[sid] = Head.RUNNING

    for n in range(data.draw(st.integers(1, 40))):
        ops = ["push"] + [op for op, phase in (("dispatch", Head.READY), ("park", Head.READY),
                                              ("complete", Head.RUNNING)) if ref.heads(phase)]
        ops += ["unpark"] * bool(ref.parked) + ["fail"] * bool(ref.fifos)
        ops += ["move"] * any(len(f) > 1 for f in ref.fifos.values())
        op = data.draw(st.sampled_from(ops))
        if op == "move":  # what the runtime does for a read replica: the item behind a head goes elsewhere
            sid = data.draw(st.sampled_from(sorted(s for s, f in ref.fifos.items() if len(f) > 1)))
            to = data.draw(st.sampled_from(STATES))
            assert q.next(sid) == ref.fifos[sid][1]
            item = q.take_next(sid)
            assert item == ref.fifos[sid].pop(1)
            pushed.remove((sid, item))
            pushed.append((to, item))
            head = q.push(to, item)
            assert head == ref.push(to, item)
            resolve(to, head)
        elif op == "push":
            sid, device[n] = data.draw(st.sampled_from(STATES)), data.draw(st.booleans())
            pushed.append((sid, n))
            head = q.push(sid, n)
            assert head == ref.push(sid, n)
            resolve(sid, head)
        elif op == "unpark":
            busy = data.draw(st.sets(st.sampled_from(STATES)))
            freed = q.unpark(lambda s: s in busy)
            expected = [s for s in ref.parked if s not in busy]
            assert [s for s, _ in freed] == expected
            ref.parked = [s for s in ref.parked if s in busy]
            for sid, head in freed:
                assert head == ref.fifos[sid][0]
                resolve(sid, head)
        else:
            candidates = sorted(ref.fifos) if op == "fail" else ref.heads(
                Head.RUNNING if op == "complete" else Head.READY)
            sid = data.draw(st.sampled_from(candidates))
            if op == "dispatch":
                assert q.dispatch(sid) == ref.fifos[sid][0]
                ref.phase[sid] = Head.RUNNING
            elif op == "park":
                q.park(sid)
                ref.phase[sid] = Head.PARKED
                ref.parked.append(sid)
            else:
                head = getattr(q, op)(sid)
                assert head == ref.leave(sid)
                resolve(sid, head)
        check(q, ref, pushed)


def check(q: GroupQueue, ref: Reference, pushed: list) -> None:
    for sid in STATES:
        assert q.head(sid) == (ref.fifos[sid][0] if sid in ref.fifos else None)
        assert q.pending(sid) == len(ref.fifos.get(sid, ()))
        assert q.phase(sid) == ref.phase.get(sid)
    assert sorted(q.ready.keys()) == ref.heads(Head.READY)
    assert q.parked() == ref.parked
    # every pushed item is queued once or has left once, and the items of one state leave in push order
    queued = [(s, i) for s, i, _ in q.items()]
    assert sorted(queued + ref.left) == sorted(pushed)
    for sid in STATES:
        assert [i for s, i in ref.left if s == sid] + [i for s, i in queued if s == sid] == \
            [i for s, i in pushed if s == sid]
    assert [(s, i) for s, i, in_flight in q.items() if in_flight] == \
        [(s, ref.fifos[s][0]) for s in ref.fifos if ref.phase[s] is Head.RUNNING]
    assert len(q) == len(queued)

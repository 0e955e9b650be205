"""The per-model ordering of `plexrl serve` (plexrl/serve/sequencer.py), with a fake clock."""

from __future__ import annotations

from plexrl.serve.sequencer import Sequencer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(gap_s: float = 30.0):
    clock, ran = Clock(), []
    seq = Sequencer(1, gap_s, clock)
    return seq, clock, ran, lambda n: (lambda: ran.append(n))


def test_calls_run_in_number_order_once_the_model_exists():
    seq, _, ran, call = make()
    for n in (3, 1, 2):
        seq.arrive(n, call(n))
    assert ran == []  # not placed yet
    assert "placed" in seq.waiting_for(3)
    seq.open()
    assert ran == [1, 2, 3]
    seq.arrive(5, call(5))
    assert ran == [1, 2, 3] and "seq_id=4" in seq.waiting_for(5)
    seq.arrive(4, call(4))
    assert ran == [1, 2, 3, 4, 5] and seq.waiting_for(5) is None


def test_unnumbered_and_late_calls_run_at_once_and_never_take_a_number():
    seq, _, ran, call = make()
    seq.open()
    seq.arrive(2, call(2))  # waits for 1
    seq.arrive(None, call("unnumbered"))
    assert ran == ["unnumbered"]
    seq.arrive(1, call(1))
    assert ran == ["unnumbered", 1, 2]
    seq.arrive(1, call("late 1"))  # a number already passed: at once, never re-ordered
    assert ran[-1] == "late 1"


def test_a_missing_number_is_skipped_only_after_gap_s_of_being_blocked():
    seq, clock, ran, call = make(gap_s=30)
    seq.open()
    clock.now = 1000.0  # long idle: the gap timer starts when a call is blocked, not at the last move
    seq.arrive(2, call(2))
    seq.drain()
    assert ran == []
    clock.now = 1029.0
    seq.drain()
    assert ran == []
    clock.now = 1031.0
    seq.drain()
    assert ran == [2]
    seq.arrive(3, call(3))
    assert ran == [2, 3]

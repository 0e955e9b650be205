"""The service's hot-path ledger charge equals the Ledger's own methods, bit for bit.

`occupy_gang` holds a call's gang and inlines `Ledger.charge_exec` per GPU and
`Ledger.record_wait` for speed; the
reference applies the Ledger's methods to a second ledger for the same calls, interleaved with
transitions, and every figure of the two summaries must be identical (not merely close).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy import Ledger
from plexrl.sim.service import occupy_gang
from plexrl.sim.worker import SimWorker

WORKERS = [SimWorker(wid=i, arena_bytes=10**6, host_bytes=10**9, link_bytes_per_s=1.0, disk_bytes_per_s=1.0)
           for i in range(4)]

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)
charge = st.tuples(
    st.sampled_from(["a", "b", "c"]),  # job
    st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4, unique=True).map(tuple),  # gang
    seconds,  # exec
    seconds,  # queue wait
    st.one_of(st.none(), seconds),  # a switch charged to the gang's first GPU before the call
)


def reference(ledger: Ledger, job: str, gang: tuple[SimWorker, ...], exec_s: float, wait_s: float) -> None:
    for w in gang:
        ledger.charge_exec(job, w.wid, exec_s)
    ledger.record_wait(job, wait_s)


@settings(max_examples=200, deadline=None)
@given(st.lists(charge, max_size=30))
def test_occupy_gang_equals_the_ledger_methods(calls):
    fast, slow = Ledger(), Ledger()
    for job, gang, exec_s, wait_s, switch_s in calls:
        for ledger in (fast, slow):
            if switch_s is not None:
                ledger.charge_transition(job, gang[0].wid, "load", 1, switch_s)
        occupy_gang(fast, job, gang, exec_s, wait_s, exec_s + 1.0)
        assert all(w.busy and w.expected_end == exec_s + 1.0 for w in gang)
        reference(slow, job, gang, exec_s, wait_s)
    assert fast.summary() == slow.summary()

"""Read replicas (runtime/state_manager.py, runtime/scheduler.py): a weights-only model's calls that
change nothing run on several devices at once, each on a read-only copy of its host copy.

Checked: the calls of one sampler snapshot spread over both devices and return exactly what one
device gives; a replica holds no host memory of its own; a weight sync that rewrites a snapshot in
place leaves no replica sampling the old weights; a snapshot retired while its replica runs goes,
replica and all, once that call ends; a job that finishes leaves no replica behind; node functions
that change the snapshot wait for its replicas. The local engine (its devices are threads of this
process) with `read_replicas=True`, so the test can reach the node; the process engine, where
replicas are on by default, for the results.
"""

from __future__ import annotations

import threading
import time

import pytest

import plexrl
from plexrl import errors
from tests.helpers import datum

TIMEOUT_S = 120
PROMPT = plexrl.ModelInput.from_ints([5, 6, 7])


def burst(sampler, n: int = 12, seed: int = 0) -> list:
    """`n` sample calls and `n` log-prob calls submitted at once; their results in order."""
    samples = [sampler.sample(PROMPT, 2, plexrl.SamplingParams(max_tokens=6, seed=seed + i, temperature=1.0))
               for i in range(n)]
    logprobs = [sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7, 8 + i])) for i in range(n)]
    return ([[s.tokens for s in f.result(TIMEOUT_S).sequences] for f in samples]
            + [f.result(TIMEOUT_S) for f in logprobs])


def starts(cluster, model_prefix: str) -> dict[str, set]:
    """model -> the devices its calls started on."""
    out: dict[str, set] = {}
    for e in cluster.events():
        if e["event"] == "start" and e.get("device") is not None and e["model"].startswith(model_prefix):
            out.setdefault(e["model"], set()).add(e["device"])
    return out


def test_a_snapshots_calls_spread_over_both_devices_with_the_results_of_one(tiny_model):
    results = {}
    for replicas in (False, True):
        with plexrl.LocalCluster(devices=2, read_replicas=replicas) as c:
            trainer = c.service_client("job").create_training_client(base_model=tiny_model, seed=0)
            sampler = trainer.save_weights_and_get_sampling_client()
            primary = sampler.state.state_id
            results[replicas] = burst(sampler)
            ran = starts(c, primary)
            node = c.nodes[0].target
            if not replicas:
                assert list(ran) == [primary]
                continue
            assert set(ran) == {primary, f"{primary}#1"}, ran  # one replica on two devices
            assert set().union(*ran.values()) == {0, 1}
            with node.lock:
                view = node.sm.view(node.scheduler.pending)
            assert view.states[f"{primary}#1"].host_bytes == 0  # its host copy is its primary's
            assert view.host_used() == sum(s.host_bytes for s in node.sm.states.values() if not s.replica_of)
            assert f"{primary}#1" not in node.state_ids()  # the node's own, not a model of the job
    assert results[True] == results[False]


def test_the_process_engine_replicates_by_default_and_gets_the_same_results(tiny_model):
    from plexrl import engines

    results = {}
    for replicas in (None, False):
        with engines.open_cluster("process", 2, read_replicas=replicas) as c:
            sampler = c.service_client("job").create_training_client(
                base_model=tiny_model, seed=0).save_weights_and_get_sampling_client()
            results[replicas] = burst(sampler, seed=7)
            assert (f"{sampler.state.state_id}#1" in starts(c, sampler.state.state_id)) is (replicas is None)
    assert results[None] == results[False]


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_replicas_on_cuda_page_lock_their_own_mapping_and_get_the_same_results(tiny_model):
    """Two logical devices on the GPUs this process sees (one GPU: both on it), the process engine:
    a worker that holds a snapshot and its replica maps and page-locks the same host file twice
    (`make gpu-check` runs this)."""
    from plexrl import engines

    results = {}
    for replicas in (True, False):
        with engines.open_cluster("process", 2, torch_device="cuda", read_replicas=replicas) as c:
            sampler = c.service_client("job").create_training_client(
                base_model=tiny_model, seed=0).save_weights_and_get_sampling_client()
            results[replicas] = [burst(sampler, seed=3) for _ in range(3)]
            assert (f"{sampler.state.state_id}#1" in starts(c, sampler.state.state_id)) is replicas
    assert results[True] == results[False]


def train_and_sample(cluster, tiny_model, steps: int = 3) -> list:
    """Each step: sync (in place when nothing uses the snapshot), a burst of samples, an update on them."""
    trainer = cluster.service_client("rl").create_training_client(base_model=tiny_model, seed=1)
    out, sampler = [], None
    for step in range(steps):
        snapshot = trainer.save_weights_for_sampler().result(TIMEOUT_S)
        sampler = sampler or plexrl.SamplingClient(cluster, snapshot, seed=0)
        got = burst(sampler, n=6, seed=10 * step)
        out.append(got)
        data = [datum([5, 6, 7] + tokens, weights=[1.0] * (len(tokens) + 2)) for pair in got[:6] for tokens in pair]
        trainer.forward_backward(data, loss_fn="cross_entropy").result(TIMEOUT_S)
        trainer.optim_step(plexrl.AdamParams(learning_rate=5e-2)).result(TIMEOUT_S)
    return out


def test_a_snapshot_rewritten_in_place_leaves_no_replica_on_the_old_weights(tiny_model):
    runs = {}
    for replicas in (False, True):
        with plexrl.LocalCluster(devices=2, read_replicas=replicas) as c:
            runs[replicas] = train_and_sample(c, tiny_model)
            snapshots = [sid for sid in c.nodes[0].target.state_ids() if "@" in sid]
            assert len(snapshots) == 1  # every sync rewrote the one snapshot in place
    assert runs[True][0] != runs[True][-1]  # the weights moved between steps
    assert runs[True] == runs[False]


def test_a_snapshot_retired_while_its_replica_runs_goes_with_it_once_that_call_ends(tiny_model):
    with plexrl.LocalCluster(devices=2, read_replicas=True, prefetch=False) as c:
        trainer = c.service_client("job").create_training_client(base_model=tiny_model, seed=0)
        sampler = trainer.save_weights_and_get_sampling_client()
        old = sampler.state.state_id
        node = c.nodes[0].target
        release, in_use, go = node.sm.release, threading.Event(), threading.Event()

        def held_release(plan, now):  # the replica's call ran: keep it claimed until the test says
            if plan.state_id == f"{old}#1":
                in_use.set()
                assert go.wait(60)
            release(plan, now)

        node.sm.release = held_release
        calls = [sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7, 8 + i])) for i in range(2)]
        assert in_use.wait(60)
        calls[0].result(TIMEOUT_S)  # the primary's own call is done; its replica's is held
        new = trainer.save_weights_for_sampler().result(TIMEOUT_S)
        assert new.state_id != old  # its replica is in use: a new version, the old one retired
        assert old in node.sm.states and f"{old}#1" in node.sm.states
        go.set()
        calls[1].result(TIMEOUT_S)
        deadline = time.monotonic() + 30
        while (old in node.sm.states or f"{old}#1" in node.sm.states) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert old not in node.sm.states and f"{old}#1" not in node.sm.states


def test_a_finished_job_leaves_no_replica_behind(tiny_model):
    with plexrl.LocalCluster(devices=2, read_replicas=True) as c:
        for job in ("a", "b"):
            sampler = c.service_client(job).create_training_client(
                base_model=tiny_model, seed=0).save_weights_and_get_sampling_client()
            burst(sampler, n=4)
        node = c.nodes[0].target
        assert any(s.replica_of and s.job == "a" for s in node.sm.states.values())
        c.finish_job("a")
        assert not any(s.job == "a" for s in node.sm.states.values())
        assert any(s.replica_of and s.job == "b" for s in node.sm.states.values())


def load_between_bursts(cluster, tiny_model, hold_replica: bool) -> tuple[list, list]:
    """A burst, a load_state of later weights into the snapshot, a burst: submitted at once.
    `hold_replica`: the snapshot's replica is claimed meanwhile (as a load elsewhere would), so its
    call waits, parked, while the snapshot's own calls run and the load's turn comes."""
    trainer = cluster.service_client("job").create_training_client(base_model=tiny_model, seed=0)
    sampler = trainer.save_weights_and_get_sampling_client()
    trainer.forward_backward([datum([5, 6, 7, 8, 9])], loss_fn="cross_entropy").result(TIMEOUT_S)
    trainer.optim_step(plexrl.AdamParams(learning_rate=5e-2)).result(TIMEOUT_S)
    path = trainer.save_state("later").result(TIMEOUT_S).path
    burst(sampler, n=2)  # makes the replica
    node = cluster.nodes[0].target
    replica = node.sm.states.get(f"{sampler.state.state_id}#1")
    assert (replica is not None) is hold_replica
    if hold_replica:
        with node.lock:
            replica.busy = True
    before = [sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7, 8 + i])) for i in range(8)]
    loading = cluster.submit(sampler.state, "load_state", {"path": path, "with_optimizer": False})
    after = [sampler.compute_logprobs(plexrl.ModelInput.from_ints([5, 6, 7, 8 + i])) for i in range(8)]
    if hold_replica:
        time.sleep(0.5)  # the snapshot's own calls run meanwhile
        assert not loading.done(), "the load ran while a replica's call of before it waited"
        with node.lock:
            replica.busy = False
            node.lock.notify_all()
    loading.result(TIMEOUT_S)
    return [f.result(TIMEOUT_S) for f in before], [f.result(TIMEOUT_S) for f in after]


def test_a_load_state_into_a_snapshot_waits_for_its_replicas_and_they_see_what_it_wrote(tiny_model):
    """The calls before the load read the old weights, the calls after it the new ones, on
    whichever replica they run: the load waits for the replicas and drops their device copies."""
    runs = {}
    for replicas in (False, True):
        with plexrl.LocalCluster(devices=2, read_replicas=replicas) as c:
            runs[replicas] = load_between_bursts(c, tiny_model, hold_replica=replicas)
    before, after = runs[True]
    assert before != after
    assert runs[True] == runs[False]


def test_read_replicas_must_be_a_bool_or_none():
    with pytest.raises(errors.ConfigError, match="read_replicas"):
        plexrl.LocalCluster(devices=2, read_replicas="yes")

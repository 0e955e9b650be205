"""Placement on the local cluster (issue 4): the Placer decides where each job's states live,
with what phase shift; jobs wait for room; profiles are measured online; migrations move states."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

import plexrl
from plexrl import errors
from plexrl.policy import JobProfile, ModelMemory
from tests.helpers import datum, reserve_bytes, weights
from tests.helpers import rl_job

MiB = 1 << 20


def state_bytes(model_dir: str, trainable: bool = True) -> int:
    from plexrl.runtime.state import load_module

    numel = sum(p.numel() for p in load_module(model_dir).parameters())
    return numel * 4 * (4 if trainable else 1)


def square_wave(job: str, nbytes: int) -> JobProfile:
    return JobProfile(job, period_s=0.2, demand=(1, 1, 0, 0), devices=1, models=(ModelMemory("policy", nbytes, nbytes),))


def test_complementary_jobs_share_a_group_with_disjoint_busy_slots(tiny_model):
    nbytes = state_bytes(tiny_model)
    with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=4 * nbytes, host_memory_bytes=8 * nbytes,
                             slot_s=0.05) as c:
        a = c.service_client("a", profile=square_wave("a", nbytes))
        t0 = time.perf_counter()
        b = c.service_client("b", profile=square_wave("b", nbytes))
        waited = time.perf_counter() - t0
        placement = c.metrics()["placement"]
        assert placement["a"]["group"] == placement["b"]["group"], "packed onto one group"
        assert placement["b"]["score"] == 0 and c.control.target.placer.placer.overload_s() < 1e-9, "busy slots disjoint"
        assert placement["a"]["phase_shift_s"] < 0.05 <= placement["b"]["phase_shift_s"]
        assert waited >= placement["b"]["phase_shift_s"] - 0.01, "the job starts after its phase shift"
        trainer = b.create_training_client(base_model=tiny_model)
        trainer.forward_backward([datum([5, 6, 7])]).result()
        node = placement["b"]["group"]
        loads = [e for e in c.events() if e["event"] == "transition" and e["state"] == trainer.model_id]
        assert loads and all(e["node"] == node for e in loads)
        a.close()
        b.close()


def test_a_job_that_does_not_fit_waits_until_another_finishes(tiny_model, monkeypatch, caplog):
    from plexrl.runtime import job_placer

    monkeypatch.setattr(job_placer, "WAIT_LOG_S", 0.1)  # a wait says what it waits for, every WAIT_LOG_S
    caplog.set_level("INFO", logger="plexrl.runtime")
    nbytes = state_bytes(tiny_model)
    with plexrl.LocalCluster(nodes=1, devices_per_node=2, device_memory_bytes=2 * nbytes + reserve_bytes(tiny_model),
                             host_memory_bytes=nbytes + nbytes // 2) as c:
        first = c.service_client("first")
        first.create_training_client(base_model=tiny_model)
        with pytest.raises(errors.AdmissionTimeout, match="'impatient' waited 0.2 s.*host"):
            c.service_client("impatient", admission_timeout=0.2).create_training_client(base_model=tiny_model)
        admitted = {}

        def second_job():
            trainer = c.service_client("second").create_training_client(base_model=tiny_model)
            admitted["loss"] = trainer.forward_backward([datum([5, 6, 7])]).result().metrics["loss:sum"]

        waiter = threading.Thread(target=second_job)
        waiter.start()
        deadline = time.monotonic() + 60  # the waiter reaches admission when its thread gets to run
        while "second" not in c.metrics()["admission"] and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        reason = c.metrics()["admission"]["second"]["waiting_reason"]
        assert "loss" not in admitted and reason
        said = [r.getMessage() for r in caplog.records if "'second' has waited" in r.getMessage()]
        assert said and reason in said[-1], said
        first.close()
        waiter.join(timeout=60)
        assert admitted["loss"] > 0
        assert c.metrics()["placement"]["second"]["queueing_delay_s"] >= 0.25


def test_a_job_too_big_for_any_group_fails_at_once(tiny_model):
    nbytes = state_bytes(tiny_model)
    with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=8 * nbytes, host_memory_bytes=2 * nbytes) as c:
        huge = JobProfile("huge", 1.0, (1.0,), 1, (ModelMemory("policy", nbytes, 3 * nbytes),))
        with pytest.raises(errors.StateTooLarge, match="no node group has that"):
            c.service_client("huge", profile=huge)


def test_profiles_are_measured_online_and_replace_the_guess(tiny_model):
    with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB,
                             profile_steps=2) as c:
        rl_job(c, "job", tiny_model, seed=1, steps=3)
        placed = c.metrics()["placement"]["job"]
    assert placed["provisional"] is False and placed["replacements"] >= 1


def test_a_job_that_declares_its_steps_is_placed_as_one_that_ends(tiny_model):
    """`service_client(steps=N)`: the job's measured profile says it ends (`JobProfile.ends`), so
    the pack limit may judge it; a job that does not say (a service session) is open-ended. A
    bad `steps` is refused naming it, and nothing is placed for it."""
    with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB,
                             profile_steps=2) as c:
        for bad in (0, 2.5, "3", True):
            with pytest.raises(errors.InvalidInput, match=r"steps=.*expected the job's number of steps"):
                c.service_client("bad", steps=bad)
        rl_job(c, "finite", tiny_model, seed=1, steps=3, declare_steps=True)
        rl_job(c, "open", tiny_model, seed=2, steps=3)
        placer = c.control.target.placer.placer
        assert placer.profile_of("finite").ends is True and placer.profile_of("open").ends is False
        assert "bad" not in c.metrics()["placement"]


def test_a_profile_reads_only_its_jobs_recent_window(tiny_model):
    """What the runtime sends the placer for a profile (`events(job, since)`: the job's records
    from the step mark `profile_steps` back) measures the same profile as the whole log."""
    from plexrl.policy import profile_from_events

    with plexrl.LocalCluster(nodes=1, devices_per_node=2, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB,
                             profile_steps=2) as c:
        rl_job(c, "job", tiny_model, seed=1, steps=5)
        rl_job(c, "other", tiny_model, seed=2, steps=1)
        whole = c.events("job")
        marks = sorted(e["t"] for e in whole if e["event"] == "step")
        since = marks[-3] - 1e-6
        recent = c.events("job", since)
        everything = c.events()
    assert {e.get("job") for e in whole} == {"job"} and len(recent) < len(whole) < len(everything)
    models = (ModelMemory("policy", MiB, MiB),)
    assert (profile_from_events(recent, "job", 0.01, models, last_steps=2)
            == profile_from_events(whole, "job", 0.01, models, last_steps=2))


def test_events_kept_bounds_every_log_and_profiles_still_run(tiny_model):
    with plexrl.LocalCluster(nodes=1, devices_per_node=2, device_memory_bytes=64 * MiB, host_memory_bytes=256 * MiB,
                             profile_steps=2, events_kept=120) as c:
        rl_job(c, "job", tiny_model, seed=1, steps=8)  # ~33 records a step
        kept = c.events()
        placed = c.metrics()["placement"]["job"]
    assert 0 < len(kept) <= 2 * 120  # the node's log and the control plane's, each at most 120
    assert placed["provisional"] is False and placed["replacements"] >= 1


def test_migration_moves_states_and_changes_no_result(tiny_model):
    def run(migrate: bool):
        with plexrl.LocalCluster(nodes=2, devices_per_node=1, device_memory_bytes=64 * MiB,
                                 host_memory_bytes=256 * MiB, profile_steps=1000) as c:
            trainer = c.service_client("job").create_training_client(base_model=tiny_model, seed=0)
            for step in range(4):
                if migrate and step == 2:
                    source = c.metrics()["placement"]["job"]["group"]
                    c.migrate("job", 1 - source)
                trainer.forward_backward([datum([5, 6, 7, 8, 9])]).result()
                trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result()
            events = c.events()
            return weights(c, trainer), c.metrics(), events

    still, _, _ = run(False)
    moved, metrics, events = run(True)
    assert torch.equal(still, moved), "a migration must not change the job's results"
    assert metrics["migrations"] == 1
    moves = [e for e in events if e["event"] in ("state_added", "state_removed", "migration")
             and (e.get("state") == "job/policy" or e["event"] == "migration")]
    assert [e["event"] for e in moves] == ["state_added", "state_removed", "migration", "state_added"], moves
    assert moves[0]["node"] == moves[1]["node"] == moves[2]["source"] != moves[3]["node"] == moves[2]["target"]


def test_the_placer_is_told_each_jobs_measured_inflation(tiny_model):
    """The closed loop (issue #11): after MEASURED_STEPS steps where it was placed, a job's step
    inflation against its profile's period reaches the placer (Placer.observe) and the metrics."""
    from plexrl.policy import MEASURED_STEPS

    nbytes = state_bytes(tiny_model)
    with plexrl.LocalCluster(nodes=1, devices_per_node=1, device_memory_bytes=4 * nbytes + reserve_bytes(tiny_model),
                             host_memory_bytes=8 * nbytes, slot_s=0.05, profile_steps=100) as c:
        service = c.service_client("slow", profile=square_wave("slow", nbytes))  # a period of 0.2 s
        trainer = service.create_training_client(base_model=tiny_model)
        placer = c.control.target.placer.placer
        for step in range(MEASURED_STEPS + 1):
            trainer.forward_backward([datum([5, 6, 7])]).result()
            time.sleep(0.3)  # each step takes >= 0.3 s: >= 50% longer than its profile says
            c.report_step("slow", step)
            if step < MEASURED_STEPS - 1:
                assert "slow" not in placer.tenancy.measured, f"measured after {step + 1} steps, before {MEASURED_STEPS}"
        measured = c.metrics()["placement"]["slow"]["measured_inflation"]
        assert measured is not None and measured >= 0.5, f"measured inflation {measured}; each step took >= 1.5 periods"
        assert placer.tenancy.measured["slow"] == measured


def test_the_pack_limit_reaches_the_placer():
    """`ClusterConfig.pack_limit` (an option, off by default: None, each job by its own slack and
    packing by effect where runs are known; a value applies to jobs that declared their steps,
    `JobProfile.ends`)."""
    with plexrl.LocalCluster(devices=1) as c:
        assert c.control.target.placer.placer.pack_limit is None and c.control.target.placer.placer.by_effect
    with plexrl.LocalCluster(devices=1, pack_limit=0.25) as c:
        assert c.control.target.placer.placer.pack_limit == 0.25
    with plexrl.LocalCluster(devices=1, pack_limit=None) as c:
        assert c.control.target.placer.placer.pack_limit is None


def test_the_placement_setting_reaches_the_placer():
    """`ClusterConfig.placement`: phase-shift (default: spread while there is room), pack-first
    (`Placer(pack_first=True)`) or first-fit; anything else is refused naming the choices."""
    from plexrl.policy.placement import FirstFit, Placer

    for placement, pack_first, cls in (("phase-shift", False, Placer), ("pack-first", True, Placer),
                                       ("first-fit", False, FirstFit)):
        with plexrl.LocalCluster(devices=1, placement=placement) as c:
            placer = c.control.target.placer.placer
            assert type(placer) is cls and placer.pack_first is pack_first
    with pytest.raises(errors.ConfigError, match="pack-first"):
        plexrl.LocalCluster(devices=1, placement="pack")


def test_a_refused_replacement_says_why():
    """A job admitted on its provisional guess whose measured profile the placer will not re-place
    (its one device is busy with another job's guess all the time) stays where it is, and the placement
    metrics say why (`replacement_refused`, as `plexrl demo` reports it per job)."""
    from plexrl.policy import ResourceView
    from plexrl.runtime.job_placer import JobPlacer, provisional_profile

    models = [ModelMemory("policy", MiB, MiB)]
    placer = JobPlacer(ResourceView.uniform(1, 1, 1, 1, 64 * MiB, 256 * MiB), horizon_slots=64, slot_s=0.1,
                       placement="phase-shift", profile_steps=2)
    clock = lambda: 0.0  # noqa: E731
    for job in ("busy", "guess"):  # both on a guess: admitted without a slack check, on the one device
        placer.admit(provisional_profile(job, models, 0.1), 0.1, True, clock, 5.0)
    events = [{"t": float(t), "event": "step", "job": "guess"} for t in range(3)]
    events += [{"t": 0.0, "event": "start", "job": "guess", "request_id": 1, "device": 0},
               {"t": 2.0, "event": "end", "job": "guess", "request_id": 1, "device": 0}]  # busy all the time
    assert placer.summary(2.0)["guess"]["replacement_refused"] is None
    for step in (1, 2):
        assert placer.on_step("guess", lambda: events, models, now=float(step)) is None
    placed = placer.summary(2.0)["guess"]
    assert placed["provisional"] and placed["replacements"] == 1
    assert "slack" in placed["replacement_refused"], placed["replacement_refused"]
    # it stays, and the placer holds what was measured of it there, not the guess
    measured = placer.placer.profile_of("guess")
    assert measured.slack == 0.1 and measured.period_s == pytest.approx(1.0) and measured.devices == 1
    assert not placer.jobs["guess"].guessed
    # no prediction to judge while its co-tenant is still a guess
    assert placed["inflation_predicted"] is None


def test_a_job_moves_at_its_step_boundary_to_let_a_waiting_job_start():
    """Defragmenting in the runtime: two node groups of two devices, one device of each held by a
    job busy all the time; a two-device job waits. At `a`'s step boundary the placer moves `a`
    onto the free device of the other group (its new placement comes back: the cluster migrates
    it) and the waiting job's `admit` returns with `a`'s old group."""
    from plexrl.policy import ResourceView
    from plexrl.runtime.job_placer import JobPlacer

    models = [ModelMemory("policy", MiB, MiB)]
    placer = JobPlacer(ResourceView.uniform(1, 2, 1, 2, 64 * MiB, 256 * MiB), horizon_slots=64, slot_s=0.1,
                       placement="phase-shift", profile_steps=1000)
    clock = lambda: 1.0  # noqa: E731

    def busy(job: str, devices: int = 1) -> JobProfile:
        return JobProfile(job, period_s=0.8, demand=(devices,) * 8, devices=devices, models=tuple(models))

    for job in ("a", "b", "c", "d"):
        placer.admit(busy(job), 0.1, False, clock, 1.0)
    placer.finish("b", 1.0)
    placer.finish("c", 1.0)
    admitted: list = []
    waiter = threading.Thread(target=lambda: admitted.append(placer.admit(busy("wide", 2), 0.1, False, clock, 10.0)))
    waiter.start()
    for _ in range(500):  # bounded: until `wide` is in the queue
        if placer.queue.waiting:
            break
        time.sleep(0.01)
    assert [w.profile.job for w in placer.queue.waiting] == ["wide"]
    old = placer.jobs["a"].placement
    moved = placer.on_step("a", lambda: [], models, now=2.0)
    waiter.join(10.0)
    assert moved is not None and moved.group != old.group
    assert admitted and admitted[0].group == old.group and set(old.devices) < set(admitted[0].devices)
    summary = placer.summary(2.0)
    assert summary["a"]["migrations"] == 1 and summary["a"]["group_name"] == moved.group
    assert summary["wide"]["group_name"] == old.group


def test_a_job_that_shares_spreads_out_at_its_step_boundary_when_nobody_waits():
    """Spreading out in the runtime: four jobs busy all the time fill two node groups of two
    devices, and a light tenant shares a device with one of them. Once a job of the other group
    leaves (nobody waits), the tenant's step boundary moves it onto the device that job left
    (its new placement comes back: the cluster migrates it); then the job it shared with is
    alone, and stays."""
    from plexrl.policy import ResourceView
    from plexrl.runtime.job_placer import JobPlacer

    models = [ModelMemory("policy", MiB, MiB)]
    placer = JobPlacer(ResourceView.uniform(1, 2, 1, 2, 64 * MiB, 256 * MiB), horizon_slots=64, slot_s=0.1,
                       placement="phase-shift", profile_steps=1000)
    clock = lambda: 1.0  # noqa: E731
    for job in ("a", "b", "c", "d"):
        placer.admit(JobProfile(job, period_s=0.8, demand=(1,) * 8, devices=1, models=tuple(models)),
                     0.1, False, clock, 1.0)
    light = JobProfile("light", period_s=0.8, demand=(0.05,) * 8, devices=1, models=tuple(models), slack=math.inf)
    shared = placer.admit(light, 0.1, False, clock, 1.0)
    owner = next(job for job in "abcd" if placer.jobs[job].placement.devices == shared.devices)
    assert placer.on_step("light", lambda: [], models, now=2.0) is None  # no device unused: it stays
    gone = next(job for job in "abcd" if placer.jobs[job].placement.group != shared.group)
    placer.finish(gone, 2.5)
    assert not placer.queue.waiting
    moved = placer.on_step("light", lambda: [], models, now=3.0)
    assert moved is not None and moved.group != shared.group
    assert moved.devices == placer.placer.placements()["light"].devices
    assert not set(moved.devices) & {d for job, p in placer.placer.placements().items() if job != "light" for d in p.devices}
    assert placer.summary(3.0)["light"]["migrations"] == 1
    assert placer.on_step(owner, lambda: [], models, now=3.0) is None  # alone on its device now


def test_a_moved_job_migrates_and_the_waiting_job_starts_on_the_cluster(tiny_model):
    """The same through a cluster: two nodes of two devices (a node group each), `a`..`d` busy
    all the time on one device each; `b` and `c` leave, and `wide` (two devices) waits. `a`'s step
    mark moves it: its trainer migrates to the other node and goes on training there, and `wide`
    is admitted on the node `a` left."""
    nbytes = state_bytes(tiny_model)

    def busy(job: str, devices: int = 1) -> JobProfile:
        return JobProfile(job, period_s=0.2, demand=(devices,) * 4, devices=devices,
                          models=(ModelMemory("policy", nbytes, nbytes),))

    with plexrl.LocalCluster(nodes=2, devices_per_node=2, device_memory_bytes=4 * nbytes + reserve_bytes(tiny_model),
                             host_memory_bytes=8 * nbytes, slot_s=0.05, profile_steps=1000) as c:
        clients = {job: c.service_client(job, profile=busy(job)) for job in "abcd"}
        placement = c.metrics()["placement"]
        assert placement["a"]["group"] == placement["b"]["group"] != placement["c"]["group"] == placement["d"]["group"]
        trainer = clients["a"].create_training_client(base_model=tiny_model, seed=0)
        trainer.forward_backward([datum([5, 6, 7])]).result()
        clients["b"].close()
        clients["c"].close()
        admitted = {}
        waiter = threading.Thread(target=lambda: admitted.update(wide=c.service_client("wide", profile=busy("wide", 2))))
        waiter.start()
        deadline = time.monotonic() + 60  # bounded: until `wide` waits in the queue
        while "wide" not in c.metrics()["admission"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "wide" not in admitted and c.metrics()["admission"]["wide"]["waiting_reason"]
        left = placement["a"]["group"]
        c.report_step("a", 0)
        waiter.join(timeout=60)
        placement = c.metrics()["placement"]
        assert "wide" in admitted and placement["wide"]["group"] == left != placement["a"]["group"]
        assert placement["a"]["migrations"] == 1 and c.metrics()["migrations"] == 1
        # its next step counts its waits against its slack on the new group from the move on
        assert c.nodes[placement["a"]["group"]].target.scheduler._slack["a"].clock.started_s is not None
        loss = trainer.forward_backward([datum([5, 6, 7])]).result().metrics["loss:sum"]
        assert loss > 0
        loads = [e for e in c.events() if e["event"] == "transition" and e["state"] == trainer.model_id]
        assert loads[-1]["node"] == placement["a"]["group"]
        for job in ("a", "d"):
            clients[job].close()
        admitted["wide"].close()

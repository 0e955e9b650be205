"""Device processes killed at random points of a multi-job run (issue 13, "Faults").

Three deterministic RL-like jobs share a 2-device process engine whose budget holds one trainer
and one snapshot per device (they keep switching); a seeded killer SIGKILLs a random device's
process 4 times — mid-call, in a switch, between calls — one fault at a time. Each job retries a
failed step as a unit from the checkpoint it saved at the step's start (plexrl/bench/faults.py,
which `plexrl bench faults` runs too). Asserted:
- every job finishes, every future bounded (a hang fails the run instead of blocking it);
- every job's final weights are bitwise those of the same jobs run without kills;
- every kill of a live process was followed by a restart of that process, and the runtime
  counted a restart for every kill a job felt;
- a write-back torn by a death (StateLost) is redone from the step's checkpoint, bitwise too.
"""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.bench import faults

STEPS = 40
KILLS = 4


@pytest.fixture(scope="module")
def reference(micro_model, tmp_path_factory):
    weights, _ = faults.clean_run(micro_model, STEPS, str(tmp_path_factory.mktemp("clean")), engine="local")
    return weights


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_device_processes_leave_every_job_bitwise_unchanged(micro_model, reference, tmp_path):
    run = faults.faulty_run(micro_model, STEPS, KILLS, seed=0, workdir=str(tmp_path))
    weights, kills, log, metrics = run.weights, run.kills, run.log, run.metrics
    assert len(kills) == KILLS, f"the jobs ended before the killer was done ({len(kills)} kills): lengthen them"
    for job in reference:
        np.testing.assert_array_equal(weights[job], reference[job],
                                      err_msg=f"{job} ended with other weights than without kills; kills {kills}")
    recoveries = faults.recovery_seconds(kills, log.snapshot())
    felt = sum(s is not None for s in recoveries)
    assert felt >= 1, f"no kill interrupted a job: the test tests nothing ({kills})"
    assert run.process_restarts == sum(k.live for k in kills), "every killed process was started again"
    assert metrics["recovery"]["worker_restarts"] >= felt, "the runtime counted every restart a job felt"
    print(f"kills {[(k.device, k.moment) for k in kills]}, recovery s {recoveries}, restarts {metrics['recovery']}")


def test_a_torn_write_back_is_redone_from_the_step_checkpoint(micro_model, reference, tmp_path):
    """Device 0's process dies halfway through its first write-back (the failpoint the runtime
    offers tests): that model is StateLost, its job loads the checkpoint of the step and redoes
    it; the other jobs' calls fail retriably. Every job still ends bitwise as without the fault."""
    from plexrl.engines.process import ProcessCluster
    from plexrl.runtime import remote

    log = faults.FaultLog()
    with ProcessCluster(**faults.cluster_settings(micro_model), workdir=str(tmp_path)) as cluster:
        weights = faults.run_jobs(cluster, micro_model, STEPS, log,
                                  on_ready=lambda: remote.get(cluster.workers[0].fail_at.remote("writeback")))
        torn = [e["torn"] for e in cluster.events() if e["event"] == "worker_failed"]
    assert torn and torn[0], f"no write-back was torn: the test tests nothing ({torn})"
    assert any(error == "StateLost" for *_, error in log.snapshot())
    for job in reference:
        np.testing.assert_array_equal(weights[job], reference[job], err_msg=f"{job} differs after a torn write-back")


def test_a_device_process_killed_while_a_model_is_added(micro_model, tmp_path):
    """The device's process dies while the node waits for it to prepare a new model (SIGSTOP
    first, so the prepare is certainly in flight). Expected: the create succeeds or fails with the
    retriable WorkerFailed, and creating the model again works. (Found by the killer above when it
    started before the jobs' models existed: a raw internal WorkerGone escaped.)"""
    import os
    import signal
    import threading

    from plexrl import errors
    from plexrl.engines.process import ProcessCluster

    with ProcessCluster(**faults.cluster_settings(micro_model), workdir=str(tmp_path)) as cluster:
        service = cluster.service_client(job="adding")
        process = cluster.workers[0]._process
        os.kill(process.pid, signal.SIGSTOP)
        outcome = {}

        def create():
            try:
                outcome["client"] = service.create_training_client(base_model=micro_model, seed=0)
            except Exception as exc:
                outcome["error"] = exc

        creating = threading.Thread(target=create)
        creating.start()
        creating.join(0.5)
        os.kill(process.pid, signal.SIGKILL)
        creating.join(120)
        assert not creating.is_alive(), "create_training_client hung"
        error = outcome.get("error")
        assert error is None or isinstance(error, errors.WorkerFailed), f"not retriable: {error!r}"
        client = outcome.get("client") or service.create_training_client(base_model=micro_model, seed=0)
        assert client.optim_step().result(120).metrics["step"] == 1.0


@pytest.mark.slow
def test_bench_faults_json(capsys):
    from plexrl.cli import main

    assert main(["bench", "faults", "--json", "--kills", "1", "--steps", "6"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert {"recovery_s_median", "recovery_s_max", "step_s_mean", "ratio_median", "kills"} <= set(out)
    assert out["bitwise_equal"] and out["process_restarts"] == out["kills"] == 1

"""`plexrl bench cotenancy` (plexrl/bench/cotenancy.py): the placer's co-tenancy model against the
simulator, one combination of job classes on one node group at a time.

Invariants checked (the error itself is a figure for notes, not asserted):
- every multiset of 2..K classes of one size runs, its jobs all placed on the same devices and
  sharing through the whole run, each with a predicted and a realised inflation;
- the mean absolute error is the mean of |predicted - realised| over those jobs, overall and per
  number of tenants;
- a class that differs from another only in arrivals, slack and steps counts once; a class that
  does not fill whole nodes is left out with a reason; fewer than 2 tenants is a
  clear error; the command prints one JSON object.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from plexrl.bench.cotenancy import cotenancy
from plexrl.cli import main
from plexrl.sim.workload import WorkloadJob, Workload, load_cluster, load_workload


def two_classes() -> Workload:
    crowded = load_workload("crowded-256")
    math, code = crowded.jobs[0], crowded.jobs[2]
    half = math.model_copy(update={"name": "half-node", "dp": 4})
    later = code.model_copy(update={"name": "code-7b-later", "arrival_s": 5000.0, "count": 3, "slack": 0.2})
    return crowded.model_copy(update={"jobs": [math, code, half, later]})


def test_every_pair_shares_one_group_and_the_error_is_their_mean():
    workload = two_classes()
    out = cotenancy(workload, load_cluster(workload.cluster), tenants=2)
    assert [c["combination"] for c in out["combinations"]] == [
        ["math-7b", "math-7b"], ["math-7b", "code-7b"], ["code-7b", "code-7b"]]
    assert out["not_co_placed"] == [] and all(c["co_placed"] for c in out["combinations"])
    rows = [r for c in out["combinations"] for r in c["jobs"]]
    assert len(rows) == 6 and all(r["shared"] and r["realised"] > 0 for r in rows)
    errors = [abs(r["predicted"] - r["realised"]) for r in rows]
    assert out["mae"] == pytest.approx(np.mean(errors)) and out["mae_by_tenants"] == {"2": pytest.approx(out["mae"])}
    assert out["skipped"] == ["half-node: 4 GPUs is not whole nodes of 8"]


def test_the_pinned_mode_realises_the_same_pairs_with_pinned_rollouts():
    """`--mode plexrl-pinned`: the profiles name no elastic rollouts, so the model predicts
    pinned calls (each rollout phase waits for the rest of a co-tenant's rollout: no less than
    elastic turns, which share its replicas), and the realised slowdowns are those of rollouts
    dealt to every replica (two code-7b jobs: 5-7% pinned, 0-3% elastic)."""
    workload = two_classes()
    cluster = load_cluster(workload.cluster)
    elastic, pinned = (cotenancy(workload, cluster, tenants=2, mode=m) for m in ("plexrl", "plexrl-pinned"))
    assert (elastic["mode"], pinned["mode"]) == ("plexrl", "plexrl-pinned")
    for a, b in zip(elastic["combinations"], pinned["combinations"]):
        assert all(p["predicted"] >= e["predicted"] for e, p in zip(a["jobs"], b["jobs"]))
    # the math-7b pair: its rollouts wait for each other pinned, share replicas elastic
    assert pinned["combinations"][0]["jobs"][0]["predicted"] > elastic["combinations"][0]["jobs"][0]["predicted"]
    code = lambda out: [r["realised"] for r in out["combinations"][2]["jobs"]]
    assert max(code(elastic)) < min(code(pinned))


def test_fewer_than_two_tenants_or_an_unknown_workload_is_a_clear_error(capsys):
    workload = load_workload("crowded-256")
    with pytest.raises(ValueError, match="--tenants 1: expected at least 2"):
        cotenancy(workload, load_cluster(workload.cluster), tenants=1)
    with pytest.raises(ValueError, match="--mode 'colocated': expected one of the PlexRL modes"):
        cotenancy(workload, load_cluster(workload.cluster), tenants=2, mode="colocated")
    for argv, says in ((["--tenants", "1"], "--tenants 1: expected at least 2"),
                       (["--mode", "split"], "--mode 'split': expected one of the PlexRL modes"),
                       (["nosuch"], "workload 'nosuch' is neither a file nor a shipped workload")):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "cotenancy", *argv])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_command_prints_one_json_object(capsys, tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(load_workload("crowded-256").model_copy(
        update={"jobs": [WorkloadJob(name="solo", params_b=7, reward_s=10)]}).model_dump()))
    assert main(["bench", "cotenancy", str(path), "--tenants", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["combination"] for c in out["combinations"]] == [["solo", "solo"]]
    assert out["target_mae"] == 0.05 and set(out["mae_by_tenants"]) == {"2"}


def test_jobs_whose_memory_cannot_share_a_group_are_reported_not_co_placed():
    """Host memory for one math-7b job per node, not two: the second waits the whole run."""
    workload = load_workload("crowded-256")
    workload = workload.model_copy(update={"jobs": [workload.jobs[0]]})
    cluster = load_cluster(workload.cluster).model_copy(update={"host_memory_gb": 250})
    out = cotenancy(workload, cluster, tenants=2)
    assert out["not_co_placed"] == [["math-7b", "math-7b"]] and out["mae"] is None and out["mae_by_tenants"] == {}
    assert [r["predicted"] for r in out["combinations"][0]["jobs"]] == [0.0, None]

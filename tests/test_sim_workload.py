"""Workload and cluster files: shipped ones load, bad ones are reported by field, and the CLI
prints the documented JSON."""

from __future__ import annotations

import json

import pytest

from plexrl.errors import ConfigError
from plexrl.sim.cli import main
from plexrl.sim.runner import expand_jobs
from plexrl.sim.workload import SHIPPED, load_cluster, load_workload


@pytest.mark.parametrize("name", sorted(p.stem for p in (SHIPPED / "workloads").glob("*.yaml")))
def test_shipped_workloads_load_and_fit_their_cluster(name):
    w = load_workload(name)
    cluster = load_cluster(w.cluster)
    for job in w.jobs:
        cluster.check_job(job)


@pytest.mark.parametrize("name", sorted(p.stem for p in (SHIPPED / "clusters").glob("*.yaml")))
def test_shipped_clusters_load(name):
    assert load_cluster(name).gpus > 0


BAD = [
    ("missing params", "jobs: [{name: a}]", "jobs.0.params_b"),
    ("negative steps", "jobs: [{name: a, params_b: 7, steps: -1}]", "jobs.0.steps = -1"),
    ("unknown field", "jobs: [{name: a, params_b: 7, gpus: 8}]", "jobs.0.gpus"),
    ("mixture weights", "jobs: [{name: a, params_b: 7, rollout: {length_weights: [0.5, 0.2, 0.1, 0.1]}}]", "sum to"),
    ("duplicate names", "jobs: [{name: a, params_b: 7}, {name: a, params_b: 7}]", "repeated: ['a']"),
    ("not yaml", "jobs: [", "not valid YAML"),
    ("arrival order", "poisson: {rate_per_h: 10, order: sorted}\njobs: [{name: a, params_b: 7}]", "poisson.order"),
]


@pytest.mark.parametrize("text,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_workload_names_field_and_value(tmp_path, text, expected):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_workload(str(path))
    assert expected in str(info.value) and str(path) in str(info.value)


def _poisson(tmp_path, order: str | None):
    """Two classes of 20 copies each arriving as a Poisson process, in `order` (None: the default)."""
    arrivals = "{rate_per_h: 30}" if order is None else f"{{rate_per_h: 30, order: {order}}}"
    path = tmp_path / f"poisson-{order}.yaml"
    path.write_text(f"seed: 3\npoisson: {arrivals}\njobs:\n  - {{name: a, params_b: 7, count: 20}}\n"
                    f"  - {{name: b, params_b: 7, count: 20}}\n")
    return expand_jobs(load_workload(str(path)))


def test_poisson_arrivals_interleave_the_classes_unless_listed(tmp_path):
    """A Poisson process over a job mix: by default the classes interleave (a queue many users
    submit to), in an order drawn from the workload's seed; `order: listed` keeps the file's
    order, class after class. Both see the same arrival times."""
    mixed, listed = _poisson(tmp_path, None), _poisson(tmp_path, "listed")
    assert [j.name.split("-")[0] for j in listed] == ["a"] * 20 + ["b"] * 20
    classes = [j.name.split("-")[0] for j in mixed]
    assert sorted(classes) == sorted(j.name.split("-")[0] for j in listed)  # every copy, once
    assert "b" in classes[:10] and "a" in classes[-10:]  # interleaved (certain for this seed)
    assert [j.arrival_s for j in mixed] == [j.arrival_s for j in listed]
    assert [j.name for j in _poisson(tmp_path, "mixed")] == [j.name for j in mixed]  # "mixed" is the default
    assert [j.name for j in _poisson(tmp_path, None)] == [j.name for j in mixed]  # the same order every time


def test_unknown_name_lists_shipped_ones():
    with pytest.raises(ConfigError, match="paper-mix"):
        load_workload("no-such-workload")


@pytest.mark.parametrize("update,message", [
    ({"tp": 3, "dp": 2}, "tp = 3 must divide the cluster's gpus_per_node = 8"),
    ({"tp": 8, "dp": 5}, "tp \\* dp = 40 GPUs exceed a node group of 32 GPUs"),
], ids=["replica-spans-nodes", "job-exceeds-group"])
def test_job_replicas_fit_nodes_and_job_fits_a_group(update, message):
    cluster = load_cluster("h200-256")
    bad = load_workload("paper-mix").jobs[0].model_copy(update=update)
    with pytest.raises(ConfigError, match=message):
        cluster.check_job(bad)
    cluster.check_job(bad.model_copy(update={"tp": 1, "dp": 3}))  # any dp is fine now: GPUs are the unit


def test_cli_json_has_every_documented_field(tmp_path, capsys):
    path = tmp_path / "w.yaml"
    path.write_text(
        "name: cli\ncluster: h200-256\njobs:\n"
        "  - {name: a, count: 2, params_b: 7, steps: 2, reward_s: 200, rollout: {prompts: 32}}\n"
    )
    assert main([str(path), "--json", "--modes", "colocated,split,plexrl,plexrl-fcfs", "--plots", str(tmp_path / "p")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["events_per_s"] > 0 and doc["wall_s"] > 0 and doc["events_per_process_s"] > 0
    assert doc["processes"] >= 1
    assert set(doc["results"]) == {"colocated", "split", "plexrl", "plexrl-fcfs"}
    for summary in doc["results"].values():
        for key in ("gpu_hours_per_step", "cost_reduction_vs_colocated", "slowdown_mean", "slowdown_p95",
                    "makespan_s", "queue_delay_p50_s", "queue_delay_p99_s", "utilization", "switch_overhead_share",
                    "steps", "jct_mean_s", "cluster_gpu_hours_per_step", "capacity_vs_colocated", "within_slack",
                    "makespan_floor_s"):
            assert key in summary
    for key in ("inflation_predicted_mean", "inflation_realised_mean", "inflation_mae", "inflation_mae_shared"):
        assert key in doc["results"]["plexrl"]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "cost_per_step.png", "fig8_policies.png", "inflation_predicted_vs_realised.png", "makespan.png",
        "queue_delay_cdf.png", "utilization.png"]


def test_cli_pack_limit_overrides_the_workloads(tmp_path, capsys):
    """`--pack-limit none` judges every job by its own slack alone, as the workload's
    `pack_limit: null, pack_by_effect: false` does; `--pack-limit X` by at most X, as
    `pack_limit: X, pack_by_effect: false`; `--pack-limit effect` is the default (packing by
    effect). A bad value is refused naming what was expected."""
    jobs = "jobs:\n  - {name: a, count: 3, params_b: 7, dp: 8, steps: 3, arrival_every_s: 40, slack: 1.0}\n"
    cluster = tmp_path / "small.yaml"
    cluster.write_text("name: small\nnodes_per_pod: 2\ngroup_nodes: 2\n")  # 16 GPUs for 24 GPUs of demand
    head = f"name: packing\ncluster: {cluster}\n"
    runs = {}
    for name, text, extra in (("default", head + jobs, []), ("effect", head + jobs, ["--pack-limit", "effect"]),
                              ("flag", head + jobs, ["--pack-limit", "none"]),
                              ("file", head + "pack_limit: null\npack_by_effect: false\n" + jobs, []),
                              ("third", head + jobs, ["--pack-limit", "0.333"]),
                              ("third-file", head + "pack_limit: 0.333\npack_by_effect: false\n" + jobs, [])):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        assert main([str(path), "--json", "--modes", "plexrl", "--processes", "1", *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["results"]["plexrl"]["jobs"]
    assert runs["flag"] == runs["file"] != runs["default"]  # without the effect rule the third job shares at once
    assert runs["default"] == runs["effect"] and runs["third"] == runs["third-file"]
    assert any(job["shared"] for job in runs["flag"].values()) and runs["default"]["a-2"]["queue_delay_s"] > 0
    for bad in ("-0.5", "half"):
        with pytest.raises(SystemExit) as exit_:
            main([str(tmp_path / "default.yaml"), "--pack-limit", bad])
        assert exit_.value.code == 2
        assert f"'{bad}': expected a step slowdown >= 0 (e.g. 0.333), 'none' or 'effect'" in capsys.readouterr().err


def test_cli_refuses_zero_processes(capsys):
    assert main(["paper-mix", "--processes", "0"]) == 2
    err = capsys.readouterr().err
    assert "processes = 0; expected at least 1" in err and "Traceback" not in err


def test_cli_bad_file_is_one_line_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "w.yaml"
    path.write_text("jobs: [{name: a, params_b: 0}]")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "jobs.0.params_b = 0" in err and "Traceback" not in err


def test_cli_tables_fit_an_80_column_terminal_without_cutting_a_figure(tmp_path, capsys):
    """`plexrl sim`'s tables (every mode, over seeds too) print whole in 80 columns: no line is
    wider, no cell is shortened to an ellipsis, and every mode's figures are there."""
    import io

    from rich.console import Console

    from plexrl.sim.cli import SEED_TABLES, USER_TABLES, _cell, show

    path = tmp_path / "w.yaml"
    path.write_text("name: cli\ncluster: h200-256\njobs:\n"
                    "  - {name: a, count: 2, params_b: 7, steps: 2, reward_s: 200, rollout: {prompts: 32}}\n")
    assert main([str(path), "--json", "--seeds", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    out = io.StringIO()
    show(doc, Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for mode in doc["results"]:  # one row in each table
        rows = [line for line in text.splitlines() if line.startswith(f"│ {mode} ")]
        assert len(rows) == len(USER_TABLES) + len(SEED_TABLES), mode
    for results, tables in ((doc["results"], USER_TABLES), (doc["over_seeds"]["modes"], SEED_TABLES)):
        for mode, summary in results.items():
            for _, cols in tables:
                for _, key in cols:
                    assert _cell(key, summary.get(key)) in text

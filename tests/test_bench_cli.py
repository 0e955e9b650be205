"""The benchmark commands print one JSON object with the documented keys (small sizes here;
the figures themselves are reported in notes, never asserted as timings)."""

from __future__ import annotations

import json

from plexrl.cli import main


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_switch_json(capsys):
    out = run_json(capsys, ["bench", "switch", "--json", "--size-mb", "8", "--repeats", "2"])
    assert {"switch_gbps", "memcpy_gbps", "ratio"} <= set(out)
    assert 0.5 * out["state_bytes"] < out["bytes_per_switch"] < 2 * out["state_bytes"], "one state loaded per switch"
    assert out["ratio"] == out["switch_gbps"] / out["memcpy_gbps"]


def test_bench_dispatch_json(capsys):
    out = run_json(capsys, ["bench", "dispatch", "--json", "--requests", "50", "--queued", "100"])
    assert {"overhead_ms_per_request", "decision_us_p99"} <= set(out)
    assert out["decision_us_p99"] >= out["decision_us_p50"] > 0


def test_unknown_command_is_a_clear_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err

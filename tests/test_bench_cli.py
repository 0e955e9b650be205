"""The benchmark commands print one JSON object with the documented keys (small sizes here;
the figures themselves are reported in notes, never asserted as timings)."""

from __future__ import annotations

import json

from plexrl.cli import main


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_switch_json(capsys):
    out = run_json(capsys, ["bench", "switch", "--json", "--size-mb", "8", "--repeats", "2", "--rl-steps", "2",
                            "--device", "cpu"])
    assert {"switch_gbps", "memcpy_gbps", "ratio"} <= set(out)
    assert 0.5 * out["state_bytes"] < out["bytes_per_switch"] < 2 * out["state_bytes"], "one state loaded per switch"
    assert out["ratio"] == out["switch_gbps"] / out["memcpy_gbps"]
    # a step's forward_backward copies the gradients back (4 B/param), its optim_step weights and moments (12):
    # the whole state once, where writing it all back after both would copy it twice; the gradients are zeroed
    assert out["writeback_bytes_per_step"] == out["trainer_state_bytes"]
    assert out["writeback_zeroed_bytes_per_step"] == out["trainer_state_bytes"] / 4
    assert out["whole_state_writeback_bytes_per_step"] == 2 * out["trainer_state_bytes"]
    assert out["writeback_s_per_step"] > 0 and out["whole_state_writeback_s_per_step"] > 0


def test_bench_prefetch_json(capsys):
    out = run_json(capsys, ["bench", "prefetch", "--json", "--size-mb", "8", "--rounds", "2", "--tokens", "8"])
    assert out["calls"] == 2 * 2 * 2, "two jobs, two models each, two rounds"
    assert 0 < out["prefetched_loads"] <= out["loads_on"], "jobs taking turns on one device prefetch their next state"
    assert 0.0 <= out["hidden_fraction"] <= 1.0
    assert 0 <= out["switch_in_s_per_call_on"] and 0 < out["switch_in_s_per_call_off"]


def test_bench_dispatch_json(capsys):
    out = run_json(capsys, ["bench", "dispatch", "--json", "--requests", "50", "--queued", "100"])
    assert {"overhead_ms_per_request", "decision_us_p99"} <= set(out)
    assert out["decision_us_p99"] >= out["decision_us_p50"] > 0


SERVE_MEASURED = {f"{name}_ms_{stat}" for name in ("inprocess", "sdk", "raw_http", "wakeup", "echo")
                  for stat in ("mean", "p50", "p95")} | {
    "sdk_rps_8_clients", "echo_rps_8_clients", "sdk_round_trips_per_call", "raw_round_trips_per_call",
    "protocol_http_floor_ms", "added_ratio_to_echo", "wakeup_ratio_to_echo", "sdk_rps_ratio_to_echo"}
SERVE_DIFFERENCES = {"added_ms", "sdk_client_side_ms", "protocol_ms", "protocol_service_ms"}


def test_bench_serve_json(capsys):
    import math

    out = run_json(capsys, ["bench", "serve", "--quick", "--json"])
    assert SERVE_MEASURED | SERVE_DIFFERENCES | {"call", "calls"} <= set(out)
    assert out["calls"] > 0
    for key in SERVE_MEASURED:
        assert math.isfinite(out[key]) and out[key] > 0, (key, out[key])
    # differences of two measured means: finite, and the split adds up, but either sign is possible on a busy machine
    for key in SERVE_DIFFERENCES:
        assert math.isfinite(out[key]), (key, out[key])
    assert math.isclose(out["added_ms"], out["sdk_client_side_ms"] + out["protocol_ms"], rel_tol=1e-9, abs_tol=1e-9)
    assert out["sdk_round_trips_per_call"] >= 2, "the SDK POSTs, then polls retrieve_future at least once"
    assert out["raw_http_ms_p95"] >= out["raw_http_ms_p50"]


def test_unknown_command_is_a_clear_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err

"""The benchmark commands print one JSON object with the documented keys (small sizes here;
the figures themselves are reported in notes, never asserted as timings)."""

from __future__ import annotations

import json

import pytest

from plexrl.cli import main
from tests.test_vllm import needs_vllm


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_switch_json(capsys):
    out = run_json(capsys, ["bench", "switch", "--json", "--size-mb", "8", "--repeats", "2", "--rl-steps", "2",
                            "--device", "cpu"])
    assert {"switch_gbps", "memcpy_gbps", "ratio"} <= set(out)
    assert 0.5 * out["state_bytes"] < out["bytes_per_switch"] < 2 * out["state_bytes"], "one state loaded per switch"
    assert out["ratio"] == out["switch_gbps"] / out["memcpy_gbps"]
    # the wall time of a whole switching call, against the copy timed by the same (host) clock
    assert out["switch_wall_s"] >= out["load_s"] > 0, "a switching call's wall time includes its load"
    assert out["noop_wall_s"] > 0 and out["copy_wall_s"] > 0 and out["copy_event_s"] > 0
    assert out["wall_ratio"] == out["copy_wall_s"] / out["switch_wall_s"]
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
    # its bound: a load hides behind at most the call before it
    assert out["hidden_fraction_bound"] == min(1.0, out["exec_s_per_call"] / out["load_s_per_load"]) > 0
    assert out["hidden_of_bound"] == out["hidden_fraction"] / out["hidden_fraction_bound"]
    assert 0 <= out["switch_in_s_per_call_on"] and 0 < out["switch_in_s_per_call_off"]


SAMPLE_SMALL = ["bench", "sample", "--json", "--batch", "4", "--max-tokens", "8", "--prompt-tokens", "4",
                "--repeats", "1", "--sweep", "1,8", "--rollout", "4x2x4"]


def check_sample_budget(out: dict) -> None:
    # the split the cluster reports adds up to the budget, and its arena holds one of the bench's states
    assert out["budget_device_memory_bytes"] == sum(out[f"budget_{part}_bytes"] for part in (
        "activation_reserve", "engine", "shared", "state"))
    assert out["budget_activation_reserve_bytes"] > 0 and out["budget_state_bytes"] // out["state_bytes"] == 1


def test_bench_sample_json_hf(capsys):
    out = run_json(capsys, SAMPLE_SMALL + ["--samplers", "hf"])
    assert out["hf_tokens"] == 4 * 8, "the bench's model has no EOS: every sequence decodes all its tokens"
    assert out["hf_tokens_per_s"] > 0 and out["hf_decode_s"] > 0
    assert out["state_bytes"] == 4 * out["parameters"], "fp32 on CPU"
    assert out["vllm_skipped"] == "not asked for (--samplers hf)" and "vllm_vs_hf" not in out
    assert out["budget_engine_bytes"] == 0
    check_sample_budget(out)
    assert [row["batch"] for row in out["sweep"]] == [1, 8] and out["copy_bandwidth_gbps"] > 0
    for row in out["sweep"]:
        assert min(row["loop_tokens_per_s"], row["batched_tokens_per_s"], row["bound_tokens_per_s"]) > 0
        assert row["batched_of_bound"] == row["batched_tokens_per_s"] / row["bound_tokens_per_s"]
    assert out["rollout"] == "4x2x4" and out["rollout_pairs"] == 1
    ratio = out["rollout_batched_tokens_per_s"] / out["rollout_loop_tokens_per_s"]
    assert out["rollout_batched_vs_loop"] == pytest.approx(ratio, rel=1e-9), "one pair: the ratio of its rates"


@needs_vllm
def test_bench_sample_json_vllm(capsys):
    out = run_json(capsys, SAMPLE_SMALL + ["--switches", "2"])
    assert "vllm_skipped" not in out
    assert out["vllm_tokens"] == out["hf_tokens"] == 4 * 8
    assert out["vllm_vs_hf"] == out["vllm_tokens_per_s"] / out["hf_tokens_per_s"]
    assert out["vllm_switches"] == 2, "two jobs' states taking turns: every call after the first round is a switch"
    assert out["vllm_push_bytes"] == out["state_bytes"] and out["vllm_switch_in_s"] > 0
    assert out["vllm_push_copy_s"] > 0, "the push's reference: its bytes over a copy's speed measured in this run"
    assert out["vllm_switch_in_vs_copy"] == out["vllm_switch_in_s"] / out["vllm_push_copy_s"]
    assert out["vllm_sleep"].startswith("sleep skipped"), "vLLM's sleep mode is CUDA-only"
    assert out["budget_engine_bytes"] > 0
    check_sample_budget(out)


def test_bench_dispatch_json(capsys):
    out = run_json(capsys, ["bench", "dispatch", "--json", "--requests", "50", "--queued", "100"])
    assert {"overhead_ms_per_request", "decision_us_p99", "process_ms_per_request", "pipe_round_trip_ms"} <= set(out)
    assert out["decision_us_p99"] >= out["decision_us_p50"] > 0
    assert min(out["process_ms_per_request"], out["pipe_round_trip_ms"], out["process_cpu_ms_per_request"]) > 0


SERVE_MEASURED = {f"{name}_ms_{stat}" for name in ("inprocess", "sdk", "raw_http", "wakeup", "echo")
                  for stat in ("mean", "p50", "p95")} | {
    "sdk_rps_8_clients", "echo_rps_8_clients", "sdk_round_trips_per_call", "raw_round_trips_per_call",
    "protocol_http_floor_ms", "added_ratio_to_echo", "wakeup_ratio_to_echo", "sdk_rps_ratio_to_echo",
    "sampled_tokens_per_s_8_inprocess", "sampled_tokens_per_s_8_sdk", "sampled_sdk_vs_inprocess"}
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


def test_bench_scale_json(capsys, tmp_path):
    plot = tmp_path / "scale.png"
    out = run_json(capsys, ["bench", "scale", "--json", "--sizes", "256", "--hours", "0.25", "--plot", str(plot)])
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"colocated", "plexrl"} and all(r["gpus"] == 256 for r in rows.values())
    assert rows["plexrl"]["jobs"] == 30, "scale-10k's 1,200 jobs cut to 256 of its 10,240 GPUs"
    assert all(r["events"] > 0 and r["wall_s"] > 0 for r in rows.values())
    assert rows["plexrl"]["decisions"] >= 1 and rows["plexrl"]["decision_ms_p99"] > 0
    assert "decisions" not in rows["colocated"], "only a placer's decisions are timed"
    assert plot.stat().st_size > 0 and out["plot"] == str(plot)

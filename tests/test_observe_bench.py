"""`plexrl bench observe --quick`: every figure is there and plausible (the speed targets are
checked by running the benchmark, not here)."""

from __future__ import annotations

import json

from plexrl import cli


def test_bench_observe_json(capsys):
    assert cli.main(["bench", "observe", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dashboard_devices"] == 8 and out["dashboard_jobs"] == 20 and out["dashboard_spans"] > 0
    assert out["calls_per_arm"] == 10 and out["scrapes"] >= 1 and out["scrape_ms_mean"] > 0
    assert out["trace_records"] == 2000 and out["trace_calls"] > 0 and out["trace_s"] > 0
    for key in ("call_unscraped_ms_mean", "call_scraped_ms_mean", "dashboard_data_ms_p95", "metrics_scrape_ms_p95"):
        assert out[key] > 0

"""`plexrl serve`'s command line and key file: bad settings are refused before anything starts,
with a message naming the line or flag (and never showing a key)."""

from __future__ import annotations

import pytest

from plexrl.api import errors
from plexrl.serve.server import main, parse_models
from plexrl.serve.tenants import DEFAULT_TENANT, Tenants

GOOD = "tml-0123456789abcdefghij"


@pytest.mark.parametrize("text, message", [
    ("alice", "expected 'TENANT KEY'"),
    (f"alice {GOOD} extra", "expected 'TENANT KEY'"),
    ("alice not-a-tinker-key-0123456789", "must start with 'tml-'"),
    ("alice tml-short", "at least 16 more"),
    (f"al/ice {GOOD}", "tenant 'al/ice'"),
    (f"alice {GOOD}\nbob {GOOD}", "also on an earlier line"),
    ("# only a comment\n\n", "no 'TENANT KEY' lines"),
])
def test_bad_key_files_are_refused_by_line(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(errors.ConfigError, match=message) as refused:
        Tenants.from_file(path)
    assert GOOD not in str(refused.value)  # a key is never shown


def test_keys_map_to_their_tenants_and_nothing_else(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# team\nalice {GOOD}\nbob {GOOD}x\n")
    tenants = Tenants.from_file(path)
    assert tenants.tenant_of(GOOD) == "alice" and tenants.tenant_of(GOOD + "x") == "bob"
    assert tenants.tenant_of(GOOD[:-1]) is None and tenants.tenant_of(None) is None and tenants.tenant_of("") is None
    assert Tenants().tenant_of(None) == DEFAULT_TENANT  # no key file: one tenant


def test_models_are_named_by_path_or_by_name(tmp_path, tiny_model):
    models = parse_models([tiny_model, f"small={tiny_model}"])
    assert set(models) == {tiny_model, "small"} and len(set(models.values())) == 1
    with pytest.raises(errors.ConfigError, match="no config.json"):
        parse_models([str(tmp_path)])
    with pytest.raises(errors.ConfigError, match="given twice"):
        parse_models([f"a={tiny_model}", f"a={tiny_model}"])


def test_without_keys_the_server_refuses_a_non_loopback_address(tiny_model, capsys):
    assert main(["--host", "0.0.0.0", "--model", tiny_model]) == 2
    assert "binds only a loopback address" in capsys.readouterr().err
    assert main([]) == 2
    assert "--model" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--edge-workers", "0"], "workers=0"),
    (["--max-json-mib", "0"], "max_json_bytes=0"),
    (["--queued-per-tenant", "-1"], "queued_per_tenant=-1"),
    (["--poll-hold", "0"], "poll_hold_s=0"),
])
def test_bad_limits_are_refused_naming_the_setting(tiny_model, capsys, flags, message):
    assert main(["--model", tiny_model, *flags]) == 2
    assert message in capsys.readouterr().err


def test_edge_limits_follow_the_served_context(tiny_model):
    """A JSON body need hold no more than a prompt of the longest served context (its asample), a
    forward_backward no more than the SDK's chunk or one full-context datum; given values win."""
    from plexrl.serve.edge import EdgeLimits
    from plexrl.serve.server import max_context

    assert max_context([tiny_model]) == 256 and max_context(["/nonexistent"]) is None
    small = EdgeLimits.for_context(256)
    assert small.max_json_bytes == (64 << 10) + 12 * 256 and small.max_json_items == 4096 + 512
    assert small.max_request_values == 1_250_000
    assert EdgeLimits.for_context(1 << 20).max_request_values == 4 << 20
    assert EdgeLimits.for_context(None) == EdgeLimits()
    assert EdgeLimits.for_context(256, max_json_bytes=5).max_json_bytes == 5

"""Warm start cache: keyed on its inputs, reused, atomic; the folder is a loadable base model."""

from __future__ import annotations

from plexrl.rl import warm_start
from plexrl.rl.spec import ModelSpec
from plexrl.engines.local import LocalCluster

SMALL = ModelSpec(hidden_size=32, num_layers=1, num_heads=2)


def test_cache_is_reused_and_keyed_on_inputs(tmp_path):
    first = warm_start.warm_model("addition", SMALL, steps=2, root=tmp_path)
    built_at = (first / "model.safetensors").stat().st_mtime_ns
    assert warm_start.warm_model("addition", SMALL, steps=2, root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == built_at, "a cache hit must not rebuild"
    others = {warm_start.warm_model("addition", SMALL, steps=3, root=tmp_path),
              warm_start.warm_model("countdown", SMALL, steps=2, root=tmp_path),
              warm_start.warm_model("addition", SMALL.model_copy(update={"seed": 1}), steps=2, root=tmp_path)}
    assert first not in others and len(others) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building-")], "no half-built entries left"


def test_warm_folder_is_a_base_model_and_differs_from_random(tmp_path):
    folder = warm_start.warm_model("addition", SMALL, steps=2, root=tmp_path)
    with LocalCluster(devices=1) as cluster:
        client = cluster.service_client("j").create_training_client(base_model=folder)
        assert client.get_tokenizer().encode("12+34=", add_special_tokens=False)


def test_key_changes_with_code(tmp_path, monkeypatch):
    key = warm_start.cache_key("addition", SMALL, 2)
    monkeypatch.setattr(warm_start, "SFT_LEARNING_RATE", warm_start.SFT_LEARNING_RATE * 2)
    assert warm_start.cache_key("addition", SMALL, 2) != key

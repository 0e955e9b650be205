"""Shared fixtures. Tiny models are built offline once per session and loaded through the real
Hugging Face loading path."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer, hidden-64 char-level Llama (~0.6 M parameters)."""
    from plexrl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> str:
    """A 1-layer, hidden-16 model: cheap enough for property tests with many requests."""
    from plexrl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "micro", seed=1, hidden_size=16,
                               num_layers=1, num_heads=2))


@pytest.fixture(scope="module")
def ray_node():
    """One local Ray instance with 2 logical GPUs for a test module (start-up costs seconds)."""
    import tempfile

    ray = pytest.importorskip("ray")
    ray.init(num_gpus=2, num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             _temp_dir=tempfile.mkdtemp(prefix="/tmp/r"), log_to_driver=False)
    yield
    ray.shutdown()

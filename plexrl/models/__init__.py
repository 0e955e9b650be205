"""Model makers: small Hugging Face causal LMs for tests and demos."""

from plexrl.models.tiny import make_tiny_model

__all__ = ["make_tiny_model"]

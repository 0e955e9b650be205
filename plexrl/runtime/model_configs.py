"""The model folders a front has seen: each one's Hugging Face config, read once.

A front answers a client's questions about a model (its vocabulary and positions, its stop
tokens) and estimates what a model will take (runtime/memory_estimates.py) from its config
alone; it never loads weights. Every node must see the same folder (`source`), so one read
here serves every node. Invariant: a folder that is not a Hugging Face model folder fails with
ModelLoadError naming the folder and what was expected, never with a transformers traceback.
"""

from __future__ import annotations

from pathlib import Path

from plexrl.api import errors
from plexrl.api.cluster import StateHandle
from plexrl.policy import ModelMemory
from plexrl.runtime.memory_estimates import model_memory, state_bytes


class ModelConfigs:
    def __init__(self):
        self._configs: dict[str, object] = {}
        self._base_sizes: dict[str, int] = {}

    def config(self, source: str):
        if source not in self._configs:
            self._configs[source] = load_config(source)
        return self._configs[source]

    def limits(self, source: str) -> tuple[int, int]:
        """(vocabulary size, maximum positions) of the model."""
        config = self.config(source)
        return int(config.vocab_size), int(getattr(config, "max_position_embeddings", 1 << 30))

    def stop_token_ids(self, source: str) -> tuple[int, ...]:
        eos = getattr(self.config(source), "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def base_bytes(self, source: str) -> int:
        """Float32 bytes of `source`'s weights (a LoRA base), from its config."""
        if source not in self._base_sizes:
            self._base_sizes[source] = state_bytes(self.config(source), False)[0]
        return self._base_sizes[source]

    def memory(self, handles: list[StateHandle]) -> list[ModelMemory]:
        """What the placer counts of these models: each one's own bytes next to its activation
        reserve and vLLM engine on a device, a LoRA base's once per node."""
        return [m for h in handles for m in model_memory(
            h.name, h.source, h.device_bytes + h.activation_reserve_bytes + h.engine_bytes, h.host_bytes,
            self.base_bytes(h.source) if h.lora else 0)]


def load_config(source: str):
    from transformers import AutoConfig

    if not Path(source).is_dir():
        raise errors.ModelLoadError(
            f"base model folder {source!r} does not exist; expected a local Hugging Face model folder "
            "(config.json + weights), e.g. one written by `plexrl tiny-model FOLDER`")
    if not (Path(source) / "config.json").is_file():
        raise errors.ModelLoadError(
            f"base model folder {source!r} has no config.json; expected a local Hugging Face model folder "
            "(config.json + weights) that every node can read, e.g. one written by `plexrl tiny-model FOLDER`")
    try:
        return AutoConfig.from_pretrained(source)
    except Exception as exc:  # transformers raises many kinds; the user needs one clear message
        raise errors.ModelLoadError(f"could not load {source!r} as a causal LM with AutoModelForCausalLM: "
                                    f"{type(exc).__name__}: {exc}") from exc

"""What a model will take before it is loaded: its bytes, its dtypes, a sample call's KV cache.

A front decides admission and checks a call's size before any node has measured the model, from
its Hugging Face config alone. These are those estimates; every one is provisional and on the
safe side for admission (a node measures the real size, and the placer's profile is replaced by
measured ones later). Invariants: a state's bytes here count its weights in the dtype it is held
in (`weights_dtype`), its KV cache in the dtype it computes in (`compute_dtype`); a LoRA state's
frozen base is counted once per node, as a shared model (`model_memory`).
"""

from __future__ import annotations

from plexrl.api.types import LoraConfig
from plexrl.policy import ModelMemory
from plexrl.runtime import precision


def num_samples_tokens(num_samples: int, prompt_tokens: int, max_tokens: int) -> int:
    """Tokens a sample call holds at its end: every sequence's prompt and completion."""
    return int(num_samples) * (prompt_tokens + int(max_tokens))


def kv_bytes_per_token(config, itemsize: int = 4) -> int:
    """Keys and values of every layer for one token of a Hugging Face decoder config, `itemsize`
    bytes a number (the dtype the model computes in: `compute_dtype`)."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def compute_dtype(resolved: str, trainable: bool, lora: LoraConfig | None):
    """The dtype a state's model computes in (its KV cache's): its autocast dtype, else its weights'."""
    weights, autocast = _state_dtypes(resolved, trainable, lora)
    return autocast or weights


def weights_dtype(resolved: str, trainable: bool, lora: LoraConfig | None):
    """The dtype a state of a cluster of precision `resolved` holds."""
    return _state_dtypes(resolved, trainable, lora)[0]


def _state_dtypes(resolved: str, trainable: bool, lora: LoraConfig | None):
    """`precision.state_dtypes` as a front sees it: "auto" (not known to a Ray front: its nodes
    ask their workers) counts as bf16, the smaller: the node checks the real size."""
    return precision.state_dtypes("bf16" if resolved == "auto" else resolved, trainable, lora)


def state_bytes(config, trainable: bool, lora: LoraConfig | None = None, resolved: str = "fp32") -> tuple[int, int]:
    """Bytes of a state before it is loaded (its weights in `weights_dtype`), and float32 bytes of
    the shared base it stands on (a LoRA state's; else 0): a provisional estimate for admission
    (the node measures the real size; the placer's profile is replaced by measured ones later)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plexrl.runtime.lora import adapter_numel

    from plexrl.runtime.state import MODEL_BUILD

    with MODEL_BUILD, torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if lora is None:
        if not trainable:
            return -(-numel * weights_dtype(resolved, False, None).itemsize // 4) * 4, 0
        return numel * 4 * 4, 0
    return adapter_numel(config, lora) * 4 * (4 if trainable else 1), numel * 4


def provisional_memory(config, job: str, name: str, source: str, trainable: bool, lora: LoraConfig | None,
                       resolved: str, cluster) -> list[ModelMemory]:
    """A model not loaded yet as admission counts it (`cluster`: the ClusterConfig): its estimated
    bytes next to the activation reserve set (a measured one is known once the node measured it),
    its LoRA base shared. StateTooLarge (budgets.check_budgets) when it can never fit."""
    from plexrl.runtime.budgets import BesideStates, check_budgets

    nbytes, shared = state_bytes(config, trainable, lora, resolved)
    reserve = cluster.activation_reserve_bytes or 0
    check_budgets(name, job, trainable, nbytes, nbytes, cluster.device_memory_bytes, cluster.host_memory_bytes,
                  shared, weights_dtype(resolved, trainable, lora),
                  BesideStates(reserve_bytes=reserve, shared_bytes=shared))
    return model_memory(name, source, nbytes + reserve, nbytes, shared)


def model_memory(name: str, source: str, device_bytes: int, host_bytes: int, shared_bytes: int) -> list[ModelMemory]:
    """A model as the placer counts it: its own bytes and, for a LoRA model, its frozen base as a
    shared model (one copy per node whatever the number of jobs using it; resident next to it)."""
    if not shared_bytes:
        return [ModelMemory(name, device_bytes, host_bytes)]
    return [ModelMemory(name, device_bytes + shared_bytes, host_bytes),
            ModelMemory(f"{name}:base", shared_bytes, shared_bytes, shared=f"lora-base:{source}")]

"""LoRA states' modules: a peft adapter over a frozen base that every LoRA state of that base shares.

A LoRA state's module is a skeleton whose base parameters and buffers *are* a shared base module's
(the same tensors, no copy), with peft's LoRA layers injected (`peft.inject_adapter_in_model`).
Only the adapter's parameters are the state's own (`ModelState.params`): its flat memory is the
usual [weights | grads | adam m | adam v] over them, so binding, switching, Adam steps and
write-through run on the adapter alone. Who owns the shared base: a device worker's per-source
template (device_worker.py), and the node's own copy for node functions (node_models.py).

Invariants:
- the base is read-only: its parameters have requires_grad=False, and nothing writes them;
- the adapter's initial weights depend on `LoraConfig.seed` only, drawn from a private generator
  (the global RNG is neither read nor changed): A uniform in +-1/sqrt(fan_in) (peft's kaiming
  init), B zero, so a fresh adapter computes exactly the base's outputs;
- the adapter's parameter order is `named_parameters` order, fixed by the base's config and the
  LoraConfig: the same flat layout in every process.
"""

from __future__ import annotations

import math

import torch

from plexrl.api.types import LoraConfig
from plexrl.runtime.state import MODEL_BUILD

ADAPTER = "default"  # peft's adapter name: one adapter per state


def peft_config(lora: LoraConfig):
    """The peft.LoraConfig of `lora` (no dropout: results must not depend on what else runs)."""
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha, target_modules=list(lora.target_modules),
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def frozen(module: torch.nn.Module) -> torch.nn.Module:
    """`module` made a shareable base: every parameter read-only for autograd."""
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def lora_module(base: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """A module computing `base` + the adapter of `lora`: base tensors shared, adapter initialised."""
    import peft
    from transformers import AutoModelForCausalLM

    # 1) a skeleton on the meta device (no memory), then every base tensor put in by reference
    with MODEL_BUILD:
        with torch.device("meta"):
            twin = AutoModelForCausalLM.from_config(base.config, dtype=torch.float32)
        share_tensors(twin, frozen(base))
        # 2) peft's LoRA layers, their weights on meta (peft draws no random numbers this way)
        peft.inject_adapter_in_model(peft_config(lora), twin, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    # 3) the adapter's weights, from the config's seed alone
    init_adapter(twin, lora.seed, device=next(base.parameters()).device)
    twin.eval()
    return twin


def share_tensors(twin: torch.nn.Module, base: torch.nn.Module) -> None:
    """Point every parameter and buffer of `twin` at `base`'s (same architecture)."""
    modules = dict(base.named_modules())
    for name, module in twin.named_modules():
        source = modules[name]
        for key in module._parameters:
            module._parameters[key] = source._parameters[key]
        for key in module._buffers:
            module._buffers[key] = source._buffers[key]


def init_adapter(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Give every adapter parameter (still on meta) its initial value: A uniform, B zero."""
    generator = torch.Generator().manual_seed(int(seed))
    for name, layer in module.named_modules():
        for key, param in list(layer._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if ".lora_A." in f"{name}.":
                bound = 1.0 / math.sqrt(param.shape[1])
                value = torch.empty(param.shape).uniform_(-bound, bound, generator=generator)
            elif ".lora_B." in f"{name}.":
                value = torch.zeros(param.shape)
            else:
                raise RuntimeError(f"parameter {name}.{key} is still on the meta device after the base was shared")
            layer._parameters[key] = torch.nn.Parameter(value.to(device), requires_grad=True)


def adapter_names(module: torch.nn.Module) -> list[str]:
    """The adapter's parameter names, in the state's flat order."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def adapter_numel(config, lora: LoraConfig) -> int:
    """Parameters of `lora`'s adapter over a base of this Hugging Face config (built on meta: free)."""
    import peft
    from transformers import AutoModelForCausalLM

    with MODEL_BUILD, torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        peft.inject_adapter_in_model(peft_config(lora), twin, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    return sum(p.numel() for name, p in twin.named_parameters() if "lora_" in name)


def peft_key(name: str) -> str:
    """The key peft's `adapter_model.safetensors` stores an adapter parameter under
    (`PeftModel.save_pretrained`: `base_model.model.` before, no adapter name)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")

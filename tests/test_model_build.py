"""Building models from two threads of one process: peft's `init_empty_weights` (used when it
adds LoRA layers) patches `torch.nn.Module.register_parameter` for every thread while it runs,
and a `from_pretrained` on another thread then registers its loaded parameters (marked
`_is_hf_initialized`) through the patch, which fails. `state.MODEL_BUILD` serialises every
model build and adapter injection; this was seen as a failed create_model with two tenants on
one `plexrl serve`."""

from __future__ import annotations

import threading
import time

import peft

from plexrl.api.types import LoraConfig
from plexrl.runtime import lora
from plexrl.runtime.state import load_module


def test_a_load_during_another_threads_lora_injection_waits_and_succeeds(tiny_model, monkeypatch):
    base = load_module(tiny_model)
    real = peft.inject_adapter_in_model
    patched = threading.Event()

    def slow_inject(*args, **kwargs):  # hold peft's global patch open while the other thread loads
        from peft.utils.integrations import init_empty_weights

        with init_empty_weights():
            patched.set()
            time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(peft, "inject_adapter_in_model", slow_inject)
    outcome: dict = {}

    def build_lora():
        outcome["lora"] = lora.lora_module(base, LoraConfig(rank=4))

    def load():
        try:
            outcome["loaded"] = load_module(tiny_model)
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    first = threading.Thread(target=build_lora)
    first.start()
    assert patched.wait(60)
    second = threading.Thread(target=load)
    second.start()
    first.join(60)
    second.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert sum(p.numel() for p in outcome["loaded"].parameters()) == sum(p.numel() for p in base.parameters())
    assert any("lora_" in name for name, _ in outcome["lora"].named_parameters())

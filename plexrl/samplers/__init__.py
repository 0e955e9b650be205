"""Samplers other than the Hugging Face loop of backends/execution.py, chosen per model when it is
created (`sampler="hf" | "vllm"`). Today one: vLLM, in an engine process of its own per (device,
base model) — vllm_sampler.py is the device worker's side, vllm_engine.py the engine process."""

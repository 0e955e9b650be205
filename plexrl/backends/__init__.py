"""Backends: the real execution of the function API on Hugging Face models (torch).

`execution` runs sample / compute_logprobs / forward_backward on a model the runtime hands in;
`losses` holds the built-in losses. The latency-model backend of the simulator lives elsewhere.
"""

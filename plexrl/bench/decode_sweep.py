"""Decode throughput against live batch size, beside the memory-bound limit measured in the same
run (part of `plexrl bench sample`, bench/sample.py).

For each live batch size b, on one model, in this process (no cluster: the decode itself):
- `loop`: today's one-request loop (execution.sample_eager): one call of b samples of one
  prompt, one Python step and one host sync per token (its best case: b rows in one call);
- `batched`: the same b samples of that prompt decoded in slots (execution.sample_batch; with
  `graph`, each step a captured CUDA graph): the same work, so the two differ only in how a
  step runs. (Rows of different requests each prefill their own prompt, at batch 1: the
  rollout A/B below has them.)
- `bound`: b x copy bandwidth / (the model's weight bytes + the KV bytes of b rows at their mean
  context): what a decoder that reads only those bytes once per step at the bandwidth of a
  device-to-device copy (bytes read + written per second) would reach. A bound, not a target
  on CPU: a small model's step there is launch- and Python-bound, far from memory-bound.
Tokens/s are of the call's wall time, median of `repeats` after a warm-up call.

And a rollout A/B (`rollout`): P prompts x S samples x T tokens, as today's loop runs it (one
sample call per prompt, one after the other) and as one batched call, in pairs back to back;
tokens/s of each and the median ratio of the pairs, in one run.

Out of scope: prompts sharing a prefix (each request prefills its own), stop tokens (every row
decodes all its tokens; the model has no EOS).
"""

from __future__ import annotations

import time

import torch

from plexrl.api.types import SamplingParams
from plexrl.backends import execution, slot_decode
from plexrl.bench.common import median

COPY_BYTES = 256 << 20


def copy_bandwidth(device: str, repeats: int = 5) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of COPY_BYTES."""
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    return 2 * COPY_BYTES / median(seconds[1:])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[4 + (11 * i + 7 * j) % (vocab - 4) for j in range(length)] for i in range(count)]


def timed(device: str, run) -> float:
    sync(device)
    t0 = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - t0


def rate(device: str, run, tokens: int, repeats: int) -> float:
    run()  # warm-up: kernels, allocator, compilation
    return tokens / median([timed(device, run) for _ in range(repeats)])


def sweep(model: torch.nn.Module, device: str, batches: list[int], prompt_tokens: int, max_tokens: int,
          repeats: int, graph: bool, bandwidth: float) -> list[dict]:
    """One row per live batch size: loop, batched and bound tokens/s."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_position = slot_decode.kv_bytes_per_position(model.config, next(model.parameters()).dtype)
    context = prompt_tokens + max_tokens / 2
    rows = []
    for b in batches:
        text = prompts(1, prompt_tokens, model.config.vocab_size)[0]
        requests = [execution.sample_request(model, text, b, params, seed=0)]
        kv_tokens = max(slot_decode.DEFAULT_KV_TOKENS, b * slot_decode.cache_len(prompt_tokens + max_tokens,
                                                                                 model.config.max_position_embeddings))
        loop = rate(device, lambda: execution.sample_eager(model, text, b, params, seed=0), b * max_tokens, repeats)
        batched = rate(device, lambda: execution.sample_batch(model, requests, kv_tokens=kv_tokens, graph=graph),
                       b * max_tokens, repeats)
        bound = b * bandwidth / (weights + b * context * per_position)
        rows.append({"batch": b, "loop_tokens_per_s": loop, "batched_tokens_per_s": batched,
                     "bound_tokens_per_s": bound, "loop_of_bound": loop / bound, "batched_of_bound": batched / bound,
                     "batched_vs_loop": batched / loop})
    return rows


def rollout(model: torch.nn.Module, device: str, count: int, samples: int, prompt_tokens: int, max_tokens: int,
            graph: bool, pairs: int) -> dict:
    """One rollout of `count` prompts x `samples` samples x `max_tokens` tokens, today's loop
    (a call per prompt, one after the other) against one batched call: after a warm-up of each,
    `pairs` pairs run back to back; tokens/s are medians, the ratio the median of the pairs'
    (on a shared machine a pair's two runs see about the same load)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    texts = prompts(count, prompt_tokens, model.config.vocab_size)
    requests = [execution.sample_request(model, text, samples, params, seed=i) for i, text in enumerate(texts)]

    def loop():
        for i, text in enumerate(texts):
            execution.sample_eager(model, text, samples, params, seed=i)

    def batched():
        execution.sample_batch(model, requests, graph=graph)

    tokens = count * samples * max_tokens
    loop(), batched()  # warm-up
    times = [(timed(device, loop), timed(device, batched)) for _ in range(pairs)]
    return {"rollout": f"{count}x{samples}x{max_tokens}", "rollout_pairs": pairs,
            "rollout_loop_tokens_per_s": tokens / median([a for a, _ in times]),
            "rollout_batched_tokens_per_s": tokens / median([b for _, b in times]),
            "rollout_batched_vs_loop": median([a / b for a, b in times])}

"""Batched sampling (backends/slot_decode.py): a row's tokens and log-probs are bitwise those it
gets alone, whatever else shares its batch; its sampling follows the one-request eager loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexrl import errors
from plexrl.api.types import SamplingParams
from plexrl.backends import execution, slot_decode
from plexrl.runtime.state import load_module


@pytest.fixture(scope="module")
def micro(micro_model):
    return load_module(micro_model)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return load_module(tiny_model)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def request(model, prompt, n, params, seed, **kwargs):
    return execution.sample_request(model, prompt, n, params, seed=seed, **kwargs)


def alone(model, req):
    """The request as the only one of its call (the reference every batched row must equal)."""
    responses, _ = execution.sample_batch(model, [req])
    return responses[0]


PARAMS = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 20),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.3]),
    top_k=st.sampled_from([-1, 1, 4]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    stop=st.sampled_from([None, (5,), (7, 9, 11)]),
)
REQUEST = st.tuples(st.lists(st.integers(4, 80), min_size=1, max_size=40), st.integers(1, 6), PARAMS,
                    st.integers(0, 2**64 - 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=1, max_size=7), st.sampled_from([8 * slot_decode.CACHE_MIN, slot_decode.DEFAULT_KV_TOKENS]),
       st.randoms(use_true_random=False))
def test_rows_do_not_depend_on_their_batch(micro, requests, kv_tokens, rng):
    """Random compositions: up to 42 rows (slot buckets 8 to 64), up to three cache lengths, rows
    that outnumber the slots (a budget of 8 slots of the shortest length: rows wait and take freed
    slots), every request compared with itself alone in the default budget."""
    reqs = [request(micro, prompt, n, params, seed) for prompt, n, params, seed in requests]
    rng.shuffle(reqs)
    responses, stats = execution.sample_batch(micro, reqs, kv_tokens=kv_tokens)
    for req, response in zip(reqs, responses):
        assert response == alone(micro, req), f"row results moved with the batch: {req}"
    assert stats.row_steps == sum(stats.tokens), "every live row-step yields one token"


def spread(model, n_requests, n, params, length=6):
    return [request(model, [4 + (7 * i + j) % 70 for j in range(length + i % 5)], n, params, seed=100 + i)
            for i in range(n_requests)]


COMPOSITIONS = {
    # name: (requests beside the probe, their num_samples, kv budget)
    "alone in a batch of 8 slots": (0, 1, slot_decode.DEFAULT_KV_TOKENS),
    "beside 40 rows (64 slots)": (10, 4, slot_decode.DEFAULT_KV_TOKENS),
    "beside 200 rows (256 slots)": (25, 8, slot_decode.DEFAULT_KV_TOKENS),
    "rows outnumber the slots": (12, 3, 8 * slot_decode.CACHE_MIN),
}


@pytest.mark.parametrize("others, n, kv_tokens", COMPOSITIONS.values(), ids=COMPOSITIONS.keys())
def test_named_compositions_on_the_tiny_model(tiny, others, n, kv_tokens):
    probe = request(tiny, [1, 20, 30, 40, 50], 3, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95), seed=7)
    long_one = request(tiny, list(range(4, 84)), 2, SamplingParams(max_tokens=30), seed=8)  # another cache length
    batch = spread(tiny, others, n, SamplingParams(max_tokens=16, temperature=0.8, stop=(9,)))
    reqs = batch[: len(batch) // 2] + [probe, long_one] + batch[len(batch) // 2:]
    responses, stats = execution.sample_batch(tiny, reqs, kv_tokens=kv_tokens)
    assert responses[reqs.index(probe)] == alone(tiny, probe)
    assert responses[reqs.index(long_one)] == alone(tiny, long_one)
    assert len(stats.slots) == 2, "two cache lengths: two slot batches"


def test_stop_strings_and_prompt_logprobs_beside_plain_rows(tiny, tokenizer):
    ids = tokenizer.encode("12+34=")
    stopped = request(tiny, ids, 4, SamplingParams(max_tokens=30, temperature=1.0, stop=("Q", "7")), seed=3,
                      decode=tokenizer.decode, include_prompt_logprobs=True)
    plain = spread(tiny, 6, 5, SamplingParams(max_tokens=30, temperature=1.0))
    responses, _ = execution.sample_batch(tiny, plain + [stopped])
    got = responses[-1]
    assert got == alone(tiny, stopped)
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(ids)
    for seq in got.sequences:
        text = tokenizer.decode(seq.tokens)
        if seq.stop_reason == "stop":
            assert text.endswith("Q") or text.endswith("7"), text
            assert "Q" not in tokenizer.decode(seq.tokens[:-1]) and "7" not in tokenizer.decode(seq.tokens[:-1])
        else:
            assert len(seq.tokens) == 30 and "Q" not in text and "7" not in text


def test_greedy_rows_match_the_eager_loop(tiny):
    """The reference: the one-request loop `sample` ran before (a KV cache, SDPA attention)."""
    params = SamplingParams(max_tokens=20, temperature=0.0)
    prompt = [1, 30, 31, 32, 33]
    batched = execution.sample(tiny, prompt, 2, params, seed=0)
    eager = execution.sample_eager(tiny, prompt, 2, params, seed=0)
    for ours, theirs in zip(batched.sequences, eager.sequences):
        assert ours.tokens == theirs.tokens and ours.stop_reason == theirs.stop_reason
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


FILTERS = {
    # name: (temperature, top_k, top_p, logits, tokens that may be drawn)
    "plain": (1.0, -1, 1.0, [0.0, 1.0, 2.0, -1.0], {0, 1, 2, 3}),
    "top-k 2": (1.0, 2, 1.0, [0.0, 1.0, 2.0, -1.0], {1, 2}),
    "top-k keeps ties": (1.0, 1, 1.0, [2.0, 1.0, 2.0, -1.0], {0, 2}),
    "top-p": (1.0, -1, 0.7, [0.0, 1.0, 2.0, -1.0], {1, 2}),  # masses 0.64, 0.24, 0.09, 0.03
    "greedy": (0.0, -1, 1.0, [0.0, 1.0, 2.0, -1.0], {2}),
}


@pytest.mark.parametrize("temperature, top_k, top_p, logits, allowed", FILTERS.values(), ids=FILTERS.keys())
def test_choose_draws_from_the_tempered_softmax(temperature, top_k, top_p, logits, allowed):
    """20,000 draws of one row's distribution (each its own sample index): every drawn token is
    allowed, and each allowed token's frequency is within 5 standard errors of its probability
    under the renormalised allowed softmax (a correct sampler fails this ~1e-6 of the time)."""
    draws = 20_000
    row = torch.tensor(logits)
    scaled = row / (temperature or 1.0)
    rows = lambda x, dtype: torch.full((draws,), x, dtype=dtype)  # noqa: E731
    noise = slot_decode.gumbel_noise(rows(12345, torch.long), torch.arange(draws), rows(0, torch.long), len(logits))
    tokens, logprobs = slot_decode.choose(row.expand(draws, -1), rows(temperature, torch.float32),
                                          rows(top_k, torch.long), rows(top_p, torch.float32), noise)
    assert set(tokens.tolist()) <= allowed
    mask = torch.tensor([i in allowed for i in range(len(logits))])
    probs = torch.softmax(scaled.masked_fill(~mask, float("-inf")), -1)
    for token in allowed:
        p = float(probs[token])
        freq = float((tokens == token).float().mean())
        assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (token, freq, p)
    expected = torch.log_softmax(scaled, -1)[tokens]
    assert torch.equal(logprobs, expected), "log-probs are under the untruncated tempered softmax"


def test_noise_is_a_function_of_seed_sample_and_step():
    seed = torch.tensor([1, 1, 1, slot_decode.as_int64(2**63 + 5)], dtype=torch.long)
    sample = torch.tensor([0, 1, 0, 0])
    step = torch.tensor([0, 0, 1, 0])
    noise = slot_decode.gumbel_noise(seed, sample, step, 50)
    assert torch.isfinite(noise).all()
    assert torch.equal(noise, slot_decode.gumbel_noise(seed, sample, step, 50))
    assert len({tuple(r) for r in noise.tolist()}) == 4, "each of seed, sample and step changes the draw"
    assert torch.equal(noise[:1], slot_decode.gumbel_noise(seed[:1], sample[:1], step[:1], 50))


def test_cache_lengths_and_slot_buckets():
    assert [slot_decode.cache_len(p, 256) for p in (1, 16, 17, 64, 65, 200, 300)] == [16, 16, 32, 64, 128, 256, 256]
    assert slot_decode.cache_len(150, 160) == 160, "at most the model's positions"
    assert [slot_decode.slot_count(r, 64, 16384) for r in (1, 8, 9, 100, 1000)] == [8, 8, 16, 128, 256]
    assert slot_decode.slot_count(1000, 256, 4096) == 16, "the budget caps the slots"
    assert slot_decode.slot_count(5, 4096, 1024) == 8, "never below the smallest bucket"


def test_graphs_need_cuda(micro):
    req = request(micro, [5, 6], 1, SamplingParams(max_tokens=2), seed=0)
    with pytest.raises(errors.InvalidInput, match="expected a CUDA device"):
        execution.sample_batch(micro, [req], graph=True)


def test_sampling_switches_only_its_own_modules_attention_and_back(tiny):
    """A batched sample runs eager attention on its module for the call only; a module built
    like a state's (skeleton_like) has its own config, so another module's calls meanwhile (a
    worker's activation probe, on another thread) keep theirs."""
    from plexrl.runtime.state import skeleton_like

    twin = skeleton_like(tiny)
    assert twin.config is not tiny.config
    before = tiny.config._attn_implementation
    with slot_decode.eager_attention(twin):
        assert twin.config._attn_implementation == "eager" and tiny.config._attn_implementation == before
    execution.sample(tiny, [5, 6], 1, SamplingParams(max_tokens=3), seed=0)
    assert tiny.config._attn_implementation == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=1, max_size=7), st.randoms(use_true_random=False))
def test_rows_do_not_depend_on_their_batch_on_cuda_graphs(micro_model, requests, rng):
    """The property on CUDA, decode steps as captured graphs (what `make gpu-check` runs)."""
    model = cuda_micro(micro_model)
    reqs = [request(model, prompt, n, params, seed) for prompt, n, params, seed in requests]
    rng.shuffle(reqs)
    responses, _ = execution.sample_batch(model, reqs, graph=True)
    for req, response in zip(reqs, responses):
        assert response == execution.sample_batch(model, [req], graph=True)[0][0]


CUDA_MODELS: dict = {}


def cuda_micro(folder):
    if folder not in CUDA_MODELS:
        CUDA_MODELS[folder] = load_module(folder).to("cuda")
    return CUDA_MODELS[folder]

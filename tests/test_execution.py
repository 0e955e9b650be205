"""The execution backend on a real tiny Llama: gradients into preset views, batching, sampling.

References are plain: per-datum forward passes with the loss written inline, and a decode loop
that re-runs the whole sequence every step without a KV cache.
"""

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plexrl import errors
from plexrl.api import validation
from plexrl.backends import execution, losses
from plexrl.models import make_tiny_model
from plexrl.types import Datum, ModelInput, SamplingParams
from tests.helpers import datum

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = [1, 5, 6, 14, 11, 18]  # <bos> "12+7="


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("exec") / "model", seed=0, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.fixture()
def arena_model(folder):
    """A fresh model whose p.grad are views into one flat zero buffer, as the runtime presets them."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    params = list(model.parameters())
    arena = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = arena[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return model, arena


BATCH = [datum([1, 5, 6, 14, 11, 18, 5, 13, 2]), datum([1, 7, 2]), datum([1, 9, 9, 16, 9, 18, 6, 2])]


def policy_batch(advantages=(1.0, -0.5, 2.0)):
    """BATCH with sampler log-probs slightly off the model's, so ratios straddle the clip range."""
    out = []
    for d, adv in zip(BATCH, advantages):
        n = d.model_input.length
        shift = [0.3 * math.sin(3 * t) for t in range(n)]
        out.append(Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                         "logprobs": [-4.6 + s for s in shift], "advantages": [adv] * n}))
    return out


def value_batch():
    return [Datum(d.model_input, {"target_values": [0.1 * t for t in range(d.model_input.length)]}) for d in BATCH]


def reference_datum_loss(model, d, name):
    """One datum, unpadded, the loss written out per token with torch ops."""
    ids = torch.tensor([d.model_input.to_ints()])
    logits = model(input_ids=ids).logits[0]
    x = {k: torch.tensor(v.tolist()) for k, v in d.loss_fn_inputs.items()}
    if name == "value_mse":
        return 0.5 * ((logits[:, losses.VALUE_TOKEN_ID] - x["target_values"]) ** 2).sum()
    lp = torch.log_softmax(logits, -1)[torch.arange(len(ids[0])), x["target_tokens"].long()]
    if name == "cross_entropy":
        return -lp.sum()
    ratio = torch.exp(lp - x["logprobs"])
    adv = x["advantages"]
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * 0.01 * (lp - x["logprobs"]) ** 2).sum()
    return -(ratio.clamp(0.0, 4.0).detach() * lp * adv).sum()  # cispo


LOSS_BATCHES = {
    "cross_entropy": lambda: BATCH,
    "importance_sampling": policy_batch,
    "ppo": policy_batch,
    "cispo": policy_batch,
    "dro": policy_batch,
    "value_mse": value_batch,
}


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", LOSS_BATCHES)
def test_batched_loss_and_grads_match_per_datum_reference(folder, name, arena_model):
    model, arena = arena_model
    datums = LOSS_BATCHES[name]()
    out = execution.forward_backward(model, datums, name)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    ref_total = sum(reference_datum_loss(reference, d, name) for d in datums)
    ref_total.backward()
    assert out.metrics["loss:sum"] == pytest.approx(ref_total.item(), rel=1e-5, abs=1e-5)
    assert torch.allclose(arena, grads(reference), rtol=1e-4, atol=1e-6)
    assert arena.abs().sum() > 0


def test_grads_accumulate_into_preset_views_in_place(arena_model):
    model, arena = arena_model
    pointers = [p.grad.data_ptr() for p in model.parameters()]
    execution.forward_backward(model, BATCH, "cross_entropy")
    once = arena.clone()
    execution.forward_backward(model, BATCH, "cross_entropy")
    assert [p.grad.data_ptr() for p in model.parameters()] == pointers
    assert all(p.grad.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr() for p in model.parameters())
    assert torch.allclose(arena, 2 * once, rtol=1e-5, atol=1e-7) and once.abs().sum() > 0


def test_cross_entropy_takes_any_per_token_weights(model):
    """forward_backward_custom sends a custom loss's gradient in lp as cross_entropy's weights, so
    weights of any sign must give -sum(weights * lp) and each datum's logprobs back."""
    plain = execution.forward_backward(model, BATCH, "cross_entropy", backward=False)
    weights = [[(-1.0) ** t * (t + 0.5) for t in range(d.model_input.length)] for d in BATCH]
    weighted = execution.forward_backward(model, [Datum(d.model_input, {**d.loss_fn_inputs, "weights": w})
                                                  for d, w in zip(BATCH, weights)], "cross_entropy", backward=False)
    logprobs = [out["logprobs"].tolist() for out in plain.loss_fn_outputs]
    assert [out["logprobs"].tolist() for out in weighted.loss_fn_outputs] == logprobs
    expected = -sum(w * lp for ws, lps in zip(weights, logprobs) for w, lp in zip(ws, lps))
    assert weighted.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_forward_only_leaves_grads_alone_and_matches(arena_model):
    model, arena = arena_model
    forward = execution.forward_backward(model, BATCH, "cross_entropy", backward=False)
    assert torch.all(arena == 0)
    both = execution.forward_backward(model, BATCH, "cross_entropy")
    assert forward.metrics["loss:sum"] == pytest.approx(both.metrics["loss:sum"], rel=1e-6)
    for f, b in zip(forward.loss_fn_outputs, both.loss_fn_outputs):
        assert f["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-6)


def test_padding_does_not_change_a_datum(model):
    batched = execution.forward_backward(model, BATCH, "cross_entropy", backward=False)
    for d, out in zip(BATCH, batched.loss_fn_outputs):
        alone = execution.forward_backward(model, [d], "cross_entropy", backward=False)
        assert out["logprobs"].tolist() == pytest.approx(alone.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-5)
        assert out["logprobs"].shape == (d.model_input.length,)


def test_logprob_outputs_agree_with_compute_logprobs(model):
    out = execution.forward_backward(model, BATCH[:1], "cross_entropy", backward=False)
    tokens = BATCH[0].model_input.to_ints() + [BATCH[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(execution.compute_logprobs(model, tokens)[1:], abs=1e-5)


def test_value_mse_outputs_token_zero_logit(model):
    out = execution.forward_backward(model, value_batch(), "value_mse", backward=False)
    ids = torch.tensor([BATCH[1].model_input.to_ints()])
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0, :, losses.VALUE_TOKEN_ID]
    assert out.loss_fn_outputs[1]["values"].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert "logprobs" not in out.loss_fn_outputs[1], "no target_tokens given, so no logprobs"


def test_custom_loss_sees_per_datum_logprobs_and_matches_builtin(folder, arena_model):
    model, arena = arena_model
    seen = []

    def neg_sum(datums, logprobs):
        seen.extend(lp.shape[0] for lp in logprobs)
        return -sum(lp.sum() for lp in logprobs), {"tokens": sum(seen)}

    custom = execution.forward_backward(model, BATCH, neg_sum)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    builtin = execution.forward_backward(reference, BATCH, "cross_entropy")
    assert seen == [d.model_input.length for d in BATCH]
    assert custom.metrics["tokens"] == sum(seen)
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-6)
    assert torch.allclose(arena, grads(reference), rtol=1e-5, atol=1e-7)


BAD_CUSTOM = {
    "returns a float": lambda datums, lps: (1.0, {}),
    "returns only the loss": lambda datums, lps: lps[0].sum(),
    "loss without gradient": lambda datums, lps: (torch.tensor(1.0), {}),
}


@pytest.mark.parametrize("fn", BAD_CUSTOM.values(), ids=BAD_CUSTOM.keys())
def test_bad_custom_loss_is_reported(model, fn):
    with pytest.raises(errors.InvalidInput, match="custom loss"):
        execution.forward_backward(model, BATCH, fn)


# ---------------------------------------------------------------- validation

BAD_DATUMS = {
    "no datums": ([], errors.InvalidInput, ["at least one"]),
    "empty model_input": ([Datum(ModelInput.from_ints([]), {})], errors.InvalidInput, ["datum 0", "0 tokens"]),
    "too long": ([Datum(ModelInput.from_ints([1] * 65), {})], errors.InvalidInput, ["65 tokens", "64 positions"]),
    "token out of vocab": ([datum([1, 5]), datum([1, 500, 2])], errors.InvalidInput, ["datum 1", "token 500", "< 99"]),
    "short target_tokens": ([Datum(ModelInput.from_ints([1, 5, 6]), {"target_tokens": [5, 6]})],
                            errors.DatumShapeError, ["datum 0", "'target_tokens'", "length 2", "expected", "length 3"]),
    "long weights": ([datum([1, 5, 6], weights=[1.0, 1.0, 1.0])], errors.DatumShapeError,
                     ["'weights'", "length 3", "length 2"]),
    "2-d advantages": ([Datum(ModelInput.from_ints([1, 5]), {"advantages": [[1.0], [1.0]]})],
                       errors.DatumShapeError, ["'advantages'", "shape (2, 1)"]),
    "nan weights": ([datum([1, 5, 6], weights=[1.0, float("nan")])], errors.DatumShapeError, ["NaN"]),
    "fractional target": ([Datum(ModelInput.from_ints([1, 5]), {"target_tokens": [5.0, 6.5]})],
                          errors.DatumShapeError, ["non-integer"]),
    "target out of vocab": ([datum([1, 5, 99])], errors.InvalidInput, ["'target_tokens'", "token 99"]),
}


@pytest.mark.parametrize("datums, error, fragments", BAD_DATUMS.values(), ids=BAD_DATUMS.keys())
def test_bad_datums_are_named(datums, error, fragments):
    with pytest.raises(error) as raised:
        validation.validate_datums(datums, vocab_size=99, max_positions=64)
    assert all(f in str(raised.value) for f in fragments), str(raised.value)


def test_forward_backward_rejects_unknown_loss_and_missing_inputs(arena_model):
    model, arena = arena_model
    with pytest.raises(errors.UnknownLossFunction, match="'dpo'"):
        execution.forward_backward(model, BATCH, "dpo")
    with pytest.raises(errors.DatumShapeError, match="missing \\['logprobs', 'advantages'\\]"):
        execution.forward_backward(model, BATCH, "ppo")
    with pytest.raises(errors.DatumShapeError, match="datum 0: a custom loss needs"):
        execution.forward_backward(model, value_batch(), lambda datums, lps: (lps[0].sum(), {}))
    with pytest.raises(errors.InvalidInput, match="custom loss"):
        execution.forward_backward(model, BATCH, lambda datums, lps: (lps[0].sum(), {}), {"clip": 1.0})
    assert torch.all(arena == 0), "nothing may execute when the input is bad"


# ---------------------------------------------------------------- compute_logprobs and sample

def reference_decode(model, prompt, steps, pick):
    """No KV cache: re-run the whole sequence each step; `pick(logits)` chooses the next token."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            last = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            token = pick(last)
            logprobs.append(torch.log_softmax(last, -1)[token].item())
            tokens.append(token)
    return tokens[len(prompt):], logprobs


def test_compute_logprobs_first_is_none_and_rejects_bad_tokens(model):
    lps = execution.compute_logprobs(model, PROMPT)
    assert lps[0] is None and len(lps) == len(PROMPT) and all(lp < 0 for lp in lps[1:])
    with pytest.raises(errors.InvalidInput, match="token 1000 at position 1"):
        execution.compute_logprobs(model, [1, 1000])


def test_greedy_matches_uncached_argmax_decode(model):
    out = execution.sample(model, PROMPT, 3, SamplingParams(max_tokens=12, temperature=0.0), seed=0)
    tokens, logprobs = reference_decode(model, PROMPT, 12, lambda logits: int(logits.argmax()))
    for seq in out.sequences:
        assert seq.tokens == tokens and seq.stop_reason == "length"
        assert seq.logprobs == pytest.approx(logprobs, abs=1e-5)


def test_top_k_one_is_greedy(model):
    greedy = execution.sample(model, PROMPT, 2, SamplingParams(max_tokens=10, temperature=0.0), seed=0)
    top1 = execution.sample(model, PROMPT, 2, SamplingParams(max_tokens=10, temperature=1.0, top_k=1), seed=5)
    assert [s.tokens for s in top1.sequences] == [s.tokens for s in greedy.sequences]


def test_sample_is_deterministic_under_seed_and_ignores_global_rng(model):
    params = SamplingParams(max_tokens=16, temperature=1.0)
    first = execution.sample(model, PROMPT, 4, params, seed=11)
    rng_before = torch.get_rng_state()
    torch.rand(1000)  # disturbing the global RNG must not matter
    second = execution.sample(model, PROMPT, 4, params, seed=11)
    assert first == second
    assert not torch.equal(rng_before, torch.get_rng_state())
    state = torch.get_rng_state()
    other = execution.sample(model, PROMPT, 4, params, seed=12)
    assert torch.equal(state, torch.get_rng_state()), "sample must not draw from the global RNG"
    assert other.sequences != first.sequences
    assert len({tuple(s.tokens) for s in first.sequences}) > 1, "rows of one call are independent draws"


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_sample_logprobs_are_tempered_model_logprobs(model, temperature):
    out = execution.sample(model, PROMPT, 3, SamplingParams(max_tokens=10, temperature=temperature), seed=4)
    for seq in out.sequences:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + seq.tokens])).logits[0]
        tempered = torch.log_softmax(logits / temperature, -1)
        expected = [tempered[len(PROMPT) - 1 + t, tok].item() for t, tok in enumerate(seq.tokens)]
        assert seq.logprobs == pytest.approx(expected, abs=1e-5)
        if temperature == 1.0:
            assert seq.logprobs == pytest.approx(execution.compute_logprobs(model, PROMPT + seq.tokens)[len(PROMPT):], abs=1e-5)


def test_prompt_logprobs_match_compute_logprobs(model):
    out = execution.sample(model, PROMPT, 1, SamplingParams(max_tokens=2), seed=0, include_prompt_logprobs=True)
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(execution.compute_logprobs(model, PROMPT)[1:], abs=1e-5)


def test_greedy_stops_on_stop_token_and_keeps_it(model):
    greedy = execution.sample(model, PROMPT, 1, SamplingParams(max_tokens=12, temperature=0.0), seed=0).sequences[0]
    stop = greedy.tokens[4]
    first = greedy.tokens.index(stop)
    for params, extra in [(SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)), ()),
                          (SamplingParams(max_tokens=12, temperature=0.0), (stop,))]:
        seq = execution.sample(model, PROMPT, 2, params, seed=0, stop_token_ids=extra).sequences[0]
        assert seq.tokens == greedy.tokens[: first + 1] and seq.stop_reason == "stop"
        assert len(seq.logprobs) == len(seq.tokens)


def test_sampled_rows_stop_at_their_first_stop_token(model):
    stops = (40, 45, 50, 55, 60, 65, 70, 75)  # many stop ids, so most rows stop early
    out = execution.sample(model, PROMPT, 8, SamplingParams(max_tokens=20, stop=stops), seed=3)
    reasons = {s.stop_reason for s in out.sequences}
    assert "stop" in reasons
    for seq in out.sequences:
        assert not set(seq.tokens[:-1]) & set(stops)
        assert (seq.tokens[-1] in stops) == (seq.stop_reason == "stop")
        assert seq.stop_reason == "stop" or len(seq.tokens) == 20


def test_stop_strings_need_decode_and_work_with_tokenizer(model, folder):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    greedy = execution.sample(model, PROMPT, 1, SamplingParams(max_tokens=12, temperature=0.0), seed=0).sequences[0]
    text = tokenizer.decode(greedy.tokens)
    stop_text = text[3:5]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=(stop_text,))
    with pytest.raises(errors.InvalidSamplingParams, match="decode="):
        execution.sample(model, PROMPT, 1, params, seed=0)
    seq = execution.sample(model, PROMPT, 1, params, seed=0, decode=tokenizer.decode).sequences[0]
    end = text.index(stop_text) + len(stop_text)
    assert tokenizer.decode(seq.tokens) == text[:end] and seq.stop_reason == "stop"


BAD_SAMPLES = {
    "prompt plus max_tokens too long": (PROMPT, 1, SamplingParams(max_tokens=60), errors.InvalidInput, "66 positions"),
    "empty prompt": ([], 1, SamplingParams(), errors.InvalidInput, "0 tokens"),
    "zero samples": (PROMPT, 0, SamplingParams(), errors.InvalidInput, "num_samples=0"),
    "bad top_p": (PROMPT, 1, SamplingParams(top_p=0.0), errors.InvalidSamplingParams, "top_p=0.0"),
    "token outside vocab": ([1, 120], 1, SamplingParams(), errors.InvalidInput, "token 120"),
}


@pytest.mark.parametrize("prompt, n, params, error, fragment", BAD_SAMPLES.values(), ids=BAD_SAMPLES.keys())
def test_bad_sample_requests_are_rejected(model, prompt, n, params, error, fragment):
    with pytest.raises(error) as raised:
        execution.sample(model, prompt, n, params, seed=0)
    assert fragment in str(raised.value), str(raised.value)


# ---------------------------------------------------------------- filters vs. plain references

def reference_top_p_keep(probs, top_p):
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        keep.add(i)
        mass += probs[i]
    return keep


FILTER_LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 3.0, 0.1, -2.0]])


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.8, 0.95, 0.999])
def test_top_p_filter_keeps_the_nucleus(top_p):
    filtered = execution.top_p_filter(FILTER_LOGITS, top_p)
    for row, logits in enumerate(FILTER_LOGITS):
        keep = reference_top_p_keep(torch.softmax(logits, -1).tolist(), top_p)
        assert {i for i, v in enumerate(filtered[row].tolist()) if v != float("-inf")} == keep


@pytest.mark.parametrize("top_k", [1, 2, 4, 5, 50])
def test_top_k_filter_keeps_k_largest(top_k):
    filtered = execution.top_k_filter(FILTER_LOGITS, top_k)
    for row, logits in enumerate(FILTER_LOGITS):
        largest = set(torch.argsort(logits, descending=True)[:top_k].tolist())
        assert {i for i, v in enumerate(filtered[row].tolist()) if v != float("-inf")} == largest


def test_sampling_with_small_top_p_stays_in_nucleus(model):
    out = execution.sample(model, PROMPT, 6, SamplingParams(max_tokens=1, top_p=0.05), seed=1)
    with torch.no_grad():
        last = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    nucleus = reference_top_p_keep(torch.softmax(last, -1).tolist(), 0.05)
    assert {s.tokens[0] for s in out.sequences} <= nucleus

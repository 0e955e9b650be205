"""Issue 13, defect 9: types are checked at the edge. A call with an argument of the wrong type
(or a non-finite number) fails through its future, like any other input error, with an
`errors.InvalidInput` naming the parameter, its value and what was expected; the client method
itself never raises, and nothing reaches the cluster. A bool is not a number; numpy scalars are.

Every case of `BAD_CALLS` runs twice: on the hand-written `FakeCluster` of test_api_pure.py
(nothing is submitted, no checkpoint path is asked for) and on a real `LocalCluster` (the job's
weights are unchanged, and its next good calls train exactly as a job that made no bad calls).
`ModelInput.from_ints` is a constructor the caller runs before any call, so it raises at once.
"""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.api import errors, validation
from plexrl.api.client import ServiceClient
from plexrl.api.types import AdamParams, Datum, EncodedTextChunk, ModelInput, SamplingParams, TensorData
from test_api_pure import FakeCluster, custom_loss, policy_datum

ints = ModelInput.from_ints
INF, NAN = float("inf"), float("nan")


def sample_with(**params):
    return lambda t, s: s.sample(ints([1, 2]), 1, SamplingParams(**params))


def adam_with(**params):
    return lambda t, s: t.optim_step(AdamParams(**params))


def fb_with(datum, loss_fn="ppo", config=None):
    return lambda t, s: t.forward_backward([datum], loss_fn, config)


def policy_inputs(**replaced):
    """The loss_fn_inputs of policy_datum() over 3 tokens, with some replaced."""
    return {"target_tokens": [5, 6, 3], "logprobs": [-1.0] * 3, "advantages": [0.5] * 3, **replaced}


def hand_made_input(*tokens):
    return ModelInput((EncodedTextChunk(tokens),))


# name: (call on (trainer, sampler), error type, fragments its message must hold)
BAD_CALLS = {
    # sampling
    "temperature a string": (sample_with(temperature="hot"), errors.InvalidSamplingParams,
                             ["temperature='hot'", "expected a finite number"]),
    "max_tokens 0.5": (sample_with(max_tokens=0.5), errors.InvalidSamplingParams, ["max_tokens=0.5", "integer"]),
    "max_tokens True": (sample_with(max_tokens=True), errors.InvalidSamplingParams, ["max_tokens=True (a bool)"]),
    "top_k True": (sample_with(top_k=True), errors.InvalidSamplingParams, ["top_k=True (a bool)", "integer"]),
    "seed -1": (sample_with(seed=-1), errors.InvalidSamplingParams, ["seed=-1", "0 <= seed"]),
    "seed 1.5": (sample_with(seed=1.5), errors.InvalidSamplingParams, ["seed=1.5", "integer"]),
    "stop a number": (sample_with(stop=5), errors.InvalidSamplingParams, ["stop=5", "token ids"]),
    "stop with an empty string": (sample_with(stop=["a", ""]), errors.InvalidSamplingParams, ["stop=['a', '']"]),
    "sampling_params a dict": (lambda t, s: s.sample(ints([1]), 1, {"max_tokens": 4}), errors.InvalidSamplingParams,
                               ["sampling_params={'max_tokens': 4} (a dict)", "expected a SamplingParams"]),
    "num_samples a string": (lambda t, s: s.sample(ints([1]), "3"), errors.InvalidInput,
                             ["num_samples='3'", "integer >= 1"]),
    "num_samples True": (lambda t, s: s.sample(ints([1]), True), errors.InvalidInput, ["num_samples=True (a bool)"]),
    "num_samples 2.0": (lambda t, s: s.sample(ints([1]), 2.0), errors.InvalidInput, ["num_samples=2.0"]),
    "prompt a list": (lambda t, s: s.sample([1, 2]), errors.InvalidInput,
                      ["sample prompt=[1, 2] (a list)", "expected a ModelInput"]),
    "include_prompt_logprobs a string": (lambda t, s: s.sample(ints([1]), 1, None, "yes"), errors.InvalidInput,
                                         ["include_prompt_logprobs='yes'", "True or False"]),
    "compute_logprobs of a list": (lambda t, s: s.compute_logprobs([1, 2]), errors.InvalidInput,
                                   ["compute_logprobs prompt=[1, 2] (a list)", "ModelInput"]),
    "prompt token 5.9 in a hand-made chunk": (lambda t, s: s.compute_logprobs(hand_made_input(1, 5.9)),
                                              errors.InvalidInput, ["token 5.9 at position 1", "not an integer"]),
    "prompt chunk not a chunk": (lambda t, s: s.sample(ModelInput(([1, 2],))), errors.InvalidInput,
                                 ["sample prompt: chunks=", "EncodedTextChunk"]),
    # optimizer
    "learning_rate a string": (adam_with(learning_rate="1e-3"), errors.InvalidAdamParams,
                               ["learning_rate='1e-3'", "expected a finite number >= 0"]),
    "beta2 True": (adam_with(beta2=True), errors.InvalidAdamParams, ["beta2=True (a bool)"]),
    "adam_params a dict": (lambda t, s: t.optim_step({"learning_rate": 1e-3}), errors.InvalidAdamParams,
                           ["adam_params={'learning_rate': 0.001} (a dict)", "expected an AdamParams"]),
    # losses
    "loss_fn a list": (fb_with(policy_datum(), ["ppo"]), errors.UnknownLossFunction,
                       ["loss_fn ['ppo'] (a list)", "expected one of"]),
    "loss_fn None": (fb_with(policy_datum(), None), errors.UnknownLossFunction, ["loss_fn None", "callable"]),
    "loss_fn_config a string": (fb_with(policy_datum(), "ppo", "abc"), errors.InvalidInput,
                                ["loss_fn_config='abc'", "expected a dict"]),
    "loss_fn_config value a string": (fb_with(policy_datum(), "ppo", {"clip_low_threshold": "x"}), errors.InvalidInput,
                                      ["loss_fn_config['clip_low_threshold']='x'", "finite number"]),
    "loss_fn_config value nan": (fb_with(policy_datum(), "ppo", {"clip_high_threshold": NAN}), errors.InvalidInput,
                                 ["loss_fn_config['clip_high_threshold']=nan", "finite number"]),
    "loss_fn_config key an int": (fb_with(policy_datum(), "ppo", {1: 0.5, "clip_low_threshold": 0.5}),
                                  errors.InvalidInput, ["loss_fn_config key 1", "expected a str"]),
    "custom loss with loss_fn_config a string": (lambda t, s: t.forward([policy_datum()], custom_loss, "abc"),
                                                 errors.InvalidInput, ["loss_fn_config='abc'", "custom loss"]),
    # data
    "model_input a list": (fb_with(Datum([5, 6, 7], policy_inputs())), errors.DatumShapeError,
                           ["datum 0: model_input=[5, 6, 7] (a list)", "expected a ModelInput"]),
    "datum token 5.9 in a hand-made chunk": (fb_with(Datum(hand_made_input(1, 5.9, 6), policy_inputs())),
                                             errors.InvalidInput, ["datum 0: model_input", "token 5.9 at position 1"]),
    "data one Datum, not a list": (lambda t, s: t.forward_backward(policy_datum()), errors.DatumShapeError,
                                   ["data=", "(a Datum)", "expected a list of Datum"]),
    "data an int": (lambda t, s: t.forward_backward(5), errors.DatumShapeError, ["data=5", "list of Datum"]),
    "data item a string": (lambda t, s: t.forward_backward([policy_datum(), "x"]), errors.DatumShapeError,
                           ["data[1]='x'", "expected a Datum"]),
    "advantages a string": (fb_with(Datum(ints([1, 5, 6]), policy_inputs(advantages="abc"))), errors.DatumShapeError,
                            ["datum 0: loss_fn_inputs['advantages']='abc'", "expected numbers"]),
    "advantages None": (fb_with(Datum(ints([1, 5, 6]), policy_inputs(advantages=None))), errors.DatumShapeError,
                        ["loss_fn_inputs['advantages']=None", "expected numbers"]),
    "advantages ragged": (fb_with(Datum(ints([1, 5, 6]), policy_inputs(advantages=[[0.5], [0.5, 0.5], [0.5]]))),
                          errors.DatumShapeError, ["loss_fn_inputs['advantages']=[[0.5], [0.5, 0.5], [0.5]] (a list)"]),
    "advantages complex": (fb_with(Datum(ints([1, 5, 6]), policy_inputs(advantages=np.ones(3) * 1j))),
                           errors.DatumShapeError, ["loss_fn_inputs['advantages']=", "expected numbers"]),
    "loss_fn_inputs a list": (fb_with(Datum(ints([1, 5, 6]), [5, 6, 3])), errors.DatumShapeError,
                              ["datum 0: loss_fn_inputs=[5, 6, 3] (a list)", "expected a dict"]),
    "loss_fn_inputs key an int": (fb_with(Datum(ints([1, 5, 6]), {0: [5, 6, 3]}), "cross_entropy"),
                                  errors.DatumShapeError, ["datum 0: loss_fn_inputs key 0", "expected a str"]),
    "int64 TensorData of 6.5": (fb_with(Datum(ints([1, 5, 6]), {"target_tokens": TensorData((6.5, 6.0, 3.0), "int64")}),
                                        "cross_entropy"),
                                errors.DatumShapeError, ["loss_fn_inputs['target_tokens']", "'int64'", "non-integer"]),
    "TensorData that does not fit its shape": (
        fb_with(Datum(ints([1, 5, 6]), {"target_tokens": TensorData((5, 6, 3), "int64", (2,))}), "cross_entropy"),
        errors.DatumShapeError, ["loss_fn_inputs['target_tokens']", "3 values do not fit shape (2,)"]),
    # checkpoints and samplers
    "save_state 5": (lambda t, s: t.save_state(5), errors.InvalidInput, ["checkpoint name 5", "plain non-empty name"]),
    "save_state ''": (lambda t, s: t.save_state(""), errors.InvalidInput, ["checkpoint name ''"]),
    "save_state 'a/b'": (lambda t, s: t.save_state("a/b"), errors.InvalidInput, ["checkpoint name 'a/b'", "'/'"]),
    "save_state '..'": (lambda t, s: t.save_state(".."), errors.InvalidInput, ["checkpoint name '..'"]),
    "save_state '.'": (lambda t, s: t.save_state("."), errors.InvalidInput, ["checkpoint name '.'"]),
    "save_state with_optimizer a string": (lambda t, s: t.save_state("ok", "yes"), errors.InvalidInput,
                                           ["with_optimizer='yes'"]),
    "sampler name 5": (lambda t, s: t.save_weights_for_sampler(5), errors.InvalidInput, ["sampler name 5"]),
    "load_state path 5": (lambda t, s: t.load_state(5), errors.InvalidInput, ["checkpoint path=5", "save_state folder"]),
    "load_state path ''": (lambda t, s: t.load_state(""), errors.InvalidInput, ["checkpoint path=''"]),
}
# Defect 6 at the edge: every float field, infinite or NaN, is refused before it reaches the weights.
for _field in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
    for _bad in (INF, NAN, -INF):
        BAD_CALLS[f"{_field} {_bad}"] = (adam_with(**{_field: _bad}), errors.InvalidAdamParams, [f"{_field}={_bad!r}"])
for _field in ("temperature", "top_p"):
    for _bad in (INF, NAN):
        BAD_CALLS[f"{_field} {_bad}"] = (sample_with(**{_field: _bad}), errors.InvalidSamplingParams,
                                         [f"{_field}={_bad!r}"])

# name: (tokens given to ModelInput.from_ints, fragment of the InvalidInput raised at once)
BAD_TOKENS = {
    "5.9 truncates nothing": ([5.9, 6.2], "tokens[0]=5.9"),
    "an integral float": ([5, 6.0], "tokens[1]=6.0"),
    "a bool": ([5, True], "tokens[1]=True (a bool)"),
    "a numpy float": ([5, np.float32(6)], "tokens[1]=np.float32(6.0)"),
    "a string": ("abc", "tokens='abc'"),
    "a number": (5, "tokens=5"),
    "None": ([5, None], "tokens[1]=None"),
}


class Mismatch(AssertionError):
    pass


def expect_failed(future, error, fragments) -> None:
    """The future failed, at once, with `error` and a message holding every fragment."""
    if not future.done():
        raise Mismatch("the future is not done: the call was submitted")
    exc = future.exception()
    if not isinstance(exc, error) or not all(f in str(exc) for f in fragments):
        raise Mismatch(f"{type(exc).__name__}: {exc}")


def fake_clients():
    cluster = FakeCluster()
    service = ServiceClient(cluster, "job")
    return cluster, service.create_training_client("/models/tiny"), service.create_sampling_client("/models/tiny")


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_type_fails_through_its_future_and_reaches_no_cluster(name):
    call, error, fragments = BAD_CALLS[name]
    cluster, trainer, sampler = fake_clients()
    expect_failed(call(trainer, sampler), error, fragments)
    assert cluster.submitted == [] and cluster.paths_asked == [], name


@pytest.mark.parametrize("name", BAD_TOKENS)
def test_from_ints_refuses_what_is_not_an_integer(name):
    tokens, fragment = BAD_TOKENS[name]
    with pytest.raises(errors.InvalidInput) as info:
        ModelInput.from_ints(tokens)
    assert "ModelInput.from_ints" in str(info.value) and fragment in str(info.value), str(info.value)


def test_from_ints_takes_numpy_integers_as_python_ints():
    tokens = ModelInput.from_ints(np.array([5, 6], dtype=np.int32)).append_int(np.int64(7)).to_ints()
    assert tokens == [5, 6, 7] and all(type(t) is int for t in tokens)
    with pytest.raises(errors.InvalidInput, match=r"append_int: tokens\[0\]=5.5"):
        ModelInput.from_ints([5]).append_int(5.5)


def test_numpy_scalars_are_numbers_and_reach_the_cluster_as_python_ones():
    cluster, trainer, sampler = fake_clients()
    params = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4), seed=np.uint8(7),
                            stop="ab")
    for future in (sampler.sample(ints([1, 2]), np.int64(2), params, np.True_),
                   trainer.optim_step(AdamParams(learning_rate=np.float32(0.25), weight_decay=np.float64(0.5)))):
        assert future.exception() is None, future.exception()
    (_, _, sampled), (_, _, stepped) = cluster.submitted
    assert sampled["params"] == SamplingParams(3, 0.5, 4, 1.0, 7, ("ab",)) and sampled["seed"] == 7
    assert type(sampled["num_samples"]) is int and type(sampled["params"].max_tokens) is int
    assert stepped["params"] == AdamParams(learning_rate=0.25, weight_decay=0.5)
    assert all(type(getattr(stepped["params"], f)) is float for f in ("learning_rate", "weight_decay", "beta1"))


def test_a_bad_call_does_not_shift_the_seeds_of_the_good_ones():
    """Default seeds follow the client's call count; a refused call is not a call."""
    clean_cluster, _, clean_sampler = fake_clients()
    noisy_cluster, _, noisy_sampler = fake_clients()
    params = SamplingParams(max_tokens=4)
    noisy_sampler.sample(ints([1]), "3", params)
    noisy_sampler.sample(ints([1]), 1, params)
    clean_sampler.sample(ints([1]), 1, params)
    [(_, _, noisy)], [(_, _, clean)] = noisy_cluster.submitted, clean_cluster.submitted
    assert noisy["seed"] == clean["seed"]


def test_a_client_of_a_seed_that_is_not_an_integer_is_refused_at_once():
    service = ServiceClient(FakeCluster(), "job")
    for seed in ("1", 1.5, True):
        with pytest.raises(errors.InvalidInput, match="seed="):
            service.create_training_client("/models/tiny", seed=seed)


def test_bad_calls_on_a_local_cluster_fail_through_their_futures_and_change_nothing(tiny_model):
    import plexrl

    good = policy_datum()
    with plexrl.LocalCluster(devices=1) as cluster:
        service = cluster.service_client("edge")
        trainer = service.create_training_client(base_model=tiny_model)
        sampler = service.create_sampling_client(base_model=tiny_model, name="ref")
        before = cluster.fetch_weights(trainer.state)
        mismatches = {}
        for name, (call, error, fragments) in BAD_CALLS.items():
            try:
                expect_failed(call(trainer, sampler), error, fragments)
            except Mismatch as exc:
                mismatches[name] = str(exc)
        assert mismatches == {}
        np.testing.assert_array_equal(cluster.fetch_weights(trainer.state), before)
        # the job's next good calls work, and train exactly as those of a job that made no bad calls
        clean = cluster.service_client("clean").create_training_client(base_model=tiny_model)
        for client in (trainer, clean):
            client.forward_backward([good], "ppo").result(timeout=60)
            client.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
        after = cluster.fetch_weights(trainer.state)
        np.testing.assert_array_equal(after, cluster.fetch_weights(clean.state))
        assert not np.array_equal(after, before)
        assert len(sampler.sample(ints([1, 2]), 2, SamplingParams(max_tokens=3)).result(timeout=60).sequences) == 2


def test_from_ints_refuses_a_bool_array_and_takes_an_int_array_unchanged():
    with pytest.raises(errors.InvalidInput, match=r"tokens\[0\]=np.True_"):
        ModelInput.from_ints(np.array([True, False]))
    big = np.array([0, 2**40, 7], dtype=np.uint64)
    assert ModelInput.from_ints(big).to_ints() == [0, 2**40, 7]


@pytest.mark.parametrize("tokens, fragment", [
    ((5, True, 6), "token True (a bool) at position 1 is not an integer"),
    ((5, 6.0), "token 6.0 at position 1 is not an integer"),
    ((5, np.int64(99), 3, -1), "token 99 at position 1 is outside the vocabulary (expected 0 <= token < 10; 2 bad"),
    ([4, 3, 10], "token 10 at position 2 is outside the vocabulary (expected 0 <= token < 10; 1 bad"),
])
def test_check_tokens_names_the_first_bad_token_whatever_the_types_around_it(tokens, fragment):
    with pytest.raises(errors.InvalidInput) as info:
        validation.check_tokens(tokens, 10, "what")
    assert fragment in str(info.value), str(info.value)


def test_check_tokens_takes_python_and_numpy_integers_mixed():
    validation.check_tokens((0, np.int32(9), np.uint8(3), 4), 10, "what")
    validation.check_tokens((), 10, "what")


def test_a_target_token_outside_the_vocabulary_is_named_with_its_position():
    datum = Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 12, -1]})
    with pytest.raises(errors.InvalidInput, match=r"target_tokens'\]: token 12 at position 1 is outside the vocabulary "
                                                  r"\(expected 0 <= token < 10; 2 bad"):
        validation.validate_datums([datum], vocab_size=10, max_positions=8)
    validation.validate_datums([Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 9, 0]})], 10, 8)

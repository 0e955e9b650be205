"""plexrl/serve/bodies.py: the JSON bodies decoded at the edge. A decoder refuses what the body
alone decides, with the message a caller sees, and carries as given what a numbered model call
checks in its turn (a call refused at the edge would leave a gap its model waits out)."""

import pytest

from plexrl.api import errors
from plexrl.serve import bodies
from plexrl.serve.refusals import BadRequest

MOST = 16 << 10


@pytest.mark.parametrize("decode, body, refusal, message", [
    (lambda b: bodies.CreateModel.decode(b, MOST), {"model_seq_id": -1}, BadRequest,
     "model_seq_id=-1; expected an integer >= 0"),
    (lambda b: bodies.CreateModel.decode(b, MOST), {"model_seq_id": 0, "optimizer_config": {"type": "sgd"}},
     BadRequest, "PlexRL trains with 'adamw' only"),
    (lambda b: bodies.CreateModel.decode(b, MOST), {"model_seq_id": 0, "lora_config": {"rank": -2}},
     errors.InvalidInput, "lora_config.rank=-2"),
    (lambda b: bodies.CreateSession.decode(b, 10), {"user_metadata": {"k": "v" * 20}}, errors.InvalidInput,
     "expected at most 10"),
    (lambda b: bodies.CreateSession.decode(b, MOST), {"user_metadata": [1]}, BadRequest, "expected an object of strings"),
    (bodies.SaveForSampler.decode, {"model_id": "m"}, BadRequest, "needs 'path'"),
    (lambda b: bodies.Sample.decode(b, 1 << 16), {}, BadRequest, "needs 'sampling_session_id'"),
    (lambda b: bodies.Sample.decode(b, 1 << 16), {"sampling_session_id": "s", "topk_sample_logprobs": 3},
     errors.InvalidInput, "does not compute top-k"),
])
def test_a_body_is_refused_with_the_message_callers_see(decode, body, refusal, message):
    with pytest.raises(refusal, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode(body)


def test_what_a_model_call_checks_in_its_turn_passes_the_edge_as_given():
    saved = bodies.SaveWeights.decode({"model_id": "m", "seq_id": 3, "path": "../x", "user_metadata": [1]})
    assert (saved.name, saved.user_metadata, saved.seq_id) == ("../x", [1], 3)
    assert bodies.SaveWeights.decode({"seq_id": 7}).name == "000007"
    assert bodies.OptimStep.decode({"model_id": "m", "optim_params": {"lr": "x"}}).adam_params == {"lr": "x"}
    assert bodies.SaveForSampler.decode({"model_id": "m", "path": ""}).named.name == ""  # a path, if empty

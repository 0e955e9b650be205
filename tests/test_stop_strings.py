"""Stop strings through a cluster: the worker matches them against the model folder's tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import plexrl
from plexrl.engines.local import LocalCluster


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(devices=1) as c:
        yield c


def test_sampling_stops_at_a_stop_string_and_keeps_it(cluster, tiny_model):
    sampler = cluster.service_client(job="stops").create_sampling_client(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = plexrl.ModelInput.from_ints(tokenizer.encode("1+2="))
    greedy = sampler.sample(prompt, 1, plexrl.SamplingParams(max_tokens=12, temperature=0.0)).result(60).sequences[0]
    text = tokenizer.decode(greedy.tokens)
    stop = text[3:5]  # two characters the greedy continuation passes through
    first = text.index(stop) + len(stop)  # where the text first ends with the stop string
    cut = sampler.sample(prompt, 1, plexrl.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop, "never"]))
    seq = cut.result(60).sequences[0]
    assert seq.stop_reason == "stop"
    assert tokenizer.decode(seq.tokens) == text[:first]
    assert seq.tokens == greedy.tokens[: len(seq.tokens)]


def test_a_lone_stop_string_is_one_stop_string(cluster, tiny_model):
    sampler = cluster.service_client(job="lone").create_sampling_client(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = plexrl.ModelInput.from_ints(tokenizer.encode("ab"))
    greedy = sampler.sample(prompt, 1, plexrl.SamplingParams(max_tokens=8, temperature=0.0)).result(60).sequences[0]
    stop = tokenizer.decode(greedy.tokens)[1]
    seq = sampler.sample(prompt, 1, plexrl.SamplingParams(max_tokens=8, temperature=0.0, stop=stop)).result(60)
    assert tokenizer.decode(seq.sequences[0].tokens).endswith(stop)
    assert seq.sequences[0].stop_reason == "stop"

"""Payloads are typed at the front's `submit` (runtime/payloads.py): every function of the table
names its payload type, a client's dict is decoded into it once, and a key too many or missing
fails with InvalidInput naming the function, the key and the expected fields."""

from __future__ import annotations

import dataclasses

import pytest

from plexrl.api import errors
from plexrl.api.types import SamplingParams
from plexrl.runtime import functions
from plexrl.runtime.payloads import CheckpointPayload, NoPayload, SamplePayload, SyncPayload

SAMPLE = {"tokens": [1, 2], "num_samples": 2, "params": SamplingParams(max_tokens=3), "seed": 7, "stop_ids": (),
          "include_prompt_logprobs": False}

# name: (function, payload as a client gives it, the typed payload it becomes)
GOOD = {
    "sample": ("sample", SAMPLE, SamplePayload(**SAMPLE)),
    "noop without a payload": ("noop", None, NoPayload()),
    "read_weights with an empty dict": ("read_weights", {}, NoPayload()),
    "sync_weights: sampler defaults to hf": ("sync_weights", {"name": "s"}, SyncPayload("s", "hf")),
    "save_state": ("save_state", {"path": "/c", "with_optimizer": True}, CheckpointPayload("/c", True)),
    "already typed": ("load_state", CheckpointPayload("/c", False), CheckpointPayload("/c", False)),
}

# name: (function, payload, fragments the error must hold)
BAD = {
    "a key too many": ("save_state", {"path": "/c", "with_optimizer": True, "force": 1},
                       ["save_state", "'force'", "['path', 'with_optimizer']"]),
    "a key missing": ("sample", {k: v for k, v in SAMPLE.items() if k != "seed"},
                      ["sample", "'seed'", "'include_prompt_logprobs'"]),
    "not a dict": ("compute_logprobs", [1, 2], ["compute_logprobs", "list", "['tokens']"]),
    "an unknown function": ("train", {}, ["'train'", "not served"]),
}


def test_every_function_names_a_payload_dataclass():
    for fn, function in functions.FUNCTIONS.items():
        assert dataclasses.is_dataclass(function.payload), fn


@pytest.mark.parametrize("name", GOOD)
def test_a_good_payload_decodes_into_its_type(name):
    fn, given, expected = GOOD[name]
    assert functions.decode(fn, given) == expected


@pytest.mark.parametrize("name", BAD)
def test_a_bad_payload_names_the_function_the_key_and_the_fields(name):
    fn, given, fragments = BAD[name]
    with pytest.raises(errors.InvalidInput) as raised:
        functions.decode(fn, given)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_sample_positions_count_every_sequence_prompt_and_completion():
    assert SamplePayload(**SAMPLE).positions() == 2 * (2 + 3)

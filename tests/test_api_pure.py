"""docs/design.md §8: the job side (plexrl/api) imports neither torch, ray nor transformers, and its
clients stand on any `Cluster`.

The clients run here on `FakeCluster`, a hand-written `Cluster` that executes nothing: bad input
must fail through the call's future without reaching `submit`; good input must reach `submit` as
(function name, payload). `test_api_runs_with_heavy_libraries_unimportable` runs every case of
this file (and the fake-cluster cases of test_api_edge_types.py) again in a process where
torch, ray and transformers cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plexrl.api import errors
from plexrl.api.client import SamplingClient, ServiceClient
from plexrl.api.cluster import Cluster, StateHandle
from plexrl.api.futures import APIFuture
from plexrl.api.types import AdamParams, Datum, ModelInput, SamplingParams

BLOCKED = ("torch", "ray", "transformers", "safetensors", "tokenizers")
VOCAB, POSITIONS = 32, 16


class FakeCluster:
    """Records every call; `submit` answers at once with a completed future (a sync with a
    snapshot handle, everything else with None)."""

    def __init__(self):
        self.submitted: list[tuple[str, str, dict]] = []
        self.paths_asked: list[object] = []  # checkpoint names the client asked a path for
        self.steps: list[tuple[str, int, dict]] = []
        self.finished: list[str] = []

    def add_model(self, job, name, base_model, trainable, slack=0.10, admission_timeout=None, owner=None) -> StateHandle:
        return StateHandle(f"{job}/{name}", job, name, str(base_model), trainable, 1 << 20, 1 << 20)

    def submit(self, state, fn, payload) -> APIFuture:
        self.submitted.append((state.state_id, fn, payload))
        if fn == "sync_weights":
            return APIFuture.completed(StateHandle(f"{state.state_id}@{payload['name']}.v1", state.job,
                                                   f"{state.name}@{payload['name']}", state.source, False, 0, 0))
        return APIFuture.completed(None)

    def latest_sampler(self, trainer_id, name):
        return None

    def limits(self, state):
        return VOCAB, POSITIONS

    def stop_token_ids(self, state):
        return (2,)

    def checkpoint_path(self, state, name):
        self.paths_asked.append(name)
        return Path("/nonexistent/checkpoints") / state.job / name

    def report_step(self, job, step, **fields):
        self.steps.append((job, step, fields))

    def finish_job(self, job, owner=None):
        self.finished.append(job)


def clients():
    cluster = FakeCluster()
    service = ServiceClient(cluster, "job")
    return cluster, service.create_training_client("/models/tiny"), service.create_sampling_client("/models/tiny")


def policy_datum(tokens=(1, 5, 6), without=()) -> Datum:
    """A datum with every input a policy loss reads, less those named in `without`."""
    inputs = {"target_tokens": list(tokens[1:]) + [3], "logprobs": [-1.0] * len(tokens),
              "advantages": [0.5] * len(tokens)}
    return Datum(ModelInput.from_ints(tokens), {k: v for k, v in inputs.items() if k not in without})


ints = ModelInput.from_ints


def custom_loss(datums, logprobs):
    return sum(lp.sum() for lp in logprobs), {}


# name: (call on (trainer, sampler), error type, fragments its message must hold)
BAD_CALLS = {
    "sample token out of range": (lambda t, s: s.sample(ints([1, 40])),
                                  errors.InvalidInput, ["sample prompt", "token 40", "< 32"]),
    "sample past max positions": (lambda t, s: s.sample(ints([1] * 10), 1, SamplingParams(max_tokens=10)),
                                  errors.InvalidInput, ["max_tokens=10", "20 positions", "16"]),
    "bad sampling params": (lambda t, s: s.sample(ints([1]), 1, SamplingParams(top_p=0.0)),
                            errors.InvalidSamplingParams, ["top_p=0.0"]),
    "zero samples": (lambda t, s: s.sample(ints([1]), 0), errors.InvalidInput, ["num_samples=0"]),
    "logprobs of nothing": (lambda t, s: s.compute_logprobs(ModelInput.empty()),
                            errors.InvalidInput, ["compute_logprobs sequence", "0 tokens"]),
    "logprobs token out of range": (lambda t, s: s.compute_logprobs(ints([1, -3])),
                                    errors.InvalidInput, ["token -3 at position 1"]),
    "unknown loss": (lambda t, s: t.forward_backward([policy_datum()], "dpo"),
                     errors.UnknownLossFunction, ["'dpo'", "'ppo'", "callable"]),
    "missing advantages": (lambda t, s: t.forward_backward([policy_datum(), policy_datum(without=["advantages"])],
                                                           "ppo"),
                           errors.DatumShapeError, ["datum 1", "'ppo'", "missing ['advantages']"]),
    "unknown config key": (lambda t, s: t.forward_backward([policy_datum()], "ppo", {"clip_epsilon": 0.2}),
                           errors.InvalidInput, ["unknown keys ['clip_epsilon']", "clip_high_threshold"]),
    "short target_tokens": (lambda t, s: t.forward([Datum(ints([1, 5, 6]), {"target_tokens": [5, 6]})]),
                            errors.DatumShapeError, ["datum 0", "'target_tokens'", "length 2", "length 3"]),
    "target out of range": (lambda t, s: t.forward_backward([Datum(ints([1, 5]), {"target_tokens": [5, 32]})]),
                            errors.InvalidInput, ["'target_tokens'", "token 32"]),
    "no datums": (lambda t, s: t.forward_backward([]), errors.DatumShapeError, ["no datums", "at least one"]),
    "config with a custom loss": (lambda t, s: t.forward([policy_datum()], custom_loss, {"beta": 0.1}),
                                  errors.InvalidInput, ["custom loss", "expected none"]),
    "custom loss without targets": (lambda t, s: t.forward_backward_custom([policy_datum(without=["target_tokens"])],
                                                                           custom_loss),
                                    errors.DatumShapeError, ["datum 0", "target_tokens"]),
    "bad Adam params": (lambda t, s: t.optim_step(AdamParams(learning_rate=-1.0)),
                        errors.InvalidAdamParams, ["learning_rate=-1.0"]),
    "missing checkpoint": (lambda t, s: t.load_state("/nonexistent/ckpt"), errors.ModelLoadError, ["does not exist"]),
}

# name: (call on (trainer, sampler), the function submitted, its payload's keys)
GOOD_CALLS = {
    "sample": (lambda t, s: s.sample(ints([1, 2, 3]), 2, SamplingParams(max_tokens=4, seed=7)),
               "sample", {"tokens", "num_samples", "params", "seed", "stop_ids", "include_prompt_logprobs"}),
    "compute_logprobs": (lambda t, s: s.compute_logprobs(ints([1, 2, 3])), "compute_logprobs", {"tokens"}),
    "forward_backward ppo": (lambda t, s: t.forward_backward([policy_datum()], "ppo", {"clip_high_threshold": 1.5}),
                             "forward_backward", {"data", "loss_fn", "loss_fn_config", "backward"}),
    "forward value_mse": (lambda t, s: t.forward([Datum(ints([1, 2]), {"target_values": np.zeros(2)})],
                                                 "value_mse"),
                          "forward", {"data", "loss_fn", "loss_fn_config", "backward"}),
    "forward_backward_custom": (lambda t, s: t.forward_backward_custom([policy_datum()], custom_loss),
                                "forward_backward", {"data", "loss_fn", "loss_fn_config", "backward"}),
    "optim_step": (lambda t, s: t.optim_step(AdamParams(learning_rate=1e-3)), "optim_step", {"params"}),
    "save_state": (lambda t, s: t.save_state("step-3"), "save_state", {"path", "with_optimizer"}),
    "save_weights_for_sampler": (lambda t, s: t.save_weights_for_sampler("rollout"), "sync_weights", {"name"}),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_fails_through_its_future_and_submits_nothing(name):
    call, error, fragments = BAD_CALLS[name]
    cluster, trainer, sampler = clients()
    future = call(trainer, sampler)
    assert future.done() and isinstance(future.exception(), error), (name, future.exception())
    message = str(future.exception())
    assert all(f in message for f in fragments), (name, message)
    assert cluster.submitted == [], name


@pytest.mark.parametrize("name", GOOD_CALLS)
def test_good_input_reaches_submit_as_function_and_payload(name):
    call, fn, keys = GOOD_CALLS[name]
    cluster, trainer, sampler = clients()
    future = call(trainer, sampler)
    assert future.done() and future.exception() is None, (name, future.exception())
    [(state_id, submitted_fn, payload)] = cluster.submitted
    assert submitted_fn == fn and set(payload) == keys, (name, submitted_fn, sorted(payload))
    assert state_id == (sampler if fn in ("sample", "compute_logprobs") else trainer).model_id


def test_sample_payload_carries_prompt_seed_and_stop_ids():
    cluster, trainer, sampler = clients()
    sampler.sample(ModelInput.from_ints([1, 2, 3]), 2, SamplingParams(max_tokens=4, seed=7))
    payload = cluster.submitted[0][2]
    assert (payload["tokens"], payload["num_samples"], payload["seed"], payload["stop_ids"]) == ([1, 2, 3], 2, 7, (2,))


def test_service_client_marks_steps_and_finishes_the_job():
    cluster = FakeCluster()
    with ServiceClient(cluster, "job") as service:
        service.report_step(3, reward=0.5)
    assert cluster.steps == [("job", 3, {"reward": 0.5})] and cluster.finished == ["job"]


def test_a_sync_gives_a_sampling_client_of_the_snapshot():
    cluster, trainer, _ = clients()
    sampler = trainer.save_weights_and_get_sampling_client("rollout")
    assert isinstance(sampler, SamplingClient) and sampler.model_id == "job/policy@rollout.v1"
    assert isinstance(cluster, Cluster)


def run_every_case() -> int:
    """Every test of this file, and the fake-cluster cases of test_api_edge_types.py, without
    pytest (for the subprocess below)."""
    import test_api_edge_types as edge

    for name in edge.BAD_CALLS:
        edge.test_bad_type_fails_through_its_future_and_reaches_no_cluster(name)
    edge.test_numpy_scalars_are_numbers_and_reach_the_cluster_as_python_ones()
    for name in BAD_CALLS:
        test_bad_input_fails_through_its_future_and_submits_nothing(name)
    for name in GOOD_CALLS:
        test_good_input_reaches_submit_as_function_and_payload(name)
    test_sample_payload_carries_prompt_seed_and_stop_ids()
    test_service_client_marks_steps_and_finishes_the_job()
    test_a_sync_gives_a_sampling_client_of_the_snapshot()
    return len(BAD_CALLS) + len(GOOD_CALLS) + 3 + len(edge.BAD_CALLS) + 1


def test_api_runs_with_heavy_libraries_unimportable():
    from tests.helpers import run_with_blocked_imports  # here: the blocked process imports this module too

    body = f"""
try:
    import torch
    raise SystemExit('the blocker let torch in')
except ImportError:
    pass
import plexrl.api, plexrl.api.client, plexrl.api.validation, plexrl.api.cluster, plexrl.types, plexrl.errors
import plexrl.client
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_api_pure
ran = test_api_pure.run_every_case()
print('ok', ran)
"""
    result = run_with_blocked_imports(BLOCKED, body, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")

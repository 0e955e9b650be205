"""Algorithm loops on a real (tiny, random) model: rollout alignment, losses vs numpy, determinism.

Uses a 1-layer, 32-wide char model so every test runs in about a second on 2 CPU cores.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from plexrl.models.tiny import make_tiny_model
from plexrl.rl.codec import Codec
from plexrl.rl.job import Job
from plexrl.rl.rollout import Episode, policy_datum, replies, rollout
from plexrl.rl.spec import JobSpec
from plexrl.rl.train import CONTROLLER_NICE, controllers, run_job
from plexrl.engines.local import LocalCluster
from plexrl.tasks import AdditionTask, ToolUseTask
from plexrl.types import ModelInput, SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, hidden_size=32, num_layers=1, num_heads=2))


@pytest.fixture
def cluster():
    with LocalCluster(devices=1) as c:
        yield c


def scripted_tool_episode(codec: Codec) -> Episode:
    """A two-turn tool episode built by hand: call, tool reply, answer."""
    from plexrl.types import SampledSequence

    task = ToolUseTask(tool="calculator")
    problem = task.sample_problem(np.random.default_rng(0))
    episode = Episode.start(codec, problem)
    for text in task.demonstration(problem):
        ids = codec.encode(text[0] + "\n")
        episode.add_turn(codec, task, SampledSequence(ids, [-0.5] * len(ids), "stop"))
    episode.reward = task.reward(problem, episode.turns)
    return episode


def test_multi_turn_episode_marks_only_model_tokens_as_sampled(model):
    codec = Codec.from_model(model)
    episode = scripted_tool_episode(codec)
    text = codec.decode(episode.tokens)
    a, b = episode.problem.numbers
    assert text == f"{a}*{b}?calc({a}*{b})\n>{a * b}\n{a * b}\n"
    sampled = "".join(codec.decode([t]) for t, lp in zip(episode.tokens, episode.logprobs) if lp is not None)
    assert sampled == f"calc({a}*{b})\n{a * b}\n", "prompt and tool output must never be trained on"
    assert episode.reward == 1.0 and episode.done


class TogetherToolTask(ToolUseTask):
    """The tool task whose calls each wait until `parties` of them are in flight (a barrier that
    gives up after 10 s): asked for one after another, they could never all be."""

    def __init__(self, parties: int):
        super().__init__(tool="calculator", latency_s=0.0)
        self.barrier = threading.Barrier(parties, timeout=10)

    def respond(self, problem, turns):
        self.barrier.wait()
        return super().respond(problem, turns)


def test_one_turns_tool_calls_go_out_together_and_reply_in_order(model):
    """A turn's environment calls are in flight at once (the agentic controller's tool calls to
    the sandbox service), and each episode gets its own reply, as asked for one by one."""
    from plexrl.types import SampledSequence

    codec, plain = Codec.from_model(model), ToolUseTask(tool="calculator", latency_s=0.0)
    problems = [plain.sample_problem(np.random.default_rng(i)) for i in range(6)]
    episodes = []
    for problem in problems:
        episode = Episode.start(codec, problem)
        call = plain.demonstration(problem)[0][0]
        ids = codec.encode(call + "\n")
        episode.add_sample(codec, SampledSequence(ids, [-0.5] * len(ids), "stop"))
        episodes.append(episode)
    together = replies(TogetherToolTask(len(episodes)), episodes)
    assert together == [episode.reply(plain) for episode in episodes]
    assert together == [f">{a * b}\n" for a, b in (p.numbers for p in problems)]
    assert replies(AdditionTask(), episodes) == [None] * len(episodes)  # single-turn: nothing to ask


def test_policy_datum_places_advantages_on_sampled_tokens(model):
    episode = scripted_tool_episode(Codec.from_model(model))
    advantages = np.arange(1, len(episode.policy_positions) + 1, dtype=np.float32)
    datum = policy_datum(episode, advantages)
    token_adv = datum.loss_fn_inputs["advantages"].to_numpy()
    assert datum.model_input.length == len(episode.tokens) - 1
    np.testing.assert_array_equal(token_adv[episode.policy_positions - 1], advantages)
    assert np.count_nonzero(token_adv) == len(advantages)
    targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
    np.testing.assert_array_equal(targets[episode.policy_positions - 1], np.array(episode.tokens)[episode.policy_positions])


def test_sampled_logprobs_match_compute_logprobs(model, cluster):
    """At temperature 1 the sampler's log-probs are the model's: the alignment every loss relies on."""
    codec, task = Codec.from_model(model), ToolUseTask()
    sampler = cluster.service_client("j").create_sampling_client(base_model=model)
    problems = [task.sample_problem(np.random.default_rng(i)) for i in range(2)]
    episodes = rollout(sampler, codec, task, problems, 2, SamplingParams(max_tokens=6, stop=(codec.turn_end,)), (0,))
    for episode in episodes:
        scored = sampler.compute_logprobs(ModelInput.from_ints(episode.tokens)).result()
        expected = np.array([scored[p] for p in episode.policy_positions])
        np.testing.assert_allclose(episode.policy_logprobs, expected, atol=1e-4)


def reference_ppo_loss(logprobs, old, advantages, low, high):
    ratio = np.exp(logprobs - old)
    return float(-np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages).sum())


def test_ppo_update_loss_matches_numpy_reference(model, cluster):
    spec = JobSpec(name="j", algorithm="grpo", task="addition", steps=1, problems_per_step=2, group_size=2)
    job = Job(cluster.service_client("j"), spec, model)
    episodes = job.rollout(0)
    rng = np.random.default_rng(0)
    datums = [policy_datum(e, rng.normal(size=len(e.policy_positions))) for e in episodes]
    # perturb the behaviour log-probs so ratios leave the clip range on some tokens
    datums = [type(d)(d.model_input, {**d.loss_fn_inputs, "logprobs": d.loss_fn_inputs["logprobs"].to_numpy() - 0.3})
              for d in datums]
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    out = job.trainer.forward(datums, loss_fn="ppo", loss_fn_config=config).result()
    expected = sum(reference_ppo_loss(o["logprobs"].to_numpy(), d.loss_fn_inputs["logprobs"].to_numpy(),
                                      d.loss_fn_inputs["advantages"].to_numpy(), 0.8, 1.2)
                   for o, d in zip(out.loss_fn_outputs, datums))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("algorithm, task, extra", [
    ("grpo", "addition", {"kl_coef": 0.1}),
    ("dapo", "countdown", {"max_sampling_rounds": 2}),
    ("ppo", "countdown", {}),
    ("reinforce_pp", "tool_use", {"kl_coef": 0.01}),
    ("distill", "addition", {}),
])
def test_each_algorithm_steps_and_is_deterministic(model, algorithm, task, extra):
    spec = JobSpec(name="j", algorithm=algorithm, task=task, steps=2, problems_per_step=2, group_size=2,
                   max_tokens=6, **extra)
    curves = []
    for _ in range(2):
        with LocalCluster(devices=1) as cluster:
            result = run_job(cluster, spec, model, teacher_model=model)
            curves.append(result.rewards)
            assert all(np.isfinite(v) for m in result.metrics for v in m.values() if isinstance(v, float))
    assert len(curves[0]) == 2 and curves[0] == curves[1]


def test_distill_without_teacher_is_refused(model, cluster):
    spec = JobSpec(name="j", algorithm="distill", task="addition", steps=1)
    with pytest.raises(ValueError, match="needs a teacher"):
        run_job(cluster, spec, model)


def test_a_jobs_declared_slack_is_the_one_the_cluster_holds_it_to(model):
    spec = JobSpec(name="slow-ok", algorithm="grpo", task="addition", steps=1, problems_per_step=2, group_size=2,
                   max_tokens=4, slack=0.5)
    with LocalCluster(devices=1) as cluster:
        run_job(cluster, spec, model)
        assert cluster.metrics()["placement"]["slow-ok"]["slack"] == 0.5
    with pytest.raises(ValueError, match="slack"):
        JobSpec(name="j", algorithm="grpo", task="addition", steps=1, slack=-0.1)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread CPU priority is Linux's")
def test_controllers_yield_the_cores_to_the_devices_and_nothing_else_does():
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = niceness()
    with controllers(2) as pool:
        theirs = {pool.submit(niceness).result() for _ in range(4)}
    assert theirs == {min(mine + CONTROLLER_NICE, 19)}
    assert niceness() == mine  # the caller's threads (the scheduler's among them) keep theirs

"""Episodes: sampling (possibly multi-turn) rollouts and turning them into training datums.

An `Episode` is one token sequence: the prompt, then model turns (sampled: each token has the
sampler's log-prob) and environment replies (written: log-prob None). Every turn of every
episode is sampled with an explicit seed derived from (job seed, step, round, turn, index), so a
job's rollouts are a function of its weights and seeds alone, whoever else shares the devices.
Tool calls and reward checks run here, in the job's controller, while its model waits: that is
the device-idle time the multiplexed runtime hands to other jobs. The environment's replies to one
turn's episodes are asked for together (`replies`: threads, at most `CALLS_IN_FLIGHT` at once), as
an agentic RL controller sends its tool calls to the sandbox service, so a turn waits for its
slowest call, not for the sum of them; each reply is a function of its episode alone, so the
order they come back in changes nothing.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from plexrl.rl.codec import Codec
from plexrl.tasks import TURN_END, Problem, Task
from plexrl.types import Datum, ModelInput, SampledSequence, SamplingParams


def derive_seed(*parts: int) -> int:
    """A sampling seed from integers; stable across processes (unlike `hash`)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31)


@dataclass
class Episode:
    problem: Problem
    tokens: list[int]
    logprobs: list[float | None]  # per token: the sampler's log-prob, None where not sampled
    turns: list[str] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0

    @classmethod
    def start(cls, codec: Codec, problem: Problem) -> "Episode":
        prompt = codec.encode_prompt(problem.prompt)
        return cls(problem, prompt, [None] * len(prompt))

    @property
    def policy_positions(self) -> np.ndarray:
        """Indices of the tokens the policy sampled."""
        return np.array([i for i, lp in enumerate(self.logprobs) if lp is not None], dtype=np.int64)

    @property
    def policy_logprobs(self) -> np.ndarray:
        return np.array([lp for lp in self.logprobs if lp is not None], dtype=np.float64)

    def add_turn(self, codec: Codec, task: Task, sequence: SampledSequence) -> None:
        """The model's turn, then the environment's reply to it (`add_sample`, `add_reply`)."""
        self.add_sample(codec, sequence)
        self.add_reply(codec, self.reply(task))

    def add_sample(self, codec: Codec, sequence: SampledSequence) -> None:
        """The model's turn: its sampled tokens, closed with the turn's end if it was cut off."""
        self._append(sequence.tokens, sequence.logprobs)
        if not sequence.tokens or sequence.tokens[-1] != codec.turn_end:
            self._append([codec.turn_end], [None])  # cut off at max_tokens: close the turn
        self.turns.append(codec.decode(sequence.tokens).split(TURN_END)[0])

    def awaits_reply(self, task: Task) -> bool:
        """Whether the environment answers its latest turn (a turn before the task's last)."""
        return len(self.turns) < task.max_turns

    def reply(self, task: Task) -> str | None:
        """The environment's reply to the turns so far; None when the episode is over."""
        return task.respond(self.problem, self.turns) if self.awaits_reply(task) else None

    def add_reply(self, codec: Codec, reply: str | None) -> None:
        if reply is None:
            self.done = True
        else:
            written = codec.encode(reply)
            self._append(written, [None] * len(written))

    def _append(self, tokens, logprobs) -> None:
        self.tokens += [int(t) for t in tokens]
        self.logprobs += [None if lp is None else float(lp) for lp in logprobs]


def rollout(sampler, codec: Codec, task: Task, problems: list[Problem], group_size: int,
            params: SamplingParams, seed_parts: tuple[int, ...]) -> list[Episode]:
    """`group_size` episodes per problem, consecutive; each graded by the task."""
    episodes = [Episode.start(codec, problem) for problem in problems for _ in range(group_size)]
    for turn in range(task.max_turns):
        live = [episode for episode in episodes if not episode.done]
        if not live:
            break
        for episode, sequence in zip(live, _sample_turn(sampler, live, turn, group_size, params, seed_parts)):
            episode.add_sample(codec, sequence)
        for episode, reply in zip(live, replies(task, live)):
            episode.add_reply(codec, reply)
    for episode in episodes:
        episode.reward = float(task.reward(episode.problem, episode.turns))
    return episodes


CALLS_IN_FLIGHT = 16  # one turn's environment calls sent at once (a step's tool calls in the demo)


def replies(task: Task, episodes: list[Episode]) -> list[str | None]:
    """Each episode's reply to its latest turn (`Episode.reply`), asked for together: a task
    whose episodes get one (a multi-turn task before its last turn) has its calls in flight at
    once, at most `CALLS_IN_FLIGHT`, from threads this controller starts (so they run at its
    priority). A single-turn task, or a turn that is the last, asks for nothing."""
    asking = sum(episode.awaits_reply(task) for episode in episodes)
    if asking <= 1:
        return [episode.reply(task) for episode in episodes]
    with ThreadPoolExecutor(min(asking, CALLS_IN_FLIGHT), thread_name_prefix="plexrl-env") as pool:
        return list(pool.map(lambda episode: episode.reply(task), episodes))


def _sample_turn(sampler, live: list[Episode], turn: int, group_size: int, params: SamplingParams,
                 seed_parts: tuple[int, ...]) -> list[SampledSequence]:
    """The first turn samples a whole group from its shared prompt; later turns diverge."""
    width = group_size if turn == 0 else 1
    heads = live[::width]
    futures = [  # submitted together so the runtime can queue them back to back
        sampler.sample(prompt=ModelInput.from_ints(episode.tokens), num_samples=width,
                       sampling_params=_with_seed(params, derive_seed(*seed_parts, turn, index)))
        for index, episode in enumerate(heads)
    ]
    return [sequence for future in futures for sequence in future.result().sequences]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                          top_k=params.top_k, top_p=params.top_p, seed=seed, stop=params.stop)


def policy_datum(episode: Episode, advantages: np.ndarray) -> Datum:
    """A datum for the policy losses: `advantages` has one value per sampled token.

    Position j of the datum predicts token j+1; prompt and environment tokens get advantage 0
    (so they carry no gradient) and a log-prob of 0 (harmless: ratio <= 1 times 0).
    """
    positions = episode.policy_positions
    if len(advantages) != len(positions):
        raise ValueError(f"{len(advantages)} advantages for {len(positions)} sampled tokens (expected equal)")
    length = len(episode.tokens) - 1
    token_advantages, token_logprobs = np.zeros(length, np.float32), np.zeros(length, np.float32)
    token_advantages[positions - 1] = advantages
    token_logprobs[positions - 1] = episode.policy_logprobs
    return Datum(model_input=ModelInput.from_ints(episode.tokens[:-1]),
                 loss_fn_inputs={"target_tokens": np.array(episode.tokens[1:], np.int64),
                                 "logprobs": token_logprobs, "advantages": token_advantages})


def value_datum(episode: Episode, targets: np.ndarray) -> Datum:
    """A critic datum: regress the value before each sampled token onto `targets` (one per token)."""
    positions = episode.policy_positions
    length = len(episode.tokens) - 1
    token_targets, weights = np.zeros(length, np.float32), np.zeros(length, np.float32)
    token_targets[positions - 1] = targets
    weights[positions - 1] = 1.0
    return Datum(model_input=ModelInput.from_ints(episode.tokens[:-1]),
                 loss_fn_inputs={"target_values": token_targets, "weights": weights})


def sft_datum(codec: Codec, prompt: str, completion: str, weight: float = 1.0) -> Datum:
    """Supervised datum: cross-entropy on the completion's tokens only."""
    prompt_ids, completion_ids = codec.encode_prompt(prompt), codec.encode(completion)
    tokens = prompt_ids + completion_ids
    weights = np.zeros(len(tokens) - 1, np.float32)
    weights[len(prompt_ids) - 1:] = weight
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                 loss_fn_inputs={"target_tokens": np.array(tokens[1:], np.int64), "weights": weights})

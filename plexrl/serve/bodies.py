"""The JSON bodies of the Tinker SDK's requests as typed values, decoded once at the edge (on the
tenant's share of the pool, after plexrl/serve/edge.py bounded and parsed them), so the service
reads fields, never a dict.

A decoder does the checks the body alone decides (types, required fields, what PlexRL does not
support) with the messages the SDK's callers see; lookups (a session, a model, a served base
model) stay with the service. A malformed field is `BadRequest` (400); a well-formed value PlexRL
refuses is `errors.InvalidInput` (a failed request for the calls that answer a future).

Invariant: a value that a numbered model call checks in its turn (a checkpoint name, save's
user_metadata, optim_step's adam_params, load's path) is carried as given and checked there,
never here: a call refused in its turn still moves its model's sequence on, one refused at the
edge would leave a gap the model waits out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plexrl.api import errors
from plexrl.api.types import LoraConfig, ModelInput, SamplingParams, shown
from plexrl.serve import wire
from plexrl.serve.refusals import BadRequest

UNSUPPORTED_TOP_K = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


# ---------------------------------------------------------------------------- fields

def count(body: dict, name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{name}={shown(value)}; expected an integer >= 0")
    return value


def optional_count(body: dict, name: str) -> int | None:
    return None if body.get(name) is None else count(body, name)


def user_metadata(value: Any, most_bytes: int) -> dict | None:
    """A user_metadata object as stored: str keys and values (others as their str), at most
    `most_bytes` as JSON. Its strings are valid Unicode: the edge refused any other."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"user_metadata={shown(value)}; expected an object of strings")
    metadata = {str(k): v if isinstance(v, str) else str(v) for k, v in value.items()}
    size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > most_bytes:
        raise errors.InvalidInput(f"user_metadata is {size:,} bytes as JSON; expected at most {most_bytes:,}")
    return metadata


def lora_config(config: Any) -> LoraConfig | None:
    """Tinker's lora_config as PlexRL's; rank 0 (or no lora_config) is a full-parameter model."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise BadRequest(f"lora_config={shown(config)}; expected an object with 'rank'")
    rank = config.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise errors.InvalidInput(f"lora_config.rank={shown(rank)}; expected an integer >= 1 (or 0 for full-parameter training)")
    if rank == 0:
        return None
    seed = config.get("seed")
    return LoraConfig(rank=rank, seed=0 if seed is None else seed, train_mlp=config.get("train_mlp", True),
                      train_attn=config.get("train_attn", True), train_unembed=config.get("train_unembed", True))


# ---------------------------------------------------------------------------- sessions and futures

@dataclass(frozen=True)
class CreateSession:
    user_metadata: dict | None

    @classmethod
    def decode(cls, body: dict, metadata_bytes: int) -> "CreateSession":
        return cls(user_metadata(body.get("user_metadata"), metadata_bytes))


@dataclass(frozen=True)
class Named:
    """A body that names one record (a session, a model, a request, a checkpoint), as given: the
    lookup refuses what is not the caller's."""

    name: Any

    @classmethod
    def decode(cls, body: dict, field: str) -> "Named":
        return cls(body.get(field))


# ---------------------------------------------------------------------------- models

@dataclass(frozen=True)
class CreateModel:
    session_id: Any
    model_seq_id: int
    lora: LoraConfig | None
    base_model: Any
    user_metadata: dict | None

    @classmethod
    def decode(cls, body: dict, metadata_bytes: int) -> "CreateModel":
        seq = count(body, "model_seq_id")
        optimizer = body.get("optimizer_config") or {}
        if isinstance(optimizer, dict) and optimizer.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config.type={shown(optimizer.get('type'))}; PlexRL trains with 'adamw' only")
        lora = lora_config(body.get("lora_config"))
        return cls(body.get("session_id"), seq, lora, body.get("base_model"),
                   user_metadata(body.get("user_metadata"), metadata_bytes))


@dataclass(frozen=True)
class OptimStep:
    model_id: Any
    seq_id: int | None
    adam_params: Any  # checked in the call's turn (wire.adam_params)

    @classmethod
    def decode(cls, body: dict) -> "OptimStep":
        return cls(body.get("model_id"), optional_count(body, "seq_id"),
                   body.get("adam_params") or body.get("optim_params") or {})


# ---------------------------------------------------------------------------- checkpoints

@dataclass(frozen=True)
class SaveWeights:
    """save_weights, or save_weights_for_sampler with a `path` (a named sampler checkpoint)."""

    model_id: Any
    seq_id: int | None
    name: Any  # checked in the call's turn
    overwrite: bool
    user_metadata: Any  # checked in the call's turn

    @classmethod
    def decode(cls, body: dict) -> "SaveWeights":
        seq = optional_count(body, "seq_id")
        return cls(body.get("model_id"), seq, body.get("path") or f"{seq or 0:06d}",
                   bool(body.get("overwrite", False)), body.get("user_metadata"))


@dataclass(frozen=True)
class SaveForSampler:
    """save_weights_for_sampler: `named` when it has a path, else an unnamed sampler numbered
    `sampling_session_seq_id` in the model's session."""

    model_id: Any
    seq_id: int | None
    named: SaveWeights | None
    sampling_session_seq_id: int | None

    @classmethod
    def decode(cls, body: dict) -> "SaveForSampler":
        seq = optional_count(body, "seq_id")
        if body.get("path") is None and body.get("sampling_session_seq_id") is None:
            raise BadRequest("save_weights_for_sampler needs 'path' (a named checkpoint) or "
                             "'sampling_session_seq_id' (an unnamed sampler)")
        if body.get("path") is not None:
            named = SaveWeights(body.get("model_id"), seq, body.get("path"), bool(body.get("overwrite", False)),
                                body.get("user_metadata"))
            return cls(body.get("model_id"), seq, named, None)
        return cls(body.get("model_id"), seq, None, count(body, "sampling_session_seq_id"))


@dataclass(frozen=True)
class LoadWeights:
    """load_weights into a model (`model_id`), or into a new model of a session (`session_id`,
    `model_seq_id`: Tinker's create_training_client_from_state)."""

    path: Any  # looked up in the call's turn
    with_optimizer: bool
    model_id: Any
    seq_id: int | None
    session_id: Any = None
    model_seq_id: int | None = None
    user_metadata: dict | None = None

    @classmethod
    def decode(cls, body: dict, metadata_bytes: int) -> "LoadWeights":
        path, with_optimizer = body.get("path"), bool(body.get("optimizer", False))
        if body.get("model_id") is not None:
            return cls(path, with_optimizer, body.get("model_id"), optional_count(body, "seq_id"))
        return cls(path, with_optimizer, None, None, body.get("session_id"), count(body, "model_seq_id"),
                   user_metadata(body.get("user_metadata"), metadata_bytes))


# ---------------------------------------------------------------------------- sampling

@dataclass(frozen=True)
class CreateSamplingSession:
    session_id: Any
    sampling_session_seq_id: int
    model_path: Any
    base_model: Any

    @classmethod
    def decode(cls, body: dict) -> "CreateSamplingSession":
        return cls(body.get("session_id"), count(body, "sampling_session_seq_id"), body.get("model_path"),
                   body.get("base_model"))


@dataclass(frozen=True)
class Sample:
    sampling_session_id: str
    seq_id: int | None
    prompt: ModelInput
    params: SamplingParams
    num_samples: int
    prompt_logprobs: bool

    @classmethod
    def decode(cls, body: dict, max_sampled_tokens: int) -> "Sample":
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:
            raise BadRequest("asample needs 'sampling_session_id' (create one with create_sampling_session)")
        seq = optional_count(body, "seq_id")
        for unsupported in UNSUPPORTED_TOP_K:
            if body.get(unsupported):
                raise errors.InvalidInput(f"{unsupported}={shown(body[unsupported])}; PlexRL does not compute top-k "
                                          "log-probs: expected 0")
        if body.get("target_prompt_logprobs") is not None:
            raise errors.InvalidInput("target_prompt_logprobs is not supported by PlexRL; expected None")
        prompt: ModelInput = wire.model_input(body.get("prompt"))
        params = wire.sampling_params(body.get("sampling_params") or {})
        if body.get("record_stability_info"):
            raise errors.InvalidInput("record_stability_info=True (for the stable_reinforce loss) is not supported by "
                                      "PlexRL; train with loss_fn importance_sampling, ppo, cispo or dro")
        num_samples = samples_asked(body.get("num_samples", 1), prompt.length, params.max_tokens, max_sampled_tokens)
        return cls(sampler_id, seq, prompt, params, num_samples, bool(body.get("prompt_logprobs") or False))


def samples_asked(value: Any, prompt_tokens: int, max_tokens: int, limit: int) -> int:
    """num_samples checked before anything is built for it: an integer from 1 to what the
    cluster's `max_sampled_tokens` (`limit`) allows for this prompt and max_tokens."""
    most = max(1, limit // max(1, prompt_tokens + max_tokens))
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise errors.InvalidInput(
            f"num_samples={shown(value)}; expected an integer from 1 to {most:,} (max_sampled_tokens={limit:,} over "
            f"a prompt of {prompt_tokens:,} tokens + max_tokens={max_tokens:,})")
    return value

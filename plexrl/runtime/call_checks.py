"""What a front checks before it acts, beyond what the client checked.

A new service client's and a new model's arguments (`check_service_client`, `check_new_model`,
`plain_lora`), and a call's payload where the check needs the cluster's settings or knows
other jobs (`CallChecks`):
- a sample call's tokens are bounded (`max_sampled_tokens`), and so is its KV cache: it must
  fit the device budget next to its model (memory the call holds on the device besides the state);
- a job loads its own checkpoints, or folders from outside the cluster's checkpoint directory
  (a base model, an exported run), never another job's.
Invariant: a call refused here fails with InvalidInput saying what was asked, the limit and what
to do instead; nothing of it reaches a node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plexrl.api import errors
from plexrl.api import validation
from plexrl.api.cluster import StateHandle, check_name
from plexrl.api.types import LoraConfig, is_integer
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.memory_estimates import compute_dtype, kv_bytes_per_token
from plexrl.runtime.model_configs import ModelConfigs
from plexrl.runtime.payloads import SamplePayload


class CallChecks:
    def __init__(self, config: ClusterConfig, models: ModelConfigs, precision: str, checkpoint_dir: Path):
        self.max_sampled_tokens = config.max_sampled_tokens
        self.device_memory_bytes = config.device_memory_bytes
        self.models, self.precision, self.checkpoint_dir = models, precision, checkpoint_dir

    def check(self, state: StateHandle, fn: str, payload: Any) -> None:
        """InvalidInput if the cluster refuses call `fn` (its payload decoded) on `state`."""
        if fn == "sample":
            self._sample_size(state, payload)
        elif fn == "load_state":
            self._own_checkpoint(state, payload.path)

    def _sample_size(self, state: StateHandle, payload: SamplePayload) -> None:
        num, tokens = payload.num_samples, payload.positions()
        if tokens > self.max_sampled_tokens:
            raise errors.InvalidInput(
                f"num_samples={num} x (prompt + max_tokens) = {tokens:,} tokens in one sample call; expected at most "
                f"max_sampled_tokens={self.max_sampled_tokens:,} (a cluster setting): split the call")
        itemsize = compute_dtype(self.precision, state.trainable, state.lora).itemsize
        kv = tokens * kv_bytes_per_token(self.models.config(state.source), itemsize)
        if kv + state.device_bytes > self.device_memory_bytes:
            raise errors.InvalidInput(
                f"num_samples={num} needs a {kv:,}-byte KV cache next to its {state.device_bytes:,}-byte model, more "
                f"than a device budget of {self.device_memory_bytes:,} bytes: sample fewer sequences at once")

    def _own_checkpoint(self, state: StateHandle, path: str) -> None:
        folder, root = Path(path).resolve(), self.checkpoint_dir.resolve()
        if folder.is_relative_to(root) and not folder.is_relative_to(root / state.job):
            raise errors.InvalidInput(
                f"checkpoint {str(path)!r} is another job's (under {str(root)!r} but not under job {state.job!r}'s "
                "folder); expected one of this job's own checkpoints or a folder outside the checkpoint directory")


def check_service_client(job: str, slack: float, steps: int | None) -> None:
    check_name("job", job)
    if not (isinstance(slack, (int, float)) and not isinstance(slack, bool) and slack >= 0):
        raise errors.InvalidInput(f"slack={slack!r}; expected a fraction of a step >= 0, e.g. 0.1")
    if steps is not None and not (is_integer(steps) and steps >= 1):
        raise errors.InvalidInput(f"steps={steps!r}; expected the job's number of steps (an integer >= 1) or None")


def check_new_model(job: str, name: str, trainable: bool, sampler: str) -> None:
    check_name("job", job)
    check_name("model name", name)
    if validation.check_sampler(sampler) != "hf" and trainable:
        raise errors.InvalidInput(f"sampler={sampler!r} for trainable model {name!r}; expected 'hf' (a trainer "
                                  "samples nothing: its snapshots choose their sampler when synced)")


def plain_lora(lora: LoraConfig | None) -> LoraConfig | None:
    """A model's LoRA setting, checked, as it travels to its node (None: a full-parameter model)."""
    if lora is None:
        return None
    if not isinstance(lora, LoraConfig):
        raise errors.InvalidInput(f"lora={lora!r}; expected None or a plexrl.LoraConfig")
    lora.validate()
    return lora.plain()

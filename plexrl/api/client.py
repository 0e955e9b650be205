"""What a job holds: a service client per job, a training client per trainable model, sampling
clients for weights (Tinker's shape). Every call returns a future; calls on one model run in
submission order. Inputs are checked here (plexrl/api/validation.py), so a bad call fails at once,
through its future, with a clear message and never reaches a worker. A call's method never
raises for its arguments, of whatever type: everything it checks or converts runs inside
`_submit`, whose failure is the future's. (Synchronous calls, such as creating a client, raise.)

The clients stand on any `Cluster` (plexrl/api/cluster.py): the local, process and Ray fronts,
or a network edge. Nothing here imports torch, ray or transformers (`get_tokenizer` imports
transformers when it is called).
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any, Callable, Sequence

from plexrl.api import errors, validation
from plexrl.api.cluster import Cluster, StateHandle
from plexrl.api.futures import APIFuture
from plexrl.api.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadStateResponse,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    is_integer,
)

LossFn = str | Callable


class ServiceClient:
    """A job's handle. Several service clients of one job (controllers of its parts) each own
    what they create: `close()` frees only that, and the job ends when its last one closes."""

    def __init__(self, cluster: Cluster, job: str, slack: float = 0.10, admission_timeout: float | None = None,
                 owner: int | None = None, ends: bool = False):
        self.cluster = cluster
        self.job = job
        self.slack = slack
        self.admission_timeout = admission_timeout
        self.owner = owner  # the cluster's number for this client (None: the client owns the whole job)
        self.ends = ends  # the job declared its length (`service_client(steps=...)`)

    def create_training_client(self, base_model: str | Path, seed: int = 0, name: str = "policy") -> "TrainingClient":
        """A trainable, full-parameter model of this job, loaded from a local HF folder."""
        validation.check_seed(seed)
        state = self.cluster.add_model(self.job, name, base_model, True, self.slack, self.admission_timeout,
                                       owner=self.owner, **self._length())
        return TrainingClient(self.cluster, state, seed)

    def create_lora_training_client(self, base_model: str | Path, rank: int, seed: int = 0, name: str = "policy",
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = False) -> "TrainingClient":
        """A trainable LoRA adapter (LoraConfig) over `base_model`, whose frozen weights are shared
        with every other LoRA model of that base on its node; `seed` draws the adapter's initial
        weights and the client's default sampling seeds. `rank=0`: a full-parameter model
        (create_training_client)."""
        validation.check_seed(seed)
        if is_integer(rank) and rank == 0:
            return self.create_training_client(base_model, seed, name)
        lora = LoraConfig(rank, seed, train_mlp, train_attn, train_unembed)
        lora.validate()
        state = self.cluster.add_model(self.job, name, base_model, True, self.slack, self.admission_timeout,
                                       owner=self.owner, lora=lora.plain(), **self._length())
        return TrainingClient(self.cluster, state, seed)

    def create_sampling_client(self, base_model: str | Path, name: str | None = None, seed: int = 0,
                               sampler: str = "hf") -> "SamplingClient":
        """A frozen model (reference, teacher) for sampling and log-probs; `sampler="vllm"` runs
        those on a vLLM engine (plexrl/samplers/), "hf" on the Hugging Face model.

        `base_model` is a Hugging Face model folder, or a LoRA adapter folder that a LoRA
        model's `save_state` wrote (peft's `adapter_config.json` names its base): then the model
        is that adapter over its base, frozen."""
        validation.check_seed(seed)
        validation.check_sampler(sampler)
        name = name or "frozen:" + re.sub(r"[^A-Za-z0-9._:-]", "_", Path(str(base_model)).name)
        kwargs = ({} if sampler == "hf" else {"sampler": sampler}) | self._length()  # a Cluster serving only "hf" need not know it
        adapter = validation.lora_adapter(base_model)
        if adapter is not None:
            base, lora = adapter
            state = self.cluster.add_model(self.job, name, base, False, self.slack, self.admission_timeout,
                                           owner=self.owner, lora=lora, **kwargs)
            client = SamplingClient(self.cluster, state, seed)
            client.load_adapter(str(base_model)).result()
            return client
        state = self.cluster.add_model(self.job, name, base_model, False, self.slack, self.admission_timeout,
                                       owner=self.owner, **kwargs)
        return SamplingClient(self.cluster, state, seed)

    def _length(self) -> dict:
        """`add_model`'s `ends` when the job declared its length (a Cluster that places no jobs
        need not know it)."""
        return {"ends": True} if self.ends else {}

    def report_step(self, step: int, **fields) -> None:
        """Marks the end of this job's step `step` (fields such as `reward=` go to its metrics).

        Step marks are where the cluster measures the job's profile, checkpoints its trainable
        models (every k-th mark) and may move it; a job that runs outside the driver's process
        marks its steps through this call."""
        self.cluster.report_step(self.job, step, **fields)

    def close(self) -> None:
        """This client is done: free the states it created; the job's last client frees the job's
        place and lets waiting jobs in."""
        self.cluster.finish_job(self.job, owner=self.owner)

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ModelClient:
    def __init__(self, cluster: Cluster, state: StateHandle, seed: int):
        self.cluster = cluster
        self.state = state
        self.seed = int(seed)
        self._calls = 0

    @property
    def model_id(self) -> str:
        return self.state.state_id

    def get_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.state.source)

    def _submit(self, fn: str, build: Callable[[], dict[str, Any]]) -> APIFuture:
        """One call = (function name, payload). `build` checks the call's arguments and makes its
        payload; whatever it raises fails the returned future, and nothing is submitted."""
        try:
            payload = build()
        except Exception as exc:  # an InvalidInput; anything else is a bug in a check, yet still only this call's
            return APIFuture.failed(exc)
        future = self.cluster.submit(self.state, fn, payload)
        if future.done() and isinstance(future.exception(), errors.UnknownModel):
            # a sync retired the snapshot between resolving it and submitting: resolve again
            future = self.cluster.submit(self.state, fn, payload)
        return future

    def _next_seed(self, requested: int | None) -> int:
        """Explicit seeds win; otherwise one derived from (client seed, call number): deterministic
        whatever else runs on the cluster."""
        self._calls += 1
        if requested is not None:
            return requested
        return (self.seed * 1_000_003 + self._calls * 7_919) % (2**31 - 1)


class SamplingClient(_ModelClient):
    """Samples and scores with one set of weights. A client made by
    `save_weights_and_get_sampling_client(name)` follows the weights most recently synced
    under `name` (as a weight-synced rollout engine does): calls submitted before a sync see
    the weights before it, calls submitted after see the new ones."""

    def __init__(self, cluster: Cluster, state: StateHandle, seed: int, follows: tuple[str, str] | None = None):
        super().__init__(cluster, state, seed)
        self._follows = follows

    @property
    def state(self) -> StateHandle:
        if self._follows is not None:
            latest = self.cluster.latest_sampler(*self._follows)
            if latest is not None:
                return latest
        return self._state

    @state.setter
    def state(self, value: StateHandle) -> None:
        self._state = value

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        def build() -> dict[str, Any]:
            tokens = validation.input_tokens(prompt, "sample prompt")
            params = validation.sampling_params(sampling_params)
            validation.check_bool(include_prompt_logprobs, "include_prompt_logprobs")
            vocab, positions = self.cluster.limits(self.state)
            validation.check_sample_request(tokens, num_samples, params, vocab, positions)
            return {"tokens": tokens, "num_samples": int(num_samples), "params": params,
                    "seed": self._next_seed(params.seed), "stop_ids": self.cluster.stop_token_ids(self.state),
                    "include_prompt_logprobs": bool(include_prompt_logprobs)}

        return self._submit("sample", build)

    def load_adapter(self, path: str | Path) -> APIFuture[LoadStateResponse]:
        """Overwrite a frozen LoRA model's adapter from an adapter folder (create_sampling_client
        of such a folder does it)."""
        return self._submit("load_state", lambda: {"path": str(validation.checkpoint_folder(path)),
                                                   "with_optimizer": False})

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        def build() -> dict[str, Any]:
            tokens = validation.input_tokens(prompt, "compute_logprobs prompt")
            vocab, positions = self.cluster.limits(self.state)
            validation.check_sequence(tokens, vocab, positions, "compute_logprobs sequence")
            return {"tokens": tokens}

        return self._submit("compute_logprobs", build)


class TrainingClient(_ModelClient):
    def forward_backward(self, data: Sequence[Datum], loss_fn: LossFn = "cross_entropy",
                         loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self._forward(data, loss_fn, loss_fn_config, backward=True)

    def forward(self, data: Sequence[Datum], loss_fn: LossFn = "cross_entropy",
                loss_fn_config: dict | None = None) -> APIFuture[ForwardBackwardOutput]:
        """The loss and its outputs (e.g. a critic's `values`) without touching gradients."""
        return self._forward(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: Callable) -> APIFuture[ForwardBackwardOutput]:
        return self._forward(data, loss_fn, None, backward=True)

    def _forward(self, data, loss_fn, loss_fn_config, backward: bool) -> APIFuture[ForwardBackwardOutput]:
        def build() -> dict[str, Any]:
            datums = validation.datum_list(data)
            vocab, positions = self.cluster.limits(self.state)
            validation.validate_datums(datums, vocab, positions)
            validation.check_loss(loss_fn, loss_fn_config, datums)
            return {"data": datums, "loss_fn": loss_fn, "loss_fn_config": loss_fn_config, "backward": backward}

        return self._submit("forward_backward" if backward else "forward", build)

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        return self._submit("optim_step", lambda: {"params": validation.adam_params(adam_params)})

    def save_state(self, name: str, with_optimizer: bool = True) -> APIFuture[SaveStateResponse]:
        """Materialize a consistent snapshot to the checkpoint directory (residency unchanged)."""
        def build() -> dict[str, Any]:
            validation.check_checkpoint_name(name)  # before the front is asked for a path of it
            validation.check_bool(with_optimizer, "with_optimizer")
            path = self.cluster.checkpoint_path(self.state, name)
            return {"path": str(path), "with_optimizer": bool(with_optimizer)}

        return self._submit("save_state", build)

    def load_state(self, path: str | Path) -> APIFuture[LoadStateResponse]:
        """Weights from a checkpoint; optimizer moments restart from zero."""
        return self._load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str | Path) -> APIFuture[LoadStateResponse]:
        return self._load(path, with_optimizer=True)

    def _load(self, path: Any, with_optimizer: bool) -> APIFuture[LoadStateResponse]:
        def build() -> dict[str, Any]:
            folder = validation.checkpoint_folder(path)
            if not folder.is_dir():
                raise errors.ModelLoadError(f"checkpoint folder {str(folder)!r} does not exist; expected a save_state path")
            return {"path": str(folder), "with_optimizer": with_optimizer}

        return self._submit("load_state", build)

    def save_weights_for_sampler(self, name: str = "sampler", sampler: str = "hf") -> APIFuture[StateHandle]:
        """Weight sync: the current weights become the weights of this model's sampler snapshot
        `name`, which samples with `sampler` ("hf" or "vllm")."""
        def build() -> dict[str, Any]:
            validation.check_plain_name(name, "sampler name")
            validation.check_sampler(sampler)
            return {"name": name} if sampler == "hf" else {"name": name, "sampler": sampler}

        return self._submit("sync_weights", build)

    def save_weights_and_get_sampling_client(self, name: str = "sampler", sampler: str = "hf") -> SamplingClient:
        """Blocks until the weights are synced. Samplers of successive syncs draw from different
        default seed streams (explicit `SamplingParams.seed` always wins)."""
        snapshot = self.save_weights_for_sampler(name, sampler).result()
        self._syncs += 1
        return SamplingClient(self.cluster, snapshot, self.seed * 1_000_033 + self._syncs,
                              follows=(self.state.state_id, name))

    _syncs = 0

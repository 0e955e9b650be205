"""Exceptions a PlexRL user can see. Each message names what was wrong and what was expected.

Errors reach the caller through its future; the cluster and every other job carry on.
`retriable` tells a client whether repeating the same call may succeed.
"""

from __future__ import annotations


class PlexRLError(Exception):
    """Every PlexRL error; `retriable` says whether the same call may succeed if repeated."""

    retriable = False


class InvalidInput(PlexRLError, ValueError):
    """A call's arguments are wrong; nothing was executed."""


class ModelLoadError(InvalidInput):
    """A base model folder is missing or cannot be loaded as a Hugging Face causal LM."""


class UnknownLossFunction(InvalidInput):
    """`loss_fn` names no built-in loss (and is not a callable for `forward_backward_custom`)."""


class DatumShapeError(InvalidInput):
    """The data of a forward or backward call is malformed: not a list of datums, a loss input
    that is missing, of the wrong length, type or dtype, or holds non-finite values or bad ids."""


class InvalidSamplingParams(InvalidInput):
    """A sampling parameter is out of range (max_tokens, temperature, top_k, top_p, seed, stop)."""


class InvalidAdamParams(InvalidInput):
    """An Adam parameter is out of range (learning rate, betas, eps, weight decay, clipping)."""


class NonFiniteUpdate(InvalidInput):
    """An update would make a model's gradients, weights or optimizer moments non-finite (NaN, inf,
    or too large for float32); it was refused and the state is as it was before the call."""


class StateTooLarge(PlexRLError):
    """A model state cannot fit a device (or host) budget even when everything else is offloaded."""


class ClusterClosed(PlexRLError):
    """A call was made on a cluster that has been closed."""


class WorkerFailed(PlexRLError):
    """The worker executing a request died; the request may be submitted again."""

    retriable = True


class StateLost(PlexRLError):
    """A model's state is gone from the runtime (its host copy was being written when its worker
    died); it must be restored from a checkpoint (load_state) before it can be used again."""


class ExecutionError(PlexRLError):
    """The function raised while executing on the worker; the message carries the cause."""


class UnknownModel(InvalidInput):
    """A call names a model state the cluster no longer holds (released, or a superseded sampler
    snapshot)."""


class ConfigError(InvalidInput):
    """A cluster or job setting is out of range."""


class AdmissionTimeout(PlexRLError):
    """A job waited for room on the cluster longer than it was willing to."""

    retriable = True

__all__ = ["AdmissionTimeout", "ClusterClosed", "ConfigError", "DatumShapeError", "ExecutionError", "InvalidAdamParams", "InvalidInput", "InvalidSamplingParams", "ModelLoadError", "NonFiniteUpdate", "PlexRLError", "StateLost", "StateTooLarge", "UnknownLossFunction", "UnknownModel", "WorkerFailed"]

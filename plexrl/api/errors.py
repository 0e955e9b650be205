"""Exceptions a PlexRL user can see. Each message names what was wrong and what was expected.

Errors reach the caller through its future; the cluster and every other job carry on.
`retriable` tells a client whether repeating the same call may succeed.
"""

from __future__ import annotations


class PlexRLError(Exception):
    retriable = False


class InvalidInput(PlexRLError, ValueError):
    """A call's arguments are wrong; nothing was executed."""


class ModelLoadError(InvalidInput):
    """A base model folder is missing or cannot be loaded as a Hugging Face causal LM."""


class UnknownLossFunction(InvalidInput):
    pass


class DatumShapeError(InvalidInput):
    pass


class InvalidSamplingParams(InvalidInput):
    pass


class InvalidAdamParams(InvalidInput):
    pass


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
    pass


class ConfigError(InvalidInput):
    """A cluster or job setting is out of range."""


class AdmissionTimeout(PlexRLError):
    """A job waited for room on the cluster longer than it was willing to."""

    retriable = True

__all__ = ["AdmissionTimeout", "ClusterClosed", "ConfigError", "DatumShapeError", "ExecutionError", "InvalidAdamParams", "InvalidInput", "InvalidSamplingParams", "ModelLoadError", "NonFiniteUpdate", "PlexRLError", "StateLost", "StateTooLarge", "UnknownLossFunction", "UnknownModel", "WorkerFailed"]

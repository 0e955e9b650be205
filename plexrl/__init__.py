"""PlexRL: multiplexed, serviceized LLM execution for RL post-training on shared clusters."""

from plexrl import errors
from plexrl.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadStateResponse,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    TensorData,
)

__all__ = [
    "AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LoadStateResponse", "LocalCluster",
    "ModelInput", "OptimStepResponse", "RayCluster", "SampleResponse", "SampledSequence", "SamplingParams",
    "SaveStateResponse", "TensorData", "errors",
]


def __getattr__(name: str):
    # The runtime pulls in torch and transformers; import it only when it is used.
    if name == "LocalCluster":
        from plexrl.runtime.local_cluster import LocalCluster

        return LocalCluster
    if name == "RayCluster":
        from plexrl.engines.ray_cluster import RayCluster

        return RayCluster
    if name in ("ServiceClient", "TrainingClient", "SamplingClient"):
        from plexrl import client

        return getattr(client, name)
    raise AttributeError(f"module 'plexrl' has no attribute {name!r}")

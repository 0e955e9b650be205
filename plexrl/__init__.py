"""PlexRL: multiplexed, serviceized LLM execution for RL post-training on shared clusters."""

from plexrl import errors
from plexrl.api.client import SamplingClient, ServiceClient, TrainingClient
from plexrl.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadStateResponse,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    TensorData,
)

__all__ = [
    "AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LoadStateResponse", "LocalCluster", "LoraConfig",
    "ModelInput", "ProcessCluster", "OptimStepResponse", "RayCluster", "SampleResponse", "SampledSequence", "SamplingClient",
    "SamplingParams", "SaveStateResponse", "ServiceClient", "TensorData", "TrainingClient", "errors",
]


def __getattr__(name: str):
    # The runtime pulls in torch and transformers; import it only when it is used.
    if name in ("LocalCluster", "ProcessCluster", "RayCluster"):
        from plexrl import engines

        return getattr(engines, name)
    raise AttributeError(f"module 'plexrl' has no attribute {name!r}")

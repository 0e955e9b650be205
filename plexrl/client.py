"""The public name of the job's clients (`plexrl.client.ServiceClient`); they are defined in plexrl/api/client.py."""

from plexrl.api.client import SamplingClient, ServiceClient, TrainingClient

__all__ = ["SamplingClient", "ServiceClient", "TrainingClient"]

"""The typed seam between a front and the control plane (runtime/control_plane.py): `Control`
and `ControlClient` each have every method of `ControlPlane` with its parameters, and a PlexRL
error raised in the control plane reaches the front as it is, not wrapped by the transport."""

from __future__ import annotations

import inspect

import pytest

from plexrl.api import errors
from plexrl.engines.hosting import InlineActor
from plexrl.runtime.control import Control
from plexrl.runtime.control_plane import ControlClient, ControlPlane

METHODS = [name for name, _ in inspect.getmembers(ControlPlane, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("implementation", [Control, ControlClient])
@pytest.mark.parametrize("method", METHODS)
def test_every_control_plane_method_is_implemented_with_its_parameters(implementation, method):
    declared = inspect.signature(getattr(ControlPlane, method)).parameters
    implemented = [name for name in inspect.signature(getattr(implementation, method)).parameters
                   if name != "_ray_trace_ctx"]  # what ray.remote(Control) adds to its methods, in place
    assert implemented == list(declared), (implementation.__name__, method)


class Refusing:
    """A control plane whose admission refuses, once as a PlexRL error, once wrapped as a transport wraps it."""

    def admit(self, profile, slack, provisional, timeout, ends=False):
        raise errors.AdmissionTimeout("no room for job 'a' within 0 s")

    def placement(self, job):
        wrapped = RuntimeError("the actor's task failed")
        wrapped.cause = errors.InvalidInput(f"job {job!r} is unknown")
        raise wrapped


def test_a_control_plane_error_reaches_the_front_unwrapped():
    client = ControlClient(InlineActor(Refusing(), "control"))
    with pytest.raises(errors.AdmissionTimeout, match="no room"):
        client.admit(None, 0.1, True, 0.0)
    with pytest.raises(errors.InvalidInput, match="job 'a' is unknown"):
        client.placement("a")

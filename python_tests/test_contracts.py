"""The written runtime-transport contract (``moe_dispatch.transport.base``): every registered
transport is a ``Transport`` with a ``Capabilities`` record, its operations take the base's
parameters, both plans provide the ``Plan`` protocol, and the steps helpers behave as documented."""

import dataclasses
import inspect

import pytest

from moe_dispatch.runtime.queue import drive, finish, start
from moe_dispatch.transport import TRANSPORT_NAMES, TRANSPORTS, transport_class
from moe_dispatch.transport.base import Capabilities, Plan, Transport, completed
from moe_dispatch.transport.kernels import KernelPlan, KernelTransport
from moe_dispatch.transport.torch_dist import TorchDistPlan, TorchDistTransport

OPERATIONS = (
    "agree",
    "plan",
    "dispatch",
    "forward",
    "combine",
    "refuse",
    "refusal",
    "check_errors",
    "close",
    "release",
)


def test_registry():
    assert TRANSPORTS == {"torch_dist": TorchDistTransport, "kernels": KernelTransport}
    assert TRANSPORT_NAMES == ("auto", "torch_dist", "kernels", "cuda")
    assert transport_class("cuda") is KernelTransport and transport_class("torch_dist") is TorchDistTransport
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'torch_dist', 'kernels', 'cuda'\)"):
        transport_class("nvlink")


@pytest.mark.parametrize("cls", [TorchDistTransport, KernelTransport])
def test_transports_subclass_the_contract(cls):
    assert issubclass(cls, Transport) and not inspect.isabstract(cls)
    assert isinstance(cls.capabilities, Capabilities)
    for name in OPERATIONS:
        want = list(inspect.signature(getattr(Transport, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} does not take the contract's {want}"


def test_the_contract_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Transport(None, None, None)


@pytest.mark.parametrize("cls", [TorchDistPlan, KernelPlan])
def test_plans_provide_the_protocol(cls):
    fields = {f.name for f in dataclasses.fields(cls)}
    members = [n for n in vars(Plan) if not n.startswith("_")]
    assert members
    for name in members:
        assert name in fields or isinstance(getattr(cls, name, None), property), f"{cls.__name__} lacks {name}"


def test_completed_steps_finish_at_once():
    assert drive(completed(7)) == 7
    assert list(completed()) == []
    started = start(completed("x"))
    assert started == (True, "x") and finish(completed(), started) == "x"

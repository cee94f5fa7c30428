"""The written Buffer-transport contract (``moe_dispatch.transport.base``): both transports and
both plans provide every member of their protocol, with the protocol's parameters, and the
steps helpers behave as documented."""

import dataclasses
import inspect

import pytest

from moe_dispatch.transport.base import Plan, Transport, completed, drive, finish, start
from moe_dispatch.transport.kernels import KernelPlan, KernelTransport
from moe_dispatch.transport.torch_dist import TorchDistPlan, TorchDistTransport


def _members(protocol) -> list[str]:
    own = [n for n in vars(protocol) if not n.startswith("_")]
    return sorted({*own, *getattr(protocol, "__annotations__", {})})


@pytest.mark.parametrize("cls", [TorchDistTransport, KernelTransport])
def test_transports_provide_the_protocol(cls):
    assert _members(Transport) == [
        "agree",
        "close",
        "combine",
        "dispatch",
        "forward",
        "plan",
        "plans_on_comm_thread",
        "progress",
        "release",
    ]
    assert isinstance(cls.plans_on_comm_thread, bool)
    for name in _members(Transport):
        if not callable(getattr(Transport, name, None)):
            continue  # attributes: plans_on_comm_thread above, progress set by __init__
        want = list(inspect.signature(getattr(Transport, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[: len(want)] == want, f"{cls.__name__}.{name}{got} does not take the protocol's {want}"


@pytest.mark.parametrize("cls", [TorchDistPlan, KernelPlan])
def test_plans_provide_the_protocol(cls):
    fields = {f.name for f in dataclasses.fields(cls)}
    for name in _members(Plan):
        assert name in fields or isinstance(getattr(cls, name, None), property), f"{cls.__name__} lacks {name}"


def test_completed_steps_finish_at_once():
    assert drive(completed(7)) == 7
    assert list(completed()) == []
    started = start(completed("x"))
    assert started == (True, "x") and finish(completed(), started) == "x"

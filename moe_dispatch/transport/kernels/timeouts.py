"""The kernels' wait bounds and their error record: how long a wait may last
(:func:`default_timeout_s`, :func:`kernel_timeout_s`, :func:`timeout_cycles`), and what a
timed-out launch recorded (``int32[16]``, ``csrc/kernels/intranode.cuh`` ``ErrorRecord``): read
without a device synchronisation (:func:`recorded`) and described for the timeout errors
(:func:`describe_intranode_timeout`, :func:`describe_internode_timeout`). Importable without the
extension (only :func:`timeout_cycles` on a GPU needs it).
"""

from __future__ import annotations

import math
import os

import torch

from ..._ext import require_extension

TIMEOUT_ENV = "MOE_DISPATCH_KERNEL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 100.0
# What a kernel time-out leaves and what a Buffer user does (the loopback test harnesses have reset()).
AFTER_TIMEOUT = (
    "the communication buffers are now in an undefined state: the Buffer is broken, close() it on every rank "
    "and make a new Buffer"
)

# ---------------------------------------------------------------------------------------------
# Timeouts: the kernels' error record (int32[16], csrc/kernels/intranode.cuh ErrorRecord)
# ---------------------------------------------------------------------------------------------

_PHASES = {1: "notify", 2: "dispatch", 3: "combine"}
_NODE_PHASES = {
    1: "intranode notify",
    2: "intranode dispatch",
    3: "intranode combine",
    4: "node notify",
    5: "node dispatch",
    6: "node combine",
}
_FUSED_PHASES = {
    1: "notify",
    2: "dispatch (NVLink)",
    3: "combine (NVLink)",
    4: "notify",
    5: "dispatch (RDMA)",
    6: "combine (RDMA)",
}
_ROLES = {1: "barrier", 2: "sender", 3: "receiver", 4: "coordinator"}
_SIGNAL, _TAIL, _HEAD, _HEADER = 1, 2, 3, 4
_COUNTERS = {1: "signal", 2: "tail", 3: "head", 4: "header", 5: "relayed header", 6: "forwarded tail"}


def describe_intranode_timeout(record: list[int], timeout_s: float) -> tuple[str, dict]:
    """The message and fields of a kernel error record (``int32[16]``, see ``ErrorRecord``)."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:  # the flag without a record: the offering wait could not take the record's lock
        return (
            f"moe_dispatch intranode operation timed out after timeout_s={timeout_s:g}, but the kernel's record "
            f"of which wait it was is missing; {AFTER_TIMEOUT}",
            {
                "phase": None,
                "role": None,
                "rank": None,
                "channel": None,
                "peer": None,
                "counter": None,
                "expected": None,
                "observed": None,
            },
        )
    fields = {
        "phase": _PHASES.get(phase, str(phase)),
        "role": _ROLES.get(role, str(role)),
        "rank": rank,
        "channel": channel,
        "peer": peer,
        "counter": {_SIGNAL: "signal", _TAIL: "tail", _HEAD: "head", _HEADER: "header"}.get(counter, str(counter)),
        "expected": expected,
        "observed": observed,
    }
    where = f"rank {rank} ({fields['role']}, channel {channel})" if channel >= 0 else f"rank {rank}"
    if counter == _SIGNAL:
        what = (
            f"waited at the notify barrier for rank {peer} to arrive (signal[{peer}] of rank {rank}); "
            f"saw {observed} arrivals, needed {expected}"
        )
    elif counter == _TAIL:
        what = (
            f"waited for tokens from rank {peer}: tail of queue rank {peer} -> rank {rank}, channel {channel} "
            f"should reach {expected} but stayed at {observed}"
        )
    elif counter == _HEADER:
        what = f"waited for the header of rank {peer} (its operation never started)"
    else:
        what = (
            f"waited for rank {peer} to free queue slots: head of queue rank {rank} -> rank {peer}, "
            f"channel {channel} should reach {expected} but stayed at {observed}"
        )
    message = (
        f"moe_dispatch intranode {fields['phase']} timed out after timeout_s={timeout_s:g}: {where} {what}. "
        f"Rank {peer} did not take part (crashed, hung, or called another operation); {AFTER_TIMEOUT}."
    )
    return message, fields


def describe_internode_timeout(
    record: list[int], timeout_s: float, ranks_per_node: int, node: int | None = None, fused: bool = False
) -> tuple[str, dict]:
    """Message and fields of an error record (``int32[16]``). ``node``: the node whose intranode
    engine wrote it (staged stage 2: its ranks and peers are local), None for the RDMA engine;
    ``fused``: the record of a fused pipeline's launch (ranks are global)."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:
        message = (
            f"moe_dispatch internode operation timed out after timeout_s={timeout_s:g}, but the kernel's "
            f"record of which wait it was is missing; {AFTER_TIMEOUT}"
        )
        return message, dict.fromkeys(
            (
                "stage",
                "phase",
                "role",
                "rank",
                "node",
                "channel",
                "peer",
                "peer_node",
                "counter",
                "expected",
                "observed",
            )
        )
    if node is not None:  # an intranode engine: local ranks -> global
        rank, peer = node * ranks_per_node + rank, node * ranks_per_node + peer
    nvlink = node is not None or (fused and phase in (1, 2, 3))
    fields = {
        "stage": 2 if nvlink else 1,
        "phase": (_FUSED_PHASES if fused else _NODE_PHASES).get(phase, str(phase)),
        "role": _ROLES.get(role, str(role)),
        "rank": rank,
        "node": rank // ranks_per_node,
        "channel": channel,
        "peer": peer,
        "peer_node": peer // ranks_per_node,
        "counter": _COUNTERS.get(counter, str(counter)),
        "expected": expected,
        "observed": observed,
    }
    me = f"rank {rank} (node {rank // ranks_per_node}, local {rank % ranks_per_node})"
    them = f"rank {peer} (node {peer // ranks_per_node}, local {peer % ranks_per_node})"
    link = "NVLink" if nvlink else "RDMA"
    counter_name = fields["counter"]
    if counter_name == "signal":
        what = f"waited at the {fields['phase']} for {them} to arrive; saw {observed}, needed {expected}"
    elif counter_name in ("header", "relayed header"):
        what = f"waited for the {counter_name} of {them} (its operation never started or stalled)"
    elif counter_name in ("tail", "forwarded tail"):
        what = (
            f"{fields['role']} of channel {channel} waited for tokens from {them}: the tail of {link} queue "
            f"{them} -> rank {rank}, channel {channel}, should reach {expected} but stayed at {observed}"
        )
    else:
        what = (
            f"{fields['role']} of channel {channel} waited for {them} to free slots: the head of {link} queue "
            f"rank {rank} -> {them}, channel {channel}, should reach {expected} but stayed at {observed}"
        )
    message = (
        f"moe_dispatch internode {fields['phase']} (stage {fields['stage']}, {link}) timed out after "
        f"timeout_s={timeout_s:g}: {me} {what}. Rank {peer} did not take part (crashed, hung, or called another "
        f"operation); {AFTER_TIMEOUT}."
    )
    return message, fields


def default_timeout_s(timeout_s: float | None) -> float:
    """``timeout_s``, or ``MOE_DISPATCH_KERNEL_TIMEOUT_S``, or 100: the bound of every wait of a
    loopback harness or a transport made directly, in s.

    Raises:
        ValueError: ``timeout_s`` is None and the variable is set but is no positive number.
    """
    if timeout_s is not None:
        return float(timeout_s)
    return kernel_timeout_s(DEFAULT_TIMEOUT_S)


def kernel_timeout_s(timeout_s: float) -> float:
    """The bound of the kernels' waits under a Buffer, seconds (GPU kernels and the CPU backend
    alike): ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` where set (e.g. 1, to see a hang's record at once
    while the host-side checks keep ``timeout_s``), else the Buffer's ``timeout_s``.

    Raises:
        ValueError: the variable is set but is no positive number.
    """
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return timeout_s
    try:
        bound = float(value)
    except ValueError:
        bound = math.nan
    if not (bound > 0 and math.isfinite(bound)):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return bound


def timeout_cycles(backend: str, device: torch.device, timeout_s: float) -> int:
    """``timeout_s`` as the kernels' wait bound: clock64 cycles of ``device`` ("cuda"), or
    nanoseconds (the CPU backend)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if backend == "cuda":
        clock_khz = require_extension().device_clock_khz(
            device.index if device.index is not None else torch.cuda.current_device()
        )
        return max(1, int(timeout_s * clock_khz * 1000))
    return max(1, int(timeout_s * 1e9))


def recorded(mirror: torch.Tensor | None, record: torch.Tensor) -> list[int] | None:
    """A kernel error record as ints, or None when clear, read without a device synchronisation:
    from its pinned host mirror on a GPU (whose flag is written last), from the record itself on
    the CPU backend (host memory)."""
    values = (mirror if mirror is not None else record).numpy().tolist()
    return values if values[0] or (mirror is None and values[1]) else None

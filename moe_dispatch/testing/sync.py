"""A host-synchronisation detector: ``with no_host_sync(): ...`` fails on the first call inside
the block that would make a GPU's host wait for the device.

It exists to test the sync-free mode of ``Buffer`` (the kernels with ``num_worst_tokens``,
see ``moe_dispatch.transport.kernels``) on machines without a GPU, where nothing waits for
a device and so nothing can be observed waiting. On CPU tensors it intercepts, in every
thread, the Python-level calls that on a GPU would block the host:

- reading tensor values on the host: ``Tensor.item``, ``.tolist``, ``bool()`` / ``int()`` /
  ``float()`` / ``operator.index()`` of a tensor (of a CUDA tensor where a GPU is present; of
  any tensor where none is, CPU tensors standing in for device ones), and ``.cpu()`` /
  ``.to("cpu")`` / ``.numpy()`` of a CUDA tensor;
- explicit waits: ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``,
  ``torch.cuda.Stream.synchronize``, ``torch.distributed.barrier``;
- host waits on a Buffer's communication thread: ``concurrent.futures.Future.result``. On CPU
  the Buffer's communication thread stands in for its CUDA stream, so it orders the caller
  after the thread where a GPU orders the caller's stream after the communication stream
  (no host wait there); those waits go through
  :func:`moe_dispatch.transport.base.stream_order_wait` and pass. Any other
  wait on a future is what ``Event.synchronize`` is on a GPU, and fails.

With a CUDA GPU, the block also runs under ``torch.cuda.set_sync_debug_mode("error")``, which
makes every CUDA call that synchronises implicitly raise (a device-to-host copy, an op whose
output size depends on device values).

Raises (inside the block):
    HostSyncError: naming the call and the source line that made it.

Not intercepted: calls made by C++ code (a kernel launch reads no tensor values), and reads
of host memory through numpy views of CPU tensors: the kernels' error records are read that
way, being pinned host memory on a GPU (written by the kernels, read without waiting).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import traceback

import torch
import torch.distributed as dist

from ..errors import HostSyncError
from ..runtime.queue import in_stream_order_wait

_LOCK = threading.Lock()
_ACTIVE = [0]  # nesting depth of no_host_sync blocks (the patches are process-wide)
_SAVED: list[tuple[object, str, object | None]] = []  # (owner, name, own attribute or None) to restore
_TORCH_DIR = os.path.dirname(torch.__file__)


def _caller() -> str:
    """The innermost frame outside this module and torch: where the synchronising call was made."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename != __file__ and not frame.filename.startswith(_TORCH_DIR):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<unknown>"


def _fail(name: str):
    raise HostSyncError(
        f"{name} would synchronise the host with the GPU, called from {_caller()} inside no_host_sync()"
    )


def _tensor_read(name: str, original, cpu_too: bool):
    """``Tensor.<name>`` failing for tensors that stand for device memory: CUDA tensors, and
    (``cpu_too``) CPU tensors on a machine without a GPU, where they stand in for them."""

    def wrapper(self, *args, **kwargs):
        if cpu_too or self.device.type != "cpu":
            _fail(f"Tensor.{name}() of a {self.device.type} tensor {list(self.shape)}")
        return original(self, *args, **kwargs)

    return wrapper


def _to_cpu(original):
    def wrapper(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if self.device.type != "cpu" and isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            _fail(f"Tensor.to({str(target)!r}) of a {self.device.type} tensor {list(self.shape)}")
        return original(self, *args, **kwargs)

    return wrapper


def _blocked(name: str):
    def wrapper(*args, **kwargs):
        _fail(name)

    return wrapper


def _future_result(original):
    def wrapper(self, *args, **kwargs):
        if not in_stream_order_wait():
            _fail("Future.result() (a host wait on the Buffer's communication thread)")
        return original(self, *args, **kwargs)

    return wrapper


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for every intercepted call."""
    T = torch.Tensor
    host_reads = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    stand_in = not torch.cuda.is_available()  # CPU tensors stand for device tensors
    patches = [(T, name, _tensor_read(name, getattr(T, name), stand_in)) for name in host_reads]
    patches += [(T, name, _tensor_read(name, getattr(T, name), False)) for name in ("cpu", "numpy")]
    patches.append((T, "to", _to_cpu(T.to)))
    patches += [
        (torch.cuda, "synchronize", _blocked("torch.cuda.synchronize()")),
        (torch.cuda.Event, "synchronize", _blocked("torch.cuda.Event.synchronize()")),
        (torch.cuda.Stream, "synchronize", _blocked("torch.cuda.Stream.synchronize()")),
        (dist, "barrier", _blocked("torch.distributed.barrier()")),
        (concurrent.futures.Future, "result", _future_result(concurrent.futures.Future.result)),
    ]
    return patches


@contextlib.contextmanager
def no_host_sync():
    """Fails (:class:`HostSyncError`) on any call inside the block, in any thread, that would
    make a GPU host wait for the device (see the module docstring for the list).

    The patches are process-wide while a block is open (the Buffer's communication thread must
    see them); blocks may nest. With a CUDA GPU the block runs under
    ``torch.cuda.set_sync_debug_mode("error")`` as well.
    """
    with _LOCK:
        if _ACTIVE[0] == 0:
            for owner, name, replacement in _patches():
                _SAVED.append((owner, name, owner.__dict__.get(name)))
                setattr(owner, name, replacement)
        _ACTIVE[0] += 1
    gpu = torch.cuda.is_available()
    debug_mode = torch.cuda.get_sync_debug_mode() if gpu else None
    if gpu:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if gpu:
            torch.cuda.set_sync_debug_mode(debug_mode)
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                while _SAVED:
                    owner, name, own = _SAVED.pop()
                    if own is None:  # inherited: drop the patch, the base class's attribute shows again
                        delattr(owner, name)
                    else:
                        setattr(owner, name, own)


__all__ = ["HostSyncError", "no_host_sync"]

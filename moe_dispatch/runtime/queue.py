"""One Buffer's ordered queue of operations: where transport steps run, in what order, and what
state the Buffer is in.

Every operation of a Buffer (a dispatch, a combine, a backward pass) runs in one queue, so
asynchronous calls overlap the caller's compute and a Buffer's collectives never interleave: a
high-priority CUDA stream (CUDA tensors) or one thread (CPU), the communication stream/thread.
An operation is a generator of **steps** (:mod:`moe_dispatch.transport.base`): :func:`drive`
runs them to the end, :func:`start` / :func:`finish` stop after the first yield and go on later
(receive hooks). :class:`OperationQueue` launches them as the call's mode says: ``"sync"``
returns complete, ``"async"`` with an :class:`EventOverlap`, ``"hook"`` with a
:class:`RecvHook`.

States: open; broken after an operation failed halfway (a CommError, or any error but an
argument refusal and an overflow), when every later call raises CommError at once; closed. One
thread at a time may be inside the Buffer (:meth:`OperationQueue.entered`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from ..errors import BudgetOverflowError, CommError
from ..transport.base import Steps
from .calls import Call

T = TypeVar("T")


def drive(steps: Steps[T]) -> T:
    """Runs an operation's steps to completion, waiting on each collective; returns its result.

    Data movement is never differentiated here (the autograd Functions wire gradients), and
    grad mode is per thread, so it is switched off explicitly for the communication thread.
    """
    with torch.no_grad():
        try:
            while True:
                pending = next(steps)
                if pending is not None:
                    pending.wait()
        except StopIteration as stop:
            return stop.value


def start(steps: Steps):
    """Runs an operation up to its first collective (issued, not awaited); returns what
    :func:`finish` needs."""
    with torch.no_grad():
        try:
            return False, next(steps)
        except StopIteration as stop:
            return True, stop.value


def finish(steps: Steps[T], started) -> T:
    """Completes an operation begun with :func:`start`; returns its result."""
    done, value = started
    if done:
        return value
    if value is not None:
        value.wait()
    return drive(steps)


_ORDERING = threading.local()  # .active: this thread is in stream_order_wait


def stream_order_wait(future):
    """``future.result()`` of a communication-thread future where, on a GPU, a stream would wait
    for another instead of the host: on CPU the Buffer's communication thread stands in for its
    CUDA stream, so this is the stand-in of ``wait_stream`` / ``wait_event``, not a host
    synchronisation (``moe_dispatch.testing.sync`` lets these waits pass). Returns the result."""
    previous = getattr(_ORDERING, "active", False)
    _ORDERING.active = True
    try:
        return future.result()
    finally:
        _ORDERING.active = previous


def in_stream_order_wait() -> bool:
    """Whether this thread is inside :func:`stream_order_wait`."""
    return getattr(_ORDERING, "active", False)


class EventOverlap:
    """Completion of an asynchronous operation (DeepEP's ``EventOverlap``).

    On GPU it holds a ``torch.cuda.Event`` recorded after the operation; on CPU a future of the
    Buffer's communication thread. ``EventOverlap()`` (neither) is an operation that already
    completed.
    """

    def __init__(self, event: "torch.cuda.Event | None" = None, future: "Future | None" = None):
        self.event, self.future = event, future

    def current_stream_wait(self) -> None:
        """Orders the caller after the operation: the current CUDA stream waits for the event
        (no host synchronisation); on CPU the host waits for the communication thread.

        Raises:
            CommError: the operation failed or timed out (CPU; raised here, where it is awaited).
        """
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        if self.future is not None:
            stream_order_wait(self.future)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


class RecvHook:
    """Completes an operation issued with ``return_recv_hook=True``: ``hook()`` waits for the
    issued stage and runs the rest (on the Buffer's communication thread), then returns.

    Raises:
        RuntimeError: called twice.
        CommError: the operation failed or timed out.
    """

    def __init__(self, queue: OperationQueue, steps, first):
        self._queue, self._steps, self._first = queue, steps, first
        self.called = False

    def __call__(self) -> None:
        if self.called:
            raise RuntimeError("this receive hook was already called; each hook completes its operation once")
        self.called = True
        stream_order_wait(self._queue.submit(finish, self._steps, self._first))
        self._queue.join()


# What Buffers dropped without close() left, released at the next Buffer() or close() (where
# destroying process groups cannot cut into c10d's own bookkeeping, as a garbage collection could).
_DROPPED: list[Callable[[], None]] = []


def _dropped(rank: int, comm: ThreadPoolExecutor, release: Callable[[], None]) -> None:
    """A Buffer's finalizer: warns, ends its communication thread, queues the rest."""
    warnings.warn(
        f"moe_dispatch.Buffer of EP rank {rank} was garbage-collected without close(): its process groups, "
        "threads and store keys are freed at the next Buffer() or close() of this process; call close() on "
        "every rank after the last operation",
        ResourceWarning,
        stacklevel=2,
    )
    comm.shutdown(wait=False)
    _DROPPED.append(release)


def release_dropped() -> None:
    """Frees what Buffers dropped without close() made (local: no collective)."""
    while _DROPPED:
        _DROPPED.pop()()


class OperationQueue:
    """The ordered queue of one Buffer (see the module docstring).

    Args:
        rank: this rank's index in the EP group (for messages).
        device: the Buffer's device (CUDA: the communication stream lives there).
        release: frees, without a collective, what the Buffer made (its transport and control
            plane): run at the next safe point when the Buffer is dropped without close().
    """

    def __init__(self, rank: int, device: torch.device, release: Callable[[], None]):
        self.rank, self.device = rank, device
        self._seq = 0  # operations issued, the same count on every rank (they are collective)
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"moe_dispatch-comm-{rank}")
        self._comm_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._closed = False
        self._broken: str | None = None  # why, once an operation failed halfway
        self._guard = threading.Lock()
        self._owner: tuple[int, str, str] | None = None  # (thread id, thread name, entry point) inside
        self._depth = 0
        self._queued = 0  # CPU: operations submitted to the communication thread and not done yet
        self._queued_lock = threading.Lock()
        # Dropped without close(): warn, and free what needs no peer at the next safe point.
        self._finalizer = weakref.finalize(self, _dropped, rank, self._comm, release)
        self._finalizer.atexit = False

    @property
    def broken(self) -> bool:
        """Whether an operation failed halfway (every later call raises CommError)."""
        return self._broken is not None

    def next_seq(self) -> int:
        """The next operation's number (the same on every rank of a consistent program)."""
        self._seq += 1
        return self._seq

    def check_open(self) -> None:
        """Raises RuntimeError once the Buffer was closed, CommError once it is broken."""
        if self._closed:
            raise RuntimeError(f"EP rank {self.rank}: this Buffer was closed; make a new one")
        if self._broken is not None:
            raise CommError(self._broken)

    @contextlib.contextmanager
    def entered(self, what: str, check: bool = True):
        """Marks the calling thread as inside the Buffer for ``what`` (re-entrant): a Buffer's
        operations are collective and ordered, so a second thread at the same time gets a
        RuntimeError at once (its peers' collectives would interleave differently), and the
        first thread's operation goes on. Checks that the Buffer is usable unless ``check``."""
        me = threading.get_ident()
        with self._guard:
            if self._owner is not None and self._owner[0] != me:
                _, name, inside = self._owner
                raise RuntimeError(
                    f"EP rank {self.rank}: Buffer.{what} called on thread "
                    f"{threading.current_thread().name!r} while thread {name!r} is inside Buffer.{inside}: "
                    "one thread at a time may use a Buffer (its operations are collective and ordered); use "
                    "one Buffer per thread, or a lock around the calls"
                )
            if self._owner is None:
                self._owner = (me, threading.current_thread().name, what)
            self._depth += 1
        try:
            if check:
                self.check_open()
            yield
        finally:
            with self._guard:
                self._depth -= 1
                if not self._depth:
                    self._owner = None

    def break_(self, err: BaseException) -> None:
        """Marks the Buffer broken by ``err`` (the first cause is kept)."""
        if self._broken is None:
            self._broken = (
                f"EP rank {self.rank}: this Buffer is broken and refuses every later call: a new Buffer is "
                "needed (close() this one on every rank: a broken Buffer frees what it made without waiting for "
                f"its peers). It broke on: {type(err).__name__}: {err}"
            )

    def guarded(self, fn, *args):
        """``fn(*args)``, an operation's steps: refused at once on a broken Buffer; a failure
        that may have left the ranks out of step breaks it (the agreement's ValueError and
        TypeError come before any payload moved, an overflow after it completed: those do not)."""
        if self._broken is not None:
            raise CommError(self._broken)
        try:
            return fn(*args)
        except (ValueError, TypeError, BudgetOverflowError):
            raise
        except Exception as err:
            self.break_(err)
            raise

    def submit(self, fn, *args) -> Future:
        """CPU: queues ``fn(*args)`` on the communication thread. CUDA: runs it now with the
        communication stream current, after the work already queued on the caller's stream."""
        self.check_open()
        if self.device.type != "cuda":
            with self._queued_lock:
                self._queued += 1
            future = self._comm.submit(self.guarded, fn, *args)
            future.add_done_callback(self._done)
            return future
        future: Future = Future()
        self._comm_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._comm_stream):
            future.set_result(self.guarded(fn, *args))
        return future

    def _done(self, _future: Future) -> None:
        with self._queued_lock:
            self._queued -= 1

    def idle_cpu(self) -> bool:
        """CPU tensors and nothing queued: the caller's thread may run a synchronous operation
        itself, in queue order all the same, without two thread hand-offs."""
        return self.device.type != "cuda" and not self._queued

    def join(self) -> None:
        """Orders the caller's CUDA stream after the communication stream (no host wait)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().wait_stream(self._comm_stream)

    def run(self, steps, call: Call, uses: list[torch.Tensor]) -> None:
        """Runs ``steps`` as ``call.mode`` says (see the module docstring). ``uses``: tensors of
        the caller's stream that the operation reads or writes (on CUDA the caching allocator is
        told, so an early free cannot hand their memory to other work)."""
        if call.mode == "hook":
            first = stream_order_wait(self.submit(start, steps))
            call.hook = RecvHook(self, steps, first)
            self.record(uses)
            return
        if call.mode == "sync" and self.idle_cpu():
            self.check_open()
            self.guarded(drive, steps)
            return
        future = self.submit(drive, steps)
        if call.mode == "sync":
            self.join()
            stream_order_wait(future)
            return
        self.record(uses)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(self._comm_stream)
            call.event = EventOverlap(event)
        else:
            call.event = EventOverlap(future=future)

    def record(self, tensors: list[torch.Tensor]) -> None:
        """On CUDA, tells the caching allocator that the communication stream uses ``tensors``."""
        if self.device.type == "cuda":
            for t in tensors:
                t.record_stream(self._comm_stream)

    def alloc(self, call: Call, shapes_like: list[tuple[torch.Tensor, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Outputs ``t.new_empty(shape)``; with ``allocate_on_comm_stream`` on CUDA they come from the
        communication stream's pool and are recorded for the caller's stream, which reads them."""
        if not (call.allocate_on_comm_stream and self.device.type == "cuda"):
            return [t.new_empty(shape) for t, shape in shapes_like]
        with torch.cuda.stream(self._comm_stream):
            out = [t.new_empty(shape) for t, shape in shapes_like]
        for t in out:
            t.record_stream(torch.cuda.current_stream())
        return out

    def drain(self) -> None:
        """Waits until every queued operation completed (a host synchronisation)."""
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        else:
            self._comm.submit(lambda: None).result()  # the communication thread's queue is drained

    def close(self) -> bool:
        """Waits for the queued operations and ends the communication thread; returns False when
        it was closed before (idempotent), True the first time."""
        if self._closed:
            return False
        self._closed = True
        self._finalizer.detach()
        self._comm.shutdown(wait=True)
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        return True

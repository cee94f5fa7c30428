"""Spawn a multi-process torch.distributed world on one machine (tests, CPU benchmarks).

Each rank runs ``fn(rank, world_size, *args)`` after ``init_process_group`` on a free loopback
port; its return value comes back to the parent; an exception in any rank is re-raised in the
parent with that rank's traceback; the whole world is bounded by ``timeout_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(fn_ref: tuple[str, str]) -> Callable[..., Any]:
    module, qualname = fn_ref
    obj = sys.modules.get(module) or importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


def init_rank(rank: int, world_size: int, port: int, backend: str, env: dict[str, str], timeout_s: float) -> None:
    """A spawned rank's set-up: ``env`` applied, one torch thread, the process group on the
    loopback ``port`` (NCCL: a GPU per rank)."""
    # The environment first, then fn's module: importing it may already ask CUDA for its devices
    # (Megatron's import does), and CUDA reads CUDA_VISIBLE_DEVICES only once.
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


_DONE_KEY = "moe_dispatch/spawn_world/done"


def _linger_as_store_host(rank: int, world_size: int, timeout_s: float) -> None:
    """Counts this rank's ``fn`` as returned; rank 0, whose process holds the world's TCP store,
    then stays until every rank's has (at most ``timeout_s``): a rank still reading the store
    (a failure's diagnosis names its peers from it) is not cut off by rank 0's exit."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        done = store.add(_DONE_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while rank == 0 and done < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            done = store.add(_DONE_KEY, 0)
    except (RuntimeError, ValueError):  # the store is gone (its host died): nothing to keep alive
        pass


def _rank_main(rank: int, world_size: int, port: int, backend: str, results, fn_ref, args, env, timeout_s) -> None:
    try:
        init_rank(rank, world_size, port, backend, env, timeout_s)
        import torch.distributed as dist

        try:
            results.put((rank, True, _resolve(fn_ref)(rank, world_size, *args)))
        finally:
            _linger_as_store_host(rank, world_size, timeout_s)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, f"[rank {rank}] " + traceback.format_exc()))


def _record(item, out: dict, errors: list) -> None:
    rank, ok, value = item
    if ok:
        out[rank] = value
    else:
        errors.append(value)


def _exited_silently(procs, out: dict, errors: list) -> list[int]:
    """Ranks whose process is gone without a result or an error (they never will report)."""
    reported = set(out) | {r for r in range(len(procs)) if any(e.startswith(f"[rank {r}] ") for e in errors)}
    return [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported]


def spawn_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    Args:
        world_size: number of ranks.
        fn: a module-level function (resolved by module and name in each rank, after ``env``
            is applied).
        backend: "gloo" (CPU) or "nccl". A gloo world is a CPU world: its ranks see no GPU
            (``CUDA_VISIBLE_DEVICES=''``), so it behaves the same on a machine with GPUs.
        timeout_s: wall-clock bound for the whole world; ranks still running then are killed.
        env: extra environment variables for the ranks (``CUDA_VISIBLE_DEVICES`` here wins).

    Returns:
        the ranks' return values, indexed by rank.

    Raises:
        ValueError: ``fn`` is not a module-level function.
        RuntimeError: a rank raised (its traceback in the message), died, or the world timed out.
    """
    fn_ref = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
    try:
        found = _resolve(fn_ref) is fn
    except (AttributeError, ImportError, TypeError):
        found = False
    if not found:
        raise ValueError(f"fn must be a module-level function (the ranks import it by name), got {fn!r}")
    ctx = mp.get_context("forkserver")  # fast (no re-import of torch per rank) yet fork-safe
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    results = ctx.Queue()
    port = free_port()
    env = ({"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else {}) | (env or {})
    procs = [
        ctx.Process(
            target=_rank_main, daemon=True, args=(r, world_size, port, backend, results, fn_ref, args, env, timeout_s)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"world of {world_size} ranks did not finish within {timeout_s:g} s; ranks done: {sorted(out)}"
                )
            try:
                _record(results.get(timeout=min(remaining, 1.0)), out, errors)
            except queue.Empty:
                silent = _exited_silently(procs, out, errors)
                if silent:
                    # A result put just before exiting may still be in the pipe: drain, then decide.
                    try:
                        while True:
                            _record(results.get(timeout=1.0), out, errors)
                    except queue.Empty:
                        pass
                    silent = _exited_silently(procs, out, errors)
                if silent:
                    raise RuntimeError(
                        f"ranks {silent} exited without a result (exit codes "
                        f"{[procs[r].exitcode for r in silent]})" + ("\n" + "\n".join(errors) if errors else "")
                    ) from None  # the empty queue is how the silence showed, not a cause
        if errors:
            raise RuntimeError("\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def retain_freed_memory() -> bool:
    """Makes this process keep the memory it frees, on every thread, as torch's CUDA caching
    allocator does on a GPU: glibc malloc otherwise hands big blocks back to the kernel on
    ``free`` (mmap'd blocks, and the heap's top past the trim threshold), and the next allocation
    of the same size page-faults all of it in again. Call it before the threads that allocate
    start (their arena is chosen then). For CPU benchmarks that compare schedules allocating the
    same tensors: how much of that churn a schedule meets depends on what ran before (glibc
    adapts its thresholds to the sizes freed so far), which otherwise moves the expert
    compute of ``bench_overlap`` by up to 30% between runs.

    Returns True when set (glibc), False elsewhere (another libc: nothing changed).
    """
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # glibc's <malloc.h>
    # One arena for every thread (a thread arena's heaps are at most 64 MiB: bigger blocks would be
    # mmap'd whatever M_MMAP_MAX says), no mmap'd blocks (each block comes from the arena and
    # returns to it), and no trimming.
    return all(
        libc.mallopt(option, value)
        for option, value in ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, 2**31 - 1))
    )


def local_device(local_rank: int, device_count: int) -> int:
    """The CUDA device of local rank ``local_rank`` (one process per GPU, ``LOCAL_RANK`` = GPU index).

    Raises:
        RuntimeError: more ranks on this host than visible GPUs (two ranks would share a GPU and
            NCCL would fail later with a less helpful message), naming the host and the fix.
    """
    if not 0 <= local_rank < device_count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} on host {socket.gethostname()}, but only {device_count} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start at most one rank per "
            f"GPU, e.g. torchrun --nproc-per-node {device_count}"
        )
    return local_rank


def launch_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 1800.0) -> Any:
    """Runs ``fn(rank, world_size, *args)`` on every rank and returns rank 0's value.

    Under ``torchrun`` (``RANK`` set) this process is one rank of the launched world (NCCL when
    CUDA is available, else gloo; ``world_size`` is ignored; ``timeout_s`` bounds the process
    group's collectives) and other ranks return their own value (None by convention); otherwise
    a gloo world of ``world_size`` processes is spawned, bounded by ``timeout_s``.
    """
    if "RANK" not in os.environ:
        return spawn_world(world_size, fn, *args, timeout_s=timeout_s)[0]
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_device(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()

"""Helpers for tests that run many cases inside one spawned multi-process world.

Spawning a world costs seconds (process start, gloo rendezvous), so each world runs a list
of named cases and returns, per rank, ``{case: None | traceback}``; pytest then reports each
case as its own test item.
"""

from __future__ import annotations

import functools
import traceback

from moe_dispatch.testing.launch import _resolve, free_port, init_rank, spawn_world

# moe-dispatch-bench's options of a tiny run (seconds in a CPU world): hidden sizes at 1% of the
# models', 1 warm-up and 2 timed iterations
TINY_BENCH_RUN = ["--hidden-scale", "0.01", "--iters", "2", "--warmup", "1"]


def run_cases(rank: int, world_size: int, cases: dict, *args) -> dict[str, str | None]:
    """Runs ``cases[name](rank, world_size, *args)`` in order on this rank, catching failures."""
    results: dict[str, str | None] = {}
    for name, fn in cases.items():
        try:
            fn(rank, world_size, *args)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = f"[rank {rank}] " + traceback.format_exc()
    return results


def run_megatron_cases(rank: int, world_size: int, cases: dict, before_shims: dict | None = None) -> dict:
    """:func:`run_cases` for Megatron cases: ``before_shims`` first, then ``cases`` with the CPU
    shims of ``moe_dispatch.megatron.cpu`` on (importing them imports the backend, which cases
    about its import must run before). torch.compile is off: Megatron's jit_fuser wraps
    dispatch_preprocess, seconds of compiling per rank that change nothing here
    (test_setup_metadata_compiles checks our part compiles without breaks)."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    first = run_cases(rank, world_size, before_shims or {})
    import moe_dispatch.megatron.cpu as mcpu

    mcpu.enable()
    return {**first, **run_cases(rank, world_size, cases)}


@functools.cache
def world_results(entry, world_size: int, *args, backend: str = "gloo") -> list[dict[str, str | None]]:
    """Runs ``entry(rank, world_size, *args)`` in a fresh world once per distinct argument set."""
    return spawn_world(world_size, entry, *args, backend=backend, timeout_s=600)


def assert_case(results: list[dict[str, str | None]], case: str) -> None:
    """Fails with every failing rank's traceback for ``case``."""
    failures = [r[case] for r in results if r.get(case) is not None]
    missing = [i for i, r in enumerate(results) if case not in r]
    assert not missing, f"case {case} did not run on ranks {missing}"
    assert not failures, "\n".join(failures)


class LiveWorld:
    """A gloo world that stays up across calls, for tests whose cases are drawn in the parent
    (hypothesis): the world is spawned once, each case costs only its own work.

    ``setup(rank, world_size)`` runs once per rank after the process group is up; its value is
    the rank's state (closed with ``state.close()`` at the end when it has one).
    :meth:`run` runs ``fn(rank, world_size, state, *args)`` on every rank (module-level
    functions, as for ``spawn_world``) and returns ``[(ok, value or traceback)]`` by rank.

    Args:
        world_size: ranks.
        setup: module-level function.
        timeout_s: the process group's timeout, and the bound of the set-up.
    """

    def __init__(self, world_size: int, setup, timeout_s: float = 600.0):
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self.world_size = world_size
        self._ended: str | None = None  # why the world ended early (later calls repeat it)
        self._commands = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                daemon=True,
                args=(r, world_size, port, self._commands[r], self._results, _ref(setup), timeout_s),
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        ready = self._collect(timeout_s)
        failed = [value for ok, value in ready if not ok]
        if failed:
            self.close()
            raise RuntimeError("\n".join(failed))

    def run(self, fn, *args, timeout_s: float = 300.0) -> list[tuple[bool, object]]:
        """Runs ``fn(rank, world_size, state, *args)`` on every rank; ``[(ok, value)]`` by rank.

        Raises:
            RuntimeError: a rank died or did not answer within ``timeout_s`` (the world is
                closed), or it was closed so at an earlier call.
        """
        if self._ended is not None:
            raise RuntimeError(f"the live world ended at an earlier call: {self._ended}")
        for commands in self._commands:
            commands.put((_ref(fn), args))
        return self._collect(timeout_s)

    def _collect(self, timeout_s: float) -> list[tuple[bool, object]]:
        import queue
        import time

        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                got[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in got]
                if dead or time.monotonic() > deadline:
                    self.close()
                    self._ended = (
                        f"ranks {dead or sorted(set(range(self.world_size)) - set(got))} of the live world "
                        f"{'died' if dead else f'did not answer within {timeout_s:g} s'}"
                    )
                    raise RuntimeError(self._ended) from None
        return [got[r] for r in range(self.world_size)]

    def close(self) -> None:
        for commands in self._commands:
            commands.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "LiveWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ref(fn) -> tuple[str, str]:
    return fn.__module__, fn.__qualname__


def _serve(rank, world_size, port, commands, results, setup_ref, timeout_s) -> None:
    """A live world's rank: set up, then run commands until None."""
    try:
        init_rank(rank, world_size, port, "gloo", {"CUDA_VISIBLE_DEVICES": ""}, timeout_s)
        state = _resolve(setup_ref)(rank, world_size)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, f"[rank {rank}] " + traceback.format_exc()))
        return
    results.put((rank, True, None))
    import torch.distributed as dist

    try:
        while (command := commands.get()) is not None:
            fn_ref, args = command
            try:
                results.put((rank, True, _resolve(fn_ref)(rank, world_size, state, *args)))
            except Exception:  # noqa: BLE001 - reported per call
                results.put((rank, False, f"[rank {rank}] " + traceback.format_exc()))
    finally:
        if hasattr(state, "close"):
            state.close()
        dist.destroy_process_group()

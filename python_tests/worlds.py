"""Helpers for tests that run many cases inside one spawned multi-process world.

Spawning a world costs seconds (process start, gloo rendezvous), so each world runs a list
of named cases and returns, per rank, ``{case: None | traceback}``; pytest then reports each
case as its own test item.
"""

from __future__ import annotations

import functools
import traceback

from moe_dispatch.testing.launch import spawn_world


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

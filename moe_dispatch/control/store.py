"""torch.distributed's store as the control plane reaches it: the default store, calls bounded
in time (the store may be unreachable exactly when a diagnosis needs it, and its calls block
until the store's own timeout), and short names of groups for keys."""

from __future__ import annotations

import hashlib
import threading

import torch.distributed as dist

READ_TIMEOUT_S = 2.0


def group_key(group_ranks: list[int]) -> str:
    """A short name of a group (its global ranks) for store keys."""
    return hashlib.sha1(",".join(map(str, group_ranks)).encode()).hexdigest()[:12]


def default_store():
    """torch.distributed's default store, or None (a custom process group without one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def bounded(fn, timeout_s: float = READ_TIMEOUT_S):
    """Runs ``fn()`` on a daemon thread and waits for it at most ``timeout_s``.

    Returns:
        ``(True, result)``, ``(False, exception)`` when it raised, ``(False, None)`` when it did
        not answer in time (the thread is left to finish on its own).
    """
    answer: list = []

    def run():
        try:
            answer.append((True, fn()))
        except Exception as err:  # noqa: BLE001 - handed to the caller
            answer.append((False, err))

    thread = threading.Thread(target=run, name="moe_dispatch-store", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answer[0] if answer else (False, None)

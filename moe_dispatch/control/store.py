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


def present_values(store, keys: list[str]) -> dict[str, bytes]:
    """The values of those of ``keys`` that ``store`` holds: two round trips when it holds all of
    them (a ``check`` and a ``multi_get``, both in torch 2.13 too). A get of an absent key waits
    for it until the store's own timeout, so absent keys (a peer's closed records) are found first,
    by checking halves. Raises what the store raises."""
    found = _present(store, keys)
    return dict(zip(found, store.multi_get(found))) if found else {}


def _present(store, keys: list[str]) -> list[str]:
    if not keys or store.check(keys):
        return list(keys)
    if len(keys) == 1:
        return []
    half = len(keys) // 2
    return _present(store, keys[:half]) + _present(store, keys[half:])

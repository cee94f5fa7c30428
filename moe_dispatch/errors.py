"""The errors moe_dispatch raises beyond Python's own (``ValueError``/``TypeError`` for bad
arguments, each naming the argument, the expectation and what came)."""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective failed or did not complete within the Buffer's ``timeout_s`` (a peer that
    never joined, died, or whose link was cut).

    The message names this rank, the operation and stage, and the peer ranks it waited for.
    """


class BudgetOverflowError(RuntimeError):
    """More rows than a static budget holds, on every path that has one: a dispatch with
    ``num_worst_tokens`` (``Buffer.dispatch``, and the kernels' budget mode), and a permute with
    ``num_permuted_tokens``. The message names both counts; the operation itself completed (the
    rows past the budget were dropped, or landed in scratch), so the Buffer stays usable.
    """

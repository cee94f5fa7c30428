"""Public path of the oracle: :mod:`moe_dispatch.semantics.reference`."""

from .semantics.reference import RankDispatch, combine, dispatch

__all__ = ["RankDispatch", "combine", "dispatch"]

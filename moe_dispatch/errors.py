"""Every error class moe_dispatch raises beyond Python's own, each carrying its facts as
attributes (the message says the same in words; nothing decides an error's type from its text).

- :class:`ArgumentError` (:class:`InvalidArgumentError`, a ``ValueError``, and
  :class:`ArgumentTypeError`, a ``TypeError``): a call's argument refused, on this rank or a peer
  (every rank raises at once, and the Buffer stays usable): ``argument``, ``rank``.
- :class:`MismatchError` (a ``ValueError``): the kernels' device check saw peers call an operation
  differently (or one refuse): the ranks, the field and both values.
- :class:`CommError` (a ``RuntimeError``): a collective failed or timed out; its kernel-wait
  subclasses :class:`IntranodeTimeoutError` and :class:`InternodeTimeoutError` carry the
  kernel's record.
- :class:`BudgetOverflowError`: more rows than a static budget holds.
- :class:`UnsupportedMegatronVersionError`: a megatron-core version without patch points.
- :class:`HostSyncError`, :class:`OracleMismatch` (``AssertionError``\\ s): the test helpers'
  (``moe_dispatch.testing``) verdicts.
"""

from __future__ import annotations

import contextlib


class ArgumentError(Exception):
    """A call's argument refused: the base of :class:`InvalidArgumentError` (``ValueError``) and
    :class:`ArgumentTypeError` (``TypeError``); catch those, or this for both.

    Attributes:
        argument: the argument's name (e.g. ``"topk_idx"``; a peer's agreed field, e.g.
            ``"hidden"``, where ranks differ; ``"arguments"`` where no one argument is to blame).
        rank: the EP rank whose argument it is (this rank, or the lowest refusing or differing
            peer); None before the rank is known.
    """

    def __init__(self, message: str, *, argument: str, rank: int | None = None):
        super().__init__(message)
        self.argument, self.rank = argument, rank


class InvalidArgumentError(ArgumentError, ValueError):
    """An argument with a wrong value, shape, device or count (see :class:`ArgumentError`)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a wrong type or dtype (see :class:`ArgumentError`)."""


ARGUMENT_ERRORS: dict[type, type[ArgumentError]] = {ValueError: InvalidArgumentError, TypeError: ArgumentTypeError}


def argument_error(kind: type, message: str, *, argument: str, rank: int | None = None) -> ArgumentError:
    """An :class:`ArgumentError` of ``kind`` (``ValueError`` or ``TypeError``)."""
    return ARGUMENT_ERRORS[kind](message, argument=argument, rank=rank)


def error_name(err: BaseException) -> str:
    """The name a message quotes for ``err``: an argument error's Python kind (``ValueError`` or
    ``TypeError``, what a user catches), any other error's class name."""
    if isinstance(err, ArgumentError):
        return "TypeError" if isinstance(err, TypeError) else "ValueError"
    return type(err).__name__


@contextlib.contextmanager
def checking(argument: str, rank: int | None = None):
    """Turns a ``ValueError`` / ``TypeError`` raised inside into an :class:`ArgumentError` of the
    same kind naming ``argument`` (the message unchanged, the original its cause); an
    ArgumentError passes as it is."""
    try:
        yield
    except ArgumentError:
        raise
    except (ValueError, TypeError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise argument_error(kind, str(err), argument=argument, rank=rank) from err


class MismatchError(ValueError):
    """Ranks called a collective kernel operation with arguments that do not match (the
    kernels' device check, ``moe_dispatch.transport.kernels.header``), or one of them refused it.

    Attributes: ``rank`` (the rank that recorded it), ``peer`` (the rank whose header differs),
    ``field`` (its name), ``mine`` / ``theirs`` (both values), ``via`` (None, or the local rank
    that reported the peer's header: internode).
    """

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.__dict__.update(fields)


class CommError(RuntimeError):
    """A collective failed or did not complete within the Buffer's ``timeout_s`` (a peer that
    never joined, died, or whose link was cut).

    The message names this rank, the operation and stage, and the peer ranks it waited for.
    """


class IntranodeTimeoutError(CommError):
    """A wait inside an intranode kernel ran past ``timeout_s``.

    Attributes (from the kernel's record): ``phase`` ("notify"/"dispatch"/"combine"),
    ``role``, ``rank`` (the waiting rank), ``channel`` (-1 for the barrier), ``peer`` (the rank
    whose store never came), ``counter`` ("signal"/"tail"/"head"), ``expected``, ``observed``.
    """

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.__dict__.update(fields)


class InternodeTimeoutError(CommError):
    """A wait inside an internode kernel ran past ``timeout_s``.

    Attributes: ``stage`` (1 = RDMA, 2 = NVLink), ``phase``, ``role``, ``rank`` / ``node`` (the
    waiting rank, global), ``channel`` (-1 for notify), ``peer`` / ``peer_node`` (the rank whose
    store never came), ``counter`` ("signal"/"tail"/"head"/"header"/...), ``expected``,
    ``observed``.
    """

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.__dict__.update(fields)


class BudgetOverflowError(RuntimeError):
    """More rows than a static budget holds, on every path that has one: a dispatch with
    ``num_worst_tokens`` (``Buffer.dispatch``, and the kernels' budget mode), and a permute with
    ``num_permuted_tokens``. The message names both counts; the operation itself completed (the
    rows past the budget were dropped, or landed in scratch), so the Buffer stays usable.
    """


class UnsupportedMegatronVersionError(RuntimeError):
    """The installed megatron-core is a version whose patch points are not known here
    (``moe_dispatch.megatron.compat``)."""


class HostSyncError(AssertionError):
    """A call inside ``moe_dispatch.testing.sync.no_host_sync`` would have synchronised a GPU's host."""


class OracleMismatch(AssertionError):
    """A result differs from the oracle's (``moe_dispatch.testing.cases``; the message names the
    output and the case)."""

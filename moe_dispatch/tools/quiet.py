"""Megatron-Core's known warnings on a CPU machine, filtered from the benchmarks' output.

Importing megatron-core without Transformer Engine, Apex or absl, and building its configs and
process groups on CPU, prints dozens of lines per rank that say nothing about the run (see
:data:`KNOWN_WARNINGS`). The benchmarks (``moe-dispatch-bench``, ``make train`` and the scripts
under benchmarks/) call :func:`filter_known_warnings` in every process before importing Megatron,
and print :data:`NOTE` once. Tests do not filter: pytest collects warnings itself. Any other
warning still shows.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings


@dataclasses.dataclass(frozen=True)
class KnownWarning:
    """One warning that is filtered.

    Attributes:
        category: its class (``UserWarning``, ...); ``None`` for a log record.
        message: a regular expression matched against the start of the message.
        logger: for a log record, the logger's name.
        why: why it says nothing about the run.
    """

    category: type[Warning] | None
    message: str
    logger: str | None = None
    why: str = ""


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed", why="torch fallbacks, used"),
    KnownWarning(UserWarning, r"absl\.logging is not installed", why="Python logging is used instead"),
    KnownWarning(UserWarning, r"full scope is deprecated", why="Megatron's own default cuda_graph_scope, no graphs"),
    KnownWarning(UserWarning, r"moe_ffn_hidden_size is not set", why="ffn_hidden_size is meant"),
    KnownWarning(
        FutureWarning,
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        why="Megatron's own calls into torch",
    ),
    KnownWarning(None, r"No CUDA runtime is found", logger="torch.utils.cpp_extension", why="a CPU machine"),
)

NOTE = "Megatron-Core's known warnings on CPU are filtered (moe_dispatch.tools.quiet.KNOWN_WARNINGS)"


class _DropKnownRecords(logging.Filter):
    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


_INSTALLED = False


def filter_known_warnings() -> None:
    """Filters :data:`KNOWN_WARNINGS` in this process (idempotent). Call it before importing
    megatron-core, in every process that imports it (spawned ranks do not inherit filters)."""
    global _INSTALLED
    if _INSTALLED:
        return
    by_logger: dict[str, list[str]] = {}
    for known in KNOWN_WARNINGS:
        if known.logger is None:
            warnings.filterwarnings("ignore", message=known.message, category=known.category)
        else:
            by_logger.setdefault(known.logger, []).append(known.message)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropKnownRecords(patterns))
    _INSTALLED = True

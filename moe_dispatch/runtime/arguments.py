"""``Buffer()``'s arguments: checked and resolved on each rank (:func:`resolve_arguments`, nothing
collective), then agreed by every rank of the group through torch.distributed's store before any
process group exists (:func:`agree_arguments`), so a refusal on any rank leaves the world as it was
and every rank raises the same error."""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings

import torch
import torch.distributed as dist

from ..config import Config, check_config, num_sms_error
from ..control.agreement import agree_in_store
from ..control.groups import align_group_count, group_count
from ..errors import InvalidArgumentError, argument_error, error_name
from ..semantics.validation import check_timeout_s, is_int
from ..topology import Topology
from ..transport import choose_transport, log_choice, transport_class
from ..transport.base import TransportOptions

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class BufferArguments:
    """``Buffer()``'s arguments as every rank resolved and agreed them.

    Attributes:
        group: the EP process group (the world group when None was passed).
        topology: this rank's place in it.
        device: where the tensors live.
        transport: the registered transport name (``"auto"`` and old names resolved).
        transport_reason: why (``"requested"``, or ``"auto"``'s reason).
        config: the kernels' Config, ``"auto"`` or None.
        timeout_s: bound on every collective.
        num_chunks: the torch_dist pipeline depth, or None.
    """

    group: dist.ProcessGroup
    topology: Topology
    device: torch.device
    transport: str
    transport_reason: str
    config: Config | str | None
    timeout_s: float
    num_chunks: int | None


def agree_arguments(
    group, ranks_per_node, transport, num_sms, timeout_s, config, num_chunks, device
) -> BufferArguments:
    """Resolves ``Buffer()``'s arguments on this rank, agrees them with every rank of the group
    through the store (no process group is made), and aligns the ranks' count of c10d groups.

    Raises (on every rank alike, see :class:`~moe_dispatch.buffer.Buffer`):
        InvalidArgumentError / ArgumentTypeError: a rank refused its arguments (the first such
            rank's error, of its kind) or the ranks' resolved arguments differ.
        RuntimeError: a rank refused with a RuntimeError (no extension, no GPU).
        CommError: a rank did not post within ``timeout_s``.
    """
    args, refused = resolve_arguments(group, ranks_per_node, transport, num_sms, timeout_s, config, num_chunks, device)
    rank = dist.get_rank(args["group"])
    posts = agree_in_store(
        dist.get_process_group_ranks(args["group"]),
        rank,
        {**(args["posted"] if refused is None else {"error": refused}), _GROUP_COUNT: group_count()},
        args["timeout_s"],
    )
    check_posts(posts, rank, args)
    align_group_count(max((p[_GROUP_COUNT] for p in posts if p[_GROUP_COUNT] is not None), default=None))
    return BufferArguments(**{f.name: args[f.name] for f in dataclasses.fields(BufferArguments)})


def default_ranks_per_node(group: dist.ProcessGroup) -> int:
    """EP ranks per node of ``group``, from where its ranks run.

    The node size is ``LOCAL_WORLD_SIZE`` (torchrun), else the visible GPU count; the group's
    global ranks are mapped to nodes of that size and must sit in equal contiguous runs (a
    Megatron EP group, strided by TP x CP, does on homogeneous nodes): the run length is the
    answer. Without a known node size, or with uneven runs, the group is one "node" (a flat
    exchange, still exact), with a warning in the latter case saying how to set it.
    """
    world_size = dist.get_world_size(group)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    node_size = int(local) if local is not None and local.isdigit() and int(local) > 0 else None
    if node_size is None and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        node_size = torch.cuda.device_count()
    if node_size is None:
        return world_size
    nodes = [r // node_size for r in dist.get_process_group_ranks(group)]
    runs = [len(list(run)) for _, run in itertools.groupby(nodes)]
    if len(runs) == len(set(nodes)) and len(set(runs)) == 1:
        return runs[0]
    warnings.warn(
        f"the EP group's ranks sit on nodes {nodes} (node size {node_size}), not as equal contiguous runs: "
        "moe_dispatch treats the group as one node (exact, but no inter-node de-duplication); pass "
        "ranks_per_node= to set the hierarchy",
        stacklevel=3,
    )
    return world_size


DEFAULT_TIMEOUT_S = 300.0


def _device(device: torch.device | str | None, backend: str) -> torch.device:
    """The device of a Buffer on a group of ``backend`` (see ``Buffer(device=...)``)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {str(device)!r}")
    if device.type == "cpu":
        if "nccl" in backend:
            raise ValueError(
                "device='cpu' with an NCCL group: NCCL moves CUDA tensors only; use a gloo group for "
                "CPU tensors, or device=None for the current CUDA device"
            )
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} but torch sees no CUDA GPU")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def resolve_arguments(
    group, ranks_per_node, transport, num_sms, timeout_s, config, num_chunks, device=None
) -> tuple[dict, dict | None]:
    """``Buffer()``'s arguments checked and resolved on this rank (nothing collective).

    Returns:
        ``(args, None)``: the resolved arguments, ``args["posted"]`` what the ranks compare; or
        ``(args, refused)`` with ``refused = {"field", "type", "message"}`` for the first bad
        argument (``args`` then holds what is needed to agree: the group, the timeout).
    """
    args = {"group": dist.group.WORLD, "timeout_s": DEFAULT_TIMEOUT_S}
    field = "group"
    try:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            # Agreed over the world: peers that pass None learn of it at once.
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None (the world), got {type(group).__name__}"
            )
        args["group"] = group = group if group is not None else dist.group.WORLD
        field = "timeout_s"
        args["timeout_s"] = check_timeout_s(timeout_s)
        field = "ranks_per_node"
        given_ranks_per_node = ranks_per_node
        if ranks_per_node is None:
            ranks_per_node = default_ranks_per_node(group)
        if not is_int(ranks_per_node) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        topology = Topology(dist.get_rank(group), dist.get_world_size(group), ranks_per_node)
        field = "transport"
        if transport != "auto":
            transport = transport_class(transport).name
        field = "num_sms"
        if num_sms is not None and (error := num_sms_error(num_sms)) is not None:
            raise ValueError(f"num_sms {error}, or None for the default")
        field = "config"
        if isinstance(config, str) and config != "auto":
            raise ValueError(f"config must be a moe_dispatch.config.Config, None or 'auto', got {config!r}")
        if config != "auto":
            check_config(config)
        if config is not None:
            if num_sms is not None:
                budget = "'auto'" if config == "auto" else f"(num_sms={config.num_sms})"
                raise ValueError(f"num_sms={num_sms} and config {budget} both set the SM budget: pass one")
        elif num_sms is not None:
            config = Config(num_sms=num_sms)
        field = "num_chunks"
        if num_chunks is not None and (not is_int(num_chunks) or num_chunks < 1):
            raise ValueError(
                f"num_chunks must be a positive int (the torch_dist pipeline depth: chunks per dispatch "
                f"and combine) or None for the default, got {num_chunks!r}"
            )
        field = "device"
        backend = str(dist.get_backend(group))
        device = _device(device, backend)
        field = "transport"
        reason = "requested"
        if transport == "auto":
            transport, reason = choose_transport(device)
            log_choice(transport, reason)
        if device.type == "cuda" and "nccl" not in backend and transport != "kernels":
            raise ValueError(
                f"device={str(device)!r} with a {backend} group needs transport='kernels' (the kernels move "
                f"the CUDA tensors, {backend} carries only their buffer handles and checks); transport="
                f"{transport!r} ({reason}) would run its collectives on {backend}, which cannot move CUDA tensors"
            )
        transport_class(transport).check_options(topology, TransportOptions(timeout_s, device, config, num_chunks))
        if transport == "kernels":
            num_chunks = None
    except (TypeError, ValueError, RuntimeError) as err:
        args["error"] = err
        return args, {"field": field, "type": error_name(err), "message": str(err)}
    args.update(
        topology=topology,
        transport=transport,
        transport_reason=reason,
        device=device,
        config=config,
        num_chunks=num_chunks,
        given_ranks_per_node=given_ranks_per_node,
        posted={
            "device": device.type,
            "transport": transport,
            "ranks_per_node": ranks_per_node,
            "num_chunks": num_chunks,
            **(_posted_config(config) if transport == "kernels" else {"config": None}),
        },
    )
    return args, None


def _posted_config(config: Config | str | None) -> dict:
    """What the ranks compare of the kernels' Config (None: the default): each field by name (a
    difference is named as ``config.num_sms``, not as two whole reprs), or ``"auto"``."""
    if config == "auto":
        return {"config": "auto"}
    config = config or Config()
    return {"config": "Config", **{f"config.{f.name}": getattr(config, f.name) for f in dataclasses.fields(config)}}


# What the ranks post of c10d's group count when they agree Buffer()'s arguments (control.groups).
_GROUP_COUNT = "c10d group count"
_UNCHANGED = "no rank created anything, so a Buffer() with good arguments can follow"


def check_posts(posts: list[dict], rank: int, args: dict) -> None:
    """Raises, on every rank alike, when a rank refused its arguments (the first such rank's
    error, of its type) or the ranks' resolved arguments differ (ValueError)."""
    bad = [(r, post["error"]) for r, post in enumerate(posts) if "error" in post]
    if bad:
        first, error = bad[0]
        others = f" (EP ranks {[r for r, _ in bad[1:]]} refused theirs too)" if len(bad) > 1 else ""
        message = (
            f"EP rank {rank}: Buffer() refused by EP rank {first}{others}: {error['field']}: {error['message']}; "
            f"{_UNCHANGED}"
        )
        if error["type"] == "RuntimeError":
            raise RuntimeError(message) from args.get("error")
        kind = TypeError if error["type"] == "TypeError" else ValueError  # the posted type, by name
        raise argument_error(kind, message, argument=error["field"], rank=first) from args.get("error")
    mine = args["posted"]
    for field, value in mine.items():
        differ = [(r, post.get(field)) for r, post in enumerate(posts) if post.get(field) != value]
        if differ:
            theirs = ", ".join(f"{v!r} on EP rank {r}" for r, v in differ)
            resolved = (
                " (resolved from LOCAL_WORLD_SIZE or the GPU count where not given)"
                if field == "ranks_per_node" and args["given_ranks_per_node"] is None
                else ""
            )
            raise InvalidArgumentError(
                f"EP rank {rank}: Buffer() arguments differ across ranks: {field} is {value!r} here{resolved} but "
                f"{theirs}; every rank must pass the same ({_UNCHANGED})",
                argument=field,
                rank=differ[0][0],
            )

"""The main job: moe_dispatch against Megatron-Core's own alltoall dispatcher, side by side.

``moe-dispatch-bench`` (or ``python -m moe_dispatch.tools.bench``). Without ``torchrun`` it spawns a
CPU world (gloo, default 4 processes) and runs every case on two hierarchies of it (2 simulated
nodes x 2, and 1 node x 4); under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set)
each process is one rank, on NCCL when CUDA is there, with the nodes that LOCAL_WORLD_SIZE gives.

Per model preset (routing shaped like DeepSeek-V3, Qwen3-30B-A3B, Mixtral-8x7B, from one shared
seed: :mod:`moe_dispatch.testing.routing`), tokens per rank and hierarchy it times, interleaved in
the same iterations (each iteration's time is the max over ranks, dispatch + combine):

- ``ours``: Megatron-Core's flex dispatcher with moe_dispatch's backend "custom" (the permute fused
  into dispatch, the unpermute into combine), through Megatron's dispatcher calls
  (``dispatch_preprocess`` .. ``combine_postprocess``);
- ``alltoall``: Megatron-Core's alltoall dispatcher (``moe_token_dispatcher_type="alltoall"``) on the
  same routing and tensors, through the same calls (``moe_dispatch.megatron.cpu`` on a CPU world);
- ``buffer``: the bare ``moe_dispatch.Buffer`` dispatch + combine (no permute);
- ``flat floor``: a bare ``all_to_all_single`` moving each token once to each rank that holds it, and
  back (splits precomputed, buffers prebuilt);
- ``two-stage floor``: the hierarchy's two collectives alone (inter-node, then intra-node, and back)
  with prebuilt buffers of the de-duplicated rows.

Every rank checks its results against :mod:`moe_dispatch.reference` with ``torch.equal``: Buffer's
dispatch and combine outputs, the backend's expert input (rows, split sizes, probabilities: a
permute of the oracle's dispatch) and combine output, and that Megatron's alltoall dispatcher hands
its experts the same rows. The cross-node bytes of each side are counted against the de-dup lower
bound. Only rank 0 prints: a table within 120 columns (ours and alltoall, their ratio with its
spread, the cross-node bytes, the oracle check; without Megatron-Core, bare Buffer and the
two-stage floor), one verdict line per model, and a JSON file with every figure, the verdicts, the
configuration, the hosts, versions, date and commit. ``benchmarks/simcluster`` runs it on shaped
links.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..ops.permute import permute, unpermute
from ..runtime.arguments import DEFAULT_TIMEOUT_S  # a rank that never joins fails the run after this
from ..semantics import reference
from ..semantics.layout import get_dispatch_layout_reference
from ..testing import routing
from ..testing.launch import launch_ranks, spawn_world
from ..testing.models import moe_config_fields
from ..transport.torch_dist import TorchDistTransport
from . import bench_page
from .env import source_commit
from .quiet import NOTE as QUIET_NOTE
from .quiet import filter_known_warnings

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# CPU defaults keep `make demo` (3 models x 2 sizes x 2 hierarchies, 4 processes on 2 cores) near a minute.
CPU_HIDDEN_SCALE, CPU_ITERS, CPU_WARMUP, CPU_WORLD = 0.125, 7, 2, 4
GPU_ITERS, GPU_WARMUP = 50, 10
DEFAULT_TOKENS = (4096, 256)
SIDES = ("ours", "alltoall", "buffer", "flat_floor", "two_stage_floor")
# What the figures mean, stored in the JSON (the page prints a short legend: bench_page.LEGENDS).
DEFINITIONS = {
    "latency_ms": "per iteration the max over ranks of dispatch (and combine, and their sum); median, min, max, p10, "
    "p90 over the timed iterations; every side runs in every iteration, in rotating order",
    "ours": "MoEFlexTokenDispatcher with moe_flex_dispatcher_backend='custom': dispatch_preprocess + token_dispatch + "
    "dispatch_postprocess, then combine_preprocess + token_combine + combine_postprocess",
    "alltoall": "MoEAlltoAllTokenDispatcher (moe_token_dispatcher_type='alltoall'), the same calls",
    "buffer": "Buffer.dispatch / Buffer.combine (layout included, no permute)",
    "flat_floor": "one all_to_all_single over all ranks moving each token once to each rank holding it, and back "
    "(splits precomputed, buffers prebuilt)",
    "two_stage_floor": "the hierarchy's collectives alone: stage 1 over the inter-node group, then stage 2 over the "
    "intra-node group, and back, with prebuilt buffers of the de-duplicated rows",
    "ratio": "median(a) / median(b) of the dispatch + combine totals; spread: p10 and p90 of the per-iteration ratios",
    "bytes": "rows x H x element size of hidden payload crossing nodes per direction, summed over ranks (combine moves "
    "the same rows back); lower bound: sum over tokens of |nodes(t) minus the source's node| x H x element size",
}
# glibc settings for the CPU world's processes (unless already set): freed buffers stay in the
# heap, so the tens of MB each dispatch allocates do not page-fault afresh on every call (what
# the CUDA caching allocator gives on GPU). The floors reuse their buffers either way.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (picklable: it travels to the spawned ranks).

    Attributes:
        models: preset names of :data:`moe_dispatch.testing.routing.PRESETS`.
        num_tokens: T values, tokens per rank.
        hidden_scale: factor on each model's hidden size (1.0 = full size).
        world_size: W.
        topologies: ranks per node L of each hierarchy to run (each divides W).
        iters: timed iterations; warmup: untimed ones before.
        dtype: key of :data:`DTYPES`.
        seed: the shared seed every rank's inputs derive from.
        timeout_s: bound, in seconds, on every collective (``Buffer(timeout_s=...)``; under
            torchrun also the process group's timeout).
        megatron: compare with Megatron-Core's dispatchers (needs megatron-core).
        progress_path: a file rank 0 appends one line to per finished step (the CPU world's
            progress display reads it), or None.
    """

    models: tuple[str, ...]
    num_tokens: tuple[int, ...]
    hidden_scale: float
    world_size: int
    topologies: tuple[int, ...]
    iters: int
    warmup: int
    dtype: str
    seed: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    megatron: bool = True
    progress_path: str | None = None

    @property
    def num_cases(self) -> int:
        return len(self.models) * len(self.num_tokens) * len(self.topologies)


def _torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_world_size)`` when launched by torchrun, else None."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    if not all(k in os.environ for k in keys):
        return None
    return tuple(int(os.environ[k]) for k in keys)  # type: ignore[return-value]


def _have_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def _parse_args(argv: list[str] | None, torchrun: tuple[int, int, int] | None) -> tuple[BenchConfig, pathlib.Path]:
    parser = argparse.ArgumentParser(
        prog="moe-dispatch-bench",
        description="moe_dispatch's Megatron backend against Megatron-Core's alltoall dispatcher, bare Buffer and the "
        "collectives' floors, on DeepSeek-V3, Qwen3-30B-A3B and Mixtral-8x7B routing; every rank checks its results "
        "against the oracle. CPU world (gloo, 4 processes) by default; under torchrun one rank per process.",
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(routing.PRESETS), default=list(routing.PRESETS), help="presets to run"
    )
    parser.add_argument(
        "--num-tokens",
        type=int,
        nargs="+",
        default=list(DEFAULT_TOKENS),
        help=f"tokens per rank, one case each (default {' '.join(map(str, DEFAULT_TOKENS))})",
    )
    parser.add_argument(
        "--hidden-scale",
        type=float,
        default=None,
        help=f"factor on each model's hidden size (default {CPU_HIDDEN_SCALE} on the CPU world, 1.0 with GPUs)",
    )
    parser.add_argument("--full", action="store_true", help="full hidden sizes (same as --hidden-scale 1)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help=f"ranks of the CPU world (default {CPU_WORLD}); under torchrun: WORLD_SIZE",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        nargs="+",
        default=None,
        help="ranks per node L of each hierarchy to run (default on the CPU world: W/2 and W, i.e. 2 nodes and 1 "
        "node; under torchrun: LOCAL_WORLD_SIZE)",
    )
    parser.add_argument(
        "--iters", type=int, default=None, help=f"timed iterations (default {CPU_ITERS} on CPU, {GPU_ITERS} on GPU)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed warm-up iterations (default {CPU_WARMUP} on CPU, {GPU_WARMUP} on GPU)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="hidden payload dtype (default bf16)")
    parser.add_argument("--seed", type=int, default=0, help="shared seed of every rank's inputs (default 0)")
    parser.add_argument(
        "--no-megatron", action="store_true", help="leave out Megatron-Core's dispatchers (Buffer and floors only)"
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"bound in seconds on every collective: a rank that fails or never joins makes the others "
        f"raise CommError naming it (default {DEFAULT_TIMEOUT_S:g}; under torchrun also the "
        f"process group's timeout)",
    )
    parser.add_argument(
        "--json",
        type=pathlib.Path,
        default=pathlib.Path("bench_results/bench.json"),
        help="where to write the figures (default bench_results/bench.json)",
    )
    args = parser.parse_args(argv)

    gpu = torchrun is not None and torch.cuda.is_available()
    if args.full and args.hidden_scale not in (None, 1.0):
        parser.error(f"--full means --hidden-scale 1; got --hidden-scale {args.hidden_scale}")
    hidden_scale = 1.0 if args.full else args.hidden_scale
    if hidden_scale is None:
        hidden_scale = 1.0 if gpu else CPU_HIDDEN_SCALE
    if torchrun is not None:
        _, world_size, local_world_size = torchrun
        if args.world_size not in (None, world_size):
            parser.error(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={world_size}")
        topologies = args.ranks_per_node or [local_world_size]
    else:
        world_size = CPU_WORLD if args.world_size is None else args.world_size
        topologies = args.ranks_per_node or sorted({max(1, world_size // 2), world_size})
    iters = args.iters if args.iters is not None else (GPU_ITERS if gpu else CPU_ITERS)
    warmup = args.warmup if args.warmup is not None else (GPU_WARMUP if gpu else CPU_WARMUP)
    for name, value, low in (
        ("--num-tokens", min(args.num_tokens), 1),
        ("--world-size", world_size, 1),
        ("--ranks-per-node", min(topologies), 1),
        ("--iters", iters, 1),
        ("--warmup", warmup, 0),
    ):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    for ranks_per_node in topologies:
        if world_size % ranks_per_node != 0:
            parser.error(f"--ranks-per-node {ranks_per_node} must divide the world size {world_size}")
    if not hidden_scale > 0:
        parser.error(f"--hidden-scale must be positive, got {hidden_scale}")
    if not args.timeout_s > 0:
        parser.error(f"--timeout-s must be positive, got {args.timeout_s}")
    config = BenchConfig(
        models=tuple(dict.fromkeys(args.models)),
        num_tokens=tuple(dict.fromkeys(args.num_tokens)),
        hidden_scale=hidden_scale,
        world_size=world_size,
        topologies=tuple(dict.fromkeys(topologies)),
        iters=iters,
        warmup=warmup,
        dtype=args.dtype,
        seed=args.seed,
        timeout_s=args.timeout_s,
        megatron=not args.no_megatron and _have_megatron(),
    )
    return config, args.json


# -- one rank ------------------------------------------------------------------------------------
def _rank_inputs(
    preset: routing.ModelPreset, config: BenchConfig, num_tokens: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(x [T, H], topk_idx [T, K] int64, topk_weights [T, K] fp32)`` on the CPU,
    from the shared seed; each model and size gets its own streams."""
    case = sorted(routing.PRESETS).index(preset.name) * 1_000_003 + num_tokens
    gen = routing.make_generator(routing.rank_seed(config.seed, case), rank)
    logits = routing.router_logits(num_tokens, preset.num_experts, gen)
    topk_idx, topk_weights = routing.select_experts(logits, preset)
    x = torch.randn(num_tokens, preset.hidden, generator=gen).to(DTYPES[config.dtype])
    return x, topk_idx, topk_weights


def _expert(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """The stand-in expert: a function of the row and the holding rank only, so the oracle can
    rebuild every rank's output from the inputs, and a row combined from the wrong rank shows."""
    return rows * (rank + 1)


def _mismatches(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], rank: int) -> list[str]:
    """One line per ``(name, got, oracle)`` pair that is not bit-identical (None must match None)."""
    out = []
    for name, got, want in pairs:
        got = got.cpu() if isinstance(got, torch.Tensor) else got
        want = want.cpu() if isinstance(want, torch.Tensor) else want
        if got is None or want is None:
            if got is not want:
                out.append(f"rank {rank}: {name}: got {type(got).__name__}, oracle {type(want).__name__}")
        elif got.shape != want.shape or got.dtype != want.dtype:
            out.append(
                f"rank {rank}: {name}: got {list(got.shape)} {got.dtype}, oracle {list(want.shape)} {want.dtype}"
            )
        elif not torch.equal(got, want):
            bad = (got != want).reshape(got.shape[0], -1).any(1) if got.dim() else torch.ones(1, dtype=torch.bool)
            rows = torch.nonzero(bad).flatten()
            out.append(
                f"rank {rank}: {name}: {rows.numel()} of {max(1, got.shape[0] if got.dim() else 1)} rows differ from "
                f"the oracle (first: {rows[:5].tolist()})"
            )
    return out


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": ordered[int(0.1 * (n - 1))],
        "p90": ordered[round(0.9 * (n - 1))],
    }


def _ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """median(num) / median(den), with the p10 and p90 of the per-iteration ratios as its spread."""
    per_iter = _summary([a / b for a, b in zip(num, den)])
    return {"ratio": statistics.median(num) / statistics.median(den), "p10": per_iter["p10"], "p90": per_iter["p90"]}


class _Megatron:
    """Megatron-Core's two dispatchers over the EP group of a CPU or GPU world (built per case)."""

    def __init__(self, world_size: int):
        from megatron.core import parallel_state as ps

        import moe_dispatch.megatron as mdm

        if not torch.cuda.is_available():
            import moe_dispatch.megatron.cpu as mcpu

            mcpu.enable(redirect_cuda_tensors=False)
            # Megatron wraps dispatch_preprocess in torch.compile: on CPU it would only cost compile time
            torch._dynamo.config.disable = True
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(expert_model_parallel_size=world_size)
        self.mdm = mdm

    def dispatcher(self, preset: routing.ModelPreset, dtype: torch.dtype, kind: str, ranks_per_node: int):
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig

        pg = get_default_pg_collection()
        cfg = TransformerConfig(
            **moe_config_fields(
                hidden=preset.hidden,
                heads=1,
                experts=preset.num_experts,
                topk=preset.topk,
                ffn=16,
                dtype=dtype,
                moe_token_dispatcher_type="alltoall",
                moe_router_dtype="fp32",
                expert_model_parallel_size=pg.ep.size(),
                use_cpu_initialization=True,
                add_bias_linear=False,
            )
        )
        if kind == "ours":
            self.mdm.configure(cfg, ranks_per_node=ranks_per_node)
        local = preset.num_experts // pg.ep.size()
        cls = MoEFlexTokenDispatcher if kind == "ours" else MoEAlltoAllTokenDispatcher
        experts = list(range(pg.ep.rank() * local, (pg.ep.rank() + 1) * local))
        return cls(local, experts, config=cfg, pg_collection=pg)  # "ours" makes its Buffer here, not in a timed call


def _megatron_calls(dispatcher, x: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """``(dispatch, combine)`` callables through Megatron's dispatcher contract."""

    def dispatch():
        hidden, p = dispatcher.dispatch_preprocess(x.view(x.shape[0], 1, -1), routing_map, probs)
        hidden, p = dispatcher.token_dispatch(hidden, p)
        return dispatcher.dispatch_postprocess(hidden, p)

    def combine(y):
        return dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(y)))

    return dispatch, combine


class _Floors:
    """The bare collectives' floors of one case: the flat exchange and the two stages, with splits
    from the counts and prebuilt buffers of hidden rows."""

    def __init__(self, x: torch.Tensor, in_rank: list[torch.Tensor], rank: int, ranks_per_node: int, groups):
        world = len(in_rank)
        nodes = world // ranks_per_node
        node, local = rank // ranks_per_node, rank % ranks_per_node
        self.group, (self.inter, self.intra) = groups["world"], groups[ranks_per_node]
        mine = in_rank[rank]
        self.flat_send = mine.sum(0).tolist()
        self.flat_recv = [int(in_rank[s][:, rank].sum()) for s in range(world)]
        self.flat_s = x[torch.nonzero(mine.t())[:, 1].to(x.device)].contiguous().view(torch.uint8)
        self.flat_r = self.flat_s.new_empty((sum(self.flat_recv), self.flat_s.shape[1]))
        held = [m.view(-1, nodes, ranks_per_node) for m in in_rank]
        peers = [m * ranks_per_node + local for m in range(nodes)]  # my inter-node group, by node
        self.s1_send = held[rank].any(2).sum(0).tolist()
        self.s1_recv = [int(held[p][:, node].any(1).sum()) for p in peers]
        # stage 2: I forward to local rank l' the rows of sources (m, my l) held by (my node, l')
        self.s2_send = [sum(int(held[p][:, node, lp].sum()) for p in peers) for lp in range(ranks_per_node)]
        self.s2_recv = [
            sum(int(held[m * ranks_per_node + lp][:, node, local].sum()) for m in range(nodes))
            for lp in range(ranks_per_node)
        ]
        width = self.flat_s.shape[1]
        self.b1s, self.b1r = (x.new_zeros((sum(n), width), dtype=torch.uint8) for n in (self.s1_send, self.s1_recv))
        self.b2s, self.b2r = (x.new_zeros((sum(n), width), dtype=torch.uint8) for n in (self.s2_send, self.s2_recv))

    def flat(self, back: bool) -> None:
        send, recv = (self.flat_r, self.flat_s) if back else (self.flat_s, self.flat_r)
        ins, outs = (self.flat_recv, self.flat_send) if back else (self.flat_send, self.flat_recv)
        dist.all_to_all_single(recv, send, outs, ins, group=self.group)

    def two_stage(self, back: bool) -> None:
        stages = [
            (self.inter, self.b1s, self.b1r, self.s1_send, self.s1_recv),
            (self.intra, self.b2s, self.b2r, self.s2_send, self.s2_recv),
        ]
        for group, s, r, ns, nr in reversed(stages) if back else stages:
            if group is None:
                continue
            if back:
                dist.all_to_all_single(s, r, ns, nr, group=group)
            else:
                dist.all_to_all_single(r, s, nr, ns, group=group)


def _stage_groups(world: int, topologies: tuple[int, ...], rank: int) -> dict:
    """The floors' process groups: the world, and per hierarchy this rank's (inter-node, intra-node)
    groups (None where a group would have one rank). Collective."""
    groups: dict = {"world": dist.group.WORLD}
    for ranks_per_node in topologies:
        nodes = world // ranks_per_node
        mine = []
        for ranks in [[m * ranks_per_node + lr for m in range(nodes)] for lr in range(ranks_per_node)] + [
            list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)
        ]:
            group = dist.new_group(ranks) if len(ranks) > 1 else None  # every rank creates every group
            if rank in ranks:
                mine.append(group)
        groups[ranks_per_node] = tuple(mine)  # (inter-node, intra-node)
    return groups


def _bench_case(
    buf: Buffer,
    megatron: _Megatron | None,
    groups: dict,
    preset: routing.ModelPreset,
    num_tokens: int,
    config: BenchConfig,
    sync: Callable[[], None],
) -> dict:
    """Checks and times one (model, tokens, hierarchy) on this rank. Collective over the world.
    Returns the figures (reduced over ranks, identical on every rank)."""
    rank, world, ranks_per_node = buf.rank, buf.world_size, buf.topology.ranks_per_node
    device, dtype, num_experts = buf.device, DTYPES[config.dtype], preset.num_experts
    nodes = world // ranks_per_node
    figures: dict = {
        "model": preset.name,
        "num_tokens": num_tokens,
        "num_nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "num_experts": num_experts,
        "topk": preset.topk,
        "hidden": preset.hidden,
        "hidden_full": routing.PRESETS[preset.name].hidden,
    }
    if num_experts % world != 0:
        figures["skipped"] = f"num_experts={num_experts} is not divisible by the world size {world}"
        return figures
    inputs = [_rank_inputs(preset, config, num_tokens, s) for s in range(world)]
    xs, idxs, ws = (list(t) for t in zip(*inputs))
    x, topk_idx, weights = (t.to(device) for t in inputs[rank])
    in_rank = [get_dispatch_layout_reference(t, num_experts, world, ranks_per_node)[3] for t in idxs]
    per_rank = num_experts // world
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=device).scatter_(1, topk_idx, True)
    probs = torch.zeros(num_tokens, num_experts, device=device).scatter_(1, topk_idx, weights)

    # The oracle of this rank. Its combine outputs depend only on its own tokens and the rows their
    # holders return, so it runs on a world where the other ranks send nothing ("alone").
    want = reference.dispatch(xs, idxs, ws, num_experts, ranks_per_node, ranks=[rank])[0]
    want_permuted = permute(want.recv_x, want.recv_topk_idx, want.recv_topk_weights, num_local_experts=per_rank)
    alone = [t if s == rank else t[:0] for s, t in enumerate(idxs)]
    mine = [xs[rank][in_rank[rank][:, r]] for r in range(world)]
    want_out = reference.combine([_expert(m, r) for r, m in enumerate(mine)], alone, num_experts, ranks_per_node)[rank]
    held = [reference.dispatch(xs, alone, None, num_experts, ranks_per_node, ranks=[r])[0] for r in range(world)]
    unpermuted = []
    for r, h in enumerate(held):  # each holder's unpermute of its experts' outputs for my rows
        p = permute(h.recv_x, h.recv_topk_idx, num_local_experts=per_rank)
        unpermuted.append(unpermute(_expert(p.permuted_x, r), p.handle))
    want_ours_out = reference.combine(unpermuted, alone, num_experts, ranks_per_node)[rank]
    del held, unpermuted, mine

    recv_x, recv_idx, recv_w, recv_per_expert, handle, _ = buf.dispatch(x, topk_idx, weights, num_experts)
    out, _ = buf.combine(_expert(recv_x, rank), handle)
    checks = [
        ("Buffer recv_x", recv_x, want.recv_x),
        ("Buffer recv_topk_idx", recv_idx, want.recv_topk_idx),
        ("Buffer recv_topk_weights", recv_w, want.recv_topk_weights),
        ("Buffer num_recv_tokens_per_expert", recv_per_expert, want.num_recv_tokens_per_expert),
        ("Buffer combine", out, want_out),
    ]
    calls = {}
    if megatron is not None:
        for kind in ("ours", "alltoall"):
            calls[kind] = _megatron_calls(
                megatron.dispatcher(preset, dtype, kind, ranks_per_node), x, routing_map, probs
            )
        tokens, sizes, permuted_probs = calls["ours"][0]()
        ours_out = calls["ours"][1](_expert(tokens, rank))
        a2a_tokens = calls["alltoall"][0]()
        calls["alltoall"][1](_expert(a2a_tokens[0], rank))
        checks += [
            ("ours expert input", tokens, want_permuted.permuted_x),
            ("ours tokens_per_expert", sizes, want_permuted.tokens_per_expert),
            ("ours permuted probs", permuted_probs, want_permuted.permuted_probs),
            ("ours combine", ours_out.view(num_tokens, -1), want_ours_out),
            ("alltoall expert input (same rows as ours)", a2a_tokens[0], want_permuted.permuted_x),
        ]
    errors = _mismatches(checks, rank)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, errors, group=buf.group)
    errors = [e for rank_errors in gathered for e in rank_errors]
    figures["oracle_check"] = "failed" if errors else "passed"
    figures["mismatches"] = errors
    del xs, want, want_permuted, want_out, want_ours_out, recv_x, out

    # Cross-node bytes per direction, all ranks: ours (the handle's rows), Megatron's alltoall (a
    # copy per (token, expert) on another node), flat (a copy per (token, rank) on another node).
    my_node = rank // ranks_per_node
    held_nodes = in_rank[rank].view(-1, nodes, ranks_per_node).any(2)
    expert_node = topk_idx.cpu() // per_rank // ranks_per_node
    other = torch.ones(world, dtype=torch.bool)
    other[my_node * ranks_per_node : (my_node + 1) * ranks_per_node] = False
    rows = torch.tensor(
        [
            handle.num_internode_tokens,
            int((expert_node != my_node).sum()),
            int(in_rank[rank][:, other].sum()),
            int(held_nodes.sum() - held_nodes[:, my_node].sum()),
        ],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(rows, group=buf.group)
    row_bytes = preset.hidden * dtype.itemsize
    ours_b, a2a_b, flat_b, lower = (int(v) * row_bytes for v in rows.tolist())
    figures["bytes"] = {
        "row_bytes": row_bytes,
        "lower_bound_internode": lower,
        **{
            side: {"internode": b, "internode_over_lower_bound": b / lower if lower else None}
            for side, b in (("ours", ours_b), ("alltoall", a2a_b), ("flat", flat_b))
        },
    }

    floors = _Floors(x, in_rank, rank, ranks_per_node, groups)
    state: dict = {}

    def buffer_dispatch():
        state["recv"], *_, state["handle"], _ = buf.dispatch(x, topk_idx, weights, num_experts)
        state["y"] = _expert(state["recv"], rank)

    runs = {
        "buffer": (buffer_dispatch, lambda: buf.combine(state["y"], state["handle"])),
        "flat_floor": (lambda: floors.flat(False), lambda: floors.flat(True)),
        "two_stage_floor": (lambda: floors.two_stage(False), lambda: floors.two_stage(True)),
    }
    for kind, (dispatch, combine) in calls.items():

        def megatron_dispatch(dispatch=dispatch, kind=kind):
            state[kind] = _expert(dispatch()[0], rank)

        runs[kind] = (megatron_dispatch, lambda combine=combine, kind=kind: combine(state[kind]))
    sides = [s for s in SIDES if s in runs]

    def timed(fn) -> float:
        dist.barrier(group=buf.group)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e3

    samples = torch.zeros(config.iters, len(sides), 2, dtype=torch.float64)
    for it in range(config.warmup + config.iters):
        for j in range(len(sides)):  # every side in every iteration, the first one rotating
            side = sides[(j + it) % len(sides)]
            dispatch, combine = runs[side]
            times = (timed(dispatch), timed(combine))
            if it >= config.warmup:
                samples[it - config.warmup, sides.index(side)] = torch.tensor(times)
    samples = samples.to(device)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=buf.group)  # an iteration lasts as long as its slowest rank
    samples = samples.cpu()
    totals = {side: samples[:, j].sum(1).tolist() for j, side in enumerate(sides)}
    figures["latency_ms"] = {
        side: {
            "dispatch": _summary(samples[:, j, 0].tolist()),
            "combine": _summary(samples[:, j, 1].tolist()),
            "total": _summary(totals[side]),
        }
        for j, side in enumerate(sides)
    }
    # The links torch_dist measured for its route choice on these ranks (gloo, large calls only).
    links = buf.transport.measured_links if isinstance(buf.transport, TorchDistTransport) else None
    figures["measured_links"] = dataclasses.asdict(links) if links else None
    figures["ratios"] = {"buffer_over_two_stage_floor": _ratio(totals["buffer"], totals["two_stage_floor"])}
    figures["ratios"]["two_stage_floor_over_flat_floor"] = _ratio(totals["two_stage_floor"], totals["flat_floor"])
    if calls:
        figures["ratios"]["ours_over_alltoall"] = _ratio(totals["ours"], totals["alltoall"])
        figures["ratios"]["buffer_over_alltoall"] = _ratio(totals["buffer"], totals["alltoall"])
    return figures


def node_hosts(hosts: list[str], ranks_per_node: int) -> list[list[str]]:
    """Per node (ranks ``[n*L, (n+1)*L)``), the distinct hosts its ranks run on, in rank order.

    A node whose ranks run on more than one host means ``ranks_per_node`` (``LOCAL_WORLD_SIZE``
    under torchrun) does not match the machines: the "intra-node" hop would cross the network.
    Several nodes on one host is fine (a simulated cluster, or a CPU world).
    """
    return [list(dict.fromkeys(hosts[n : n + ranks_per_node])) for n in range(0, len(hosts), ranks_per_node)]


def _layout(hosts: list[str], ranks_per_node: int) -> tuple[list[str], list[str]]:
    """``(lines describing where each node runs, warnings)`` for rank 0 to print."""
    per_node = node_hosts(hosts, ranks_per_node)
    lines = [
        f"node {n}: {', '.join(h)} (ranks {n * ranks_per_node}-{(n + 1) * ranks_per_node - 1})"
        for n, h in enumerate(per_node)
    ]
    if len(lines) > 8:  # 64 nodes need not fill the screen: first 4, last 2
        lines = lines[:4] + [f"... ({len(lines) - 6} more)"] + lines[-2:]
    warnings = [
        f"node {n} (ranks {n * ranks_per_node}-{(n + 1) * ranks_per_node - 1}) spans hosts {', '.join(h)}: "
        f"ranks_per_node={ranks_per_node} does not match the ranks per host, so the hierarchy's intra-node "
        f"hop crosses the network; set --ranks-per-node (torchrun: LOCAL_WORLD_SIZE = --nproc-per-node) "
        f"to the GPUs per host"
        for n, h in enumerate(per_node)
        if len(h) > 1
    ]
    return lines, warnings


def _note(config: BenchConfig, line: str, rank: int) -> None:
    """Rank 0's progress: a line in the progress file (the CPU world's display), else printed."""
    if rank != 0:
        return
    if config.progress_path is None:
        print(f"[moe-dispatch-bench] {line}", flush=True)
        return
    with open(config.progress_path, "a") as f:
        f.write(line + "\n")


def _run_rank(config: BenchConfig) -> tuple[list[dict], list[str]]:
    """Every case on this rank of an initialised world; returns ``(figures, host of each rank)``
    (all ranks agree). Rank 0 notes where the nodes run and each finished case."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if dist.get_backend() == "nccl" else (lambda: None)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if torchrun_layout := _torchrun_env():
        lines, warnings = _layout(hosts, torchrun_layout[2])
        _note(config, f"{world} ranks ({dist.get_backend()}): " + "; ".join(lines), rank)
        for line in warnings:
            _note(config, f"WARNING: {line}", rank)
    megatron = _Megatron(world) if config.megatron else None
    _note(config, "world started" + (", Megatron-Core imported" if megatron else ""), rank)
    groups = _stage_groups(world, config.topologies, rank)
    buffers = {L: Buffer(ranks_per_node=L, timeout_s=config.timeout_s) for L in config.topologies}
    results = []
    for name in config.models:
        preset = routing.PRESETS[name].with_hidden_scale(config.hidden_scale)
        for num_tokens in config.num_tokens:
            for ranks_per_node in config.topologies:
                start = time.perf_counter()
                figures = _bench_case(buffers[ranks_per_node], megatron, groups, preset, num_tokens, config, sync)
                state = figures.get("skipped") or f"oracle check {figures['oracle_check']}"
                if links := figures.get("measured_links"):
                    state += (
                        f"; links measured: collective {links['collective_s'] * 1e3:.2f} ms, two stages' "
                        f"{links['two_collectives_s'] * 1e3:.2f} ms; MB/s per rank: "
                        + ", ".join(
                            f"{name} {1 / links[key] / 1e6:.0f}" if links[key] else f"{name} -"
                            for name, key in (
                                ("all", "per_byte"),
                                ("inter", "per_inter_byte"),
                                ("intra", "per_intra_byte"),
                            )
                        )
                    )
                _note(
                    config,
                    f"case {name}, {num_tokens} tokens, {world // ranks_per_node} x {ranks_per_node}: {state} "
                    f"({time.perf_counter() - start:.1f} s)",
                    rank,
                )
                results.append(figures)
    for buf in buffers.values():
        buf.close()
    if megatron is not None:
        megatron.mdm.clear_buffers()
    return results, hosts


def _world_rank(rank: int, world_size: int, config: BenchConfig) -> tuple[list[dict], list[str]] | None:
    """Entry point of each rank (spawned or under torchrun); rank 0 returns ``(figures, hosts)``."""
    filter_known_warnings()
    figures_and_hosts = _run_rank(config)
    return figures_and_hosts if rank == 0 else None


def _spawn_with_progress(config: BenchConfig, console) -> tuple[list[dict], list[str]]:
    """The CPU world, with a rich progress display fed by rank 0's progress file."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with tempfile.TemporaryDirectory(prefix="moe-dispatch-bench-") as tmp:
        path = pathlib.Path(tmp) / "progress"
        path.touch()
        config = dataclasses.replace(config, progress_path=str(path))
        outcome: dict = {}

        def run():
            try:
                outcome["value"] = spawn_world(config.world_size, _world_rank, config, timeout_s=3600.0)[0]
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=run, name="moe-dispatch-bench-world", daemon=True)
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as progress:
            task = progress.add_task(
                f"starting {config.world_size} ranks (gloo"
                + (", importing Megatron-Core)" if config.megatron else ")"),
                total=config.num_cases + 1,
            )
            thread.start()
            seen = 0
            while thread.is_alive() or seen < len(path.read_text().splitlines()):
                lines = path.read_text().splitlines()
                for line in lines[seen:]:
                    if line.startswith("case "):
                        progress.console.print(f"  {line}", markup=False, highlight=False)
                        progress.update(task, advance=1, description="cases")
                    else:
                        progress.update(task, advance=1, description=line)
                seen = len(lines)
                time.sleep(0.1)
            thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# -- reporting (rank 0) ---------------------------------------------------------------------------
def _report(
    results: list[dict],
    config: BenchConfig,
    device: str,
    json_path: pathlib.Path,
    environment: dict | None = None,
    hosts: list[str] | None = None,
    console=None,
) -> int:
    """Prints the page (:func:`moe_dispatch.tools.bench_page.print_page`), writes the JSON with
    every figure and the verdicts; returns the exit status (1 when an oracle check failed)."""
    console = console or bench_page.console()
    title = (
        f"dispatch + combine, ms: slowest rank, median of {config.iters} iterations; {config.dtype}, "
        f"hidden x{config.hidden_scale:g}, W={config.world_size}, on {device}"
    )
    verdicts = bench_page.print_page(results, title, config.megatron, console)
    failed = sorted({f["model"] for f in results if f.get("oracle_check") == "failed"})
    if failed:
        console.print(f"[bold red]ORACLE CHECK FAILED for {', '.join(failed)}[/bold red]")

    payload = {
        "config": dataclasses.asdict(config) | {"device": device, "environment": environment or {}},
        "torch_version": torch.__version__,
        "megatron_core_version": _megatron_version(),
        "python_version": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": source_commit()["commit"],
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "hosts": node_hosts(hosts, config.topologies[0]) if hosts else None,
        "cases": results,
        "verdicts": verdicts,
        "definitions": DEFINITIONS,
        "oracle_check": "failed" if failed else "passed",
    }
    payload["config"].pop("progress_path", None)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"all figures (per-op times, bare Buffer, the floors): {json_path}")
    return 1 if failed else 0


def _megatron_version() -> str | None:
    try:
        import importlib.metadata as md

        return md.version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed
        return None


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status (1 when any oracle check failed).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); see ``--help``.
    """
    filter_known_warnings()
    torchrun = _torchrun_env()
    config, json_path = _parse_args(argv, torchrun)
    shapes = ", ".join(f"{config.world_size // L} x {L}" for L in config.topologies)
    tokens = ", ".join(map(str, config.num_tokens))
    megatron = "on" if config.megatron else "off (not installed or --no-megatron)"
    run_desc = (
        f"nodes x ranks: {shapes}; tokens/rank {tokens}; hidden x{config.hidden_scale:g}; {config.iters} iterations; "
        f"Megatron-Core {megatron}"
    )
    if torchrun is None:
        console = bench_page.console()
        console.print(f"[moe-dispatch-bench] CPU world: {config.world_size} processes (gloo); {run_desc}", markup=False)
        if config.megatron:
            console.print(f"[moe-dispatch-bench] {QUIET_NOTE}", markup=False)
        if config.world_size > (os.cpu_count() or 1):
            console.print(
                f"[moe-dispatch-bench] note: {config.world_size} ranks on {os.cpu_count()} cores; load average "
                f"{os.getloadavg()[0]:.1f} before the run",
                markup=False,
            )
        # The ranks inherit the environment of the forkserver, which starts with the first world of
        # this process (a forkserver already running keeps its own).
        added = [k for k in CPU_MALLOC_ENV if k not in os.environ]
        os.environ.update({k: CPU_MALLOC_ENV[k] for k in added})
        malloc_env = {k: os.environ[k] for k in CPU_MALLOC_ENV}
        try:
            results, hosts = _spawn_with_progress(config, console)
        finally:
            for k in added:
                os.environ.pop(k, None)
        return _report(
            results, config, "the CPU world (gloo)", json_path, {"malloc_env": malloc_env}, hosts, console=console
        )

    rank, world_size, _ = torchrun
    if rank == 0:
        print(f"[moe-dispatch-bench] torchrun world: {world_size} ranks; {run_desc}", flush=True)
        if config.megatron:  # every rank filters them (_world_rank), as in the CPU world
            print(f"[moe-dispatch-bench] {QUIET_NOTE}", flush=True)
    # The process group is bounded like the Buffer: a peer that never joins fails the run instead of hanging it.
    out = launch_ranks(world_size, _world_rank, config, timeout_s=config.timeout_s)
    if out is None:  # not rank 0
        return 0
    results, hosts = out
    nodes = world_size // config.topologies[0]
    device = (
        f"{nodes} nodes x {config.topologies[0]} x {torch.cuda.get_device_name()} (NCCL)"
        if torch.cuda.is_available()
        else f"torchrun CPU world of {nodes} nodes x {config.topologies[0]} (gloo)"
    )
    return _report(results, config, device, json_path, hosts=hosts)


if __name__ == "__main__":
    # Under torchrun, record() puts a failing rank's traceback into torchrun's error summary
    # (which names the rank and its host); elsewhere it changes nothing.
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())

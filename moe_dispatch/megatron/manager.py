"""``CustomDispatchManager``: Megatron-Core's ``_DispatchManager`` contract over ``moe_dispatch.Buffer``.

Megatron's flex dispatcher (``MoEFlexTokenDispatcher``) drives its manager in this order per
micro-batch and layer (the semantics come from megatron-core's ``token_dispatcher.py``):

1. ``setup_metadata(routing_map [T, W, E_local] or [T, E'], probs)``: here converted to top-k
   form, ``token_indices [T, K]`` int64 and ``token_probs [T, K]`` fp32 (differentiable in
   probs); ``dispatch_preprocess`` hands ``token_probs`` on as "the probs".
2. ``dispatch(hidden [T, H])``: the hierarchical dispatch (differentiable; its backward is a
   combine). Fused (HybridEP layout, the default: ``Buffer.dispatch_to_experts``): the received
   rows land in expert-major blocks (straight from the receive buffer, or permuted after the
   kernels' static receive), padded to ``pad_multiple``, optionally into a static budget of
   ``P`` rows or (drop-and-pad) into blocks of exactly ``capacity x group size`` rows, and
   ``dispatched_probs [P]`` follows the rows. Unfused (DeepEP layout, ``fuse_permute=False``:
   ``Buffer.dispatch``): the received rows come back as is (``[R, H]``, source rank then source
   token) with ``dispatched_probs [R, K]``. The budget and fp8 are the Buffer's keywords
   either way.
3. ``get_permuted_hidden_states_by_experts(hidden)`` -> ``(tokens [P, H], probs [P])``: the
   permute when unfused, the identity when fused. Experts multiply by the probs themselves.
4. ``get_number_of_tokens_per_expert()`` -> ``[E_local]`` int64 split sizes of the rows.
5. ``get_restored_hidden_states_by_experts(y [P, H])`` -> unpermute (unweighted) or identity.
6. ``combine(y)`` -> ``[T, H]``, the unweighted sum of every copy (Megatron's contract); fused,
   the Buffer sums each token's expert-major copies as it returns them.

The attributes ``token_probs`` and ``dispatched_probs`` are part of the contract: Megatron's
EP-overlap schedule (``overlap_moe_expert_parallel_comm``) replaces them with detached copies
between its schedule nodes, so ``dispatch`` reads ``self.token_probs`` and step 3 reads
``self.dispatched_probs``. The routing state of one dispatch (the ``DispatchHandle``, the
permute handle, the split sizes) lives in one :class:`InflightDispatch` held from ``dispatch``
to its ``combine`` (a layer's dispatch and combine of one micro-batch are never interleaved
with another micro-batch's, even under EP overlap); backward passes need none of it: their
state is in the autograd contexts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

from ..buffer import Buffer, DispatchHandle
from ..config import Config
from ..errors import BudgetOverflowError
from ..ops.layout import routing_map_to_topk
from ..ops.permute import PermuteHandle, check_permute_overflow, permute, unpermute
from ..runtime.arguments import default_ranks_per_node
from ..transport import TRANSPORT_ALIASES
from .config import (
    get_options,
    has_static_budget,
    is_drop_and_pad,
    resolve_expert_capacity,
    resolve_fp8_dispatch,
    resolve_fuse_permute,
    resolve_kernel_config,
    resolve_pad_multiple,
    validate_config,
)

_BUFFERS: dict[tuple, Buffer] = {}


def ep_ranks_per_node(group: dist.ProcessGroup, explicit: int | None = None) -> int:
    """EP ranks per node of ``group`` for the Buffer's hierarchy: ``explicit`` when given (it
    must divide the group size), else :func:`moe_dispatch.runtime.arguments.default_ranks_per_node`."""
    world_size = dist.get_world_size(group)
    if explicit is not None:
        if world_size % explicit != 0:
            raise ValueError(
                f"ranks_per_node={explicit} does not divide the EP group size {world_size}: pass "
                f"configure(config, ranks_per_node=...) with a divisor of {world_size}"
            )
        return explicit
    return default_ranks_per_node(group)


def get_buffer(
    group: dist.ProcessGroup,
    *,
    ranks_per_node: int | None = None,
    num_sms: int | None = None,
    timeout_s: float = 300.0,
    transport: str = "auto",
    config: Config | str | None = None,
    device: torch.device | None = None,
) -> Buffer:
    """The ``moe_dispatch.Buffer`` of an EP group, created once per (group, hierarchy, kernel
    Config or SM budget, timeout, transport, device; see ``Buffer`` for each). ``config`` (a
    ``moe_dispatch.config.Config`` or "auto") replaces ``num_sms`` when given.

    Collective on first use for a group (every rank of ``group`` must reach it together, which
    Megatron's identical layer order on all EP ranks guarantees).
    """
    rpn = ep_ranks_per_node(group, ranks_per_node)
    num_sms = None if config is not None else num_sms
    transport = TRANSPORT_ALIASES.get(transport, transport)  # "cuda" and "kernels": one Buffer
    key = (group, rpn, num_sms, config, float(timeout_s), transport, device)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = Buffer(
            group,
            ranks_per_node=rpn,
            num_sms=num_sms,
            config=config,
            timeout_s=timeout_s,
            transport=transport,
            device=device,
        )
        _BUFFERS[key] = buf
    return buf


def clear_buffers() -> None:
    """Closes and forgets the cached Buffers, freeing their groups, threads and store keys
    (collective: every rank, e.g. before ``destroy_model_parallel`` or ``destroy_process_group``)."""
    while _BUFFERS:
        _BUFFERS.popitem()[1].close()


@dataclasses.dataclass(eq=False)
class InflightDispatch:
    """Routing state of one dispatch, from ``dispatch`` to its ``combine``.

    Attributes:
        handle: the Buffer's :class:`~moe_dispatch.DispatchHandle` (combine replays it backwards;
            ``handle.recv_topk_idx``: the received rows' local expert ids).
        num_tokens: T, tokens this rank dispatched.
        fused: whether dispatch returned permuted rows.
        permute_handle: the :class:`~moe_dispatch.semantics.permute.PermuteHandle` once permuted.
        tokens_per_expert: ``[E_local]`` int64 rows of each expert block (grouped-GEMM splits).
    """

    handle: DispatchHandle
    num_tokens: int
    fused: bool
    permute_handle: PermuteHandle | None = None
    tokens_per_expert: torch.Tensor | None = None


class CustomDispatchManager(_DispatchManager):
    """Megatron-Core's flex-dispatcher manager for ``moe_flex_dispatcher_backend="custom"``.

    Built by ``MoEFlexTokenDispatcher.__init__`` (patched by ``moe_dispatch.megatron.install``)
    once per MoE layer, over the TP x EP group (any size > 1: EP only, expert TP only, or both),
    with the experts and top-k folded over TP as Megatron does for DeepEP.

    Collective construction: the manager makes its group's ``Buffer`` here (:func:`get_buffer`:
    collective over the group the first time, reused by the group's later managers). Here,
    because Megatron builds the flex dispatcher, and so this manager, in ``MoELayer.__init__``
    on every rank, and the ranks of one TP x EP group (one pipeline stage) build the same layers
    in the same order before any forward: they all reach the group's first construction
    together. Inside the first dispatch the collective would rest on the schedule bringing
    every rank to it together, and its cost would land in the first step. The device is known
    here too: Megatron keeps the activations on the current CUDA device when torch sees a GPU
    (``torch.cuda.set_device`` comes first), else on the CPU (gloo, ``moe_dispatch.megatron.cpu``);
    a gloo group on a GPU is processes sharing it (``transport="kernels"``).

    Args:
        group: the TP x EP process group (``pg_collection.tp_ep``).
        num_local_experts: E_local, experts on this rank.
        router_topk: K, entries per token in the folded routing map (``tp * moe_router_topk``).
        num_experts: E', experts in the folded numbering (``tp * num_moe_experts``).
        config: the ``TransformerConfig`` (checked with ``validate_config``; backend knobs from
            ``moe_dispatch.megatron.configure``).

    Attributes (Megatron's contract):
        token_indices: ``[T, K]`` int64 global expert ids, -1 = none.
        token_probs: ``[T, K]`` fp32 probabilities of those experts (0 where none).
        dispatched_probs: ``[P]`` (fused) or ``[R, K]`` (unfused) fp32 probs of the received rows.
        wgrad_store: None, or the experts' :class:`~moe_dispatch.overlap.DelayedWgrad` (set by
            ``enable_delayed_wgrad``): the dispatch backward runs it while its combine is in flight.
        over_budget: ``[1]`` bool, set once any budgeted dispatch dropped rows, or a drop-and-pad
            expert got more rows than its capacity (never reset here; Megatron's
            ``dispatcher.reset_over_budget()`` clears it).

    Attributes (Megatron-LM main's over-budget replay: its ``PagedStashRunner``, used whenever
    ``moe_expert_rank_capacity_factor`` is set, replays an overflowed step and reads these
    through ``MoEFlexTokenDispatcher.check_required_capacity`` / ``grow_ep_recv_capacity``):
        required_recv: ``[1]`` int64, the most rows of the expert input (the unit of the static
            budget P) any budgeted dispatch needed to drop nothing since it was last zeroed
            (main's ``dispatcher.reset_over_budget()`` zeroes it; 0.16/0.19 never read it).
            Exact, except after rows were dropped already on receipt (the kernels' static
            receive): then an upper bound (see :meth:`rows_needed`). Device-side, no host sync.
        moe_expert_rank_capacity_factor: Megatron's factor of the static budget as this manager
            applies it (``config.moe_expert_rank_capacity_factor`` at construction). The runner
            sets it to None for a dropless replay and restores it from the config afterwards
            (0.19's runner does the same). ``configure``'s own budget knobs do not go through it.
        budget_floor: None, or the fewest rows of the static budget (:meth:`grow_recv_capacity`).

    Attributes (ours):
        buffer: the group's :class:`~moe_dispatch.Buffer`.

    Raises:
        ValueError: an invalid config (see ``validate_config``), or E' not divisible by the group;
            from ``Buffer()`` (on every rank alike), arguments it refuses.
        CommError: a rank of the group did not construct its manager within ``timeout_s``.
    """

    def __init__(
        self, group: dist.ProcessGroup, num_local_experts: int, router_topk: int, num_experts: int, config
    ) -> None:
        validate_config(config)
        self.group = group
        self.num_local_experts = num_local_experts
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.config = config
        self.options = get_options(config)
        group_size = dist.get_world_size(group)
        if num_experts != num_local_experts * group_size:
            raise ValueError(
                f"the 'custom' backend needs num_experts ({num_experts}, folded over TP) = "
                f"num_local_experts ({num_local_experts}) x the TP x EP group size ({group_size}); "
                "make num_moe_experts divisible by expert_model_parallel_size"
            )
        self.pad_multiple = resolve_pad_multiple(config)
        self.drop_and_pad = is_drop_and_pad(config)
        self.fused = resolve_fuse_permute(config)
        self.fp8_dispatch = resolve_fp8_dispatch(config)
        if getattr(config, "fp8", None) and not self.fp8_dispatch:
            _log_once(
                f"config.fp8={config.fp8!r} but the 'custom' backend dispatches in the model dtype "
                f"(fp8_dispatch={self.options.fp8_dispatch}, hidden_size={config.hidden_size}: fp8 rows "
                "need a multiple of 128)"
            )
        self.router_dtype = getattr(config, "moe_router_dtype", None)
        self.buffer = get_buffer(  # collective on the group's first manager (see the class docstring)
            group,
            ranks_per_node=self.options.ranks_per_node,
            config=resolve_kernel_config(config),
            timeout_s=self.options.timeout_s,
            transport=self.options.transport,
            device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
        )
        self.over_budget = torch.zeros(1, dtype=torch.bool, device=self.buffer.device)
        self.required_recv = torch.zeros(1, dtype=torch.int64, device=self.buffer.device)
        self.moe_expert_rank_capacity_factor = getattr(config, "moe_expert_rank_capacity_factor", None)
        self.budget_floor: int | None = None
        self.token_indices: torch.Tensor | None = None
        self.token_probs: torch.Tensor | None = None
        self.dispatched_probs: torch.Tensor | None = None
        self._inflight: InflightDispatch | None = None
        self.wgrad_store = None  # a DelayedWgrad, set by delayed_wgrad.enable_delayed_wgrad

    # -- the expert input's layout ----------------------------------------------------------
    def budget(self, num_tokens: int) -> int | None:
        """Static rows P of the permuted expert input for T dispatched tokens, or None (dropless):
        ``num_permuted_tokens``, or ``ceil(T * topk * factor)`` for the rank capacity factor
        (``configure``'s, else :attr:`moe_expert_rank_capacity_factor`), at least
        :attr:`budget_floor`, rounded up to ``pad_multiple``."""
        factor = self.options.expert_rank_capacity_factor
        if factor is None:
            factor = self.moe_expert_rank_capacity_factor
        if self.options.num_permuted_tokens is not None:
            rows = self.options.num_permuted_tokens
        elif factor is not None:
            rows = math.ceil(num_tokens * self.router_topk * factor)
        else:
            return None
        rows = max(rows, self.budget_floor or 0)
        return -(-rows // self.pad_multiple) * self.pad_multiple

    def rows_needed(self, state: InflightDispatch, handle: PermuteHandle) -> torch.Tensor:
        """``[1]`` int64 on the device: the static budget P that would have kept every copy of
        ``state``'s dispatch, whose permute is ``handle`` (no host sync).

        The permute's own count (every expert block padded) is exact for the rows it saw. Rows
        the static receive dropped before it (``recv_count`` past the receive size) carry up to
        ``min(topk, E_local)`` copies each, and may add up to ``pad_multiple - 1`` padding rows
        per expert: counted so, the result is an upper bound that a replay with this budget
        cannot overflow (the receive size is P too, and each received row takes at least one
        row of the expert input)."""
        needed = handle.num_rows_needed.reshape(1).to(torch.int64)
        dispatch = state.handle
        dropped = (dispatch.recv_count.to(torch.int64) - dispatch.num_recv_tokens).clamp_(min=0)
        slack = self.num_local_experts * (self.pad_multiple - 1)
        return needed + dropped * min(self.router_topk, self.num_local_experts) + (dropped > 0) * slack

    def grow_recv_capacity(self, new_capacity: int) -> None:
        """Makes the static budget P at least ``new_capacity`` rows from the next dispatch on (then
        rounded up to ``pad_multiple``); never shrinks it. Megatron-LM main's
        ``MoEFlexTokenDispatcher.grow_ep_recv_capacity`` calls it after an overflowed step with
        the largest :attr:`required_recv` of every layer and rank, so the replay, and the steps
        after it, keep every row. Call it with the same value on every rank of the group (the
        kernels' static receive must agree). A no-op without a static budget (dropless or
        drop-and-pad: nothing to grow).

        Raises:
            TypeError: ``new_capacity`` is not an int.
            ValueError: ``new_capacity`` < 1.
        """
        try:
            rows = operator.index(new_capacity)
        except TypeError:
            raise TypeError(
                f"grow_recv_capacity takes the rows of the static budget as an int (e.g. int(required_recv.max())), "
                f"got {type(new_capacity).__name__}"
            ) from None
        if rows < 1:
            raise ValueError(f"grow_recv_capacity takes a positive row count, got {rows}")
        if has_static_budget(self.config):
            self.budget_floor = max(self.budget_floor or 0, rows)

    def _layout(self, num_tokens: int) -> dict:
        """The permute's layout for T dispatched tokens: padding, the static budget, drop-and-pad blocks."""
        return dict(
            pad_multiple=self.pad_multiple,
            num_permuted_tokens=self.budget(num_tokens),
            expert_capacity=resolve_expert_capacity(self.config, num_tokens, dist.get_world_size(self.group)),
        )

    def _permute(self, state: InflightDispatch, hidden: torch.Tensor, probs: torch.Tensor):
        """The DeepEP layout's permute of the received rows (unfused)."""
        # the received ids come from Buffer.dispatch (checked there, local ids): no second host check
        res = permute(
            hidden,
            state.handle.recv_topk_idx,
            probs,
            num_local_experts=self.num_local_experts,
            validate=False,
            **self._layout(state.num_tokens),
        )
        self._blocks(state, res.handle)
        return res.permuted_x, res.permuted_probs

    def _blocks(self, state: InflightDispatch, handle: PermuteHandle) -> None:
        """Keeps a permute's handle and split sizes on ``state``; records (or raises) an overflow
        of the static receive or of the expert input."""
        state.permute_handle, state.tokens_per_expert = handle, handle.tokens_per_expert
        budget = handle.num_permuted_tokens
        if budget is not None:
            # The unused tail of the budget (zero rows, no token, prob 0) joins the last expert's
            # block, so the split sizes sum to P as Megatron's experts (torch.split, grouped
            # GEMMs) require; its outputs are never gathered back. Device ops, no host sync.
            # (Fixed drop-and-pad blocks sum to P already.)
            tokens_per_expert = handle.tokens_per_expert.clone()
            tokens_per_expert[-1] += budget - tokens_per_expert.sum()
            state.tokens_per_expert = tokens_per_expert
            torch.maximum(self.required_recv, self.rows_needed(state, handle), out=self.required_recv)
            self.over_budget |= state.handle.overflow  # rows past a static receive (the kernels)
        if budget is not None or handle.expert_capacity is not None:
            self.over_budget |= handle.overflow
            if self.options.raise_on_overflow:  # host reads: the permute's flag, then the dispatch's
                check_permute_overflow(handle)
                if bool(state.handle.overflow):
                    raise BudgetOverflowError(
                        f"dispatch received {int(state.handle.recv_count)} rows, more than the static expert input "
                        f"holds (num_permuted_tokens={budget}); the rows past it were dropped before the permute: "
                        "raise the budget"
                    )

    @staticmethod
    def _async(async_finish: bool, device: torch.device) -> bool:
        """Launch asynchronously only on CUDA: there the caller's stream waits for the event; on
        CPU the host would wait for the communication thread at once, an extra hand-off."""
        return async_finish and device.type == "cuda"

    def _state(self, what: str) -> InflightDispatch:
        if self._inflight is None:
            raise RuntimeError(
                f"{what} called without a dispatch in flight: Megatron's flex dispatcher calls "
                "token_dispatch before dispatch_postprocess/combine_preprocess/token_combine, once each"
            )
        return self._inflight

    # -- Megatron's contract ---------------------------------------------------------------
    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        """Routing of this micro-batch: ``routing_map [T, W, E_local]`` bool and ``probs`` of the
        same shape (or already ``[T, E']``) -> ``token_indices``/``token_probs`` ``[T, K]``.

        In drop-and-pad mode the router's routing map also holds the padding entries that fill
        each expert to its capacity, with probability 0 (``apply_router_token_dropping(...,
        pad_to_capacity=True)``); they are left out here (the fused permute pads with zero
        rows instead), so K routed experts per token remain. A routed entry whose probability
        is exactly 0 is left out too: its expert output is scaled by 0 and, through the
        router's top-k scatter, its probability gradient reaches no logit either.

        Raises:
            ValueError: a token selects more than K experts (checked on CPU tensors only, to
                keep GPU dispatch free of an extra host synchronisation).
        """
        num_tokens = routing_map.shape[0]
        routing_map = routing_map.reshape(num_tokens, self.num_experts)
        probs = probs.reshape(num_tokens, self.num_experts)
        if self.drop_and_pad:
            routing_map = routing_map & (probs != 0)
        self.token_indices, self.token_probs = routing_map_to_topk(routing_map, probs, self.router_topk, validate=False)

    def dispatch(
        self, hidden_states: torch.Tensor, async_finish: bool = False, allocate_on_comm_stream: bool = False
    ) -> torch.Tensor:
        """Dispatches ``hidden_states [T, H]`` (bf16/fp16/fp32) to the ranks of their experts.

        Collective over the TP x EP group. Fused (the default): ``Buffer.dispatch_to_experts``;
        unfused: ``Buffer.dispatch`` (the permute follows in
        :meth:`get_permuted_hidden_states_by_experts`). Without a static budget (dropless,
        drop-and-pad) it synchronises the host once (receive sizes). With one (P rows, from
        ``configure`` or Megatron's ``moe_expert_rank_capacity_factor``) on a transport that
        keeps the receive count on the device (``transport="kernels"``), the receive is static
        too (``num_worst_tokens=P``: a received row takes at least one row of the expert input,
        so more rows than P overflow that input anyway; the rows past it are dropped and flagged
        in ``over_budget``): nothing waits for the host and the step can be captured in a CUDA
        graph, the experts getting the whole fixed-size buffer, as Megatron's static shapes
        (0.19: ``moe_ncclep_static_shape``; main: ``moe_expert_rank_capacity_factor`` alone).
        ``async_finish`` launches the Buffer asynchronously and makes the current stream wait
        for it before returning (what Megatron's DeepEP wrapper does); ``allocate_on_comm_stream``
        allocates the outputs from the Buffer's communication stream (CUDA). With
        ``fp8_dispatch`` the rows travel as fp8 with 1x128 scales and arrive dequantized to
        ``hidden_states``' dtype (``use_fp8``).

        Returns:
            fused: ``[P, H]`` expert-major rows (zero padding rows), ``dispatched_probs [P]``;
            unfused: ``[R, H]`` received rows, ``dispatched_probs [R, K]``.

        Raises:
            BudgetOverflowError: with ``raise_on_overflow``, more rows arrived than the static
                receive or the expert input holds (a host read).
        """
        if self.token_indices is None or self.token_probs is None:
            raise RuntimeError("dispatch called before setup_metadata: Megatron's dispatch_preprocess sets the routing")
        probs = self.token_probs if self.token_probs.dtype == torch.float32 else self.token_probs.float()
        num_tokens = hidden_states.shape[0]
        budget = self.budget(num_tokens)
        static_receive = budget is not None and self.buffer.transport.capabilities.budget_on_device
        args = (hidden_states.contiguous(), self.token_indices, probs.contiguous(), self.num_experts)
        launch = dict(
            num_worst_tokens=budget if static_receive else 0,
            on_overflow="drop",
            use_fp8=self.fp8_dispatch,
            async_finish=self._async(async_finish, hidden_states.device),
            allocate_on_comm_stream=allocate_on_comm_stream,
            wgrad_store=self.wgrad_store,
        )
        if self.fused:
            out, self.dispatched_probs, _, handle, event = self.buffer.dispatch_to_experts(
                *args, **self._layout(num_tokens), **launch
            )
        else:
            out, _, self.dispatched_probs, _, handle, event = self.buffer.dispatch(*args, **launch)
        event.current_stream_wait()
        self._inflight = InflightDispatch(handle=handle, num_tokens=num_tokens, fused=self.fused)
        if self.fused:
            self._blocks(self._inflight, handle.permute)
        return out

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        """``(tokens [P, H], probs [P])`` for the experts, expert-major (identity when fused).

        Reads ``self.dispatched_probs`` (the EP-overlap schedule may have replaced it by a
        detached copy). With ``moe_router_dtype="fp64"`` the probs are returned in fp64, as
        Megatron's DeepEP manager does.
        """
        state = self._state("get_permuted_hidden_states_by_experts")
        if state.fused:
            probs = self.dispatched_probs
        else:
            hidden_states, probs = self._permute(state, hidden_states, self.dispatched_probs)
        if self.router_dtype == "fp64":
            probs = probs.to(torch.float64)
        return hidden_states, probs

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """``[E_local]`` int64 rows of each local expert block (padded to ``pad_multiple``,
        clipped to the budget; with a budget the last block also holds the unused tail rows,
        so the sizes sum to P; drop-and-pad: the capacity of each, ``capacity x group size``):
        the grouped-GEMM split sizes, on the Buffer's device."""
        state = self._state("get_number_of_tokens_per_expert")
        if state.tokens_per_expert is None:
            raise RuntimeError(
                "get_number_of_tokens_per_expert called before the permute: Megatron's "
                "dispatch_postprocess calls get_permuted_hidden_states_by_experts first"
            )
        return state.tokens_per_expert

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert outputs ``[P, H]`` -> received-row order ``[R, H]`` (unweighted sum of each
        row's copies; identity when fused: ``combine`` unpermutes)."""
        state = self._state("get_restored_hidden_states_by_experts")
        if state.fused:
            return hidden_states
        return unpermute(hidden_states, state.permute_handle)

    def combine(
        self, hidden_states: torch.Tensor, async_finish: bool = False, allocate_on_comm_stream: bool = False
    ) -> torch.Tensor:
        """Sums expert outputs back onto their source tokens: ``[P, H]`` (fused) or ``[R, H]``
        -> ``[T, H]`` in the input dtype (fp32 accumulation, deterministic order).

        Collective over the TP x EP group; releases this dispatch's routing state.
        """
        state = self._state("combine")
        self._inflight = None
        out, event = self.buffer.combine(  # fused: the Buffer sums each token's expert-major copies
            hidden_states.contiguous(),
            state.handle,
            async_finish=self._async(async_finish, hidden_states.device),
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        event.current_stream_wait()
        self.dispatched_probs = None
        return out


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.getLogger("moe_dispatch.megatron").info(message)

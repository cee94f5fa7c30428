"""Megatron-Core backend "custom" in gloo worlds on CPU (``moe_dispatch.megatron`` + ``.cpu``).

One world of 4 ranks runs every multi-rank case (spawning costs seconds; importing Megatron
costs more): first EP 4 (1 and 2 simulated nodes), then EP 2 x DP 2 (1 and 2 nodes), then
expert-TP 2 x EP 2 (the flex dispatcher's TP x EP group).

- Megatron's dispatcher contract (its own unit test's shape): dispatch_preprocess ->
  token_dispatch -> dispatch_postprocess -> scale by probs -> combine_preprocess ->
  token_combine -> combine_postprocess restores the input, and the gradient of the input is
  the output gradient; dropless, padded (fused permute), with a static budget (overflow
  detected), with tokens that lost experts to a capacity drop, and in drop-and-pad mode with
  uneven token counts per rank (fixed expert blocks; a rank receiving more than its blocks
  hold flags it).
- The expert input (rows, split sizes, probs) equals the alltoall dispatcher's row for row.
- Equivalence: one MoELayer's weights and inputs through alltoall and through "custom" give
  the same output and the same gradients (input, router, experts).
- EP overlap: a bf16 GPTModel through Megatron's combined 1F1B schedule
  (``overlap_moe_expert_parallel_comm`` + ``delay_wgrad_compute``) equals the plain schedule.

test_megatron_config.py covers ``configure()`` validation, the patch points, Bridge's helper
and the import guard in one process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from moe_dispatch.testing.models import moe_config_fields  # noqa: E402

from .worlds import assert_case, run_megatron_cases, world_results  # noqa: E402

WORLD_SIZE = 4
HIDDEN = 16
NUM_EXPERTS = 8
TOPK = 2


# ---------------------------------------------------------------------------------------------
# helpers run inside the ranks
# ---------------------------------------------------------------------------------------------


def _init_parallel(ep: int, etp: int = 1) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatch.megatron as mdm

    mdm.clear_buffers()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(1234)  # the RNG tracker attention forks


def _config(ep: int, dispatcher: str, etp: int = 1, **knobs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_dispatch.megatron as mdm

    cfg = TransformerConfig(
        **moe_config_fields(
            hidden=HIDDEN,
            experts=NUM_EXPERTS,
            topk=TOPK,
            ffn=24,
            moe_token_dispatcher_type="alltoall",
            use_cpu_initialization=True,
            moe_aux_loss_coeff=1e-2,
            add_bias_linear=False,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    )
    if dispatcher == "custom":
        mdm.configure(cfg, **knobs)
    return cfg


def _dispatcher(cfg):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher

    pg = get_default_pg_collection()
    ep, rank = pg.ep.size(), pg.ep.rank()
    local = NUM_EXPERTS // ep
    cls = MoEFlexTokenDispatcher if cfg.moe_token_dispatcher_type == "flex" else MoEAlltoAllTokenDispatcher
    return cls(local, list(range(rank * local, (rank + 1) * local)), config=cfg, pg_collection=pg)


def _routing(num_tokens: int, seed: int, *, drop_last: bool = True):
    """``routing_map [T, E]`` bool with TOPK experts per token (the last token keeps one: a
    capacity drop) and ``probs [T, E]`` fp32 whose selected entries sum to 1 per token."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
    top = scores.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(num_tokens, NUM_EXPERTS, dtype=torch.bool)
    routing_map.scatter_(1, top, True)
    if drop_last and num_tokens:
        routing_map[-1, top[-1, 1]] = False
    probs = torch.where(routing_map, scores + 0.1, torch.zeros_like(scores))
    probs = probs / probs.sum(1, keepdim=True)
    return routing_map, probs


def _inputs(rank: int, seed: int, *, drop_last: bool = True):
    seq = 5 + rank  # uneven token counts across ranks
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(seq, 2, HIDDEN, generator=gen)
    routing_map, probs = _routing(seq * 2, seed * 100 + rank + 7, drop_last=drop_last)
    return x, routing_map, probs


def _contract(d, x, routing_map, probs):
    """Megatron's dispatcher contract; returns the output and the expert input."""
    hidden, p = d.dispatch_preprocess(x, routing_map, probs)
    hidden, p = d.token_dispatch(hidden, p)
    tokens, tokens_per_expert, permuted_probs = d.dispatch_postprocess(hidden, p)
    y = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype)
    y = d.combine_preprocess(y)
    y = d.token_combine(y)
    return d.combine_postprocess(y), (tokens, tokens_per_expert, permuted_probs)


def _check_roundtrip(cfg, rank: int, seed: int, *, exact_restore: bool = True, drop_last: bool = True):
    """Runs the contract on ``cfg``'s dispatcher; checks the input and its gradients come back
    (times the expert-TP size: each expert-TP rank gets a copy and combine sums them, where
    real experts return partial sums of a row-parallel GEMM)."""
    fold = cfg.expert_tensor_parallel_size
    x, routing_map, probs = _inputs(rank, seed, drop_last=drop_last)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    d = _dispatcher(cfg)
    out, expert_input = _contract(d, x, routing_map, probs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + rank))
    out.backward(grad)
    if exact_restore:
        # probs of a token sum to 1: the weighted sum of its copies is the token (fp32 rounding)
        torch.testing.assert_close(out, fold * x.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, fold * grad, rtol=1e-5, atol=1e-5)
        # d out / d probs[t, e] = <x_t, grad_t> where routed, 0 elsewhere
        dots = fold * (x.detach().reshape(-1, HIDDEN) * grad.reshape(-1, HIDDEN)).sum(1, keepdim=True)
        expected = torch.where(routing_map, dots.expand(-1, NUM_EXPERTS), torch.zeros_like(probs))
        torch.testing.assert_close(probs.grad, expected, rtol=1e-4, atol=1e-5)
    return d, out, expert_input


def _alltoall_expert_input(ep: int, rank: int, seed: int):
    cfg = _config(ep, "alltoall")  # dropless alltoall expects exactly topk experts per token
    x, routing_map, probs = _inputs(rank, seed, drop_last=False)
    _, expert_input = _contract(_dispatcher(cfg), x, routing_map, probs)
    return expert_input


def _check_contract(ep: int, seed: int, etp: int = 1, **knobs):
    def case(rank, world_size):
        _check_roundtrip(_config(ep, "custom", etp=etp, **knobs), rank, seed)

    return case


def _check_same_expert_input(ep: int, seed: int, pad_multiple: int = 1, **knobs):
    """The custom backend hands the experts the alltoall dispatcher's rows (expert-major,
    then source rank, then source token), split sizes and probs; padding rows are zero."""

    def case(rank, world_size):
        _, _, (tokens, tpe, pprobs) = _check_roundtrip(
            _config(ep, "custom", pad_multiple=pad_multiple, **knobs), rank, seed, drop_last=False
        )
        ref_tokens, ref_tpe, ref_probs = _alltoall_expert_input(ep, rank, seed)
        ref_tpe = torch.as_tensor(ref_tpe).to(torch.int64)
        padded = (ref_tpe + pad_multiple - 1) // pad_multiple * pad_multiple
        assert torch.equal(tpe.cpu(), padded), f"tokens_per_expert {tpe.tolist()} != padded {padded.tolist()}"
        assert tokens.shape[0] == int(padded.sum())
        start = ref_start = 0
        for n, p in zip(ref_tpe.tolist(), padded.tolist()):
            assert torch.equal(tokens[start : start + n], ref_tokens[ref_start : ref_start + n]), "expert rows differ"
            assert torch.equal(pprobs[start : start + n], ref_probs[ref_start : ref_start + n].float()), "probs differ"
            assert not tokens[start + n : start + p].any() and not pprobs[start + n : start + p].any(), "padding not 0"
            start, ref_start = start + p, ref_start + n

    return case


def _check_budget(ep: int, seed: int):
    """Static budget: an ample one keeps everything (exact restore, fixed row count); a tight
    one sets the overflow flag on every rank and drops rows."""

    def case(rank, world_size):
        from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

        ample = 4 * 16 * TOPK
        d, _, (tokens, tpe, _) = _check_roundtrip(_config(ep, "custom", num_permuted_tokens=ample), rank, seed)
        assert tokens.shape[0] == ample and int(tpe.sum()) == ample  # the tail joins the last expert
        assert isinstance(d, MoEFlexTokenDispatcher) and not bool(d.check_over_budget().any())

        d, out, (tokens, _, _) = _check_roundtrip(
            _config(ep, "custom", num_permuted_tokens=2), rank, seed, exact_restore=False
        )
        assert tokens.shape[0] == 2
        assert bool(d.check_over_budget().any()), "a budget of 2 rows must overflow on every rank"
        d.reset_over_budget()
        assert not bool(d.check_over_budget().any())

        # the capacity-factor form: P = ceil(T * topk * factor) rounded up to pad_multiple
        cfg = _config(ep, "custom", expert_rank_capacity_factor=4.0, pad_multiple=4)
        d, _, (tokens, _, _) = _check_roundtrip(cfg, rank, seed)
        num_tokens = (5 + rank) * 2
        assert tokens.shape[0] == -(-num_tokens * TOPK * 4 // 4) * 4
        assert not bool(d.check_over_budget().any())

    return case


def _check_drop_and_pad(ep: int, seed: int):
    """Drop-and-pad outside the router: every local expert block has capacity x EP rows, where
    capacity is Megatron's get_capacity of this rank's tokens; blocks too small for what the
    other ranks (more tokens) send set the overflow flag, and raise_on_overflow names it."""

    def case(rank, world_size):
        from megatron.core.transformer.moe.moe_utils import get_capacity

        from moe_dispatch import BudgetOverflowError as PermuteOverflowError

        num_tokens = (5 + rank) * 2
        for factor, overflows in ((4.0, False), (0.1, True)):
            knobs = dict(moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=True, ranks_per_node=2)
            d, _, (tokens, tpe, _) = _check_roundtrip(
                _config(ep, "custom", **knobs), rank, seed, exact_restore=not overflows
            )
            block = get_capacity(num_tokens * TOPK, NUM_EXPERTS, factor) * ep
            assert tpe.tolist() == [block] * (NUM_EXPERTS // ep) and tokens.shape[0] == block * NUM_EXPERTS // ep
            assert bool(d.check_over_budget().any()) == overflows
        d = _dispatcher(_config(ep, "custom", raise_on_overflow=True, **knobs))
        x, routing_map, probs = _inputs(rank, seed)
        hidden, p = d.dispatch_preprocess(x, routing_map, probs)
        with pytest.raises(PermuteOverflowError, match=r"copies for one expert .* expert_capacity="):
            d.token_dispatch(hidden, p)

    return case


def _check_raise_on_overflow(ep: int, seed: int):
    def case(rank, world_size):
        from moe_dispatch import BudgetOverflowError

        d = _dispatcher(_config(ep, "custom", num_permuted_tokens=1, raise_on_overflow=True))
        x, routing_map, probs = _inputs(rank, seed)
        hidden, p = d.dispatch_preprocess(x, routing_map, probs)
        with pytest.raises(BudgetOverflowError, match="num_permuted_tokens=1"):
            d.token_dispatch(hidden, p)

    return case


def _manager_step(m, hidden, routing_map, probs):
    """One MoE layer step through a CustomDispatchManager's contract (setup_metadata, dispatch,
    permute, an expert scaling by the probs, unpermute, combine), forward and backward; returns
    the output, the gradients of hidden and probs, and the expert input's rows."""
    hidden, probs = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    m.setup_metadata(routing_map, probs)
    tokens, token_probs = m.get_permuted_hidden_states_by_experts(m.dispatch(hidden))
    out = m.combine(m.get_restored_hidden_states_by_experts(tokens * token_probs.unsqueeze(-1)))
    (out * out).sum().backward()
    return out.detach(), hidden.grad, probs.grad, tokens.shape[0]


def _even_inputs(rank: int, seed: int):
    """:func:`_inputs` cut to the same 10 tokens on every rank: a static budget from the rank
    capacity factor follows T, and the ranks' budgets (num_worst_tokens) must agree."""
    x, routing_map, probs = _inputs(rank, seed)
    return x[:5], routing_map[:10], probs[:10]


def _rank_capacity_factor(factor: float) -> dict:
    """Megatron's moe_expert_rank_capacity_factor where this megatron-core has it (0.19), else
    the backend's own knob of the same meaning (0.16)."""
    from moe_dispatch.megatron import compat

    if compat.missing_config_field("moe_expert_rank_capacity_factor") is None:
        return {"moe_expert_rank_capacity_factor": factor}
    return {"expert_rank_capacity_factor": factor}


def _check_sync_free_static_shape(ep: int, seed: int):
    """Megatron's moe_expert_rank_capacity_factor with transport="kernels": the static expert
    input of moe_ncclep_static_shape (every row of the fixed-size buffer goes to the experts),
    and a whole step through the manager runs without a host synchronisation, equal to the
    sized (dropless) step."""

    def case(rank, world_size):
        import functools
        from unittest import mock

        import moe_dispatch.runtime.transfers as transfers
        from moe_dispatch.testing.sync import no_host_sync

        x, routing_map, probs = _even_inputs(rank, seed)
        hidden = x.reshape(-1, HIDDEN)
        static = _dispatcher(_config(ep, "custom", transport="kernels", **_rank_capacity_factor(4.0)))
        manager = static._comm_manager
        budget = manager.budget(hidden.shape[0])
        assert budget == -(-hidden.shape[0] * TOPK * 4 // 1)  # ceil(T * topk * 4), pad_multiple 1
        want = _manager_step(
            _dispatcher(_config(ep, "custom", transport="kernels"))._comm_manager, hidden, routing_map, probs
        )
        _manager_step(manager, hidden, routing_map, probs)  # the first call of each signature: checked
        # The permute after the static receive as on a GPU: its Triton kernels (interpreted here),
        # not the CPU reference, which validates on the host.
        triton = {
            name: functools.partial(getattr(transfers, name), backend="triton") for name in ("permute", "unpermute")
        }
        with mock.patch.multiple(transfers, **triton), no_host_sync():
            got = _manager_step(manager, hidden, routing_map, probs)
        assert got[3] == budget and not bool(manager.over_budget)  # every row of the static buffer
        for name, g, w in zip(("output", "grad hidden", "grad probs"), got[:3], want[:3]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)  # sums over other row counts

    return case


def _check_budget_replay(ep: int, seed: int):
    """Megatron-LM main's over-budget replay (its PagedStashRunner's calls, made here directly; on
    0.16/0.19, whose dispatcher lacks the hooks, on the manager): a step over a tight static
    budget flags every rank and reports the rows it needed (exactly, where the permute saw every
    row; an upper bound after the kernels' static receive dropped rows); growing every rank's
    budget to the group's peak replays the step without a drop and equal to the dropless step; a
    cleared factor replays it dropless; a budget never shrinks and needs one."""

    def case(rank, world_size):
        import torch.distributed as dist

        from moe_dispatch.megatron import compat

        x, routing_map, probs = _even_inputs(rank, seed)
        hidden = x.reshape(-1, HIDDEN)
        megatron_factor = compat.missing_config_field("moe_expert_rank_capacity_factor") is None
        for transport in ("torch_dist", "kernels"):
            want = _manager_step(
                _dispatcher(_config(ep, "custom", transport=transport))._comm_manager, hidden, routing_map, probs
            )
            cfg = _config(ep, "custom", transport=transport, **_rank_capacity_factor(0.25))
            d = _dispatcher(cfg)
            m = d._comm_manager
            tight = m.budget(hidden.shape[0])
            _manager_step(m, hidden, routing_map, probs)
            assert bool(m.over_budget) and tight < want[3], f"{transport}: a budget of {tight} rows must overflow"
            required = int(m.required_recv)
            if transport == "torch_dist":  # the permute saw every received row: exact
                assert required == want[3], f"required_recv {required} != the dropless step's {want[3]} rows"
            else:  # rows dropped on receipt: an upper bound
                assert required >= want[3], f"required_recv {required} < the dropless step's {want[3]} rows"
            peak = m.required_recv.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            if hasattr(d, "grow_ep_recv_capacity"):  # Megatron-LM main: through the dispatcher
                assert d.check_required_capacity() is m.required_recv
                d.reset_over_budget()
                assert int(m.required_recv) == 0, "main's reset_over_budget clears required_recv too"
                d.grow_ep_recv_capacity(int(peak))
            else:
                d.reset_over_budget()
                m.grow_recv_capacity(int(peak))
            grown = m.budget(hidden.shape[0])
            assert grown == int(peak)  # pad_multiple 1
            got = _manager_step(m, hidden, routing_map, probs)
            assert got[3] == grown and not bool(m.over_budget), f"{transport}: the replay dropped rows"
            for name, g, w in zip(("output", "grad hidden", "grad probs"), got[:3], want[:3]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{transport}: {name}")
            m.grow_recv_capacity(1)
            assert m.budget(hidden.shape[0]) == grown, "a smaller capacity must not shrink the budget"
            if megatron_factor:  # the runner's dropless replay, then its restore from the config
                m.moe_expert_rank_capacity_factor = None
                assert m.budget(hidden.shape[0]) is None
                got = _manager_step(m, hidden, routing_map, probs)
                assert got[3] == want[3] and not bool(m.over_budget)
                m.moe_expert_rank_capacity_factor = cfg.moe_expert_rank_capacity_factor
                assert m.budget(hidden.shape[0]) == grown
        dropless = _dispatcher(_config(ep, "custom"))._comm_manager
        dropless.grow_recv_capacity(64)
        assert dropless.budget(hidden.shape[0]) is None, "growing a dropless manager must leave it dropless"
        with pytest.raises(ValueError, match="positive row count, got 0"):
            m.grow_recv_capacity(0)
        with pytest.raises(TypeError, match="as an int .* got float"):
            m.grow_recv_capacity(1.5)

    return case


def _check_fp8_dispatch(ep: int, seed: int):
    """fp8_dispatch: the tokens travel as fp8 pairs with 1x128 scales and reach the experts
    dequantized; the contract restores the quantized input, gradients pass straight through."""

    def case(rank, world_size):
        from moe_dispatch.ops.quant import per_token_cast_back, per_token_cast_to_fp8

        hidden_size = 128
        d = _dispatcher(_config(ep, "custom", transport="kernels", fp8_dispatch=True, hidden_size=hidden_size))
        assert d._comm_manager.fp8_dispatch
        gen = torch.Generator().manual_seed(seed * 100 + rank)
        x = torch.randn(5 + rank, 2, hidden_size, generator=gen).requires_grad_()
        routing_map, probs = _routing(x.shape[0] * 2, seed * 100 + rank + 7)
        probs.requires_grad_()
        out, (tokens, _, _) = _contract(d, x, routing_map, probs)
        quantized = per_token_cast_back(*per_token_cast_to_fp8(x.detach().reshape(-1, hidden_size)), torch.float32)
        torch.testing.assert_close(out.reshape(-1, hidden_size), quantized, rtol=1e-5, atol=1e-6)
        assert tokens.dtype == x.dtype
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        torch.testing.assert_close(x.grad, grad, rtol=1e-5, atol=1e-5)
        dots = (quantized * grad.reshape(-1, hidden_size)).sum(1, keepdim=True)
        expected = torch.where(routing_map, dots.expand(-1, NUM_EXPERTS), torch.zeros_like(probs))
        torch.testing.assert_close(probs.grad, expected, rtol=1e-4, atol=1e-5)

    return case


def _check_layer_equivalence(ep: int, seed: int, etp: int = 1, **knobs):
    """alltoall vs custom: same weights, same input -> same output and gradients."""

    def case(rank, world_size):
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        spec = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
        torch.manual_seed(seed)
        ref = spec(config=_config(ep, "alltoall", etp=etp))
        layer = spec(config=_config(ep, "custom", etp=etp, **knobs))
        layer.load_state_dict(ref.state_dict())
        assert type(layer.token_dispatcher).__name__ == "MoEFlexTokenDispatcher"
        assert type(layer.token_dispatcher._comm_manager).__name__ == "CustomDispatchManager"
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(6 + rank, 2, HIDDEN, generator=gen)
        grad = torch.randn(x.shape, generator=gen)
        outs, grads = [], []
        for module in (ref, layer):
            xi = x.clone().requires_grad_(True)
            out, _ = module(xi)
            out.backward(grad)
            outs.append(out.detach())
            grads.append([xi.grad] + [p.grad for p in module.parameters()])
        # fp32; the same products summed in the same order, except the final unweighted sum
        # of a token's copies (combine) whose order may differ: a few ulps at most
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
        names = ["input"] + [n for n, _ in ref.named_parameters()]
        for name, g_ref, g in zip(names, grads[0], grads[1]):
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"grad of {n}: {m}")

    return case


def _check_ranks_per_node(ep: int):
    def case(rank, world_size):
        import os

        from megatron.core import parallel_state as ps

        import moe_dispatch.megatron as mdm

        group = ps.get_expert_tensor_and_model_parallel_group()
        assert mdm.ep_ranks_per_node(group, 1) == 1
        with pytest.raises(ValueError, match="does not divide the EP group size"):
            mdm.ep_ranks_per_node(group, 3)
        old = os.environ.get("LOCAL_WORLD_SIZE")
        try:
            os.environ["LOCAL_WORLD_SIZE"] = "2"
            assert mdm.ep_ranks_per_node(group) == 2  # EP groups {0,1},{2,3} (ep=2) or {0..3} (ep=4)
            os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
            assert mdm.ep_ranks_per_node(group) == ep
        finally:
            if old is None:
                os.environ.pop("LOCAL_WORLD_SIZE", None)
            else:
                os.environ["LOCAL_WORLD_SIZE"] = old

    return case


def gpt_config(**fields):
    """A bf16 GPT TransformerConfig with NUM_EXPERTS experts (top-TOPK), EP = the world, no bias,
    no dropout, CPU initialisation; ``fields``: its size (``layers``, ``hidden``, ``heads``,
    ``ffn`` of :func:`moe_config_fields`) and what to add (or another EP size)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **moe_config_fields(
            experts=NUM_EXPERTS,
            topk=TOPK,
            dtype=torch.bfloat16,
            use_cpu_initialization=True,
            moe_aux_loss_coeff=1e-2,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **{"expert_model_parallel_size": torch.distributed.get_world_size(), **fields},
        )
    )


def gpt_model(cfg, seed: int, *, vocab_size: int, max_sequence_length: int, **model_args):
    """A GPTModel of ``cfg`` (local layer spec, rope) whose parameters come from
    ``torch.manual_seed(seed)``; configure ``cfg`` first. ``model_args`` go to ``GPTModel``
    (a pipeline stage's ``vp_stage``, ``pre_process``, ``post_process``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # process-wide aux-loss scale: earlier cases' layer backward made it 0-d, the schedule sets [1]
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    torch.manual_seed(seed)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=NUM_EXPERTS),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        **model_args,
    )


def _train_step(overlap: bool, seed: int, run_wgrad: str | None = None, **knobs):
    """Three micro-batches of a 2-layer bf16 GPTModel (EP = the world) through Megatron's
    no-pipelining schedule (the combined 1F1B EP-overlap schedule + delay_wgrad_compute when
    ``overlap``), experts with delayed wgrads when ``run_wgrad``; returns losses, gradients and
    the delayed-wgrad stores ({} without ``run_wgrad``). test_megatron_overlap.py runs it too."""
    import moe_dispatch.megatron as mdm
    from moe_dispatch.megatron.schedule import run_gpt_step

    cfg = gpt_config(layers=2, hidden=HIDDEN, ffn=24)
    mdm.configure(cfg, overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=overlap, **knobs)
    model = gpt_model(cfg, seed, vocab_size=32, max_sequence_length=8)
    stores = mdm.enable_delayed_wgrad(model, run_wgrad=run_wgrad) if run_wgrad else {}
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    batches = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(3)]
    return run_gpt_step(model, batches), {n: p.grad for n, p in model.named_parameters()}, stores


def _check_ep_overlap(seed: int, **knobs):
    """overlap_moe_expert_parallel_comm + delay_wgrad_compute with "custom": Megatron's combined
    1F1B schedule builds and runs, and gives the plain schedule's losses and gradients exactly
    (the same operations per micro-batch; only the interleaving differs)."""

    def case(rank, world_size):
        losses, grads, _ = _train_step(False, seed, **knobs)
        losses_overlap, grads_overlap, _ = _train_step(True, seed, **knobs)
        assert all(torch.equal(a, b) for a, b in zip(losses, losses_overlap)), (losses, losses_overlap)
        for name, g in grads.items():
            assert g is not None and torch.equal(grads_overlap[name], g), f"gradient of {name} differs"

    return case


def _phase(ep: int, cases: dict, etp: int = 1) -> dict:
    def init(rank, world_size):
        _init_parallel(ep, etp)

    return {f"init_ep{ep}_etp{etp}": init, **cases}


EP4_CASES = {
    "contract_ep4_1node": _check_contract(4, 1),
    "contract_ep4_2nodes": _check_contract(4, 2, ranks_per_node=2),
    "contract_ep4_2nodes_fused": _check_contract(4, 3, ranks_per_node=2, fuse_permute=True),
    "expert_input_ep4_2nodes": _check_same_expert_input(4, 4, ranks_per_node=2),
    "expert_input_ep4_2nodes_padded": _check_same_expert_input(4, 5, pad_multiple=4, ranks_per_node=2),
    "budget_ep4_2nodes": _check_budget(4, 6),
    "raise_on_overflow_ep4": _check_raise_on_overflow(4, 7),
    "drop_and_pad_ep4_2nodes": _check_drop_and_pad(4, 10),
    "layer_equivalence_ep4_2nodes": _check_layer_equivalence(4, 8, ranks_per_node=2),
    "layer_equivalence_ep4_2nodes_padded": _check_layer_equivalence(4, 9, ranks_per_node=2, pad_multiple=8),
    "ranks_per_node_ep4": _check_ranks_per_node(4),
    "ep_overlap_ep4_2nodes": _check_ep_overlap(17, ranks_per_node=2),
    "ep_overlap_ep4_2nodes_fused": _check_ep_overlap(18, ranks_per_node=2, pad_multiple=4),
    # The intranode kernels behind the Buffer (transport="kernels"; on CPU their CPU backend).
    "contract_ep4_1node_kernels": _check_contract(4, 31, transport="kernels"),
    "layer_equivalence_ep4_1node_kernels": _check_layer_equivalence(4, 32, transport="kernels"),
    "ep_overlap_ep4_1node_kernels": _check_ep_overlap(33, transport="kernels"),
    "sync_free_static_shape_ep4_kernels": _check_sync_free_static_shape(4, 34),
    "budget_replay_ep4": _check_budget_replay(4, 36),
    "fp8_dispatch_ep4_kernels": _check_fp8_dispatch(4, 35),
}
EP2_CASES = {
    "contract_ep2_1node": _check_contract(2, 11),
    "contract_ep2_2nodes": _check_contract(2, 12, ranks_per_node=1),
    "expert_input_ep2_2nodes_padded": _check_same_expert_input(2, 13, pad_multiple=2, ranks_per_node=1),
    "budget_ep2_2nodes": _check_budget(2, 14),
    "layer_equivalence_ep2_1node": _check_layer_equivalence(2, 15),
    "layer_equivalence_ep2_2nodes_budget": _check_layer_equivalence(
        2, 16, ranks_per_node=1, expert_rank_capacity_factor=8.0
    ),
    "ranks_per_node_ep2": _check_ranks_per_node(2),
}
ETP2_CASES = {  # expert tensor parallelism 2 x EP 2: the TP x EP group of 4, experts and top-k folded
    "contract_etp2_ep2_2nodes": _check_contract(2, 21, etp=2, ranks_per_node=2),
    "contract_etp2_ep2_2nodes_padded": _check_contract(2, 22, etp=2, ranks_per_node=2, pad_multiple=4),
    # (test_megatron_matrix.py compares expert TP with the alltoall dispatcher, 1 and 2 nodes)
}
ALL_CASES = {**_phase(4, EP4_CASES), **_phase(2, EP2_CASES), **_phase(2, ETP2_CASES, etp=2)}


def world_entry(rank: int, world_size: int):
    return run_megatron_cases(rank, world_size, ALL_CASES)


@pytest.mark.world
@pytest.mark.parametrize("case", list(ALL_CASES))
def test_megatron_world(case):
    assert_case(world_results(world_entry, WORLD_SIZE), case)


# ---------------------------------------------------------------------------------------------
# GPU: a whole MoE layer step through the manager, captured in a CUDA graph
# ---------------------------------------------------------------------------------------------


def _graph_entry(rank: int, world_size: int):
    """EP 2 on one GPU (gloo carries the kernels' handles: NCCL refuses two ranks on one GPU):
    Megatron's moe_expert_rank_capacity_factor and transport="kernels", one manager step
    (setup_metadata, dispatch, permute, expert, unpermute, combine, backward) captured in a
    CUDA graph; replays with new tokens equal eager steps."""
    torch.cuda.set_device(0)
    _init_parallel(2)
    d = _dispatcher(_config(2, "custom", transport="kernels", **_rank_capacity_factor(4.0)))
    manager = d._comm_manager
    x, routing_map, probs = _even_inputs(rank, 41)
    hidden, routing_map, probs = x.reshape(-1, HIDDEN).cuda(), routing_map.cuda(), probs.cuda()
    eager = [_manager_step(manager, hidden * s, routing_map, probs) for s in (1.0, 2.0)]
    static = hidden.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph wants
        _manager_step(manager, static, routing_map, probs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _manager_step(manager, static, routing_map, probs)
    for s, want in zip((1.0, 2.0), eager):
        static.copy_(hidden * s)
        graph.replay()
        torch.cuda.synchronize()
        for name, got, ref in zip(("output", "grad hidden", "grad probs"), captured[:3], want[:3]):
            assert torch.equal(got, ref), f"{name}: a graph replay differs from the eager step"
    return "ok"


@pytest.mark.gpu
@pytest.mark.world
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_manager_step_in_a_cuda_graph():
    import os

    from moe_dispatch.testing.launch import spawn_world

    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or "0"
    assert spawn_world(2, _graph_entry, env={"CUDA_VISIBLE_DEVICES": visible}, timeout_s=300) == ["ok", "ok"]

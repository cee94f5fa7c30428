"""Megatron-Core's dispatcher test matrix, run on backend "custom" with the alltoall dispatcher
as the control (our own tests of what Megatron-LM's ``test_token_dispatcher.py``,
``test_a2a_token_dispatcher.py`` and ``test_moe_layer.py`` assert, branch core_r0.19.0).

One 4-rank gloo world runs every case (spawning and importing Megatron cost seconds per
process). Phases: ``(tp, ep)`` in (1, 4), (4, 1), (2, 2), with expert TP = tp and sequence
parallelism when tp > 1 (as Megatron's test container sets them), each on 1 and 2 simulated
nodes (``ranks_per_node`` 4 and 2 over the TP x EP group). Each phase runs:

- dispatcher cases (router -> dispatch_preprocess -> token_dispatch -> dispatch_postprocess ->
  scale by the permuted probs -> combine_preprocess -> token_combine -> combine_postprocess),
  in fp32 with hidden 16 (Megatron's alltoall shapes) and in bf16 with hidden 1024 (its flex
  shapes), for four modes:

  * dropless: the input comes back (times the expert-TP size) and so does its gradient;
  * capacity (factor 0.5, drop policy "probs", and "position" too): no expert gets more than
    ``capacity * ep * tp`` rows, and the input comes back scaled by the sum of its kept probs;
  * drop-and-pad (factor 0.6, ``moe_pad_expert_input_to_capacity``): every expert gets exactly
    ``capacity * ep * tp`` rows, and output and gradient equal the unpadded run's;
  * router padding for quantization (32 experts, top-4, fp8): every expert block is a
    multiple of 16 rows that sum to the rows handed over, and output and gradient equal the
    unpadded run's.

  In every mode "custom" is also compared with the alltoall dispatcher on the same router
  weights and inputs: outputs and input gradients equal (Megatron's ``assert_close``).
- layer cases: a whole ``MoELayer`` (router, experts, aux loss) through "custom" and through
  alltoall with the same weights and inputs, forward and backward: output, input gradient
  and every parameter gradient equal. fp32 hidden 16, bf16 hidden 1024, bf16 with
  ``recompute_modules=["moe"]`` (activation checkpointing re-runs dispatch and combine in
  backward), fp16 (as ``test_moe_layer.py``'s fp16 and recompute classes), and fp32
  drop-and-pad.

CPU adaptations: the world is gloo on CPU tensors (``moe_dispatch.megatron.cpu``); fp8 is set
on the config after it is built (``TransformerConfig.__post_init__`` refuses fp8 without
Transformer Engine; the dispatchers only read the recipe's alignment from it, and "custom" is
told to dispatch bf16 as the alltoall dispatcher does); inputs differ per rank (Megatron's
container gives every rank the same input).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_dispatch.testing.models import moe_config_fields  # noqa: E402

from .worlds import assert_case, run_megatron_cases, world_results  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.world]

WORLD_SIZE = 4
PARALLEL = ((1, 4), (4, 1), (2, 2))  # (tp, ep), expert TP = tp
NODES = (1, 2)
SHAPES = {"fp32_h16": (torch.float32, 16), "bf16_h1024": (torch.bfloat16, 1024)}
# Megatron's settings per mode: experts, top-k, tokens per rank, config fields
MODES = {
    "dropless": (8, 2, (32, 8), {}),
    "capacity": (8, 2, (16,), dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")),
    "capacity_position": (8, 2, (16,), dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")),
    "drop_and_pad": (
        8,
        2,
        (16,),
        dict(moe_expert_capacity_factor=0.6, moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=True),
    ),
    "router_padding": (32, 4, (32,), dict(moe_router_padding_for_quantization=True, fp8="hybrid")),
}
UNPADDED = {
    "drop_and_pad": dict(moe_pad_expert_input_to_capacity=False),  # the run a padded one must equal
    "router_padding": dict(moe_router_padding_for_quantization=False, fp8=None),
}
QUANTIZATION_ALIGN = 16  # get_align_size_for_quantization for fp8 "hybrid" with the default "delayed" recipe


# ---------------------------------------------------------------------------------------------
# helpers run inside the ranks
# ---------------------------------------------------------------------------------------------


def _init_parallel(tp: int, ep: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatch.megatron as mdm

    mdm.clear_buffers()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp
    )
    model_parallel_cuda_manual_seed(123)


def _config(
    tp: int,
    ep: int,
    nodes: int,
    dispatcher: str,
    *,
    num_experts: int,
    topk: int,
    hidden: int,
    dtype: torch.dtype,
    ffn: int = 32,
    **fields,
):
    """A TransformerConfig as Megatron's test container builds it; ``fields`` that
    ``__post_init__`` would refuse on CPU (fp8 without TE) are set afterwards, as
    ``configure()`` sets its keywords."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_dispatch.megatron as mdm

    late = {name: fields.pop(name) for name in ("fp8", "moe_router_padding_for_quantization") if name in fields}
    cfg = TransformerConfig(
        **moe_config_fields(
            hidden=hidden,
            heads=4,
            experts=num_experts,
            topk=topk,
            ffn=ffn,
            dtype=dtype,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.1,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
            sequence_parallel=tp > 1,
            use_cpu_initialization=True,
            add_bias_linear=False,
            **fields,
        )
    )
    if dispatcher == "custom":
        # fp8 here only enables the router's padding: the tokens travel in bf16, as the alltoall
        # dispatcher's (fp8 dispatch quantizes them: test_megatron.py checks it)
        mdm.configure(cfg, ranks_per_node=WORLD_SIZE // nodes, fp8_dispatch=False, **late)
    else:
        for name, value in late.items():
            setattr(cfg, name, value)
    return cfg


def _layer(cfg, reference=None):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    layer = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)(config=cfg)
    if reference is not None:
        layer.load_state_dict(reference.state_dict())
    want = "MoEFlexTokenDispatcher" if cfg.moe_token_dispatcher_type == "flex" else "MoEAlltoAllTokenDispatcher"
    assert type(layer.token_dispatcher).__name__ == want
    return layer


def _tolerance(dtype: torch.dtype) -> dict:
    """Megatron's assert_close defaults, except for fp32 sums of a token's copies, whose order
    differs between the dispatchers (a few ulps)."""
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}


def _assert_layer_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A whole layer in bf16/fp16 with expert TP: alltoall rounds each copy's sum over the TP
    ranks (its reduce-scatter) to the dtype before summing a token's top-k copies, "custom"
    rounds the fp32 sum of all of them once; they differ by about two roundings of the
    largest value (Megatron asserts no equality here; its layer tests check dtypes and
    that gradients exist)."""
    tol = _tolerance(got.dtype)
    if got.dtype != torch.float32:
        tol = dict(rtol=tol.get("rtol", 1.6e-2), atol=2 * torch.finfo(got.dtype).eps * float(want.abs().max()))
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def _through_dispatcher(layer, x, probs_fn=None, scale: float = 1.0):
    """Megatron's dispatcher round trip on ``layer``'s router and dispatcher: returns the
    restored tokens and ``(tokens_per_expert, expert rows)``."""
    d = layer.token_dispatcher
    probs, routing_map = layer.router(x)
    if probs_fn is not None:
        probs = probs_fn(probs)
    hidden, p = d.dispatch_preprocess(x, routing_map, probs)
    hidden, p = d.token_dispatch(hidden, p)
    tokens, tokens_per_expert, permuted_probs = d.dispatch_postprocess(hidden, p)
    y = (tokens * permuted_probs.unsqueeze(-1) / scale).to(x.dtype)
    y = d.combine_preprocess(y)
    y = d.token_combine(y)
    return d.combine_postprocess(y), (torch.as_tensor(tokens_per_expert).long(), tokens.shape[0])


def _inputs(shape, hidden, dtype, seed: int) -> torch.Tensor:
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(*shape, hidden, generator=gen).to(dtype).requires_grad_(True)


def _dispatcher_case(tp: int, ep: int, nodes: int, mode: str, shape_name: str, seed: int):
    num_experts, topk, token_shape, fields = MODES[mode]
    dtype, hidden = SHAPES[shape_name]

    def case(rank, world_size):
        from megatron.core.transformer.moe.moe_utils import get_capacity

        def config(dispatcher, **overrides):
            knobs = {**fields, **overrides}
            return _config(
                tp, ep, nodes, dispatcher, num_experts=num_experts, topk=topk, hidden=hidden, dtype=dtype, **knobs
            )

        torch.manual_seed(seed)
        reference = _layer(config("alltoall"))
        tol = _tolerance(dtype)
        num_tokens = token_shape[0]
        capacity = None
        if "moe_expert_capacity_factor" in fields:
            capacity = get_capacity(num_tokens * topk, num_experts, fields["moe_expert_capacity_factor"])
        results = {}
        for dispatcher in ("alltoall", "custom"):
            x = _inputs(token_shape, hidden, dtype, seed)
            if mode == "dropless":
                # Megatron replaces the probs by 1/topk: the round trip restores the input
                out, (tpe, rows) = _through_dispatcher(
                    _layer(config(dispatcher), reference), x, lambda p: torch.ones_like(p) / topk
                )
                torch.testing.assert_close(out, x.detach() * tp, **tol)
                out.backward(x.detach())
                torch.testing.assert_close(x.grad, x.detach() * tp, **tol)
            elif mode.startswith("capacity"):
                kept = {}

                def probs_fn(p):
                    kept["probs"] = (p != 0) / topk
                    return kept["probs"]

                out, (tpe, rows) = _through_dispatcher(_layer(config(dispatcher), reference), x, probs_fn, scale=tp)
                assert bool((tpe <= capacity * ep * tp).all()), f"tokens per expert {tpe.tolist()} > capacity"
                answer = (x.detach() * kept["probs"].sum(1, keepdim=True)).to(dtype)
                torch.testing.assert_close(out, answer, **tol)
                out.backward(x.detach())
                torch.testing.assert_close(x.grad, answer, **tol)
            else:  # drop-and-pad / router padding: the padded run equals the unpadded one
                unpadded, _ = _through_dispatcher(_layer(config(dispatcher, **UNPADDED[mode]), reference), x)
                unpadded.backward(unpadded.detach())
                unpadded_grad, x.grad = x.grad, None
                out, (tpe, rows) = _through_dispatcher(_layer(config(dispatcher), reference), x)
                if mode == "drop_and_pad":
                    assert tpe.tolist() == [capacity * ep * tp] * tpe.numel(), (
                        f"tokens per expert {tpe.tolist()} != capacity {capacity} x {ep * tp} ranks"
                    )
                else:
                    assert int(tpe.sum()) == rows, f"tokens per expert {tpe.tolist()} do not sum to the {rows} rows"
                    if tpe.numel() > 1:  # Megatron: one expert may lack the tokens to pad
                        assert bool((tpe % QUANTIZATION_ALIGN == 0).all()), f"tokens per expert {tpe.tolist()}"
                torch.testing.assert_close(out, unpadded, **tol)
                out.backward(out.detach())
                torch.testing.assert_close(x.grad, unpadded_grad, **tol)
            results[dispatcher] = (out.detach(), x.grad)
        # "custom" against the control, same router weights and inputs
        torch.testing.assert_close(results["custom"][0], results["alltoall"][0], **tol)
        torch.testing.assert_close(results["custom"][1], results["alltoall"][1], **tol)

    return case


LAYER_CASES = {  # name: (dtype, hidden, config fields)
    "layer_fp32_h16": (torch.float32, 16, {}),
    "layer_bf16_h1024": (torch.bfloat16, 1024, {}),
    "layer_recompute_bf16": (torch.bfloat16, 64, dict(recompute_granularity="selective", recompute_modules=["moe"])),
    "layer_fp16": (torch.float16, 64, {}),
    "layer_drop_and_pad_fp32": (
        torch.float32,
        16,
        dict(moe_expert_capacity_factor=0.6, moe_pad_expert_input_to_capacity=True),
    ),
}


def _layer_case(tp: int, ep: int, nodes: int, name: str, seed: int):
    dtype, hidden, fields = LAYER_CASES[name]

    def case(rank, world_size):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None  # process-wide: a fresh default scale
        torch.manual_seed(seed)
        configs = [
            _config(tp, ep, nodes, d, num_experts=8, topk=2, hidden=hidden, dtype=dtype, ffn=64, **fields)
            for d in ("alltoall", "custom")
        ]
        reference = _layer(configs[0])
        layers = [reference, _layer(configs[1], reference)]
        if fields.get("recompute_modules"):
            assert all(layer.moe_layer_recompute for layer in layers)
        grad = _inputs((16, 2), hidden, dtype, seed + 1).detach()
        outs, grads = [], []
        for layer in layers:
            x = _inputs((16, 2), hidden, dtype, seed)
            out, _ = layer(x)
            out.backward(grad)
            assert out.dtype == dtype and x.grad.dtype == dtype
            outs.append(out.detach())
            grads.append([("input", x.grad)] + [(n, p.grad) for n, p in layer.named_parameters()])
        _assert_layer_close(outs[1], outs[0], "output")
        for (n, g_ref), (_, g) in zip(grads[0], grads[1]):
            assert g is not None and g_ref is not None, f"no gradient for {n}"
            _assert_layer_close(g, g_ref, f"gradient of {n}")

    return case


def _missing_fields(fields) -> list[str]:
    """The ``TransformerConfig`` fields among ``fields`` that the installed megatron-core lacks."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    return sorted(set(fields) - known)


def _cases() -> tuple[dict, dict]:
    """``(cases to run, {case: why it is skipped})``; a case needing a config field this
    megatron-core lacks is skipped (0.16.1 and 0.19.2 have them all)."""
    cases, skipped, seed = {}, {}, 0
    needs = {
        **{mode: [*MODES[mode][3], *UNPADDED.get(mode, {})] for mode in MODES},
        **{name: list(LAYER_CASES[name][2]) for name in LAYER_CASES},
    }
    for tp, ep in PARALLEL:

        def init(rank, world_size, tp=tp, ep=ep):
            _init_parallel(tp, ep)

        cases[f"init_tp{tp}_ep{ep}"] = init
        for nodes in NODES:
            tag = f"tp{tp}_ep{ep}_{nodes}node{'s' if nodes > 1 else ''}"
            for key, variants in [(mode, SHAPES) for mode in MODES] + [(name, [None]) for name in LAYER_CASES]:
                for shape_name in variants:
                    seed += 1
                    name = f"{key}_{shape_name}_{tag}" if shape_name else f"{key}_{tag}"
                    if missing := _missing_fields(needs[key]):
                        skipped[name] = f"megatron-core has no TransformerConfig field {', '.join(missing)}"
                    elif shape_name:
                        cases[name] = _dispatcher_case(tp, ep, nodes, key, shape_name, seed)
                    else:
                        cases[name] = _layer_case(tp, ep, nodes, key, seed)
    return cases, skipped


ALL_CASES, SKIPPED = _cases()


def world_entry(rank: int, world_size: int):
    return run_megatron_cases(rank, world_size, ALL_CASES)


@pytest.mark.parametrize("case", list(ALL_CASES) + list(SKIPPED))
def test_megatron_matrix(case):
    if case in SKIPPED:
        pytest.skip(SKIPPED[case])
    assert_case(world_results(world_entry, WORLD_SIZE), case)

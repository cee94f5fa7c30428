"""Delayed expert weight gradients in Megatron-Core with the "custom" backend
(``moe_dispatch.megatron.enable_delayed_wgrad``), on CPU under gloo, plus one multi-GPU check.

One world of 4 ranks runs every CPU case (EP 4 with 1 and 2 simulated nodes, then EP 2 x DP 2
with 1 and 2 nodes, then PP 2 x VPP 2 x EP 2):

- layer: a MoELayer whose local experts defer their wgrads. Run as Megatron's EP-overlap
  schedule splits it (dispatch | experts + combine | ...), the experts' backward leaves the
  expert weight gradients absent, ``MoELayer.backward_dw()`` produces them, and every
  gradient (input, router, experts) is bitwise the non-delayed layer's. A whole-layer
  backward gets them from the dispatch backward (while its combine is in flight).
  ``run_wgrad="dispatch_backward"``: ``backward_dw()`` hands over to the dispatch backward.
- schedule: a bf16 GPTModel through Megatron's combined-1F1B schedule with
  ``overlap_moe_expert_parallel_comm`` + ``delay_wgrad_compute`` and delayed experts gives
  the plain schedule's losses and gradients bitwise; the stores' event records show who ran
  the wgrads: Megatron's ``backward_dw`` once per layer and micro-batch, or (hand-over mode)
  the dispatch backward right after each ``backward_dw`` call, i.e. after launching its
  gradient combine on the Buffer's communication thread and before waiting for it.
- errors: what ``enable_delayed_wgrad`` refuses, the check for wgrads never run, disable;
  ``gradient_accumulation_fusion`` (``main_grad``) and Megatron DDP's delayed-wgrad hooks.
- pipeline: Megatron's interleaved schedule (PP 2, VPP 2, its default ``batch_p2p_comm``) with
  EP overlap (alltoall and "custom" as Megatron-Bridge's guidance configures it) and without,
  with ``overlap_p2p_comm`` (Bridge's setting) and with ``variable_seq_lengths``: identical
  micro-batches give identical losses (``moe_dispatch.megatron.cpu``'s tagged pipeline
  messages; without them the two stages' activations and gradients cross).

GPU (skipped without >= 2 GPUs: EP must be > 1 and NCCL needs one GPU per rank): the same
GPTModel with EP overlap + delay_wgrad and "custom" matches the alltoall dispatcher's losses
over a few optimizer steps.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from .test_megatron import (  # noqa: E402
    HIDDEN,
    NUM_EXPERTS,
    _config,
    _init_parallel,
    _phase,
    _train_step,
    gpt_config,
    gpt_model,
)
from .worlds import assert_case, run_megatron_cases, world_results  # noqa: E402

WORLD_SIZE = 4
NUM_MICROBATCHES = 3
NUM_LAYERS = 2


# ---------------------------------------------------------------------------------------------
# helpers run inside the ranks
# ---------------------------------------------------------------------------------------------


def _layer_pair(ep: int, seed: int, run_wgrad: str | None, **knobs):
    """``(reference MoELayer, MoELayer with delayed expert wgrads)``, same weights, "custom"."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    import moe_dispatch.megatron as mdm

    spec = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(seed)
    ref = spec(config=_config(ep, "custom", **{**knobs, "delay_wgrad_compute": False}))
    layer = spec(config=_config(ep, "custom", **knobs))
    layer.load_state_dict(ref.state_dict())
    stores = mdm.enable_delayed_wgrad(layer, run_wgrad=run_wgrad) if run_wgrad else {}
    return ref, layer, next(iter(stores.values()), None)


def _split_forward(layer, x):
    """The MoE part of Megatron's EP-overlap layer split: route + dispatch | experts + combine,
    the experts' inputs detached as the schedule's nodes detach them."""
    probs, routing_map = layer.route(x)
    tokens, probs = layer.preprocess(x, probs, routing_map)
    sent = layer.dispatch(tokens, probs)
    recv = tuple(t.detach().requires_grad_(t.requires_grad) for t in sent)
    layer.token_dispatcher._comm_manager.dispatched_probs = recv[1]  # what the schedule's expert node does
    out, _ = layer.routed_experts_compute(*recv)
    return layer.postprocess(layer.combine(out), None), sent, recv


def _expert_weights(layer) -> list[torch.Tensor]:
    return [lin.weight for e in layer.experts.local_experts for lin in (e.linear_fc1, e.linear_fc2)]


def _grads(layer, x) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in layer.parameters()]


def _assert_bitwise(ref_grads, grads, names):
    for name, g_ref, g in zip(names, ref_grads, grads):
        assert g is not None and torch.equal(g, g_ref), f"gradient of {name} differs from the non-delayed layer"


def _check_layer(ep: int, seed: int, run_wgrad: str = "backward_dw", **knobs):
    def case(rank, world_size):
        # bf16=True: EP overlap's prerequisite (configure checks it as Megatron does); it only marks the model for
        # mixed precision, so these bare fp32 layers stay fp32 and their gradients comparable bit for bit
        ref, layer, store = _layer_pair(
            ep, seed, run_wgrad, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, bf16=True, **knobs
        )
        names = ["input"] + [n for n, _ in ref.named_parameters()]
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x0 = torch.randn(6 + rank, 2, HIDDEN, generator=gen)
        grad = torch.randn(x0.shape, generator=gen)

        # 1. the schedule's split: experts backward | backward_dw | dispatch backward
        results = []
        for module in (ref, layer):
            x = x0.clone().requires_grad_(True)
            out, sent, recv = _split_forward(module, x)
            out.backward(grad)  # combine + experts (dgrad)
            if module is layer:
                assert all(w.grad is None for w in _expert_weights(layer)), "expert wgrads were not deferred"
                assert len(store) == 2 * len(layer.experts.local_experts), f"{len(store)} wgrads deferred"
                layer.backward_dw()  # what the schedule's mlp node calls (MoELayer.backward_dw)
                if run_wgrad == "backward_dw":
                    assert all(w.grad is not None for w in _expert_weights(layer)), "backward_dw ran no wgrads"
                    assert len(store) == 0
                else:  # handed over: the dispatch backward runs them
                    assert all(w.grad is None for w in _expert_weights(layer)) and len(store) > 0
            torch.autograd.backward(
                [t for t in sent if t.requires_grad], [r.grad for r, t in zip(recv, sent) if t.requires_grad]
            )  # dispatch backward
            results.append(_grads(module, x))
        _assert_bitwise(*results, names)
        expected = {
            "backward_dw": {"run_by_backward_dw": 1},
            "dispatch_backward": {"handed_over": 1, "run_in_dispatch_backward": 1},
        }[run_wgrad]
        assert {k: v for k, v in store.counts.items() if k != "deferred"} == expected, store.counts

        # 2. a whole-layer backward (no backward_dw call): the dispatch backward runs the wgrads
        for module in (ref, layer):
            module.zero_grad(set_to_none=True)
        results = []
        for module in (ref, layer):
            x = x0.clone().requires_grad_(True)
            out, _ = module(x)
            out.backward(grad)
            results.append(_grads(module, x))
        _assert_bitwise(*results, names)
        assert (
            len(store) == 0
            and store.counts["run_in_dispatch_backward"] == expected.get("run_in_dispatch_backward", 0) + 1
        )

    return case


def _check_errors(rank, world_size):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    import moe_dispatch.megatron as mdm

    spec = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    alltoall = spec(config=_config(4, "alltoall"))
    with pytest.raises(ValueError, match="needs the 'custom' flex dispatcher backend"):
        mdm.enable_delayed_wgrad(alltoall, run_wgrad="dispatch_backward")
    with pytest.raises(ValueError, match="would never run"):
        mdm.enable_delayed_wgrad(alltoall)
    with pytest.raises(ValueError, match="run_wgrad must be one of"):
        mdm.enable_delayed_wgrad(alltoall, run_wgrad="later")
    with pytest.raises(ValueError, match="found no Megatron MoELayer"):
        mdm.enable_delayed_wgrad(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        mdm.enable_delayed_wgrad(42)

    _, layer, store = _layer_pair(4, 31, "backward_dw")
    assert mdm.enable_delayed_wgrad(layer) == {"MoELayer": store}  # idempotent
    assert mdm.enable_delayed_wgrad(layer, run_wgrad="dispatch_backward") == {"MoELayer": store}  # empty: switches
    assert mdm.enable_delayed_wgrad(layer)["MoELayer"].run_wgrad == "backward_dw"
    # wgrads deferred by an experts-only backward and never run: the next forward refuses
    x = torch.randn(5, 2, HIDDEN, requires_grad=True)
    out, _, _ = _split_forward(layer, x)
    out.sum().backward()
    assert len(store) > 0
    with pytest.raises(RuntimeError, match="holds .* deferred expert weight gradients .* before switching"):
        mdm.enable_delayed_wgrad(layer, run_wgrad="dispatch_backward")
    with pytest.raises(RuntimeError, match="were never run"):
        layer(x)
    with pytest.raises(RuntimeError, match="run layer.backward_dw"):
        mdm.disable_delayed_wgrad(layer)
    layer.backward_dw()
    assert mdm.disable_delayed_wgrad(layer) == 1
    assert layer.token_dispatcher._comm_manager.wgrad_store is None
    layer.zero_grad(set_to_none=True)
    out, _, _ = _split_forward(layer, x)
    out.sum().backward()
    assert all(w.grad is not None for w in _expert_weights(layer)), "disable must restore immediate wgrads"


def _check_main_grad(rank, world_size):
    """gradient_accumulation_fusion: the delayed wgrads accumulate into ``weight.main_grad``
    (Megatron DDP's fp32 buffer) instead of ``.grad``, and each weight's DDP hook registered
    through ``register_wgrad_accumulation_and_reduce_hooks`` runs right after its wgrad."""
    ref, layer, store = _layer_pair(4, 32, "backward_dw")
    fired = []
    for lin in (lin for e in layer.experts.local_experts for lin in (e.linear_fc1, e.linear_fc2)):
        assert lin.weight.skip_backward_post_hook
        lin.gradient_accumulation_fusion = True
        lin.weight.main_grad = torch.zeros_like(lin.weight)
        lin.weight.grad_added_to_main_grad = False
        lin.register_wgrad_accumulation_and_reduce_hooks(lambda w=lin.weight: fired.append(w))
    x = torch.randn(5, 2, HIDDEN, generator=torch.Generator().manual_seed(rank))
    for module in (ref, layer):
        out, sent, recv = _split_forward(module, x.clone().requires_grad_(True))
        out.sum().backward()
        assert not fired
        module.backward_dw()
        torch.autograd.backward(
            [t for t in sent if t.requires_grad], [r.grad for r, t in zip(recv, sent) if t.requires_grad]
        )
    for w_ref, w in zip(_expert_weights(ref), _expert_weights(layer)):
        assert w.grad is None and w.grad_added_to_main_grad and torch.equal(w.main_grad, w_ref.grad)
    assert sorted(map(id, fired)) == sorted(map(id, _expert_weights(layer))), "each weight's DDP hook runs once"
    assert len(store) == 0


def _check_schedule(seed: int, **knobs):
    """Plain schedule (reference) == plain with delayed experts (the dispatch backward runs
    them) == combined 1F1B + delay_wgrad with delayed experts run by Megatron's backward_dw
    == the same with backward_dw handing over to the dispatch backward."""

    def case(rank, world_size):
        losses, grads, _ = _train_step(False, seed, None, **knobs)
        expected_runs = NUM_LAYERS * NUM_MICROBATCHES
        for overlap, run_wgrad, events in (
            (False, "backward_dw", {"run_in_dispatch_backward": expected_runs}),
            (True, "backward_dw", {"run_by_backward_dw": expected_runs}),
            (True, "dispatch_backward", {"handed_over": expected_runs, "run_in_dispatch_backward": expected_runs}),
        ):
            what = f"overlap={overlap} run_wgrad={run_wgrad}"
            got_losses, got_grads, stores = _train_step(overlap, seed, run_wgrad, **knobs)
            assert len(stores) == NUM_LAYERS
            assert all(torch.equal(a, b) for a, b in zip(losses, got_losses)), (what, losses, got_losses)
            for name, g in grads.items():
                assert g is not None and torch.equal(got_grads[name], g), f"{what}: gradient of {name} differs"
            for store in stores.values():
                assert len(store) == 0, f"{what}: {store.layer_name} left {len(store)} wgrads"
                assert {k: v for k, v in store.counts.items() if k != "deferred"} == {
                    k: v // NUM_LAYERS for k, v in events.items()
                }, (what, store.layer_name, store.counts)
                if run_wgrad == "dispatch_backward":
                    # every backward_dw call of the schedule was followed by the dispatch backward running
                    # the wgrads (launch combine -> wgrads -> wait), before anything else touched the store
                    ran = [e for e in store.history if e != "deferred"]
                    assert ran == ["handed_over", "run_in_dispatch_backward"] * NUM_MICROBATCHES, ran

    return case


def _check_auto_deferral(seed: int, **knobs):
    """ "custom" + delay_wgrad_compute=True and no enable_delayed_wgrad call: the backend defers the
    local experts' wgrads as the layers are built, so each of Megatron's MoELayer.backward_dw()
    calls in the combined-1F1B schedule produces expert weight gradients (it would change none if
    they had run in the normal backward, as with the alltoall dispatcher), and losses and
    gradients equal the plain schedule's bitwise."""

    def case(rank, world_size):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        losses, grads, _ = _train_step(False, seed, **knobs)
        calls = []
        original = MoELayer.backward_dw

        def spy(self, routed_experts=True, shared_experts=False):
            if not routed_experts:  # the schedule's second call, for the shared experts
                return original(self, routed_experts, shared_experts)
            weights = _expert_weights(self)
            before = [None if w.grad is None else w.grad.clone() for w in weights]
            result = original(self, routed_experts, shared_experts)
            changed = [
                w.grad is not None and (b is None or not torch.equal(b, w.grad)) for b, w in zip(before, weights)
            ]
            calls.append((any(changed), all(b is not None or c for b, c in zip(before, changed))))
            return result

        MoELayer.backward_dw = spy
        try:
            got_losses, got_grads, _ = _train_step(True, seed, **knobs)
        finally:
            MoELayer.backward_dw = original
        assert len(calls) == NUM_LAYERS * NUM_MICROBATCHES, calls
        assert all(any_changed and none_missed for any_changed, none_missed in calls), (
            f"MoELayer.backward_dw() changed no expert weight gradient in some calls: {calls}"
        )
        assert all(torch.equal(a, b) for a, b in zip(losses, got_losses)), (losses, got_losses)
        for name, g in grads.items():
            assert g is not None and torch.equal(got_grads[name], g), f"gradient of {name} differs"

    return case


PP_MICROBATCHES = 4
# PP 2 x VPP 2 x EP 2: the parallel state and the models' configs
PIPELINE = {
    "pipeline_model_parallel_size": 2,
    "virtual_pipeline_model_parallel_size": 2,
    "expert_model_parallel_size": 2,
}


def _init_pipeline(rank, world_size):
    """PP 2 x VPP 2 x EP 2 on the 4 ranks (pipeline stages {0, 2} and {1, 3})."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatch.megatron as mdm

    mdm.clear_buffers()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(**PIPELINE)
    model_parallel_cuda_manual_seed(1234)
    # Megatron's process-wide MoE metrics (the routers' aux losses) are sized by the first model's
    # layer count (the earlier cases' 2); these models have 4
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker  # 0.19
    except ImportError:  # 0.16: a dict of per-layer values by name
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def _pipeline_losses(dispatcher: str, seed: int, batches, **fields):
    """Per-micro-batch losses of one step of a 4-layer bf16 GPTModel, one layer per model chunk,
    through Megatron's interleaved schedule (default ``batch_p2p_comm=True``), and how often the
    combined-1F1B schedule ran; "custom" is configured as Megatron-Bridge's EP-overlap guidance
    says (flex + "custom", shared-expert overlap off, bf16)."""
    from unittest import mock

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    import moe_dispatch.megatron as mdm
    from moe_dispatch.megatron.schedule import run_gpt_step

    overlap = {k: fields.pop(k) for k in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute") if k in fields}
    cfg = gpt_config(
        layers=4,
        hidden=64,
        heads=4,
        ffn=64,
        moe_token_dispatcher_type="alltoall",
        **PIPELINE,
        pipeline_dtype=torch.bfloat16,
        moe_shared_expert_overlap=False,
        **(overlap if dispatcher == "alltoall" else {}),
        **fields,
    )
    if dispatcher == "custom":
        mdm.configure(cfg, **overlap)
    chunks = [
        gpt_model(
            cfg,
            seed + vp,
            vocab_size=64,
            max_sequence_length=32,
            vp_stage=vp,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
        )
        for vp in range(2)
    ]
    name = "combined_1f1b_schedule_for_interleaved_pipelining"
    with mock.patch.object(schedules, name, wraps=getattr(schedules, name)) as combined:
        losses = run_gpt_step(chunks, batches)
    return losses, combined.call_count


def _check_pipeline_vpp(dispatcher: str, seed: int, **fields):
    """PP 2, VPP 2, EP 2 on gloo: the same micro-batch PP_MICROBATCHES times gives the same loss
    each time (without cpu.py's tagged pipeline messages, Megatron's batched exchange between
    the two stages crossed activations and gradients: the later micro-batches' losses differed);
    with EP overlap the combined-1F1B schedule ran."""

    def case(rank, world_size):
        from megatron.core import parallel_state as ps

        gen = torch.Generator().manual_seed(seed * 10 + ps.get_data_parallel_rank())
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        losses, combined = _pipeline_losses(dispatcher, seed, [tokens] * PP_MICROBATCHES, **fields)
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            assert losses == [], losses
        else:
            assert len(losses) == PP_MICROBATCHES and all(torch.equal(loss, losses[0]) for loss in losses), losses
        overlap = fields.get("overlap_moe_expert_parallel_comm", False)
        # with EP overlap every forward and backward goes through it (warm-up, cool-down: one side empty)
        assert (combined > 0) == overlap, f"combined-1F1B schedule entered {combined} times (overlap={overlap})"

    return case


def _check_pipeline_variable_lengths(seed: int):
    """``variable_seq_lengths=True``: two micro-batches of 16 tokens, then two of 24 (the
    steady state sends one's activations and the other's gradients in one exchange, so the
    shapes exchanged ahead of them differ between the two directions); micro-batches with the
    same tokens give the same loss."""

    def case(rank, world_size):
        from megatron.core import parallel_state as ps

        gen = torch.Generator().manual_seed(seed * 10 + ps.get_data_parallel_rank())
        short, long = (torch.randint(0, 64, (2, s), generator=gen) for s in (16, 24))
        losses, _ = _pipeline_losses("custom", seed, [short, short, long, long], variable_seq_lengths=True)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            assert torch.equal(losses[0], losses[1]) and torch.equal(losses[2], losses[3]), losses
            assert not torch.equal(losses[0], losses[2]), losses

    return case


CPU_CASES = {
    **_phase(
        4,
        {
            "layer_ep4_1node": _check_layer(4, 41),
            "layer_ep4_2nodes_fused": _check_layer(4, 42, ranks_per_node=2, pad_multiple=4),
            "layer_ep4_2nodes_handover": _check_layer(4, 43, "dispatch_backward", ranks_per_node=2),
            "errors_ep4": _check_errors,
            "main_grad_ep4": _check_main_grad,
            "schedule_ep4_2nodes": _check_schedule(44, ranks_per_node=2),
            "auto_deferral_ep4_2nodes": _check_auto_deferral(47, ranks_per_node=2),
        },
    ),
    **_phase(
        2,
        {
            "layer_ep2_1node": _check_layer(2, 45),
            "layer_ep2_2nodes_handover": _check_layer(2, 46, "dispatch_backward", ranks_per_node=1),
        },
    ),
    "init_pp2_vpp2_ep2": _init_pipeline,
    "pipeline_vpp_alltoall_ep_overlap": _check_pipeline_vpp(
        "alltoall", 52, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
    ),
    "pipeline_vpp_custom_ep_overlap": _check_pipeline_vpp(
        "custom", 48, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
    ),
    # what Megatron-Bridge sets with VPP: unbatched pipeline messages, overlapped with compute
    "pipeline_vpp_custom_ep_overlap_p2p_overlap": _check_pipeline_vpp(
        "custom", 51, overlap_moe_expert_parallel_comm=True, overlap_p2p_comm=True, batch_p2p_comm=False
    ),
    "pipeline_vpp_custom": _check_pipeline_vpp("custom", 49),
    "pipeline_vpp_custom_variable_lengths": _check_pipeline_variable_lengths(50),
}


def world_entry(rank: int, world_size: int):
    return run_megatron_cases(rank, world_size, CPU_CASES)


@pytest.mark.world
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_megatron_overlap_world(case):
    assert_case(world_results(world_entry, WORLD_SIZE), case)


# ---------------------------------------------------------------------------------------------
# GPU: EP overlap + delay_wgrad with "custom" vs alltoall, a few optimizer steps
# ---------------------------------------------------------------------------------------------

GPU_STEPS = 3


def _gpu_losses(dispatcher: str, seed: int) -> list[float]:
    """Mean loss of each of GPU_STEPS steps (NUM_MICROBATCHES micro-batches, SGD) of a 2-layer
    bf16 GPTModel; "custom": EP overlap + delay_wgrad_compute with delayed experts."""
    import moe_dispatch.megatron as mdm
    from moe_dispatch.megatron.schedule import run_gpt_step

    cfg = gpt_config(layers=NUM_LAYERS, hidden=64, heads=4, ffn=128, moe_token_dispatcher_type="alltoall")
    if dispatcher == "custom":
        mdm.configure(cfg, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    model = gpt_model(cfg, seed, vocab_size=128, max_sequence_length=64).cuda()
    if dispatcher == "custom":
        mdm.enable_delayed_wgrad(model)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    losses = []
    for _ in range(GPU_STEPS):
        batches = [torch.randint(0, 128, (4, 64), generator=gen).cuda() for _ in range(NUM_MICROBATCHES)]
        losses.append(float(torch.stack(run_gpt_step(model, batches)).mean()))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.5)
                    p.grad = None
    return losses


def _gpu_entry(rank: int, world_size: int):
    import moe_dispatch.megatron as mdm

    _init_parallel(world_size)
    alltoall = _gpu_losses("alltoall", 51)
    custom = _gpu_losses("custom", 51)
    mdm.clear_buffers()
    return alltoall, custom


@pytest.mark.gpu
@pytest.mark.world
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs (Megatron EP overlap with NCCL)")
def test_gpu_ep_overlap_delay_wgrad_matches_alltoall():
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs >= 2 GPUs: EP must be > 1 and NCCL needs one GPU per rank ({gpus} visible)")
    world_size = 8 if gpus >= 8 else 4 if gpus >= 4 else 2  # divides NUM_EXPERTS
    for rank, (alltoall, custom) in enumerate(world_results(_gpu_entry, world_size, backend="nccl")):
        # bf16: the two dispatchers sum a token's expert outputs in different orders (a few ulps
        # per layer), which three SGD steps amplify a little; a routing or wgrad error is far larger
        torch.testing.assert_close(
            torch.tensor(custom),
            torch.tensor(alltoall),
            rtol=2e-2,
            atol=2e-2,
            msg=lambda m, r=rank: f"rank {r}: custom {custom} vs alltoall {alltoall}: {m}",
        )

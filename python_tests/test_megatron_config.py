"""``moe_dispatch.megatron`` in one process: ``configure()`` and its checks (each error names the
knob, the reason and the fix), the patch points ``install()`` wraps, Megatron-Bridge's helper
(against stand-in modules; test_megatron_bridge.py runs the real one), and the import guard."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

import moe_dispatch.megatron as mdm  # noqa: E402
from moe_dispatch import _autoload  # noqa: E402
from moe_dispatch.config import Config  # noqa: E402
from moe_dispatch.megatron import compat  # noqa: E402
from moe_dispatch.megatron.config import (  # noqa: E402
    has_static_budget,
    rank_capacity_factor,
    resolve_fp8_dispatch,
    resolve_fuse_permute,
    resolve_kernel_config,
    resolve_num_sms,
)
from moe_dispatch.testing.models import moe_config_fields  # noqa: E402

# TransformerConfig fields that some supported megatron-core version lacks (configure() names the version)
VERSION_DEPENDENT_FIELDS = sorted(
    {name for points in compat._PATCH_POINTS.values() for name, _ in points.missing_config_fields}
)


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **moe_config_fields(layers=2, experts=8, dtype=torch.bfloat16, **{"expert_model_parallel_size": 2, **fields})
    )


# ---------------------------------------------------------------------------------------------
# configure() and validate_config()
# ---------------------------------------------------------------------------------------------


def test_configure_selects_the_backend():
    cfg = _config(moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=False)
    cfg.moe_shared_expert_overlap = True  # configure turns it off, as Bridge's helper does
    out = mdm.configure(cfg, ranks_per_node=2, num_sms=24, pad_multiple=16, expert_rank_capacity_factor=1.5)
    assert out is cfg
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == ("flex", "custom")
    # the SM budget: Megatron's moe_flex_dispatcher_num_sms (0.19), the backend's own attribute where there is none
    assert cfg.moe_shared_expert_overlap is False and getattr(cfg, compat.num_sms_attr()) == 24
    assert resolve_num_sms(cfg) == 24 and resolve_num_sms(_config()) is None
    assert mdm.get_options(cfg) == mdm.CustomBackendOptions(
        ranks_per_node=2, pad_multiple=16, expert_rank_capacity_factor=1.5
    )
    assert mdm.is_custom_backend(cfg)


def test_configure_passes_the_kernel_config_to_the_buffer(monkeypatch):
    """kernel_config ("auto" or a Config) reaches the manager's Buffer as its config, in place of the SM budget."""
    from moe_dispatch.config import Config
    from moe_dispatch.megatron import manager

    cfg = mdm.configure(_config(), kernel_config="auto", transport="kernels")
    assert mdm.get_options(cfg).kernel_config == "auto"
    made = []
    monkeypatch.setattr(manager, "Buffer", lambda *a, **kw: made.append(kw) or object())
    monkeypatch.setattr(manager, "ep_ranks_per_node", lambda group, rpn: 1)
    monkeypatch.setattr(manager, "_BUFFERS", {})  # the fakes are never closed
    manager.get_buffer(None, num_sms=24, config="auto")
    manager.get_buffer(None, num_sms=24, config=Config(num_sms=6))
    assert [(kw["config"], kw["num_sms"]) for kw in made] == [("auto", None), (Config(num_sms=6), None)]


def test_kernel_config_reaches_the_buffer_and_megatrons_num_sms_must_agree():
    """configure(kernel_config=Config(...)) hands the whole Config to the Buffer; an SM budget
    set on the config by hand must be the Config's."""
    config = Config(num_sms=8, num_slots=16, chunk_tokens=4, l2_discard=True)
    cfg = mdm.configure(_config(), transport="kernels", kernel_config=config)
    assert resolve_kernel_config(cfg) is config and mdm.get_options(cfg).transport == "kernels"
    assert resolve_kernel_config(mdm.configure(_config(), num_sms=6)) == Config(num_sms=6)
    assert resolve_kernel_config(mdm.configure(_config())) is None
    cfg = _config()
    setattr(cfg, compat.num_sms_attr(), 12)
    with pytest.raises(ValueError, match=rf"{compat.num_sms_attr()}=12 and configure\(kernel_config=Config\(num_sms=8"):
        mdm.configure(cfg, kernel_config=config)


def test_megatrons_rank_capacity_factor_is_the_static_budget():
    """Megatron's moe_expert_rank_capacity_factor (HybridEP's / NCCL EP's knob) sets the static
    expert input as configure(expert_rank_capacity_factor=...) does: fused permute, P rows."""
    if compat.missing_config_field("moe_expert_rank_capacity_factor") is not None:
        pytest.skip(
            f"megatron-core {compat.version_string()} has no TransformerConfig field moe_expert_rank_capacity_factor "
            "(test_configure_names_the_version_of_a_missing_field covers it there)"
        )
    cfg = mdm.configure(_config(), moe_expert_rank_capacity_factor=1.5)
    assert rank_capacity_factor(cfg) == 1.5 and has_static_budget(cfg) and resolve_fuse_permute(cfg)
    assert not has_static_budget(mdm.configure(_config()))


def test_fp8_dispatch_follows_megatrons_fp8_where_rows_fit():
    """fp8 training (config.fp8) makes the manager dispatch fp8 pairs when the hidden size is a
    multiple of 128; fp8_dispatch= overrides."""
    cfg = mdm.configure(_config(hidden_size=128), fp8="hybrid")  # set after __post_init__: Megatron wants TE there
    assert resolve_fp8_dispatch(cfg)
    assert not resolve_fp8_dispatch(mdm.configure(_config(hidden_size=128), fp8="hybrid", fp8_dispatch=False))
    assert not resolve_fp8_dispatch(mdm.configure(_config(), fp8="hybrid"))  # 16 does not fit 1x128 blocks
    assert resolve_fp8_dispatch(mdm.configure(_config(hidden_size=256), fp8_dispatch=True))


def test_configure_sets_megatron_fields_then_checks():
    cfg = mdm.configure(_config(), overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    assert cfg.overlap_moe_expert_parallel_comm and cfg.delay_wgrad_compute


@pytest.mark.parametrize(
    "fields",
    [
        dict(bf16=False, fp16=True, params_dtype=torch.float16),
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"]),
        dict(mtp_num_layers=1),
        dict(cuda_graph_impl="transformer_engine"),  # whole layers: Megatron's check lets it pass
    ],
    ids=lambda fields: ",".join(fields),
)
def test_ep_overlap_accepts_what_megatron_accepts(fields):
    """The EP-overlap checks refuse only what Megatron-Core and Megatron-Bridge refuse."""
    cfg = mdm.configure(_config(), overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, **fields)
    assert all(getattr(cfg, name) == value for name, value in fields.items())


def test_ep_overlap_refuses_a_cuda_graph_of_the_moe_block():
    """Transformer Engine's per-layer CUDA graph may not capture the MoE or MLP block (Megatron's
    rule); the field is cuda_graph_modules on megatron-core 0.19, cuda_graph_scope on 0.16, and
    holds names or enum members (after Megatron's __post_init__)."""
    from megatron.core.transformer import enums

    field = "cuda_graph_modules" if hasattr(_config(), "cuda_graph_modules") else "cuda_graph_scope"
    member = getattr(enums, "CudaGraphModule", None) or enums.CudaGraphScope
    overlap = dict(overlap_moe_expert_parallel_comm=True, cuda_graph_impl="transformer_engine")
    for value, captured in (
        ("attn,moe", r"\['moe'\]"),
        ([member.mlp], r"\['mlp'\]"),
        (["moe", "mlp"], r"\['moe', 'mlp'\]"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"cuda_graph_impl='transformer_engine' capturing {captured} \({field}=.*"
            rf"Drop 'moe' and 'mlp' from {field}",
        ):
            mdm.configure(_config(), **overlap, **{field: value})
    mdm.configure(_config(), **overlap, **{field: ["attn", "moe_router"]})  # attention and router graphs: allowed
    mdm.configure(_config(), overlap_moe_expert_parallel_comm=True, **{field: ["moe"]})  # no graphs: nothing captured


def test_dispatch_backward_wgrad_overlap_excludes_ep_overlap():
    """overlap_dispatch_backward_with_experts_wgrad (megatron-core 0.19) and the EP-overlap
    schedule (with or without delay_wgrad_compute) exclude each other, as Megatron says."""
    if not hasattr(_config(), "overlap_dispatch_backward_with_experts_wgrad"):
        pytest.skip(f"megatron-core {compat.version_string()} has no overlap_dispatch_backward_with_experts_wgrad")
    for delay_wgrad in (False, True):
        with pytest.raises(
            ValueError,
            match=rf"overlap_dispatch_backward_with_experts_wgrad=True .*\(overlap_moe_expert_parallel_comm=True, "
            rf"delay_wgrad_compute={delay_wgrad}\).* Set overlap_dispatch_backward_with_experts_wgrad=False",
        ):
            mdm.configure(
                _config(),
                overlap_moe_expert_parallel_comm=True,
                delay_wgrad_compute=delay_wgrad,
                overlap_dispatch_backward_with_experts_wgrad=True,
            )
    assert mdm.configure(_config(), overlap_dispatch_backward_with_experts_wgrad=True)  # without EP overlap: fine


def test_resolved_layout():
    from moe_dispatch.megatron.config import resolve_fuse_permute, resolve_pad_multiple

    cfg = mdm.configure(_config())
    assert resolve_pad_multiple(cfg) == 1 and resolve_fuse_permute(cfg)  # fused by default
    cfg = mdm.configure(_config(), fuse_permute=False)
    assert not resolve_fuse_permute(cfg)  # DeepEP layout: permute after
    cfg = mdm.configure(_config(), pad_multiple=16)
    assert resolve_pad_multiple(cfg) == 16 and resolve_fuse_permute(cfg)  # HybridEP layout: fused
    cfg = mdm.configure(_config(), num_permuted_tokens=512)
    assert resolve_fuse_permute(cfg)
    cfg = mdm.configure(_config(), pad_multiple=16, fuse_permute=False)
    assert not resolve_fuse_permute(cfg)


def test_expert_tp_without_ep_configures():
    """The flex dispatcher communicates over expert TP x EP: EP 1 with expert TP 4 is a group of 4."""
    from moe_dispatch.megatron.config import dispatch_group_size

    cfg = mdm.configure(
        _config(expert_model_parallel_size=1, expert_tensor_parallel_size=4, add_bias_linear=False), ranks_per_node=2
    )
    assert dispatch_group_size(cfg) == 4 and mdm.is_custom_backend(cfg)
    assert dispatch_group_size(_config(tensor_model_parallel_size=2, add_bias_linear=False)) == 4  # ETP = TP


def test_drop_and_pad_and_router_padding_resolve():
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from moe_dispatch.megatron.config import resolve_expert_capacity, resolve_fuse_permute, resolve_pad_multiple

    cfg = mdm.configure(_config(), moe_expert_capacity_factor=0.6, moe_pad_expert_input_to_capacity=True)
    assert resolve_fuse_permute(cfg) and resolve_pad_multiple(cfg) == 1
    capacity = get_capacity(16 * 2, 8, 0.6)  # the router's capacity of a rank's 16 tokens, top-2 of 8 experts
    assert resolve_expert_capacity(cfg, 16, 4) == capacity * 4
    cfg.moe_pad_expert_input_to_capacity = False  # capacity factor alone: the router drops, no fixed blocks
    assert resolve_expert_capacity(cfg, 16, 4) is None and resolve_fuse_permute(cfg)  # fused by default
    # router padding: fp8 set after construction (TransformerConfig refuses fp8 without Transformer Engine)
    cfg = mdm.configure(_config(), moe_router_padding_for_quantization=True, fp8="hybrid")
    assert resolve_pad_multiple(cfg) == 16 and resolve_fuse_permute(cfg)
    cfg = mdm.configure(_config(), moe_router_padding_for_quantization=True, fp8="hybrid", pad_multiple=32)
    assert resolve_pad_multiple(cfg) == 32
    cfg = mdm.configure(
        _config(), moe_expert_capacity_factor=0.6, moe_pad_expert_input_to_capacity=True, pad_multiple=16
    )  # fixed blocks round up to the padding multiple
    assert resolve_expert_capacity(cfg, 16, 4) == -(-capacity * 4 // 16) * 16


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(moe_token_dispatcher_type="alltoall"),
            r"configure\(\) selects moe_token_dispatcher_type='flex'.*got moe_token_dispatcher_type='alltoall'.*Drop "
            r"those keywords",
        ),
        (
            dict(expert_model_parallel_size=1),
            r"expert_tensor_parallel_size x expert_model_parallel_size = 1 x 1 = 1: there is nothing to dispatch\. Set "
            r"expert_model_parallel_size > 1 or expert_tensor_parallel_size > 1",
        ),
        (dict(num_moe_experts=1), r"num_moe_experts=1: set num_moe_experts >= 2"),
        (
            dict(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=1, expert_tensor_parallel_size=2),
            r"overlap_moe_expert_parallel_comm=True hides the expert-parallel dispatch and combine .* but "
            r"expert_model_parallel_size=1: there is no EP communication to hide .* Set expert_model_parallel_size > 1",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, bf16=False, params_dtype=torch.float32),
            r"overlap_moe_expert_parallel_comm=True needs a bf16 or fp16 model .* but bf16=False and fp16=False: set "
            r"bf16=True",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, pipeline_model_parallel_size=2),
            r"pipeline_model_parallel_size=2 needs the interleaved schedule: set virtual_pipeline_model_parallel_size",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, recompute_granularity="full"),
            r"overlap_moe_expert_parallel_comm=True with recompute_granularity='full': the EP-overlap schedule runs "
            r"each layer's attention, dispatch, experts and combine as separate steps.* Set "
            r"recompute_granularity='selective' \(recompute_modules without 'moe'\) or None",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, recompute_method="uniform"),
            r"overlap_moe_expert_parallel_comm=True with recompute_method='uniform' .* Set recompute_method=None",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, recompute_num_layers=1),
            r"overlap_moe_expert_parallel_comm=True with recompute_num_layers=1 .* Set recompute_num_layers=None",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, recompute_modules=["core_attn", "moe"]),
            r"overlap_moe_expert_parallel_comm=True with 'moe' in recompute_modules=\['core_attn', 'moe'\]: .* Drop "
            r"'moe' from recompute_modules",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, mtp_num_layers=2),
            r"overlap_moe_expert_parallel_comm=True with mtp_num_layers=2: .* at most one multi-token-prediction "
            r"layer\. Set mtp_num_layers=1",
        ),
        (
            dict(ep_overlap_early_attn_memory_release=True),
            r"ep_overlap_early_attn_memory_release=True reorders the attention backward .* set that too, or "
            r"ep_overlap_early_attn_memory_release=False",
        ),
        (
            dict(overlap_moe_expert_parallel_comm=True, moe_shared_expert_overlap=True),
            r"moe_shared_expert_overlap=True and overlap_moe_expert_parallel_comm=True exclude each other.*set "
            r"moe_shared_expert_overlap=False",
        ),
        (
            dict(delay_wgrad_compute=True),
            r"set overlap_moe_expert_parallel_comm=True too, or delay_wgrad_compute=False",
        ),
        (
            dict(moe_pad_expert_input_to_capacity=True),
            r"moe_pad_expert_input_to_capacity=True pads every expert's input to its capacity, which "
            r"moe_expert_capacity_factor defines: set moe_expert_capacity_factor",
        ),
        (
            dict(
                moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0, expert_rank_capacity_factor=1.5
            ),
            r"already fixes the expert input \(capacity rows per expert\).*drop the static budget",
        ),
        (
            dict(moe_router_padding_for_quantization=True),
            r"the config has neither fp8 nor fp4 \(Megatron requires one\): set fp8/fp4, or set "
            r"moe_router_padding_for_quantization=False",
        ),
        (
            dict(moe_router_padding_for_quantization=True, fp8="hybrid", pad_multiple=8),
            r"needs expert blocks padded to a multiple of 16 \(the fp8/fp4 recipe's alignment\), but "
            r"configure\(pad_multiple=8\) is not one",
        ),
        (
            dict(moe_expert_rank_capacity_factor=1.5, num_permuted_tokens=64),
            r"moe_expert_rank_capacity_factor=1\.5 and configure\(num_permuted_tokens=64, .*both set the static budget",
        ),
        (dict(moe_expert_rank_capacity_factor=-2.0), r"moe_expert_rank_capacity_factor must be a positive number"),
        (
            dict(
                moe_pad_expert_input_to_capacity=True,
                moe_expert_capacity_factor=1.0,
                moe_expert_rank_capacity_factor=1.5,
            ),
            r"already fixes the expert input .*moe_expert_rank_capacity_factor",
        ),
        (dict(fp8_dispatch=True), r"fp8_dispatch=True quantizes rows in 1x128 blocks, but hidden_size=16"),
    ],
)
def test_configure_rejects_with_the_fix(fields, match):
    lacking = [name for name in fields if compat.missing_config_field(name) is not None]
    if lacking:
        pytest.skip(
            f"megatron-core {compat.version_string()} has no TransformerConfig field {lacking[0]} "
            "(test_configure_names_the_version_of_a_missing_field covers it there)"
        )
    with pytest.raises(ValueError, match=match):
        mdm.configure(_config(), **fields)


@pytest.mark.parametrize("field", VERSION_DEPENDENT_FIELDS)
def test_configure_names_the_version_of_a_missing_field(field):
    cfg = _config()
    if hasattr(cfg, field):
        pytest.skip(f"megatron-core {compat.version_string()} has the TransformerConfig field {field}")
    fix = compat.missing_config_field(field)
    assert fix, f"{field} is missing in megatron-core {compat.version_string()} but its entry names no fix"
    with pytest.raises(
        ValueError,
        match=rf"configure\(\) got {field}, but megatron-core "
        rf"{re.escape(compat.version_string())} has no TransformerConfig field "
        rf"{field} \(newer supported versions do\): {re.escape(fix)}, or upgrade",
    ):
        mdm.configure(cfg, **{field: 1})
    assert cfg.moe_token_dispatcher_type != "flex", "a rejected configure() must leave the config alone"


def test_version_entries_differ_where_megatron_does():
    """The patch points of both supported versions (checked on whichever is installed)."""
    old, new = compat.patch_points((0, 16, 1)), compat.patch_points((0, 19, 2))
    assert old.free_input_module == old.callables_module == "megatron.core.models.gpt.fine_grained_callables"
    assert new.free_input_module == "megatron.core.models.common.utils"
    assert old.free_input_params == ("name", "is_moe", "config")
    assert new.free_input_params == ("name", "is_moe", "config", "num_local_experts")
    assert old.callables_importers == () and new.callables_importers
    assert (old.num_sms_field, new.num_sms_field) == (None, "moe_flex_dispatcher_num_sms")
    assert (compat.num_sms_attr((0, 16, 1)), compat.num_sms_attr((0, 19, 2))) == (
        "moe_dispatch_num_sms",
        "moe_flex_dispatcher_num_sms",
    )
    assert not old.dispatcher_has_over_budget and new.dispatcher_has_over_budget
    assert old.align_size_needs_quantization and not new.align_size_needs_quantization
    assert not old.row_parallel_has_backward_dw and new.row_parallel_has_backward_dw
    assert compat.missing_config_field("moe_expert_rank_capacity_factor", (0, 16, 1)).endswith(
        "configure(config, expert_rank_capacity_factor=...)"
    )
    assert compat.missing_config_field("moe_expert_rank_capacity_factor", (0, 19, 2)) is None
    for points in (old, new):  # a version that lacks a field has no field name pointing at it
        assert points.num_sms_field not in dict(points.missing_config_fields)


def test_default_pad_multiple_follows_quantization():
    """No fp8/fp4: no padding by default on every version (0.16's get_align_size_for_quantization
    answers 16 there, which is only its router-padding size)."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    from moe_dispatch.megatron.config import resolve_pad_multiple

    cfg = mdm.configure(_config())
    assert compat.quantization_align_size(cfg) in (0, 1) and resolve_pad_multiple(cfg) == 1
    if compat.patch_points().align_size_needs_quantization:
        assert get_align_size_for_quantization(cfg) > 1  # the difference the entry exists for
    cfg.fp8 = "e4m3"  # the recipe's alignment, as Megatron's HybridEP uses it
    assert resolve_pad_multiple(cfg) == get_align_size_for_quantization(cfg) > 1


def test_validate_config_catches_a_hand_set_backend():
    cfg = _config(moe_token_dispatcher_type="alltoall")
    cfg.moe_flex_dispatcher_backend = "custom"  # what users write by mistake
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='flex'"):
        mdm.validate_config(cfg)
    mdm.validate_config(_config())  # other backends: untouched


def test_validate_config_checks_a_hand_set_sm_budget():
    cfg = mdm.configure(_config())
    setattr(cfg, compat.num_sms_attr(), 21)  # set on the config by hand, or for another flex backend
    with pytest.raises(
        ValueError,
        match=rf"{compat.num_sms_attr()} \(the SM budget .*\) must be an even int in "
        r"\[2, 128\].*got 21",
    ):
        mdm.validate_config(cfg)


@pytest.mark.parametrize("field", ["moe_dispatch_fwd_dtype", "moe_combine_bwd_dtype"])
def test_megatron_mains_wire_dtypes_are_refused(field):
    """Megatron-LM main's moe_dispatch_fwd_dtype / moe_combine_bwd_dtype ask for NCCL EP's MXFP8
    payload, which "custom" does not make: refused with the fp8 knob it has (set by hand here, so
    the check runs on versions without the fields too)."""
    cfg = mdm.configure(_config())
    setattr(cfg, field, "mxfp8")
    with pytest.raises(
        ValueError, match=rf"{field}='mxfp8'.*Set both to 'bf16'.*configure\(config, fp8_dispatch=True\)"
    ):
        mdm.validate_config(cfg)
    setattr(cfg, field, "bf16")
    mdm.validate_config(cfg)


def test_max_connections_one_warns_with_ep_overlap(monkeypatch):
    def max_connections_warnings(**fields):
        cfg = _config()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mdm.configure(cfg, **fields)
        return [w for w in caught if "CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message)]

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    found = max_connections_warnings(overlap_moe_expert_parallel_comm=True)
    assert len(found) == 1 and found[0].category is UserWarning
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 while overlap_moe_expert_parallel_comm=True" in str(found[0].message)
    assert "Unset it" in str(found[0].message)
    assert not max_connections_warnings()  # no EP overlap: nothing to say
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert not max_connections_warnings(overlap_moe_expert_parallel_comm=True)


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(pad_multiple=0), r"pad_multiple must be a positive int"),
        (dict(ranks_per_node=0), r"ranks_per_node must be a positive int"),
        (dict(num_permuted_tokens=0), r"num_permuted_tokens must be a positive int"),
        (dict(expert_rank_capacity_factor=-1.0), r"expert_rank_capacity_factor must be a positive number"),
        (dict(num_permuted_tokens=64, expert_rank_capacity_factor=1.0), r"both set a static budget: pass only one"),
        (dict(fuse_permute="yes"), r"fuse_permute must be True, False or None"),
        (dict(timeout_s=0), r"timeout_s must be a positive, finite number"),
        (dict(timeout_s=float("inf")), r"timeout_s must be a positive, finite number"),
        (dict(num_sms=0), r"num_sms \(SMs of the dispatch/combine kernels\) must be an even int in \[2, 128\]"),
        (dict(num_sms=3), r"must be an even int in \[2, 128\] .*got 3, or None to keep the config's value"),
        (
            dict(transport="nvlink"),
            r"transport must be one of \('auto', 'torch_dist', 'kernels', 'cuda'\) "
            r"\(the Buffer's\), got 'nvlink'",
        ),
        (
            dict(moe_not_a_field=1),
            r"\['moe_not_a_field'\], which are neither TransformerConfig fields nor backend knobs",
        ),
        (dict(kernel_config="fast"), r"kernel_config must be None, 'auto' or a moe_dispatch.config.Config, got 'fast'"),
        (dict(kernel_config="auto", num_sms=8), r"num_sms=8 and kernel_config='auto' both set the kernels' SM budget"),
        (
            dict(num_sms=8, kernel_config=Config(num_sms=8)),
            r"num_sms=8 and kernel_config=Config\(num_sms=8, .*\) both set",
        ),
        (dict(fp8_dispatch="yes"), r"fp8_dispatch must be True, False or None"),
    ],
)
def test_bad_knobs(knobs, match):
    with pytest.raises(ValueError, match=match):
        mdm.configure(_config(), **knobs)


def test_foreign_options_object():
    cfg = _config()
    cfg.moe_dispatch_options = {"ranks_per_node": 2}
    with pytest.raises(TypeError, match="CustomBackendOptions"):
        mdm.get_options(cfg)


# ---------------------------------------------------------------------------------------------
# install() and its patch points
# ---------------------------------------------------------------------------------------------


def _patched_functions():
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    points = compat.patch_points()
    free_input = importlib.import_module(points.free_input_module)
    callables = importlib.import_module(points.callables_module)
    return (MoEFlexTokenDispatcher.__init__, free_input.should_free_input, callables.build_transformer_layer_callables)


def test_install_is_idempotent():
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    points = compat.patch_points()
    before = _patched_functions()
    budget_api = (MoEFlexTokenDispatcher.check_over_budget, MoEFlexTokenDispatcher.reset_over_budget)
    mdm.install()
    mdm.install()
    assert mdm.installed()
    after = _patched_functions()
    assert before == after
    for fn in after:
        assert getattr(fn, "_moe_dispatch_patched", False)
        assert not getattr(fn.__wrapped_original__, "_moe_dispatch_patched", False)  # wrapped once
    for name in points.callables_importers:
        assert importlib.import_module(name).build_transformer_layer_callables is after[2], name
    # Megatron's own over-budget API, or ours (same behaviour) where the version has none
    assert budget_api == (MoEFlexTokenDispatcher.check_over_budget, MoEFlexTokenDispatcher.reset_over_budget)
    for fn in budget_api:
        assert getattr(fn, "_moe_dispatch_patched", False) is (not points.dispatcher_has_over_budget)


def test_row_parallel_linear_has_a_no_op_backward_dw():
    """delay_wgrad_compute makes the EP-overlap schedule call backward_dw() on the local spec's
    linears; Megatron's own compute their wgrads at once, so it must exist and do nothing."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    backward_dw = RowParallelLinear.backward_dw
    ours = not compat.patch_points().row_parallel_has_backward_dw
    assert getattr(backward_dw, "_moe_dispatch_patched", False) is ours
    assert callable(ColumnParallelLinear.backward_dw)
    linear = types.SimpleNamespace(weight=torch.ones(2, 2, requires_grad=True))
    assert backward_dw(linear) is None and linear.weight.grad is None


def test_over_budget_api_reads_the_managers_flag():
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    dispatcher = types.SimpleNamespace(_comm_manager=types.SimpleNamespace(over_budget=torch.ones(1, dtype=torch.bool)))
    flag = MoEFlexTokenDispatcher.check_over_budget(dispatcher)
    assert flag is dispatcher._comm_manager.over_budget and bool(flag)
    MoEFlexTokenDispatcher.reset_over_budget(dispatcher)
    assert not bool(dispatcher._comm_manager.over_budget)
    no_flag = types.SimpleNamespace(_comm_manager=types.SimpleNamespace())  # deepep: keeps none
    assert MoEFlexTokenDispatcher.check_over_budget(no_flag) is None
    MoEFlexTokenDispatcher.reset_over_budget(no_flag)


def test_unsupported_version_names_it():
    for version in ((0, 15, 0), (0, 17, 0), (1, 0, 0)):
        with pytest.raises(
            compat.UnsupportedMegatronVersionError,
            match=rf"supports megatron-core 0\.16\.x, 0\.19\.x, 0\.20\.x "
            rf"\(tested: {re.escape(compat.TESTED_VERSIONS)}\), "
            rf"found {re.escape(compat.version_string(version))}\. .*moe_dispatch/megatron/compat\.py",
        ):
            compat.patch_points(version)
    assert compat.patch_points((0, 19, 0)) is compat.patch_points((0, 19, 2))
    # Megatron-LM main (0.20.0.dev, checked by hand: docs/megatron-main.md) keeps 0.19's places
    assert compat.patch_points((0, 20, 0)) == compat.patch_points((0, 19, 2))


def test_should_free_input_for_custom():
    points = compat.patch_points()
    module = importlib.import_module(points.free_input_module)
    extra = (4,) if "num_local_experts" in points.free_input_params else ()  # 0.16: no num_local_experts

    def free(name, is_moe, cfg, fn=module.should_free_input):
        return fn(name, is_moe, cfg, *extra)

    unfused = mdm.configure(_config(), fuse_permute=False)
    fused = mdm.configure(_config())
    for cfg in (unfused, fused):
        assert free("moe_dispatch", True, cfg) is False  # the router saved it
        assert free("moe_combine", True, cfg) is True
        assert free("pre_dispatch_computation", True, cfg) is False
        assert free("moe_dispatch", False, cfg) is False  # dense layers
    assert free("mlp", True, unfused) is True  # permute copies: free
    assert free("mlp", True, fused) is False  # experts saved the permuted rows
    for backend in ("deepep", "hybridep"):
        cfg = _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
        for name in ("moe_dispatch", "mlp", "moe_combine"):
            assert free(name, True, cfg) == free(name, True, cfg, fn=module.should_free_input.__wrapped_original__)


def test_setup_metadata_compiles_without_graph_breaks():
    """Megatron wraps dispatch_preprocess (which calls setup_metadata) in torch.compile: the
    routing conversion must trace as one graph (no host synchronisation)."""
    from moe_dispatch.ops.layout import routing_map_to_topk

    routing_map = torch.rand(12, 8) > 0.7
    probs = torch.rand(12, 8)
    explanation = torch._dynamo.explain(lambda r, p: routing_map_to_topk(r, p, 4, validate=False))(routing_map, probs)
    assert explanation.graph_break_count == 0, explanation.break_reasons


# ---------------------------------------------------------------------------------------------
# Megatron-Bridge (stand-in modules with its helpers' signatures; test_megatron_bridge.py runs the real one)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_bridge(monkeypatch):
    calls = []

    def apply_flex_dispatcher_backend(model_config, moe_flex_dispatcher_backend=None):
        calls.append(("apply", moe_flex_dispatcher_backend))
        if moe_flex_dispatcher_backend not in ("deepep", "hybridep"):
            return None  # Bridge logs "Not a valid flex dispatcher backend" and skips
        model_config.moe_token_dispatcher_type = "flex"
        model_config.moe_flex_dispatcher_backend = moe_flex_dispatcher_backend
        model_config.moe_shared_expert_overlap = False
        return None

    def validate_flex_dispatcher_backend(model_config):
        calls.append(("validate", model_config.moe_flex_dispatcher_backend))

    names = ["megatron.bridge", "megatron.bridge.training", _autoload.BRIDGE_MODULE, "megatron.bridge.recipes_stub"]
    modules = {name: types.ModuleType(name) for name in names}
    flex = modules[_autoload.BRIDGE_MODULE]
    flex.apply_flex_dispatcher_backend = apply_flex_dispatcher_backend
    flex.validate_flex_dispatcher_backend = validate_flex_dispatcher_backend
    modules["megatron.bridge.recipes_stub"].apply_flex_dispatcher_backend = apply_flex_dispatcher_backend
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules, calls


def test_bridge_helper_accepts_custom(fake_bridge):
    modules, calls = fake_bridge
    assert mdm.patch_bridge()
    flex = modules[_autoload.BRIDGE_MODULE]
    assert modules["megatron.bridge.recipes_stub"].apply_flex_dispatcher_backend is flex.apply_flex_dispatcher_backend

    cfg = _config(moe_shared_expert_overlap=False)
    cfg.moe_shared_expert_overlap = True
    flex.apply_flex_dispatcher_backend(cfg, "custom")
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend, cfg.moe_shared_expert_overlap) == (
        "flex",
        "custom",
        False,
    )
    assert mdm.get_options(cfg) == mdm.CustomBackendOptions()
    flex.validate_flex_dispatcher_backend(cfg)  # ours: passes
    cfg.expert_model_parallel_size = 1
    with pytest.raises(ValueError, match="nothing to dispatch"):
        flex.validate_flex_dispatcher_backend(cfg)

    other = _config()
    flex.apply_flex_dispatcher_backend(other, "hybridep")  # Bridge's own path
    assert other.moe_flex_dispatcher_backend == "hybridep" and ("apply", "hybridep") in calls
    flex.validate_flex_dispatcher_backend(other)
    assert ("validate", "hybridep") in calls

    dense = _config(num_moe_experts=None, expert_model_parallel_size=1, moe_ffn_hidden_size=None)
    flex.apply_flex_dispatcher_backend(dense, "custom")  # not an MoE model: left alone, like Bridge
    assert dense.moe_token_dispatcher_type == "allgather"
    assert mdm.patch_bridge()  # idempotent


def test_no_bridge_no_patch():
    """Importing moe_dispatch.megatron never imports Bridge (its package imports every model bridge)."""
    assert not any(name.startswith("megatron.bridge") for name in sys.modules)
    assert mdm.patch_bridge() is False


def test_bridge_module_is_patched_when_imported(tmp_path, monkeypatch):
    """The import hook install() sets up: a Bridge module imported after moe_dispatch.megatron is
    patched before its importer binds the names (a stand-in file tree on sys.path: ``megatron`` is
    a namespace package, so it joins the installed megatron-core as Bridge's wheel does)."""
    root = tmp_path / "megatron" / "bridge" / "training"
    root.mkdir(parents=True)
    for pkg in (root.parent, root):
        (pkg / "__init__.py").write_text("")
    (root / "flex_dispatcher_backend.py").write_text(
        "def apply_flex_dispatcher_backend(model_config, moe_flex_dispatcher_backend=None):\n"
        "    model_config.seen_by_bridge = moe_flex_dispatcher_backend\n\n"
        "def validate_flex_dispatcher_backend(model_config):\n"
        "    model_config.validated_by_bridge = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("megatron.bridge", "megatron.bridge.training", _autoload.BRIDGE_MODULE):
        monkeypatch.delitem(sys.modules, name, raising=False)  # and removed again at teardown
    from megatron.bridge.training.flex_dispatcher_backend import (
        apply_flex_dispatcher_backend,
        validate_flex_dispatcher_backend,
    )

    assert getattr(apply_flex_dispatcher_backend, "_moe_dispatch_patched", False)
    assert getattr(validate_flex_dispatcher_backend, "_moe_dispatch_patched", False)
    cfg = _config()
    apply_flex_dispatcher_backend(cfg, "custom")
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == ("flex", "custom")
    assert not hasattr(cfg, "seen_by_bridge")
    validate_flex_dispatcher_backend(cfg)
    assert not hasattr(cfg, "validated_by_bridge")
    apply_flex_dispatcher_backend(cfg, "deepep")  # other names: Bridge's own function
    assert cfg.seen_by_bridge == "deepep"


# ---------------------------------------------------------------------------------------------
# import guard and the CPU shims' refusal on GPU machines
# ---------------------------------------------------------------------------------------------


def test_core_imports_without_megatron_and_the_backend_says_how_to_install():
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None\n"
        "sys.modules['megatron.core'] = None\n"
        "import moe_dispatch\n"
        "print('core ok')\n"
        "try:\n"
        "    import moe_dispatch.megatron\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "core ok" in out.stdout
    assert "ImportError: moe_dispatch.megatron needs megatron-core" in out.stdout
    assert "pip install 'moe-dispatch[megatron]'" in out.stdout


def test_cpu_shims_refuse_a_gpu_process(monkeypatch):
    cpu = importlib.import_module("moe_dispatch.megatron.cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="for processes without a GPU.*CUDA_VISIBLE_DEVICES"):
        cpu.enable()
    assert not cpu.is_enabled()


def test_configure_rejects_what_would_fail_later():
    """Settings that pass Megatron's own checks but cannot work with the backend fail at configure()."""
    with pytest.raises(ValueError, match=r"num_moe_experts=6 is not divisible by expert_model_parallel_size=4"):
        mdm.configure(_config(expert_model_parallel_size=4), num_moe_experts=6)
    with pytest.raises(ValueError, match=r"configure\(ranks_per_node=3\) must divide the expert TP x EP group size 4"):
        mdm.configure(_config(expert_model_parallel_size=4), ranks_per_node=3)
    with pytest.raises(ValueError, match=r"moe_flex_dispatcher_backend='deepep'. Drop those keywords"):
        mdm.configure(_config(), moe_flex_dispatcher_backend="deepep")
    with pytest.raises(TypeError, match=r"configure\(\) takes a megatron.core.transformer.TransformerConfig, got dict"):
        mdm.configure({"a": 1})


def test_delay_wgrad_owner_of_each_expert_type():
    """Who defers under delay_wgrad_compute=True: TE where its experts are used, ours for the local
    SequentialMLP (test_megatron_overlap.py runs that), nobody for other experts (said at set-up)."""
    from moe_dispatch.megatron.delayed_wgrad import defer_built_layer, expert_wgrad_owner

    te_grouped = type("TEGroupedMLP", (torch.nn.Module,), {})()
    assert expert_wgrad_owner(te_grouped) == "transformer_engine"
    assert defer_built_layer(types.SimpleNamespace(experts=te_grouped)) is None
    other = torch.nn.Linear(2, 2)
    assert expert_wgrad_owner(other) == "none"
    with pytest.warns(UserWarning, match="defers nothing for experts of type Linear: their weight gradients run in"):
        assert defer_built_layer(types.SimpleNamespace(experts=other)) is None

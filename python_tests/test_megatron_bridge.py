"""The real Megatron-Bridge (``make venv`` installs megatron-bridge 0.6.2 from the package index,
without its dependencies; see requirements/bridge.txt) with backend "custom", on CPU.

In a 2-rank gloo world (EP 2): Bridge's own ``apply_flex_dispatcher_backend(cfg, "custom")``
and ``validate_flex_dispatcher_backend(cfg)``, wrapped as their module loads by the start-up hook
(``moe_dispatch._autoload``; first without any import of ``moe_dispatch.megatron``), select and
check the backend; other names still reach Bridge's code; the
same config then builds a ``MoELayer`` whose dispatcher runs our manager, and its forward and
backward equal the alltoall dispatcher's on the same weights and inputs.

STUB, said plainly: the package object ``megatron.bridge`` is made bare (its ``__path__``
only), so Bridge's ``megatron/bridge/__init__.py`` does not run. That file imports every model
conversion bridge (``megatron.bridge.models``, ``megatron.bridge.diffusion.models``); through
``megatron/bridge/peft/lora_layers.py`` they import ``transformer_engine.pytorch``
unconditionally, which PyPI has only as source (``transformer-engine-torch``, built against
CUDA and torch), and they also need transformers (with its own dependencies), omegaconf and
einops. ``flex_dispatcher_backend`` itself needs only megatron-core and torch. Every module
under ``megatron.bridge`` that its import reaches (``training``, ``utils.common_utils``,
``utils.slurm_utils``, ``training.utils.packed_seq_utils``) runs as shipped.

Without a world: Bridge's ``CommOverlapConfig`` (``training/comm_overlap.py``, its MoE EP-overlap
validation and what it sets for pipelining) on a ``GPTModelProvider`` with "custom", against our
``validate_config``: the guidance's settings pass both (and Megatron-Core's own
``TransformerConfig.__post_init__``, run by the provider's ``finalize()``); each wrong setting is
refused by both, Bridge with its bare ``AssertionError``, ours with a ``ValueError`` naming the knob.
STUB, said plainly: besides ``megatron.bridge``, the package ``megatron.bridge.models`` is made bare
too (its ``__init__`` imports every model bridge: transformers and Transformer Engine, as above);
comm_overlap takes two names from it, ``GPTModelProvider`` and ``T5ModelProvider`` (used only in
annotations), which are set on the bare package from Bridge's own ``models.gpt_provider`` and
``models.t5_provider``, as its ``__init__`` would. Nothing is stubbed below that: comm_overlap,
the providers, ``models.gpt.gpt_builder``, ``models.hybrid.hybrid_builder`` and
``utils.cuda_graph`` run as shipped; the providers need omegaconf and PyYAML, which
requirements/bridge.txt pins. No Transformer Engine stub: comm_overlap imports it under
``try`` (``HAVE_TE=False`` here), and its TE-version checks (delayed wgrad with
``overlap_grad_reduce``, ``gradient_accumulation_fusion`` or CUDA graphs) are not reached by
these configs (Bridge turns ``gradient_accumulation_fusion`` off without TE or Apex).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")
try:
    BRIDGE_VERSION = importlib.metadata.version("megatron-bridge")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "megatron-bridge is not installed (make venv installs 0.6.2 from requirements/bridge.txt; it needs "
        "Python >= 3.12, so the Python 3.11 compatibility environment has none)",
        allow_module_level=True,
    )

from moe_dispatch.testing.models import moe_config_fields  # noqa: E402

from .worlds import assert_case, run_megatron_cases, world_results  # noqa: E402

pytestmark = pytest.mark.megatron

WORLD_SIZE = 2
BRIDGE_MODULE = "megatron.bridge.training.flex_dispatcher_backend"


def _bare_package(name: str):
    """The installed package ``name`` in ``sys.modules`` with its ``__path__`` only: its
    ``__init__`` does not run, its submodules import as shipped (the module docstring says why)."""
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)  # finds the package, runs nothing
        assert spec is not None and spec.submodule_search_locations, f"megatron-bridge's {name} is not importable"
        sys.modules[name] = importlib.util.module_from_spec(spec)
    return sys.modules[name]


def import_bridge_flex_module():
    """Bridge's ``flex_dispatcher_backend`` from the installed wheel, its package ``__init__``
    not run."""
    _bare_package("megatron.bridge")
    return importlib.import_module(BRIDGE_MODULE)


def _config(dispatcher: str = "alltoall", **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = moe_config_fields(
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=WORLD_SIZE,
        use_cpu_initialization=True,
        add_bias_linear=False,
        moe_aux_loss_coeff=1e-2,
    )
    return TransformerConfig(**{**base, **fields})


def _bridge_without_explicit_import(rank, world_size):
    """A recipe that names "custom" only through Bridge (no ``import moe_dispatch.megatron`` anywhere):
    the start-up hook (``moe_dispatch._autoload``) wraps Bridge's helpers as their module loads, so
    "custom" is applied and checked rather than skipped with a log line."""
    import sys

    assert "moe_dispatch.megatron" not in sys.modules, "this case must run before anything imports the backend"
    flex = import_bridge_flex_module()
    cfg = _config(moe_shared_expert_overlap=False)
    flex.apply_flex_dispatcher_backend(cfg, "custom")
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == ("flex", "custom")
    assert "moe_dispatch.megatron" in sys.modules  # the hook installed the backend for this call
    flex.validate_flex_dispatcher_backend(cfg)  # ours: passes
    cfg.expert_model_parallel_size = 1
    with pytest.raises(ValueError, match="nothing to dispatch"):
        flex.validate_flex_dispatcher_backend(cfg)


def _patched_helpers(rank, world_size):
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher  # noqa: F401

    import moe_dispatch.megatron as mdm  # noqa: F401 - the backend (the start-up hook wrapped Bridge's helpers)

    flex = import_bridge_flex_module()
    assert flex.__file__.endswith("megatron/bridge/training/flex_dispatcher_backend.py"), flex.__file__
    assert "site-packages" in flex.__file__, f"Bridge's module must come from the installed wheel: {flex.__file__}"
    for name in ("apply_flex_dispatcher_backend", "validate_flex_dispatcher_backend"):
        fn = getattr(flex, name)
        assert getattr(fn, "_moe_dispatch_patched", False), f"{name} is not patched"
        assert fn.__wrapped_original__.__module__ == BRIDGE_MODULE
    # other backend names run Bridge's own code (on CPU it selects deepep without an architecture check)
    other = _config()
    flex.apply_flex_dispatcher_backend(other, "deepep")
    assert (other.moe_token_dispatcher_type, other.moe_flex_dispatcher_backend) == ("flex", "deepep")


def _bridge_config_builds_our_layer(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatch.megatron as mdm

    flex = import_bridge_flex_module()
    mdm.clear_buffers()
    ps.initialize_model_parallel(expert_model_parallel_size=WORLD_SIZE)
    model_parallel_cuda_manual_seed(7)

    cfg = _config(moe_shared_expert_overlap=False)
    cfg.moe_shared_expert_overlap = True  # Bridge's helper turns it off for every flex backend
    flex.apply_flex_dispatcher_backend(cfg, "custom")
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend, cfg.moe_shared_expert_overlap) == (
        "flex",
        "custom",
        False,
    )
    flex.validate_flex_dispatcher_backend(cfg)  # ours for "custom": no GPU architecture to read on CPU

    spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    torch.manual_seed(7)
    reference = spec(config=_config())
    layer = spec(config=cfg)
    layer.load_state_dict(reference.state_dict())
    assert type(layer.token_dispatcher._comm_manager) is mdm.CustomDispatchManager
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6 + rank, 2, 16, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    results = []
    for module in (reference, layer):
        xi = x.clone().requires_grad_(True)
        out, _ = module(xi)
        out.backward(grad)
        results.append((out.detach(), xi.grad, [p.grad for p in module.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)

    bad = _config(expert_model_parallel_size=1, num_moe_experts=4)
    flex.apply_flex_dispatcher_backend(bad, "custom")
    with pytest.raises(ValueError, match="nothing to dispatch"):  # a group of one rank: our check, named
        flex.validate_flex_dispatcher_backend(bad)


FIRST_CASES = {"bridge_without_explicit_import": _bridge_without_explicit_import}  # before the CPU shims
CASES = {"patched_helpers": _patched_helpers, "bridge_config_builds_our_layer": _bridge_config_builds_our_layer}


def world_entry(rank: int, world_size: int):
    return run_megatron_cases(rank, world_size, CASES, before_shims=FIRST_CASES)


def test_bridge_version():
    assert BRIDGE_VERSION == "0.6.2", f"requirements/bridge.txt pins megatron-bridge 0.6.2, found {BRIDGE_VERSION}"


@pytest.mark.world
@pytest.mark.parametrize("case", [*FIRST_CASES, *CASES])
def test_megatron_bridge(case):
    assert_case(world_results(world_entry, WORLD_SIZE), case)


# ---------------------------------------------------------------------------------------------
# Bridge's CommOverlapConfig against validate_config, in this process (no world)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bridge():
    """Bridge's ``comm_overlap`` and (patched) ``flex_dispatcher_backend`` modules and its
    ``GPTModelProvider`` (see the module docstring for what is bare). The ``megatron.bridge``
    modules imported here leave ``sys.modules`` again afterwards: test_megatron_config.py checks
    that nothing in the package imports Bridge."""
    before = set(sys.modules)
    import moe_dispatch.megatron  # noqa: F401 - patches Bridge's flex module when it is imported

    flex = import_bridge_flex_module()
    models = _bare_package("megatron.bridge.models")
    try:
        from megatron.bridge.models.gpt_provider import GPTModelProvider
        from megatron.bridge.models.t5_provider import T5ModelProvider
    except ModuleNotFoundError as err:
        pytest.fail(f"{err}: requirements/bridge.txt pins what Bridge's model providers import; run make venv")
    models.GPTModelProvider, models.T5ModelProvider = GPTModelProvider, T5ModelProvider  # as its __init__ does
    comm_overlap = importlib.import_module("megatron.bridge.training.comm_overlap")
    assert "site-packages" in comm_overlap.__file__, comm_overlap.__file__
    assert getattr(flex.apply_flex_dispatcher_backend, "_moe_dispatch_patched", False)
    yield SimpleNamespace(flex=flex, comm_overlap=comm_overlap, GPTModelProvider=GPTModelProvider)
    for name in set(sys.modules) - before:
        if name.startswith("megatron.bridge"):
            del sys.modules[name]


def _custom_provider(bridge, **fields):
    """A bf16 GPTModelProvider (EP 2, 8 experts) set to "custom" by Bridge's helper, then ``fields``
    set as a recipe would override them (after the helper, which turns shared-expert overlap off)."""
    base = moe_config_fields(layers=4, experts=8, dtype=torch.bfloat16, expert_model_parallel_size=2)
    model = bridge.GPTModelProvider(**base)  # Bridge defers Megatron's __post_init__ to finalize()
    bridge.flex.apply_flex_dispatcher_backend(model, "custom")
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", "custom")
    for name, value in fields.items():
        setattr(model, name, value)
    return model


def _bridge_overlap_setup(bridge, model, overlap: bool, delay_wgrad: bool) -> None:
    """What Bridge's ``runtime_config_update`` does with ``cfg.comm_overlap``: finalize, then
    setup on the model, optimizer and DDP configs (which copies the overlap knobs onto the model)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    cfg = bridge.comm_overlap.CommOverlapConfig(
        tp_comm_overlap=False,
        overlap_moe_expert_parallel_comm=overlap,
        delay_wgrad_compute=delay_wgrad,
        data_parallel_size=1,
    )
    cfg.finalize()
    cfg.setup(model, OptimizerConfig(), DistributedDataParallelConfig())


@pytest.mark.parametrize(
    "pp, vpp, delay_wgrad", [(1, None, False), (1, None, True), (2, 2, False), (2, 2, True)], ids=str
)
def test_comm_overlap_and_ours_accept_the_guidance(bridge, pp, vpp, delay_wgrad):
    """Bridge's MoE overlap guidance with "custom": Bridge's CommOverlapConfig, our validate_config
    and Megatron-Core's __post_init__ all accept it; with VPP Bridge sets the interleaved
    schedule's p2p knobs (overlapped, not batched)."""
    from moe_dispatch.megatron.config import validate_config

    model = _custom_provider(bridge, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    _bridge_overlap_setup(bridge, model, overlap=True, delay_wgrad=delay_wgrad)
    assert model.overlap_moe_expert_parallel_comm is True and model.delay_wgrad_compute is delay_wgrad
    assert (model.overlap_p2p_comm, model.batch_p2p_comm) == ((True, False) if pp > 1 else (False, False))
    validate_config(model)
    model.finalize()
    assert model.moe_flex_dispatcher_backend == "custom" and model.overlap_moe_expert_parallel_comm


# (recipe fields, EP overlap, delay_wgrad, Bridge's assertion message, our message)
WRONG_SETTINGS = {
    "ep1": (
        dict(expert_model_parallel_size=1, expert_tensor_parallel_size=2),
        True,
        False,
        r"only supported when expert_model_parallel_size > 1",
        r"but expert_model_parallel_size=1: there is no EP communication to hide",
    ),
    "one_expert": (dict(num_moe_experts=1), True, False, r"num_moe_experts > 1", r"num_moe_experts=1: set"),
    "fp32": (
        dict(bf16=False, params_dtype=torch.float32),
        True,
        True,
        r"only supported when using bf16 or fp16",
        r"needs a bf16 or fp16 model .* but bf16=False and fp16=False: set bf16=True",
    ),
    "pp_without_vpp": (
        dict(pipeline_model_parallel_size=2),
        True,
        False,
        r"virtual_pipeline_model_parallel_size must be specified",
        r"pipeline_model_parallel_size=2 needs the interleaved schedule: set virtual_pipeline_model_parallel_size",
    ),
    "full_recompute": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        True,
        True,
        r"disable full recomputation",
        r"with recompute_granularity='full': .* Set recompute_granularity='selective'",
    ),
    "recompute_method": (
        dict(recompute_method="block"),
        True,
        False,
        r"disable recomputation method",
        r"with recompute_method='block' .* Set recompute_method=None",
    ),
    "recompute_num_layers": (
        dict(recompute_num_layers=2),
        True,
        False,
        r"recompute_num_layers must be None",
        r"with recompute_num_layers=2 .* Set recompute_num_layers=None",
    ),
    "moe_recompute": (
        dict(recompute_granularity="selective", recompute_modules=["moe"]),
        True,
        False,
        r"disable moe in recompute_modules",
        r"with 'moe' in recompute_modules=\['moe'\]: .* Drop 'moe'",
    ),
    "shared_expert_overlap": (
        dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
        True,
        True,
        r"disable moe_shared_expert_overlap",
        r"moe_shared_expert_overlap=True and overlap_moe_expert_parallel_comm=True exclude each other.*set "
        r"moe_shared_expert_overlap=False",
    ),
    "two_mtp_layers": (
        dict(mtp_num_layers=2),
        True,
        False,
        r"MTP supports at most one layer",
        r"with mtp_num_layers=2: .* Set mtp_num_layers=1",
    ),
    "delay_wgrad_without_overlap": (
        {},
        False,
        True,
        r"overlap_moe_expert_parallel_comm is required for delay_wgrad_compute",
        r"delay_wgrad_compute=True defers .* set overlap_moe_expert_parallel_comm=True too",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_SETTINGS))
def test_comm_overlap_and_ours_refuse_the_same(bridge, case):
    """Each wrong setting for EP overlap: Bridge's CommOverlapConfig refuses it (bare assert, its
    own reason), and so does our validate_config once the overlap knobs are on the model (where
    Bridge's setup would have put them), with a ValueError that names the knob and the fix."""
    from moe_dispatch.megatron.config import validate_config

    fields, overlap, delay_wgrad, bridge_reason, ours = WRONG_SETTINGS[case]
    model = _custom_provider(bridge, **fields)
    with pytest.raises(AssertionError, match=bridge_reason):
        _bridge_overlap_setup(bridge, model, overlap=overlap, delay_wgrad=delay_wgrad)
    model.overlap_moe_expert_parallel_comm, model.delay_wgrad_compute = overlap, delay_wgrad
    with pytest.raises(ValueError, match=ours):
        validate_config(model)

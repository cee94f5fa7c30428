"""The real Megatron-Bridge (``make venv`` installs megatron-bridge 0.6.2 from the package index,
without its dependencies; see requirements/bridge.txt) with backend "custom", on CPU.

In a 2-rank gloo world (EP 2): Bridge's own ``apply_flex_dispatcher_backend(cfg, "custom")``
and ``validate_flex_dispatcher_backend(cfg)``, patched by ``moe_dispatch.megatron`` when the
module is imported, select and check the backend; other names still reach Bridge's code; the
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
"""

from __future__ import annotations

import importlib.metadata

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

from .worlds import assert_case, run_cases, world_results  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.world]

WORLD_SIZE = 2
BRIDGE_MODULE = "megatron.bridge.training.flex_dispatcher_backend"


def import_bridge_flex_module():
    """Bridge's ``flex_dispatcher_backend`` from the installed wheel, its package ``__init__``
    not run (the module docstring says why)."""
    import importlib.util
    import sys

    if "megatron.bridge" not in sys.modules:
        spec = importlib.util.find_spec("megatron.bridge")  # finds the package, runs nothing
        assert spec is not None and spec.submodule_search_locations, "megatron-bridge's package is not importable"
        sys.modules["megatron.bridge"] = importlib.util.module_from_spec(spec)
    return importlib.import_module(BRIDGE_MODULE)


def _config(dispatcher: str = "alltoall", **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=WORLD_SIZE,
        use_cpu_initialization=True,
        add_bias_linear=False,
        moe_ffn_hidden_size=32,
        ffn_hidden_size=32,
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
    import torch._dynamo

    torch._dynamo.config.disable = True
    first = run_cases(rank, world_size, FIRST_CASES)
    import moe_dispatch.megatron.cpu as mcpu  # imports the backend

    mcpu.enable()
    return {**first, **run_cases(rank, world_size, CASES)}


def test_bridge_version():
    assert BRIDGE_VERSION == "0.6.2", f"requirements/bridge.txt pins megatron-bridge 0.6.2, found {BRIDGE_VERSION}"


@pytest.mark.parametrize("case", [*FIRST_CASES, *CASES])
def test_megatron_bridge(case):
    assert_case(world_results(world_entry, WORLD_SIZE), case)

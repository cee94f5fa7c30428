"""The start-up import hook (``moe_dispatch._autoload``, run by ``moe_dispatch-autoload.pth``): the
flex backend "custom" works in Megatron-Core and Megatron-Bridge without ``import
moe_dispatch.megatron``, and costs nothing until Megatron is imported.

Each check runs in a fresh interpreter of this environment (the ``.pth`` runs only at start-up),
importing nothing of ``moe_dispatch`` itself. In a 2-rank gloo world (EP 2), a ``MoELayer`` whose
config names "custom" gets our manager, and with ``delay_wgrad_compute=True`` its local experts
defer their weight gradients, all without the explicit import. Bridge's own helpers are in
test_megatron_bridge.py (they need its wheel, which the Python 3.11 environment lacks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from moe_dispatch.testing.models import moe_config_fields

from .worlds import assert_case, run_megatron_cases, world_results

PTH = "moe_dispatch-autoload.pth"


def _python(code: str, **env) -> dict:
    """Runs ``code`` in a fresh interpreter; it prints one JSON object, returned here."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=Path(__file__).parent,  # not the source tree's root: only the installed hook can act
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pth_file_is_installed():
    site = Path(sysconfig.get_paths()["purelib"])
    pth = site / PTH
    assert pth.exists(), f"{pth} is missing: reinstall moe_dispatch (pip install . or make install)"
    assert pth.read_text().startswith("import moe_dispatch._autoload;")


def test_start_up_installs_the_finder_and_imports_no_torch():
    got = _python(
        "import json, sys\n"
        "finder = [type(f).__module__ for f in sys.meta_path if type(f).__module__ == 'moe_dispatch._autoload']\n"
        "print(json.dumps({'finder': finder, 'torch': 'torch' in sys.modules}))\n"
    )
    assert got == {"finder": ["moe_dispatch._autoload"], "torch": False}
    off = _python(
        "import json, sys\n"
        "print(json.dumps({'finder': any(type(f).__module__ == 'moe_dispatch._autoload' for f in sys.meta_path)}))\n",
        MOE_DISPATCH_AUTOLOAD="0",
    )
    assert off == {"finder": False}


BUILD_LAYER = """
import json, sys
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2)
cfg.moe_flex_dispatcher_backend = "custom"  # by hand, with the alltoall dispatcher type
before = "moe_dispatch.megatron" in sys.modules
try:
    MoELayer(cfg)
    error = None
except Exception as e:  # ours: a ValueError; Megatron's own, without the hook: 0.16 asserts on its groups
    error = str(e)
print(json.dumps({"wrapped": getattr(MoELayer.__init__, "_moe_dispatch_patched", False), "before": before,
                  "error": error}))
"""


def test_a_custom_layer_with_another_dispatcher_type_fails_loudly():
    """Megatron would build the alltoall dispatcher without a word; the hook's config check names it."""
    got = _python(BUILD_LAYER)
    assert got["wrapped"] and not got["before"]
    assert "takes effect only with moe_token_dispatcher_type='flex'" in got["error"]
    off = _python(BUILD_LAYER, MOE_DISPATCH_AUTOLOAD="0")  # Megatron's own constructor, failing on its own terms
    assert not off["wrapped"] and not off["before"] and "moe_token_dispatcher_type" not in (off["error"] or "")


# ---------------------------------------------------------------------------------------------
# a 2-rank world: a "custom" MoELayer built without the explicit import
# ---------------------------------------------------------------------------------------------


def _custom_layer_without_import(rank, world_size):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert "moe_dispatch.megatron" not in sys.modules, "the test must start without moe_dispatch.megatron"
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    fields = moe_config_fields(
        dtype=torch.bfloat16,
        expert_model_parallel_size=world_size,
        use_cpu_initialization=True,
        add_bias_linear=False,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="custom",
        moe_shared_expert_overlap=False,
        overlap_moe_expert_parallel_comm=True,
        delay_wgrad_compute=True,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    layer = spec(config=TransformerConfig(**fields))
    import moe_dispatch.megatron as mdm  # imported by the hook while the layer was built: nothing new here

    assert type(layer.token_dispatcher._comm_manager) is mdm.CustomDispatchManager
    store = layer.moe_dispatch_wgrad_store  # set by the backend: the local experts defer their wgrads
    assert store.run_wgrad == "backward_dw" and layer.token_dispatcher._comm_manager.wgrad_store is store
    weights = [lin.weight for e in layer.experts.local_experts for lin in (e.linear_fc1, e.linear_fc2)]
    assert all(w.skip_backward_post_hook for w in weights)


def _world_entry(rank: int, world_size: int):
    # the CPU shims would import the backend: the case runs before them
    return run_megatron_cases(
        rank, world_size, {}, before_shims={"custom_layer_without_import": _custom_layer_without_import}
    )


@pytest.mark.world
@pytest.mark.megatron
def test_world_custom_layer_without_import():
    pytest.importorskip("megatron.core")
    assert_case(world_results(_world_entry, 2), "custom_layer_without_import")

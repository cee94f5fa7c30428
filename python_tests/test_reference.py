"""The oracle itself: dispatch and combine are adjoint (<dispatch(x), y> == <x, combine(y)>),
checked on random worlds without any process group."""

import pytest
import torch

from moe_dispatch.semantics import reference

from .test_dispatch import make_routing


@pytest.mark.parametrize("world_size,ranks_per_node", [(1, 1), (4, 2), (8, 4), (6, 3)])
def test_dispatch_combine_adjoint(world_size, ranks_per_node):
    num_tokens = [13 + r for r in range(world_size)]
    idxs, _, num_experts = make_routing(world_size, num_tokens, seed=world_size)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(t, 5, generator=gen, dtype=torch.float64) for t in num_tokens]
    recv = reference.dispatch(xs, idxs, None, num_experts, ranks_per_node)
    ys = [torch.randn(r.recv_x.shape, generator=gen, dtype=torch.float64) for r in recv]
    outs = reference.combine(ys, idxs, num_experts, ranks_per_node)
    lhs = sum((r.recv_x * y).sum() for r, y in zip(recv, ys))
    rhs = sum((x * o).sum() for x, o in zip(xs, outs))
    # combine accumulates in fp32 whatever the dtype, and sums in another order: fp32 tolerance
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-5)


def test_rows_ordered_by_source_rank_then_token():
    idxs, _, num_experts = make_routing(4, [9, 0, 7, 11], seed=3)
    xs = [torch.zeros(t, 1) for t in (9, 0, 7, 11)]
    for r in reference.dispatch(xs, idxs, None, num_experts, 2):
        key = r.src_rank * 1000 + r.src_idx
        assert torch.equal(key, key.sort().values)
        # every received row names a token that selected one of this rank's experts
        assert bool((r.recv_topk_idx >= 0).any(1).all())


def test_public_paths_reexport_the_moved_modules():
    """The paths users import keep working after the layout change (thin re-export modules)."""
    import moe_dispatch.env
    import moe_dispatch.launch
    import moe_dispatch.reference
    from moe_dispatch.testing import launch
    from moe_dispatch.tools import env

    assert moe_dispatch.reference.dispatch is reference.dispatch and moe_dispatch.reference.combine is reference.combine
    assert (
        moe_dispatch.launch.spawn_world is launch.spawn_world
        and moe_dispatch.launch.launch_ranks is launch.launch_ranks
    )
    assert moe_dispatch.env.main is env.main


def test_semantics_import_only_torch_and_each_other():
    """moe_dispatch.semantics is the oracle: its modules import the standard library, torch and
    each other, never Triton or the kernels they are the reference of."""
    import ast
    import sys
    from pathlib import Path

    import moe_dispatch.semantics

    folder = Path(moe_dispatch.semantics.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name} imports from outside semantics/: {ast.unparse(node)}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    top = name.split(".")[0]
                    assert top in ("torch", "__future__") or top in sys.stdlib_module_names, (
                        f"{path.name} imports {name}"
                    )

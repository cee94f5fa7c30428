"""GPU: the torch_dist and kernel transports on CUDA tensors (NCCL world of one rank per visible GPU, which
on a single-GPU machine is one rank): layout through the Triton kernels, transfers on the
Buffer's communication stream, events, hooks, comm-stream allocation. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from moe_dispatch import Buffer
from moe_dispatch.semantics import reference

from .test_dispatch import expert, make_routing, make_x
from .worlds import assert_case, run_cases, world_results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.world,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL world)"),
]


def _roundtrip(rank, world_size, buf, **launch):
    num_tokens = [512] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=40, zipf=1.0)
    xs = make_x(num_tokens, 2880, torch.bfloat16, seed=40)
    dev = buf.device
    mode = "hook" if launch.get("return_recv_hook") else "async" if launch.get("async_finish") else "sync"
    outs = buf.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev), num_experts, **launch)
    if mode == "hook":
        outs[-1]()
    elif mode == "async":
        outs[-1].current_stream_wait()
    recv_x, recv_idx, recv_w, per_expert, handle = outs[:5]
    refs = reference.dispatch(xs, idxs, ws, num_experts, buf.topology.ranks_per_node)
    rows = refs[rank].recv_x.shape[0]
    if launch.get("num_worst_tokens"):  # static size: the received rows first, then padding 0 / -1 / 0
        assert recv_x.shape[0] == launch["num_worst_tokens"]
        assert not recv_x[rows:].any() and bool((recv_idx[rows:] == -1).all()) and not recv_w[rows:].any()
    assert torch.equal(recv_x[:rows].cpu(), refs[rank].recv_x)
    assert torch.equal(recv_idx[:rows].cpu(), refs[rank].recv_topk_idx)
    assert torch.equal(recv_w[:rows].cpu(), refs[rank].recv_topk_weights)
    ys = [expert(r.recv_x, i) for i, r in enumerate(refs)]
    y = expert(recv_x, rank)
    y[rows:] = 1e4  # padding rows must not reach any token
    out, event, *hook = buf.combine(y, handle, **{k: v for k, v in launch.items() if k != "num_worst_tokens"})
    if hook:
        hook[0]()
    event.current_stream_wait()
    want = reference.combine(ys, idxs, num_experts, buf.topology.ranks_per_node, ranks=[rank])[0]
    assert torch.equal(out.cpu(), want)


CASES = {
    "sync": lambda r, w, buf: _roundtrip(r, w, buf),
    "async": lambda r, w, buf: _roundtrip(r, w, buf, async_finish=True),
    "async-alloc-on-comm-stream": lambda r, w, buf: _roundtrip(
        r, w, buf, async_finish=True, allocate_on_comm_stream=True
    ),
    "hook": lambda r, w, buf: _roundtrip(r, w, buf, return_recv_hook=True),
    # No host sync at all: the counts travel with the transfer on the communication stream.
    "static-async": lambda r, w, buf: _roundtrip(r, w, buf, async_finish=True, num_worst_tokens=512 * w),
}


def _entry(rank, world_size, transport="auto"):
    return run_cases(rank, world_size, CASES, Buffer(transport=transport, timeout_s=60))


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_torch_dist(case):
    world_size = torch.cuda.device_count()
    assert_case(world_results(_entry, world_size, backend="nccl"), case)


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_kernel_transport(case):
    """The same cases through Buffer(transport="kernels"): the intranode kernels on CUDA IPC
    buffers, launched on the Buffer's communication stream (one rank per visible GPU)."""
    world_size = torch.cuda.device_count()
    assert_case(world_results(_entry, world_size, "kernels", backend="nccl"), case)

"""Run Megatron-Core's MoE layers under gloo on a machine without a GPU (explicit opt-in).

For tests, debugging a dispatcher configuration on a laptop, and the CPU demo. **Not a
training path**: everything runs in fp32/bf16 on CPU cores, orders of magnitude slower than
GPUs, and the CUDA streams Megatron uses to overlap communication become no-ops (the
schedule's order is kept, nothing runs concurrently).

``enable()`` installs the minimal shims megatron-core (0.16, 0.19) needs for an alltoall or flex
``MoELayer`` (and a small ``GPTModel`` built from the local, non-Transformer-Engine spec) on
CPU tensors and gloo process groups:

1. ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream`` /
   ``synchronize`` / ``set_device`` and ``Tensor.record_stream`` become no-ops, and
   ``torch.cuda.current_device()`` returns the CPU device (dispatcher, router and the EP-overlap
   schedule call them unconditionally; code that builds ``torch.device("cuda", index)`` from
   it is not covered).
2. Tensor factories and moves that name a CUDA device (``torch.ones(..., device="cuda")``,
   ``t.cuda()``, ``t.to("cuda")``) land on the CPU (a ``TorchFunctionMode`` entered for the
   process; pass ``redirect_cuda_tensors=False`` to do without).
3. The "CUDA" random-number state that Megatron's RNG tracker forks
   (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``, entered by
   attention even without dropout) is a CPU generator of its own; CPU ops (dropout) draw from
   torch's default CPU generator, so random streams differ from a GPU run.
4. Transformer Engine symbols that megatron's MoE utilities expect as module attributes are
   defined as None when TE is absent (already so in 0.19; older versions left them undefined).
5. Host split sizes of Megatron's ``all_to_all`` reach gloo as Python lists (Megatron passes
   numpy arrays or tensors, which NCCL's binding accepts and gloo's does not).
6. On a CPU-only torch build (e.g. ``torch==2.13.0+cpu``), whose ``torch.cuda.nvtx`` functions
   raise "NVTX functions not installed", NVTX ranges and marks become no-ops (the EP-overlap
   schedule's nodes open one around every forward and backward). CUDA builds keep theirs.
7. Megatron's all-gather of uneven row counts (``_gather_along_first_dim`` with
   ``output_split_sizes``: the alltoall dispatcher's expert-TP gather) runs as one
   ``all_to_all_single`` on a gloo group, whose ``all_gather`` needs equal sizes.
8. Pipeline point-to-point messages on a gloo group carry a tag per direction (activations
   to the next stage, gradients to the previous one). With a pipeline of 2 stages the previous
   and the next stage are the same rank, and Megatron's interleaved (VPP) schedule, with its
   default ``batch_p2p_comm=True``, sends that rank an activation and a gradient of the same
   shape in one batch; untagged messages between two ranks are matched in the order they were
   posted, and both ranks post ``send_prev`` before ``send_next`` but ``recv_prev`` before
   ``recv_next``, so the activation lands in the gradient's buffer and the other way round:
   wrong losses and gradients without an error (Megatron-LM's training arguments refuse PP 2
   with VPP unless ``overlap_p2p_comm``; megatron-core alone does not check). With a tag per
   direction each direction is matched on its own, as between distinct ranks when PP > 2. The
   same holds for the shapes that ``variable_seq_lengths=True`` exchanges ahead of the tensors.

Call it in every rank before building the model; it refuses to run where a GPU is visible.
The changes are process-wide and stay until the process exits (spawned ranks are the place).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_ENABLED = False
_MODE: "_CudaToCpu | None" = None

# moe_utils names megatron's alltoall/flex paths test for None when Transformer Engine is absent.
_TE_SYMBOLS = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_and_pad_with_probs",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: work is already ordered on the CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "_CpuEvent":
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: complete as soon as recorded."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Redirects tensors requested on a CUDA device to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _shim_cuda_runtime() -> None:
    cpu = torch.device("cpu")
    cuda = torch.cuda
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _CpuStream()
    cuda.default_stream = lambda device=None: _CpuStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.current_device = lambda: cpu
    record_stream = torch.Tensor.record_stream

    def record_stream_on_cpu(tensor, stream):
        if isinstance(stream, _CpuStream) or not tensor.is_cuda:
            return None
        return record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream_on_cpu


class _CudaRng:
    """The "CUDA" generator of a CPU process: its own CPU ``torch.Generator``."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def get_state(self, device=None, *args, **kwargs) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state, device=None, *args, **kwargs) -> None:
        self.generator.set_state(state)

    def manual_seed(self, seed) -> None:
        self.generator.manual_seed(int(seed))


def _shim_cuda_rng() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    rng = _CudaRng()
    for module in (torch.cuda, torch.cuda.random):
        module.get_rng_state = rng.get_state
        module.set_rng_state = rng.set_state
        module.manual_seed = rng.manual_seed
        module.manual_seed_all = rng.manual_seed
    megatron_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: rng.get_state()
    megatron_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: rng.set_state(new_state)


class _NoNvtx:
    """Stand-in for ``torch._C._nvtx`` where torch was built without it: ranges of depth 0."""

    @staticmethod
    def rangePushA(msg) -> int:  # noqa: N802 - torch's names
        return 0

    @staticmethod
    def rangePop() -> int:  # noqa: N802
        return 0

    @staticmethod
    def rangeStartA(msg) -> int:  # noqa: N802
        return 0

    @staticmethod
    def rangeEnd(range_id) -> None:  # noqa: N802
        return None

    @staticmethod
    def markA(msg) -> None:  # noqa: N802
        return None

    @staticmethod
    def deviceRangeStart(msg, stream=0) -> None:  # noqa: N802
        return None

    @staticmethod
    def deviceRangeEnd(range_handle, stream=0) -> None:  # noqa: N802
        return None


def _shim_nvtx() -> None:
    if not hasattr(torch._C, "_nvtx"):  # a CPU-only build: torch.cuda.nvtx's stub raises on every call
        torch.cuda.nvtx._nvtx = _NoNvtx()


def _shim_te_symbols() -> None:
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_SYMBOLS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _as_list(splits):
    if splits is None:
        return None
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    return [int(v) for v in values]


def _shim_all_to_all_splits() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings._AllToAll.forward
    if getattr(original, "_moe_dispatch_cpu", False):
        return

    def forward(ctx, group, input, output_split_sizes, input_split_sizes, *args, **kwargs):
        return original(ctx, group, input, _as_list(output_split_sizes), _as_list(input_split_sizes), *args, **kwargs)

    forward._moe_dispatch_cpu = True
    mappings._AllToAll.forward = staticmethod(forward)


def _shim_uneven_all_gather() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim
    if getattr(original, "_moe_dispatch_cpu", False):
        return

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        # every rank sends its rows to every rank; the receive splits are the gathered sizes
        sizes = _as_list(output_split_sizes)
        output = input_.new_empty(sum(sizes), *input_.shape[1:])
        send = input_.contiguous().repeat(group.size(), *([1] * (input_.dim() - 1)))
        dist.all_to_all_single(
            output, send, output_split_sizes=sizes, input_split_sizes=[input_.shape[0]] * group.size(), group=group
        )
        return output

    gather_along_first_dim._moe_dispatch_cpu = True
    mappings._gather_along_first_dim = gather_along_first_dim


# Tags of the two directions of pipeline traffic, so that a peer that is both the previous and the
# next stage (PP 2) matches each direction's messages on their own.
_TAG_TO_NEXT = 1  # activations: send_next -> the next stage's recv_prev
_TAG_TO_PREV = 2  # gradients: send_prev -> the previous stage's recv_next


def _tagged_p2p(
    *,
    tensor_send_prev,
    tensor_recv_prev,
    tensor_send_next,
    tensor_recv_next,
    group,
    prev_pipeline_rank,
    next_pipeline_rank,
) -> dict:
    """Megatron's pipeline exchange as tagged isend/irecv (gloo runs them in any order without
    deadlock); returns the works by Megatron's names (send_next, recv_prev, ...)."""
    import torch.distributed as dist

    ops = {
        "send_next": (dist.isend, tensor_send_next, next_pipeline_rank, _TAG_TO_NEXT),
        "recv_prev": (dist.irecv, tensor_recv_prev, prev_pipeline_rank, _TAG_TO_NEXT),
        "send_prev": (dist.isend, tensor_send_prev, prev_pipeline_rank, _TAG_TO_PREV),
        "recv_next": (dist.irecv, tensor_recv_next, next_pipeline_rank, _TAG_TO_PREV),
    }
    return {name: op(t, peer, group, tag) for name, (op, t, peer, tag) in ops.items() if t is not None}


def _shim_pipeline_p2p() -> None:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    batched, unbatched = p2p._batched_p2p_ops, p2p._p2p_ops
    if getattr(batched, "_moe_dispatch_cpu", False):
        return

    def batched_p2p_ops(**kwargs):  # batch_p2p_comm=True: Megatron waits on a list of works
        if dist.get_backend(kwargs["group"]) != "gloo":
            return batched(**kwargs)
        return list(_tagged_p2p(**kwargs).values())

    def p2p_ops(**kwargs):  # batch_p2p_comm=False: a dict of works by name (overlap_p2p_comm keeps some)
        if dist.get_backend(kwargs["group"]) != "gloo":
            return unbatched(**kwargs)
        return _tagged_p2p(**kwargs)

    communicate_shapes = p2p.P2PCommunicator._communicate_shapes

    def tagged_communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        # variable_seq_lengths: the shapes go ahead of the tensors, in one batch of the same order
        if self.config.use_ring_exchange_p2p or dist.get_backend(self.pp_group) != "gloo":
            return communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        shapes = {
            "tensor_send_next": None if tensor_send_next is None else torch.tensor(tensor_send_next.shape),
            "tensor_send_prev": None if tensor_send_prev is None else torch.tensor(tensor_send_prev.shape),
            "tensor_recv_prev": torch.zeros(3, dtype=torch.int64) if recv_prev else None,
            "tensor_recv_next": torch.zeros(3, dtype=torch.int64) if recv_next else None,
        }
        works = _tagged_p2p(
            **shapes, group=self.pp_group, prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank
        )
        for work in works.values():
            work.wait()
        received = (shapes["tensor_recv_prev"], shapes["tensor_recv_next"])
        return tuple([0, 0, 0] if shape is None else shape.tolist() for shape in received)

    batched_p2p_ops._moe_dispatch_cpu = p2p_ops._moe_dispatch_cpu = True
    p2p._batched_p2p_ops, p2p._p2p_ops = batched_p2p_ops, p2p_ops
    p2p.P2PCommunicator._communicate_shapes = tagged_communicate_shapes


def enable(*, redirect_cuda_tensors: bool = True) -> None:
    """Installs the CPU shims in this process (idempotent; see the module docstring).

    Args:
        redirect_cuda_tensors: also redirect tensors requested on CUDA devices to the CPU
            (needed by Megatron code that allocates with ``device="cuda"``: the default causal
            mask, the schedules' token counters). Costs a Python hook per torch call.

    Raises:
        RuntimeError: a CUDA device is visible (the shims would break real GPU runs).
    """
    global _ENABLED, _MODE
    with _LOCK:
        if torch.cuda.is_available():
            raise RuntimeError(
                "moe_dispatch.megatron.cpu is for processes without a GPU (it replaces torch.cuda "
                "streams and events by no-ops); a CUDA device is visible here: run on the GPU "
                "instead, or hide it with CUDA_VISIBLE_DEVICES=''"
            )
        if not _ENABLED:
            _shim_cuda_runtime()
            _shim_nvtx()
            _shim_cuda_rng()
            _shim_te_symbols()
            _shim_all_to_all_splits()
            _shim_uneven_all_gather()
            _shim_pipeline_p2p()
            _ENABLED = True
        if redirect_cuda_tensors and _MODE is None:
            _MODE = _CudaToCpu()
            _MODE.__enter__()


def is_enabled() -> bool:
    """Whether :func:`enable` ran in this process."""
    return _ENABLED

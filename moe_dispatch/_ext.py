"""Loader and torch wrappers of the CUDA extension ``moe_dispatch._C``.

Importing this module never fails: when the extension is missing or cannot load, the reason
is recorded and reported by :func:`extension_status` (and ``python -m moe_dispatch.env``), and
only the CUDA entry points raise. ``_C`` takes raw device pointers and stream handles; the
wrappers here turn tensors into those and allocate outputs with torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
from pathlib import Path

import torch

from .semantics.validation import check_tensor

NVSHMEM_HOST_LIB = "libnvshmem_host.so.3"


def nvshmem_package_dir() -> Path | None:
    """Folder of the ``nvidia.nvshmem`` pip package (``include/``, ``lib/``), or None.

    It is a namespace package (no ``__init__``), hence the spec lookup rather than ``__file__``.
    """
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ImportError:  # no "nvidia" namespace at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _preload_nvshmem() -> Path | None:
    """Loads the NVSHMEM host library globally so ``_C``'s dependency on it resolves without
    LD_LIBRARY_PATH (editable installs have no rpath to site-packages). Returns its path."""
    package_dir = nvshmem_package_dir()
    if package_dir is None or not (package_dir / "lib" / NVSHMEM_HOST_LIB).exists():
        return None
    path = package_dir / "lib" / NVSHMEM_HOST_LIB
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """What this installation's CUDA extension is.

    Attributes:
        built: ``moe_dispatch._C`` imported.
        error: why it did not (None when built).
        with_nvshmem: compiled against NVSHMEM (internode transport possible).
        cuda_archs: the architectures it was compiled for, e.g. ``"90"``; None when not built.
        nvshmem_lib: the preloaded ``libnvshmem_host.so.3``, or None.
    """

    built: bool
    error: str | None
    with_nvshmem: bool
    cuda_archs: str | None
    nvshmem_lib: str | None

    def __str__(self) -> str:
        if not self.built:
            return f"not built ({self.error})"
        nvshmem = "with NVSHMEM" if self.with_nvshmem else "without NVSHMEM"
        return f"built for sm_{self.cuda_archs.replace(',', ', sm_')}, {nvshmem}"


def _load() -> tuple[object | None, ExtensionStatus]:
    try:
        nvshmem_lib = _preload_nvshmem()
    except OSError as e:
        # _C may still load (built without NVSHMEM); if not, its ImportError says what is missing.
        nvshmem_lib, preload_error = None, f"; preloading {NVSHMEM_HOST_LIB} failed: {e}"
    else:
        preload_error = ""
    try:
        module = importlib.import_module("moe_dispatch._C")
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "moe_dispatch._C":
            error = (
                "moe_dispatch._C is not compiled (a pure-Python install): reinstall with nvcc on PATH "
                "or CUDA_HOME set (MOE_DISPATCH_REQUIRE_CUDA=1 makes a missing nvcc an error)"
            )
        elif NVSHMEM_HOST_LIB in str(e):
            where = "is not installed" if nvshmem_package_dir() is None else "lacks it"
            error = (
                f"moe_dispatch._C failed to load: {e}; it needs {NVSHMEM_HOST_LIB} from the "
                f"nvidia-nvshmem-cu13 package, which {where} (pip install nvidia-nvshmem-cu13)"
            )
        else:
            error = f"moe_dispatch._C failed to load: {e}"
        return None, ExtensionStatus(False, error + preload_error, False, None, None)
    status = ExtensionStatus(
        True, None, bool(module.with_nvshmem), str(module.cuda_archs), str(nvshmem_lib) if nvshmem_lib else None
    )
    return module, status


_C, _STATUS = _load()


def extension_status() -> ExtensionStatus:
    """Whether ``moe_dispatch._C`` loaded, why not, and how it was built."""
    return _STATUS


def cuda_available() -> bool:
    """True when the extension is built and its CUDA runtime sees at least one GPU.

    Asks the extension's own (statically linked) runtime, so a driver too old for it reads as
    unavailable even where torch sees GPUs. Initialises CUDA in this process: call it after
    forking worker processes, not before.
    """
    if _C is None:
        return False
    try:
        return _C.device_count() > 0
    except RuntimeError:  # _C.CudaError: no driver, no device, ...
        return False


def require_extension() -> object:
    """The loaded ``moe_dispatch._C`` module.

    Raises:
        RuntimeError: the extension is not built or failed to load (the message says why).
    """
    if _C is None:
        raise RuntimeError(f"the CUDA extension is unavailable: {_STATUS.error}")
    return _C


@torch.library.custom_op("moe_dispatch::get_dispatch_layout", mutates_args=(), device_types="cuda")
def _get_dispatch_layout_op(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    C = require_extension()
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    with torch.cuda.device(device):
        num_tokens_per_rank = torch.empty(num_ranks, dtype=torch.int64, device=device)
        num_tokens_per_node = torch.empty(num_ranks // ranks_per_node, dtype=torch.int64, device=device)
        num_tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=device)
        is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
        C.get_dispatch_layout(
            topk_idx.data_ptr(),
            num_tokens,
            num_topk,
            num_experts,
            num_ranks,
            ranks_per_node,
            num_tokens_per_rank.data_ptr(),
            num_tokens_per_node.data_ptr(),
            num_tokens_per_expert.data_ptr(),
            is_token_in_rank.data_ptr(),
            torch.cuda.current_stream(device).cuda_stream,
        )
    return num_tokens_per_rank, num_tokens_per_node, num_tokens_per_expert, is_token_in_rank


@_get_dispatch_layout_op.register_fake
def _(topk_idx, num_experts, num_ranks, ranks_per_node):
    num_tokens = topk_idx.shape[0]
    return (
        topk_idx.new_empty(num_ranks, dtype=torch.int64),
        topk_idx.new_empty(num_ranks // ranks_per_node, dtype=torch.int64),
        topk_idx.new_empty(num_experts, dtype=torch.int64),
        topk_idx.new_empty(num_tokens, num_ranks, dtype=torch.bool),
    )


def get_dispatch_layout_cuda(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing layout computed by the CUDA kernel; same results as
    :func:`moe_dispatch.semantics.layout.get_dispatch_layout_reference`.

    Runs on the current stream of ``topk_idx``'s device: asynchronous, no host synchronisation,
    CUDA-graph safe, not collective. Registered as the op ``moe_dispatch::get_dispatch_layout``
    (with a fake implementation for ``torch.compile``).

    Args:
        topk_idx: ``[T, K]`` int64 CUDA tensor, contiguous; global expert ids, ``-1`` = no
            expert. Entries are not range-checked here (that would synchronise the host); ids
            outside ``[0, num_experts)`` are ignored like ``-1``.
        num_experts: E, a positive multiple of ``num_ranks``.
        num_ranks: W, the EP world size.
        ranks_per_node: L, dividing W.

    Returns:
        ``num_tokens_per_rank [W]`` int64, ``num_tokens_per_node [W/L]`` int64,
        ``num_tokens_per_expert [E]`` int64, ``is_token_in_rank [T, W]`` bool; on topk_idx's device.

    Raises:
        TypeError / ValueError: ``topk_idx`` is not a contiguous 2-D int64 CUDA tensor, or the
            sizes do not divide.
        RuntimeError: the extension is not available (see :func:`extension_status`);
            ``moe_dispatch._C.CudaError`` if the launch fails.
    """
    check_tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int64,))
    if topk_idx.device.type != "cuda":
        raise ValueError(f"topk_idx must be a CUDA tensor, got device {topk_idx.device}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts must be a positive multiple of num_ranks={num_ranks}, got {num_experts!r}")
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or num_ranks % ranks_per_node != 0:
        raise ValueError(f"ranks_per_node must divide num_ranks={num_ranks}, got {ranks_per_node!r}")
    return _get_dispatch_layout_op(topk_idx, num_experts, num_ranks, ranks_per_node)

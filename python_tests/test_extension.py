"""The CUDA extension ``moe_dispatch._C`` and its build decisions.

On CPU machines: it is built wherever nvcc exists, loads without a GPU, turns CUDA failures
into exceptions naming the error, and setup.py skips or fails cleanly without nvcc. On a GPU:
the layout kernel equals the torch reference exactly.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_dispatch import _ext
from moe_dispatch.semantics.layout import get_dispatch_layout_reference

from .conftest import needs_gpu

ROOT = Path(__file__).resolve().parents[1]


def _load_setup_py():
    # setup.py calls setup() only under __main__, so importing it just defines its helpers.
    spec = importlib.util.spec_from_file_location("moe_dispatch_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


setup_py = _load_setup_py()
STATUS = _ext.extension_status()
built = pytest.mark.skipif(not STATUS.built, reason=f"moe_dispatch._C not available: {STATUS.error}")


# --- the build -------------------------------------------------------------------------------


def test_extension_built_where_nvcc_exists():
    if setup_py.find_nvcc(os.environ) is None:
        pytest.skip("nvcc not found: the pure-Python install is expected here")
    if os.environ.get("MOE_DISPATCH_SKIP_CUDA", "") not in ("", "0"):
        pytest.skip("MOE_DISPATCH_SKIP_CUDA is set")
    assert STATUS.built, f"nvcc exists but moe_dispatch._C did not load: {STATUS.error}"


@built
def test_module_attributes():
    assert re.fullmatch(r"\d+[af]?(,\d+[af]?)*", _ext._C.cuda_archs), _ext._C.cuda_archs
    assert STATUS.cuda_archs == _ext._C.cuda_archs
    assert isinstance(_ext._C.with_nvshmem, bool)
    assert str(STATUS).startswith("built for sm_")


@built
def test_config_mirror_matches_extension():
    """kernel_layout.py's hand mirror (the pure-Python wheel's only source) equals what _C reports."""
    from moe_dispatch import kernel_layout
    from moe_dispatch.transport.kernels.header import header_words

    intranode, internode = _ext._C.intranode_limits, _ext._C.internode_limits
    mirror = {
        "max_ranks": kernel_layout.MAX_RANKS,
        "max_channels": kernel_layout.MAX_CHANNELS,
        "max_topk": kernel_layout.MAX_TOPK,
        "field_align": kernel_layout.FIELD_ALIGN,
        "line": kernel_layout.LINE,
        "error_record_ints": kernel_layout.ERROR_RECORD_INTS,
        "mismatch_record_words": kernel_layout.MISMATCH_RECORD_WORDS,
        "header_words": kernel_layout.HEADER_WORDS,
        "max_rows_in_flight": kernel_layout.MAX_ROWS_IN_FLIGHT,
        "combine_warps": list(kernel_layout.COMBINE_WARPS),
    }
    assert {k: intranode[k] for k in mirror} == mirror
    assert (internode["max_nodes"], internode["max_ranks_per_node"], internode["max_launch_ranks"]) == (
        kernel_layout.MAX_NODES,
        kernel_layout.MAX_RANKS_PER_NODE,
        kernel_layout.MAX_LAUNCH_RANKS,
    )
    assert internode["max_channels"] == kernel_layout.MAX_CHANNELS
    assert _ext._C.intranode_limits["max_rows_in_flight"] == 2
    compiled = [tuple(v) for v in _ext._C.copy_variants]
    assert compiled == [(a, b, int(c), int(d), int(e)) for a, b, c, d, e in kernel_layout.COPY_VARIANTS]
    assert len(header_words(1, 2, 3, torch.bfloat16, 4, 5, 6)) == kernel_layout.HEADER_WORDS
    assert (
        kernel_layout.buffer_layout(8, 8, 32, 14640, 2).__dict__
        == _ext._C.intranode_buffer_layout(8, 8, 32, 14640, 2).to_dict()
    )
    assert kernel_layout.slot_layout(7168, 224, 8).__dict__ == _ext._C.intranode_slot_layout(7168, 224, 8).to_dict()
    assert (
        kernel_layout.rdma_layout(2, 8, 8, 32, 14640).__dict__
        == _ext._C.internode_rdma_layout(2, 8, 8, 32, 14640).to_dict()
    )


@built
def test_header_and_record_codes_match_extension():
    """The codes Python writes into headers and reads from the kernels' records equal _C's."""
    from moe_dispatch.transport.kernels import header, launcher, timeouts

    codes = _ext._C.codes
    assert {name: code for code, name in header.OPS.items()} == codes["op"]
    assert len(header.FIELDS) == len(codes["header_field"])
    fields = codes["header_field"]
    assert (header.FIELD_STATUS, header.FIELD_BUDGET) == (fields["status"], fields["budget"])
    assert {"grow": header.STATUS_GROW} == codes["status"]
    assert {str(dtype).removeprefix("torch."): c for dtype, c in launcher.COMBINE_DTYPES.items()} == codes[
        "combine_dtype"
    ]
    assert {name: code for code, name in timeouts._PHASES.items()} == codes["phase"]
    assert {name: code for code, name in timeouts._ROLES.items()} == codes["role"]
    assert {name: code for code, name in timeouts._COUNTERS.items()} == codes["counter"]


@built
def test_argument_structs_are_typed():
    """The launch structs take each field by keyword in its C++ type; a missing, unknown or
    too wide field is refused naming the struct and the field."""
    from moe_dispatch.kernel_layout import HEADER_WORDS as words

    C = _ext._C
    check = C.Check(header=list(range(words)), mismatch=64)
    assert check.header == list(range(words)) and check.mismatch == 64 and check.mismatch_host is None
    with pytest.raises(ValueError, match=rf"check.header must list {words} words, got 2"):
        C.Check(header=[1, 2], mismatch=64)
    with pytest.raises(ValueError, match=r"check is missing 'mismatch'"):
        C.Check(header=[0] * words)
    with pytest.raises(TypeError, match=r"combine rank has no field 'rows'"):
        C.CombineRank(rows=1)
    fields = dict(y=None, row_scale=None, is_token_in_rank=None, recv_prefix=None, out=None, check=check)
    with pytest.raises(ValueError, match=r"combine rank.num_rows = 4294967296 does not fit int32"):
        C.CombineRank(**fields, num_tokens=1, num_rows=1 << 32)
    rank = C.CombineRank(**fields, num_tokens=3, num_rows=5)
    assert (rank.num_tokens, rank.num_rows, rank.check.header) == (3, 5, list(range(words)))
    assert C.Variant().loads_in_flight == 4 and C.CpuOptions(num_workers=5).group_warps == 2


def test_status_when_missing_names_the_fix():
    if STATUS.built:
        pytest.skip("the extension is built here")
    assert "not built" in str(STATUS) and STATUS.error


def test_missing_nvshmem_library_is_named_with_the_fix(monkeypatch):
    # Simulated: wherever torch is a CUDA 13 build it loads libnvshmem_host.so.3 itself, so a
    # real process with torch but without the library does not exist on this machine.
    def import_fails(name):
        raise ImportError(f"{_ext.NVSHMEM_HOST_LIB}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(_ext, "nvshmem_package_dir", lambda: None)
    monkeypatch.setattr(_ext.importlib, "import_module", import_fails)
    module, status = _ext._load()
    assert module is None and not status.built and not status.with_nvshmem
    assert status.error == (
        "moe_dispatch._C failed to load: libnvshmem_host.so.3: cannot open shared object file: "
        "No such file or directory; it needs libnvshmem_host.so.3 from the nvidia-nvshmem-cu13 "
        "package, which is not installed (pip install nvidia-nvshmem-cu13)"
    )


@built
def test_with_nvshmem_when_package_installed():
    if _ext.nvshmem_package_dir() is None:
        pytest.skip("nvidia-nvshmem package not installed")
    assert STATUS.with_nvshmem, "the nvidia.nvshmem package is installed but _C was built without it"
    assert STATUS.nvshmem_lib and STATUS.nvshmem_lib.endswith("libnvshmem_host.so.3")
    major, minor = _ext._C.nvshmem_version()  # host-only: works without a GPU
    for dist in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        try:
            assert importlib.metadata.version(dist).split(".")[:2] == [str(major), str(minor)]
            break
        except importlib.metadata.PackageNotFoundError:
            continue


@built
def test_device_count_error_is_a_named_exception():
    if _ext.cuda_available():
        pytest.skip("a GPU is visible: device_count succeeds")
    with pytest.raises(
        _ext._C.CudaError, match=r"CUDA error \d+ \(cudaError\w+: .*\) at csrc/bindings\.cpp:\d+"
    ) as info:
        _ext._C.device_count()
    error = info.value
    assert isinstance(error, RuntimeError)
    assert error.code != 0 and error.name.startswith("cudaError")
    assert error.file == "csrc/bindings.cpp" and error.line > 0


@built
@pytest.mark.parametrize(
    "sizes, match",
    [
        ((4, 2, 7, 4, 2), r"num_experts must be a positive multiple of num_ranks=4, got 7"),
        ((4, 2, 8, 4, 3), r"ranks_per_node must divide num_ranks=4, got 3"),
        ((-1, 2, 8, 4, 2), r"num_tokens must be in \[0, 2147483647\], got -1"),
        ((4, 2, 8, 0, 1), r"num_ranks must be >= 1, got 0"),
        ((1 << 20, 1 << 12, 8, 4, 2), r"num_tokens \* num_topk must be <= 2147483647"),
    ],
)
def test_layout_binding_rejects_bad_sizes(sizes, match):
    # Host checks run before anything touches CUDA, so they are testable without a GPU.
    num_tokens, num_topk, num_experts, num_ranks, ranks_per_node = sizes
    with pytest.raises(ValueError, match=match):
        _ext._C.get_dispatch_layout(8, num_tokens, num_topk, num_experts, num_ranks, ranks_per_node, 8, 8, 8, 8, 0)


# --- setup.py's decision (called directly: no pip run) -----------------------------------


def test_require_cuda_without_nvcc_fails(tmp_path):
    environ = {"PATH": str(tmp_path), "MOE_DISPATCH_REQUIRE_CUDA": "1"}
    with pytest.raises(SystemExit, match=r"MOE_DISPATCH_REQUIRE_CUDA=1 but nvcc not found on PATH"):
        setup_py.plan_cuda_build(environ, default_cuda_home=str(tmp_path / "no-cuda"))


def test_without_nvcc_the_plan_skips_with_the_reason(tmp_path, capsys):
    plan = setup_py.plan_cuda_build({"PATH": str(tmp_path)}, default_cuda_home=str(tmp_path))
    assert plan.nvcc is None and plan.archs is None and plan.nvcc_version is None
    assert plan.skip_reason == f"nvcc not found on PATH, in $CUDA_HOME/bin or in {tmp_path}/bin"
    assert capsys.readouterr().err == ""  # setup.py runs once per build hook; the build announces it


def test_announce_skip_prints_one_line(capsys):
    setup_py.announce_skip(setup_py.CudaPlan(None, "MOE_DISPATCH_SKIP_CUDA=1"))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "moe_dispatch: CUDA extension moe_dispatch._C skipped (MOE_DISPATCH_SKIP_CUDA=1); "
        "building the pure-Python package (py3-none-any)\n"
    )


def _fake_nvcc(path: Path, version: str, archs: list[str] | None) -> Path:
    """An nvcc script answering --version and --list-gpu-arch (exit 1 for it when archs is None)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    listing = 'printf "%s\\n" ' + " ".join(f"compute_{a}" for a in archs) if archs is not None else "exit 1"
    path.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "Cuda compilation tools, release {version.rsplit(".", 1)[0]}, V{version}" ;;
  --list-gpu-arch) {listing} ;;
  *) exit 2 ;;
esac
""")
    path.chmod(0o755)
    return path


def test_nvcc_found_in_cuda_home_and_queried(tmp_path, capsys):
    nvcc = _fake_nvcc(tmp_path / "cuda" / "bin" / "nvcc", "12.8.93", ["80", "90", "100", "120"])
    environ = {"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path / "cuda")}
    plan = setup_py.plan_cuda_build(environ, default_cuda_home=str(tmp_path / "none"))
    assert plan == setup_py.CudaPlan(str(nvcc), None, "12.8.93", "90;100")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "archs, default",
    [(["75", "80", "86", "89", "90"], "90"), (None, "90"), (["90", "100", "103", "110", "120"], "90;100")],
)
def test_default_archs_follow_what_nvcc_supports(tmp_path, archs, default):
    nvcc = _fake_nvcc(tmp_path / "nvcc", "12.4.131", archs)
    assert setup_py.nvcc_gpu_archs(str(nvcc)) == (None if archs is None else set(archs))
    assert setup_py.cuda_archs({}, setup_py.nvcc_gpu_archs(str(nvcc))) == default
    # The variable wins over the detection.
    assert setup_py.cuda_archs({"MOE_DISPATCH_CUDA_ARCHS": "100a"}, setup_py.nvcc_gpu_archs(str(nvcc))) == "100a"


def test_default_archs_fail_when_nvcc_supports_none():
    with pytest.raises(SystemExit, match=r"nvcc supports none of sm_90, sm_100 \(it lists compute_70, compute_80\)"):
        setup_py.cuda_archs({}, {"70", "80"})


def test_real_nvcc_is_queried():
    nvcc = setup_py.find_nvcc(os.environ)
    if nvcc is None:
        pytest.skip("nvcc not found")
    assert re.fullmatch(r"\d+\.\d+\.\d+", setup_py.nvcc_version(nvcc))
    assert "90" in setup_py.nvcc_gpu_archs(nvcc)


def test_nvcc_version_rejects_unknown_output(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho hello\n")
    nvcc.chmod(0o755)
    with pytest.raises(SystemExit, match=r"printed no version \(expected 'V<major>.<minor>.<patch>'\), got 'hello\\n'"):
        setup_py.nvcc_version(str(nvcc))


def test_skip_cuda_overrides_nvcc_and_contradicts_require():
    assert setup_py.plan_cuda_build({"MOE_DISPATCH_SKIP_CUDA": "1"}) == setup_py.CudaPlan(
        None, "MOE_DISPATCH_SKIP_CUDA=1"
    )
    with pytest.raises(SystemExit, match="contradict"):
        setup_py.plan_cuda_build({"MOE_DISPATCH_SKIP_CUDA": "1", "MOE_DISPATCH_REQUIRE_CUDA": "1"})


def test_build_info_module_round_trips():
    plan = setup_py.CudaPlan("/cuda/bin/nvcc", None, "13.0.88", "90;100")
    values = {}
    exec(setup_py.build_info_source(plan, "ab" * 20, True, "3.4.5"), values)
    assert {k: v for k, v in values.items() if k.isupper()} == {
        "COMMIT": "ab" * 20,
        "COMMIT_DIRTY": True,
        "NVCC_VERSION": "13.0.88",
        "CUDA_ARCHS": "90;100",
        "NVSHMEM_VERSION": "3.4.5",
    }


def test_git_commit_only_for_the_checkout_top_level(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout")
    commit, dirty = setup_py.git_commit(ROOT)
    assert commit == head.stdout.strip() and isinstance(dirty, bool)
    assert setup_py.git_commit(ROOT / "moe_dispatch") == (None, False)  # inside, but not the top level
    assert setup_py.git_commit(tmp_path) == (None, False)


def test_nvshmem_version_from_headers():
    root = setup_py.find_nvshmem(os.environ)
    if root is None:
        pytest.skip("nvidia-nvshmem package not installed")
    assert setup_py.nvshmem_version(root) == importlib.metadata.version("nvidia-nvshmem-cu13")


def test_nvshmem_home_is_used_when_complete(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "lib").mkdir()
    assert setup_py.find_nvshmem({"NVSHMEM_HOME": str(tmp_path)}) is None  # headers missing
    (tmp_path / "include" / "nvshmem.h").write_text("")
    (tmp_path / "lib" / "libnvshmem_host.so.3").write_text("")
    assert setup_py.find_nvshmem({"NVSHMEM_HOME": str(tmp_path)}) == str(tmp_path)


@pytest.mark.parametrize(
    "raw, archs", [(None, "90"), ("90", "90"), ("90, 100a", "90;100a"), ("80;90a-real", "80;90a-real")]
)
def test_cuda_archs(raw, archs):
    # Without what nvcc supports (None), the default is sm_90 alone.
    assert setup_py.cuda_archs({} if raw is None else {"MOE_DISPATCH_CUDA_ARCHS": raw}) == archs


def test_cuda_archs_rejects_junk():
    with pytest.raises(SystemExit, match=r"MOE_DISPATCH_CUDA_ARCHS must list CUDA architectures .* got 'sm_90'"):
        setup_py.cuda_archs({"MOE_DISPATCH_CUDA_ARCHS": "sm_90"})


# --- the torch wrapper -------------------------------------------------------------------------


def test_wrapper_validates_before_launch():
    with pytest.raises(ValueError, match=r"topk_idx must be a CUDA tensor, got device cpu"):
        _ext.get_dispatch_layout_cuda(torch.zeros(4, 2, dtype=torch.int64), 8, 4, 2)
    with pytest.raises(TypeError, match=r"topk_idx must have dtype in \(int64\), got int32"):
        _ext.get_dispatch_layout_cuda(torch.zeros(4, 2, dtype=torch.int32), 8, 4, 2)
    with pytest.raises(ValueError, match=r"topk_idx must be contiguous"):
        _ext.get_dispatch_layout_cuda(torch.zeros(2, 4, dtype=torch.int64).t(), 8, 4, 2)


def test_op_fake_impl_gives_shapes():
    # The fake implementation is what torch.compile traces; meta tensors reach it on CPU.
    topk_idx = torch.empty(5, 3, dtype=torch.int64, device="meta")
    outs = torch.ops.moe_dispatch.get_dispatch_layout(topk_idx, 12, 6, 2)
    assert [tuple(o.shape) for o in outs] == [(6,), (3,), (12,), (5, 6)]
    assert [o.dtype for o in outs] == [torch.int64, torch.int64, torch.int64, torch.bool]


# --- the kernel (GPU only) ---------------------------------------------------------------------


def _routing(gen, num_tokens, num_topk, num_experts, skewed, drop):
    """``[T, K]`` int64 top-k without repeats; skewed piles tokens onto a few experts, drop is
    the fraction of entries set to -1."""
    weights = torch.rand(num_experts, generator=gen) ** 8 + 1e-6 if skewed else torch.ones(num_experts)
    idx = (
        torch.multinomial(weights.expand(num_tokens, -1), num_topk, generator=gen)
        if num_tokens
        else torch.empty(0, num_topk, dtype=torch.int64)
    )
    idx[torch.rand(idx.shape, generator=gen) < drop] = -1
    return idx


LAYOUT_CASES = [
    # T, K, E, W, L, skewed, drop
    (0, 8, 64, 8, 8, False, 0.0),
    (1, 1, 1, 1, 1, False, 0.0),
    (37, 8, 64, 8, 4, True, 0.2),
    (129, 6, 48, 12, 3, False, 0.5),
    (4096, 8, 256, 16, 8, True, 0.05),
    (4096, 8, 256, 64, 8, False, 0.0),
    (50, 3, 2048, 2048, 1024, False, 0.1),  # several counting blocks per role
    (3000, 9, 3072, 1536, 3, True, 0.05),  # grid-stride is_token_in_rank
    (20, 5, 10, 5, 5, False, 1.0),  # every entry -1
]


@needs_gpu
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "T{}-K{}-E{}-W{}-L{}-skew{}-drop{}".format(*c))
def test_layout_kernel_matches_reference(case):
    num_tokens, num_topk, num_experts, num_ranks, ranks_per_node, skewed, drop = case
    gen = torch.Generator().manual_seed(hash(case) % (1 << 31))
    topk_idx = _routing(gen, num_tokens, num_topk, num_experts, skewed, drop).cuda()
    got = _ext.get_dispatch_layout_cuda(topk_idx, num_experts, num_ranks, ranks_per_node)
    want = get_dispatch_layout_reference(topk_idx, num_experts, num_ranks, ranks_per_node)
    for name, g, w in zip(
        ("num_tokens_per_rank", "num_tokens_per_node", "num_tokens_per_expert", "is_token_in_rank"), got, want
    ):
        assert g.dtype == w.dtype and g.device == topk_idx.device, name
        assert torch.equal(g, w), name  # counts are exact


@needs_gpu
def test_layout_kernel_on_side_stream_is_deterministic():
    gen = torch.Generator().manual_seed(7)
    topk_idx = _routing(gen, 2048, 8, 128, True, 0.1).cuda()
    first = _ext.get_dispatch_layout_cuda(topk_idx, 128, 16, 8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        second = _ext.get_dispatch_layout_cuda(topk_idx, 128, 16, 8)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b in zip(first, second):
        assert torch.equal(a, b)

// Python bindings of moe_dispatch._C. Arguments are plain integers (device pointers from
// tensor.data_ptr(), streams from torch.cuda.Stream.cuda_stream), so the module does not
// depend on the torch C++ ABI; moe_dispatch/_ext.py wraps it for tensors.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "core/error.h"
#include "kernels/layout.h"

#ifdef MOE_DISPATCH_WITH_NVSHMEM
#include <nvshmem_host.h>
#endif

namespace py = pybind11;

namespace moe_dispatch {
namespace bind {
// csrc/kernels/intranode_bindings.cpp: the argument classes both kernel families share (bind_args.h).
void register_arg_types(py::module_& m);
}  // namespace bind
// csrc/kernels/intranode_bindings.cpp: intranode dispatch/combine, CUDA IPC helpers.
void register_intranode(py::module_& m);
// csrc/kernels/internode_bindings.cpp: stage 1 of internode dispatch/combine, NVSHMEM host calls.
void register_internode(py::module_& m);
// csrc/kernels/{layout,pack,permute,sums}_cpu.cpp: the CPU host passes of the torch_dist path.
void register_layout(py::module_& m);
void register_pack(py::module_& m);
void register_permute(py::module_& m);
void register_sums(py::module_& m);
}  // namespace moe_dispatch

namespace {

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

int device_count() {
  int count = 0;
  MOE_CUDA_CHECK(cudaGetDeviceCount(&count));
  return count;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_dispatch CUDA kernels over raw device pointers (see moe_dispatch/_ext.py).";

  // moe_dispatch._C.CudaError(RuntimeError) with attributes code (int), name (e.g.
  // "cudaErrorNoDevice"), file and line of the failing call in csrc/.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> cuda_error_type;
  cuda_error_type.call_once_and_store_result([]() {
    return py::reinterpret_steal<py::object>(
        PyErr_NewException("moe_dispatch._C.CudaError", PyExc_RuntimeError, nullptr));
  });
  m.attr("CudaError") = cuda_error_type.get_stored();
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const moe_dispatch::CudaError& e) {
      py::object type = cuda_error_type.get_stored();
      py::object error = type(e.what());
      error.attr("code") = e.code();
      error.attr("name") = e.name();
      error.attr("file") = e.file();
      error.attr("line") = e.line();
      PyErr_SetObject(type.ptr(), error.ptr());
    }
  });

  m.attr("cuda_archs") = MOE_DISPATCH_CUDA_ARCHS;
#ifdef MOE_DISPATCH_WITH_NVSHMEM
  m.attr("with_nvshmem") = true;
  m.def(
      "nvshmem_version",
      []() {
        // The library's own version, answered from host constants: no GPU, no nvshmem_init.
        int major = 0, minor = 0, patch = 0;
        nvshmemx_vendor_get_version_info(&major, &minor, &patch);
        return py::make_tuple(major, minor);
      },
      "(major, minor) of the linked NVSHMEM host library; needs no GPU.");
#else
  m.attr("with_nvshmem") = false;
#endif

  m.def("device_count", &device_count,
        "Number of CUDA devices the runtime sees (cudaGetDeviceCount).\n\n"
        "Raises moe_dispatch._C.CudaError naming the CUDA error when the runtime cannot answer "
        "(e.g. cudaErrorInsufficientDriver without a driver).");

  m.def(
      "get_dispatch_layout",
      [](std::uintptr_t topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts, int64_t num_ranks,
         int64_t ranks_per_node, std::uintptr_t num_tokens_per_rank, std::uintptr_t num_tokens_per_node,
         std::uintptr_t num_tokens_per_expert, std::uintptr_t is_token_in_rank, std::uintptr_t stream) {
        moe_dispatch::get_dispatch_layout(as_ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks,
                                          ranks_per_node, as_ptr<int64_t>(num_tokens_per_rank),
                                          as_ptr<int64_t>(num_tokens_per_node), as_ptr<int64_t>(num_tokens_per_expert),
                                          as_ptr<bool>(is_token_in_rank), as_stream(stream));
      },
      py::arg("topk_idx_ptr"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"), py::arg("num_ranks"),
      py::arg("ranks_per_node"), py::arg("num_tokens_per_rank_ptr"), py::arg("num_tokens_per_node_ptr"),
      py::arg("num_tokens_per_expert_ptr"), py::arg("is_token_in_rank_ptr"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>(),
      "Launches the routing-layout kernel on `stream` (asynchronous, CUDA-graph safe).\n\n"
      "Pointers are device addresses: topk_idx [num_tokens, num_topk] int64 (-1 = no expert);\n"
      "outputs num_tokens_per_rank [num_ranks], num_tokens_per_node [num_ranks/ranks_per_node],\n"
      "num_tokens_per_expert [num_experts] int64 and is_token_in_rank [num_tokens, num_ranks]\n"
      "bool, all fully overwritten. Raises ValueError for inconsistent sizes, CudaError on\n"
      "launch failure.");

  moe_dispatch::bind::register_arg_types(m);
  moe_dispatch::register_intranode(m);
  moe_dispatch::register_internode(m);
  moe_dispatch::register_layout(m);
  moe_dispatch::register_pack(m);
  moe_dispatch::register_permute(m);
  moe_dispatch::register_sums(m);
}

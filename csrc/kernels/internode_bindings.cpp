// Python bindings of stage 1 of the internode kernels and of the NVSHMEM host calls
// (registered into moe_dispatch._C by bindings.cpp; moe_dispatch/transport/kernels/internode.py and
// nvshmem.py drive them).
//
// Launches take `common` (an InternodeCommon: world shape, RDMA buffer layout, buffers or the
// symmetric buffer, the fused pipeline's NVLink buffers, error record) and `ranks` (one struct
// per launched rank: for the staged stage 1 the intranode rank structs with is_token_in_rank
// meaning is_token_in_node [T, N]; for the fused pipeline the Fused*Rank structs; bind_args.h). backend="cuda" launches
// on `stream` in `mode` "loopback" or "nvshmem"; backend="cpu" runs the same role code on threads over host memory
// (loopback buffers) and returns when done.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/bind_args.h"
#include "kernels/internode.h"
#include "kernels/internode_cpu.h"

#ifdef MOE_DISPATCH_WITH_NVSHMEM
#include <nvshmem_host.h>
#endif

namespace py = pybind11;

namespace moe_dispatch {
namespace internode {
namespace {

using bind::copy_ranks;

Mode parse_mode(const std::string& mode) {
  MOE_HOST_CHECK(mode == "loopback" || mode == "nvshmem", "mode must be 'loopback' or 'nvshmem', got '" << mode << "'");
  return mode == "nvshmem" ? kNvshmem : kLoopback;
}

RdmaLayout checked_layout(int64_t num_nodes, int64_t ranks_per_node, int64_t num_channels, int64_t num_slots,
                          int64_t slot_bytes) {
  MOE_HOST_CHECK(num_nodes >= 1 && num_nodes <= kMaxNodes,
                 "num_nodes must be in [1, " << kMaxNodes << "], got " << num_nodes);
  MOE_HOST_CHECK(ranks_per_node >= 1 && ranks_per_node <= kMaxLocal,
                 "ranks_per_node must be in [1, " << kMaxLocal << "], got " << ranks_per_node);
  MOE_HOST_CHECK(num_channels >= 1 && num_channels <= kMaxChannels,
                 "num_channels must be in [1, " << kMaxChannels << "], got " << num_channels);
  MOE_HOST_CHECK(num_slots >= 1 && num_slots <= (1 << 20), "num_slots must be in [1, 2^20], got " << num_slots);
  MOE_HOST_CHECK(slot_bytes > 0 && slot_bytes % intranode::kFieldAlign == 0 && slot_bytes <= INT32_MAX / 2,
                 "slot_bytes must be a positive multiple of " << intranode::kFieldAlign << ", got " << slot_bytes);
  return make_rdma_layout(static_cast<int>(num_nodes), static_cast<int>(ranks_per_node), static_cast<int>(num_channels),
                          static_cast<int>(num_slots), static_cast<int>(slot_bytes));
}

// A launch's common fields with its launched ranks counted.
Common launch_common(const Common& given, int32_t num_launch_ranks) {
  Common c = given;
  c.num_launch_ranks = num_launch_ranks;
  return c;
}

void register_types(py::module_& m) {
  using bind::Layout;
  using bind::Struct;
  Layout<RdmaLayout>(m, "RdmaLayout", "Byte offsets of one rank's RDMA buffer (drawn in internode.cuh).")
      .field("num_nodes", &RdmaLayout::num_nodes)
      .field("ranks_per_node", &RdmaLayout::ranks_per_node)
      .field("num_channels", &RdmaLayout::num_channels)
      .field("num_slots", &RdmaLayout::num_slots)
      .field("slot_bytes", &RdmaLayout::slot_bytes)
      .field("msg_bytes", &RdmaLayout::msg_bytes)
      .field("arrive_offset", &RdmaLayout::arrive_offset)
      .field("meta_offset", &RdmaLayout::meta_offset)
      .field("meta_out_offset", &RdmaLayout::meta_out_offset)
      .field("header_offset", &RdmaLayout::header_offset)
      .field("header_out_offset", &RdmaLayout::header_out_offset)
      .field("tail_offset", &RdmaLayout::tail_offset)
      .field("head_offset", &RdmaLayout::head_offset)
      .field("flag_offset", &RdmaLayout::flag_offset)
      .field("zero_offset", &RdmaLayout::zero_offset)
      .field("recv_offset", &RdmaLayout::recv_offset)
      .field("send_offset", &RdmaLayout::send_offset)
      .field("total_bytes", &RdmaLayout::total_bytes)
      .done();
  Struct<Common>(m, "InternodeCommon", "internode common",
                 "The fields every rank of an internode launch shares (internode.cuh Common): world shape, the\n"
                 "RDMA buffers (loopback) or the symmetric buffer (NVSHMEM), the fused pipeline's NVLink\n"
                 "buffers; the launch sets num_launch_ranks from its rank list.")
      .integer("num_nodes", &Common::num_nodes)
      .integer("ranks_per_node", &Common::ranks_per_node)
      .integer("num_channels", &Common::num_channels)
      .integer("rank_begin", &Common::rank_begin)
      .integer("skip_rank", &Common::skip_rank)
      .integer("chunk_tokens", &Common::chunk_tokens)
      .integer("l2_discard", &Common::l2_discard)
      .integer("nvl_first_rank", &Common::nvl_first_rank, false)
      .member("variant", &Common::variant)
      .integer("timeout_cycles", &Common::timeout_cycles)
      .member("layout", &Common::layout)
      .member("nvl_layout", &Common::nvl_layout, false)
      .pointer("symmetric", &Common::symmetric, false)
      .addresses("buffers", &Common::buffers)
      .addresses("nvl_buffers", &Common::nvl_buffers, false)
      .pointer("error", &Common::error)
      .pointer("error_host", &Common::error_host, false)
      .init();
  Struct<FusedNotifyRank>(m, "FusedNotifyRank", "fused notify rank",
                          "One launched rank of the fused notify (internode.cuh FusedNotifyRank).")
      .pointer("is_token_in_rank", &FusedNotifyRank::is_token_in_rank)
      .pointer("is_token_in_node", &FusedNotifyRank::is_token_in_node)
      .pointer("recv_prefix", &FusedNotifyRank::recv_prefix)
      .pointer("forward_prefix", &FusedNotifyRank::forward_prefix)
      .pointer("counts", &FusedNotifyRank::counts)
      .pointer("overflow", &FusedNotifyRank::overflow)
      .pointer("peer_ok", &FusedNotifyRank::peer_ok)
      .pointer("relay_prefix", &FusedNotifyRank::relay_prefix)
      .pointer("recv_topk_idx", &FusedNotifyRank::recv_topk_idx)
      .pointer("recv_topk_weights", &FusedNotifyRank::recv_topk_weights)
      .pointer("recv_src_idx", &FusedNotifyRank::recv_src_idx)
      .member("check", &FusedNotifyRank::check)
      .integer("num_tokens", &FusedNotifyRank::num_tokens)
      .integer("budget", &FusedNotifyRank::budget)
      .integer("forward_capacity", &FusedNotifyRank::forward_capacity)
      .init();
  Struct<FusedDispatchRank>(m, "FusedDispatchRank", "fused dispatch rank",
                            "One launched rank of the fused dispatch (internode.cuh FusedDispatchRank).")
      .pointer("x", &FusedDispatchRank::x)
      .pointer("x_scales", &FusedDispatchRank::x_scales)
      .pointer("topk_idx", &FusedDispatchRank::topk_idx)
      .pointer("topk_weights", &FusedDispatchRank::topk_weights)
      .pointer("is_token_in_node", &FusedDispatchRank::is_token_in_node)
      .pointer("recv_prefix", &FusedDispatchRank::recv_prefix)
      .pointer("forward_prefix", &FusedDispatchRank::forward_prefix)
      .pointer("relay_prefix", &FusedDispatchRank::relay_prefix)
      .pointer("forward_mask", &FusedDispatchRank::forward_mask)
      .pointer("forward_cut", &FusedDispatchRank::forward_cut)
      .pointer("recv_x", &FusedDispatchRank::recv_x)
      .pointer("recv_scales", &FusedDispatchRank::recv_scales)
      .pointer("recv_topk_idx", &FusedDispatchRank::recv_topk_idx)
      .pointer("recv_topk_weights", &FusedDispatchRank::recv_topk_weights)
      .pointer("recv_src_idx", &FusedDispatchRank::recv_src_idx)
      .pointer("num_recv_per_expert", &FusedDispatchRank::num_recv_per_expert)
      .pointer("overflow", &FusedDispatchRank::overflow)
      .pointer("peer_ok", &FusedDispatchRank::peer_ok)  // None: a cached dispatch exchanges header lines
      .member("check", &FusedDispatchRank::check)
      .integer("num_tokens", &FusedDispatchRank::num_tokens)
      .integer("num_rows", &FusedDispatchRank::num_rows)
      .integer("forward_capacity", &FusedDispatchRank::forward_capacity)
      .integer("budget", &FusedDispatchRank::budget)
      .init();
  Struct<FusedCombineRank>(m, "FusedCombineRank", "fused combine rank",
                           "One launched rank of the fused combine (internode.cuh FusedCombineRank).")
      .pointer("y", &FusedCombineRank::y)
      .pointer("row_scale", &FusedCombineRank::row_scale)
      .pointer("is_token_in_node", &FusedCombineRank::is_token_in_node)
      .pointer("recv_prefix", &FusedCombineRank::recv_prefix)
      .pointer("forward_prefix", &FusedCombineRank::forward_prefix)
      .pointer("relay_prefix", &FusedCombineRank::relay_prefix)
      .pointer("forward_mask", &FusedCombineRank::forward_mask)
      .pointer("forward_cut", &FusedCombineRank::forward_cut)
      .pointer("out", &FusedCombineRank::out)
      .member("check", &FusedCombineRank::check)
      .integer("num_tokens", &FusedCombineRank::num_tokens)
      .integer("num_rows", &FusedCombineRank::num_rows)
      .integer("forward_capacity", &FusedCombineRank::forward_capacity)
      .integer("budget", &FusedCombineRank::budget)
      .init();
}

// Runs `cpu` on the CPU backend, or launches `cuda(mode)`; the GIL is released either way.
template <class Cpu, class Cuda>
void run(const std::string& backend, const std::string& mode, const Common& common, bool fused, Cpu cpu, Cuda cuda) {
  bind::check_backend(backend);
  const Mode m = parse_mode(mode);
  if (backend == "cpu") {
    MOE_HOST_CHECK(m == kLoopback, "the CPU backend runs loopback mode only, got mode '" << mode << "'");
    check_common(common, kLoopback, fused);
  }
  py::gil_scoped_release release;
  if (backend == "cpu") {
    cpu();
  } else {
    cuda(m);
  }
}

}  // namespace
}  // namespace internode

void register_internode(py::module_& m) {
  using namespace internode;
  register_types(m);
  py::dict limits;
  limits["max_nodes"] = kMaxNodes;
  limits["max_channels"] = kMaxChannels;
  limits["max_launch_ranks"] = kMaxLaunchRanks;
  limits["notify_threads"] = kNotifyThreads;
  limits["max_ranks_per_node"] = kMaxLocal;
  m.attr("internode_limits") = limits;

  m.def(
      "internode_rdma_layout",
      [](int64_t num_nodes, int64_t ranks_per_node, int64_t num_channels, int64_t num_slots, int64_t slot_bytes) {
        return checked_layout(num_nodes, ranks_per_node, num_channels, num_slots, slot_bytes);
      },
      py::arg("num_nodes"), py::arg("ranks_per_node"), py::arg("num_channels"), py::arg("num_slots"),
      py::arg("slot_bytes"), "Byte offsets of one rank's RDMA buffer (csrc/kernels/internode.cuh draws it).");

  // ---- the staged pipeline's stage 1 ----
  m.def(
      "internode_node_notify",
      [](const Common& common, const std::vector<intranode::NotifyRank>& ranks, const std::string& backend,
         const std::string& mode, std::uintptr_t stream, bool cooperative) {
        NotifyArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        run(
            backend, mode, args.common, false, [&]() { run_node_notify_cpu(args); },
            [&](Mode md) { launch_node_notify(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("backend") = "cuda", py::arg("mode") = "loopback",
      py::arg("stream") = 0, py::arg("cooperative") = true,
      "Stage-1 counts and headers along each rail: writes recv_prefix [N*C+1] (rows by source node,\n"
      "channel), num_recv_tokens and peer_ok [N]. Collective along the rail.");

  m.def(
      "internode_node_dispatch",
      [](const Common& common, const std::vector<intranode::DispatchRank>& ranks, int64_t x_bytes, int64_t scale_bytes,
         int64_t num_topk, int64_t experts_per_node, const std::string& backend, const std::string& mode,
         std::uintptr_t stream, bool cooperative, const CpuOptions& options) {
        DispatchArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.slot = bind::checked_slot(x_bytes, scale_bytes, num_topk);
        args.experts_per_node = static_cast<int32_t>(experts_per_node);
        run(
            backend, mode, args.common, false, [&]() { run_node_dispatch_cpu(args, options); },
            [&](Mode md) { launch_node_dispatch(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      py::arg("experts_per_node"), py::arg("backend") = "cuda", py::arg("mode") = "loopback", py::arg("stream") = 0,
      py::arg("cooperative") = true, py::arg("cpu_options") = CpuOptions{},
      "Stage 1: each token once to each node holding it (the forwarder of the same local index);\n"
      "rows by (source node, source token), top-k ids node-local.");

  m.def(
      "internode_node_combine",
      [](const Common& common, const std::vector<intranode::CombineRank>& ranks, int64_t y_bytes, int64_t dtype,
         const std::string& backend, const std::string& mode, std::uintptr_t stream, bool cooperative,
         const CpuOptions& options) {
        CombineArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.slot = bind::checked_slot(y_bytes, 0, 0, "y_bytes");
        const auto dt = static_cast<intranode::DType>(dtype);
        run(
            backend, mode, args.common, false, [&]() { run_node_combine_cpu(args, dt, options); },
            [&](Mode md) { launch_node_combine(args, dt, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("y_bytes"), py::arg("dtype"), py::arg("backend") = "cuda",
      py::arg("mode") = "loopback", py::arg("stream") = 0, py::arg("cooperative") = true,
      py::arg("cpu_options") = CpuOptions{},
      "Stage 1 backwards: each node partial once back to its source, summed there over nodes in\n"
      "ascending order (fp32, rounded once).");

  // ---- the fused pipeline ----
  m.def(
      "internode_fused_notify",
      [](const Common& common, const std::vector<FusedNotifyRank>& ranks, int64_t num_topk, const std::string& backend,
         const std::string& mode, std::uintptr_t stream, bool cooperative) {
        FusedNotifyArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        MOE_HOST_CHECK(num_topk >= 0 && num_topk <= intranode::kMaxTopk,
                       "num_topk must be in [0, " << intranode::kMaxTopk << "], got " << num_topk);
        args.num_topk = static_cast<int32_t>(num_topk);
        run(
            backend, mode, args.common, true, [&]() { run_fused_notify_cpu(args); },
            [&](Mode md) { launch_fused_notify(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("num_topk"), py::arg("backend") = "cuda",
      py::arg("mode") = "loopback", py::arg("stream") = 0, py::arg("cooperative") = true,
      "Counts and headers along the rail, relayed over NVLink: writes recv_prefix [W*C+1],\n"
      "forward_prefix [C*N+1], counts (R, R1), overflow, peer_ok [N+L] and the budget padding.");

  m.def(
      "internode_fused_dispatch",
      [](const Common& common, const std::vector<FusedDispatchRank>& ranks, int64_t x_bytes, int64_t scale_bytes,
         int64_t num_topk, int64_t experts_per_rank, const std::string& backend, const std::string& mode,
         std::uintptr_t stream, bool cooperative, const CpuOptions& options) {
        FusedDispatchArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.slot = bind::checked_slot(x_bytes, scale_bytes, num_topk);
        args.experts_per_rank = static_cast<int32_t>(experts_per_rank);
        args.experts_per_node = static_cast<int32_t>(experts_per_rank * args.common.ranks_per_node);
        run(
            backend, mode, args.common, true, [&]() { run_fused_dispatch_cpu(args, options); },
            [&](Mode md) { launch_fused_dispatch(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      py::arg("experts_per_rank"), py::arg("backend") = "cuda", py::arg("mode") = "loopback", py::arg("stream") = 0,
      py::arg("cooperative") = true, py::arg("cpu_options") = CpuOptions{},
      "Both stages at once: RDMA puts to the forwarders, forwarding over NVLink as chunks land;\n"
      "rows by (source rank, source token), top-k ids local.");

  m.def(
      "internode_fused_combine",
      [](const Common& common, const std::vector<FusedCombineRank>& ranks, int64_t y_bytes, int64_t dtype,
         const std::string& backend, const std::string& mode, std::uintptr_t stream, bool cooperative,
         const CpuOptions& options) {
        FusedCombineArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.slot = bind::checked_slot(y_bytes, 0, 0, "y_bytes");
        const auto dt = static_cast<intranode::DType>(dtype);
        run(
            backend, mode, args.common, true, [&]() { run_fused_combine_cpu(args, dt, options); },
            [&](Mode md) { launch_fused_combine(args, dt, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("y_bytes"), py::arg("dtype"), py::arg("backend") = "cuda",
      py::arg("mode") = "loopback", py::arg("stream") = 0, py::arg("cooperative") = true,
      py::arg("cpu_options") = CpuOptions{},
      "Holders -> forwarder over NVLink, pre-reduced there (ascending local rank, fp32, rounded\n"
      "once), one partial per (token, node) back over RDMA, summed by ascending node.");

#ifdef MOE_DISPATCH_WITH_NVSHMEM
  m.def(
      "nvshmem_unique_id",
      []() {
        nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
        const int status = nvshmemx_get_uniqueid(&id);
        MOE_HOST_CHECK(status == 0, "nvshmemx_get_uniqueid failed with status " << status);
        return py::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
      },
      "A fresh NVSHMEM unique id (bytes) for nvshmem_init; made on one rank and broadcast.");

  m.def(
      "nvshmem_init",
      [](const py::bytes& unique_id, int rank, int world_size, int device) {
        const std::string raw = unique_id;
        MOE_HOST_CHECK(raw.size() == sizeof(nvshmemx_uniqueid_t),
                       "an NVSHMEM unique id has " << sizeof(nvshmemx_uniqueid_t) << " bytes, got " << raw.size());
        MOE_HOST_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
                       "need 0 <= rank < world_size, got rank " << rank << " of " << world_size);
        MOE_CUDA_CHECK(cudaSetDevice(device));
        nvshmemx_uniqueid_t id;
        std::memcpy(&id, raw.data(), sizeof(id));
        nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
        int status = nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr);
        MOE_HOST_CHECK(status == 0, "nvshmemx_set_attr_uniqueid_args failed with status " << status);
        py::gil_scoped_release release;  // collective: waits for every rank
        status = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
        MOE_HOST_CHECK(status == 0, "nvshmemx_init_attr failed with status " << status);
      },
      py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
      "Initialises NVSHMEM on `device` as PE `rank` of `world_size` (collective; transports from\n"
      "NVSHMEM's environment: IBGDA, IBRC, UCX, libfabric).");

  m.def("nvshmem_my_pe", []() { return nvshmem_my_pe(); });
  m.def("nvshmem_n_pes", []() { return nvshmem_n_pes(); });
  m.def(
      "nvshmem_malloc",
      [](int64_t bytes) {
        MOE_HOST_CHECK(bytes > 0, "bytes must be > 0, got " << bytes);
        void* ptr = nullptr;
        {
          py::gil_scoped_release release;  // collective
          ptr = nvshmem_malloc(static_cast<size_t>(bytes));
        }
        MOE_HOST_CHECK(ptr != nullptr, "nvshmem_malloc(" << bytes
                                                         << ") failed: the symmetric heap is too small "
                                                            "(NVSHMEM_SYMMETRIC_SIZE)");
        MOE_CUDA_CHECK(cudaMemset(ptr, 0, static_cast<size_t>(bytes)));
        MOE_CUDA_CHECK(cudaDeviceSynchronize());
        return reinterpret_cast<std::uintptr_t>(ptr);
      },
      py::arg("bytes"), "Zeroed symmetric allocation (collective: same size on every PE); returns its address.");
  m.def(
      "nvshmem_free",
      [](std::uintptr_t ptr) {
        py::gil_scoped_release release;
        nvshmem_free(reinterpret_cast<void*>(ptr));
      },
      py::arg("ptr"), "Frees a symmetric allocation (collective).");
  m.def(
      "nvshmem_barrier_all",
      []() {
        py::gil_scoped_release release;
        nvshmem_barrier_all();
      },
      "Host barrier of all PEs (unbounded: only around setup and teardown).");
  m.def(
      "nvshmem_finalize",
      []() {
        py::gil_scoped_release release;
        nvshmem_finalize();
      },
      "Tears NVSHMEM down (collective; after the last free).");
#endif
}

}  // namespace moe_dispatch

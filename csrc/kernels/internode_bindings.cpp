// Python bindings of stage 1 of the internode kernels and of the NVSHMEM host calls
// (registered into moe_dispatch._C by bindings.cpp; moe_dispatch/transport/internode.py and
// nvshmem.py drive them).
//
// Launches take `common` (a dict: world shape, RDMA buffer shape, buffers or the symmetric
// buffer, the fused pipeline's NVLink buffers, error record) and `ranks` (one dict per launched
// rank: for the staged stage 1 the intranode rank fields with is_token_in_rank meaning
// is_token_in_node [T, N]; for the fused pipeline the fused rank fields). backend="cuda" launches on `stream` in
// `mode` "loopback" or "nvshmem"; backend="cpu" runs the same role code on threads over host
// memory (loopback buffers) and returns when done.
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

using bind::field;
using bind::int32;
using bind::integer;
using bind::pointer;

Mode parse_mode(const std::string& mode) {
  MOE_HOST_CHECK(mode == "loopback" || mode == "nvshmem", "mode must be 'loopback' or 'nvshmem', got '" << mode << "'");
  return mode == "nvshmem" ? kNvshmem : kLoopback;
}

RdmaLayout checked_layout(int64_t num_nodes, int64_t ranks_per_node, int64_t num_channels, int64_t num_slots,
                          int64_t slot_bytes) {
  MOE_HOST_CHECK(num_nodes >= 1 && num_nodes <= kMaxNodes, "num_nodes must be in [1, " << kMaxNodes << "], got " << num_nodes);
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

std::vector<std::uintptr_t> address_list(const py::dict& d, const char* key, const char* what) {
  const auto list = field(d, key, what).cast<std::vector<std::uintptr_t>>();
  MOE_HOST_CHECK(list.size() <= static_cast<size_t>(kMaxLaunchRanks),
                 what << "['" << key << "'] lists at most " << kMaxLaunchRanks << " buffers, got " << list.size());
  return list;
}

// `common` of either pipeline; the fused one also has the NVLink buffers ('nvl_buffers',
// 'nvl_first_rank', 'nvl_slot_bytes', 'nvl_num_slots').
Common parse_common(const py::dict& d, const py::list& ranks) {
  const char* what = "common";
  MOE_HOST_CHECK(ranks.size() >= 1 && ranks.size() <= kMaxLaunchRanks,
                 "ranks must list 1 to " << kMaxLaunchRanks << " launched ranks, got " << ranks.size());
  Common c{};
  c.num_nodes = int32(d, "num_nodes", what);
  c.ranks_per_node = int32(d, "ranks_per_node", what);
  c.num_channels = int32(d, "num_channels", what);
  c.rank_begin = int32(d, "rank_begin", what);
  c.num_launch_ranks = static_cast<int32_t>(ranks.size());
  c.skip_rank = int32(d, "skip_rank", what);
  c.chunk_tokens = int32(d, "chunk_tokens", what);
  c.l2_discard = int32(d, "l2_discard", what);
  c.timeout_cycles = integer(d, "timeout_cycles", what);
  const int64_t buffer_channels = integer(d, "buffer_channels", what);
  c.layout = checked_layout(c.num_nodes, c.ranks_per_node, buffer_channels, integer(d, "num_slots", what),
                            integer(d, "slot_bytes", what));
  c.symmetric = pointer<char>(d, "symmetric", what);
  const auto buffers = address_list(d, "buffers", what);
  for (size_t i = 0; i < buffers.size(); ++i) c.buffers[i] = reinterpret_cast<char*>(buffers[i]);
  if (d.contains("nvl_buffers")) {
    const auto nvl = address_list(d, "nvl_buffers", what);
    for (size_t i = 0; i < nvl.size(); ++i) c.nvl_buffers[i] = reinterpret_cast<char*>(nvl[i]);
    c.nvl_first_rank = int32(d, "nvl_first_rank", what);
    c.nvl_layout = intranode::make_buffer_layout(c.ranks_per_node, static_cast<int>(buffer_channels),
                                                 int32(d, "nvl_num_slots", what), int32(d, "nvl_slot_bytes", what),
                                                 c.num_nodes);
  }
  c.error = pointer<intranode::ErrorRecord>(d, "error", what);
  c.error_host = pointer<intranode::ErrorRecord>(d, "error_host", what);
  return c;
}

py::dict layout_dict(const RdmaLayout& l) {
  py::dict d;
  d["num_nodes"] = l.num_nodes;
  d["ranks_per_node"] = l.ranks_per_node;
  d["num_channels"] = l.num_channels;
  d["num_slots"] = l.num_slots;
  d["slot_bytes"] = l.slot_bytes;
  d["msg_bytes"] = l.msg_bytes;
  d["arrive_offset"] = l.arrive_offset;
  d["meta_offset"] = l.meta_offset;
  d["meta_out_offset"] = l.meta_out_offset;
  d["header_offset"] = l.header_offset;
  d["header_out_offset"] = l.header_out_offset;
  d["tail_offset"] = l.tail_offset;
  d["head_offset"] = l.head_offset;
  d["flag_offset"] = l.flag_offset;
  d["zero_offset"] = l.zero_offset;
  d["recv_offset"] = l.recv_offset;
  d["send_offset"] = l.send_offset;
  d["total_bytes"] = l.total_bytes;
  return d;
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

SlotLayout dispatch_slot(int64_t x_bytes, int64_t scale_bytes, int64_t num_topk) {
  MOE_HOST_CHECK(x_bytes > 0 && x_bytes <= INT32_MAX / 2, "x_bytes must be in (0, 2^30), got " << x_bytes);
  MOE_HOST_CHECK(scale_bytes >= 0 && scale_bytes <= INT32_MAX / 2, "scale_bytes must be in [0, 2^30), got " << scale_bytes);
  MOE_HOST_CHECK(num_topk >= 0 && num_topk <= intranode::kMaxTopk,
                 "num_topk must be in [0, " << intranode::kMaxTopk << "], got " << num_topk);
  return intranode::make_slot_layout(static_cast<int>(x_bytes), static_cast<int>(scale_bytes), static_cast<int>(num_topk));
}

SlotLayout combine_slot(int64_t y_bytes) {
  MOE_HOST_CHECK(y_bytes > 0 && y_bytes <= INT32_MAX / 2, "y_bytes must be in (0, 2^30), got " << y_bytes);
  return intranode::make_slot_layout(static_cast<int>(y_bytes), 0, 0);
}

FusedNotifyRank parse_fused_notify_rank(const py::dict& r) {
  const char* what = "fused notify rank";
  FusedNotifyRank n{};
  n.is_token_in_rank = pointer<const bool>(r, "is_token_in_rank", what);
  n.is_token_in_node = pointer<const bool>(r, "is_token_in_node", what);
  n.recv_prefix = pointer<int32_t>(r, "recv_prefix", what);
  n.forward_prefix = pointer<int32_t>(r, "forward_prefix", what);
  n.counts = pointer<int32_t>(r, "counts", what);
  n.overflow = pointer<int32_t>(r, "overflow", what);
  n.peer_ok = pointer<int32_t>(r, "peer_ok", what);
  n.recv_topk_idx = pointer<int64_t>(r, "recv_topk_idx", what);
  n.recv_topk_weights = pointer<float>(r, "recv_topk_weights", what);
  n.recv_src_idx = pointer<int32_t>(r, "recv_src_idx", what);
  n.check = bind::parse_check(r, what);
  n.num_tokens = int32(r, "num_tokens", what);
  n.budget = int32(r, "budget", what);
  n.forward_capacity = int32(r, "forward_capacity", what);
  return n;
}

FusedDispatchRank parse_fused_dispatch_rank(const py::dict& r) {
  const char* what = "fused dispatch rank";
  FusedDispatchRank d{};
  d.x = pointer<const char>(r, "x", what);
  d.x_scales = pointer<const float>(r, "x_scales", what);
  d.topk_idx = pointer<const int64_t>(r, "topk_idx", what);
  d.topk_weights = pointer<const float>(r, "topk_weights", what);
  d.token_ids = nullptr;
  d.is_token_in_node = pointer<const bool>(r, "is_token_in_node", what);
  d.recv_prefix = pointer<const int32_t>(r, "recv_prefix", what);
  d.forward_prefix = pointer<const int32_t>(r, "forward_prefix", what);
  d.forward_mask = pointer<int32_t>(r, "forward_mask", what);
  d.recv_x = pointer<char>(r, "recv_x", what);
  d.recv_scales = pointer<float>(r, "recv_scales", what);
  d.recv_topk_idx = pointer<int64_t>(r, "recv_topk_idx", what);
  d.recv_topk_weights = pointer<float>(r, "recv_topk_weights", what);
  d.recv_src_idx = pointer<int32_t>(r, "recv_src_idx", what);
  d.num_recv_per_expert = pointer<int64_t>(r, "num_recv_per_expert", what);
  d.overflow = pointer<int32_t>(r, "overflow", what);
  d.peer_ok = pointer<const int32_t>(r, "peer_ok", what);
  d.check = bind::parse_check(r, what);
  d.num_tokens = int32(r, "num_tokens", what);
  d.num_rows = int32(r, "num_rows", what);
  d.forward_capacity = int32(r, "forward_capacity", what);
  return d;
}

FusedCombineRank parse_fused_combine_rank(const py::dict& r) {
  const char* what = "fused combine rank";
  FusedCombineRank c{};
  c.y = pointer<const char>(r, "y", what);
  c.row_scale = pointer<const float>(r, "row_scale", what);
  c.is_token_in_node = pointer<const bool>(r, "is_token_in_node", what);
  c.recv_prefix = pointer<const int32_t>(r, "recv_prefix", what);
  c.forward_prefix = pointer<const int32_t>(r, "forward_prefix", what);
  c.forward_mask = pointer<const int32_t>(r, "forward_mask", what);
  c.out = pointer<char>(r, "out", what);
  c.check = bind::parse_check(r, what);
  c.num_tokens = int32(r, "num_tokens", what);
  c.num_rows = int32(r, "num_rows", what);
  c.forward_capacity = int32(r, "forward_capacity", what);
  return c;
}

}  // namespace
}  // namespace internode

void register_internode(py::module_& m) {
  using namespace internode;
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
        return layout_dict(checked_layout(num_nodes, ranks_per_node, num_channels, num_slots, slot_bytes));
      },
      py::arg("num_nodes"), py::arg("ranks_per_node"), py::arg("num_channels"), py::arg("num_slots"),
      py::arg("slot_bytes"), "Byte offsets of one rank's RDMA buffer (csrc/kernels/internode.cuh draws it).");

  // ---- the staged pipeline's stage 1 ----
  m.def(
      "internode_node_notify",
      [](const py::dict& common, const py::list& ranks, const std::string& backend, const std::string& mode,
         std::uintptr_t stream, bool cooperative) {
        NotifyArgs args{};
        args.common = parse_common(common, ranks);
        for (size_t i = 0; i < ranks.size(); ++i) args.ranks[i] = bind::parse_notify_rank(ranks[i].cast<py::dict>());
        run(backend, mode, args.common, false, [&]() { run_node_notify_cpu(args); },
            [&](Mode md) { launch_node_notify(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("backend") = "cuda", py::arg("mode") = "loopback",
      py::arg("stream") = 0, py::arg("cooperative") = true,
      "Stage-1 counts and headers along each rail: writes recv_prefix [N*C+1] (rows by source node,\n"
      "channel), num_recv_tokens and peer_ok [N]. Collective along the rail.");

  m.def(
      "internode_node_dispatch",
      [](const py::dict& common, const py::list& ranks, int64_t x_bytes, int64_t scale_bytes, int64_t num_topk,
         int64_t experts_per_node, const std::string& backend, const std::string& mode, std::uintptr_t stream,
         bool cooperative, const py::dict& cpu_options) {
        DispatchArgs args{};
        args.common = parse_common(common, ranks);
        args.slot = dispatch_slot(x_bytes, scale_bytes, num_topk);
        args.experts_per_node = static_cast<int32_t>(experts_per_node);
        for (size_t i = 0; i < ranks.size(); ++i) args.ranks[i] = bind::parse_dispatch_rank(ranks[i].cast<py::dict>());
        const CpuOptions options = bind::parse_cpu_options(cpu_options);
        run(backend, mode, args.common, false, [&]() { run_node_dispatch_cpu(args, options); },
            [&](Mode md) { launch_node_dispatch(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      py::arg("experts_per_node"), py::arg("backend") = "cuda", py::arg("mode") = "loopback", py::arg("stream") = 0,
      py::arg("cooperative") = true, py::arg("cpu_options") = py::dict(),
      "Stage 1: each token once to each node holding it (the forwarder of the same local index);\n"
      "rows by (source node, source token), top-k ids node-local.");

  m.def(
      "internode_node_combine",
      [](const py::dict& common, const py::list& ranks, int64_t y_bytes, int64_t dtype, const std::string& backend,
         const std::string& mode, std::uintptr_t stream, bool cooperative, const py::dict& cpu_options) {
        CombineArgs args{};
        args.common = parse_common(common, ranks);
        args.slot = combine_slot(y_bytes);
        for (size_t i = 0; i < ranks.size(); ++i) args.ranks[i] = bind::parse_combine_rank(ranks[i].cast<py::dict>());
        const CpuOptions options = bind::parse_cpu_options(cpu_options);
        const auto dt = static_cast<intranode::DType>(dtype);
        run(backend, mode, args.common, false, [&]() { run_node_combine_cpu(args, dt, options); },
            [&](Mode md) { launch_node_combine(args, dt, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("y_bytes"), py::arg("dtype"), py::arg("backend") = "cuda",
      py::arg("mode") = "loopback", py::arg("stream") = 0, py::arg("cooperative") = true,
      py::arg("cpu_options") = py::dict(),
      "Stage 1 backwards: each node partial once back to its source, summed there over nodes in\n"
      "ascending order (fp32, rounded once).");

  // ---- the fused pipeline ----
  m.def(
      "internode_fused_notify",
      [](const py::dict& common, const py::list& ranks, int64_t num_topk, const std::string& backend,
         const std::string& mode, std::uintptr_t stream, bool cooperative) {
        FusedNotifyArgs args{};
        args.common = parse_common(common, ranks);
        MOE_HOST_CHECK(num_topk >= 0 && num_topk <= intranode::kMaxTopk, "num_topk must be in [0, 32], got " << num_topk);
        args.num_topk = static_cast<int32_t>(num_topk);
        for (size_t i = 0; i < ranks.size(); ++i) args.ranks[i] = parse_fused_notify_rank(ranks[i].cast<py::dict>());
        run(backend, mode, args.common, true, [&]() { run_fused_notify_cpu(args); },
            [&](Mode md) { launch_fused_notify(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("num_topk"), py::arg("backend") = "cuda",
      py::arg("mode") = "loopback", py::arg("stream") = 0, py::arg("cooperative") = true,
      "Counts and headers along the rail, relayed over NVLink: writes recv_prefix [W*C+1],\n"
      "forward_prefix [C*N+1], counts (R, R1), overflow, peer_ok [N+L] and the budget padding.");

  m.def(
      "internode_fused_dispatch",
      [](const py::dict& common, const py::list& ranks, int64_t x_bytes, int64_t scale_bytes, int64_t num_topk,
         int64_t experts_per_rank, const std::string& backend, const std::string& mode, std::uintptr_t stream,
         bool cooperative, const py::dict& cpu_options) {
        FusedDispatchArgs args{};
        args.common = parse_common(common, ranks);
        args.slot = dispatch_slot(x_bytes, scale_bytes, num_topk);
        args.experts_per_rank = static_cast<int32_t>(experts_per_rank);
        args.experts_per_node = static_cast<int32_t>(experts_per_rank * args.common.ranks_per_node);
        for (size_t i = 0; i < ranks.size(); ++i) args.ranks[i] = parse_fused_dispatch_rank(ranks[i].cast<py::dict>());
        const CpuOptions options = bind::parse_cpu_options(cpu_options);
        run(backend, mode, args.common, true, [&]() { run_fused_dispatch_cpu(args, options); },
            [&](Mode md) { launch_fused_dispatch(args, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      py::arg("experts_per_rank"), py::arg("backend") = "cuda", py::arg("mode") = "loopback", py::arg("stream") = 0,
      py::arg("cooperative") = true, py::arg("cpu_options") = py::dict(),
      "Both stages at once: RDMA puts to the forwarders, forwarding over NVLink as chunks land;\n"
      "rows by (source rank, source token), top-k ids local.");

  m.def(
      "internode_fused_combine",
      [](const py::dict& common, const py::list& ranks, int64_t y_bytes, int64_t dtype, const std::string& backend,
         const std::string& mode, std::uintptr_t stream, bool cooperative, const py::dict& cpu_options) {
        FusedCombineArgs args{};
        args.common = parse_common(common, ranks);
        args.slot = combine_slot(y_bytes);
        for (size_t i = 0; i < ranks.size(); ++i) args.ranks[i] = parse_fused_combine_rank(ranks[i].cast<py::dict>());
        const CpuOptions options = bind::parse_cpu_options(cpu_options);
        const auto dt = static_cast<intranode::DType>(dtype);
        run(backend, mode, args.common, true, [&]() { run_fused_combine_cpu(args, dt, options); },
            [&](Mode md) { launch_fused_combine(args, dt, md, cooperative, bind::as_stream(stream)); });
      },
      py::arg("common"), py::arg("ranks"), py::arg("y_bytes"), py::arg("dtype"), py::arg("backend") = "cuda",
      py::arg("mode") = "loopback", py::arg("stream") = 0, py::arg("cooperative") = true,
      py::arg("cpu_options") = py::dict(),
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
        MOE_HOST_CHECK(ptr != nullptr, "nvshmem_malloc(" << bytes << ") failed: the symmetric heap is too small "
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

// Python bindings of the intranode kernels (registered into moe_dispatch._C by bindings.cpp).
//
// Each launch takes `common`, a dict of the fields every launched rank shares, and `ranks`, a
// list with one dict of device pointers (ints, 0 or None = null) and sizes per launched rank;
// moe_dispatch/transport/intranode.py builds both. backend="cuda" launches the kernel on `stream`
// (asynchronous); backend="cpu" runs the same protocol code on threads over host memory and
// returns when done (timeouts then count nanoseconds instead of clock64 cycles).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/bind_args.h"
#include "kernels/intranode.h"
#include "kernels/intranode_cpu.h"

namespace py = pybind11;

namespace moe_dispatch {
namespace intranode {
namespace {

using bind::as_stream;
using bind::check_backend;
using bind::field;
using bind::int32;
using bind::integer;
using bind::parse_combine_rank;
using bind::parse_cpu_options;
using bind::parse_dispatch_rank;
using bind::parse_notify_rank;
using bind::pointer;

Common parse_common(const py::dict& d, int64_t num_launch_ranks) {
  const char* what = "common";
  Common c{};
  c.num_ranks = int32(d, "num_ranks", what);
  c.num_channels = int32(d, "num_channels", what);
  c.rank_begin = int32(d, "rank_begin", what);
  c.num_launch_ranks = static_cast<int32_t>(num_launch_ranks);
  c.skip_rank = int32(d, "skip_rank", what);
  c.chunk_tokens = int32(d, "chunk_tokens", what);
  c.l2_discard = int32(d, "l2_discard", what);
  c.timeout_cycles = integer(d, "timeout_cycles", what);
  c.layout = make_buffer_layout(c.num_ranks, int32(d, "buffer_channels", what), int32(d, "num_slots", what),
                                int32(d, "slot_bytes", what), d.contains("relay_nodes") ? int32(d, "relay_nodes", what) : 0);
  const auto buffers = field(d, "buffers", what).cast<std::vector<std::uintptr_t>>();
  MOE_HOST_CHECK(static_cast<int64_t>(buffers.size()) == c.num_ranks && c.num_ranks <= kMaxRanks,
                 "common['buffers'] must list one buffer per rank (" << c.num_ranks << ", at most " << kMaxRanks
                                                                      << "), got " << buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) c.buffers[i] = reinterpret_cast<char*>(buffers[i]);
  c.error = pointer<ErrorRecord>(d, "error", what);
  c.error_host = pointer<ErrorRecord>(d, "error_host", what);
  return c;
}

void check_num_launch_ranks(const py::list& ranks) {
  MOE_HOST_CHECK(ranks.size() >= 1 && ranks.size() <= kMaxRanks,
                 "ranks must list 1 to " << kMaxRanks << " launched ranks, got " << ranks.size());
}

NotifyArgs parse_notify(const py::dict& common, const py::list& ranks, int64_t num_topk) {
  check_num_launch_ranks(ranks);
  NotifyArgs a{};
  a.common = parse_common(common, static_cast<int64_t>(ranks.size()));
  a.num_topk = static_cast<int32_t>(num_topk);
  for (size_t i = 0; i < ranks.size(); ++i) a.ranks[i] = parse_notify_rank(ranks[i].cast<py::dict>());
  return a;
}

DispatchArgs parse_dispatch(const py::dict& common, const py::list& ranks, int64_t x_bytes, int64_t scale_bytes,
                            int64_t num_topk, int64_t experts_per_rank) {
  check_num_launch_ranks(ranks);
  MOE_HOST_CHECK(x_bytes > 0 && x_bytes <= INT32_MAX / 2, "x_bytes must be in (0, 2^30), got " << x_bytes);
  MOE_HOST_CHECK(scale_bytes >= 0 && scale_bytes <= INT32_MAX / 2, "scale_bytes must be in [0, 2^30), got " << scale_bytes);
  MOE_HOST_CHECK(num_topk >= 0 && num_topk <= kMaxTopk, "num_topk must be in [0, " << kMaxTopk << "], got " << num_topk);
  DispatchArgs a{};
  a.common = parse_common(common, static_cast<int64_t>(ranks.size()));
  a.slot = make_slot_layout(static_cast<int>(x_bytes), static_cast<int>(scale_bytes), static_cast<int>(num_topk));
  a.experts_per_rank = static_cast<int32_t>(experts_per_rank);
  for (size_t i = 0; i < ranks.size(); ++i) a.ranks[i] = parse_dispatch_rank(ranks[i].cast<py::dict>());
  return a;
}

CombineArgs parse_combine(const py::dict& common, const py::list& ranks, int64_t y_bytes) {
  check_num_launch_ranks(ranks);
  MOE_HOST_CHECK(y_bytes > 0 && y_bytes <= INT32_MAX / 2, "y_bytes must be in (0, 2^30), got " << y_bytes);
  CombineArgs a{};
  a.common = parse_common(common, static_cast<int64_t>(ranks.size()));
  a.slot = make_slot_layout(static_cast<int>(y_bytes), 0, 0);
  for (size_t i = 0; i < ranks.size(); ++i) a.ranks[i] = parse_combine_rank(ranks[i].cast<py::dict>());
  return a;
}

py::dict buffer_layout_dict(const BufferLayout& l) {
  py::dict d;
  d["num_ranks"] = l.num_ranks;
  d["num_channels"] = l.num_channels;
  d["num_slots"] = l.num_slots;
  d["slot_bytes"] = l.slot_bytes;
  d["relay_nodes"] = l.relay_nodes;
  d["relay_bytes"] = l.relay_bytes;
  d["meta_offset"] = l.meta_offset;
  d["tail_offset"] = l.tail_offset;
  d["head_offset"] = l.head_offset;
  d["epoch_offset"] = l.epoch_offset;
  d["header_offset"] = l.header_offset;
  d["relay_offset"] = l.relay_offset;
  d["queue_offset"] = l.queue_offset;
  d["total_bytes"] = l.total_bytes;
  return d;
}

}  // namespace
}  // namespace intranode

void register_intranode(py::module_& m) {
  using namespace intranode;
  py::dict limits;
  limits["max_ranks"] = kMaxRanks;
  limits["max_channels"] = kMaxChannels;
  limits["max_topk"] = kMaxTopk;
  limits["num_threads"] = kNumThreads;
  limits["error_record_ints"] = kErrorRecordInts;
  limits["mismatch_record_words"] = kMismatchRecordWords;
  limits["header_words"] = static_cast<int>(kHeaderWords);
  limits["field_align"] = kFieldAlign;
  m.attr("intranode_limits") = limits;

  m.def(
      "intranode_buffer_layout",
      [](int64_t num_ranks, int64_t num_channels, int64_t num_slots, int64_t slot_bytes, int64_t relay_nodes) {
        MOE_HOST_CHECK(relay_nodes >= 0 && relay_nodes <= 64, "relay_nodes must be in [0, 64], got " << relay_nodes);
        MOE_HOST_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks,
                       "num_ranks must be in [1, " << kMaxRanks << "], got " << num_ranks);
        MOE_HOST_CHECK(num_channels >= 1 && num_channels <= kMaxChannels,
                       "num_channels must be in [1, " << kMaxChannels << "], got " << num_channels);
        MOE_HOST_CHECK(num_slots >= 1 && num_slots <= (1 << 20), "num_slots must be in [1, 2^20], got " << num_slots);
        MOE_HOST_CHECK(slot_bytes > 0 && slot_bytes % kFieldAlign == 0 && slot_bytes <= INT32_MAX / 2,
                       "slot_bytes must be a positive multiple of " << kFieldAlign << ", got " << slot_bytes);
        return buffer_layout_dict(make_buffer_layout(static_cast<int>(num_ranks), static_cast<int>(num_channels),
                                                     static_cast<int>(num_slots), static_cast<int>(slot_bytes),
                                                     static_cast<int>(relay_nodes)));
      },
      py::arg("num_ranks"), py::arg("num_channels"), py::arg("num_slots"), py::arg("slot_bytes"),
      py::arg("relay_nodes") = 0,
      "Byte offsets of one rank's communication buffer (csrc/kernels/intranode.cuh draws it).");

  m.def(
      "intranode_slot_layout",
      [](int64_t x_bytes, int64_t scale_bytes, int64_t num_topk) {
        MOE_HOST_CHECK(x_bytes >= 0 && scale_bytes >= 0 && num_topk >= 0 && num_topk <= kMaxTopk &&
                           x_bytes <= INT32_MAX / 2 && scale_bytes <= INT32_MAX / 2,
                       "bad slot sizes: x_bytes=" << x_bytes << " scale_bytes=" << scale_bytes
                                                  << " num_topk=" << num_topk);
        const SlotLayout s = make_slot_layout(static_cast<int>(x_bytes), static_cast<int>(scale_bytes),
                                              static_cast<int>(num_topk));
        py::dict d;
        d["x_bytes"] = s.x_bytes;
        d["scale_bytes"] = s.scale_bytes;
        d["num_topk"] = s.num_topk;
        d["scale_offset"] = s.scale_offset;
        d["topk_idx_offset"] = s.topk_idx_offset;
        d["topk_weights_offset"] = s.topk_weights_offset;
        d["aux_offset"] = s.aux_offset;
        d["slot_bytes"] = s.slot_bytes;
        return d;
      },
      py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      "Field offsets of one queue slot (dispatch: x, fp8 scales, topk, source index; combine: y, row scale).");

  m.def(
      "intranode_channel_of_token",
      [](int64_t num_tokens, int64_t num_channels, int64_t token) {
        MOE_HOST_CHECK(num_tokens >= 1 && num_tokens <= INT32_MAX && num_channels >= 1 && token >= 0 &&
                           token < num_tokens,
                       "need 0 <= token < num_tokens and num_channels >= 1");
        const TokenRange r = channel_token_range(static_cast<int>(num_tokens), static_cast<int>(num_channels),
                                                 channel_of_token(static_cast<int>(num_tokens),
                                                                  static_cast<int>(num_channels), static_cast<int>(token)));
        return py::make_tuple(channel_of_token(static_cast<int>(num_tokens), static_cast<int>(num_channels),
                                               static_cast<int>(token)),
                              r.begin, r.end);
      },
      py::arg("num_tokens"), py::arg("num_channels"), py::arg("token"),
      "(channel, begin, end): the channel owning `token` and its token range (protocol check).");

  m.def(
      "intranode_notify",
      [](const py::dict& common, const py::list& ranks, int64_t num_topk, const std::string& backend,
         std::uintptr_t stream, bool cooperative) {
        check_backend(backend);
        const NotifyArgs args = parse_notify(common, ranks, num_topk);
        py::gil_scoped_release release;
        if (backend == "cpu") {
          run_notify_cpu(args);
        } else {
          launch_notify(args, cooperative, as_stream(stream));
        }
      },
      py::arg("common"), py::arg("ranks"), py::arg("num_topk"), py::arg("backend") = "cuda", py::arg("stream") = 0,
      py::arg("cooperative") = true,
      "Barrier + exchange of per-(source, channel) counts; writes recv_prefix [W*C+1], num_recv_tokens,\n"
      "overflow (and -1/0 padding rows in budget mode). Collective across the W ranks.");

  m.def(
      "intranode_dispatch",
      [](const py::dict& common, const py::list& ranks, int64_t x_bytes, int64_t scale_bytes, int64_t num_topk,
         int64_t experts_per_rank, const std::string& backend, std::uintptr_t stream, bool cooperative,
         const py::dict& cpu_options) {
        check_backend(backend);
        const DispatchArgs args = parse_dispatch(common, ranks, x_bytes, scale_bytes, num_topk, experts_per_rank);
        const CpuOptions options = parse_cpu_options(cpu_options);
        py::gil_scoped_release release;
        if (backend == "cpu") {
          check_common(args.common);
          run_dispatch_cpu(args, options);
        } else {
          launch_dispatch(args, cooperative, as_stream(stream));
        }
      },
      py::arg("common"), py::arg("ranks"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      py::arg("experts_per_rank"), py::arg("backend") = "cuda", py::arg("stream") = 0, py::arg("cooperative") = true,
      py::arg("cpu_options") = py::dict(),
      "Moves every token to the ranks holding it, rows ordered by (source rank, source token).");

  m.def(
      "intranode_combine",
      [](const py::dict& common, const py::list& ranks, int64_t y_bytes, int64_t dtype, const std::string& backend,
         std::uintptr_t stream, bool cooperative, const py::dict& cpu_options) {
        check_backend(backend);
        const CombineArgs args = parse_combine(common, ranks, y_bytes);
        const CpuOptions options = parse_cpu_options(cpu_options);
        py::gil_scoped_release release;
        if (backend == "cpu") {
          check_common(args.common);
          run_combine_cpu(args, static_cast<DType>(dtype), options);
        } else {
          launch_combine(args, static_cast<DType>(dtype), cooperative, as_stream(stream));
        }
      },
      py::arg("common"), py::arg("ranks"), py::arg("y_bytes"), py::arg("dtype"), py::arg("backend") = "cuda",
      py::arg("stream") = 0, py::arg("cooperative") = true, py::arg("cpu_options") = py::dict(),
      "Sums each token's rows from its holders (ascending rank, fp32, rounded once) into out.");

  m.def(
      "device_clock_khz",
      [](int device) {
        int khz = 0;
        MOE_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
        return khz;
      },
      py::arg("device"), "SM clock of `device` in kHz (turns timeout_s into clock64 cycles).");

  m.def(
      "host_device_pointer",
      [](std::uintptr_t host) {
        void* device = nullptr;
        MOE_CUDA_CHECK(cudaHostGetDevicePointer(&device, reinterpret_cast<void*>(host), 0));
        return reinterpret_cast<std::uintptr_t>(device);
      },
      py::arg("host_ptr"), "Device address of pinned host memory (cudaHostGetDevicePointer).");

  m.def(
      "ipc_get_handle",
      [](std::uintptr_t device_ptr) {
        cudaIpcMemHandle_t handle;
        MOE_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(device_ptr)));
        return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
      },
      py::arg("device_ptr"), "CUDA IPC handle (bytes) of the allocation starting at device_ptr.");

  m.def(
      "ipc_open_handle",
      [](const py::bytes& handle_bytes) {
        const std::string raw = handle_bytes;
        MOE_HOST_CHECK(raw.size() == sizeof(cudaIpcMemHandle_t),
                       "an IPC handle has " << sizeof(cudaIpcMemHandle_t) << " bytes, got " << raw.size());
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, raw.data(), sizeof(handle));
        void* ptr = nullptr;
        MOE_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
        return reinterpret_cast<std::uintptr_t>(ptr);
      },
      py::arg("handle"), "Maps a peer's buffer into this process (cudaIpcOpenMemHandle); returns its address here.");

  m.def(
      "ipc_close",
      [](std::uintptr_t ptr) { MOE_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr))); },
      py::arg("ptr"), "Unmaps a buffer opened with ipc_open_handle (warns instead of raising).");

  m.def(
      "cuda_malloc",
      [](int64_t bytes) {
        void* ptr = nullptr;
        MOE_HOST_CHECK(bytes > 0, "bytes must be > 0, got " << bytes);
        MOE_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(bytes)));
        return reinterpret_cast<std::uintptr_t>(ptr);
      },
      py::arg("bytes"), "cudaMalloc on the current device (a base pointer, as CUDA IPC needs).");

  m.def(
      "cuda_free", [](std::uintptr_t ptr) { MOE_CUDA_CHECK_WARN(cudaFree(reinterpret_cast<void*>(ptr))); },
      py::arg("ptr"), "cudaFree (warns instead of raising: teardown path).");
}

}  // namespace moe_dispatch

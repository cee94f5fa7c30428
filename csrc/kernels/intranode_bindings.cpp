// Python bindings of the intranode kernels (registered into moe_dispatch._C by bindings.cpp).
//
// Each launch takes `common`, an IntranodeCommon of the fields every launched rank shares, and
// `ranks`, a list with one rank struct (NotifyRank, DispatchRank, CombineRank) per launched rank;
// moe_dispatch/transport/kernels/intranode.py builds both (bind_args.h: the typed classes). backend="cuda" launches
// the kernel on `stream` (asynchronous); backend="cpu" runs the same protocol code on threads over host memory and
// returns when done (timeouts then count nanoseconds instead of clock64 cycles).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/bind_args.h"
#include "kernels/intranode.h"
#include "kernels/intranode_cpu.h"

namespace py = pybind11;

namespace moe_dispatch {
namespace bind {

void register_arg_types(py::module_& m) {
  using namespace intranode;
  Struct<Variant>(m, "Variant", "variant", "The kernel variant (variant.cuh; Config.variant_fields()).",
                  kDefaultVariant)
      .integer("loads_in_flight", &Variant::loads_in_flight, false)
      .integer("rows_in_flight", &Variant::rows_in_flight, false)
      .integer("bulk_copy", &Variant::bulk_copy, false)
      .integer("register_cap", &Variant::register_cap, false)
      .integer("slot_flags", &Variant::slot_flags, false)
      .integer("combine_warps", &Variant::combine_warps, false)
      .integer("coordinator_backoff", &Variant::coordinator_backoff, false)
      .init();
  Struct<CpuOptions>(m, "CpuOptions", "cpu options", "Threads of the CPU backend (intranode_cpu.h).")
      .integer("group_warps", &CpuOptions::group_warps, false)
      .integer("num_workers", &CpuOptions::num_workers, false)
      .init();
  Struct<Check>(m, "Check", "check", "A launched rank's side of the header check (header.cuh).")
      .property(
          "header", [](const Check& c) { return std::vector<int64_t>(c.header.w, c.header.w + kHeaderWords); },
          [](Check& c, const std::vector<int64_t>& words) {
            MOE_HOST_CHECK(words.size() == kHeaderWords,
                           "check.header must list " << kHeaderWords << " words, got " << words.size());
            for (int i = 0; i < kHeaderWords; ++i) c.header.w[i] = words[i];
          })
      .pointer("mismatch", &Check::mismatch)
      .pointer("mismatch_host", &Check::mismatch_host, false)
      .init();

  Layout<SlotLayout>(m, "SlotLayout", "Byte offsets inside one queue slot (make_slot_layout, intranode.cuh).")
      .field("x_bytes", &SlotLayout::x_bytes)
      .field("scale_bytes", &SlotLayout::scale_bytes)
      .field("num_topk", &SlotLayout::num_topk)
      .field("scale_offset", &SlotLayout::scale_offset)
      .field("topk_idx_offset", &SlotLayout::topk_idx_offset)
      .field("topk_weights_offset", &SlotLayout::topk_weights_offset)
      .field("aux_offset", &SlotLayout::aux_offset)
      .field("slot_bytes", &SlotLayout::slot_bytes)
      .done();
  Layout<BufferLayout>(m, "BufferLayout", "Byte offsets of one rank's NVLink buffer (drawn in intranode.cuh).")
      .field("num_ranks", &BufferLayout::num_ranks)
      .field("num_channels", &BufferLayout::num_channels)
      .field("num_slots", &BufferLayout::num_slots)
      .field("slot_bytes", &BufferLayout::slot_bytes)
      .field("relay_nodes", &BufferLayout::relay_nodes)
      .field("relay_bytes", &BufferLayout::relay_bytes)
      .field("meta_offset", &BufferLayout::meta_offset)
      .field("tail_offset", &BufferLayout::tail_offset)
      .field("head_offset", &BufferLayout::head_offset)
      .field("epoch_offset", &BufferLayout::epoch_offset)
      .field("header_offset", &BufferLayout::header_offset)
      .field("relay_offset", &BufferLayout::relay_offset)
      .field("queue_offset", &BufferLayout::queue_offset)
      .field("total_bytes", &BufferLayout::total_bytes)
      .done();

  Struct<Common>(m, "IntranodeCommon", "intranode common",
                 "The fields every rank of an intranode launch shares (intranode.cuh Common); the launch sets\n"
                 "num_launch_ranks from its rank list.")
      .integer("num_ranks", &Common::num_ranks)
      .integer("num_channels", &Common::num_channels)
      .integer("rank_begin", &Common::rank_begin)
      .integer("skip_rank", &Common::skip_rank)
      .integer("chunk_tokens", &Common::chunk_tokens)
      .integer("l2_discard", &Common::l2_discard)
      .member("variant", &Common::variant)
      .integer("timeout_cycles", &Common::timeout_cycles)
      .member("layout", &Common::layout)
      .addresses("buffers", &Common::buffers)
      .pointer("error", &Common::error)
      .pointer("error_host", &Common::error_host, false)
      .init();
  Struct<NotifyRank>(m, "NotifyRank", "notify rank", "One launched rank of a notify (intranode.cuh NotifyRank).")
      .pointer("is_token_in_rank", &NotifyRank::is_token_in_rank)
      .pointer("recv_prefix", &NotifyRank::recv_prefix)
      .pointer("num_recv_tokens", &NotifyRank::num_recv_tokens)
      .pointer("overflow", &NotifyRank::overflow)
      .pointer("recv_topk_idx", &NotifyRank::recv_topk_idx)
      .pointer("recv_topk_weights", &NotifyRank::recv_topk_weights)
      .pointer("recv_src_idx", &NotifyRank::recv_src_idx)
      .pointer("peer_ok", &NotifyRank::peer_ok)
      .member("check", &NotifyRank::check)
      .integer("num_tokens", &NotifyRank::num_tokens)
      .integer("budget", &NotifyRank::budget)
      .init();
  Struct<DispatchRank>(m, "DispatchRank", "dispatch rank",
                       "One launched rank of a dispatch (intranode.cuh DispatchRank).")
      .pointer("x", &DispatchRank::x)
      .pointer("x_scales", &DispatchRank::x_scales)
      .pointer("topk_idx", &DispatchRank::topk_idx)
      .pointer("topk_weights", &DispatchRank::topk_weights)
      .pointer("is_token_in_rank", &DispatchRank::is_token_in_rank)
      .pointer("token_ids", &DispatchRank::token_ids, false)
      .pointer("recv_prefix", &DispatchRank::recv_prefix)
      .pointer("recv_x", &DispatchRank::recv_x)
      .pointer("recv_scales", &DispatchRank::recv_scales)
      .pointer("recv_topk_idx", &DispatchRank::recv_topk_idx)
      .pointer("recv_topk_weights", &DispatchRank::recv_topk_weights)
      .pointer("recv_src_idx", &DispatchRank::recv_src_idx)
      .pointer("num_recv_per_expert", &DispatchRank::num_recv_per_expert)
      .pointer("overflow", &DispatchRank::overflow)
      .pointer("peer_ok", &DispatchRank::peer_ok)  // None: a cached dispatch exchanges headers
      .member("check", &DispatchRank::check)
      .integer("num_tokens", &DispatchRank::num_tokens)
      .integer("num_rows", &DispatchRank::num_rows)
      .init();
  Struct<CombineRank>(m, "CombineRank", "combine rank", "One launched rank of a combine (intranode.cuh CombineRank).")
      .pointer("y", &CombineRank::y)
      .pointer("row_scale", &CombineRank::row_scale)
      .pointer("is_token_in_rank", &CombineRank::is_token_in_rank)
      .pointer("recv_prefix", &CombineRank::recv_prefix)
      .pointer("out", &CombineRank::out)
      .member("check", &CombineRank::check)
      .integer("num_tokens", &CombineRank::num_tokens)
      .integer("num_rows", &CombineRank::num_rows)
      .init();
}

}  // namespace bind

namespace intranode {
namespace {

using bind::as_stream;
using bind::check_backend;
using bind::copy_ranks;

// A launch's common fields with its launched ranks counted; every rank's buffer must be given.
Common launch_common(const Common& given, int32_t num_launch_ranks) {
  Common c = given;
  c.num_launch_ranks = num_launch_ranks;
  MOE_HOST_CHECK(c.num_ranks >= 1 && c.num_ranks <= kMaxRanks,
                 "intranode common.num_ranks must be in [1, " << kMaxRanks << "], got " << c.num_ranks);
  for (int i = 0; i < c.num_ranks; ++i)
    MOE_HOST_CHECK(c.buffers[i] != nullptr, "intranode common.buffers must list one buffer per rank ("
                                                << c.num_ranks << "), rank " << i << "'s is missing");
  return c;
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
  limits["line"] = kLine;
  limits["error_record_ints"] = kErrorRecordInts;
  limits["mismatch_record_words"] = kMismatchRecordWords;
  limits["header_words"] = static_cast<int>(kHeaderWords);
  limits["field_align"] = kFieldAlign;
  limits["max_rows_in_flight"] = kMaxRowsInFlight;
  limits["combine_warps"] = std::vector<int>(std::begin(kCombineWarps), std::end(kCombineWarps));
  m.attr("intranode_limits") = limits;
  // The codes Python reads or writes in headers and records (mirrored by transport/kernels/header.py
  // and transport/kernels/launcher.py: test_extension compares them).
  py::dict codes;
  codes["op"] = py::dict(py::arg("dispatch") = static_cast<int64_t>(kOpDispatch),
                         py::arg("cached dispatch") = static_cast<int64_t>(kOpCachedDispatch),
                         py::arg("combine") = static_cast<int64_t>(kOpCombine));
  codes["header_field"] =
      py::dict(py::arg("op") = static_cast<int>(kHdrOp), py::arg("identity") = static_cast<int>(kHdrIdentity),
               py::arg("row_bytes") = static_cast<int>(kHdrRowBytes), py::arg("dtype") = static_cast<int>(kHdrDtype),
               py::arg("topk") = static_cast<int>(kHdrTopk), py::arg("experts") = static_cast<int>(kHdrExperts),
               py::arg("shape") = static_cast<int>(kHdrShape), py::arg("status") = static_cast<int>(kHdrStatus),
               py::arg("budget") = static_cast<int>(kHdrBudget));
  codes["status"] = py::dict(py::arg("grow") = kStatusGrow);  // the statuses the kernels act on
  codes["combine_dtype"] =
      py::dict(py::arg("bfloat16") = static_cast<int>(kBf16), py::arg("float16") = static_cast<int>(kF16),
               py::arg("float32") = static_cast<int>(kF32));
  codes["phase"] =
      py::dict(py::arg("notify") = static_cast<int>(kNotify), py::arg("dispatch") = static_cast<int>(kDispatch),
               py::arg("combine") = static_cast<int>(kCombine));
  codes["role"] = py::dict(
      py::arg("barrier") = static_cast<int>(kBarrier), py::arg("sender") = static_cast<int>(kSender),
      py::arg("receiver") = static_cast<int>(kReceiver), py::arg("coordinator") = static_cast<int>(kCoordinator));
  codes["counter"] = py::dict(py::arg("signal") = static_cast<int>(kSignal), py::arg("tail") = static_cast<int>(kTail),
                              py::arg("head") = static_cast<int>(kHead), py::arg("header") = static_cast<int>(kHeader),
                              py::arg("relayed header") = static_cast<int>(kRelayHeader),
                              py::arg("forwarded tail") = static_cast<int>(kForwardTail));
  m.attr("codes") = codes;
  py::list copy_variants;  // (loads_in_flight, rows_in_flight, bulk_copy, register_cap, fused)
  for (const CopyVariant& v : kCopyVariants)
    copy_variants.append(py::make_tuple(v.loads, v.rows, v.bulk, v.cap, v.fused));
  m.attr("copy_variants") = copy_variants;

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
        return make_buffer_layout(static_cast<int>(num_ranks), static_cast<int>(num_channels),
                                  static_cast<int>(num_slots), static_cast<int>(slot_bytes),
                                  static_cast<int>(relay_nodes));
      },
      py::arg("num_ranks"), py::arg("num_channels"), py::arg("num_slots"), py::arg("slot_bytes"),
      py::arg("relay_nodes") = 0,
      "Byte offsets of one rank's communication buffer (csrc/kernels/intranode.cuh draws it).");

  m.def(
      "intranode_slot_layout",
      [](int64_t x_bytes, int64_t scale_bytes, int64_t num_topk) {
        MOE_HOST_CHECK(
            x_bytes >= 0 && scale_bytes >= 0 && num_topk >= 0 && num_topk <= kMaxTopk && x_bytes <= INT32_MAX / 2 &&
                scale_bytes <= INT32_MAX / 2,
            "bad slot sizes: x_bytes=" << x_bytes << " scale_bytes=" << scale_bytes << " num_topk=" << num_topk);
        return make_slot_layout(static_cast<int>(x_bytes), static_cast<int>(scale_bytes), static_cast<int>(num_topk));
      },
      py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"),
      "Field offsets of one queue slot (dispatch: x, fp8 scales, topk, source index; combine: y, row scale).");

  m.def(
      "intranode_channel_of_token",
      [](int64_t num_tokens, int64_t num_channels, int64_t token) {
        MOE_HOST_CHECK(
            num_tokens >= 1 && num_tokens <= INT32_MAX && num_channels >= 1 && token >= 0 && token < num_tokens,
            "need 0 <= token < num_tokens and num_channels >= 1");
        const TokenRange r = channel_token_range(
            static_cast<int>(num_tokens), static_cast<int>(num_channels),
            channel_of_token(static_cast<int>(num_tokens), static_cast<int>(num_channels), static_cast<int>(token)));
        return py::make_tuple(
            channel_of_token(static_cast<int>(num_tokens), static_cast<int>(num_channels), static_cast<int>(token)),
            r.begin, r.end);
      },
      py::arg("num_tokens"), py::arg("num_channels"), py::arg("token"),
      "(channel, begin, end): the channel owning `token` and its token range (protocol check).");

  m.def(
      "intranode_notify",
      [](const Common& common, const std::vector<NotifyRank>& ranks, int64_t num_topk, const std::string& backend,
         std::uintptr_t stream, bool cooperative) {
        check_backend(backend);
        NotifyArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.num_topk = static_cast<int32_t>(num_topk);
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
      "overflow (and -1/0 padding rows in budget mode). Collective across the W ranks.\n"
      "common: IntranodeCommon; ranks: one NotifyRank per launched rank.");

  m.def(
      "intranode_dispatch",
      [](const Common& common, const std::vector<DispatchRank>& ranks, int64_t x_bytes, int64_t scale_bytes,
         int64_t num_topk, int64_t experts_per_rank, const std::string& backend, std::uintptr_t stream,
         bool cooperative, const CpuOptions& options) {
        check_backend(backend);
        DispatchArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.slot = bind::checked_slot(x_bytes, scale_bytes, num_topk);
        args.experts_per_rank = static_cast<int32_t>(experts_per_rank);
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
      py::arg("cpu_options") = CpuOptions{},
      "Moves every token to the ranks holding it, rows ordered by (source rank, source token).\n"
      "common: IntranodeCommon; ranks: one DispatchRank per launched rank.");

  m.def(
      "intranode_combine",
      [](const Common& common, const std::vector<CombineRank>& ranks, int64_t y_bytes, int64_t dtype,
         const std::string& backend, std::uintptr_t stream, bool cooperative, const CpuOptions& options) {
        check_backend(backend);
        CombineArgs args{};
        args.common = launch_common(common, copy_ranks(ranks, args.ranks));
        args.slot = bind::checked_slot(y_bytes, 0, 0, "y_bytes");
        py::gil_scoped_release release;
        if (backend == "cpu") {
          check_common(args.common);
          run_combine_cpu(args, static_cast<DType>(dtype), options);
        } else {
          launch_combine(args, static_cast<DType>(dtype), cooperative, as_stream(stream));
        }
      },
      py::arg("common"), py::arg("ranks"), py::arg("y_bytes"), py::arg("dtype"), py::arg("backend") = "cuda",
      py::arg("stream") = 0, py::arg("cooperative") = true, py::arg("cpu_options") = CpuOptions{},
      "Sums each token's rows from its holders (ascending rank, fp32, rounded once) into out.\n"
      "common: IntranodeCommon; ranks: one CombineRank per launched rank.");

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
      "ipc_close", [](std::uintptr_t ptr) { MOE_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr))); },
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

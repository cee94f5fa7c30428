// Parsing of the Python-side launch descriptions (dicts of ints: device pointers and sizes)
// shared by intranode_bindings.cpp and internode_bindings.cpp. Missing keys and values that do
// not fit raise ValueError naming the dict and the key.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/intranode.cuh"
#include "kernels/intranode_cpu.h"

namespace moe_dispatch {
namespace bind {

namespace py = pybind11;

inline py::object field(const py::dict& d, const char* key, const char* what) {
  if (!d.contains(key)) throw std::invalid_argument(std::string(what) + " is missing '" + key + "'");
  return d[key];
}

template <typename T>
inline T* pointer(const py::dict& d, const char* key, const char* what) {
  py::object v = field(d, key, what);
  if (v.is_none()) return nullptr;
  return reinterpret_cast<T*>(v.cast<std::uintptr_t>());
}

inline int64_t integer(const py::dict& d, const char* key, const char* what) {
  return field(d, key, what).cast<int64_t>();
}

inline int32_t int32(const py::dict& d, const char* key, const char* what) {
  const int64_t v = integer(d, key, what);
  MOE_HOST_CHECK(v >= INT32_MIN && v <= INT32_MAX, what << "['" << key << "'] = " << v << " does not fit int32");
  return static_cast<int32_t>(v);
}

// The rank's header check (header.cuh): 'header' lists the 8 header words, 'mismatch' is the
// device record, 'mismatch_host' (optional) its host-mapped mirror.
inline intranode::Check parse_check(const py::dict& r, const char* what) {
  intranode::Check c{};
  const auto words = field(r, "header", what).cast<std::vector<int64_t>>();
  MOE_HOST_CHECK(words.size() == kHeaderWords,
                 what << "['header'] must list " << kHeaderWords << " words, got " << words.size());
  for (int i = 0; i < kHeaderWords; ++i) c.header.w[i] = words[i];
  c.mismatch = pointer<MismatchRecord>(r, "mismatch", what);
  MOE_HOST_CHECK(c.mismatch != nullptr, what << "['mismatch'] must be a device pointer");
  c.mismatch_host = r.contains("mismatch_host") ? pointer<MismatchRecord>(r, "mismatch_host", what) : nullptr;
  return c;
}

inline intranode::NotifyRank parse_notify_rank(const py::dict& r) {
  const char* what = "notify rank";
  intranode::NotifyRank n{};
  n.is_token_in_rank = pointer<const bool>(r, "is_token_in_rank", what);
  n.recv_prefix = pointer<int32_t>(r, "recv_prefix", what);
  n.num_recv_tokens = pointer<int32_t>(r, "num_recv_tokens", what);
  n.overflow = pointer<int32_t>(r, "overflow", what);
  n.recv_topk_idx = pointer<int64_t>(r, "recv_topk_idx", what);
  n.recv_topk_weights = pointer<float>(r, "recv_topk_weights", what);
  n.recv_src_idx = pointer<int32_t>(r, "recv_src_idx", what);
  n.peer_ok = pointer<int32_t>(r, "peer_ok", what);
  n.check = parse_check(r, what);
  n.num_tokens = int32(r, "num_tokens", what);
  n.budget = int32(r, "budget", what);
  return n;
}

inline intranode::DispatchRank parse_dispatch_rank(const py::dict& r) {
  const char* what = "dispatch rank";
  intranode::DispatchRank d{};
  d.x = pointer<const char>(r, "x", what);
  d.x_scales = pointer<const float>(r, "x_scales", what);
  d.topk_idx = pointer<const int64_t>(r, "topk_idx", what);
  d.topk_weights = pointer<const float>(r, "topk_weights", what);
  d.is_token_in_rank = pointer<const bool>(r, "is_token_in_rank", what);
  d.token_ids = r.contains("token_ids") ? pointer<const int32_t>(r, "token_ids", what) : nullptr;  // optional
  d.recv_prefix = pointer<const int32_t>(r, "recv_prefix", what);
  d.recv_x = pointer<char>(r, "recv_x", what);
  d.recv_scales = pointer<float>(r, "recv_scales", what);
  d.recv_topk_idx = pointer<int64_t>(r, "recv_topk_idx", what);
  d.recv_topk_weights = pointer<float>(r, "recv_topk_weights", what);
  d.recv_src_idx = pointer<int32_t>(r, "recv_src_idx", what);
  d.num_recv_per_expert = pointer<int64_t>(r, "num_recv_per_expert", what);
  d.overflow = pointer<int32_t>(r, "overflow", what);
  d.peer_ok = pointer<const int32_t>(r, "peer_ok", what);  // None: a cached dispatch exchanges headers
  d.check = parse_check(r, what);
  d.num_tokens = int32(r, "num_tokens", what);
  d.num_rows = int32(r, "num_rows", what);
  return d;
}

inline intranode::CombineRank parse_combine_rank(const py::dict& r) {
  const char* what = "combine rank";
  intranode::CombineRank c{};
  c.y = pointer<const char>(r, "y", what);
  c.row_scale = pointer<const float>(r, "row_scale", what);
  c.is_token_in_rank = pointer<const bool>(r, "is_token_in_rank", what);
  c.recv_prefix = pointer<const int32_t>(r, "recv_prefix", what);
  c.out = pointer<char>(r, "out", what);
  c.check = parse_check(r, what);
  c.num_tokens = int32(r, "num_tokens", what);
  c.num_rows = int32(r, "num_rows", what);
  return c;
}

inline intranode::CpuOptions parse_cpu_options(const py::dict& d) {
  intranode::CpuOptions o;
  if (d.contains("group_warps")) o.group_warps = d["group_warps"].cast<int>();
  if (d.contains("num_workers")) o.num_workers = d["num_workers"].cast<int>();
  return o;
}

inline void check_backend(const std::string& backend) {
  MOE_HOST_CHECK(backend == "cuda" || backend == "cpu", "backend must be 'cuda' or 'cpu', got '" << backend << "'");
}

inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

}  // namespace bind
}  // namespace moe_dispatch

// The permute's index phase on the CPU, in two passes over topk_idx: the same handle as
// moe_dispatch/semantics/permute.py's permute_map_reference (the expert-major layout Megatron's
// grouped GEMM takes: each expert's copies in ascending token order, blocks padded to a multiple,
// an optional row budget or fixed block capacity), and the permuted_sources of every output row.
// The reference makes it with about twenty tensor operations over [E + 1, R] one-hot counts.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace moe_dispatch {
namespace {

struct PermuteMap {
  int64_t num_tokens, num_topk, num_experts, pad_multiple;
  int64_t budget;    // num_permuted_tokens, or -1
  int64_t capacity;  // expert_capacity, or -1
};

// The local expert of (token t, slot k), or -1 (ids outside [0, E) count as none).
template <class I>
inline int64_t expert_of(const I* topk, const PermuteMap& p, int64_t t, int64_t k) {
  const int64_t x = static_cast<int64_t>(topk[t * p.num_topk + k]);
  return x >= 0 && x < p.num_experts ? x : -1;
}

// Fills the handle's tensors; returns (num_rows_needed, num_rows). sources: src and entry, at least
// num_rows each (-1 where an output row holds no copy).
template <class I>
py::tuple build(const I* topk, const PermuteMap& p, int32_t* row_id_map, int64_t* counts, int64_t* tokens_per_expert,
                int32_t* expert_offsets, int64_t* src, int64_t* entry, int64_t sources_size) {
  const int64_t e = p.num_experts;
  // The reference counts an expert once per token: a repeated one shares its first slot's row.
  // last[x]: the last token that named expert x; row_of[x]: the row it got.
  std::vector<int64_t> last(static_cast<size_t>(e), -1);
  std::fill(counts, counts + e, 0);
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int64_t k = 0; k < p.num_topk; ++k) {
      const int64_t x = expert_of(topk, p, t, k);
      if (x >= 0 && last[x] != t) {
        last[x] = t;
        ++counts[x];
      }
    }
  std::vector<int64_t> start(static_cast<size_t>(e)), padded(static_cast<size_t>(e));
  int64_t offset = 0, needed = 0;
  for (int64_t x = 0; x < e; ++x) {
    const int64_t rounded = (counts[x] + p.pad_multiple - 1) / p.pad_multiple * p.pad_multiple;
    padded[x] = p.capacity >= 0 ? p.capacity : rounded;
    start[x] = offset;
    offset += padded[x];
    needed += std::max(padded[x], rounded);
  }
  const int64_t num_rows = p.capacity >= 0 ? e * p.capacity : (p.budget >= 0 ? p.budget : needed);
  if (num_rows > sources_size)
    throw std::invalid_argument("permute_map_cpu: the sources hold " + std::to_string(sources_size) +
                                " rows, the layout has " + std::to_string(num_rows));
  const bool bounded = p.budget >= 0 || p.capacity >= 0;
  std::fill(src, src + num_rows, -1);
  std::fill(entry, entry + num_rows, -1);
  std::vector<int64_t> rank(static_cast<size_t>(e), 0);
  std::vector<int32_t> row_of(static_cast<size_t>(e), -1);
  std::fill(last.begin(), last.end(), -1);
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int64_t k = 0; k < p.num_topk; ++k) {
      const int64_t slot = t * p.num_topk + k;
      const int64_t x = expert_of(topk, p, t, k);
      if (x < 0) {
        row_id_map[slot] = -1;
        continue;
      }
      if (last[x] == t) {  // repeated: as the reference's index_put, the later slot's entry
        row_id_map[slot] = row_of[x];
        if (row_of[x] >= 0) entry[row_of[x]] = slot;
        continue;
      }
      last[x] = t;
      const int64_t r = rank[x]++;
      const int64_t row = start[x] + r;
      row_of[x] = bounded && (row >= num_rows || r >= padded[x]) ? -1 : static_cast<int32_t>(row);
      row_id_map[slot] = row_of[x];
      if (row_of[x] >= 0) {
        src[row] = t;
        entry[row] = slot;
      }
    }
  for (int64_t x = 0; x < e; ++x) {
    tokens_per_expert[x] = std::min(std::max<int64_t>(num_rows - start[x], 0), padded[x]);
    expert_offsets[x] = static_cast<int32_t>(start[x]);
  }
  return py::make_tuple(needed, num_rows);
}

}  // namespace

void register_permute(py::module_& m) {
  m.def(
      "permute_map_cpu",
      [](std::uintptr_t topk_idx, int index_bytes, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
         int64_t pad_multiple, int64_t num_permuted_tokens, int64_t expert_capacity, std::uintptr_t row_id_map,
         std::uintptr_t num_tokens_per_expert, std::uintptr_t tokens_per_expert, std::uintptr_t expert_offsets,
         std::uintptr_t src, std::uintptr_t entry, int64_t sources_size) {
        if (index_bytes != 4 && index_bytes != 8)
          throw std::invalid_argument("permute_map_cpu: index_bytes must be 4 (int32) or 8 (int64), got " +
                                      std::to_string(index_bytes));
        if (pad_multiple < 1)
          throw std::invalid_argument("permute_map_cpu: pad_multiple must be >= 1, got " +
                                      std::to_string(pad_multiple));
        const PermuteMap p{num_tokens, num_topk, num_experts, pad_multiple, num_permuted_tokens, expert_capacity};
        auto* rows = reinterpret_cast<int32_t*>(row_id_map);
        auto* counts = reinterpret_cast<int64_t*>(num_tokens_per_expert);
        auto* blocks = reinterpret_cast<int64_t*>(tokens_per_expert);
        auto* offsets = reinterpret_cast<int32_t*>(expert_offsets);
        auto* s = reinterpret_cast<int64_t*>(src);
        auto* en = reinterpret_cast<int64_t*>(entry);
        if (index_bytes == 4)
          return build(reinterpret_cast<const int32_t*>(topk_idx), p, rows, counts, blocks, offsets, s, en,
                       sources_size);
        return build(reinterpret_cast<const int64_t*>(topk_idx), p, rows, counts, blocks, offsets, s, en, sources_size);
      },
      py::arg("topk_idx"), py::arg("index_bytes"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
      py::arg("pad_multiple"), py::arg("num_permuted_tokens"), py::arg("expert_capacity"), py::arg("row_id_map"),
      py::arg("num_tokens_per_expert"), py::arg("tokens_per_expert"), py::arg("expert_offsets"), py::arg("src"),
      py::arg("entry"), py::arg("sources_size"),
      "Host memory only: permute_map_reference's handle of topk_idx [num_tokens, num_topk] (int32 or int64 "
      "local expert ids; -1, or -1 for budget / capacity when none) into row_id_map [num_tokens, num_topk] int32, "
      "num_tokens_per_expert and tokens_per_expert [num_experts] int64, expert_offsets [num_experts] int32, and "
      "permuted_sources' src and entry (int64, sources_size >= the rows). Returns (num_rows_needed, num_rows).");
}

}  // namespace moe_dispatch

// The routing layout on the CPU, each in one pass: Megatron's routing_map to top-k form,
// topk_idx's value check, is_token_in_rank, the received ids in local numbering with their
// per-expert counts, and the torch_dist transport's dispatch counts (dispatch_counts() in
// moe_dispatch/transport/torch_dist/plan.py: the per-rank and per-node counts of each token
// sub-range, written straight into the header rows, and the flat route's send order) and its flat
// combine's (token, node) pairs. The torch versions take a few tensor operations per step (min,
// max, a sort, a top-k, a scatter, cumulative sums, nonzero); these are a host call each.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace moe_dispatch {
namespace {

inline int64_t id_at(std::uintptr_t topk, int64_t index_bytes, int64_t i) {
  return index_bytes == 8 ? reinterpret_cast<const int64_t*>(topk)[i]
                          : static_cast<int64_t>(reinterpret_cast<const int32_t*>(topk)[i]);
}

inline void set_id(std::uintptr_t topk, int64_t index_bytes, int64_t i, int64_t v) {
  if (index_bytes == 8)
    reinterpret_cast<int64_t*>(topk)[i] = v;
  else
    reinterpret_cast<int32_t*>(topk)[i] = static_cast<int32_t>(v);
}

// One probs element as fp32 (dtype codes: 0 fp32, 1 bf16, 2 fp16, 3 fp64), as torch's .float().
inline float prob_at(std::uintptr_t probs, int64_t dtype, int64_t i) {
  switch (dtype) {
    case 0:
      return reinterpret_cast<const float*>(probs)[i];
    case 1: {
      const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(probs)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case 2: {
      const uint16_t h = reinterpret_cast<const uint16_t*>(probs)[i];
      const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
      float f;
      if (exp == 0) {  // zero or subnormal: man * 2^-24
        f = std::ldexp(static_cast<float>(man), -24);
        if (sign) f = -f;
        return f;
      }
      const uint32_t bits = exp == 0x1f ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    default:
      return static_cast<float>(reinterpret_cast<const double*>(probs)[i]);
  }
}

void check_index_bytes(const char* what, int64_t index_bytes) {
  if (index_bytes != 4 && index_bytes != 8)
    throw std::invalid_argument(std::string(what) + ": index_bytes must be 4 (int32) or 8 (int64), got " +
                                std::to_string(index_bytes));
}

}  // namespace

void register_layout(py::module_& m) {
  m.def(
      "routing_map_to_topk_cpu",
      [](std::uintptr_t routing_map, int64_t num_tokens, int64_t num_experts, int64_t num_topk, std::uintptr_t probs,
         int64_t probs_dtype, std::uintptr_t topk_idx, std::uintptr_t topk_weights) {
        if (probs != 0 && (probs_dtype < 0 || probs_dtype > 3))
          throw std::invalid_argument("routing_map_to_topk_cpu: probs_dtype must be 0-3, got " +
                                      std::to_string(probs_dtype));
        const auto* selected = reinterpret_cast<const uint8_t*>(routing_map);
        auto* idx = reinterpret_cast<int64_t*>(topk_idx);
        auto* weights = reinterpret_cast<float*>(topk_weights);
        int64_t worst = 0, worst_row = 0, fewest = num_tokens ? num_experts : 0;
        {
          py::gil_scoped_release release;
          for (int64_t t = 0; t < num_tokens; ++t) {
            int64_t k = 0;
            for (int64_t e = 0; e < num_experts; ++e) {
              if (!selected[t * num_experts + e]) continue;
              if (k < num_topk) {  // the lowest ids first; unvalidated extra ones are dropped
                idx[t * num_topk + k] = e;
                if (weights != nullptr) weights[t * num_topk + k] = prob_at(probs, probs_dtype, t * num_experts + e);
              }
              ++k;
            }
            if (k > worst) worst = k, worst_row = t;
            fewest = std::min(fewest, k);
            for (int64_t j = k; j < num_topk; ++j) {
              idx[t * num_topk + j] = -1;
              if (weights != nullptr) weights[t * num_topk + j] = 0.0f;
            }
          }
        }
        return py::make_tuple(worst, worst_row, fewest);
      },
      py::arg("routing_map"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("num_topk"), py::arg("probs"),
      py::arg("probs_dtype"), py::arg("topk_idx"), py::arg("topk_weights"),
      "Host memory only: topk_idx [T, K] int64 (each row's selected experts of routing_map [T, E] (one byte "
      "each, nonzero = selected) in ascending id, then -1) and, when probs is not 0, topk_weights [T, K] fp32 "
      "(probs [T, E] of dtype 0 fp32, 1 bf16, 2 fp16, 3 fp64 at those experts, then 0). Returns (the most "
      "experts a row selects, the first such row, the fewest a row selects).");

  m.def(
      "localize_topk_idx_cpu",
      [](std::uintptr_t topk_idx, int64_t index_bytes, int64_t num_tokens, int64_t num_topk, int64_t first_expert,
         int64_t num_local_experts, std::uintptr_t counts, std::uintptr_t weights) {
        check_index_bytes("localize_topk_idx_cpu", index_bytes);
        auto* per_expert = reinterpret_cast<int64_t*>(counts);
        auto* w = reinterpret_cast<float*>(weights);
        py::gil_scoped_release release;
        std::fill(per_expert, per_expert + num_local_experts, 0);
        for (int64_t i = 0; i < num_tokens * num_topk; ++i) {
          const int64_t local = id_at(topk_idx, index_bytes, i) - first_expert;
          if (local >= 0 && local < num_local_experts) {
            set_id(topk_idx, index_bytes, i, local);
            ++per_expert[local];
          } else {
            set_id(topk_idx, index_bytes, i, -1);
            if (w != nullptr) w[i] = 0.0f;
          }
        }
      },
      py::arg("topk_idx"), py::arg("index_bytes"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("first_expert"),
      py::arg("num_local_experts"), py::arg("counts"), py::arg("weights"),
      "Host memory only, in place: the ids of topk_idx [T, K] (int32 or int64) in [first_expert, first_expert + "
      "num_local_experts) made local, the others -1 (and their weights [T, K] fp32 zeroed, when weights is not "
      "0); counts [num_local_experts] int64: the local ids' occurrences.");

  m.def(
      "flat_pairs_cpu",
      [](std::uintptr_t in_node, int64_t num_tokens, int64_t num_nodes, int64_t ranks_per_node, std::uintptr_t send_idx,
         const std::vector<int64_t>& splits, std::uintptr_t pair_of_row, std::uintptr_t pair_token) {
        const auto* hit = reinterpret_cast<const bool*>(in_node);
        const auto* idx = reinterpret_cast<const int64_t*>(send_idx);
        auto* pair = reinterpret_cast<int64_t*>(pair_of_row);
        auto* token = reinterpret_cast<int64_t*>(pair_token);
        if (ranks_per_node < 1 || static_cast<int64_t>(splits.size()) != num_nodes * ranks_per_node)
          throw std::invalid_argument("flat_pairs_cpu: splits must have num_nodes * ranks_per_node entries");
        py::gil_scoped_release release;
        std::vector<int64_t> where(static_cast<size_t>(num_tokens * num_nodes), -1);
        int64_t pairs = 0;
        for (int64_t t = 0; t < num_tokens; ++t)
          for (int64_t m = 0; m < num_nodes; ++m)
            if (hit[t * num_nodes + m]) {
              where[t * num_nodes + m] = pairs;
              token[pairs++] = t;
            }
        int64_t j = 0;
        for (size_t d = 0; d < splits.size(); ++d)
          for (int64_t r = 0; r < splits[d]; ++r, ++j)
            pair[j] = where[idx[j] * num_nodes + static_cast<int64_t>(d) / ranks_per_node];
        return pairs;
      },
      py::arg("in_node"), py::arg("num_tokens"), py::arg("num_nodes"), py::arg("ranks_per_node"), py::arg("send_idx"),
      py::arg("splits"), py::arg("pair_of_row"), py::arg("pair_token"),
      "Host memory only: the (token, node) pairs of in_node [T, N] bool, token-major (pair_token [at least T * N] "
      "int64: each pair's token), and pair_of_row [F] int64: the pair of each flat send row (token send_idx[j], "
      "sent to a rank of splits' destination d, of node d / ranks_per_node), -1 where in_node does not hold it. "
      "Returns the number of pairs.");

  m.def(
      "check_topk_idx_cpu",
      [](std::uintptr_t topk_idx, int64_t index_bytes, int64_t num_tokens, int64_t num_topk) {
        check_index_bytes("check_topk_idx_cpu", index_bytes);
        int64_t lo = 0, hi = 0, dup_row = -1;
        {
          py::gil_scoped_release release;
          if (num_tokens * num_topk > 0) lo = hi = id_at(topk_idx, index_bytes, 0);
          for (int64_t t = 0; t < num_tokens; ++t)
            for (int64_t k = 0; k < num_topk; ++k) {
              const int64_t x = id_at(topk_idx, index_bytes, t * num_topk + k);
              lo = std::min(lo, x);
              hi = std::max(hi, x);
              if (dup_row < 0 && x >= 0)
                for (int64_t j = 0; j < k; ++j)
                  if (id_at(topk_idx, index_bytes, t * num_topk + j) == x) {
                    dup_row = t;
                    break;
                  }
            }
        }
        return py::make_tuple(lo, hi, dup_row);
      },
      py::arg("topk_idx"), py::arg("index_bytes"), py::arg("num_tokens"), py::arg("num_topk"),
      "Host memory only: (min, max, first row naming an expert id >= 0 twice or -1) of topk_idx [T, K] "
      "(contiguous int32 or int64); (0, 0, -1) when it is empty.");

  m.def(
      "is_token_in_rank_cpu",
      [](std::uintptr_t topk_idx, int64_t index_bytes, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
         int64_t num_ranks, std::uintptr_t out) {
        check_index_bytes("is_token_in_rank_cpu", index_bytes);
        if (num_ranks < 1 || num_experts % num_ranks != 0)
          throw std::invalid_argument("is_token_in_rank_cpu: num_ranks must divide num_experts, got " +
                                      std::to_string(num_ranks) + " and " + std::to_string(num_experts));
        const int64_t per_rank = num_experts / num_ranks;
        auto* hit = reinterpret_cast<bool*>(out);
        py::gil_scoped_release release;
        std::memset(hit, 0, static_cast<size_t>(num_tokens * num_ranks));
        for (int64_t t = 0; t < num_tokens; ++t)
          for (int64_t k = 0; k < num_topk; ++k) {
            const int64_t x = id_at(topk_idx, index_bytes, t * num_topk + k);
            if (x >= 0 && x < num_experts) hit[t * num_ranks + x / per_rank] = true;
          }
      },
      py::arg("topk_idx"), py::arg("index_bytes"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
      py::arg("num_ranks"), py::arg("out"),
      "Host memory only: out [T, W] bool, whether a token has an expert of each rank (ids outside [0, E) "
      "count as none).");

  m.def(
      "dispatch_counts_cpu",
      [](std::uintptr_t is_token_in_rank, int64_t num_tokens, int64_t num_ranks, int64_t ranks_per_node, int64_t node,
         const std::vector<int64_t>& bounds, std::uintptr_t head, int64_t head_words, int64_t head_offset,
         std::uintptr_t per_sub, std::uintptr_t in_node, std::uintptr_t send_idx) {
        const int64_t w = num_ranks, l = ranks_per_node;
        if (l < 1 || w % l != 0 || node < 0 || node >= w / l)
          throw std::invalid_argument(
              "dispatch_counts_cpu: ranks_per_node must divide num_ranks and node be one of "
              "its nodes, got " +
              std::to_string(l) + ", " + std::to_string(w) + ", " + std::to_string(node));
        const int64_t n = w / l, subs = static_cast<int64_t>(bounds.size()) - 1;
        if (subs < 1 || bounds.front() != 0 || bounds.back() != num_tokens ||
            !std::is_sorted(bounds.begin(), bounds.end()))
          throw std::invalid_argument("dispatch_counts_cpu: bounds must rise from 0 to num_tokens");
        if (head_offset + 5 + subs * (l + 1) > head_words)
          throw std::invalid_argument("dispatch_counts_cpu: the header rows hold " + std::to_string(head_words) +
                                      " words, the counts need " + std::to_string(head_offset + 5 + subs * (l + 1)));
        const auto* hit = reinterpret_cast<const bool*>(is_token_in_rank);
        auto* node_hit = reinterpret_cast<bool*>(in_node);
        auto* counts = reinterpret_cast<int64_t*>(per_sub);  // [S, W + N]
        auto* idx = reinterpret_cast<int64_t*>(send_idx);
        auto* words = reinterpret_cast<int64_t*>(head);
        py::gil_scoped_release release;
        std::fill(counts, counts + subs * (w + n), 0);
        for (int64_t s = 0; s < subs; ++s) {
          int64_t* c = counts + s * (w + n);
          for (int64_t t = bounds[s]; t < bounds[s + 1]; ++t)
            for (int64_t m = 0; m < n; ++m) {
              bool any = false;
              for (int64_t j = m * l; j < (m + 1) * l; ++j)
                if (hit[t * w + j]) {
                  ++c[j];
                  any = true;
                }
              node_hit[t * n + m] = any;
              c[w + m] += any;
            }
        }
        // The flat route's send order: rank-major, tokens ascending.
        std::vector<int64_t> at(static_cast<size_t>(w), 0), to_rank(static_cast<size_t>(w), 0);
        int64_t flat_rows = 0, stage1_rows = 0, own_rank_rows = 0, own_node_rows = 0;
        for (int64_t s = 0; s < subs; ++s)
          for (int64_t j = 0; j < w + n; ++j) {
            const int64_t v = counts[s * (w + n) + j];
            if (j < w) {
              to_rank[j] += v;
              flat_rows += v;
              own_rank_rows += j / l == node ? v : 0;
            } else {
              stage1_rows += v;
              own_node_rows += j - w == node ? v : 0;
            }
          }
        for (int64_t d = 1; d < w; ++d) at[d] = at[d - 1] + to_rank[d - 1];
        for (int64_t t = 0; t < num_tokens; ++t)
          for (int64_t d = 0; d < w; ++d)
            if (hit[t * w + d]) idx[at[d]++] = t;
        // Each destination d = (n_d, l_d)'s header: my sizes, then per sub-range my counts for the
        // ranks of d's node and for d's node.
        const int64_t sizes[5] = {flat_rows, stage1_rows, flat_rows - own_rank_rows, stage1_rows - own_node_rows,
                                  *std::max_element(to_rank.begin(), to_rank.end())};
        for (int64_t d = 0; d < w; ++d) {
          int64_t* row = words + d * head_words + head_offset;
          std::copy(sizes, sizes + 5, row);
          row += 5;
          const int64_t nd = d / l;
          for (int64_t s = 0; s < subs; ++s) {
            const int64_t* c = counts + s * (w + n);
            std::copy(c + nd * l, c + (nd + 1) * l, row);
            row[l] = c[w + nd];
            row += l + 1;
          }
        }
        return flat_rows;
      },
      py::arg("is_token_in_rank"), py::arg("num_tokens"), py::arg("num_ranks"), py::arg("ranks_per_node"),
      py::arg("node"), py::arg("bounds"), py::arg("head"), py::arg("head_words"), py::arg("head_offset"),
      py::arg("per_sub"), py::arg("in_node"), py::arg("send_idx"),
      "Host memory only, from is_token_in_rank [T, W] bool: per_sub [S, W + N] int64 (each sub-range "
      "[bounds[s], bounds[s+1]) of the tokens: tokens for each rank, then for each node), in_node [T, N] bool, "
      "send_idx [at least T * W] int64 (the token of each flat send row, rank-major, tokens ascending), and "
      "header words [head_offset, ...) of each row d of head [W, head_words] int64: the five sizes (flat rows, "
      "stage-1 rows, their rows crossing nodes, the most rows for one rank), then per sub-range the counts "
      "for d's node's ranks and for d's node. Returns the flat send rows.");
}

}  // namespace moe_dispatch

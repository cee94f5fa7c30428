// Routing layout kernel. One launch, blocks split by role:
//   [0, E_b)                 count tokens per expert, kNumBinsPerBlock experts per block
//   [E_b, E_b+W_b)           count tokens per rank
//   [E_b+W_b, E_b+W_b+N_b)   count tokens per node
//   the rest                 write is_token_in_rank, a grid-stride map over [T, W]
// A counting block owns its bins outright (shared-memory counters, then one plain store per
// bin), so outputs need no zero-fill and no global atomics; integer counts do not depend on
// the order of the shared atomics, so results are deterministic. Work is bounded for any
// W, E, K: a counting block reads every (token, k) entry once, plus K look-backs for dedup.
#include <algorithm>
#include <climits>

#include "core/error.h"
#include "kernels/layout.h"

namespace moe_dispatch {
namespace {

constexpr int kNumThreads = 256;
constexpr int kNumBinsPerBlock = 1024;  // 4 KiB of int counters per counting block
constexpr int64_t kMaxMapBlocks = 1024;

// Counts into out[bin_begin, bin_end) the entries of topk_idx whose expert e lies in bin
// e / experts_per_bin. With `dedup`, a token counts once per bin (ranks, nodes: an earlier
// entry of the same row in the same bin suppresses later ones); without, every entry counts
// (experts, like torch.bincount).
__device__ void count_bins(const int64_t* topk_idx, int64_t num_entries, int num_topk, int num_experts,
                           int experts_per_bin, bool dedup, int bin_begin, int bin_end, int64_t* out, int* counts) {
  const int num_bins = bin_end - bin_begin;
  for (int i = threadIdx.x; i < num_bins; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  // Flat loop over entries so consecutive threads load consecutive int64s.
  for (int64_t i = threadIdx.x; i < num_entries; i += blockDim.x) {
    const int64_t expert = topk_idx[i];
    if (expert < 0 || expert >= num_experts) continue;
    const int bin = static_cast<int>(expert) / experts_per_bin;
    if (bin < bin_begin || bin >= bin_end) continue;
    bool first_in_row = true;
    if (dedup) {
      const int64_t row_begin = i - i % num_topk;
      for (int64_t j = row_begin; j < i && first_in_row; ++j) {
        const int64_t other = topk_idx[j];
        first_in_row = !(other >= 0 && other < num_experts && static_cast<int>(other) / experts_per_bin == bin);
      }
    }
    if (first_in_row) atomicAdd(&counts[bin - bin_begin], 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_bins; i += blockDim.x) out[bin_begin + i] = counts[i];
}

__global__ void __launch_bounds__(kNumThreads)
    get_dispatch_layout_kernel(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                               int ranks_per_node, int64_t* num_tokens_per_rank, int64_t* num_tokens_per_node,
                               int64_t* num_tokens_per_expert, bool* is_token_in_rank, int num_expert_blocks,
                               int num_rank_blocks, int num_node_blocks, int num_map_blocks) {
  __shared__ int counts[kNumBinsPerBlock];
  const int64_t num_entries = static_cast<int64_t>(num_tokens) * num_topk;
  const int experts_per_rank = num_experts / num_ranks;
  int block = blockIdx.x;

  // Role selection depends on blockIdx only, so every thread of a block takes the same branch
  // (count_bins synchronises the block).
  if (block < num_expert_blocks) {
    const int begin = block * kNumBinsPerBlock;
    count_bins(topk_idx, num_entries, num_topk, num_experts, 1, false, begin,
               min(begin + kNumBinsPerBlock, num_experts), num_tokens_per_expert, counts);
    return;
  }
  block -= num_expert_blocks;
  if (block < num_rank_blocks) {
    const int begin = block * kNumBinsPerBlock;
    count_bins(topk_idx, num_entries, num_topk, num_experts, experts_per_rank, true, begin,
               min(begin + kNumBinsPerBlock, num_ranks), num_tokens_per_rank, counts);
    return;
  }
  block -= num_rank_blocks;
  if (block < num_node_blocks) {
    const int begin = block * kNumBinsPerBlock;
    count_bins(topk_idx, num_entries, num_topk, num_experts, experts_per_rank * ranks_per_node, true, begin,
               min(begin + kNumBinsPerBlock, num_ranks / ranks_per_node), num_tokens_per_node, counts);
    return;
  }
  block -= num_node_blocks;
  // is_token_in_rank: one thread per (token, rank) element keeps the bool stores coalesced;
  // the K loads of a row are shared by neighbouring threads through L1.
  const int64_t num_elements = static_cast<int64_t>(num_tokens) * num_ranks;
  const int64_t stride = static_cast<int64_t>(num_map_blocks) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(block) * blockDim.x + threadIdx.x; i < num_elements; i += stride) {
    const int64_t token = i / num_ranks;
    const int rank = static_cast<int>(i % num_ranks);
    const int64_t* row = topk_idx + token * num_topk;
    bool hit = false;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t expert = row[k];
      hit |= expert >= 0 && expert < num_experts && static_cast<int>(expert) / experts_per_rank == rank;
    }
    is_token_in_rank[i] = hit;
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void get_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                         int64_t num_ranks, int64_t ranks_per_node, int64_t* num_tokens_per_rank,
                         int64_t* num_tokens_per_node, int64_t* num_tokens_per_expert, bool* is_token_in_rank,
                         cudaStream_t stream) {
  MOE_HOST_CHECK(num_tokens >= 0 && num_tokens <= INT_MAX,
                 "num_tokens must be in [0, " << INT_MAX << "], got " << num_tokens);
  MOE_HOST_CHECK(num_topk >= 0 && num_topk <= INT_MAX, "num_topk must be in [0, " << INT_MAX << "], got " << num_topk);
  MOE_HOST_CHECK(num_ranks >= 1, "num_ranks must be >= 1, got " << num_ranks);
  MOE_HOST_CHECK(num_experts >= 1 && num_experts <= INT_MAX && num_experts % num_ranks == 0,
                 "num_experts must be a positive multiple of num_ranks=" << num_ranks << ", got " << num_experts);
  MOE_HOST_CHECK(ranks_per_node >= 1 && num_ranks % ranks_per_node == 0,
                 "ranks_per_node must divide num_ranks=" << num_ranks << ", got " << ranks_per_node);
  // Shared counters are int: every count is at most num_tokens * num_topk.
  MOE_HOST_CHECK(num_tokens * num_topk <= INT_MAX,
                 "num_tokens * num_topk must be <= " << INT_MAX << ", got " << num_tokens << " * " << num_topk);
  MOE_HOST_CHECK(num_tokens_per_rank != nullptr && num_tokens_per_node != nullptr && num_tokens_per_expert != nullptr,
                 "count outputs must be non-null device pointers");
  MOE_HOST_CHECK(num_tokens * num_topk == 0 || topk_idx != nullptr,
                 "topk_idx must be a non-null device pointer for " << num_tokens << " tokens");
  MOE_HOST_CHECK(num_tokens == 0 || is_token_in_rank != nullptr,
                 "is_token_in_rank must be a non-null device pointer for " << num_tokens << " tokens");

  const int64_t num_nodes = num_ranks / ranks_per_node;
  const int64_t num_expert_blocks = ceil_div(num_experts, kNumBinsPerBlock);
  const int64_t num_rank_blocks = ceil_div(num_ranks, kNumBinsPerBlock);
  const int64_t num_node_blocks = ceil_div(num_nodes, kNumBinsPerBlock);
  const int64_t num_map_blocks = std::min(ceil_div(num_tokens * num_ranks, kNumThreads), kMaxMapBlocks);
  const int64_t num_blocks = num_expert_blocks + num_rank_blocks + num_node_blocks + num_map_blocks;
  get_dispatch_layout_kernel<<<static_cast<unsigned>(num_blocks), kNumThreads, 0, stream>>>(
      topk_idx, static_cast<int>(num_tokens), static_cast<int>(num_topk), static_cast<int>(num_experts),
      static_cast<int>(num_ranks), static_cast<int>(ranks_per_node), num_tokens_per_rank, num_tokens_per_node,
      num_tokens_per_expert, is_token_in_rank, static_cast<int>(num_expert_blocks), static_cast<int>(num_rank_blocks),
      static_cast<int>(num_node_blocks), static_cast<int>(num_map_blocks));
  MOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe_dispatch

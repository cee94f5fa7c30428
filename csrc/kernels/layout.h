// Routing layout: which ranks, nodes and experts each token goes to.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_dispatch {

// Launches the layout kernel on `stream` (asynchronous; no host synchronisation, CUDA-graph
// safe). Semantics equal moe_dispatch.semantics.layout.get_dispatch_layout_reference: rank r
// owns experts [r*E/W, (r+1)*E/W), node n owns ranks [n*L, (n+1)*L).
//
// IN  topk_idx               [num_tokens, num_topk] int64, global expert ids; -1 = no expert
//                            (any value outside [0, num_experts) is ignored the same way).
// OUT num_tokens_per_rank    [num_ranks] int64: tokens with at least one expert on the rank.
// OUT num_tokens_per_node    [num_ranks / ranks_per_node] int64: same, per node.
// OUT num_tokens_per_expert  [num_experts] int64: entries naming the expert.
// OUT is_token_in_rank       [num_tokens, num_ranks] bool.
// Outputs need no initialisation: every element is written.
// Throws std::invalid_argument for sizes that do not fit (num_experts % num_ranks,
// num_ranks % ranks_per_node, negative sizes, null pointers) and CudaError on launch failure.
void get_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                         int64_t num_ranks, int64_t ranks_per_node, int64_t* num_tokens_per_rank,
                         int64_t* num_tokens_per_node, int64_t* num_tokens_per_expert, bool* is_token_in_rank,
                         cudaStream_t stream);

}  // namespace moe_dispatch

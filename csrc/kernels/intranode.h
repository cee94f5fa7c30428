// Host entry points of the intranode kernels (see intranode.cuh for layout and protocol).
// Every function checks its arguments (std::invalid_argument naming the value) and launches
// asynchronously on `stream`: no host synchronisation, CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include "kernels/intranode.cuh"

namespace moe_dispatch {
namespace intranode {

// Checks the fields every launch shares (sizes, counts, pointers).
void check_common(const Common& common);

// The per-rank counts and pointers of a dispatch's (combine's) `count` launched ranks, rank
// `rank_begin` first, shared with the internode stage 1; `mask` and `y` name is_token_in_rank and
// y in the messages (stage 1: is_token_in_node, the node partials).
void check_dispatch_ranks(const SlotLayout& s, const DispatchRank* ranks, int count, int rank_begin, const char* mask);
void check_combine_ranks(const CombineRank* ranks, int count, int rank_begin, const char* mask, const char* y);

// One block per launched rank: barrier, exchange per-(source, channel) counts, receive prefix.
// Collective across the W ranks' launches (loopback: within the one launch).
void launch_notify(const NotifyArgs& args, bool cooperative, cudaStream_t stream);

// 2 * num_channels blocks per launched rank (senders even, receivers odd). Needs the
// recv_prefix of a notify with the same is_token_in_rank (or a previous dispatch's, cached).
void launch_dispatch(const DispatchArgs& args, bool cooperative, cudaStream_t stream);

// 2 * num_channels blocks per launched rank; `dtype` is y's element type.
void launch_combine(const CombineArgs& args, DType dtype, bool cooperative, cudaStream_t stream);

}  // namespace intranode
}  // namespace moe_dispatch

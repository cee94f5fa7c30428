// Kernels of the fused internode pipeline (internode.cuh, FUSED) and their host launchers:
// one notify kernel, then one kernel per dispatch or combine with three blocks per channel,
// blockIdx = (3 * channel + role, launched rank). The per-warp protocol lives in
// internode_fused_roles.cuh, shared with the CPU backend; the contexts in internode_device.cuh.
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/launch.h"
#include "kernels/internode_device.cuh"
#include "kernels/internode_fused_roles.cuh"

namespace moe_dispatch {
namespace internode {
namespace {

template <class Ctx>
__global__ void __launch_bounds__(kNotifyThreads, 1) fused_notify_kernel(const __grid_constant__ FusedNotifyArgs args) {
  __shared__ FusedNotifyState state;
  notify_block<Ctx>(args.common, [&](Ctx& ctx, int rank) { fused_notify(ctx, args, rank, &state); });
}

// Role 0: RDMA senders (groups over nodes); role 1: forwarders (a group per local destination;
// warp 0 of channel 0 first runs a cached dispatch's header round); role 2: NVLink receivers
// (a group per local forwarder).
// Ctx carries the copy policy; kMinBlocks: 2 = the register cap of the current kernels (variant.cuh).
template <class Ctx, int kMinBlocks>
__global__ void __launch_bounds__(kNumThreads, kMinBlocks)
    fused_dispatch_kernel(const __grid_constant__ FusedDispatchArgs args) {
  rank_block<Ctx>(args.common, [&](Ctx& ctx0, int rank, uint64_t epoch) {
    const Common& common = args.common;
    const FusedDispatchRank& me = args.ranks[rank - common.rank_begin];
    const int channel = static_cast<int>(blockIdx.x) / 3, role = static_cast<int>(blockIdx.x) % 3;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    __shared__ GroupState groups[kNumWarps];
    __shared__ ForwardState forward;
    if (role == 1) {
      for (int i = threadIdx.x; i < kMaxNodes; i += blockDim.x) forward.published[i] = 0;
      for (int i = threadIdx.x; i < kMaxLocal * kMaxNodes; i += blockDim.x) (&forward.consumed[0][0])[i] = 0;
      __syncthreads();
      if (me.peer_ok == nullptr && channel == 0 && warp == 0)
        fused_handshake(ctx0, common, me.check, rank, epoch, kNodeDispatch);
    }
    const Groups g = groups_of(role == 0 ? common.num_nodes : common.ranks_per_node);
    if (g.group >= g.count) return;
    Ctx ctx{{{&common, g.group + 1, g.warps * 32}}};
    const int w = warp % g.warps;
    if (role == 0) {
      fused_rdma_send(ctx, args, rank, channel, g.group, g.count, w, g.warps, epoch, &groups[g.group]);
    } else if (role == 1) {
      fused_forward(ctx, args, rank, channel, g.group, w, g.warps, epoch, &forward, &groups[g.group]);
    } else {
      fused_nvl_recv(ctx, args, rank, channel, g.group, w, g.warps, epoch, &groups[g.group]);
    }
  });
}

// Role 0: holder senders (a group per local forwarder); role 1: the forwarder reducer (warp 0
// coordinates, after channel 0's header round; the others reduce); role 2: the source reducer.
template <class Ctx, class T, int kMinBlocks>
__global__ void __launch_bounds__(kNumThreads, kMinBlocks)
    fused_combine_kernel(const __grid_constant__ FusedCombineArgs args) {
  rank_block<Ctx>(args.common, [&](Ctx& ctx0, int rank, uint64_t epoch) {
    const Common& common = args.common;
    const FusedCombineRank& me = args.ranks[rank - common.rank_begin];
    const int channel = static_cast<int>(blockIdx.x) / 3, role = static_cast<int>(blockIdx.x) % 3;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if (role == 0) {
      __shared__ GroupState groups[kNumWarps];
      const Groups g = groups_of(common.ranks_per_node);
      if (g.group >= g.count) return;
      Ctx ctx{{{&common, g.group + 1, g.warps * 32}}};
      fused_holder_send(ctx, args, rank, channel, g.group, warp % g.warps, g.warps, epoch, &groups[g.group]);
    } else if (role == 1) {
      __shared__ ring::ReduceState<kMaxLocal> state;
      __shared__ ForwardTables tables;
      ring::init_reduce_state(&state);
      if (warp == 0) {
        if (channel == 0) fused_handshake(ctx0, common, me.check, rank, epoch, kNodeCombine);
        forward_tables(ctx0, args, rank, channel, epoch, &tables);
      }
      __syncthreads();
      const ForwardCombineSource src{&common, &args,   &me,  &tables, ctx0.buffer(rank), nvl_buffer(common, rank),
                                     rank,    channel, epoch};
      if (warp == 0) {
        ring::reduce_coordinator(ctx0, src, kNumWarps - 1, &state);
        forward_combine_finish(ctx0, src);
      } else {
        ring::reduce_worker<T>(ctx0, src, args.slot.x_bytes, warp - 1, kNumWarps - 1, &state);
      }
    } else {
      __shared__ CombineRecvState state;
      ring::init_reduce_state(&state);
      const SourceReduce src = source_reduce(ctx0, common, me.check, me.is_token_in_node, me.out, me.num_tokens,
                                             args.slot, rank, channel, epoch, true, warp == 0, false);
      if (warp == 0) {
        ring::reduce_coordinator(ctx0, src, kNumWarps - 1, &state);
      } else {
        ring::reduce_worker<T>(ctx0, src, args.slot.x_bytes, warp - 1, kNumWarps - 1, &state);
      }
    }
  });
}

void check_fused_slot(const SlotLayout& s, const Common& c, bool dispatch) {
  const SlotLayout want =
      intranode::make_slot_layout(s.x_bytes, dispatch ? s.scale_bytes : 0, dispatch ? s.num_topk : 0);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % intranode::kFieldAlign == 0 && want.slot_bytes == s.slot_bytes &&
                     (dispatch || (s.num_topk == 0 && s.scale_bytes == 0)),
                 "the " << (dispatch ? "dispatch" : "combine") << " slot layout is not make_slot_layout(" << s.x_bytes
                        << ", ...) with 16-byte rows");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes && s.slot_bytes <= c.nvl_layout.slot_bytes,
                 "a slot needs " << s.slot_bytes << " bytes but the RDMA slots hold " << c.layout.slot_bytes
                                 << " and the NVLink slots " << c.nvl_layout.slot_bytes);
}

}  // namespace

void launch_fused_notify(const FusedNotifyArgs& args, Mode mode, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  check_common(c, mode, true);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const FusedNotifyRank& r = args.ranks[i];
    const int rank = c.rank_begin + i;
    MOE_HOST_CHECK(r.num_tokens >= 0 && r.budget >= -1 && r.forward_capacity >= -1,
                   "rank " << rank << ": num_tokens >= 0, budget and forward_capacity >= -1 expected");
    MOE_HOST_CHECK(r.num_tokens == 0 || (r.is_token_in_rank != nullptr && r.is_token_in_node != nullptr),
                   "rank " << rank << ": is_token_in_rank and is_token_in_node must be device pointers");
    MOE_HOST_CHECK(r.recv_prefix != nullptr && r.forward_prefix != nullptr && r.counts != nullptr &&
                       r.overflow != nullptr && r.peer_ok != nullptr && r.relay_prefix != nullptr,
                   "rank " << rank
                           << ": recv_prefix, forward_prefix, counts, overflow, peer_ok and relay_prefix must be "
                              "device pointers");
  }
  const dim3 grid(static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    auto kernel = fused_notify_kernel<decltype(ctx)>;
    launch_resident("the internode fused notify", kernel, grid, dim3(kNotifyThreads), 0, stream, cooperative, args);
  });
}

void launch_fused_dispatch(const FusedDispatchArgs& args, Mode mode, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c, mode, true);
  check_fused_slot(s, c, true);
  MOE_HOST_CHECK(args.experts_per_rank >= 1 && args.experts_per_node == args.experts_per_rank * c.ranks_per_node,
                 "experts_per_node must be experts_per_rank x ranks_per_node, got " << args.experts_per_node << " and "
                                                                                    << args.experts_per_rank);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const FusedDispatchRank& r = args.ranks[i];
    const int rank = c.rank_begin + i;
    MOE_HOST_CHECK(r.num_tokens >= 0 && r.num_rows >= 0 && r.forward_capacity >= 0 && r.budget >= -1,
                   "rank " << rank << ": num_tokens, num_rows and forward_capacity >= 0 and budget >= -1 expected");
    MOE_HOST_CHECK(r.num_tokens == 0 ||
                       (r.x != nullptr && r.is_token_in_node != nullptr && (s.num_topk == 0 || r.topk_idx != nullptr)),
                   "rank " << rank << ": x, is_token_in_node and topk_idx must be device pointers");
    MOE_HOST_CHECK(s.scale_bytes == 0 || r.num_tokens == 0 || r.x_scales != nullptr,
                   "rank " << rank << ": fp8 dispatch needs x_scales");
    MOE_HOST_CHECK(r.recv_prefix != nullptr && r.forward_prefix != nullptr && r.relay_prefix != nullptr &&
                       r.forward_cut != nullptr && r.overflow != nullptr && r.num_recv_per_expert != nullptr &&
                       (r.forward_capacity == 0 || r.forward_mask != nullptr),
                   "rank " << rank
                           << ": recv_prefix, forward_prefix, relay_prefix, forward_mask, forward_cut, overflow and "
                              "num_recv_per_expert must be device pointers");
    MOE_HOST_CHECK(r.num_rows == 0 || (r.recv_x != nullptr && (s.num_topk == 0 || r.recv_topk_idx != nullptr) &&
                                       (s.scale_bytes == 0 || r.recv_scales != nullptr)),
                   "rank " << rank << ": recv_x, recv_topk_idx (and recv_scales for fp8) must be device pointers");
    MOE_HOST_CHECK(r.peer_ok == nullptr || s.num_topk > 0,
                   "rank " << rank << ": a fresh dispatch (peer_ok given) needs the top-k ids to travel");
  }
  const dim3 grid(static_cast<unsigned>(3 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_fused_variant(mode, c, [&](auto ctx, auto min_blocks) {
    using Ctx = decltype(ctx);
    auto kernel = fused_dispatch_kernel<Ctx, decltype(min_blocks)::value>;
    const size_t smem = prepare_dynamic_smem(kernel, intranode::bulk_smem_bytes<typename Ctx::Policy>());
    launch_resident("the internode fused dispatch", kernel, grid, dim3(kNumThreads), smem, stream, cooperative, args);
  });
}

void launch_fused_combine(const FusedCombineArgs& args, intranode::DType dtype, Mode mode, bool cooperative,
                          cudaStream_t stream) {
  const Common& c = args.common;
  check_common(c, mode, true);
  check_fused_slot(args.slot, c, false);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const FusedCombineRank& r = args.ranks[i];
    const int rank = c.rank_begin + i;
    MOE_HOST_CHECK(r.num_tokens >= 0 && r.num_rows >= 0 && r.forward_capacity >= 0 && r.budget >= -1,
                   "rank " << rank << ": num_tokens, num_rows and forward_capacity >= 0 and budget >= -1 expected");
    MOE_HOST_CHECK(r.recv_prefix != nullptr && r.forward_prefix != nullptr && r.relay_prefix != nullptr &&
                       r.forward_cut != nullptr && (r.forward_capacity == 0 || r.forward_mask != nullptr),
                   "rank " << rank
                           << ": recv_prefix, forward_prefix, relay_prefix, forward_mask and forward_cut must be "
                              "device pointers");
    MOE_HOST_CHECK(r.num_tokens == 0 || (r.out != nullptr && r.is_token_in_node != nullptr),
                   "rank " << rank << ": out and is_token_in_node must be device pointers");
    MOE_HOST_CHECK(r.num_rows == 0 || r.y != nullptr, "rank " << rank << ": y must be a device pointer");
  }
  const dim3 grid(static_cast<unsigned>(3 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_fused_variant(mode, c, [&](auto ctx, auto min_blocks) {
    using Ctx = decltype(ctx);
    intranode::with_dtype(dtype, [&](auto tag) {
      auto kernel = fused_combine_kernel<Ctx, decltype(tag), decltype(min_blocks)::value>;
      const size_t smem = prepare_dynamic_smem(kernel, intranode::bulk_smem_bytes<typename Ctx::Policy>());
      launch_resident("the internode fused combine", kernel, grid, dim3(kNumThreads), smem, stream, cooperative, args);
    });
  });
}

}  // namespace internode
}  // namespace moe_dispatch

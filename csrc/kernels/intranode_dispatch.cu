// Intranode notify + dispatch kernels and their host launchers. The per-warp protocol lives in
// intranode_roles.cuh (shared with the CPU harness); this file maps warps to roles.
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/launch.h"
#include "kernels/intranode.h"
#include "kernels/intranode_device.cuh"

namespace moe_dispatch {
namespace intranode {
namespace {

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const __grid_constant__ NotifyArgs args) {
  const int rank = args.common.rank_begin + static_cast<int>(blockIdx.x);
  if (rank == args.common.skip_rank) return;
  __shared__ NotifyState state;
  __shared__ uint64_t epoch;
  DeviceCtx ctx{&args.common, 0, 0};
  // Notify reads the op epoch (its header lines' parity); the dispatch kernel after it advances it.
  notify(ctx, args, rank, op_epoch_begin(args.common.layout.epoch(args.common.buffers[rank]), &epoch), &state);
}

// blockIdx = (2 * channel + is_receiver, launched rank). Warps form W groups of
// kNumWarps / W warps; group g serves peer g (destination when sending, source when receiving).
// P: the copy policy, kMinBlocks: 2 = the register cap of the current kernels (variant.cuh).
template <class P, int kMinBlocks>
__global__ void __launch_bounds__(kNumThreads, kMinBlocks) dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  const Common& common = args.common;
  launched_rank_block<P>(common, [&](int rank, uint64_t epoch) {
    const int channel = static_cast<int>(blockIdx.x) / 2;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int group_warps = kNumWarps / common.num_ranks;
    const int peer = warp / group_warps;
    __shared__ GroupState groups[kMaxRanks];
    if (peer < common.num_ranks) {  // W does not divide the warps: the rest idle
      DeviceCtxT<Common, P> ctx{&common, peer + 1, group_warps * 32};
      if (blockIdx.x % 2 == 0) {
        dispatch_send(ctx, args, rank, channel, peer, warp % group_warps, group_warps, epoch, &groups[peer]);
      } else {
        dispatch_recv(ctx, args, rank, channel, peer, warp % group_warps, group_warps, epoch, &groups[peer]);
      }
    }
  });
}

}  // namespace

static void check_counts(int rank, int num_tokens, int num_rows) {
  MOE_HOST_CHECK(num_tokens >= 0 && num_rows >= 0,
                 "rank " << rank << ": num_tokens and num_rows must be >= 0, got " << num_tokens << ", " << num_rows);
}

void check_dispatch_ranks(const SlotLayout& s, const DispatchRank* ranks, int count, int rank_begin, const char* mask) {
  for (int i = 0; i < count; ++i) {
    const DispatchRank& r = ranks[i];
    const int rank = rank_begin + i;
    check_counts(rank, r.num_tokens, r.num_rows);
    MOE_HOST_CHECK(r.num_tokens == 0 ||
                       (r.x != nullptr && r.is_token_in_rank != nullptr && (s.num_topk == 0 || r.topk_idx != nullptr)),
                   "rank " << rank << ": x, " << mask << " and topk_idx must be device pointers");
    MOE_HOST_CHECK(s.scale_bytes == 0 || r.num_tokens == 0 || r.x_scales != nullptr,
                   "rank " << rank << ": fp8 dispatch needs x_scales");
    MOE_HOST_CHECK(r.recv_prefix != nullptr && r.overflow != nullptr && r.num_recv_per_expert != nullptr,
                   "rank " << rank << ": recv_prefix, overflow and num_recv_per_expert must be device pointers");
    MOE_HOST_CHECK(r.num_rows == 0 || (r.recv_x != nullptr && (s.num_topk == 0 || r.recv_topk_idx != nullptr) &&
                                       (s.scale_bytes == 0 || r.recv_scales != nullptr)),
                   "rank " << rank << ": recv_x, recv_topk_idx (and recv_scales for fp8) must be device pointers");
  }
}

void check_combine_ranks(const CombineRank* ranks, int count, int rank_begin, const char* mask, const char* y) {
  for (int i = 0; i < count; ++i) {
    const CombineRank& r = ranks[i];
    const int rank = rank_begin + i;
    check_counts(rank, r.num_tokens, r.num_rows);
    MOE_HOST_CHECK(r.recv_prefix != nullptr, "rank " << rank << ": recv_prefix must be a device pointer");
    MOE_HOST_CHECK(r.num_tokens == 0 || (r.out != nullptr && r.is_token_in_rank != nullptr),
                   "rank " << rank << ": out and " << mask << " must be device pointers");
    MOE_HOST_CHECK(r.num_rows == 0 || r.y != nullptr, "rank " << rank << ": " << y << " must be a device pointer");
  }
}

void check_common(const Common& c) {
  const BufferLayout& l = c.layout;
  MOE_HOST_CHECK(c.num_ranks >= 1 && c.num_ranks <= kMaxRanks,
                 "num_ranks must be in [1, " << kMaxRanks << "] for the intranode kernels, got " << c.num_ranks);
  MOE_HOST_CHECK(l.num_ranks == c.num_ranks,
                 "the buffer is laid out for " << l.num_ranks << " ranks but the call has " << c.num_ranks);
  MOE_HOST_CHECK(l.num_channels >= 1 && l.num_channels <= kMaxChannels,
                 "the buffer's num_channels must be in [1, " << kMaxChannels << "], got " << l.num_channels);
  MOE_HOST_CHECK(
      c.num_channels >= 1 && c.num_channels <= l.num_channels,
      "num_channels (num_sms / 2) must be in [1, " << l.num_channels << "] (the buffer's), got " << c.num_channels);
  MOE_HOST_CHECK(c.num_launch_ranks >= 1 && c.rank_begin >= 0 && c.rank_begin + c.num_launch_ranks <= c.num_ranks,
                 "launched ranks [" << c.rank_begin << ", " << c.rank_begin + c.num_launch_ranks << ") must lie in [0, "
                                    << c.num_ranks << ")");
  MOE_HOST_CHECK(l.num_slots >= 1 && c.chunk_tokens >= 1 && c.chunk_tokens <= l.num_slots,
                 "chunk_tokens must be in [1, num_slots=" << l.num_slots << "], got " << c.chunk_tokens);
  MOE_HOST_CHECK(l.slot_bytes > 0 && l.slot_bytes % kFieldAlign == 0,
                 "slot_bytes must be a positive multiple of " << kFieldAlign << ", got " << l.slot_bytes);
  MOE_HOST_CHECK(c.timeout_cycles > 0, "timeout_cycles must be > 0, got " << c.timeout_cycles);
  check_variant(c.variant);
  MOE_HOST_CHECK(c.error != nullptr, "the error record must be a device pointer");
  for (int r = 0; r < c.num_ranks; ++r)
    MOE_HOST_CHECK(c.buffers[r] != nullptr, "the buffer of rank " << r << " is null");
}

void launch_notify(const NotifyArgs& args, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  check_common(c);
  MOE_HOST_CHECK(args.num_topk >= 0 && args.num_topk <= kMaxTopk,
                 "num_topk must be in [0, " << kMaxTopk << "], got " << args.num_topk);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const NotifyRank& r = args.ranks[i];
    MOE_HOST_CHECK(r.num_tokens >= 0, "rank " << c.rank_begin + i << ": num_tokens must be >= 0, got " << r.num_tokens);
    MOE_HOST_CHECK(r.num_tokens == 0 || r.is_token_in_rank != nullptr,
                   "rank " << c.rank_begin + i << ": is_token_in_rank is null");
    MOE_HOST_CHECK(
        r.recv_prefix != nullptr && r.num_recv_tokens != nullptr && r.overflow != nullptr,
        "rank " << c.rank_begin + i << ": recv_prefix, num_recv_tokens and overflow must be device pointers");
    MOE_HOST_CHECK(r.budget >= -1,
                   "rank " << c.rank_begin + i << ": budget must be >= 0, or -1 for none, got " << r.budget);
    MOE_HOST_CHECK(r.peer_ok != nullptr, "rank " << c.rank_begin + i << ": peer_ok must be a device pointer");
  }
  const dim3 grid(static_cast<unsigned>(c.num_launch_ranks));
  launch_resident("the intranode notify", notify_kernel, grid, dim3(kNotifyThreads), 0, stream, cooperative, args);
}

void launch_dispatch(const DispatchArgs& args, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % kFieldAlign == 0,
                 "x rows must be a positive multiple of " << kFieldAlign << " bytes, got " << s.x_bytes);
  MOE_HOST_CHECK(s.scale_bytes >= 0 && s.scale_bytes % 4 == 0,
                 "scale rows must be a multiple of 4 bytes, got " << s.scale_bytes);
  MOE_HOST_CHECK(s.num_topk >= 0 && s.num_topk <= kMaxTopk,
                 "num_topk must be in [0, " << kMaxTopk << "], got " << s.num_topk);
  const SlotLayout want = make_slot_layout(s.x_bytes, s.scale_bytes, s.num_topk);
  MOE_HOST_CHECK(
      want.slot_bytes == s.slot_bytes && want.aux_offset == s.aux_offset,
      "the slot layout is not make_slot_layout(" << s.x_bytes << ", " << s.scale_bytes << ", " << s.num_topk << ")");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes,
                 "a dispatch slot needs " << s.slot_bytes << " bytes but the buffer's slots hold "
                                          << c.layout.slot_bytes << "; make the Buffer for this hidden size");
  MOE_HOST_CHECK(args.experts_per_rank >= 1, "experts_per_rank must be >= 1, got " << args.experts_per_rank);
  check_dispatch_ranks(s, args.ranks, c.num_launch_ranks, c.rank_begin, "is_token_in_rank");
  const dim3 grid(static_cast<unsigned>(2 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_intranode_variant(c.variant, [&](auto policy, auto min_blocks) {
    auto kernel = dispatch_kernel<decltype(policy), decltype(min_blocks)::value>;
    const size_t smem = prepare_dynamic_smem(kernel, bulk_smem_bytes<decltype(policy)>());
    launch_resident("the intranode dispatch", kernel, grid, dim3(kNumThreads), smem, stream, cooperative, args);
  });
}

}  // namespace intranode
}  // namespace moe_dispatch

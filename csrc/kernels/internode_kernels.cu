// Stage-1 (RDMA) kernels of the staged internode pipeline and their host launchers, plus the
// checks every internode launch shares (internode.h). The per-warp protocol lives in
// internode_roles.cuh, shared with the CPU backend; the contexts in internode_device.cuh; this
// file maps warps to roles.
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/launch.h"
#include "kernels/internode_device.cuh"
#include "kernels/internode_roles.cuh"
#include "kernels/intranode.h"

namespace moe_dispatch {
namespace internode {
namespace {

template <class Ctx>
__global__ void __launch_bounds__(kNotifyThreads, 1) node_notify_kernel(const __grid_constant__ NotifyArgs args) {
  __shared__ NotifyState state;
  notify_block<Ctx>(args.common, [&](Ctx& ctx, int rank) { node_notify(ctx, args, rank, &state); });
}

// blockIdx = (2 * channel + is_receiver, launched rank). min(N, 16) warp groups; group g serves
// nodes g, g + groups, ...
template <class Ctx>
__global__ void __launch_bounds__(kNumThreads, 2) node_dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  rank_block<Ctx>(args.common, [&](Ctx&, int rank, uint64_t epoch) {
    const Common& common = args.common;
    const int channel = static_cast<int>(blockIdx.x) / 2;
    const Groups g = groups_of(common.num_nodes);
    __shared__ GroupState groups[kNumWarps];
    if (g.group >= g.count) return;
    const int warp = static_cast<int>(threadIdx.x) / 32 % g.warps;
    Ctx ctx{{{&common, g.group + 1, g.warps * 32}}};
    for (int node = g.group; node < common.num_nodes; node += g.count) {
      if (blockIdx.x % 2 == 0) {
        node_dispatch_send(ctx, args, rank, channel, node, warp, g.warps, epoch, &groups[g.group]);
      } else {
        node_dispatch_recv(ctx, args, rank, channel, node, warp, g.warps, epoch, &groups[g.group]);
      }
    }
  });
}

// Senders: warp groups over nodes; receivers: warp 0 coordinates, the others reduce.
template <class Ctx, class T>
__global__ void __launch_bounds__(kNumThreads, 2) node_combine_kernel(const __grid_constant__ CombineArgs args) {
  rank_block<Ctx>(args.common, [&](Ctx& ctx0, int rank, uint64_t epoch) {
    const Common& common = args.common;
    const int channel = static_cast<int>(blockIdx.x) / 2;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if (blockIdx.x % 2 == 0) {
      const Groups g = groups_of(common.num_nodes);
      __shared__ GroupState groups[kNumWarps];
      if (g.group >= g.count) return;
      Ctx ctx{{{&common, g.group + 1, g.warps * 32}}};
      for (int node = g.group; node < common.num_nodes; node += g.count)
        node_combine_send(ctx, args, rank, channel, node, warp % g.warps, g.warps, epoch, &groups[g.group]);
      return;
    }
    __shared__ CombineRecvState state;
    ring::init_reduce_state(&state);
    const CombineRank& me = args.ranks[rank - common.rank_begin];
    const SourceReduce src =
        source_reduce(ctx0, common, me.check, me.is_token_in_rank, me.out, me.num_tokens, args.slot, rank, channel,
                      epoch, false, warp == 0, warp == 0 && channel == 0);
    if (warp == 0) {
      ring::reduce_coordinator(ctx0, src, kNumWarps - 1, &state);
    } else {
      ring::reduce_worker<T>(ctx0, src, args.slot.x_bytes, warp - 1, kNumWarps - 1, &state);
    }
  });
}

}  // namespace

bool nvshmem_compiled() {
#ifdef MOE_DISPATCH_WITH_NVSHMEM
  return true;
#else
  return false;
#endif
}

void check_common(const Common& c, Mode mode, bool fused) {
  const RdmaLayout& l = c.layout;
  MOE_HOST_CHECK(c.num_nodes >= 1 && c.num_nodes <= kMaxNodes,
                 "num_nodes must be in [1, " << kMaxNodes << "], got " << c.num_nodes);
  MOE_HOST_CHECK(c.ranks_per_node >= 1, "ranks_per_node must be >= 1, got " << c.ranks_per_node);
  MOE_HOST_CHECK(l.num_nodes == c.num_nodes,
                 "the RDMA buffer is laid out for " << l.num_nodes << " nodes but the call has " << c.num_nodes);
  MOE_HOST_CHECK(l.num_channels >= 1 && l.num_channels <= kMaxChannels,
                 "the RDMA buffer's num_channels must be in [1, " << kMaxChannels << "], got " << l.num_channels);
  MOE_HOST_CHECK(
      c.num_channels >= 1 && c.num_channels <= l.num_channels,
      "num_channels (num_sms / 2) must be in [1, " << l.num_channels << "] (the buffer's), got " << c.num_channels);
  MOE_HOST_CHECK(fused || c.num_nodes * c.num_channels <= kNotifyThreads,
                 "num_nodes x num_channels must be <= " << kNotifyThreads << " (one notify thread per queue), got "
                                                        << c.num_nodes << " x " << c.num_channels << "; lower num_sms");
  MOE_HOST_CHECK(l.ranks_per_node == c.ranks_per_node, "the RDMA buffer is laid out for "
                                                           << l.ranks_per_node << " ranks per node but the call has "
                                                           << c.ranks_per_node);
  const int world = c.num_nodes * c.ranks_per_node;
  MOE_HOST_CHECK(c.num_launch_ranks >= 1 && c.num_launch_ranks <= kMaxLaunchRanks && c.rank_begin >= 0 &&
                     c.rank_begin + c.num_launch_ranks <= world,
                 "launched ranks [" << c.rank_begin << ", " << c.rank_begin + c.num_launch_ranks << ") must lie in [0, "
                                    << world << ") and number at most " << kMaxLaunchRanks);
  MOE_HOST_CHECK(l.num_slots >= 1 && c.chunk_tokens >= 1 && l.num_slots % c.chunk_tokens == 0,
                 "chunk_tokens must divide num_slots=" << l.num_slots << " (a chunk is one contiguous put), got "
                                                       << c.chunk_tokens);
  MOE_HOST_CHECK(l.slot_bytes > 0 && l.slot_bytes % intranode::kFieldAlign == 0,
                 "slot_bytes must be a positive multiple of " << intranode::kFieldAlign << ", got " << l.slot_bytes);
  MOE_HOST_CHECK(c.timeout_cycles > 0, "timeout_cycles must be > 0, got " << c.timeout_cycles);
  MOE_HOST_CHECK(c.error != nullptr, "the error record must be a device pointer");
  check_variant(c.variant);
  if (mode == kNvshmem) {
    MOE_HOST_CHECK(c.symmetric != nullptr, "NVSHMEM mode needs the symmetric buffer (common['symmetric'])");
  } else {
    MOE_HOST_CHECK(c.symmetric == nullptr, "loopback mode takes common['buffers'], not a symmetric buffer");
    MOE_HOST_CHECK(world <= kMaxLaunchRanks, "loopback serves at most " << kMaxLaunchRanks << " ranks, got "
                                                                        << c.num_nodes << " x " << c.ranks_per_node);
    for (int r = 0; r < world; ++r) MOE_HOST_CHECK(c.buffers[r] != nullptr, "the buffer of rank " << r << " is null");
  }
  if (!fused) return;
  const intranode::BufferLayout& nl = c.nvl_layout;
  MOE_HOST_CHECK(c.ranks_per_node <= kMaxLocal,
                 "the fused pipeline serves at most " << kMaxLocal << " ranks per node, got " << c.ranks_per_node);
  MOE_HOST_CHECK(nl.num_ranks == c.ranks_per_node && nl.relay_nodes == c.num_nodes && nl.num_channels >= c.num_channels,
                 "the NVLink buffers are laid out for " << nl.num_ranks << " ranks, " << nl.relay_nodes << " nodes and "
                                                        << nl.num_channels << " channels; the call has "
                                                        << c.ranks_per_node << ", " << c.num_nodes << " and "
                                                        << c.num_channels);
  MOE_HOST_CHECK(c.chunk_tokens <= nl.num_slots,
                 "chunk_tokens must be <= the NVLink rings' num_slots=" << nl.num_slots);
  // The NVLink buffers of every node with a launched rank.
  const int L = c.ranks_per_node;
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const int node = (c.rank_begin + i) / L;
    for (int r = node * L; r < (node + 1) * L; ++r)
      MOE_HOST_CHECK(r - c.nvl_first_rank >= 0 && r - c.nvl_first_rank < kMaxLaunchRanks &&
                         c.nvl_buffers[r - c.nvl_first_rank] != nullptr,
                     "the NVLink buffer of rank " << r << " is missing (nvl_first_rank " << c.nvl_first_rank << ")");
  }
}

void launch_node_notify(const NotifyArgs& args, Mode mode, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  check_common(c, mode, false);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const NotifyRank& r = args.ranks[i];
    MOE_HOST_CHECK(r.num_tokens >= 0, "rank " << c.rank_begin + i << ": num_tokens must be >= 0, got " << r.num_tokens);
    MOE_HOST_CHECK(r.num_tokens == 0 || r.is_token_in_rank != nullptr,
                   "rank " << c.rank_begin + i << ": is_token_in_node is null");
    MOE_HOST_CHECK(
        r.recv_prefix != nullptr && r.num_recv_tokens != nullptr && r.overflow != nullptr && r.peer_ok != nullptr,
        "rank " << c.rank_begin + i
                << ": recv_prefix, num_recv_tokens, overflow and peer_ok must be device "
                   "pointers");
  }
  const dim3 grid(static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    auto kernel = node_notify_kernel<decltype(ctx)>;
    launch_resident("the internode node notify", kernel, grid, dim3(kNotifyThreads), 0, stream, cooperative, args);
  });
}

void launch_node_dispatch(const DispatchArgs& args, Mode mode, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c, mode, false);
  const SlotLayout want = intranode::make_slot_layout(s.x_bytes, s.scale_bytes, s.num_topk);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % intranode::kFieldAlign == 0 && want.slot_bytes == s.slot_bytes,
                 "the dispatch slot layout is not make_slot_layout(" << s.x_bytes << ", " << s.scale_bytes << ", "
                                                                     << s.num_topk << ") with 16-byte rows");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes,
                 "a dispatch slot needs " << s.slot_bytes << " bytes but the RDMA slots hold " << c.layout.slot_bytes);
  MOE_HOST_CHECK(args.experts_per_node >= 1, "experts_per_node must be >= 1, got " << args.experts_per_node);
  intranode::check_dispatch_ranks(s, args.ranks, c.num_launch_ranks, c.rank_begin, "is_token_in_node");
  const dim3 grid(static_cast<unsigned>(2 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    auto kernel = node_dispatch_kernel<decltype(ctx)>;
    launch_resident("the internode node dispatch", kernel, grid, dim3(kNumThreads), 0, stream, cooperative, args);
  });
}

void launch_node_combine(const CombineArgs& args, intranode::DType dtype, Mode mode, bool cooperative,
                         cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c, mode, false);
  const SlotLayout want = intranode::make_slot_layout(s.x_bytes, 0, 0);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % intranode::kFieldAlign == 0 && want.slot_bytes == s.slot_bytes &&
                     s.num_topk == 0 && s.scale_bytes == 0,
                 "the combine slot layout is not make_slot_layout(" << s.x_bytes << ", 0, 0) with 16-byte rows");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes,
                 "a combine slot needs " << s.slot_bytes << " bytes but the RDMA slots hold " << c.layout.slot_bytes);
  intranode::check_combine_ranks(args.ranks, c.num_launch_ranks, c.rank_begin, "is_token_in_node",
                                 "y (the node partials)");
  const dim3 grid(static_cast<unsigned>(2 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    intranode::with_dtype(dtype, [&](auto tag) {
      auto kernel = node_combine_kernel<decltype(ctx), decltype(tag)>;
      launch_resident("the internode node combine", kernel, grid, dim3(kNumThreads), 0, stream, cooperative, args);
    });
  });
}

}  // namespace internode
}  // namespace moe_dispatch

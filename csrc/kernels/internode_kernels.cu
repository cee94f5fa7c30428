// Stage-1 (RDMA) kernels of the internode protocol and their host launchers, in two modes:
// loopback (every rank's buffer in this process: a put is a warp copy into the peer's buffer
// plus a release store of the signal; one GPU checks the protocol) and NVSHMEM (a put is
// nvshmemx_putmem_signal_nbi_warp to the PE of the same local index). The per-warp protocol
// lives in internode_roles.cuh, shared with the CPU backend; this file maps warps to roles.
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/launch.h"
#include "kernels/internode.h"
#include "kernels/internode_roles.cuh"
#include "kernels/intranode_device.cuh"

#ifdef MOE_DISPATCH_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace moe_dispatch {
namespace internode {
namespace {

using intranode::DeviceCtxT;
using intranode::WaitSite;

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// What both modes share: local words, warp-level waits.
struct RdmaCtxBase : DeviceCtxT<Common> {
  __device__ uint64_t load_local(const uint64_t* p) const { return *reinterpret_cast<const volatile uint64_t*>(p); }
  __device__ void store_local(uint64_t* p, uint64_t v) const { *reinterpret_cast<volatile uint64_t*>(p) = v; }
};

struct LoopbackCtx : RdmaCtxBase {
  __device__ char* buffer(int rank) const { return common->buffers[rank]; }
  template <class P>
  __device__ P* at_peer(int rank, int peer, P* p) const {
    return reinterpret_cast<P*>(common->buffers[peer] + (reinterpret_cast<char*>(p) - common->buffers[rank]));
  }
  __device__ int64_t wait_signal_lane(const uint64_t* sig, int64_t target, const WaitSite& site) const {
    return bounded_wait([sig]() { return static_cast<int64_t>(ld_acquire_sys_u64(sig)); }, target, site);
  }
  __device__ int64_t wait_signal(const uint64_t* sig, int64_t target, const WaitSite& site) const {
    int64_t v = 0;
    if (lane() == 0) v = wait_signal_lane(sig, target, site);
    return __shfl_sync(0xffffffffu, v, 0);
  }
  // The staging slots were written in this kernel: read them at L2 (copy_out), not via .nc.
  __device__ void put_signal(int rank, int peer, char* dst, const char* src, int64_t bytes, uint64_t* sig,
                             uint64_t value) const {
    copy_out(at_peer(rank, peer, dst), src, static_cast<int>(bytes));
    __syncwarp();
    if (lane() == 0) st_release_sys_u64(at_peer(rank, peer, sig), value);
    __syncwarp();
  }
  __device__ void put_signal_lane(int rank, int peer, char* dst, const char* src, int64_t bytes, uint64_t* sig,
                                  uint64_t value) const {
    int32_t* d = at_peer(rank, peer, reinterpret_cast<int32_t*>(dst));
    const int32_t* s = reinterpret_cast<const int32_t*>(src);
    for (int64_t i = 0; i < bytes / 4; ++i) d[i] = intranode::ld_queue_i32(s + i);
    st_release_sys_u64(at_peer(rank, peer, sig), value);
  }
  __device__ void signal_set(int rank, int peer, uint64_t* sig, uint64_t value) const {
    st_release_sys_u64(at_peer(rank, peer, sig), value);
  }
  __device__ void reset_signal(uint64_t* sig) const { st_relaxed_sys_u64(sig, 0); }
};

#ifdef MOE_DISPATCH_WITH_NVSHMEM
struct NvshmemCtx : RdmaCtxBase {
  __device__ char* buffer(int) const { return common->symmetric; }
  // Bounded polling of the signal word, then NVSHMEM's own wait (already satisfied, returns at
  // once) for the memory-consistency step its transports need after a signal.
  __device__ int64_t wait_signal_lane(uint64_t* sig, int64_t target, const WaitSite& site) const {
    const int64_t v = bounded_wait([sig]() { return static_cast<int64_t>(nvshmem_signal_fetch(sig)); }, target, site);
    if (v >= 0) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, static_cast<uint64_t>(target));
    return v;
  }
  __device__ int64_t wait_signal(uint64_t* sig, int64_t target, const WaitSite& site) const {
    int64_t v = 0;
    if (lane() == 0) v = wait_signal_lane(sig, target, site);
    return __shfl_sync(0xffffffffu, v, 0);
  }
  // The group's staging stores must be visible to the NIC before it reads them.
  __device__ void put_signal(int, int peer, char* dst, const char* src, int64_t bytes, uint64_t* sig,
                             uint64_t value) const {
    __threadfence_system();
    __syncwarp();
    nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(bytes), sig, value, NVSHMEM_SIGNAL_SET, peer);
  }
  __device__ void put_signal_lane(int, int peer, char* dst, const char* src, int64_t bytes, uint64_t* sig,
                                  uint64_t value) const {
    __threadfence_system();
    nvshmem_putmem_signal(dst, src, static_cast<size_t>(bytes), sig, value, NVSHMEM_SIGNAL_SET, peer);
  }
  __device__ void signal_set(int, int peer, uint64_t* sig, uint64_t value) const {
    __threadfence_system();
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, peer);
  }
  // A local store (the ring is idle: no remote write can be in flight), fenced so that it lands
  // before the signal that lets the peer write again.
  __device__ void reset_signal(uint64_t* sig) const {
    st_relaxed_sys_u64(sig, 0);
    __threadfence_system();
  }
};
#endif

template <class Ctx>
__global__ void __launch_bounds__(kNotifyThreads, 1) node_notify_kernel(const __grid_constant__ NotifyArgs args) {
  const int rank = args.common.rank_begin + static_cast<int>(blockIdx.x);
  if (rank == args.common.skip_rank) return;
  __shared__ NotifyState state;
  Ctx ctx{{{&args.common, 0, 0}}};
  node_notify(ctx, args, rank, &state);
}

// Sender/receiver blocks: min(N, 16) warp groups; group g serves nodes g, g + groups, ...
struct Groups {
  int count, warps, group;
};

__device__ __forceinline__ Groups groups_of(const Common& c) {
  const int count = c.num_nodes < kNumWarps ? c.num_nodes : kNumWarps;
  const int warps = kNumWarps / count;
  return {count, warps, static_cast<int>(threadIdx.x) / 32 / warps};
}

// blockIdx = (2 * channel + is_receiver, launched rank).
template <class Ctx>
__global__ void __launch_bounds__(kNumThreads, 2) node_dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  const Common& common = args.common;
  const int rank = common.rank_begin + static_cast<int>(blockIdx.y);
  if (rank == common.skip_rank) return;
  const int channel = static_cast<int>(blockIdx.x) / 2;
  const Groups g = groups_of(common);
  if (g.group >= g.count) return;
  const int warp = static_cast<int>(threadIdx.x) / 32 % g.warps;
  __shared__ GroupState groups[kNumWarps];
  Ctx ctx{{{&common, g.group + 1, g.warps * 32}}};
  for (int node = g.group; node < common.num_nodes; node += g.count) {
    if (blockIdx.x % 2 == 0) {
      node_dispatch_send(ctx, args, rank, channel, node, warp, g.warps, &groups[g.group]);
    } else {
      node_dispatch_recv(ctx, args, rank, channel, node, warp, g.warps, &groups[g.group]);
    }
  }
}

// Senders: warp groups over nodes; receivers: warp 0 coordinates, the others reduce.
template <class Ctx, class T>
__global__ void __launch_bounds__(kNumThreads, 2) node_combine_kernel(const __grid_constant__ CombineArgs args) {
  const Common& common = args.common;
  const int rank = common.rank_begin + static_cast<int>(blockIdx.y);
  if (rank == common.skip_rank) return;
  const int channel = static_cast<int>(blockIdx.x) / 2;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (blockIdx.x % 2 == 0) {
    const Groups g = groups_of(common);
    if (g.group >= g.count) return;
    __shared__ GroupState groups[kNumWarps];
    Ctx ctx{{{&common, g.group + 1, g.warps * 32}}};
    for (int node = g.group; node < common.num_nodes; node += g.count)
      node_combine_send(ctx, args, rank, channel, node, warp % g.warps, g.warps, &groups[g.group]);
    return;
  }
  __shared__ CombineRecvState state;
  for (int i = threadIdx.x; i < kNumWarps * kMaxNodes; i += blockDim.x) {
    (&state.progress[0][0])[i] = 0;
    (&state.seen_tail[0][0])[i] = 0;
  }
  if (threadIdx.x == 0) state.done = 0;
  __syncthreads();
  Ctx ctx{{{&common, 0, 32}}};
  if (warp == 0) {
    node_combine_recv_coordinator(ctx, args, rank, channel, kNumWarps - 1, &state);
  } else {
    node_combine_recv_worker<T>(ctx, args, rank, channel, warp - 1, kNumWarps - 1, &state);
  }
}

void check_resident(int resident, dim3 grid, const char* what) {
  const long long blocks = static_cast<long long>(grid.x) * grid.y;
  MOE_HOST_CHECK(blocks <= resident, "the internode " << what << " launch needs all of its " << blocks << " blocks ("
                                                      << grid.x << " per rank x " << grid.y
                                                      << " ranks) resident at once, but this GPU holds " << resident
                                                      << "; lower num_sms (or the number of simulated ranks)");
}

// Runs fn(kernel-for-Ctx) with the context of `mode`.
template <class Fn>
void with_mode(Mode mode, Fn fn) {
  if (mode == kLoopback) {
    fn(LoopbackCtx{});
    return;
  }
#ifdef MOE_DISPATCH_WITH_NVSHMEM
  fn(NvshmemCtx{});
#else
  MOE_HOST_CHECK(false, "NVSHMEM mode needs the extension built with NVSHMEM (this one was built without)");
#endif
}

}  // namespace

bool nvshmem_compiled() {
#ifdef MOE_DISPATCH_WITH_NVSHMEM
  return true;
#else
  return false;
#endif
}

void check_common(const Common& c, Mode mode) {
  const RdmaLayout& l = c.layout;
  MOE_HOST_CHECK(c.num_nodes >= 1 && c.num_nodes <= kMaxNodes,
                 "num_nodes must be in [1, " << kMaxNodes << "], got " << c.num_nodes);
  MOE_HOST_CHECK(c.ranks_per_node >= 1, "ranks_per_node must be >= 1, got " << c.ranks_per_node);
  MOE_HOST_CHECK(l.num_nodes == c.num_nodes,
                 "the RDMA buffer is laid out for " << l.num_nodes << " nodes but the call has " << c.num_nodes);
  MOE_HOST_CHECK(l.num_channels >= 1 && l.num_channels <= kMaxChannels,
                 "the RDMA buffer's num_channels must be in [1, " << kMaxChannels << "], got " << l.num_channels);
  MOE_HOST_CHECK(c.num_channels >= 1 && c.num_channels <= l.num_channels,
                 "num_channels (num_sms / 2) must be in [1, " << l.num_channels << "] (the buffer's), got "
                                                               << c.num_channels);
  MOE_HOST_CHECK(c.num_nodes * c.num_channels <= kNotifyThreads,
                 "num_nodes x num_channels must be <= " << kNotifyThreads << " (one notify thread per queue), got "
                                                        << c.num_nodes << " x " << c.num_channels << "; lower num_sms");
  const int world = c.num_nodes * c.ranks_per_node;
  MOE_HOST_CHECK(c.num_launch_ranks >= 1 && c.num_launch_ranks <= kMaxLaunchRanks && c.rank_begin >= 0 &&
                     c.rank_begin + c.num_launch_ranks <= world,
                 "launched ranks [" << c.rank_begin << ", " << c.rank_begin + c.num_launch_ranks << ") must lie in [0, "
                                    << world << ") and number at most " << kMaxLaunchRanks);
  MOE_HOST_CHECK(l.num_slots >= 1 && c.chunk_tokens >= 1 && l.num_slots % c.chunk_tokens == 0,
                 "chunk_tokens must divide num_slots=" << l.num_slots
                                                       << " (a chunk is one contiguous put), got " << c.chunk_tokens);
  MOE_HOST_CHECK(l.slot_bytes > 0 && l.slot_bytes % intranode::kFieldAlign == 0,
                 "slot_bytes must be a positive multiple of " << intranode::kFieldAlign << ", got " << l.slot_bytes);
  MOE_HOST_CHECK(c.timeout_cycles > 0, "timeout_cycles must be > 0, got " << c.timeout_cycles);
  MOE_HOST_CHECK(c.error != nullptr, "the error record must be a device pointer");
  if (mode == kNvshmem) {
    MOE_HOST_CHECK(c.symmetric != nullptr, "NVSHMEM mode needs the symmetric buffer (common['symmetric'])");
  } else {
    MOE_HOST_CHECK(c.symmetric == nullptr, "loopback mode takes common['buffers'], not a symmetric buffer");
    MOE_HOST_CHECK(world <= kMaxLaunchRanks, "loopback serves at most " << kMaxLaunchRanks << " ranks, got "
                                                                        << c.num_nodes << " x " << c.ranks_per_node);
    for (int r = 0; r < world; ++r) MOE_HOST_CHECK(c.buffers[r] != nullptr, "the buffer of rank " << r << " is null");
  }
}

void launch_node_notify(const NotifyArgs& args, Mode mode, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  check_common(c, mode);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const NotifyRank& r = args.ranks[i];
    MOE_HOST_CHECK(r.num_tokens >= 0, "rank " << c.rank_begin + i << ": num_tokens must be >= 0, got " << r.num_tokens);
    MOE_HOST_CHECK(r.num_tokens == 0 || r.is_token_in_rank != nullptr,
                   "rank " << c.rank_begin + i << ": is_token_in_node is null");
    MOE_HOST_CHECK(r.recv_prefix != nullptr && r.num_recv_tokens != nullptr && r.overflow != nullptr,
                   "rank " << c.rank_begin + i << ": recv_prefix, num_recv_tokens and overflow must be device pointers");
  }
  const dim3 grid(static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    auto kernel = node_notify_kernel<decltype(ctx)>;
    check_resident(max_resident_blocks(kernel, kNotifyThreads), grid, "node notify");
    launch_kernel(kernel, grid, dim3(kNotifyThreads), 0, stream, cooperative, args);
  });
}

void launch_node_dispatch(const DispatchArgs& args, Mode mode, bool cooperative, cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c, mode);
  const SlotLayout want = intranode::make_slot_layout(s.x_bytes, s.scale_bytes, s.num_topk);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % intranode::kFieldAlign == 0 && want.slot_bytes == s.slot_bytes,
                 "the dispatch slot layout is not make_slot_layout(" << s.x_bytes << ", " << s.scale_bytes << ", "
                                                                     << s.num_topk << ") with 16-byte rows");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes, "a dispatch slot needs " << s.slot_bytes
                                                                               << " bytes but the RDMA slots hold "
                                                                               << c.layout.slot_bytes);
  MOE_HOST_CHECK(args.experts_per_node >= 1, "experts_per_node must be >= 1, got " << args.experts_per_node);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const DispatchRank& r = args.ranks[i];
    const int rank = c.rank_begin + i;
    MOE_HOST_CHECK(r.num_tokens >= 0 && r.num_rows >= 0, "rank " << rank << ": num_tokens and num_rows must be >= 0");
    MOE_HOST_CHECK(r.num_tokens == 0 || (r.x != nullptr && r.is_token_in_rank != nullptr &&
                                         (s.num_topk == 0 || r.topk_idx != nullptr)),
                   "rank " << rank << ": x, is_token_in_node and topk_idx must be device pointers");
    MOE_HOST_CHECK(s.scale_bytes == 0 || r.num_tokens == 0 || r.x_scales != nullptr,
                   "rank " << rank << ": fp8 dispatch needs x_scales");
    MOE_HOST_CHECK(r.recv_prefix != nullptr && r.overflow != nullptr && r.num_recv_per_expert != nullptr,
                   "rank " << rank << ": recv_prefix, overflow and num_recv_per_expert must be device pointers");
    MOE_HOST_CHECK(r.num_rows == 0 || (r.recv_x != nullptr && (s.num_topk == 0 || r.recv_topk_idx != nullptr) &&
                                       (s.scale_bytes == 0 || r.recv_scales != nullptr)),
                   "rank " << rank << ": recv_x, recv_topk_idx (and recv_scales for fp8) must be device pointers");
  }
  const dim3 grid(static_cast<unsigned>(2 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    auto kernel = node_dispatch_kernel<decltype(ctx)>;
    check_resident(max_resident_blocks(kernel, kNumThreads), grid, "node dispatch");
    launch_kernel(kernel, grid, dim3(kNumThreads), 0, stream, cooperative, args);
  });
}

void launch_node_combine(const CombineArgs& args, intranode::DType dtype, Mode mode, bool cooperative,
                         cudaStream_t stream) {
  const Common& c = args.common;
  const SlotLayout& s = args.slot;
  check_common(c, mode);
  const SlotLayout want = intranode::make_slot_layout(s.x_bytes, 0, 0);
  MOE_HOST_CHECK(s.x_bytes > 0 && s.x_bytes % intranode::kFieldAlign == 0 && want.slot_bytes == s.slot_bytes &&
                     s.num_topk == 0 && s.scale_bytes == 0,
                 "the combine slot layout is not make_slot_layout(" << s.x_bytes << ", 0, 0) with 16-byte rows");
  MOE_HOST_CHECK(s.slot_bytes <= c.layout.slot_bytes,
                 "a combine slot needs " << s.slot_bytes << " bytes but the RDMA slots hold " << c.layout.slot_bytes);
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const CombineRank& r = args.ranks[i];
    const int rank = c.rank_begin + i;
    MOE_HOST_CHECK(r.num_tokens >= 0 && r.num_rows >= 0, "rank " << rank << ": num_tokens and num_rows must be >= 0");
    MOE_HOST_CHECK(r.recv_prefix != nullptr, "rank " << rank << ": recv_prefix must be a device pointer");
    MOE_HOST_CHECK(r.num_tokens == 0 || (r.out != nullptr && r.is_token_in_rank != nullptr),
                   "rank " << rank << ": out and is_token_in_node must be device pointers");
    MOE_HOST_CHECK(r.num_rows == 0 || r.y != nullptr, "rank " << rank << ": y (the node partials) must be a device pointer");
  }
  const dim3 grid(static_cast<unsigned>(2 * c.num_channels), static_cast<unsigned>(c.num_launch_ranks));
  with_mode(mode, [&](auto ctx) {
    using Ctx = decltype(ctx);
    auto launch = [&](auto kernel) {
      check_resident(max_resident_blocks(kernel, kNumThreads), grid, "node combine");
      launch_kernel(kernel, grid, dim3(kNumThreads), 0, stream, cooperative, args);
    };
    switch (dtype) {
      case intranode::kBf16: launch(node_combine_kernel<Ctx, intranode::Bf16Tag>); break;
      case intranode::kF16: launch(node_combine_kernel<Ctx, intranode::F16Tag>); break;
      case intranode::kF32: launch(node_combine_kernel<Ctx, intranode::F32Tag>); break;
      default: MOE_HOST_CHECK(false, "combine dtype must be 0 (bf16), 1 (fp16) or 2 (fp32), got " << dtype);
    }
  });
}

}  // namespace internode
}  // namespace moe_dispatch

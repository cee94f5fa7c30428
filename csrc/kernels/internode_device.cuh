// The GPU contexts of the internode roles (internode_roles.cuh's RDMA contract on top of
// DeviceCtx), in two modes, and what the staged and fused kernel files share: LoopbackCtx
// (every rank's buffer in this process: a put is a warp copy into the peer's buffer plus a
// release store of the signal) and NvshmemCtx (put-with-signal and signal ops to the PE of the
// same local index).
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"
#include "kernels/internode.h"
#include "kernels/intranode_device.cuh"

#ifdef MOE_DISPATCH_WITH_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace moe_dispatch {
namespace internode {

using intranode::DeviceCtxT;
using intranode::WaitSite;

// RDMA signals are uint64 words: the 64-bit accesses of intranode_device.cuh on them.
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  return static_cast<uint64_t>(intranode::ld_acquire_sys_64(reinterpret_cast<const int64_t*>(p)));
}
__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  intranode::st_release_sys_64(reinterpret_cast<int64_t*>(p), static_cast<int64_t>(v));
}
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  intranode::st_relaxed_sys_64(reinterpret_cast<int64_t*>(p), static_cast<int64_t>(v));
}

__device__ __forceinline__ void red_add_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// What both modes share: local words, warp-level waits; P is the copy policy (variant.cuh).
template <class P>
struct RdmaCtxBase : DeviceCtxT<Common, P> {
  using Policy = P;
  __device__ uint64_t load_local(const uint64_t* p) const { return *reinterpret_cast<const volatile uint64_t*>(p); }
  __device__ void store_local(uint64_t* p, uint64_t v) const { *reinterpret_cast<volatile uint64_t*>(p) = v; }
};

template <class Copy>
struct LoopbackCtxT : RdmaCtxBase<Copy> {
  using Base = RdmaCtxBase<Copy>;
  using Base::bounded_wait;
  using Base::common;
  using Base::copy_out;
  using Base::lane;

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
  __device__ bool signal_reached(const uint64_t* sig, uint64_t value) const { return ld_acquire_sys_u64(sig) >= value; }
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
  __device__ void signal_add_at(int rank, int peer, uint64_t* sig, uint64_t value) const {
    red_add_release_sys_u64(at_peer(rank, peer, sig), value);
  }
  __device__ void reset_signal(uint64_t* sig) const { st_relaxed_sys_u64(sig, 0); }
};

using LoopbackCtx = LoopbackCtxT<DefaultCopy>;

#ifdef MOE_DISPATCH_WITH_NVSHMEM
template <class Copy>
struct NvshmemCtxT : RdmaCtxBase<Copy> {
  using Base = RdmaCtxBase<Copy>;
  using Base::bounded_wait;
  using Base::common;
  using Base::lane;

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
  __device__ bool signal_reached(uint64_t* sig, uint64_t value) const {
    if (nvshmem_signal_fetch(sig) < value) return false;
    nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, value);
    return true;
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
  __device__ void signal_add_at(int, int peer, uint64_t* sig, uint64_t value) const {
    __threadfence_system();
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_ADD, peer);
  }
  // A local store (the ring is idle: no remote write can be in flight), fenced so that it lands
  // before the signal that lets the peer write again.
  __device__ void reset_signal(uint64_t* sig) const {
    st_relaxed_sys_u64(sig, 0);
    __threadfence_system();
  }
};
using NvshmemCtx = NvshmemCtxT<DefaultCopy>;
#endif

// Runs fn(context-of-mode) (a value of LoopbackCtxT<P> or NvshmemCtxT<P>, to pick the kernel).
template <class P = DefaultCopy, class Fn>
void with_mode(Mode mode, Fn fn) {
  if (mode == kLoopback) {
    fn(LoopbackCtxT<P>{});
    return;
  }
#ifdef MOE_DISPATCH_WITH_NVSHMEM
  fn(NvshmemCtxT<P>{});
#else
  MOE_HOST_CHECK(false, "NVSHMEM mode needs the extension built with NVSHMEM (this one was built without)");
#endif
}

// Group-structured blocks: `count` warp groups of `warps` warps; this thread's `group`
// (>= count: idle). count <= 16; a group of one warp synchronises with __syncwarp.
struct Groups {
  int count, warps, group;
};

__device__ __forceinline__ Groups groups_of(int num_peers) {
  const int count = num_peers < kNumWarps ? num_peers : kNumWarps;
  const int warps = kNumWarps / count;
  return {count, warps, static_cast<int>(threadIdx.x) / 32 / warps};
}

// Runs fn(context-of-mode, min_blocks) for the fused kernel of `common`'s variant (variant.cuh:
// loopback mode has the fused subset of kCopyVariants, NVSHMEM mode the current copies).
template <class Fn>
void with_fused_variant(Mode mode, const Common& common, Fn fn) {
  if (mode == kNvshmem) {
    check_variant(common.variant);
    MOE_HOST_CHECK(is_default_copy(common.variant),
                   "the fused kernels' NVSHMEM mode is compiled for the current copies only (loads_in_flight=4, "
                   "rows_in_flight=1, bulk_copy=0, register_cap=1); the other copy variants run in loopback mode");
    with_mode(mode, [&](auto ctx) { fn(ctx, std::integral_constant<int, 2>{}); });
    return;
  }
  with_copy_variant<true>(common.variant,
                          [&](auto policy, auto min_blocks) { fn(LoopbackCtxT<decltype(policy)>{}, min_blocks); });
}

// The notify block of launched rank blockIdx.x (a withheld rank's does nothing): body(ctx, rank).
template <class Ctx, class Body>
__device__ __forceinline__ void notify_block(const Common& common, Body body) {
  const int rank = common.rank_begin + static_cast<int>(blockIdx.x);
  if (rank == common.skip_rank) return;
  Ctx ctx{{{&common, 0, 0}}};
  body(ctx, rank);
}

// A dispatch or combine block of launched rank blockIdx.y: a withheld rank's blocks do nothing;
// the others read the rank's op epoch first and the last one advances it
// (intranode::op_epoch_begin / op_epoch_end) around body(ctx0, rank, epoch), ctx0 a one-warp
// context.
template <class Ctx, class Body>
__device__ __forceinline__ void rank_block(const Common& common, Body body) {
  const int rank = common.rank_begin + static_cast<int>(blockIdx.y);
  if (rank == common.skip_rank) return;
  Ctx ctx0{{{&common, 0, 32}}};
  char* buf = ctx0.buffer(rank);
  __shared__ uint64_t epoch_shared;
  const uint64_t epoch = intranode::op_epoch_begin(common.layout.op_epoch(buf), &epoch_shared);
  intranode::bulk_init<typename Ctx::Policy>();
  body(ctx0, rank, epoch);
  intranode::op_epoch_end(common.layout.op_epoch(buf), common.layout.done(buf), epoch, static_cast<int>(gridDim.x));
}

}  // namespace internode
}  // namespace moe_dispatch

// DeviceCtx: the GPU side of the Ctx contract of intranode_roles.cuh (lanes, named barriers,
// system-scope acquire/release over NVLink, bounded clock64 waits, 16-byte vector copies).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/intranode_roles.cuh"

namespace moe_dispatch {
namespace intranode {

// ---- memory primitives ----------------------------------------------------------------------

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  int32_t v;
  asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int32_t* p, int32_t v) {
  asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int64_t ld_acquire_sys_64(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int64_t ld_relaxed_sys_64(const int64_t* p) {
  int64_t v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_64(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_64(int64_t* p, int64_t v) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(int32_t* p, int32_t v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Inputs are read-only for the whole kernel: the non-coherent path, no L1 allocation.
__device__ __forceinline__ int4 ld_input_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ int32_t ld_input_i32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Queue slots are rewritten by peers as the ring wraps: read at L2 (.cg), never a stale L1 line.
__device__ __forceinline__ int4 ld_queue_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_queue_i32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- combine element types ------------------------------------------------------------------

template <class T>
struct Vec;

template <>
struct Vec<Bf16Tag> {
  static constexpr int kPer = 8;
  __device__ __forceinline__ static void unpack(const int4& v, float* f) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                           static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static int4 pack(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(float_to_bf16(f[2 * i])) |
             (static_cast<uint32_t>(float_to_bf16(f[2 * i + 1])) << 16);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                     static_cast<int>(w[3]));
  }
};

template <>
struct Vec<F16Tag> {
  static constexpr int kPer = 8;
  __device__ __forceinline__ static void unpack(const int4& v, float* f) {
    const __half* h = reinterpret_cast<const __half*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __half2float(h[i]);
  }
  __device__ __forceinline__ static int4 pack(const float* f) {
    int4 v;
    __half* h = reinterpret_cast<__half*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = __float2half_rn(f[i]);
    return v;
  }
};

template <>
struct Vec<F32Tag> {
  static constexpr int kPer = 4;
  __device__ __forceinline__ static void unpack(const int4& v, float* f) {
    f[0] = __int_as_float(v.x);
    f[1] = __int_as_float(v.y);
    f[2] = __int_as_float(v.z);
    f[3] = __int_as_float(v.w);
  }
  __device__ __forceinline__ static int4 pack(const float* f) {
    return make_int4(__float_as_int(f[0]), __float_as_int(f[1]), __float_as_int(f[2]), __float_as_int(f[3]));
  }
};

// ---- op epochs (intranode.cuh) ----------------------------------------------------------------

// Every block of a dispatch / combine launch reads its rank's op epoch when it starts (all
// threads call this; the value lands in `shared`), and the last of the rank's `blocks` blocks
// to finish advances it (op_epoch_end): by then every block has read it. The next launch on
// the stream sees the new value.
__device__ __forceinline__ uint64_t op_epoch_begin(const uint64_t* epoch, uint64_t* shared) {
  if (threadIdx.x == 0) *shared = *reinterpret_cast<const volatile uint64_t*>(epoch);
  __syncthreads();
  return *shared;
}

__device__ __forceinline__ void op_epoch_end(uint64_t* epoch, int32_t* done, uint64_t value, int blocks) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(done, 1) == blocks - 1) {
    *reinterpret_cast<volatile int32_t*>(done) = 0;
    *reinterpret_cast<volatile uint64_t*>(epoch) = value + 1;
    __threadfence();
  }
}

// ---- the context ----------------------------------------------------------------------------

constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per lane before the first store

// CommonT: a launch's shared arguments with timeout_cycles, error and error_host (intranode
// Common, or internode::Common for the RDMA stage, whose context extends this one).
template <class CommonT>
struct DeviceCtxT {
  const CommonT* common;
  int group_barrier;  // named barrier of this warp's group (1..15); unused for one-warp groups
  int group_threads;

  __device__ int lane() const { return static_cast<int>(threadIdx.x & 31u); }
  __device__ int width() const { return 32; }
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int num_threads() const { return static_cast<int>(blockDim.x); }
  __device__ void warp_sync() const { __syncwarp(); }
  __device__ void block_sync() const { __syncthreads(); }
  __device__ void group_sync() const {
    if (group_threads <= 32) {
      __syncwarp();
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(group_barrier), "r"(group_threads) : "memory");
    }
  }

  __device__ int32_t broadcast(int32_t v) const { return __shfl_sync(0xffffffffu, v, 0); }
  __device__ uint64_t warp_or(uint64_t v) const {
    const uint32_t lo = __reduce_or_sync(0xffffffffu, static_cast<uint32_t>(v));
    const uint32_t hi = __reduce_or_sync(0xffffffffu, static_cast<uint32_t>(v >> 32));
    return (static_cast<uint64_t>(hi) << 32) | lo;
  }
  __device__ int32_t load_acquire(const int32_t* p) const { return ld_acquire_sys(p); }
  __device__ int64_t load_acquire64(const int64_t* p) const { return ld_acquire_sys_64(p); }
  __device__ int64_t load_relaxed64(const int64_t* p) const { return ld_relaxed_sys_64(p); }
  __device__ void store_release64(int64_t* p, int64_t v) const { st_release_sys_64(p, v); }
  __device__ void store_relaxed64(int64_t* p, int64_t v) const { st_relaxed_sys_64(p, v); }
  __device__ void store_release(int32_t* p, int32_t v) const { st_release_sys(p, v); }
  __device__ void store_relaxed(int32_t* p, int32_t v) const { st_relaxed_sys(p, v); }
  __device__ void signal_add(int32_t* p, int32_t v) const { red_add_release_sys(p, v); }
  __device__ void count_add(int64_t* p, int64_t v) const {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  }
  __device__ int32_t shared_load(const int32_t* p) const { return *reinterpret_cast<const volatile int32_t*>(p); }
  __device__ void shared_store(int32_t* p, int32_t v) const { *reinterpret_cast<volatile int32_t*>(p) = v; }
  __device__ void shared_add(int32_t* p, int32_t v) const { atomicAdd(p, v); }
  __device__ int32_t shared_fetch_max(int32_t* p, int32_t v) const { return atomicMax(p, v); }
  __device__ void relax() const {}
  __device__ void fence_block() const { __threadfence_block(); }
  __device__ void fence_sc() const { asm volatile("fence.sc.cta;" ::: "memory"); }

  // Offers a timed-out wait to the launch's record (see ErrorRecord): written when none is
  // there yet or when this one names the cause better (lower timeout_level).
  __device__ void offer_timeout(const WaitSite& site, int32_t expected, int32_t observed) const {
    ErrorRecord* e = common->error;
    const int32_t level = timeout_level(site.counter, observed);
    bool locked = false;
    for (int i = 0; i < (1 << 16) && !locked; ++i) locked = atomicCAS(&e->lock, 0, 1) == 0;
    if (!locked) return;  // another offer holds it for a handful of stores; this one is dropped
    __threadfence();
    if (ld_volatile(&e->phase) == 0 || level < ld_volatile(&e->level)) {
      const int32_t fields[10] = {1, site.phase, site.role, site.rank, site.channel, site.peer, site.counter,
                                  expected, observed, level};
      volatile int32_t* out = &e->flag;
#pragma unroll
      for (int i = 1; i < 10; ++i) out[i] = fields[i];
      if (common->error_host != nullptr) {  // the pinned mirror: fields first, then its flag
        volatile int32_t* host = &common->error_host->flag;
#pragma unroll
        for (int i = 1; i < 10; ++i) host[i] = fields[i];
        __threadfence_system();
        host[0] = 1;
      }
    }
    __threadfence_system();
    atomicExch(&e->lock, 0);
  }

  // Offers a header mismatch to the rank's record (header.cuh): kept when none is there yet or
  // when it names a lower (peer, relayed) key.
  __device__ void offer_mismatch(const Check& check, int rank, int peer, int via, int field, int64_t mine,
                                 int64_t theirs) const {
    MismatchRecord* r = check.mismatch;
    if (r == nullptr || check.header.w[kHdrStatus] != 0) return;  // a refusing rank knows already
    unsigned long long* lock = reinterpret_cast<unsigned long long*>(&r->lock);
    bool locked = false;
    for (int i = 0; i < (1 << 16) && !locked; ++i) locked = atomicCAS(lock, 0ull, 1ull) == 0ull;
    if (!locked) return;
    __threadfence();
    volatile int64_t* out = &r->flag;
    const int64_t key = 2 * static_cast<int64_t>(peer) + (via >= 0);
    if (out[0] == 0 || key < 2 * out[2] + (out[6] >= 0)) {
      const int64_t fields[7] = {1, rank, peer, field, mine, theirs, via};
      for (int i = 1; i < 7; ++i) out[i] = fields[i];
      __threadfence();
      out[0] = 1;
      if (check.mismatch_host != nullptr) {  // the pinned mirror: fields first, then its flag
        volatile int64_t* host = &check.mismatch_host->flag;
        for (int i = 1; i < 7; ++i) host[i] = fields[i];
        __threadfence_system();
        host[0] = 1;
      }
    }
    __threadfence_system();
    atomicExch(lock, 0ull);
  }

  // Polls load() until it is >= target. -1 after timeout_cycles, or once another wait of the
  // launch timed out (offering this wait too if it had waited half the bound). `load` is an
  // acquire load of the awaited counter (int32 here, uint64 RDMA signals in internode).
  template <class Load>
  __device__ int64_t bounded_wait(Load load, int64_t target, const WaitSite& site) const {
    int64_t v = load();
    if (v >= target) return v;
    const long long start = clock64();
    for (uint32_t spin = 1;; ++spin) {
      v = load();
      if (v >= target) return v;
      if ((spin & 63u) == 0) {
        const long long waited = clock64() - start;
        if (ld_volatile(&common->error->flag) != 0) {
          if (2 * waited > common->timeout_cycles)
            offer_timeout(site, static_cast<int32_t>(target), static_cast<int32_t>(v));
          return -1;
        }
        if (waited > common->timeout_cycles) {
          atomicExch(&common->error->flag, 1);
          offer_timeout(site, static_cast<int32_t>(target), static_cast<int32_t>(v));
          return -1;
        }
      }
    }
  }

  __device__ int32_t wait_ge_lane(const int32_t* p, int32_t target, const WaitSite& site) const {
    return static_cast<int32_t>(bounded_wait([p]() { return static_cast<int64_t>(ld_acquire_sys(p)); }, target, site));
  }

  __device__ int64_t wait_ge64_lane(const int64_t* p, int64_t target, const WaitSite& site) const {
    return bounded_wait([p]() { return ld_acquire_sys_64(p); }, target, site);
  }

  __device__ int32_t wait_ge(const int32_t* p, int32_t target, const WaitSite& site) const {
    int32_t v = 0;
    if (lane() == 0) v = wait_ge_lane(p, target, site);
    return __shfl_sync(0xffffffffu, v, 0);
  }

  // In place over n entries of shared or global memory (any n): each thread sums a contiguous
  // segment, a Hillis-Steele scan over the segment sums (in `scratch`, one per thread), then
  // each thread rewrites its segment. Returns the total.
  __device__ int32_t block_exclusive_scan(int32_t* data, int n) const {
    __shared__ int32_t scratch[1024];
    const int i = tid(), threads = num_threads();
    const int per = (n + threads - 1) / threads;
    const int begin = i * per < n ? i * per : n, end = begin + per < n ? begin + per : n;
    int32_t sum = 0;
    for (int k = begin; k < end; ++k) sum += data[k];
    scratch[i] = sum;
    __syncthreads();
    for (int offset = 1; offset < threads; offset <<= 1) {
      const int32_t add = i >= offset ? scratch[i - offset] : 0;
      __syncthreads();
      scratch[i] += add;
      __syncthreads();
    }
    const int32_t total = scratch[threads - 1];
    int32_t running = scratch[i] - sum;
    for (int k = begin; k < end; ++k) {
      const int32_t v = data[k];
      data[k] = running;
      running += v;
    }
    __syncthreads();
    return total;
  }

  template <bool kFromQueue>
  __device__ __forceinline__ void copy(char* dst, const char* src, int bytes) const {
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
      const int n = bytes / 16;
      int4* d = reinterpret_cast<int4*>(dst);
      const int4* s = reinterpret_cast<const int4*>(src);
      int i = lane();
      for (; i + (kCopyUnroll - 1) * 32 < n; i += kCopyUnroll * 32) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) v[u] = kFromQueue ? ld_queue_v4(s + i + u * 32) : ld_input_v4(s + i + u * 32);
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) d[i + u * 32] = v[u];
      }
      for (; i < n; i += 32) d[i] = kFromQueue ? ld_queue_v4(s + i) : ld_input_v4(s + i);
    } else {  // fields are whole int32s (fp8 scales of H % 512 != 0)
      const int n = bytes / 4;
      int32_t* d = reinterpret_cast<int32_t*>(dst);
      const int32_t* s = reinterpret_cast<const int32_t*>(src);
      for (int i = lane(); i < n; i += 32) d[i] = kFromQueue ? ld_queue_i32(s + i) : ld_input_i32(s + i);
    }
  }
  __device__ void copy_in(char* dst, const char* src, int bytes) const { copy<false>(dst, src, bytes); }
  __device__ void copy_out(char* dst, const char* src, int bytes) const { copy<true>(dst, src, bytes); }
  __device__ void zero_row(char* dst, int bytes) const {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int i = lane(); i < bytes / 16; i += 32) d[i] = make_int4(0, 0, 0, 0);
  }
  __device__ void discard(char* slot, int bytes) const {
    const LineSpan lines = inner_lines(slot, bytes);
    for (int i = lane(); i < lines.count; i += 32)
      asm volatile("discard.global.L2 [%0], 128;" ::"l"(lines.first + static_cast<int64_t>(i) * kLine) : "memory");
  }
  __device__ int32_t queue_i32(const char* p) const { return ld_queue_i32(reinterpret_cast<const int32_t*>(p)); }
  __device__ float queue_f32(const char* p) const { return __int_as_float(queue_i32(p)); }

  // out = sum over rows h (in order) of float(rows[h]) * scales[h], fp32, rounded once.
  // Two vectors per lane per step keep two loads per holder in flight.
  template <class T>
  __device__ void reduce_rows(char* out, char* const* rows, const float* scales, int num_rows, int bytes) const {
    constexpr int kPer = Vec<T>::kPer;
    const int n = bytes / 16;
    int4* d = reinterpret_cast<int4*>(out);
    for (int i = lane(); i < n; i += 64) {
      const bool second = i + 32 < n;
      float acc0[kPer], acc1[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc0[j] = acc1[j] = 0.0f;
      for (int h = 0; h < num_rows; ++h) {
        const int4* row = reinterpret_cast<const int4*>(rows[h]);
        const int4 v0 = ld_queue_v4(row + i);
        const int4 v1 = second ? ld_queue_v4(row + i + 32) : make_int4(0, 0, 0, 0);
        const float scale = scales[h];
        float f[kPer];
        Vec<T>::unpack(v0, f);
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc0[j] = combine_step(acc0[j], f[j], scale);
        Vec<T>::unpack(v1, f);
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc1[j] = combine_step(acc1[j], f[j], scale);
      }
      d[i] = Vec<T>::pack(acc0);
      if (second) d[i + 32] = Vec<T>::pack(acc1);
    }
  }
};

using DeviceCtx = DeviceCtxT<Common>;

}  // namespace intranode
}  // namespace moe_dispatch

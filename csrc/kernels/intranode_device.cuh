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

// System-scope acquire loads, release stores and relaxed stores of one word, in both widths
// (SUFFIX names the 64-bit ones: ld_acquire_sys_64, ...); REG is the word's register constraint.
#define MOE_SYS_WORD_ACCESS(T, SUFFIX, BITS, REG)                                                \
  __device__ __forceinline__ T ld_acquire_sys##SUFFIX(const T* p) {                              \
    T v;                                                                                         \
    asm volatile("ld.acquire.sys.global.b" #BITS " %0, [%1];" : "=" REG(v) : "l"(p) : "memory"); \
    return v;                                                                                    \
  }                                                                                              \
  __device__ __forceinline__ void st_release_sys##SUFFIX(T* p, T v) {                            \
    asm volatile("st.release.sys.global.b" #BITS " [%0], %1;" ::"l"(p), REG(v) : "memory");      \
  }                                                                                              \
  __device__ __forceinline__ void st_relaxed_sys##SUFFIX(T* p, T v) {                            \
    asm volatile("st.relaxed.sys.global.b" #BITS " [%0], %1;" ::"l"(p), REG(v) : "memory");      \
  }
MOE_SYS_WORD_ACCESS(int32_t, , 32, "r")
MOE_SYS_WORD_ACCESS(int64_t, _64, 64, "l")
#undef MOE_SYS_WORD_ACCESS

__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  int32_t v;
  asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int64_t ld_relaxed_sys_64(const int64_t* p) {
  int64_t v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
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

// ---- TMA bulk copies (CopyPolicy::kBulk) -------------------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A warp's staging for bulk copies in the dynamic shared memory of a bulk kernel: kBulkStages
// pieces of kBulkPiece bytes, each with its mbarrier; `uses` counts the pieces loaded so far
// (piece u sits in stage u % kBulkStages, whose barrier completes phase u / kBulkStages).
constexpr int kBulkStages = 3;
constexpr int kBulkPiece = 2048;
constexpr int kBulkMinBytes = 1024;  // shorter fields keep the vector copy

struct BulkStage {
  uint64_t barrier[kBulkStages];
  uint32_t uses;
  alignas(128) char piece[kBulkStages][kBulkPiece];
};

// Dynamic shared memory a kernel of policy P needs (one stage per warp), 0 without bulk copies.
template <class P>
constexpr size_t bulk_smem_bytes() {
  return P::kBulk ? sizeof(BulkStage) * kNumWarps : 0;
}

__device__ __forceinline__ BulkStage* bulk_stage() {
  extern __shared__ __align__(128) char bulk_smem[];
  return reinterpret_cast<BulkStage*>(bulk_smem) + threadIdx.x / 32;
}

// Every thread of a kernel of policy P, at its start: lane 0 of each warp readies its stage's
// barriers for the async proxy (the warp's lane 0 alone issues and awaits its bulk copies).
template <class P>
__device__ __forceinline__ void bulk_init() {
  if constexpr (P::kBulk) {
    if ((threadIdx.x & 31u) == 0) {
      BulkStage* st = bulk_stage();
      for (int i = 0; i < kBulkStages; ++i)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&st->barrier[i])) : "memory");
      st->uses = 0;
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncwarp();
  }
}

// Lane: global -> shared, completing `bytes` of transactions on `barrier`.
__device__ __forceinline__ void bulk_load(char* piece, const char* src, uint32_t bytes, uint64_t* barrier) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_address(piece)),
               "l"(src), "r"(bytes), "r"(smem_address(barrier))
               : "memory");
}

// Lane: waits for phase `parity` of `barrier` (a local copy's completion, not a peer: unbounded).
__device__ __forceinline__ void bulk_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(smem_address(barrier)), "r"(parity)
                 : "memory");
  } while (!done);
}

// Lane: shared -> global as one bulk group.
__device__ __forceinline__ void bulk_store(char* dst, const char* piece, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_address(piece)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Warp: rows src[r] -> dst[r] (r < n, `bytes` each, 16-byte multiples on 16-byte addresses) in
// pieces through this warp's stage, kBulkStages loads in flight; lane 0 issues everything. The
// proxy fences order the generic accesses before (the acquire that made a slot readable) ahead
// of the bulk reads, and the bulk writes (complete at wait_group 0) ahead of what follows (the
// release that publishes them).
__device__ __forceinline__ void bulk_copy_rows(char* const* dst, const char* const* src, int n, int bytes) {
  if ((threadIdx.x & 31u) == 0) {
    BulkStage* st = bulk_stage();
    asm volatile("fence.proxy.async.global;" ::: "memory");
    const int per_row = (bytes + kBulkPiece - 1) / kBulkPiece, total = n * per_row;
    const uint32_t uses = st->uses;
    auto piece_of = [&](int k, int& row, int& offset) {
      row = k / per_row;
      offset = (k % per_row) * kBulkPiece;
      return static_cast<uint32_t>(bytes - offset < kBulkPiece ? bytes - offset : kBulkPiece);
    };
    auto load = [&](int k) {
      int row, offset;
      const uint32_t len = piece_of(k, row, offset);
      const int stage = static_cast<int>((uses + k) % kBulkStages);
      bulk_load(st->piece[stage], src[row] + offset, len, &st->barrier[stage]);
    };
    for (int k = 0; k < total && k < kBulkStages; ++k) load(k);
    for (int k = 0; k < total; ++k) {
      int row, offset;
      const uint32_t len = piece_of(k, row, offset);
      const int stage = static_cast<int>((uses + k) % kBulkStages);
      bulk_wait(&st->barrier[stage], ((uses + k) / kBulkStages) & 1u);
      bulk_store(dst[row] + offset, st->piece[stage], len);
      if (k + kBulkStages < total) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the stage is read out: reload it
        load(k + kBulkStages);
      }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    st->uses = uses + static_cast<uint32_t>(total);
  }
  __syncwarp();
}

// ---- combine element types ------------------------------------------------------------------

template <class T>
struct Vec;

template <>
struct Vec<Bf16Tag> {
  static constexpr int kPer = 8;
  __device__ __forceinline__ static void unpack(const int4& v, float* f) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
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
      w[i] =
          static_cast<uint32_t>(float_to_bf16(f[2 * i])) | (static_cast<uint32_t>(float_to_bf16(f[2 * i + 1])) << 16);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
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

// A dispatch or combine block of launched rank blockIdx.y: a withheld rank's blocks do nothing;
// the others read the rank's op epoch, set up policy P's bulk copies and run body(rank, epoch),
// and the last block to finish advances the epoch.
template <class P, class Body>
__device__ __forceinline__ void launched_rank_block(const Common& common, Body body) {
  const int rank = common.rank_begin + static_cast<int>(blockIdx.y);
  if (rank == common.skip_rank) return;
  const BufferLayout& l = common.layout;
  __shared__ uint64_t epoch_shared;
  const uint64_t epoch = op_epoch_begin(l.epoch(common.buffers[rank]), &epoch_shared);
  bulk_init<P>();
  body(rank, epoch);
  op_epoch_end(l.epoch(common.buffers[rank]), l.done(common.buffers[rank]), epoch, static_cast<int>(gridDim.x));
}

// ---- the context ----------------------------------------------------------------------------

// CommonT: a launch's shared arguments with timeout_cycles, error and error_host (intranode
// Common, or internode::Common for the RDMA stage, whose context extends this one). Policy: the
// copy loops (variant.cuh CopyPolicy; DefaultCopy is the current one).
template <class CommonT, class Policy = DefaultCopy>
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
  // Rows a warp moves together: the policy's (the launcher picked the kernel for the variant's).
  static constexpr int kMaxRows = Policy::kRows;
  __device__ static constexpr int rows_in_flight(const Variant&) { return kMaxRows; }
  __device__ static constexpr bool slot_flags(const Variant&) { return Policy::kFlags; }
  __device__ void relax() const {}
  __device__ void backoff(int idle) const { __nanosleep(64u << (idle < 4 ? idle : 4)); }
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
      const int32_t fields[10] = {1,         site.phase,   site.role, site.rank, site.channel,
                                  site.peer, site.counter, expected,  observed,  level};
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
    if (r == nullptr || !records_verdict(check.header.w[kHdrStatus], field, mine, theirs)) return;
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
  __device__ __forceinline__ static int4 load_v4(const int4* p) {
    return kFromQueue ? ld_queue_v4(p) : ld_input_v4(p);
  }

  // Rows src[r] -> dst[r], r < n <= Policy::kRows. The current copy: 4 loads per lane in
  // flight, then a remainder one at a time; deeper policies keep kPerRow loads on each of the
  // rows in flight, the tail predicated into the same loop.
  template <bool kFromQueue>
  __device__ __forceinline__ void copy_rows(char* const* dst, const char* const* src, int n, int bytes) const {
    uintptr_t bits = static_cast<uintptr_t>(bytes);
#pragma unroll
    for (int r = 0; r < Policy::kRows; ++r)
      if (r < n) bits |= reinterpret_cast<uintptr_t>(dst[r]) | reinterpret_cast<uintptr_t>(src[r]);
    if ((bits & 15) != 0) {  // fields are whole int32s (fp8 scales of H % 512 != 0)
#pragma unroll
      for (int r = 0; r < Policy::kRows; ++r) {
        if (r >= n) break;
        int32_t* d = reinterpret_cast<int32_t*>(dst[r]);
        const int32_t* s = reinterpret_cast<const int32_t*>(src[r]);
        for (int i = lane(); i < bytes / 4; i += 32) d[i] = kFromQueue ? ld_queue_i32(s + i) : ld_input_i32(s + i);
      }
      return;
    }
    if constexpr (Policy::kBulk) {
      if (bytes >= kBulkMinBytes) return bulk_copy_rows(dst, src, n, bytes);
    }
    const int vectors = bytes / 16;
    if constexpr (!Policy::kPredicatedTail) {
      if (n < 1) return;
      int4* d = reinterpret_cast<int4*>(dst[0]);
      const int4* s = reinterpret_cast<const int4*>(src[0]);
      int i = lane();
      for (; i + (Policy::kLoads - 1) * 32 < vectors; i += Policy::kLoads * 32) {
        int4 v[Policy::kLoads];
#pragma unroll
        for (int u = 0; u < Policy::kLoads; ++u) v[u] = load_v4<kFromQueue>(s + i + u * 32);
#pragma unroll
        for (int u = 0; u < Policy::kLoads; ++u) d[i + u * 32] = v[u];
      }
      for (; i < vectors; i += 32) d[i] = load_v4<kFromQueue>(s + i);
    } else {
      for (int i = lane(); i < vectors; i += Policy::kPerRow * 32) {
        int4 v[Policy::kRows][Policy::kPerRow];
#pragma unroll
        for (int r = 0; r < Policy::kRows; ++r)
#pragma unroll
          for (int u = 0; u < Policy::kPerRow; ++u)
            if (r < n && i + u * 32 < vectors)
              v[r][u] = load_v4<kFromQueue>(reinterpret_cast<const int4*>(src[r]) + i + u * 32);
#pragma unroll
        for (int r = 0; r < Policy::kRows; ++r)
#pragma unroll
          for (int u = 0; u < Policy::kPerRow; ++u)
            if (r < n && i + u * 32 < vectors) reinterpret_cast<int4*>(dst[r])[i + u * 32] = v[r][u];
      }
    }
  }
  __device__ void copy_in(char* dst, const char* src, int bytes) const { copy_rows<false>(&dst, &src, 1, bytes); }
  __device__ void copy_out(char* dst, const char* src, int bytes) const { copy_rows<true>(&dst, &src, 1, bytes); }
  __device__ void copy_in_rows(char* const* dst, const char* const* src, int n, int bytes) const {
    copy_rows<false>(dst, src, n, bytes);
  }
  __device__ void copy_out_rows(char* const* dst, const char* const* src, int n, int bytes) const {
    copy_rows<true>(dst, src, n, bytes);
  }
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

  // Bytes [offset, offset + bytes) of out = sum over rows h (in order) of float(rows[h]) *
  // scales[h], fp32, rounded once: a level of the summation order (moe_dispatch/semantics/summation.py).
  // Policy::kReduceVecs vectors per lane per step keep as many loads per holder in flight (2: the
  // current reducer).
  template <class T>
  __device__ void reduce_rows(char* out, char* const* rows, const float* scales, int num_rows, int offset,
                              int bytes) const {
    constexpr int kPer = Vec<T>::kPer, kVecs = Policy::kReduceVecs;
    const int n = bytes / 16;
    int4* d = reinterpret_cast<int4*>(out + offset);
    for (int i = lane(); i < n; i += 32 * kVecs) {
      float acc[kVecs][kPer];
#pragma unroll
      for (int u = 0; u < kVecs; ++u)
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc[u][j] = 0.0f;
      for (int h = 0; h < num_rows; ++h) {
        const int4* row = reinterpret_cast<const int4*>(rows[h] + offset);
        int4 v[kVecs];
#pragma unroll
        for (int u = 0; u < kVecs; ++u) v[u] = i + 32 * u < n ? ld_queue_v4(row + i + 32 * u) : make_int4(0, 0, 0, 0);
        const float scale = scales[h];
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          float f[kPer];
          Vec<T>::unpack(v[u], f);
#pragma unroll
          for (int j = 0; j < kPer; ++j) acc[u][j] = combine_step(acc[u][j], f[j], scale);
        }
      }
#pragma unroll
      for (int u = 0; u < kVecs; ++u)
        if (i + 32 * u < n) d[i + 32 * u] = Vec<T>::pack(acc[u]);
    }
  }
};

using DeviceCtx = DeviceCtxT<Common>;

// Host: fn(policy, min_blocks) for the intranode kernel of `v`: its copy variant, with or
// without the ready-flag loops.
template <class Fn>
void with_intranode_variant(const Variant& v, Fn fn) {
  with_copy_variant(v, [&](auto policy, auto min_blocks) {
    if (v.slot_flags) {
      fn(WithFlags<decltype(policy)>{}, min_blocks);
    } else {
      fn(policy, min_blocks);
    }
  });
}

}  // namespace intranode
}  // namespace moe_dispatch

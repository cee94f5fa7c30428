// The ring-queue protocol and the header check, written once for every queue the kernels run:
// the intranode NVLink rings (intranode_roles.cuh), the staged internode RDMA rings
// (internode_roles.cuh) and the NVLink hops of the fused internode pipeline
// (internode_fused_roles.cuh). A queue is reached through a small policy object (NvlQueue,
// RdmaQueue, ...) that says where entry i lives and how a count is published and awaited; the
// loops here (what a sender group, a receiver group, a combine reducer do) are shared.
//
// Everything is written against a context `Ctx` so that the same code runs
//   - on the GPU (DeviceCtx in intranode_device.cuh: lanes, named barriers, PTX
//     acquire/release, bounded clock64 waits, 16-byte vector copies), and
//   - on the CPU (HostCtx in intranode_host.h: one thread per warp, width 1, std atomics,
//     steady_clock waits), where tests compare it with moe_dispatch.reference.
//
// Ctx contract (every call is made by all lanes of the calling warp unless marked "lane"):
//   int lane(), width()                        this lane, lanes per warp (32 / 1)
//   int tid(), num_threads()                   thread in block (notify only)
//   void warp_sync(), group_sync(), block_sync()
//   int32_t broadcast(int32_t)                 lane 0's value to every lane
//   uint64_t warp_or(uint64_t)                 OR over the lanes
//   int32_t load_acquire(const int32_t*)       lane; a counter another rank stores
//   void store_release(int32_t*, int32_t)      lane; publish a counter (orders prior stores)
//   void store_relaxed(int32_t*, int32_t)      lane
//   int64_t load_acquire64 / load_relaxed64(const int64_t*), store_release64 / store_relaxed64
//                                              lane; header lines
//   void signal_add(int32_t*, int32_t)         lane; atomic add with release (barriers)
//   void count_add(int64_t*, int64_t)          lane; atomic add (expert counts)
//   int32_t wait_ge_lane(p, target, site)      lane; bounded wait: value >= target, or -1
//   int32_t wait_ge(p, target, site)           warp; lane 0 waits, all get its result
//   int64_t wait_ge64_lane(p, target, site)    lane; the same on an int64 word
//   int64_t bounded_wait(load, target, site)   lane; the same on whatever load() returns
//   void relax()                               lane; a spinning loop found nothing new
//   int32_t shared_load(const int32_t*)        lane; block-shared state another warp writes
//   void shared_store(int32_t*, int32_t)       lane
//   void shared_add(int32_t*, int32_t)         lane
//   int32_t shared_fetch_max(int32_t*, int32_t) lane; atomic max, returns the old value
//   void fence_block()                         lane; order my loads/stores before later shared stores
//   void fence_sc()                            lane; sequentially consistent fence (block scope): a
//                                              store before it and a load after it are not reordered
//   void block_exclusive_scan(int32_t*, n)     block; in place over n entries (any n), returns the total
//   void copy_in(char* dst, const char* src, int bytes)   warp; from a read-only input
//   void copy_out(char* dst, const char* src, int bytes)  warp; from a queue slot
//   void zero_row(char* dst, int bytes)                    warp
//   int32_t queue_i32(const char*), float queue_f32(const char*)   lane; scalars from a slot
//   void discard(char* slot, int bytes)        warp; a consumed slot's bytes are dead: the whole
//                                              128-byte lines inside it (inner_lines) may lose
//                                              their contents (GPU: dropped from L2 unwritten;
//                                              CPU: poisoned, so a later read shows)
//   void offer_mismatch(check, rank, peer, via, field, mine, theirs)
//                                              lane; into check.mismatch (and its mirror); a rank
//                                              whose own status is non-zero records nothing
//   template <class T> void reduce_rows(char* out, char* const* rows, const float* scales,
//                                       int num_rows, int bytes)   warp; combine_step order
#pragma once

#include "kernels/header.cuh"
#include "kernels/intranode.cuh"

#if defined(__CUDACC__)
#define MOE_ROLE __device__ __forceinline__
#else
#define MOE_ROLE inline
#endif

namespace moe_dispatch {
namespace ring {

using intranode::Check;
using intranode::kNumWarps;
using intranode::TokenRange;
using intranode::WaitSite;

// Per warp group (shared memory on the GPU): what warp 0 decided for the group. The loops
// below write `value` and `stop` once per round, between two group barriers; what is settled
// once before a loop (`verdict`, `lo`, `hi`) has fields of its own, so a warp still reading it
// never sees a loop's later store.
struct GroupState {
  int32_t value;    // receiver: the tail it saw; fused forwarder: the ring it picked
  int32_t stop;     // 1: a wait failed, every warp of the group leaves
  int32_t count;    // fused forwarder: entries of the picked chunk
  int32_t first;    // fused forwarder: the chunk's first entry
  int32_t verdict;  // 1: the group's pair moves rows
  int32_t lo, hi;   // a 64-bit value settled with the verdict (a forwarder's rail report)
};

// ---- header lines (header.cuh) ---------------------------------------------------------------

// Lane: this rank's header line into `line` (in the peer's buffer): the words, the relay report
// (or nothing), then the marker, with release.
template <class Ctx>
MOE_ROLE void put_header_line(Ctx& ctx, int64_t* line, const Header& h, uint64_t epoch, const int64_t* report) {
  for (int w = 0; w < kHeaderWords; ++w) ctx.store_relaxed64(line + w, h.w[w]);
  if (report != nullptr)
    for (int w = 0; w < kReportWords; ++w) ctx.store_relaxed64(line + kReportWord + w, report[w]);
  ctx.store_release64(line + kMarkerWord, static_cast<int64_t>(epoch + 1));
}

// Lane: waits for the peer's line of `epoch` in this rank's buffer and copies it into
// theirs[kHeaderLineWords]; false when the wait timed out.
template <class Ctx>
MOE_ROLE bool get_header_line(Ctx& ctx, const int64_t* line, uint64_t epoch, const WaitSite& site, int64_t* theirs) {
  if (ctx.wait_ge64_lane(line + kMarkerWord, static_cast<int64_t>(epoch + 1), site) < 0) return false;
  for (int w = 0; w < kHeaderLineWords; ++w) theirs[w] = ctx.load_relaxed64(line + w);
  return true;
}

// Lane: 1 when this rank's header and the peer's agree (the pair moves rows), else 0,
// recording the first differing field when `record`.
template <class Ctx>
MOE_ROLE int32_t judge(Ctx& ctx, const Check& check, int rank, int peer, const int64_t* theirs, bool record) {
  const int field = header_diff(check.header.w, theirs);
  if (field >= 0 && record) ctx.offer_mismatch(check, rank, peer, -1, field, check.header.w[field], theirs[field]);
  return field < 0 ? 1 : 0;
}

// ---- queue loops ------------------------------------------------------------------------------
//
// Queue policy (what the loops below call; warp-level unless marked lane):
//   sender side:   char* slot(i)                  where entry i is written
//                  int64_t wait_room(ctx, target) head >= target (entries freed), or -1
//                  void publish(ctx, begin, count) entries [begin, begin + count) are written
//                  void finish(ctx, total)        the receiver freed all `total`: reset the head
//   receiver side: char* slot(i)                  where entry i is read
//                  int64_t wait_data(ctx, target) tail >= target (entries written), or -1
//                  void release(ctx, consumed, final)   lane; free entries below `consumed`
//                                                 (`final`: the last release of the operation)
// Counters count entries since the start of the operation; intranode.cuh describes the
// self-resetting counters and the room rule (a sender writes [sent, sent + K) only once
// head >= sent + K - S).

// Sender group (`warp` of `group_warps`): entries are the tokens t of `range` with selected(t),
// in token order, K = chunk per published count; entry e is written by warp e % group_warps.
template <class Ctx, class Queue, class Select, class Write>
MOE_ROLE void send_selected(Ctx& ctx, const Queue& q, int num_slots, int chunk, TokenRange range, Select selected,
                            Write write, int warp, int group_warps, GroupState* gs) {
  int64_t sent = 0;
  for (int token = range.begin; token < range.end;) {
    if (warp == 0) {  // room for a whole chunk: entries [sent, sent + K) are free
      const int64_t target = sent + chunk - num_slots;
      const int64_t seen = target > 0 ? q.wait_room(ctx, target) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    int count = 0;  // every warp scans the same tokens, so all agree on count and slots
    for (; token < range.end && count < chunk; ++token) {
      if (!selected(token)) continue;
      if ((sent + count) % group_warps == warp) write(token, q.slot(sent + count));
      ++count;
    }
    ctx.group_sync();
    if (warp == 0 && count > 0) q.publish(ctx, sent, count);
    sent += count;
  }
  if (warp == 0 && sent > 0) q.finish(ctx, sent);  // everything consumed: reset for the next operation
}

// Sender group streaming entries [0, num_entries) (write(i, slot)) in chunks of K.
template <class Ctx, class Queue, class Write>
MOE_ROLE void send_entries(Ctx& ctx, const Queue& q, int num_slots, int chunk, int64_t num_entries, Write write,
                           int warp, int group_warps, GroupState* gs) {
  for (int64_t sent = 0; sent < num_entries;) {
    const int count = static_cast<int>(num_entries - sent < chunk ? num_entries - sent : chunk);
    if (warp == 0) {
      const int64_t target = sent + count - num_slots;
      const int64_t seen = target > 0 ? q.wait_room(ctx, target) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    for (int64_t i = sent + warp; i < sent + count; i += group_warps) write(i, q.slot(i));
    ctx.group_sync();
    if (warp == 0) q.publish(ctx, sent, count);
    sent += count;
  }
  if (warp == 0 && num_entries > 0) q.finish(ctx, num_entries);
}

// Receiver group: consumes entries [0, num_entries) as they land (read(slot, i)), freeing
// them after each batch.
template <class Ctx, class Queue, class Read>
MOE_ROLE void recv_entries(Ctx& ctx, const Queue& q, int64_t num_entries, Read read, int warp, int group_warps,
                           GroupState* gs) {
  for (int64_t consumed = 0; consumed < num_entries;) {
    if (warp == 0) {
      const int64_t seen = q.wait_data(ctx, consumed + 1);
      if (ctx.lane() == 0) {
        ctx.shared_store(&gs->value, static_cast<int32_t>(seen));
        ctx.shared_store(&gs->stop, seen < 0);
      }
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    const int64_t available = ctx.shared_load(&gs->value);
    for (int64_t i = consumed + warp; i < available; i += group_warps) read(q.slot(i), i);
    ctx.group_sync();
    if (warp == 0 && ctx.lane() == 0) q.release(ctx, available, available == num_entries);
    consumed = available;
  }
}

// ---- reduction over holders (every combine receiver) ---------------------------------------
//
// A reducer block: worker warps sum each token's rows from its holders (peers: ranks or
// nodes) in ascending peer order, in fp32, rounded once; a coordinator warp frees queue
// entries behind the slowest worker. progress[w][p]: entries of p's queue that worker w no
// longer needs (p's rows of the tokens before w's scan position; a worker never scans past a
// token of its own it has not reduced); min over workers = entries safe to free.
//
// Source policy (lane-level unless marked warp):
//   int num_tokens(), num_peers()
//   bool holds(i, p)                 token i has a row from peer p
//   bool owns(i, worker, num_workers)
//   bool begin(ctx, i)               warp; before worker's token i (false: give up)
//   int64_t wait(ctx, p, target)     warp; entries of p's queue landed >= target, or -1
//   char* row(ctx, p, index, i)      p's entry `index` (token i)
//   float scale(ctx, p, row, index, i)
//   char* out(i)
//   void after(ctx, i, rows, n)      warp; token i reduced from rows[0, n)
//   void free(ctx, p, freed, final)  lane (coordinator)
template <int kMaxPeers>
struct ReduceState {
  int32_t progress[kNumWarps][kMaxPeers];
  int32_t seen_tail[kNumWarps][kMaxPeers];
  float scales[kNumWarps][kMaxPeers];
  char* rows[kNumWarps][kMaxPeers];
  int32_t total[kMaxPeers];
  int32_t published[kMaxPeers];
  int32_t done;
};

#if defined(__CUDACC__)
// Block (all threads, then a barrier): zero progress, seen tails and the done count.
template <int kMaxPeers>
__device__ __forceinline__ void init_reduce_state(ReduceState<kMaxPeers>* st) {
  for (int i = threadIdx.x; i < kNumWarps * kMaxPeers; i += blockDim.x) {
    (&st->progress[0][0])[i] = 0;
    (&st->seen_tail[0][0])[i] = 0;
  }
  if (threadIdx.x == 0) st->done = 0;
  __syncthreads();
}
#endif

template <class T, int kMaxPeers, class Ctx, class Src>
MOE_ROLE void reduce_worker(Ctx& ctx, const Src& src, int bytes, int worker, int num_workers,
                            ReduceState<kMaxPeers>* st) {
  const int num_tokens = src.num_tokens(), num_peers = src.num_peers();
  int32_t* progress = st->progress[worker];
  int32_t* seen_tail = st->seen_tail[worker];
  bool failed = false;
  for (int i = 0; i < num_tokens && !failed; ++i) {
    if (src.owns(i, worker, num_workers)) {
      failed = !src.begin(ctx, i);
      int num_holders = 0;
      for (int p = 0; p < num_peers && !failed; ++p) {
        if (!src.holds(i, p)) continue;
        const int32_t index = ctx.shared_load(&progress[p]);
        if (ctx.shared_load(&seen_tail[p]) <= index) {
          const int64_t seen = src.wait(ctx, p, index + 1);
          failed = seen < 0;
          ctx.warp_sync();
          if (ctx.lane() == 0) ctx.shared_store(&seen_tail[p], static_cast<int32_t>(seen));
        }
        if (ctx.lane() == 0) {
          char* row = src.row(ctx, p, index, i);
          st->rows[worker][num_holders] = row;
          st->scales[worker][num_holders] = src.scale(ctx, p, row, index, i);
        }
        ++num_holders;
      }
      if (failed) break;
      ctx.warp_sync();
      ctx.template reduce_rows<T>(src.out(i), st->rows[worker], st->scales[worker], num_holders, bytes);
      ctx.warp_sync();
      src.after(ctx, i, st->rows[worker], num_holders);  // before the progress below frees the rows
    }
    // Past this token: its rows (mine reduced above, others' not my business) are released.
    ctx.fence_block();
    for (int p = ctx.lane(); p < num_peers; p += ctx.width())
      if (src.holds(i, p)) ctx.shared_store(&progress[p], ctx.shared_load(&progress[p]) + 1);
    ctx.warp_sync();
  }
  ctx.fence_block();
  if (ctx.lane() == 0) ctx.shared_add(&st->done, 1);
}

template <int kMaxPeers, class Ctx, class Src>
MOE_ROLE void reduce_coordinator(Ctx& ctx, const Src& src, int num_workers, ReduceState<kMaxPeers>* st) {
  const int num_tokens = src.num_tokens(), num_peers = src.num_peers();
  for (int p = ctx.lane(); p < num_peers; p += ctx.width()) {
    int32_t total = 0;
    for (int i = 0; i < num_tokens; ++i) total += src.holds(i, p) ? 1 : 0;
    st->total[p] = total;
    st->published[p] = 0;
  }
  ctx.warp_sync();
  for (;;) {
    const bool finished = ctx.shared_load(&st->done) == num_workers;
    ctx.fence_block();
    bool moved = false;
    for (int p = ctx.lane(); p < num_peers; p += ctx.width()) {
      int32_t freed = st->total[p];
      for (int w = 0; w < num_workers; ++w) {
        const int32_t v = ctx.shared_load(&st->progress[w][p]);
        freed = v < freed ? v : freed;
      }
      if (freed > st->published[p]) {
        src.free(ctx, p, freed, freed == st->total[p]);
        st->published[p] = freed;
        moved = true;
      }
    }
    if (finished) break;
    if (!moved) ctx.relax();
  }
}

}  // namespace ring
}  // namespace moe_dispatch

// The intranode protocol itself: what each warp (group) of the notify, dispatch and combine
// kernels does, written once against a context `Ctx` so that the same code runs
//   - on the GPU (DeviceCtx in intranode_device.cuh: lanes, named barriers, PTX
//     acquire/release, bounded clock64 waits, 16-byte vector copies), and
//   - on the CPU (HostCtx in intranode_host.h: one thread per warp, width 1,
//     std atomics, steady_clock waits), where tests compare it with moe_dispatch.reference.
// See intranode.cuh for the layout and the protocol in prose.
//
// Ctx contract (every call is made by all lanes of the calling warp unless marked "lane"):
//   int lane(), width()                        this lane, lanes per warp (32 / 1)
//   int tid(), num_threads()                   thread in block (notify only)
//   void warp_sync(), group_sync(), block_sync()
//   int32_t load_acquire(const int32_t*)       lane; a counter another rank stores
//   void store_release(int32_t*, int32_t)      lane; publish a counter (orders prior stores)
//   void store_relaxed(int32_t*, int32_t)      lane
//   void signal_add(int32_t*, int32_t)         lane; atomic add with release (barriers)
//   void count_add(int64_t*, int64_t)          lane; atomic add (expert counts)
//   int32_t wait_ge_lane(p, target, site)      lane; bounded wait: value >= target, or -1
//   int32_t wait_ge(p, target, site)           warp; lane 0 waits, all get its result
//   int32_t shared_load(const int32_t*)        lane; block-shared state another warp writes
//   void shared_store(int32_t*, int32_t)       lane
//   void shared_add(int32_t*, int32_t)         lane
//   void fence_block()                         lane; order my loads/stores before later shared stores
//   int32_t block_exclusive_scan(int32_t*, n)  block; in place, returns the total
//   void copy_in(char* dst, const char* src, int bytes)   warp; from a read-only input
//   void copy_out(char* dst, const char* src, int bytes)  warp; from a queue slot
//   void zero_row(char* dst, int bytes)                    warp
//   int32_t queue_i32(const char*), float queue_f32(const char*)   lane; scalars from a slot
//   void discard(char* slot, int bytes)        warp; a consumed slot's bytes are dead: the whole
//                                              128-byte lines inside it (inner_lines) may lose
//                                              their contents (GPU: dropped from L2 unwritten;
//                                              CPU: poisoned, so a later read shows)
//   template <class T> void reduce_rows(char* out, char* const* rows, const float* scales,
//                                       int num_rows, int bytes)   warp; combine_step order
#pragma once

#include "kernels/intranode.cuh"

#if defined(__CUDACC__)
#define MOE_ROLE __device__ __forceinline__
#else
#define MOE_ROLE inline
#endif

namespace moe_dispatch {
namespace intranode {

// Per warp group (shared memory on the GPU): the leader's verdict for this round.
struct GroupState {
  int32_t value;  // dispatch receiver: the tail it saw
  int32_t stop;   // 1: a wait failed, every warp of the group leaves
};

struct NotifyState {
  int32_t counts[kMaxRanks * kMaxChannels];
  int32_t stop;
};

// Combine receiver block state. progress[w][r]: slots of queue (r -> me, c) that worker w no
// longer needs (the r-rows of the tokens before its scan position; a worker never scans past
// a token of its own it has not reduced). min over workers = slots safe to free.
struct CombineRecvState {
  int32_t progress[kNumWarps][kMaxRanks];
  int32_t seen_tail[kNumWarps][kMaxRanks];
  float scales[kNumWarps][kMaxRanks];
  char* rows[kNumWarps][kMaxRanks];
  int32_t total[kMaxRanks];
  int32_t published[kMaxRanks];
  int32_t done;
};

// ---- notify -----------------------------------------------------------------------------------

// Barrier among the W ranks (block-collective). False when a wait failed (the block leaves).
template <class Ctx>
MOE_ROLE bool rank_barrier(Ctx& ctx, const Common& cm, int rank, NotifyState* st) {
  const BufferLayout& l = cm.layout;
  ctx.block_sync();
  for (int p = ctx.tid(); p < cm.num_ranks; p += ctx.num_threads())
    ctx.signal_add(l.signal(cm.buffers[p]) + rank, 1);
  for (int p = ctx.tid(); p < cm.num_ranks; p += ctx.num_threads()) {
    int32_t* signal = l.signal(cm.buffers[rank]) + p;
    const WaitSite site{kNotify, kBarrier, rank, -1, p, kSignal};
    if (ctx.wait_ge_lane(signal, 1, site) < 0) {
      ctx.shared_store(&st->stop, 1);
    } else {
      ctx.signal_add(signal, -1);
    }
  }
  ctx.block_sync();
  return ctx.shared_load(&st->stop) == 0;
}

// Exchanges the per-(source, channel) counts and writes this rank's receive prefix.
template <class Ctx>
MOE_ROLE void notify(Ctx& ctx, const NotifyArgs& a, int rank, NotifyState* st) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const NotifyRank& me = a.ranks[rank - cm.rank_begin];
  const int num_ranks = cm.num_ranks, num_channels = cm.num_channels;
  const int num_queues = num_ranks * num_channels;
  if (ctx.tid() == 0) ctx.shared_store(&st->stop, 0);
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) st->counts[i] = 0;
  // 1. Everyone is done reading the previous operation's meta.
  if (!rank_barrier(ctx, cm, rank, st)) return;
  // 2. counts[d][c]: my tokens of channel c that rank d holds.
  const int64_t num_flags = static_cast<int64_t>(me.num_tokens) * num_ranks;
  for (int64_t i = ctx.tid(); i < num_flags; i += ctx.num_threads()) {
    if (!me.is_token_in_rank[i]) continue;
    const int token = static_cast<int>(i / num_ranks), dst = static_cast<int>(i % num_ranks);
    ctx.shared_add(&st->counts[dst * num_channels + channel_of_token(me.num_tokens, num_channels, token)], 1);
  }
  ctx.block_sync();
  // 3. Into every destination's meta[me][c]; the barrier's release publishes them.
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) {
    const int dst = i / num_channels, channel = i % num_channels;
    ctx.store_relaxed(l.meta(cm.buffers[dst], rank, channel), ctx.shared_load(&st->counts[i]));
  }
  if (!rank_barrier(ctx, cm, rank, st)) return;
  // 4. My meta[s][c] in (source, channel) order -> exclusive prefix = first receive row.
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads())
    st->counts[i] = ctx.load_acquire(l.meta(cm.buffers[rank], i / num_channels, i % num_channels));
  ctx.block_sync();
  const int32_t total = ctx.block_exclusive_scan(st->counts, num_queues);
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) me.recv_prefix[i] = st->counts[i];
  if (ctx.tid() == 0) {
    me.recv_prefix[num_queues] = total;
    *me.num_recv_tokens = total;
    *me.overflow = (me.budget >= 0 && total > me.budget) ? 1 : 0;
  }
  // 5. Budget mode: rows past the received ones read as "no expert".
  if (me.budget >= 0 && total < me.budget) {
    const int64_t first = total, rows = me.budget - total;
    for (int64_t i = ctx.tid(); i < rows * a.num_topk; i += ctx.num_threads()) {
      if (me.recv_topk_idx != nullptr) me.recv_topk_idx[first * a.num_topk + i] = -1;
      if (me.recv_topk_weights != nullptr) me.recv_topk_weights[first * a.num_topk + i] = 0.0f;
    }
    if (me.recv_src_idx != nullptr)
      for (int64_t i = ctx.tid(); i < rows; i += ctx.num_threads()) me.recv_src_idx[first + i] = -1;
  }
}

// ---- dispatch ---------------------------------------------------------------------------------

// Token `token` of `me` into a queue slot bound for `dst` (warp-cooperative): top-k ids become
// dst's local ids (experts [dst * experts_per_rank, +experts_per_rank)), -1 elsewhere. The RDMA
// stage of internode_roles.cuh passes nodes as `dst` and experts per node.
template <class Ctx>
MOE_ROLE void write_dispatch_slot(Ctx& ctx, const SlotLayout& s, int experts_per_rank, const DispatchRank& me,
                                  int dst, int token, char* slot) {
  ctx.copy_in(slot, me.x + static_cast<int64_t>(token) * s.x_bytes, s.x_bytes);
  if (s.scale_bytes > 0)
    ctx.copy_in(slot + s.scale_offset,
                reinterpret_cast<const char*>(me.x_scales) + static_cast<int64_t>(token) * s.scale_bytes,
                s.scale_bytes);
  for (int k = ctx.lane(); k < s.num_topk; k += ctx.width()) {
    const int64_t entry = static_cast<int64_t>(token) * s.num_topk + k;
    const int32_t local = local_expert(me.topk_idx[entry], dst, experts_per_rank);
    reinterpret_cast<int32_t*>(slot + s.topk_idx_offset)[k] = local;
    reinterpret_cast<float*>(slot + s.topk_weights_offset)[k] =
        (local >= 0 && me.topk_weights != nullptr) ? me.topk_weights[entry] : 0.0f;
  }
  if (ctx.lane() == 0)
    *reinterpret_cast<int32_t*>(slot + s.aux_offset) = me.token_ids != nullptr ? me.token_ids[token] : token;
}

// A received slot into output row `row` (warp-cooperative); rows past the allocation are
// dropped and flagged.
template <class Ctx>
MOE_ROLE void read_dispatch_slot(Ctx& ctx, const SlotLayout& s, const DispatchRank& me, const char* slot, int row) {
  if (row >= me.num_rows) {
    if (ctx.lane() == 0) ctx.store_relaxed(me.overflow, 1);
    return;
  }
  ctx.copy_out(me.recv_x + static_cast<int64_t>(row) * s.x_bytes, slot, s.x_bytes);
  if (s.scale_bytes > 0)
    ctx.copy_out(reinterpret_cast<char*>(me.recv_scales) + static_cast<int64_t>(row) * s.scale_bytes,
                 slot + s.scale_offset, s.scale_bytes);
  for (int k = ctx.lane(); k < s.num_topk; k += ctx.width()) {
    const int64_t entry = static_cast<int64_t>(row) * s.num_topk + k;
    const int32_t local = ctx.queue_i32(slot + s.topk_idx_offset + 4 * k);
    me.recv_topk_idx[entry] = local;
    if (me.recv_topk_weights != nullptr) me.recv_topk_weights[entry] = ctx.queue_f32(slot + s.topk_weights_offset + 4 * k);
    if (local >= 0) ctx.count_add(me.num_recv_per_expert + local, 1);
  }
  if (ctx.lane() == 0 && me.recv_src_idx != nullptr) me.recv_src_idx[row] = ctx.queue_i32(slot + s.aux_offset);
}

// Sender group (rank -> dst, channel): `warp` of `group_warps` warps. Entry i goes to warp
// i % group_warps; warp 0's lane 0 waits and publishes.
template <class Ctx>
MOE_ROLE void dispatch_send(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int dst, int warp,
                            int group_warps, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  char* dst_buffer = cm.buffers[dst];
  int32_t* tail = l.tail(dst_buffer, rank, channel);
  int32_t* head = l.head(cm.buffers[rank], dst, channel);
  const WaitSite site{kDispatch, kSender, rank, channel, dst, kHead};
  int sent = 0;
  for (int token = range.begin; token < range.end;) {
    if (warp == 0) {  // room for a whole chunk: entries [sent, sent + K) are free
      const int32_t target = sent + cm.chunk_tokens - l.num_slots;
      const int32_t seen = target > 0 ? ctx.wait_ge(head, target, site) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    int count = 0;  // every warp scans the same tokens, so all agree on count and slots
    for (; token < range.end && count < cm.chunk_tokens; ++token) {
      if (!me.is_token_in_rank[static_cast<int64_t>(token) * cm.num_ranks + dst]) continue;
      if ((sent + count) % group_warps == warp)
        write_dispatch_slot(ctx, a.slot, a.experts_per_rank, me, dst, token,
                            l.slot(dst_buffer, rank, channel, sent + count));
      ++count;
    }
    ctx.group_sync();
    if (warp == 0 && ctx.lane() == 0 && count > 0) ctx.store_release(tail, sent + count);
    sent += count;
  }
  // Wait until dst consumed everything, then reset my head for the next operation.
  if (warp == 0 && sent > 0) {
    const int32_t seen = ctx.wait_ge(head, sent, site);
    if (ctx.lane() == 0 && seen >= 0) ctx.store_relaxed(head, 0);
  }
}

// Receiver group (src -> rank, channel).
template <class Ctx>
MOE_ROLE void dispatch_recv(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int src, int warp,
                            int group_warps, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int queue = src * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const int num_entries = me.recv_prefix[queue + 1] - first_row;
  char* my_buffer = cm.buffers[rank];
  int32_t* tail = l.tail(my_buffer, src, channel);
  int32_t* head = l.head(cm.buffers[src], rank, channel);
  const WaitSite site{kDispatch, kReceiver, rank, channel, src, kTail};
  for (int consumed = 0; consumed < num_entries;) {
    if (warp == 0) {
      const int32_t seen = ctx.wait_ge(tail, consumed + 1, site);
      if (ctx.lane() == 0) {
        ctx.shared_store(&gs->value, seen);
        ctx.shared_store(&gs->stop, seen < 0);
      }
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    const int available = ctx.shared_load(&gs->value);
    for (int i = consumed + warp; i < available; i += group_warps) {
      char* slot = l.slot(my_buffer, src, channel, i);
      read_dispatch_slot(ctx, a.slot, me, slot, first_row + i);
      if (cm.l2_discard) {
        ctx.warp_sync();  // every lane's reads of the slot are done
        ctx.discard(slot, l.slot_bytes);  // the slot's whole stride: what the call leaves unused is dead too
      }
    }
    ctx.group_sync();
    if (warp == 0 && ctx.lane() == 0) {
      if (available == num_entries) ctx.store_relaxed(tail, 0);  // before the final head
      ctx.store_release(head, available);
    }
    consumed = available;
  }
}

// ---- combine ----------------------------------------------------------------------------------

// Sender group (holder rank -> dst = the rows' source, channel): rows
// [prefix[dst][c], prefix[dst][c+1]) of y, in order.
template <class Ctx>
MOE_ROLE void combine_send(Ctx& ctx, const CombineArgs& a, int rank, int channel, int dst, int warp,
                           int group_warps, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const SlotLayout& s = a.slot;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int queue = dst * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const int num_entries = me.recv_prefix[queue + 1] - first_row;
  char* dst_buffer = cm.buffers[dst];
  int32_t* tail = l.tail(dst_buffer, rank, channel);
  int32_t* head = l.head(cm.buffers[rank], dst, channel);
  const WaitSite site{kCombine, kSender, rank, channel, dst, kHead};
  for (int sent = 0; sent < num_entries;) {
    const int count = num_entries - sent < cm.chunk_tokens ? num_entries - sent : cm.chunk_tokens;
    if (warp == 0) {
      const int32_t target = sent + count - l.num_slots;
      const int32_t seen = target > 0 ? ctx.wait_ge(head, target, site) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    for (int i = sent + warp; i < sent + count; i += group_warps) {
      char* slot = l.slot(dst_buffer, rank, channel, i);
      const int row = first_row + i;
      const bool stored = row < me.num_rows;  // budget mode: dropped rows return as zeros
      if (stored) {
        ctx.copy_in(slot, me.y + static_cast<int64_t>(row) * s.x_bytes, s.x_bytes);
      } else {
        ctx.zero_row(slot, s.x_bytes);
      }
      if (ctx.lane() == 0)
        *reinterpret_cast<float*>(slot + s.aux_offset) = (stored && me.row_scale != nullptr) ? me.row_scale[row] : 1.0f;
    }
    ctx.group_sync();
    if (warp == 0 && ctx.lane() == 0) ctx.store_release(tail, sent + count);
    sent += count;
  }
  if (warp == 0 && num_entries > 0) {
    const int32_t seen = ctx.wait_ge(head, num_entries, site);
    if (ctx.lane() == 0 && seen >= 0) ctx.store_relaxed(head, 0);
  }
}

// Worker `worker` of `num_workers` (source rank, channel): reduces tokens i % num_workers ==
// worker of the channel, holders in ascending rank order, into `out`.
template <class T, class Ctx>
MOE_ROLE void combine_recv_worker(Ctx& ctx, const CombineArgs& a, int rank, int channel, int worker,
                                  int num_workers, CombineRecvState* st) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const SlotLayout& s = a.slot;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int num_ranks = cm.num_ranks;
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  char* my_buffer = cm.buffers[rank];
  int32_t* progress = st->progress[worker];
  int32_t* seen_tail = st->seen_tail[worker];
  bool failed = false;
  for (int token = range.begin; token < range.end && !failed; ++token) {
    const bool* holds = me.is_token_in_rank + static_cast<int64_t>(token) * num_ranks;
    if ((token - range.begin) % num_workers == worker) {
      int num_holders = 0;
      for (int r = 0; r < num_ranks && !failed; ++r) {
        if (!holds[r]) continue;
        const int32_t slot_index = ctx.shared_load(&progress[r]);
        if (ctx.shared_load(&seen_tail[r]) <= slot_index) {
          const WaitSite site{kCombine, kReceiver, rank, channel, r, kTail};
          const int32_t seen = ctx.wait_ge(l.tail(my_buffer, r, channel), slot_index + 1, site);
          failed = seen < 0;
          ctx.warp_sync();
          if (ctx.lane() == 0) ctx.shared_store(&seen_tail[r], seen);
        }
        char* slot = l.slot(my_buffer, r, channel, slot_index);
        if (ctx.lane() == 0) {
          st->rows[worker][num_holders] = slot;
          st->scales[worker][num_holders] = ctx.queue_f32(slot + s.aux_offset);
        }
        ++num_holders;
      }
      if (failed) break;
      ctx.warp_sync();
      ctx.template reduce_rows<T>(me.out + static_cast<int64_t>(token) * s.x_bytes, st->rows[worker],
                                  st->scales[worker], num_holders, s.x_bytes);
      ctx.warp_sync();
      if (cm.l2_discard) {  // before the progress below lets the coordinator free these slots
        for (int h = 0; h < num_holders; ++h) ctx.discard(st->rows[worker][h], l.slot_bytes);
        ctx.warp_sync();
      }
    }
    // Past this token: its rows (mine reduced above, others' not my business) are released.
    ctx.fence_block();
    for (int r = ctx.lane(); r < num_ranks; r += ctx.width())
      if (holds[r]) ctx.shared_store(&progress[r], ctx.shared_load(&progress[r]) + 1);
    ctx.warp_sync();
  }
  ctx.fence_block();
  if (ctx.lane() == 0) ctx.shared_add(&st->done, 1);
}

// Coordinator (source rank, channel): publishes head = min over workers of progress; before
// the final head of a queue it resets that queue's tail (see intranode.cuh).
template <class Ctx>
MOE_ROLE void combine_recv_coordinator(Ctx& ctx, const CombineArgs& a, int rank, int channel, int num_workers,
                                       CombineRecvState* st) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int num_ranks = cm.num_ranks;
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  for (int r = ctx.lane(); r < num_ranks; r += ctx.width()) {
    int32_t total = 0;
    for (int token = range.begin; token < range.end; ++token)
      total += me.is_token_in_rank[static_cast<int64_t>(token) * num_ranks + r];
    st->total[r] = total;
    st->published[r] = 0;
  }
  ctx.warp_sync();
  for (;;) {
    const bool finished = ctx.shared_load(&st->done) == num_workers;
    ctx.fence_block();
    for (int r = ctx.lane(); r < num_ranks; r += ctx.width()) {
      int32_t freed = st->total[r];
      for (int w = 0; w < num_workers; ++w) {
        const int32_t p = ctx.shared_load(&st->progress[w][r]);
        freed = p < freed ? p : freed;
      }
      if (freed > st->published[r]) {
        if (freed == st->total[r]) ctx.store_relaxed(l.tail(cm.buffers[rank], r, channel), 0);
        ctx.store_release(l.head(cm.buffers[r], rank, channel), freed);
        st->published[r] = freed;
      }
    }
    if (finished) break;
  }
}

}  // namespace intranode
}  // namespace moe_dispatch

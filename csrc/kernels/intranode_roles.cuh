// The intranode protocol itself: what each warp (group) of the notify, dispatch and combine
// kernels does, over the ring loops of ring.cuh (whose Ctx contract this code uses). The same
// code runs on the GPU (intranode_device.cuh) and on the CPU (intranode_host.h). See
// intranode.cuh for the layout and the protocol in prose, header.cuh for the header check.
//
// Every role takes `epoch`, its rank's op epoch when the launch began (intranode.cuh): the
// header lines of this operation have parity epoch % 2.
#pragma once

#include "kernels/intranode.cuh"
#include "kernels/ring.cuh"

namespace moe_dispatch {
namespace intranode {

using ring::GroupState;
using CombineRecvState = ring::ReduceState<kMaxRanks>;

struct NotifyState {
  int32_t counts[kMaxRanks * kMaxChannels];
  int32_t ok[kMaxRanks];
  int32_t stop;
};

// NVLink ring (src -> dst, channel) of intranode.cuh as the loops of ring.cuh see it: it lives
// in dst's buffer, its tail too; its head in src's. `index` is src's ring index in dst's
// buffer, `peer` dst's head index in src's (the fused internode path numbers both locally).
struct NvlQueue {
  const BufferLayout* layout;
  char* ring_buffer;  // dst's buffer
  int32_t* tail;
  int32_t* head;
  int index;
  int channel;
  WaitSite site;

  MOE_ROLE char* slot(int64_t i) const { return layout->slot(ring_buffer, index, channel, i); }
  template <class Ctx>
  MOE_ROLE int64_t wait_room(Ctx& ctx, int64_t target) const {
    return ctx.wait_ge(head, static_cast<int32_t>(target), site);
  }
  template <class Ctx>
  MOE_ROLE void publish(Ctx& ctx, int64_t begin, int count) const {
    if (ctx.lane() == 0) ctx.store_release(tail, static_cast<int32_t>(begin + count));
  }
  template <class Ctx>
  MOE_ROLE void finish(Ctx& ctx, int64_t total) const {
    const int32_t seen = ctx.wait_ge(head, static_cast<int32_t>(total), site);
    if (ctx.lane() == 0 && seen >= 0) ctx.store_relaxed(head, 0);
  }
  template <class Ctx>
  MOE_ROLE int64_t wait_data(Ctx& ctx, int64_t target) const {
    return ctx.wait_ge(tail, static_cast<int32_t>(target), site);
  }
  // Before the final head: reset my tail (no further tail store can come in this operation).
  template <class Ctx>
  MOE_ROLE void release(Ctx& ctx, int64_t consumed, bool final) const {
    if (final) ctx.store_relaxed(tail, 0);
    ctx.store_release(head, static_cast<int32_t>(consumed));
  }
};

// The ring src -> dst of channel c over the buffers of src and dst; `site` names the wait.
MOE_ROLE NvlQueue nvl_queue(const BufferLayout& l, char* src_buffer, char* dst_buffer, int src, int dst, int channel,
                            const WaitSite& site) {
  return {&l, dst_buffer, l.tail(dst_buffer, src, channel), l.head(src_buffer, dst, channel), src, channel, site};
}

// ---- the header check -------------------------------------------------------------------------

// Warp: the verdict for the pair (rank, peer): 1 move rows, 0 not, -1 a wait failed. From the
// notify's verdicts (peer_ok), or from the peers' header lines of this epoch: `write` puts this
// rank's line to the peer first (one writer per pair and operation), `record` offers a mismatch.
// Cost of the exchange (a cached dispatch, a combine): per pair one 128-byte line stored into the
// peer's buffer and a poll of the line the peer stored here: one signal round in the same
// launch, which the senders' first chunk would wait for anyway, no extra kernel.
template <class Ctx>
MOE_ROLE int32_t pair_verdict(Ctx& ctx, const Common& cm, const Check& check, const int32_t* peer_ok, int rank,
                              int peer, uint64_t epoch, bool write, bool record, const WaitSite& site) {
  int32_t v = 0;
  if (ctx.lane() == 0) {
    if (peer_ok != nullptr) {
      v = peer_ok[peer];
    } else {
      if (write) ring::put_header_line(ctx, cm.layout.header(cm.buffers[peer], epoch, rank), check.header, epoch, nullptr);
      int64_t theirs[kHeaderLineWords];
      v = ring::get_header_line(ctx, cm.layout.header(cm.buffers[rank], epoch, peer), epoch, site, theirs)
              ? ring::judge(ctx, check, rank, peer, theirs, record)
              : -1;
    }
  }
  return ctx.broadcast(v);
}

// Warp: bit p set where the pair (rank, p) agrees, over every peer's header line of this epoch
// (written by the peers' senders); 0 when a wait failed (the timeout is recorded: no rows move).
template <class Ctx>
MOE_ROLE uint64_t agreeing_peers(Ctx& ctx, const Common& cm, const Check& check, int rank, uint64_t epoch,
                                 bool record, WaitSite site) {
  uint64_t ok = 0, failed = 0;
  for (int p = ctx.lane(); p < cm.num_ranks; p += ctx.width()) {
    site.peer = p;
    int64_t theirs[kHeaderLineWords];
    if (!ring::get_header_line(ctx, cm.layout.header(cm.buffers[rank], epoch, p), epoch, site, theirs)) {
      failed |= uint64_t{1} << p;
    } else if (ring::judge(ctx, check, rank, p, theirs, record)) {
      ok |= uint64_t{1} << p;
    }
  }
  return ctx.warp_or(failed) != 0 ? 0 : ctx.warp_or(ok);
}

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

// Exchanges the per-(source, channel) counts and the headers, writes this rank's receive
// prefix and its verdict on every peer (peer_ok; a refused pair's counts read as 0).
template <class Ctx>
MOE_ROLE void notify(Ctx& ctx, const NotifyArgs& a, int rank, uint64_t epoch, NotifyState* st) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const NotifyRank& me = a.ranks[rank - cm.rank_begin];
  const int num_ranks = cm.num_ranks, num_channels = cm.num_channels;
  const int num_queues = num_ranks * num_channels;
  if (ctx.tid() == 0) ctx.shared_store(&st->stop, 0);
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) st->counts[i] = 0;
  // 1. Everyone is done reading the previous operation's meta and header lines.
  if (!rank_barrier(ctx, cm, rank, st)) return;
  // 2. counts[d][c]: my tokens of channel c that rank d holds.
  const int64_t num_flags = static_cast<int64_t>(me.num_tokens) * num_ranks;
  for (int64_t i = ctx.tid(); i < num_flags; i += ctx.num_threads()) {
    if (!me.is_token_in_rank[i]) continue;
    const int token = static_cast<int>(i / num_ranks), dst = static_cast<int>(i % num_ranks);
    ctx.shared_add(&st->counts[dst * num_channels + channel_of_token(me.num_tokens, num_channels, token)], 1);
  }
  ctx.block_sync();
  // 3. Into every destination's meta[me][c] and header line; the barrier's release publishes them.
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) {
    const int dst = i / num_channels, channel = i % num_channels;
    ctx.store_relaxed(l.meta(cm.buffers[dst], rank, channel), ctx.shared_load(&st->counts[i]));
  }
  for (int p = ctx.tid(); p < num_ranks; p += ctx.num_threads())
    ring::put_header_line(ctx, l.header(cm.buffers[p], epoch, rank), me.check.header, epoch, nullptr);
  if (!rank_barrier(ctx, cm, rank, st)) return;
  // 4. Verdicts, then my meta[s][c] in (source, channel) order -> exclusive prefix = first row.
  for (int p = ctx.tid(); p < num_ranks; p += ctx.num_threads()) {
    const WaitSite site{kNotify, kBarrier, rank, -1, p, kHeader};
    int64_t theirs[kHeaderLineWords];
    const int32_t ok = ring::get_header_line(ctx, l.header(cm.buffers[rank], epoch, p), epoch, site, theirs)
                           ? ring::judge(ctx, me.check, rank, p, theirs, true)
                           : 0;
    st->ok[p] = ok;
    me.peer_ok[p] = ok;
  }
  ctx.block_sync();
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads())
    st->counts[i] = st->ok[i / num_channels] ? ctx.load_acquire(l.meta(cm.buffers[rank], i / num_channels,
                                                                        i % num_channels)) : 0;
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
template <class Ctx, class Rank>
MOE_ROLE void write_dispatch_slot(Ctx& ctx, const SlotLayout& s, int experts_per_rank, const Rank& me, int dst,
                                  int token, char* slot) {
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
// dropped and flagged. The slot's top-k ids become id - expert_base where that lies in
// [0, experts_per_rank), else -1 (weights 0 there): slots bound for this rank pass base 0; the
// fused forwarder's own rows pass node-local ids and its first expert.
template <class Ctx, class Rank>
MOE_ROLE void read_dispatch_slot(Ctx& ctx, const SlotLayout& s, const Rank& me, const char* slot, int row,
                                 int expert_base, int experts_per_rank) {
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
    const int32_t id = ctx.queue_i32(slot + s.topk_idx_offset + 4 * k);
    const int32_t local = (id >= 0 && id - expert_base >= 0 && id - expert_base < experts_per_rank) ? id - expert_base : -1;
    me.recv_topk_idx[entry] = local;
    if (me.recv_topk_weights != nullptr)
      me.recv_topk_weights[entry] = local >= 0 ? ctx.queue_f32(slot + s.topk_weights_offset + 4 * k) : 0.0f;
    if (local >= 0) ctx.count_add(me.num_recv_per_expert + local, 1);
  }
  if (ctx.lane() == 0 && me.recv_src_idx != nullptr) me.recv_src_idx[row] = ctx.queue_i32(slot + s.aux_offset);
}

// Warp 0 of a group settles the pair's verdict; false (every warp leaves) when the pair moves
// no rows or a wait failed.
template <class Ctx>
MOE_ROLE bool group_verdict(Ctx& ctx, const Common& cm, const Check& check, const int32_t* peer_ok, int rank,
                            int peer, uint64_t epoch, bool write, bool record, const WaitSite& site, int warp,
                            GroupState* gs) {
  if (warp == 0) {
    const int32_t v = pair_verdict(ctx, cm, check, peer_ok, rank, peer, epoch, write, record, site);
    if (ctx.lane() == 0) ctx.shared_store(&gs->verdict, v == 1);
  }
  ctx.group_sync();
  const bool ok = ctx.shared_load(&gs->verdict) == 1;
  ctx.group_sync();  // read by all before warp 0 may settle the group's next pair
  return ok;
}

// Sender group (rank -> dst, channel): `warp` of `group_warps` warps. Entry i goes to warp
// i % group_warps; warp 0 waits and publishes. Channel 0's group writes the header line.
template <class Ctx>
MOE_ROLE void dispatch_send(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int dst, int warp,
                            int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  if (!group_verdict(ctx, cm, me.check, me.peer_ok, rank, dst, epoch, channel == 0, false,
                     WaitSite{kDispatch, kSender, rank, channel, dst, kHeader}, warp, gs))
    return;
  const NvlQueue q = nvl_queue(l, cm.buffers[rank], cm.buffers[dst], rank, dst, channel,
                               WaitSite{kDispatch, kSender, rank, channel, dst, kHead});
  ring::send_selected(
      ctx, q, l.num_slots, cm.chunk_tokens, channel_token_range(me.num_tokens, cm.num_channels, channel),
      [&](int token) { return me.is_token_in_rank[static_cast<int64_t>(token) * cm.num_ranks + dst]; },
      [&](int token, char* slot) { write_dispatch_slot(ctx, a.slot, a.experts_per_rank, me, dst, token, slot); },
      warp, group_warps, gs);
}

// Receiver group (src -> rank, channel): rows prefix[src][c] + i. Channel 0's group records a
// mismatch of a cached dispatch (notify recorded a fresh one's).
template <class Ctx>
MOE_ROLE void dispatch_recv(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int src, int warp,
                            int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  if (!group_verdict(ctx, cm, me.check, me.peer_ok, rank, src, epoch, false, channel == 0,
                     WaitSite{kDispatch, kReceiver, rank, channel, src, kHeader}, warp, gs))
    return;
  const int queue = src * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const NvlQueue q = nvl_queue(l, cm.buffers[src], cm.buffers[rank], src, rank, channel,
                               WaitSite{kDispatch, kReceiver, rank, channel, src, kTail});
  ring::recv_entries(
      ctx, q, me.recv_prefix[queue + 1] - first_row,
      [&](char* slot, int64_t i) {
        read_dispatch_slot(ctx, a.slot, me, slot, first_row + static_cast<int>(i), 0, a.experts_per_rank);
        if (cm.l2_discard) {
          ctx.warp_sync();                  // every lane's reads of the slot are done
          ctx.discard(slot, l.slot_bytes);  // the slot's whole stride: what the call leaves unused is dead too
        }
      },
      warp, group_warps, gs);
}

// ---- combine ----------------------------------------------------------------------------------

// A row of y with its row scale into a combine slot (warp); a row at or past num_rows (budget
// mode: a dropped receive) goes as zeros with scale 1.
template <class Ctx>
MOE_ROLE void write_combine_slot(Ctx& ctx, const SlotLayout& s, const char* y, const float* row_scale, int64_t row,
                                 int num_rows, char* slot) {
  const bool stored = row < num_rows;
  if (stored) {
    ctx.copy_in(slot, y + row * s.x_bytes, s.x_bytes);
  } else {
    ctx.zero_row(slot, s.x_bytes);
  }
  if (ctx.lane() == 0)
    *reinterpret_cast<float*>(slot + s.aux_offset) = (stored && row_scale != nullptr) ? row_scale[row] : 1.0f;
}

// Sender group (holder rank -> dst = the rows' source, channel): rows
// [prefix[dst][c], prefix[dst][c+1]) of y, in order, with their row scale.
template <class Ctx>
MOE_ROLE void combine_send(Ctx& ctx, const CombineArgs& a, int rank, int channel, int dst, int warp,
                           int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& l = cm.layout;
  const SlotLayout& s = a.slot;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  if (!group_verdict(ctx, cm, me.check, nullptr, rank, dst, epoch, channel == 0, false,
                     WaitSite{kCombine, kSender, rank, channel, dst, kHeader}, warp, gs))
    return;
  const int queue = dst * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const NvlQueue q = nvl_queue(l, cm.buffers[rank], cm.buffers[dst], rank, dst, channel,
                               WaitSite{kCombine, kSender, rank, channel, dst, kHead});
  ring::send_entries(
      ctx, q, l.num_slots, cm.chunk_tokens, me.recv_prefix[queue + 1] - first_row,
      [&](int64_t i, char* slot) { write_combine_slot(ctx, s, me.y, me.row_scale, first_row + i, me.num_rows, slot); },
      warp, group_warps, gs);
}

// The combine receiver (source rank, channel) as ring::reduce_worker sees it: the channel's
// tokens round robin over the workers, holders in ascending rank among the agreeing peers.
struct CombineSource {
  const Common* cm;
  const SlotLayout* s;
  const CombineRank* me;
  TokenRange range;
  int rank;
  int channel;
  uint64_t agree;  // bit p: the pair (rank, p) moves rows

  MOE_ROLE int num_tokens() const { return range.end - range.begin; }
  MOE_ROLE int num_peers() const { return cm->num_ranks; }
  MOE_ROLE bool holds(int i, int p) const {
    return ((agree >> p) & 1u) && me->is_token_in_rank[static_cast<int64_t>(range.begin + i) * cm->num_ranks + p];
  }
  MOE_ROLE bool owns(int i, int worker, int num_workers) const { return i % num_workers == worker; }
  template <class Ctx>
  MOE_ROLE bool begin(Ctx&, int) const { return true; }
  template <class Ctx>
  MOE_ROLE int64_t wait(Ctx& ctx, int p, int64_t target) const {
    return ctx.wait_ge(cm->layout.tail(cm->buffers[rank], p, channel), static_cast<int32_t>(target),
                       WaitSite{kCombine, kReceiver, rank, channel, p, kTail});
  }
  template <class Ctx>
  MOE_ROLE char* row(Ctx&, int p, int64_t index, int) const {
    return cm->layout.slot(cm->buffers[rank], p, channel, index);
  }
  template <class Ctx>
  MOE_ROLE float scale(Ctx& ctx, int, const char* row, int64_t, int) const {
    return ctx.queue_f32(row + s->aux_offset);
  }
  MOE_ROLE char* out(int i) const { return me->out + static_cast<int64_t>(range.begin + i) * s->x_bytes; }
  template <class Ctx>
  MOE_ROLE void after(Ctx& ctx, int, char* const* rows, int num_rows) const {
    if (!cm->l2_discard) return;
    for (int h = 0; h < num_rows; ++h) ctx.discard(rows[h], cm->layout.slot_bytes);
    ctx.warp_sync();
  }
  // Before the final head of a queue: reset its tail (see intranode.cuh).
  template <class Ctx>
  MOE_ROLE void free(Ctx& ctx, int p, int32_t freed, bool final) const {
    if (final) ctx.store_relaxed(cm->layout.tail(cm->buffers[rank], p, channel), 0);
    ctx.store_release(cm->layout.head(cm->buffers[p], rank, channel), freed);
  }
};

// Warp: the receiver block's view of this launch (coordinator or worker), after the header
// check: every warp reads every peer's header line; the coordinator of channel 0 records.
template <class Ctx>
MOE_ROLE CombineSource combine_source(Ctx& ctx, const CombineArgs& a, int rank, int channel, uint64_t epoch,
                                      bool coordinator) {
  const Common& cm = a.common;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const uint64_t agree = agreeing_peers(ctx, cm, me.check, rank, epoch, coordinator && channel == 0,
                                        WaitSite{kCombine, coordinator ? kCoordinator : kReceiver, rank, channel, 0,
                                                 kHeader});
  return {&cm, &a.slot, &me, channel_token_range(me.num_tokens, cm.num_channels, channel), rank, channel, agree};
}

}  // namespace intranode
}  // namespace moe_dispatch

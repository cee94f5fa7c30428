// Stage 1 of the internode protocol (internode.cuh): what each warp (group) of the node
// notify, node dispatch and node combine kernels does, written once against a context `Ctx`:
//   - GPU loopback: peer stores into the other simulated ranks' buffers (internode_kernels.cu),
//   - GPU NVSHMEM: put-with-signal and signal ops to the PEs of the same local index,
//   - CPU (internode_cpu.cpp): memcpy + release store of the signal, threads for warps.
// Stage 2 is intranode_roles.cuh itself.
//
// Ctx contract: the intranode one (intranode_roles.cuh), plus
//   char* buffer(int rank)                      this launched rank's RDMA buffer (NVSHMEM: symmetric)
//   uint64_t load_local(const uint64_t*)        lane; a word only this rank writes
//   void store_local(uint64_t*, uint64_t)       lane
//   int64_t wait_signal(sig, target, site)      warp; bounded: *sig >= target, or -1
//   int64_t wait_signal_lane(sig, target, site) lane
//   void put_signal(rank, peer, dst, src, bytes, sig, value)
//                                               warp; dst, sig are addresses in `rank`'s buffer that
//                                               name the same offsets in `peer`'s: copy, then SET sig
//   void put_signal_lane(...)                   lane; same, src reusable on return
//   void signal_set(rank, peer, sig, value)     lane; SET `peer`'s signal
//   void reset_signal(uint64_t*)                lane; zero my own signal; ordered before any later
//                                               signal of this thread
#pragma once

#include "kernels/internode.cuh"
#include "kernels/intranode_roles.cuh"

namespace moe_dispatch {
namespace internode {

using intranode::channel_of_token;
using intranode::channel_token_range;
using intranode::GroupState;
using intranode::TokenRange;
using intranode::WaitSite;

struct NotifyState {
  int32_t counts[kNotifyThreads];
  int32_t stop;
};

// The source's combine receiver block (see intranode::CombineRecvState), over nodes.
struct CombineRecvState {
  int32_t progress[kNumWarps][kMaxNodes];
  int32_t seen_tail[kNumWarps][kMaxNodes];
  float scales[kNumWarps][kMaxNodes];
  char* rows[kNumWarps][kMaxNodes];
  int32_t total[kMaxNodes];
  int32_t published[kMaxNodes];
  int32_t done;
};

// ---- node notify ------------------------------------------------------------------------------

// Exchanges per-(source node, channel) token counts along the rail and writes the stage-1
// receive prefix [N * C + 1] (rows ordered by source node, then channel).
template <class Ctx>
MOE_ROLE void node_notify(Ctx& ctx, const NotifyArgs& a, int rank, NotifyState* st) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const NotifyRank& me = a.ranks[rank - cm.rank_begin];
  const int num_nodes = cm.num_nodes, num_channels = cm.num_channels;
  const int num_queues = num_nodes * num_channels;
  const int my_node = rank / cm.ranks_per_node;
  char* buf = ctx.buffer(rank);
  const uint64_t epoch = ctx.load_local(l.epoch(buf));
  const int parity = static_cast<int>(epoch & 1u);
  if (ctx.tid() == 0) ctx.shared_store(&st->stop, 0);
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) st->counts[i] = 0;
  ctx.block_sync();
  const int64_t num_flags = static_cast<int64_t>(me.num_tokens) * num_nodes;
  for (int64_t i = ctx.tid(); i < num_flags; i += ctx.num_threads()) {
    if (!me.is_token_in_rank[i]) continue;
    const int token = static_cast<int>(i / num_nodes), dst = static_cast<int>(i % num_nodes);
    ctx.shared_add(&st->counts[dst * num_channels + channel_of_token(me.num_tokens, num_channels, token)], 1);
  }
  ctx.block_sync();
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads())
    l.meta_out(buf, parity, i / num_channels)[i % num_channels] = ctx.shared_load(&st->counts[i]);
  ctx.block_sync();
  for (int p = ctx.tid(); p < num_nodes; p += ctx.num_threads())
    ctx.put_signal_lane(rank, rail_peer(cm, rank, p), reinterpret_cast<char*>(l.meta(buf, parity, my_node)),
                        reinterpret_cast<const char*>(l.meta_out(buf, parity, p)), 4 * num_channels,
                        l.arrive(buf, parity, my_node), epoch + 1);
  for (int p = ctx.tid(); p < num_nodes; p += ctx.num_threads()) {
    const WaitSite site{kNodeNotify, intranode::kBarrier, rank, -1, rail_peer(cm, rank, p), intranode::kSignal};
    if (ctx.wait_signal_lane(l.arrive(buf, parity, p), epoch + 1, site) < 0) ctx.shared_store(&st->stop, 1);
  }
  ctx.block_sync();
  if (ctx.shared_load(&st->stop)) return;
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads())
    st->counts[i] = ctx.queue_i32(reinterpret_cast<const char*>(l.meta(buf, parity, i / num_channels) +
                                                                i % num_channels));
  ctx.block_sync();
  const int32_t total = ctx.block_exclusive_scan(st->counts, num_queues);
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) me.recv_prefix[i] = st->counts[i];
  if (ctx.tid() == 0) {
    me.recv_prefix[num_queues] = total;
    *me.num_recv_tokens = total;
    *me.overflow = 0;
    ctx.store_local(l.epoch(buf), epoch + 1);
  }
}

// ---- node dispatch ----------------------------------------------------------------------------

// Sender group (rank -> dst_node's forwarder, channel): stages chunks, puts each with its tail.
template <class Ctx>
MOE_ROLE void node_dispatch_send(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int dst_node, int warp,
                                 int group_warps, GroupState* gs) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  const int my_node = rank / cm.ranks_per_node, peer = rail_peer(cm, rank, dst_node);
  const int stride = a.slot.slot_bytes;
  char* buf = ctx.buffer(rank);
  uint64_t* head = l.head(buf, dst_node, channel);
  const WaitSite site{kNodeDispatch, intranode::kSender, rank, channel, peer, intranode::kHead};
  int sent = 0;
  for (int token = range.begin; token < range.end;) {
    if (warp == 0) {  // room for a whole chunk: entries [sent, sent + K) are free
      const int64_t target = static_cast<int64_t>(sent) + cm.chunk_tokens - l.num_slots;
      const int64_t seen = target > 0 ? ctx.wait_signal(head, target, site) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    int count = 0;
    for (; token < range.end && count < cm.chunk_tokens; ++token) {
      if (!me.is_token_in_rank[static_cast<int64_t>(token) * cm.num_nodes + dst_node]) continue;
      if ((sent + count) % group_warps == warp)
        intranode::write_dispatch_slot(ctx, a.slot, a.experts_per_node, me, dst_node, token,
                                       l.send_slot(buf, dst_node, channel, sent + count, stride));
      ++count;
    }
    ctx.group_sync();
    if (warp == 0 && count > 0)
      ctx.put_signal(rank, peer, l.recv_slot(buf, my_node, channel, sent, stride),
                     l.send_slot(buf, dst_node, channel, sent, stride), static_cast<int64_t>(count) * stride,
                     l.tail(buf, my_node, channel), static_cast<uint64_t>(sent + count));
    sent += count;
  }
  if (warp == 0 && sent > 0) {  // everything consumed: zero my head for the next operation
    const int64_t seen = ctx.wait_signal(head, sent, site);
    if (ctx.lane() == 0 && seen >= 0) ctx.reset_signal(head);
  }
}

// Receiver group (src_node's rank of my rail -> me, channel): rows prefix[src][c] + i.
template <class Ctx>
MOE_ROLE void node_dispatch_recv(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int src_node, int warp,
                                 int group_warps, GroupState* gs) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int queue = src_node * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const int num_entries = me.recv_prefix[queue + 1] - first_row;
  const int my_node = rank / cm.ranks_per_node, peer = rail_peer(cm, rank, src_node);
  const int stride = a.slot.slot_bytes;
  char* buf = ctx.buffer(rank);
  uint64_t* tail = l.tail(buf, src_node, channel);
  const WaitSite site{kNodeDispatch, intranode::kReceiver, rank, channel, peer, intranode::kTail};
  for (int consumed = 0; consumed < num_entries;) {
    if (warp == 0) {
      const int64_t seen = ctx.wait_signal(tail, consumed + 1, site);
      if (ctx.lane() == 0) {
        ctx.shared_store(&gs->value, static_cast<int32_t>(seen));
        ctx.shared_store(&gs->stop, seen < 0);
      }
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    const int available = ctx.shared_load(&gs->value);
    for (int i = consumed + warp; i < available; i += group_warps)
      intranode::read_dispatch_slot(ctx, a.slot, me, l.recv_slot(buf, src_node, channel, i, stride), first_row + i);
    ctx.group_sync();
    if (warp == 0 && ctx.lane() == 0) {
      if (available == num_entries) ctx.reset_signal(tail);  // before the final head
      ctx.signal_set(rank, peer, l.head(buf, my_node, channel), static_cast<uint64_t>(available));
    }
    consumed = available;
  }
}

// ---- node combine -----------------------------------------------------------------------------

// Sender group (forwarder rank -> dst_node's source rank, channel): the node partials of the
// rows received from (dst_node, channel), in order, one put per chunk.
template <class Ctx>
MOE_ROLE void node_combine_send(Ctx& ctx, const CombineArgs& a, int rank, int channel, int dst_node, int warp,
                                int group_warps, GroupState* gs) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int queue = dst_node * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const int num_entries = me.recv_prefix[queue + 1] - first_row;
  const int my_node = rank / cm.ranks_per_node, peer = rail_peer(cm, rank, dst_node);
  const int stride = a.slot.slot_bytes, row_bytes = a.slot.x_bytes;
  char* buf = ctx.buffer(rank);
  uint64_t* head = l.head(buf, dst_node, channel);
  const WaitSite site{kNodeCombine, intranode::kSender, rank, channel, peer, intranode::kHead};
  for (int sent = 0; sent < num_entries;) {
    const int count = num_entries - sent < cm.chunk_tokens ? num_entries - sent : cm.chunk_tokens;
    if (warp == 0) {
      const int64_t target = static_cast<int64_t>(sent) + count - l.num_slots;
      const int64_t seen = target > 0 ? ctx.wait_signal(head, target, site) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) return;
    for (int i = sent + warp; i < sent + count; i += group_warps)
      ctx.copy_in(l.send_slot(buf, dst_node, channel, i, stride), me.y + static_cast<int64_t>(first_row + i) * row_bytes,
                  row_bytes);
    ctx.group_sync();
    if (warp == 0)
      ctx.put_signal(rank, peer, l.recv_slot(buf, my_node, channel, sent, stride),
                     l.send_slot(buf, dst_node, channel, sent, stride), static_cast<int64_t>(count) * stride,
                     l.tail(buf, my_node, channel), static_cast<uint64_t>(sent + count));
    sent += count;
  }
  if (warp == 0 && num_entries > 0) {
    const int64_t seen = ctx.wait_signal(head, num_entries, site);
    if (ctx.lane() == 0 && seen >= 0) ctx.reset_signal(head);
  }
}

// Worker `worker` of `num_workers` on the source (rank, channel): tokens i % num_workers ==
// worker of the channel, node partials summed in ascending node order (fp32, scale 1: exact
// steps), rounded once into out.
template <class T, class Ctx>
MOE_ROLE void node_combine_recv_worker(Ctx& ctx, const CombineArgs& a, int rank, int channel, int worker,
                                       int num_workers, CombineRecvState* st) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int num_nodes = cm.num_nodes, stride = a.slot.slot_bytes, row_bytes = a.slot.x_bytes;
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  char* buf = ctx.buffer(rank);
  int32_t* progress = st->progress[worker];
  int32_t* seen_tail = st->seen_tail[worker];
  bool failed = false;
  for (int token = range.begin; token < range.end && !failed; ++token) {
    const bool* holds = me.is_token_in_rank + static_cast<int64_t>(token) * num_nodes;
    if ((token - range.begin) % num_workers == worker) {
      int num_holders = 0;
      for (int n = 0; n < num_nodes && !failed; ++n) {
        if (!holds[n]) continue;
        const int32_t slot_index = ctx.shared_load(&progress[n]);
        if (ctx.shared_load(&seen_tail[n]) <= slot_index) {
          const WaitSite site{kNodeCombine, intranode::kReceiver, rank, channel, rail_peer(cm, rank, n),
                              intranode::kTail};
          const int64_t seen = ctx.wait_signal(l.tail(buf, n, channel), slot_index + 1, site);
          failed = seen < 0;
          ctx.warp_sync();
          if (ctx.lane() == 0) ctx.shared_store(&seen_tail[n], static_cast<int32_t>(seen));
        }
        if (ctx.lane() == 0) {
          st->rows[worker][num_holders] = l.recv_slot(buf, n, channel, slot_index, stride);
          st->scales[worker][num_holders] = 1.0f;
        }
        ++num_holders;
      }
      if (failed) break;
      ctx.warp_sync();
      ctx.template reduce_rows<T>(me.out + static_cast<int64_t>(token) * row_bytes, st->rows[worker],
                                  st->scales[worker], num_holders, row_bytes);
      ctx.warp_sync();
    }
    ctx.fence_block();
    for (int n = ctx.lane(); n < num_nodes; n += ctx.width())
      if (holds[n]) ctx.shared_store(&progress[n], ctx.shared_load(&progress[n]) + 1);
    ctx.warp_sync();
  }
  ctx.fence_block();
  if (ctx.lane() == 0) ctx.shared_add(&st->done, 1);
}

// Coordinator (source rank, channel): SETs each forwarder's head to the slots every worker is
// past; zeroes a ring's tail before its final head.
template <class Ctx>
MOE_ROLE void node_combine_recv_coordinator(Ctx& ctx, const CombineArgs& a, int rank, int channel, int num_workers,
                                            CombineRecvState* st) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int num_nodes = cm.num_nodes, my_node = rank / cm.ranks_per_node;
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  char* buf = ctx.buffer(rank);
  for (int n = ctx.lane(); n < num_nodes; n += ctx.width()) {
    int32_t total = 0;
    for (int token = range.begin; token < range.end; ++token)
      total += me.is_token_in_rank[static_cast<int64_t>(token) * num_nodes + n];
    st->total[n] = total;
    st->published[n] = 0;
  }
  ctx.warp_sync();
  for (;;) {
    const bool finished = ctx.shared_load(&st->done) == num_workers;
    ctx.fence_block();
    for (int n = ctx.lane(); n < num_nodes; n += ctx.width()) {
      int32_t freed = st->total[n];
      for (int w = 0; w < num_workers; ++w) {
        const int32_t p = ctx.shared_load(&st->progress[w][n]);
        freed = p < freed ? p : freed;
      }
      if (freed > st->published[n]) {
        if (freed == st->total[n]) ctx.reset_signal(l.tail(buf, n, channel));
        ctx.signal_set(rank, rail_peer(cm, rank, n), l.head(buf, my_node, channel), static_cast<uint64_t>(freed));
        st->published[n] = freed;
      }
    }
    if (finished) break;
  }
}

}  // namespace internode
}  // namespace moe_dispatch

// Stage 1 of the internode protocol (internode.cuh) for both pipelines: the RDMA-side Ctx
// contract, the rail header helpers, and the staged pipeline's node notify, node dispatch and
// node combine (over the ring loops of ring.cuh). The fused pipeline's roles, which use the
// helpers here, are in internode_fused_roles.cuh. Contexts:
//   - GPU loopback: peer stores into the other simulated ranks' buffers (internode_device.cuh),
//   - GPU NVSHMEM: put-with-signal and signal ops to the PEs of the same local index,
//   - CPU (internode_cpu.cpp): memcpy + release store of the signal, threads for warps.
//
// Ctx contract: ring.cuh's, plus
//   char* buffer(int rank)                      this launched rank's RDMA buffer (NVSHMEM: symmetric)
//   uint64_t load_local(const uint64_t*)        lane; a word only this rank writes
//   void store_local(uint64_t*, uint64_t)       lane
//   int64_t wait_signal(sig, target, site)      warp; bounded: *sig >= target, or -1
//   int64_t wait_signal_lane(sig, target, site) lane
//   bool signal_reached(sig, value)             lane; one poll: *sig >= value (acquire; NVSHMEM also
//                                               completes its consistency step once true)
//   void put_signal(rank, peer, dst, src, bytes, sig, value)
//                                               warp; dst, sig are addresses in `rank`'s buffer that
//                                               name the same offsets in `peer`'s: copy, then SET sig
//   void put_signal_lane(...)                   lane; same, src reusable on return
//   void signal_set(rank, peer, sig, value)     lane; SET `peer`'s signal
//   void signal_add_at(rank, peer, sig, value)  lane; ADD to `peer`'s signal
//   void reset_signal(uint64_t*)                lane; zero my own signal; ordered before any later
//                                               signal of this thread
#pragma once

#include "kernels/internode.cuh"
#include "kernels/intranode_roles.cuh"

namespace moe_dispatch {
namespace internode {

using intranode::channel_of_token;
using intranode::channel_token_range;
using intranode::TokenRange;
using intranode::WaitSite;
using ring::GroupState;
using CombineRecvState = ring::ReduceState<kMaxNodes>;

struct NotifyState {
  int32_t counts[kNotifyThreads];
  int32_t ok[kMaxNodes];
  int32_t stop;
};

// ---- rail header lines (exchange operations) ----------------------------------------------

// Lane: this rank's header line to its rail peer on node m (staged in header_out[m] first).
template <class Ctx>
MOE_ROLE void put_rail_header(Ctx& ctx, const Common& cm, const Check& check, int rank, int m, uint64_t epoch) {
  const RdmaLayout& l = cm.layout;
  char* buf = ctx.buffer(rank);
  int64_t* out = l.header_out(buf, m);
  for (int w = 0; w < kHeaderWords; ++w) out[w] = check.header.w[w];
  int64_t* line = l.header(buf, epoch, rank / cm.ranks_per_node);  // my line, at the peer
  ctx.put_signal_lane(rank, rail_peer(cm, rank, m), reinterpret_cast<char*>(line), reinterpret_cast<const char*>(out),
                      8 * kHeaderWords, reinterpret_cast<uint64_t*>(line + kMarkerWord), epoch + 1);
}

// Lane: the header line of my rail peer on node m for this epoch, into theirs[kHeaderWords];
// false when the wait timed out.
template <class Ctx>
MOE_ROLE bool get_rail_header(Ctx& ctx, const Common& cm, int rank, int m, uint64_t epoch, const WaitSite& site,
                              int64_t* theirs) {
  int64_t* line = cm.layout.header(ctx.buffer(rank), epoch, m);
  if (ctx.wait_signal_lane(reinterpret_cast<uint64_t*>(line + kMarkerWord), static_cast<int64_t>(epoch + 1), site) < 0)
    return false;
  for (int w = 0; w < kHeaderWords; ++w) theirs[w] = ctx.load_relaxed64(line + w);
  return true;
}

// Warp: bit m set where my rail pair with node m agrees (their lines of this epoch); 0 when a
// wait failed. `record`: offer the mismatches (one caller per rank and operation).
template <class Ctx>
MOE_ROLE uint64_t rail_agreement(Ctx& ctx, const Common& cm, const Check& check, int rank, uint64_t epoch, bool record,
                                 WaitSite site) {
  uint64_t ok = 0, failed = 0;
  for (int m = ctx.lane(); m < cm.num_nodes; m += ctx.width()) {
    site.peer = rail_peer(cm, rank, m);
    int64_t theirs[kHeaderWords];
    if (!get_rail_header(ctx, cm, rank, m, epoch, site, theirs)) {
      failed |= uint64_t{1} << m;
    } else if (ring::judge(ctx, check, rank, site.peer, theirs, record)) {
      ok |= uint64_t{1} << m;
    }
  }
  return ctx.warp_or(failed) != 0 ? 0 : ctx.warp_or(ok);
}

// Warp: the verdict on my rail pair with node m: from the notify (peer_ok) or the lines
// (`record`: offer a mismatch); true: move rows (a failed wait was recorded as a timeout).
template <class Ctx>
MOE_ROLE bool rail_verdict(Ctx& ctx, const Common& cm, const Check& check, const int32_t* peer_ok, int rank, int m,
                           uint64_t epoch, bool record, const WaitSite& site) {
  int32_t v = 0;
  if (ctx.lane() == 0) {
    if (peer_ok != nullptr) {
      v = peer_ok[m];
    } else {
      int64_t theirs[kHeaderWords];
      v = get_rail_header(ctx, cm, rank, m, epoch, site, theirs) &&
          ring::judge(ctx, check, rank, rail_peer(cm, rank, m), theirs, record);
    }
  }
  return ctx.broadcast(v) == 1;
}

// ---- the staged pipeline: node notify ------------------------------------------------------

// Exchanges per-(source node, channel) token counts and the headers along the rail; writes the
// stage-1 receive prefix [N * C + 1] (rows by source node, then channel) and the rail verdicts.
template <class Ctx>
MOE_ROLE void node_notify(Ctx& ctx, const NotifyArgs& a, int rank, NotifyState* st) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const NotifyRank& me = a.ranks[rank - cm.rank_begin];
  const int num_nodes = cm.num_nodes, num_channels = cm.num_channels;
  const int num_queues = num_nodes * num_channels;
  const int my_node = rank / cm.ranks_per_node;
  char* buf = ctx.buffer(rank);
  const uint64_t epoch = ctx.load_local(l.notify_epoch(buf));
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
    message_counts(l.meta_out(buf, parity, i / num_channels))[i % num_channels] = ctx.shared_load(&st->counts[i]);
  for (int p = ctx.tid(); p < num_nodes; p += ctx.num_threads())
    for (int w = 0; w < kHeaderWords; ++w) reinterpret_cast<int64_t*>(l.meta_out(buf, parity, p))[w] = me.check.header.w[w];
  ctx.block_sync();
  for (int p = ctx.tid(); p < num_nodes; p += ctx.num_threads())
    ctx.put_signal_lane(rank, rail_peer(cm, rank, p), l.meta(buf, parity, my_node), l.meta_out(buf, parity, p),
                        kLine + 4 * num_channels, l.arrive(buf, parity, my_node), epoch + 1);
  for (int p = ctx.tid(); p < num_nodes; p += ctx.num_threads()) {
    const WaitSite site{kNodeNotify, intranode::kBarrier, rank, -1, rail_peer(cm, rank, p), intranode::kSignal};
    if (ctx.wait_signal_lane(l.arrive(buf, parity, p), epoch + 1, site) < 0) {
      ctx.shared_store(&st->stop, 1);
      continue;
    }
    int64_t theirs[kHeaderWords];
    for (int w = 0; w < kHeaderWords; ++w)
      theirs[w] = ctx.load_relaxed64(reinterpret_cast<const int64_t*>(l.meta(buf, parity, p)) + w);
    st->ok[p] = ring::judge(ctx, me.check, rank, rail_peer(cm, rank, p), theirs, true);
    me.peer_ok[p] = st->ok[p];
  }
  ctx.block_sync();
  if (ctx.shared_load(&st->stop)) return;
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads())
    st->counts[i] = st->ok[i / num_channels] ? ctx.queue_i32(reinterpret_cast<const char*>(
                                                   message_counts(l.meta(buf, parity, i / num_channels)) + i % num_channels))
                                             : 0;
  ctx.block_sync();
  const int32_t total = ctx.block_exclusive_scan(st->counts, num_queues);
  for (int i = ctx.tid(); i < num_queues; i += ctx.num_threads()) me.recv_prefix[i] = st->counts[i];
  if (ctx.tid() == 0) {
    me.recv_prefix[num_queues] = total;
    *me.num_recv_tokens = total;
    *me.overflow = 0;
    ctx.store_local(l.notify_epoch(buf), epoch + 1);
  }
}

// ---- the staged pipeline: node dispatch / node combine ---------------------------------------

// Ring (rank's node -> node, channel) as its sender sees it, or (node -> rank's node, channel)
// as its receiver does: put-with-signal of each chunk SETs the tail (data before signal), the
// receiver SETs the sender's head. The tail/head counters reset themselves (intranode.cuh).
struct RdmaQueue {
  const RdmaLayout* l;
  char* buf;
  int rank;
  int peer;      // the rail peer at the other end
  int node;      // its node
  int my_node;
  int channel;
  int stride;
  bool sender;
  WaitSite site;

  MOE_ROLE char* slot(int64_t i) const {
    return sender ? l->send_slot(buf, node, channel, i, stride) : l->recv_slot(buf, node, channel, i, stride);
  }
  template <class C>
  MOE_ROLE int64_t wait_room(C& c, int64_t target) const { return c.wait_signal(l->head(buf, node, channel), target, site); }
  template <class C>
  MOE_ROLE void publish(C& c, int64_t begin, int count) const {
    c.put_signal(rank, peer, l->recv_slot(buf, my_node, channel, begin, stride), l->send_slot(buf, node, channel, begin, stride),
                 static_cast<int64_t>(count) * stride, l->tail(buf, my_node, channel), static_cast<uint64_t>(begin + count));
  }
  template <class C>
  MOE_ROLE void finish(C& c, int64_t total) const {
    const int64_t seen = c.wait_signal(l->head(buf, node, channel), total, site);
    if (c.lane() == 0 && seen >= 0) c.reset_signal(l->head(buf, node, channel));
  }
  template <class C>
  MOE_ROLE int64_t wait_data(C& c, int64_t target) const { return c.wait_signal(l->tail(buf, node, channel), target, site); }
  template <class C>
  MOE_ROLE void release(C& c, int64_t consumed, bool final) const {
    if (final) c.reset_signal(l->tail(buf, node, channel));  // before the final head
    c.signal_set(rank, peer, l->head(buf, my_node, channel), static_cast<uint64_t>(consumed));
  }
};

template <class Ctx>
MOE_ROLE RdmaQueue rdma_queue(Ctx& ctx, const Common& cm, int rank, int node, int channel, int stride, bool sender,
                              const WaitSite& site) {
  return {&cm.layout, ctx.buffer(rank), rank, rail_peer(cm, rank, node), node, rank / cm.ranks_per_node,
          channel, stride, sender, site};
}

// Warp 0 of a group settles the rail verdict; false (every warp leaves) when the pair moves no
// rows. In a cached dispatch or a combine the senders of channel 0 first put this rank's line
// (`sender`) and the receivers of channel 0 record a mismatch.
template <class Ctx>
MOE_ROLE bool node_group_verdict(Ctx& ctx, const Common& cm, const Check& check, const int32_t* peer_ok, int rank,
                                 int node, int channel, uint64_t epoch, bool sender, const WaitSite& site, int warp,
                                 GroupState* gs) {
  if (warp == 0) {
    if (sender && peer_ok == nullptr && channel == 0 && ctx.lane() == 0) put_rail_header(ctx, cm, check, rank, node, epoch);
    const bool v = rail_verdict(ctx, cm, check, peer_ok, rank, node, epoch, !sender && channel == 0, site);
    if (ctx.lane() == 0) ctx.shared_store(&gs->verdict, v);
  }
  ctx.group_sync();
  const bool ok = ctx.shared_load(&gs->verdict) == 1;
  ctx.group_sync();  // read by all before warp 0 may settle the group's next pair
  return ok;
}

// Sender group (rank -> dst_node's forwarder, channel): stages chunks, puts each with its tail.
template <class Ctx>
MOE_ROLE void node_dispatch_send(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int dst_node, int warp,
                                 int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int peer = rail_peer(cm, rank, dst_node);
  if (!node_group_verdict(ctx, cm, me.check, me.peer_ok, rank, dst_node, channel, epoch, true,
                          WaitSite{kNodeDispatch, intranode::kSender, rank, channel, peer, intranode::kHeader}, warp, gs))
    return;
  const auto q = rdma_queue(ctx, cm, rank, dst_node, channel, a.slot.slot_bytes, true,
                            WaitSite{kNodeDispatch, intranode::kSender, rank, channel, peer, intranode::kHead});
  ring::send_selected(
      ctx, q, cm.layout.num_slots, cm.chunk_tokens, channel_token_range(me.num_tokens, cm.num_channels, channel),
      [&](int token) { return me.is_token_in_rank[static_cast<int64_t>(token) * cm.num_nodes + dst_node]; },
      [&](int token, char* slot) {
        intranode::write_dispatch_slot(ctx, a.slot, a.experts_per_node, me, dst_node, token, slot);
      },
      warp, group_warps, gs);
}

// Receiver group (src_node's rank of my rail -> me, channel): rows prefix[src][c] + i.
template <class Ctx>
MOE_ROLE void node_dispatch_recv(Ctx& ctx, const DispatchArgs& a, int rank, int channel, int src_node, int warp,
                                 int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const DispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int peer = rail_peer(cm, rank, src_node);
  if (!node_group_verdict(ctx, cm, me.check, me.peer_ok, rank, src_node, channel, epoch, false,
                          WaitSite{kNodeDispatch, intranode::kReceiver, rank, channel, peer, intranode::kHeader}, warp,
                          gs))
    return;
  const int queue = src_node * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const auto q = rdma_queue(ctx, cm, rank, src_node, channel, a.slot.slot_bytes, false,
                            WaitSite{kNodeDispatch, intranode::kReceiver, rank, channel, peer, intranode::kTail});
  ring::recv_entries(
      ctx, q, me.recv_prefix[queue + 1] - first_row,
      [&](char* slot, int64_t i) {
        intranode::read_dispatch_slot(ctx, a.slot, me, slot, first_row + static_cast<int>(i), 0, a.experts_per_node);
      },
      warp, group_warps, gs);
}

// Sender group (forwarder rank -> dst_node's source rank, channel): the node partials of the
// rows received from (dst_node, channel), in order, one put per chunk.
template <class Ctx>
MOE_ROLE void node_combine_send(Ctx& ctx, const CombineArgs& a, int rank, int channel, int dst_node, int warp,
                                int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const CombineRank& me = a.ranks[rank - cm.rank_begin];
  const int peer = rail_peer(cm, rank, dst_node);
  if (!node_group_verdict(ctx, cm, me.check, nullptr, rank, dst_node, channel, epoch, true,
                          WaitSite{kNodeCombine, intranode::kSender, rank, channel, peer, intranode::kHeader}, warp, gs))
    return;
  const int queue = dst_node * cm.num_channels + channel;
  const int first_row = me.recv_prefix[queue];
  const int row_bytes = a.slot.x_bytes;
  const auto q = rdma_queue(ctx, cm, rank, dst_node, channel, a.slot.slot_bytes, true,
                            WaitSite{kNodeCombine, intranode::kSender, rank, channel, peer, intranode::kHead});
  ring::send_entries(
      ctx, q, cm.layout.num_slots, cm.chunk_tokens, me.recv_prefix[queue + 1] - first_row,
      [&](int64_t i, char* slot) { ctx.copy_in(slot, me.y + (first_row + i) * row_bytes, row_bytes); }, warp,
      group_warps, gs);
}

// Warp: waits until chunk `chunk`'s flag of a fused RDMA ring carries this operation's tag.
// Returns `landed` (the entries known to be there) or -1; `observed` (entries of the ring seen
// in this operation) names the wait if it times out.
template <class Ctx>
MOE_ROLE int64_t wait_chunk(Ctx& ctx, uint64_t* flag, uint64_t epoch, int64_t chunk, int64_t landed, int64_t observed,
                            const WaitSite& site) {
  int64_t v = 0;
  if (ctx.lane() == 0) {
    const uint64_t tag = chunk_tag(epoch, chunk);
    v = ctx.bounded_wait([&]() { return ctx.signal_reached(flag, tag) ? landed : observed; }, landed, site);
  }
  return ctx.broadcast(static_cast<int32_t>(v));
}

// The source's reducer (rank, channel) for ring::reduce_worker, both pipelines: the channel's
// tokens round robin over the workers, node partials summed in ascending node order (scale 1:
// exact steps), rounded once into out. The staged rings publish tails; the fused ones land
// chunks under flags tagged with `epoch`.
struct SourceReduce {
  const Common* cm;
  const bool* in_node;  // [T, N]
  char* out_base;       // [T, row_bytes]
  int row_bytes;
  int stride;  // the ring's slot size
  TokenRange range;
  char* buf;
  int rank;
  int channel;
  uint64_t agree;  // bit m: my rail pair with node m moves rows
  bool fused;
  uint64_t epoch;

  MOE_ROLE int num_tokens() const { return range.end - range.begin; }
  MOE_ROLE int num_peers() const { return cm->num_nodes; }
  MOE_ROLE bool holds(int i, int m) const {
    return ((agree >> m) & 1u) && in_node[static_cast<int64_t>(range.begin + i) * cm->num_nodes + m];
  }
  MOE_ROLE bool owns(int i, int worker, int num_workers) const { return i % num_workers == worker; }
  template <class C>
  MOE_ROLE bool begin(C&, int) const { return true; }
  template <class C>
  MOE_ROLE int64_t wait(C& ctx, int m, int64_t target) const {
    // A fused ring is filled by a forwarder that waits for its holders first: a stalled one is
    // rarely the cause (kForwardTail), the rank it waits for is.
    const WaitSite site{kNodeCombine, intranode::kReceiver, rank, channel, rail_peer(*cm, rank, m),
                        fused ? intranode::kForwardTail : intranode::kTail};
    if (!fused) return ctx.wait_signal(cm->layout.tail(buf, m, channel), target, site);
    const int K = cm->chunk_tokens;
    const int64_t chunk = (target - 1) / K;
    return wait_chunk(ctx, cm->layout.flag(buf, m, channel, chunk % (cm->layout.num_slots / K)), epoch, chunk,
                      (chunk + 1) * K, chunk * K, site);
  }
  template <class C>
  MOE_ROLE char* row(C&, int m, int64_t index, int) const {
    return cm->layout.recv_slot(buf, m, channel, index, stride);
  }
  template <class C>
  MOE_ROLE float scale(C&, int, const char*, int64_t, int) const { return 1.0f; }
  MOE_ROLE char* out(int i) const { return out_base + static_cast<int64_t>(range.begin + i) * row_bytes; }
  template <class C>
  MOE_ROLE void after(C&, int, char* const*, int) const {}
  // SETs the forwarder's head to the slots every worker is past (a staged ring zeroes its tail
  // first when it is the final head).
  template <class C>
  MOE_ROLE void free(C& ctx, int m, int32_t freed, bool final) const {
    if (final && !fused) ctx.reset_signal(cm->layout.tail(buf, m, channel));
    ctx.signal_set(rank, rail_peer(*cm, rank, m), cm->layout.head(buf, rank / cm->ranks_per_node, channel),
                   static_cast<uint64_t>(freed));
  }
};

// Warp: the source reducer of launched rank `rank` (tokens `in_node` [T, N], `out` [T, row]):
// every warp checks the rail lines; `record` (one caller per rank) offers a mismatch.
template <class Ctx>
MOE_ROLE SourceReduce source_reduce(Ctx& ctx, const Common& cm, const Check& check, const bool* in_node, char* out,
                                    int num_tokens, const SlotLayout& slot, int rank, int channel, uint64_t epoch,
                                    bool fused, bool coordinator, bool record) {
  const uint64_t agree = rail_agreement(ctx, cm, check, rank, epoch, record,
                                        WaitSite{kNodeCombine, coordinator ? intranode::kCoordinator : intranode::kReceiver,
                                                 rank, channel, 0, intranode::kHeader});
  return {&cm,  in_node, out,    slot.x_bytes, slot.slot_bytes, channel_token_range(num_tokens, cm.num_channels, channel),
          ctx.buffer(rank), rank, channel, agree, fused, epoch};
}

}  // namespace internode
}  // namespace moe_dispatch

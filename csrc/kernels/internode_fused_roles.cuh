// The fused internode pipeline (internode.cuh, "FUSED"): what each warp (group) of its notify,
// dispatch and combine kernels does. One kernel per operation, three blocks per channel:
//
//   dispatch: RDMA sender (groups over destination nodes) | forwarder (a group per local
//             destination) | NVLink receiver (a group per local forwarder)
//   combine:  NVLink holder sender (a group per local forwarder) | forwarder reducer
//             (coordinator + workers) | RDMA source reducer (coordinator + workers)
//
// Same Ctx as internode_roles.cuh (RDMA side) plus the NVLink side of ring.cuh; GPU kernels in
// internode_fused.cu, the CPU backend in internode_cpu.cpp. Every role takes `epoch`, the rank's
// op epoch (RdmaLayout::op_epoch) when the launch began: chunk tags and header-line parity.
#pragma once

#include "kernels/internode_roles.cuh"

namespace moe_dispatch {
namespace internode {

using intranode::BufferLayout;
using intranode::kCombine;  // NVLink-stage waits: the intranode phases
using intranode::kDispatch;
using intranode::nvl_queue;
using intranode::NvlQueue;

// ---- shared helpers -------------------------------------------------------------------------

// Warp: bit l set where local rank l owns one of a stage-1 slot's top-k ids (node-local).
template <class Ctx>
MOE_ROLE uint32_t local_holders(Ctx& ctx, const SlotLayout& s, const char* slot, int experts_per_rank) {
  uint64_t mask = 0;
  for (int k = ctx.lane(); k < s.num_topk; k += ctx.width()) {
    const int32_t id = ctx.queue_i32(slot + s.topk_idx_offset + 4 * k);
    if (id >= 0) mask |= uint64_t{1} << (id / experts_per_rank);
  }
  return static_cast<uint32_t>(ctx.warp_or(mask));
}

// Warp: a stage-1 slot into an NVLink slot for local rank `dest`: top-k ids become dest's
// (experts [expert_base, +experts_per_rank) of the node), -1 elsewhere with weight 0; aux
// carries the source token, the receive queue (source rank * C + channel) and the row's index
// among that queue's rows for dest.
template <class Ctx>
MOE_ROLE void forward_slot(Ctx& ctx, const SlotLayout& s, int expert_base, int experts_per_rank, const char* src,
                           char* dst, int32_t queue, int32_t index) {
  ctx.copy_out(dst, src, s.x_bytes);
  if (s.scale_bytes > 0) ctx.copy_out(dst + s.scale_offset, src + s.scale_offset, s.scale_bytes);
  for (int k = ctx.lane(); k < s.num_topk; k += ctx.width()) {
    const int32_t id = ctx.queue_i32(src + s.topk_idx_offset + 4 * k);
    const int32_t local =
        (id >= 0 && id - expert_base >= 0 && id - expert_base < experts_per_rank) ? id - expert_base : -1;
    reinterpret_cast<int32_t*>(dst + s.topk_idx_offset)[k] = local;
    reinterpret_cast<float*>(dst + s.topk_weights_offset)[k] =
        local >= 0 ? ctx.queue_f32(src + s.topk_weights_offset + 4 * k) : 0.0f;
  }
  if (ctx.lane() == 0) {
    int32_t* aux = reinterpret_cast<int32_t*>(dst + s.aux_offset);
    aux[0] = ctx.queue_i32(src + s.aux_offset);
    aux[1] = queue;
    aux[2] = index;
  }
}

// ---- the rows that travel between a forwarder and a local rank (internode.cuh, "budget") ----

constexpr int32_t kNoCut = 0x7fffffff;  // forward_cut: every row of the ring travels

// This rank's rows from forwarder f of source node m (every channel). p: recv_prefix.
MOE_ROLE int64_t rows_from(const int32_t* p, int L, int C, int f, int m) {
  return p[(m * L + f) * C + C] - p[(m * L + f) * C];
}

// This rank's rows of queue (source node m, forwarder f, channel c) that travel between it and
// f: those whose ordinal among its rows from f, in its receive order, is below the budget (all
// without one). `before`: its rows from f of source nodes below m (rows_from summed).
MOE_ROLE int64_t travelling(const int32_t* p, int L, int C, int f, int m, int c, int32_t budget, int64_t before) {
  const int64_t count = p[(m * L + f) * C + c + 1] - p[(m * L + f) * C + c];
  if (budget < 0) return count;
  const int64_t left = budget - before - (p[(m * L + f) * C + c] - p[(m * L + f) * C]);
  return left <= 0 ? 0 : (left < count ? left : count);
}

// A forwarder's record of its forwarded rows (FusedDispatchRank / FusedCombineRank): whether
// forward_mask lists each local rank's travelling rows (budget mode past forward_capacity).
template <class Rank>
MOE_ROLE bool listed(const Rank& me, int C, int N) {
  return me.budget >= 0 && me.forward_prefix[C * N] > me.forward_capacity;
}

// Whether row j of the forwarder's stage-1 ring (channel c, source node m) travels to / from
// local rank d, read back from what the fresh dispatch recorded.
template <class Rank>
MOE_ROLE bool travels(const Rank& me, int N, int L, int C, int c, int m, int j, int d, bool list) {
  if (!list)
    return ((me.forward_mask[me.forward_prefix[c * N + m] + j] >> d) & 1) != 0 &&
           (me.budget < 0 || j < me.forward_cut[(d * C + c) * N + m]);
  const int32_t* rp = me.relay_prefix + d * (N * C + 1);
  int32_t lo = rp[m * C + c], hi = rp[m * C + c + 1] < me.budget ? rp[m * C + c + 1] : me.budget;
  const int32_t* rows = me.forward_mask + static_cast<int64_t>(d) * me.budget;
  while (lo < hi) {  // the ring indices of d's travelling rows of this ring, ascending
    const int32_t mid = lo + (hi - lo) / 2;
    if (rows[mid] == j) return true;
    if (rows[mid] < j) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return false;
}

// Lane: local peer f's NVLink header line of this epoch (in my NVLink buffer), into
// theirs[kHeaderLineWords] (its report included); false when the wait timed out.
template <class Ctx>
MOE_ROLE bool get_local_header(Ctx& ctx, const Common& cm, int rank, int f, uint64_t epoch, const WaitSite& site,
                               int64_t* theirs) {
  return ring::get_header_line(ctx, cm.nvl_layout.header(nvl_buffer(cm, rank), epoch, f), epoch, site, theirs);
}

// Lane: judges local peer f's line; with `record`, offers a direct mismatch, or, when f agrees
// with this rank, f's report on its own rail (a refusing or disagreeing f is named itself, not
// the rail peers it disagreed with). True when the NVLink pair moves rows.
template <class Ctx>
MOE_ROLE bool judge_local(Ctx& ctx, const Common& cm, const Check& check, int rank, int f, const int64_t* theirs,
                          bool record) {
  const int f_rank = (rank / cm.ranks_per_node) * cm.ranks_per_node + f;
  const bool ok = ring::judge(ctx, check, rank, f_rank, theirs, record);
  const int64_t* report = theirs + kReportWord;
  // A growing f's report too, when this rank grows: whether f's rail peers grow (header.cuh).
  if (record && (ok || both_grow(check.header.w, theirs)) && f_rank != rank && report[0] != 0)
    ctx.offer_mismatch(check, rank, static_cast<int>(report[1]), f_rank, static_cast<int>(report[2]), report[3],
                       report[4]);
  return ok;
}

// Warp 0 of the forwarder block of channel 0, in a cached dispatch or a combine: this rank's
// rail header line to every rail peer, their lines checked (mismatches recorded), then this
// rank's NVLink line to every local peer, carrying the report of its rail verdicts.
template <class Ctx>
MOE_ROLE void fused_handshake(Ctx& ctx, const Common& cm, const Check& check, int rank, uint64_t epoch, int phase) {
  const int num_nodes = cm.num_nodes, L = cm.ranks_per_node, my_node = rank / L, my_local = rank % L;
  for (int m = ctx.lane(); m < num_nodes; m += ctx.width()) put_rail_header(ctx, cm, check, rank, m, epoch);
  uint64_t bad = 0, named = 0;  // named: the disagreeing pairs not growing on both sides
  for (int m = ctx.lane(); m < num_nodes; m += ctx.width()) {
    const int peer = rail_peer(cm, rank, m);
    int64_t theirs[kHeaderWords];
    const WaitSite site{phase, intranode::kBarrier, rank, -1, peer, intranode::kHeader};
    if (!get_rail_header(ctx, cm, rank, m, epoch, site, theirs)) {
      bad |= uint64_t{1} << m;
      named |= uint64_t{1} << m;
    } else if (!ring::judge(ctx, check, rank, peer, theirs, true)) {
      bad |= uint64_t{1} << m;
      if (!both_grow(check.header.w, theirs)) named |= uint64_t{1} << m;
    }
  }
  bad = ctx.warp_or(bad);
  named = ctx.warp_or(named);
  // The report names the lowest disagreeing node's peer, one not growing with this rank if
  // there is one (header.cuh, kStatusGrow); every lane rereads its line.
  int64_t report[kReportWords] = {static_cast<int64_t>(bad), -1, -1, 0, 0};
  if (bad != 0) {
    const uint64_t pick = named != 0 ? named : bad;
    int first = 0;
    while (((pick >> first) & 1u) == 0) ++first;
    int64_t theirs[kHeaderWords];
    const WaitSite site{phase, intranode::kBarrier, rank, -1, rail_peer(cm, rank, first), intranode::kHeader};
    if (get_rail_header(ctx, cm, rank, first, epoch, site, theirs)) {
      const int field = header_diff(check.header.w, theirs);
      report[1] = rail_peer(cm, rank, first);
      report[2] = field;
      report[3] = field >= 0 ? check.header.w[field] : 0;
      report[4] = field >= 0 ? theirs[field] : 0;
    }
  }
  for (int d = ctx.lane(); d < L; d += ctx.width())
    ring::put_header_line(ctx, cm.nvl_layout.header(nvl_buffer(cm, my_node * L + d), epoch, my_local), check.header,
                          epoch, report);
}

// ---- notify ---------------------------------------------------------------------------------

struct FusedNotifyState {
  int32_t rail_ok[kMaxNodes];
  int32_t nvl_ok[kMaxLocal];
  int32_t stop;
};

// One block per rank (internode.cuh, FUSED notify). Writes recv_prefix, forward_prefix, counts
// (R, R1), overflow, peer_ok, the budget padding, and the mismatch record.
template <class Ctx>
MOE_ROLE void fused_notify(Ctx& ctx, const FusedNotifyArgs& a, int rank, FusedNotifyState* st) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const BufferLayout& nl = cm.nvl_layout;
  const FusedNotifyRank& me = a.ranks[rank - cm.rank_begin];
  const int N = cm.num_nodes, L = cm.ranks_per_node, C = cm.num_channels, W = N * L;
  const int my_node = rank / L, my_local = rank % L;
  char* buf = ctx.buffer(rank);
  char* nvl = nvl_buffer(cm, rank);
  const uint64_t epoch = ctx.load_local(l.notify_epoch(buf));
  const int parity = static_cast<int>(epoch & 1u);
  const int tid = ctx.tid(), threads = ctx.num_threads();
  if (tid == 0) ctx.shared_store(&st->stop, 0);
  // 1. My message for node m: the header line, then the counts of my channel-c tokens that node m
  //    holds ([C]) and that each of its ranks holds ([L][C]).
  const int per_node = (1 + L) * C;
  for (int64_t i = tid; i < static_cast<int64_t>(N) * per_node; i += threads) {
    const int m = static_cast<int>(i / per_node), j = static_cast<int>(i % per_node), c = j % C, kind = j / C;
    const TokenRange range = channel_token_range(me.num_tokens, C, c);
    int32_t count = 0;
    for (int t = range.begin; t < range.end; ++t)
      count += kind == 0 ? me.is_token_in_node[static_cast<int64_t>(t) * N + m]
                         : me.is_token_in_rank[static_cast<int64_t>(t) * W + m * L + kind - 1];
    message_counts(l.meta_out(buf, parity, m))[j] = count;
  }
  for (int m = tid; m < N; m += threads)
    for (int w = 0; w < kHeaderWords; ++w)
      reinterpret_cast<int64_t*>(l.meta_out(buf, parity, m))[w] = me.check.header.w[w];
  ctx.block_sync();
  // 2. To each rail peer; 3. everyone's message for me; 4. the rail verdicts.
  for (int m = tid; m < N; m += threads)
    ctx.put_signal_lane(rank, rail_peer(cm, rank, m), l.meta(buf, parity, my_node), l.meta_out(buf, parity, m),
                        kLine + 4 * per_node, l.arrive(buf, parity, my_node), epoch + 1);
  for (int m = tid; m < N; m += threads) {
    const int peer = rail_peer(cm, rank, m);
    const WaitSite site{kNodeNotify, intranode::kBarrier, rank, -1, peer, intranode::kSignal};
    if (ctx.wait_signal_lane(l.arrive(buf, parity, m), epoch + 1, site) < 0) {
      ctx.shared_store(&st->stop, 1);
      continue;
    }
    int64_t theirs[kHeaderWords];
    for (int w = 0; w < kHeaderWords; ++w)
      theirs[w] = ctx.load_relaxed64(reinterpret_cast<const int64_t*>(l.meta(buf, parity, m)) + w);
    st->rail_ok[m] = ring::judge(ctx, me.check, rank, peer, theirs, true);
    me.peer_ok[m] = st->rail_ok[m];
  }
  ctx.block_sync();
  if (ctx.shared_load(&st->stop)) return;
  // 5. forward_prefix over (channel, source node): the stage-1 rings this rank forwards.
  for (int i = tid; i < C * N; i += threads) {
    const int c = i / N, m = i % N;
    me.forward_prefix[i] =
        st->rail_ok[m] ? ctx.queue_i32(reinterpret_cast<const char*>(message_counts(l.meta(buf, parity, m)) + c)) : 0;
  }
  ctx.block_sync();
  const int32_t forwarded = ctx.block_exclusive_scan(me.forward_prefix, C * N);
  // 6. Relay to each local rank d: my header line with the report of my rail verdicts, and the
  //    counts [N][C] of every source (m, my_local) for d; then its arrival signal.
  //    The report names the first disagreeing rail peer, one that is not growing with this rank
  //    if there is one (header.cuh, kStatusGrow: what a growing local rank must learn of).
  int64_t report[kReportWords] = {0, -1, -1, 0, 0};
  bool named_grows = true;
  for (int m = 0; m < N; ++m) {
    if (st->rail_ok[m]) continue;
    int64_t theirs[kHeaderWords];
    for (int w = 0; w < kHeaderWords; ++w)
      theirs[w] = ctx.load_relaxed64(reinterpret_cast<const int64_t*>(l.meta(buf, parity, m)) + w);
    if (report[0] == 0 || (named_grows && !both_grow(me.check.header.w, theirs))) {
      const int field = header_diff(me.check.header.w, theirs);
      report[1] = rail_peer(cm, rank, m);
      report[2] = field;
      report[3] = me.check.header.w[field];
      report[4] = theirs[field];
      named_grows = both_grow(me.check.header.w, theirs);
    }
    report[0] |= int64_t{1} << m;
  }
  for (int64_t i = tid; i < static_cast<int64_t>(L) * N * C; i += threads) {
    const int d = static_cast<int>(i / (N * C)), mc = static_cast<int>(i % (N * C)), m = mc / C, c = mc % C;
    const int32_t v =
        st->rail_ok[m]
            ? ctx.queue_i32(reinterpret_cast<const char*>(message_counts(l.meta(buf, parity, m)) + (1 + d) * C + c))
            : 0;
    ctx.store_relaxed(nl.relay_counts(nvl_buffer(cm, my_node * L + d), parity, my_local) + mc, v);
    me.relay_prefix[d * (N * C + 1) + mc] = v;
  }
  for (int d = tid; d < L; d += threads)
    ring::put_header_line(ctx, nl.relay_line(nvl_buffer(cm, my_node * L + d), parity, my_local), me.check.header, epoch,
                          report);
  ctx.block_sync();
  for (int d = tid; d < L; d += threads)
    ctx.store_release(nl.relay_arrive(nvl_buffer(cm, my_node * L + d), parity, my_local),
                      static_cast<int32_t>(epoch + 1));
  // What the dispatch and combine count the travelling rows with (after the relay: no peer waits).
  for (int d = 0; d < L; ++d) {
    const int32_t relayed = ctx.block_exclusive_scan(me.relay_prefix + d * (N * C + 1), N * C);
    if (tid == 0) me.relay_prefix[d * (N * C + 1) + N * C] = relayed;
  }
  // 7. Every local forwarder's relay; 8. the NVLink verdicts and the forwarders' reports.
  for (int f = tid; f < L; f += threads) {
    const WaitSite site{kNodeNotify, intranode::kBarrier, rank, -1, my_node * L + f, intranode::kRelayHeader};
    if (ctx.wait_ge_lane(nl.relay_arrive(nvl, parity, f), static_cast<int32_t>(epoch + 1), site) < 0) {
      ctx.shared_store(&st->stop, 1);
      continue;
    }
    int64_t theirs[kHeaderLineWords];
    const int64_t* line = nl.relay_line(nvl, parity, f);
    for (int w = 0; w < kHeaderLineWords; ++w) theirs[w] = ctx.load_relaxed64(line + w);
    st->nvl_ok[f] = judge_local(ctx, cm, me.check, rank, f, theirs, true);
    me.peer_ok[N + f] = st->nvl_ok[f];
  }
  ctx.block_sync();
  if (ctx.shared_load(&st->stop)) return;
  // 9. My receive prefix over (source rank s = m L + f, channel c): what forwarder f relayed.
  for (int i = tid; i < W * C; i += threads) {
    const int s = i / C, c = i % C, m = s / L, f = s % L;
    me.recv_prefix[i] = st->nvl_ok[f] ? ctx.load_acquire(nl.relay_counts(nvl, parity, f) + m * C + c) : 0;
  }
  ctx.block_sync();
  const int32_t total = ctx.block_exclusive_scan(me.recv_prefix, W * C);
  if (tid == 0) {
    me.recv_prefix[W * C] = total;
    me.forward_prefix[C * N] = forwarded;
    me.counts[0] = total;
    me.counts[1] = forwarded;
    *me.overflow = me.budget >= 0 && total > me.budget;
    ctx.store_local(l.notify_epoch(buf), epoch + 1);
  }
  // 10. Budget mode: rows past the received ones read as "no expert".
  if (me.budget >= 0 && total < me.budget) {
    const int64_t first = total, rows = me.budget - total;
    for (int64_t i = tid; i < rows * a.num_topk; i += threads) {
      if (me.recv_topk_idx != nullptr) me.recv_topk_idx[first * a.num_topk + i] = -1;
      if (me.recv_topk_weights != nullptr) me.recv_topk_weights[first * a.num_topk + i] = 0.0f;
    }
    if (me.recv_src_idx != nullptr)
      for (int64_t i = tid; i < rows; i += threads) me.recv_src_idx[first + i] = -1;
  }
}

// ---- dispatch: RDMA sender --------------------------------------------------------------------

// Group `group` of `num_groups` serves destination nodes group, group + num_groups, ...: each
// warp owns chunks q = warp, warp + group_warps, ... of a ring, stages and puts them on its own.
template <class Ctx>
MOE_ROLE void fused_rdma_send(Ctx& ctx, const FusedDispatchArgs& a, int rank, int channel, int group, int num_groups,
                              int warp, int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const FusedDispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int N = cm.num_nodes, K = cm.chunk_tokens, S = l.num_slots, Q = S / K, stride = a.slot.slot_bytes;
  const int my_node = rank / cm.ranks_per_node;
  const TokenRange range = channel_token_range(me.num_tokens, cm.num_channels, channel);
  char* buf = ctx.buffer(rank);
  for (int m = group; m < N; m += num_groups) {
    const int peer = rail_peer(cm, rank, m);
    if (warp == 0) {
      const bool ok =
          rail_verdict(ctx, cm, me.check, me.peer_ok, rank, m, epoch, false,
                       WaitSite{kNodeDispatch, intranode::kSender, rank, channel, peer, intranode::kHeader});
      if (ctx.lane() == 0) ctx.shared_store(&gs->verdict, ok);
    }
    ctx.group_sync();
    const bool ok = ctx.shared_load(&gs->verdict) == 1;
    int64_t total = 0;
    for (int t = range.begin; ok && t < range.end; ++t) total += me.is_token_in_node[static_cast<int64_t>(t) * N + m];
    const WaitSite site{kNodeDispatch, intranode::kSender, rank, channel, peer, intranode::kHead};
    uint64_t* head = l.head(buf, m, channel);
    int token = range.begin;
    int64_t entry = 0;
    for (int64_t q = warp; q * K < total; q += group_warps) {
      const int64_t first = q * K;
      const int count = static_cast<int>(total - first < K ? total - first : K);
      const int64_t target = first + count - S;  // room: the chunk's slots were freed
      if (target > 0 && ctx.wait_signal(head, target, site) < 0) break;
      for (; entry < first; ++token) entry += me.is_token_in_node[static_cast<int64_t>(token) * N + m];
      for (int e = 0; e < count; ++token) {
        if (!me.is_token_in_node[static_cast<int64_t>(token) * N + m]) continue;
        const int64_t t = token;
        char* slot = l.send_slot(buf, m, channel, first + e, stride);
        intranode::write_dispatch_slots(ctx, a.slot, a.experts_per_node, me, m, &t, &slot, 1);
        ++e;
        ++entry;
      }
      ctx.put_signal(rank, peer, l.recv_slot(buf, my_node, channel, first, stride),
                     l.send_slot(buf, m, channel, first, stride), static_cast<int64_t>(count) * stride,
                     l.flag(buf, my_node, channel, q % Q), chunk_tag(epoch, q));
    }
    ctx.group_sync();              // every warp's chunks of this ring are out (and the verdict was read)
    if (warp == 0 && total > 0) {  // all consumed: zero my head for the next operation
      const int64_t seen = ctx.wait_signal(head, total, site);
      if (ctx.lane() == 0 && seen >= 0) ctx.reset_signal(head);
    }
  }
}

// ---- dispatch: forwarder ----------------------------------------------------------------------

// Block state of a forwarder (shared memory on the GPU): per group (local destination d) and
// source node m, the ring's entries passed, of those the ones d holds (forwarded to d while they
// travel), and the ring's size; per m the entries freed to the sender so far.
struct ForwardState {
  int32_t consumed[kMaxLocal][kMaxNodes];
  int32_t held[kMaxLocal][kMaxNodes];
  int32_t total[kMaxLocal][kMaxNodes];
  int32_t published[kMaxNodes];
};

// Group for local destination d (`warp` of `group_warps`): polls the stage-1 rings (m -> me,
// channel), takes whichever chunk landed, forwards the rows d holds (to d's NVLink ring, or
// into this rank's outputs when d is itself), records each row's holders (forward_mask, group 0
// of a fresh dispatch; a cached one reads them back), and frees stage-1 entries every group
// passed by adding them to the sender's head.
template <class Ctx>
MOE_ROLE void fused_forward(Ctx& ctx, const FusedDispatchArgs& a, int rank, int channel, int d, int warp,
                            int group_warps, uint64_t epoch, ForwardState* fs, GroupState* gs) {
  const Common& cm = a.common;
  const RdmaLayout& l = cm.layout;
  const BufferLayout& nl = cm.nvl_layout;
  const SlotLayout& s = a.slot;
  const FusedDispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int N = cm.num_nodes, L = cm.ranks_per_node, C = cm.num_channels, K = cm.chunk_tokens;
  const int Q = l.num_slots / K, stride = s.slot_bytes, epr = a.experts_per_rank;
  const int my_node = rank / L, my_local = rank % L, dest = my_node * L + d;
  const bool fresh = me.peer_ok != nullptr;  // a cached dispatch exchanges headers and replays forward_mask
  const bool self = d == my_local;
  const bool list = listed(me, C, N);
  // d's rows of ring (channel, m) before it (relay_prefix): their ordinals are what travels.
  const int32_t* relayed = me.relay_prefix + d * (N * C + 1) + channel;
  char* buf = ctx.buffer(rank);
  char* nvl = nvl_buffer(cm, rank);
  int32_t* consumed = fs->consumed[d];
  int32_t* held = fs->held[d];
  int32_t* total = fs->total[d];
  if (warp == 0) {
    const uint64_t rail =
        fresh ? 0
              : rail_agreement(ctx, cm, me.check, rank, epoch, false,
                               WaitSite{kNodeDispatch, intranode::kReceiver, rank, channel, 0, intranode::kHeader});
    for (int m = ctx.lane(); m < N; m += ctx.width()) {
      const bool ok = fresh ? me.peer_ok[m] == 1 : ((rail >> m) & 1u) != 0;
      ctx.shared_store(&total[m], ok ? me.forward_prefix[channel * N + m + 1] - me.forward_prefix[channel * N + m] : 0);
      ctx.shared_store(&consumed[m], 0);
      ctx.shared_store(&held[m], 0);
      if (fresh)  // a ring whose rows for d all travel (or none do); else its row at ordinal budget cuts it
        me.forward_cut[(d * C + channel) * N + m] = me.budget >= 0 && relayed[m * C] >= me.budget ? 0 : kNoCut;
    }
    int32_t dest_ok = 0;
    if (ctx.lane() == 0) {
      if (fresh) {
        dest_ok = me.peer_ok[N + d];
      } else {
        int64_t theirs[kHeaderLineWords];
        const WaitSite site{kDispatch, intranode::kSender, rank, channel, dest, intranode::kRelayHeader};
        dest_ok = get_local_header(ctx, cm, rank, d, epoch, site, theirs) && header_diff(me.check.header.w, theirs) < 0;
      }
      ctx.shared_store(&gs->verdict, dest_ok);
    }
  }
  ctx.group_sync();
  const bool to_dest = ctx.shared_load(&gs->verdict) == 1;
  const NvlQueue q = nvl_queue(nl, nvl, nvl_buffer(cm, dest), my_local, d, channel,
                               WaitSite{kDispatch, intranode::kSender, rank, channel, dest, intranode::kHead});
  const bool nvlink = to_dest && !self;
  int64_t nvl_sent = 0;
  int next = 0;  // warp 0: where the round-robin poll starts
  for (;;) {
    // 1. Warp 0 picks a ring whose next chunk landed: value = m (-2: all done, -1: failed).
    if (warp == 0) {
      int32_t picked = -2, open = -1;
      if (ctx.lane() == 0) {
        for (int m = 0; m < N && open < 0; ++m)
          if (ctx.shared_load(&consumed[m]) < ctx.shared_load(&total[m])) open = m;
        if (open >= 0) {
          const int64_t observed = ctx.shared_load(&consumed[open]);
          const WaitSite site{kNodeDispatch, intranode::kReceiver,      rank,
                              channel,       rail_peer(cm, rank, open), intranode::kTail};
          const int64_t found = ctx.bounded_wait(
              [&]() -> int64_t {
                for (int k = 0; k < N; ++k) {
                  const int m = (next + k) % N;
                  const int32_t at = ctx.shared_load(&consumed[m]);
                  if (at < ctx.shared_load(&total[m]) &&
                      ctx.signal_reached(l.flag(buf, m, channel, (at / K) % Q), chunk_tag(epoch, at / K))) {
                    picked = m;
                    return observed + 1;
                  }
                }
                return observed;
              },
              observed + 1, site);
          if (found < 0) picked = -1;
          if (picked >= 0) {
            const int32_t first = ctx.shared_load(&consumed[picked]), left = ctx.shared_load(&total[picked]) - first;
            ctx.shared_store(&gs->first, first);
            ctx.shared_store(&gs->count, left < K ? left : K);
            next = picked + 1;
          }
        }
        ctx.shared_store(&gs->value, picked);
      }
      next = ctx.broadcast(next);
    }
    ctx.group_sync();
    const int m = ctx.shared_load(&gs->value);
    if (m < 0) break;
    const int first = ctx.shared_load(&gs->first), count = ctx.shared_load(&gs->count);
    const int32_t mask_at = me.forward_prefix[channel * N + m] + first;  // this row's forward_mask entry
    // 2. Which of the chunk's rows d holds (every warp computes the same): fresh, from the top-k ids;
    //    cached, the ones that travel to d. Of d's rows, those at ordinals below the budget travel.
    auto holders = [&](int e) -> uint32_t {
      if (fresh) return local_holders(ctx, s, l.recv_slot(buf, m, channel, first + e, stride), epr);
      return travels(me, N, L, C, channel, m, first + e, d, list) ? 1u << d : 0u;
    };
    const int32_t base = ctx.shared_load(&held[m]);  // d's rows of this ring before the chunk
    int to_d = 0;
    for (int e = 0; e < count; ++e) to_d += (holders(e) >> d) & 1u;
    const int64_t room = me.budget < 0 ? to_d : me.budget - relayed[m * C] - base;
    const int num_held = room <= 0 ? 0 : (room < to_d ? static_cast<int>(room) : to_d);  // the ones that travel
    // 3. Room in d's NVLink ring for them.
    if (warp == 0) {
      const int64_t target = nvl_sent + num_held - nl.num_slots;
      const int64_t seen = (nvlink && num_held > 0 && target > 0) ? q.wait_room(ctx, target) : 0;
      if (ctx.lane() == 0) ctx.shared_store(&gs->stop, seen < 0);
    }
    ctx.group_sync();
    if (ctx.shared_load(&gs->stop)) break;
    // 4. Copies, entry by entry of d's travelling rows round robin over the warps; a fresh dispatch
    //    records where they went (internode.cuh, "budget").
    const int32_t queue = (m * L + my_local) * C + channel;
    int index = 0;
    for (int e = 0; e < count; ++e) {
      const uint32_t mask = holders(e);
      if (fresh && !list && d == 0 && e % group_warps == warp && ctx.lane() == 0)
        me.forward_mask[mask_at + e] = static_cast<int32_t>(mask);
      if (((mask >> d) & 1u) == 0) continue;
      if (fresh && index % group_warps == warp && ctx.lane() == 0) {
        const int64_t ordinal = relayed[m * C] + base + index;  // among d's rows from this forwarder
        if (list && ordinal < me.budget) me.forward_mask[d * me.budget + ordinal] = first + e;
        if (!list && ordinal == me.budget) me.forward_cut[(d * C + channel) * N + m] = first + e;
      }
      if (index < num_held && to_dest && index % group_warps == warp) {  // the rest stay (past the budget)
        const char* slot = l.recv_slot(buf, m, channel, first + e, stride);
        if (self) {
          const int64_t row = me.recv_prefix[queue] + base + index;
          intranode::read_dispatch_slots(ctx, s, me, &slot, &row, 1, my_local * epr, epr);
        } else {
          forward_slot(ctx, s, d * epr, epr, slot, q.slot(nvl_sent + index), queue, base + index);
        }
      }
      ++index;
    }
    ctx.group_sync();
    // 5. Publish d's rows; free what every group passed.
    if (warp == 0) {
      if (nvlink && num_held > 0) q.publish(ctx, nvl_sent, num_held);
      if (ctx.lane() == 0) {
        ctx.shared_store(&held[m], base + to_d);
        ctx.shared_store(&consumed[m], first + count);
        // Store, then read the other groups' progress: without a sequentially consistent fence
        // between the two, two groups finishing the same chunk can each miss the other's store
        // and neither would free it.
        ctx.fence_sc();
        int32_t passed = first + count;
        for (int g = 0; g < L; ++g) {
          const int32_t v = ctx.shared_load(&fs->consumed[g][m]);
          passed = v < passed ? v : passed;
        }
        const int32_t before = ctx.shared_fetch_max(&fs->published[m], passed);
        if (passed > before)
          ctx.signal_add_at(rank, rail_peer(cm, rank, m), l.head(buf, my_node, channel),
                            static_cast<uint64_t>(passed - before));
      }
    }
    nvl_sent += num_held;
  }
  if (warp == 0 && nvlink && nvl_sent > 0) q.finish(ctx, nvl_sent);
}

// ---- dispatch: NVLink receiver ----------------------------------------------------------------

// Group for local forwarder f (`warp` of `group_warps`; f = this rank is the forwarder's own
// job): its ring (f -> me, channel), each row to recv_prefix[queue] + index from its slot.
template <class Ctx>
MOE_ROLE void fused_nvl_recv(Ctx& ctx, const FusedDispatchArgs& a, int rank, int channel, int f, int warp,
                             int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& nl = cm.nvl_layout;
  const FusedDispatchRank& me = a.ranks[rank - cm.rank_begin];
  const int N = cm.num_nodes, L = cm.ranks_per_node, C = cm.num_channels;
  const int my_node = rank / L, my_local = rank % L, f_rank = my_node * L + f;
  if (f == my_local) return;
  char* nvl = nvl_buffer(cm, rank);
  if (warp == 0 && ctx.lane() == 0) {
    int32_t ok = 0, expected = 0;
    uint64_t skipped = 0;  // f's rail pairs that disagreed: their rows do not come
    if (me.peer_ok != nullptr) {
      ok = me.peer_ok[N + f];  // notify's counts already leave refused pairs out
    } else {
      int64_t theirs[kHeaderLineWords];
      const WaitSite site{kDispatch, intranode::kReceiver, rank, channel, f_rank, intranode::kRelayHeader};
      if (get_local_header(ctx, cm, rank, f, epoch, site, theirs)) {
        ok = judge_local(ctx, cm, me.check, rank, f, theirs, channel == 0);
        skipped = static_cast<uint64_t>(theirs[kReportWord]);
      }
    }
    int64_t before = 0;
    for (int m = 0; m < N; ++m) {
      if (((skipped >> m) & 1u) == 0)
        expected += static_cast<int32_t>(travelling(me.recv_prefix, L, C, f, m, channel, me.budget, before));
      before += rows_from(me.recv_prefix, L, C, f, m);
    }
    ctx.shared_store(&gs->verdict, ok);
    ctx.shared_store(&gs->count, expected);
  }
  ctx.group_sync();
  if (ctx.shared_load(&gs->verdict) != 1) return;
  const SlotLayout& s = a.slot;
  const NvlQueue q =
      nvl_queue(nl, nvl_buffer(cm, f_rank), nvl, f, my_local, channel,
                WaitSite{kDispatch, intranode::kReceiver, rank, channel, f_rank, intranode::kForwardTail});
  ring::recv_entries(
      ctx, q, ctx.rows_in_flight(cm.variant), ctx.shared_load(&gs->count),
      [&](const int64_t*, char* const* slots, int n) {
        int64_t rows[Ctx::kMaxRows];
        for (int r = 0; r < Ctx::kMaxRows && r < n; ++r) {
          const int32_t queue = ctx.broadcast(ctx.queue_i32(slots[r] + s.aux_offset + 4));
          const int32_t index = ctx.broadcast(ctx.queue_i32(slots[r] + s.aux_offset + 8));
          rows[r] = me.recv_prefix[queue] + index;
        }
        intranode::read_dispatch_slots(ctx, s, me, slots, rows, n, 0, a.experts_per_rank);
        if (cm.l2_discard) {
          ctx.warp_sync();
          for (int r = 0; r < Ctx::kMaxRows && r < n; ++r) ctx.discard(slots[r], nl.slot_bytes);
        }
      },
      warp, group_warps, gs);
}

// ---- combine: NVLink holder sender ------------------------------------------------------------

// Group for local forwarder f: this rank's rows of sources (m, f), m ascending (skipping the
// nodes f's report refused), with their row scales, into f's ring (me -> f, channel).
template <class Ctx>
MOE_ROLE void fused_holder_send(Ctx& ctx, const FusedCombineArgs& a, int rank, int channel, int f, int warp,
                                int group_warps, uint64_t epoch, GroupState* gs) {
  const Common& cm = a.common;
  const BufferLayout& nl = cm.nvl_layout;
  const SlotLayout& s = a.slot;
  const FusedCombineRank& me = a.ranks[rank - cm.rank_begin];
  const int N = cm.num_nodes, L = cm.ranks_per_node, C = cm.num_channels;
  const int my_node = rank / L, my_local = rank % L, f_rank = my_node * L + f;
  if (f == my_local) return;  // the forwarder reads its own rows
  if (warp == 0 && ctx.lane() == 0) {
    int64_t theirs[kHeaderLineWords];
    const WaitSite site{kCombine, intranode::kSender, rank, channel, f_rank, intranode::kRelayHeader};
    int32_t ok = 0;
    uint64_t skipped = 0;
    if (get_local_header(ctx, cm, rank, f, epoch, site, theirs)) {
      ok = judge_local(ctx, cm, me.check, rank, f, theirs, channel == 0);
      skipped = static_cast<uint64_t>(theirs[kReportWord]);
    }
    ctx.shared_store(&gs->verdict, ok);
    ctx.shared_store(&gs->lo, static_cast<int32_t>(skipped));
    ctx.shared_store(&gs->hi, static_cast<int32_t>(skipped >> 32));
  }
  ctx.group_sync();
  if (ctx.shared_load(&gs->verdict) != 1) return;
  const uint64_t skipped = (static_cast<uint64_t>(static_cast<uint32_t>(ctx.shared_load(&gs->hi))) << 32) |
                           static_cast<uint32_t>(ctx.shared_load(&gs->lo));
  const int32_t* p = me.recv_prefix;
  auto queue = [&](int m) { return (m * L + f) * C + channel; };
  int64_t total = 0, before = 0;  // my rows from f that travel (all of them without a budget)
  for (int m = 0; m < N; ++m) {
    if (((skipped >> m) & 1u) == 0) total += travelling(p, L, C, f, m, channel, me.budget, before);
    before += rows_from(p, L, C, f, m);
  }
  const NvlQueue q = nvl_queue(nl, nvl_buffer(cm, rank), nvl_buffer(cm, f_rank), my_local, f, channel,
                               WaitSite{kCombine, intranode::kSender, rank, channel, f_rank, intranode::kHead});
  ring::send_entries(
      ctx, q, nl.num_slots, cm.chunk_tokens, ctx.rows_in_flight(cm.variant), total,
      [&](const int64_t* entries, char* const* slots, int n) {
        int64_t rows[Ctx::kMaxRows];
        for (int r = 0; r < Ctx::kMaxRows && r < n; ++r) {
          int64_t e = entries[r], from_f = 0;
          int m = 0;  // entry e of the concatenation over m
          for (;; from_f += rows_from(p, L, C, f, m++)) {
            if ((skipped >> m) & 1u) continue;
            const int64_t count = travelling(p, L, C, f, m, channel, me.budget, from_f);
            if (e < count) break;
            e -= count;
          }
          rows[r] = p[queue(m)] + e;
        }
        intranode::write_combine_slots(ctx, s, me.y, me.row_scale, rows, me.num_rows, slots, n);
      },
      warp, group_warps, gs);
}

// ---- combine: forwarder reducer ---------------------------------------------------------------

// What the forwarder's reducer block shares (shared memory on the GPU; set by one warp before
// the others start): the verdicts and, per source node m, where its ring's entries start in
// this channel's sequence (all rings, m ascending) and where this rank's own rows from source
// (m, me) start among its own rows.
struct ForwardTables {
  int32_t start[kMaxNodes + 1];
  int32_t self_start[kMaxNodes + 1];
  uint32_t rail_lo, rail_hi;  // bit m: my rail pair with node m agrees
  uint32_t agree;             // bit d: my NVLink pair with local rank d agrees
  int32_t list;               // forward_mask lists the travelling rows (listed())
};

// Warp: fills `t` (lane 0 writes).
template <class Ctx>
MOE_ROLE void forward_tables(Ctx& ctx, const FusedCombineArgs& a, int rank, int channel, uint64_t epoch,
                             ForwardTables* t) {
  const Common& cm = a.common;
  const FusedCombineRank& me = a.ranks[rank - cm.rank_begin];
  const int N = cm.num_nodes, L = cm.ranks_per_node, C = cm.num_channels;
  const int my_node = rank / L, my_local = rank % L;
  const uint64_t rail =
      rail_agreement(ctx, cm, me.check, rank, epoch, false,
                     WaitSite{kNodeCombine, intranode::kReceiver, rank, channel, 0, intranode::kHeader});
  uint64_t agree = 0, failed = 0;
  for (int d = ctx.lane(); d < L; d += ctx.width()) {
    int64_t theirs[kHeaderLineWords];
    const WaitSite site{kCombine, intranode::kReceiver, rank, channel, my_node * L + d, intranode::kRelayHeader};
    if (!get_local_header(ctx, cm, rank, d, epoch, site, theirs)) {
      failed |= uint64_t{1} << d;
    } else if (header_diff(me.check.header.w, theirs) < 0) {
      agree |= uint64_t{1} << d;
    }
  }
  agree = ctx.warp_or(failed) != 0 ? 0 : ctx.warp_or(agree);
  if (ctx.lane() == 0) {
    const int32_t* fp = me.forward_prefix;
    const int32_t* p = me.recv_prefix;
    int64_t own = 0, before = 0;  // my own rows that travel (to myself as their forwarder)
    for (int m = 0; m <= N; ++m) {
      t->start[m] = fp[channel * N + m] - fp[channel * N];
      t->self_start[m] = static_cast<int32_t>(own);
      if (m == N) break;
      if ((rail >> m) & 1u) own += travelling(p, L, C, my_local, m, channel, me.budget, before);
      before += rows_from(p, L, C, my_local, m);
    }
    t->rail_lo = static_cast<uint32_t>(rail);
    t->rail_hi = static_cast<uint32_t>(rail >> 32);
    t->agree = static_cast<uint32_t>(agree);
    t->list = listed(me, C, N);
  }
  ctx.warp_sync();
}

// The forwarder (rank, channel) as ring::reduce_worker sees it: tokens are the entries of all
// stage-1 rings of the channel, m ascending; holders are local ranks (this rank reads its own y);
// each worker owns whole chunks, reduces their rows straight into the stage-1 staging slots,
// and puts each chunk with its flag once its last row is reduced.
struct ForwardCombineSource {
  const Common* cm;
  const FusedCombineArgs* a;
  const FusedCombineRank* me;
  const ForwardTables* t;
  char* buf;
  char* nvl;
  int rank;
  int channel;
  uint64_t epoch;

  MOE_ROLE int my_node() const { return rank / cm->ranks_per_node; }
  MOE_ROLE int my_local() const { return rank % cm->ranks_per_node; }
  MOE_ROLE bool rail_ok(int m) const { return ((m < 32 ? t->rail_lo >> m : t->rail_hi >> (m - 32)) & 1u) != 0; }
  MOE_ROLE int node_of(int i) const {  // the ring of entry i: start[m] <= i < start[m + 1]
    int lo = 0, hi = cm->num_nodes - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (t->start[mid] <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
  MOE_ROLE int num_tokens() const { return t->start[cm->num_nodes]; }
  MOE_ROLE int num_peers() const { return cm->ranks_per_node; }
  // One warp per row: after() puts a chunk once its last row is reduced, which a team would have
  // to agree on first (Config.combine_warps serves the source reducers).
  MOE_ROLE int team() const { return 1; }
  MOE_ROLE bool backoff() const { return cm->variant.coordinator_backoff != 0; }
  MOE_ROLE bool holds(int i, int d) const {  // d returns row i (it holds it, and it travels)
    const int m = node_of(i);
    return ((t->agree >> d) & 1u) && rail_ok(m) &&
           travels(*me, cm->num_nodes, cm->ranks_per_node, cm->num_channels, channel, m, i - t->start[m], d,
                   t->list != 0);
  }
  MOE_ROLE bool owns(int i, int worker, int num_workers) const {
    const int m = node_of(i);
    return rail_ok(m) && ((i - t->start[m]) / cm->chunk_tokens + m) % num_workers == worker;
  }
  // Before a chunk's first row: room in the staging ring (me -> m) for the whole chunk.
  template <class C>
  MOE_ROLE bool begin(C& ctx, int i) const {
    const int m = node_of(i), j = i - t->start[m], K = cm->chunk_tokens;
    if (j % K != 0) return true;
    const int total = t->start[m + 1] - t->start[m];
    const int64_t target = static_cast<int64_t>(j) + (total - j < K ? total - j : K) - cm->layout.num_slots;
    if (target <= 0) return true;
    return ctx.wait_signal(cm->layout.head(buf, m, channel), target,
                           WaitSite{kNodeCombine, intranode::kSender, rank, channel, rail_peer(*cm, rank, m),
                                    intranode::kHead}) >= 0;
  }
  template <class C>
  MOE_ROLE int64_t wait(C& ctx, int d, int64_t target) const {
    if (d == my_local()) return int64_t{1} << 30;  // my own rows are in y already
    return ctx.wait_ge(
        cm->nvl_layout.tail(nvl, d, channel), static_cast<int32_t>(target),
        WaitSite{kCombine, intranode::kReceiver, rank, channel, my_node() * cm->ranks_per_node + d, intranode::kTail});
  }
  MOE_ROLE int64_t own_row(int i, int64_t index) const {
    const int m = node_of(i);
    const int L = cm->ranks_per_node, C = cm->num_channels;
    return me->recv_prefix[(m * L + my_local()) * C + channel] + (index - t->self_start[m]);
  }
  template <class C>
  MOE_ROLE char* row(C&, int d, int64_t index, int i) const {
    if (d != my_local()) return cm->nvl_layout.slot(nvl, d, channel, index);
    const int64_t r = own_row(i, index);
    return r < me->num_rows ? const_cast<char*>(me->y) + r * a->slot.x_bytes : cm->layout.zero(buf);
  }
  template <class C>
  MOE_ROLE float scale(C& ctx, int d, const char* row, int64_t index, int i) const {
    if (d != my_local()) return ctx.queue_f32(row + a->slot.aux_offset);
    const int64_t r = own_row(i, index);
    return (r < me->num_rows && me->row_scale != nullptr) ? me->row_scale[r] : 1.0f;
  }
  MOE_ROLE char* out(int i) const {
    const int m = node_of(i);
    return cm->layout.send_slot(buf, m, channel, i - t->start[m], a->slot.slot_bytes);
  }
  // After a chunk's last row: its put, with the chunk's flag.
  template <class C>
  MOE_ROLE void after(C& ctx, int i, char* const* rows, int num_rows, int, int) const {
    if (cm->l2_discard) {
      for (int h = 0; h < num_rows; ++h)
        if (rows[h] >= nvl && rows[h] < nvl + cm->nvl_layout.total_bytes)
          ctx.discard(rows[h], cm->nvl_layout.slot_bytes);
      ctx.warp_sync();
    }
    const int m = node_of(i), j = i - t->start[m], K = cm->chunk_tokens, total = t->start[m + 1] - t->start[m];
    if (j % K != K - 1 && j != total - 1) return;
    const int first = j - j % K, stride = a->slot.slot_bytes;
    const RdmaLayout& l = cm->layout;
    ctx.put_signal(rank, rail_peer(*cm, rank, m), l.recv_slot(buf, my_node(), channel, first, stride),
                   l.send_slot(buf, m, channel, first, stride), static_cast<int64_t>(j - first + 1) * stride,
                   l.flag(buf, my_node(), channel, (first / K) % (l.num_slots / K)), chunk_tag(epoch, first / K));
  }
  // Before the final head of a holder's ring: reset its tail (intranode.cuh).
  template <class C>
  MOE_ROLE void free(C& ctx, int d, int32_t freed, bool final) const {
    if (d == my_local()) return;
    if (final) ctx.store_relaxed(cm->nvl_layout.tail(nvl, d, channel), 0);
    ctx.store_release(cm->nvl_layout.head(nvl_buffer(*cm, my_node() * cm->ranks_per_node + d), my_local(), channel),
                      freed);
  }
};

// Coordinator, after every worker finished: waits until each source consumed its ring, then
// resets the head for the next operation.
template <class Ctx>
MOE_ROLE void forward_combine_finish(Ctx& ctx, const ForwardCombineSource& src) {
  const Common& cm = *src.cm;
  for (int m = ctx.lane(); m < cm.num_nodes; m += ctx.width()) {
    const int total = src.t->start[m + 1] - src.t->start[m];
    if (!src.rail_ok(m) || total == 0) continue;
    uint64_t* head = cm.layout.head(src.buf, m, src.channel);
    const WaitSite site{kNodeCombine, intranode::kCoordinator,    src.rank,
                        src.channel,  rail_peer(cm, src.rank, m), intranode::kHead};
    if (ctx.wait_signal_lane(head, total, site) >= 0) ctx.reset_signal(head);
  }
}

}  // namespace internode
}  // namespace moe_dispatch

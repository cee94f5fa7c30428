// Internode (hierarchical) dispatch/combine: protocol, RDMA buffer layout, kernel arguments.
//
// Shared by the CUDA kernels (internode_kernels.cu: loopback and NVSHMEM modes) and the CPU
// backend (internode_cpu.cpp), which run the same role code (internode_roles.cuh). Plain C++17
// outside `#ifdef __CUDA_ARCH__`, like intranode.cuh.
//
// ---------------------------------------------------------------------------------------------
// World: W = N nodes x L ranks, rank r = (node r / L, local r % L). Experts E, rank r owns
// [r E/W, (r+1) E/W), so node n owns [n E/N, (n+1) E/N) ("node-local" ids subtract n E/N).
//
// Stage 1 (RDMA): rank (m, l) sends each of its tokens once to every node n that holds it
// (is_token_in_node [T, N], any over the node's ranks), always to the same local index:
// the forwarder (n, l). So stage 1 is N independent "rails", one per local index l, each a
// world of N peers. It is the intranode queue protocol with nodes as peers, moved by
// put-with-signal instead of NVLink stores:
//   - per (source node m -> dest node n, channel c) one ring of S slots in n's symmetric
//     buffer, and a staging ring with the same indices in m's buffer (the source of the puts);
//   - the sender fills K = chunk_tokens staged slots (write_dispatch_slot: x row, fp8
//     scales, top-k ids in the node-local numbering of n, -1 elsewhere, weights, source token),
//     then one put-with-signal moves the chunk into n's ring and SETs n's tail[m][c] to the
//     slots written so far (data lands before the signal). S % K == 0 and chunks start at
//     multiples of K, so a chunk never wraps the ring and is one contiguous put;
//   - the receiver copies slots out (read_dispatch_slot) into staging rows ordered by
//     (source node, channel, i) = (source node, source token), then SETs m's head[n][c];
//   - self-resetting counters as intranode: the receiver zeroes its tail before the final head,
//     the sender zeroes its head after seeing the final head (local stores, then a system fence
//     before any later signal), so every operation starts from zero without a barrier;
//   - node notify: counts [N][C] per destination node are put with a signal SET to
//     `epoch + 1` into every peer's meta[epoch % 2][me]; a rank reads its meta once every
//     peer's arrive[epoch % 2][p] >= epoch + 1, then advances its own epoch. Double-buffering
//     by parity needs no first barrier: a peer can only write this parity again two notifies
//     later, after it waited for my next notify, which starts after I read this one.
//
// Stage 2 (NVLink): inside node n, forwarder (n, l) hands the rows it received from source node
// m to the local ranks that own their experts: one intranode operation per source node m
// (intranode_roles.cuh, unchanged) whose "tokens of rank l" are l's stage-1 rows from m. The
// intranode receive order (source l, then token) inside op m, ops stacked by m, gives rows
// ordered by (m, l, token) = (source rank, source token): the oracle's order.
//
// Combine runs backwards: stage 2's intranode combine of op m reduces, on the forwarder, each
// forwarded row over its holders in ascending local rank in fp32 and rounds it once to y's
// dtype (the node partial); stage 1 puts each node partial back once over RDMA; the source
// sums the partials of a token over its nodes in ascending node order in fp32 (scale 1, an
// exact step) and rounds once. Every sum has a fixed order, no atomics: results are
// deterministic and equal moe_dispatch.reference bit for bit.
//
// Waits: every wait is bounded (as intranode, ErrorRecord): phase (node notify / node dispatch
// / node combine), role, waiting rank, channel, the peer rank awaited and the counter.
// ---------------------------------------------------------------------------------------------
#pragma once

#include <cstdint>

#include "kernels/intranode.cuh"

namespace moe_dispatch {
namespace internode {

using intranode::align_up;
using intranode::CombineRank;
using intranode::DispatchRank;
using intranode::ErrorRecord;
using intranode::NotifyRank;
using intranode::SlotLayout;

constexpr int kMaxNodes = 64;  // shared-memory arrays of the combine receiver; N * C <= kNotifyThreads
constexpr int kMaxChannels = intranode::kMaxChannels;
constexpr int kMaxLaunchRanks = 16;  // ranks one launch serves (loopback: all W; NVSHMEM: 1)
constexpr int kNumThreads = intranode::kNumThreads;
constexpr int kNumWarps = intranode::kNumWarps;
constexpr int kNotifyThreads = 1024;
constexpr int kLine = intranode::kLine;

// Stage-1 error phases (intranode uses 1..3 for notify, dispatch, combine).
enum Phase : int32_t { kNodeNotify = 4, kNodeDispatch = 5, kNodeCombine = 6 };

// One rank's RDMA buffer (NVSHMEM: one symmetric allocation, same offsets on every PE).
// N = num_nodes, C = num_channels, S = num_slots, B = slot_bytes (the largest slot of any op;
// an operation strides its rings by its own slot size, so fp8 rows do not move bf16 padding):
//
//   byte offset        region
//   0                  epoch     uint64               node notifies this rank completed
//   arrive_offset      arrive    uint64 [2][N]        signal: node p's counts of epoch parity e arrived
//   meta_offset        meta      int32 [2][N][C]      counts node p -> me per channel (written by p)
//   meta_out_offset    meta_out  int32 [2][N][C]      my counts for node p (source of the put)
//   tail_offset        tail      [N][C] 128-B lines   uint64: slots of ring (p -> me, c) written (p's signal)
//   head_offset        head      [N][C] 128-B lines   uint64: slots of ring (me -> p, c) consumed (p's signal)
//   recv_offset        recv      [N][C][S] x B        ring (p -> me, c)
//   send_offset        send      [N][C][S] x B        staging of ring (me -> p, c), same slot indices
//   total_bytes
//
// Everything before recv_offset must be zero when the buffer is made.
struct RdmaLayout {
  int32_t num_nodes;
  int32_t num_channels;
  int32_t num_slots;
  int32_t slot_bytes;
  int64_t arrive_offset;
  int64_t meta_offset;
  int64_t meta_out_offset;
  int64_t tail_offset;
  int64_t head_offset;
  int64_t recv_offset;
  int64_t send_offset;
  int64_t total_bytes;

  MOE_HD uint64_t* epoch(char* base) const { return reinterpret_cast<uint64_t*>(base); }
  MOE_HD uint64_t* arrive(char* base, int parity, int node) const {
    return reinterpret_cast<uint64_t*>(base + arrive_offset) + parity * num_nodes + node;
  }
  MOE_HD int32_t* meta(char* base, int parity, int node) const {
    return reinterpret_cast<int32_t*>(base + meta_offset) + (parity * num_nodes + node) * num_channels;
  }
  MOE_HD int32_t* meta_out(char* base, int parity, int node) const {
    return reinterpret_cast<int32_t*>(base + meta_out_offset) + (parity * num_nodes + node) * num_channels;
  }
  MOE_HD uint64_t* tail(char* base, int node, int channel) const {
    return reinterpret_cast<uint64_t*>(base + tail_offset +
                                       static_cast<int64_t>(node * num_channels + channel) * kLine);
  }
  MOE_HD uint64_t* head(char* base, int node, int channel) const {
    return reinterpret_cast<uint64_t*>(base + head_offset +
                                       static_cast<int64_t>(node * num_channels + channel) * kLine);
  }
  // Slot `index` of ring (node, channel) for an operation whose slots are `stride` bytes.
  MOE_HD char* recv_slot(char* base, int node, int channel, int64_t index, int stride) const {
    return base + recv_offset + ring_offset(node, channel) + (index % num_slots) * stride;
  }
  MOE_HD char* send_slot(char* base, int node, int channel, int64_t index, int stride) const {
    return base + send_offset + ring_offset(node, channel) + (index % num_slots) * stride;
  }
  MOE_HD int64_t ring_offset(int node, int channel) const {
    return static_cast<int64_t>(node * num_channels + channel) * num_slots * slot_bytes;
  }
};

MOE_HD RdmaLayout make_rdma_layout(int num_nodes, int num_channels, int num_slots, int slot_bytes) {
  RdmaLayout l{};
  l.num_nodes = num_nodes;
  l.num_channels = num_channels;
  l.num_slots = num_slots;
  l.slot_bytes = slot_bytes;
  const int64_t queues = static_cast<int64_t>(num_nodes) * num_channels;
  l.arrive_offset = kLine;
  l.meta_offset = l.arrive_offset + align_up(16 * static_cast<int64_t>(num_nodes), kLine);
  l.meta_out_offset = l.meta_offset + align_up(8 * queues, kLine);
  l.tail_offset = l.meta_out_offset + align_up(8 * queues, kLine);
  l.head_offset = l.tail_offset + kLine * queues;
  l.recv_offset = l.head_offset + kLine * queues;
  l.send_offset = l.recv_offset + queues * num_slots * static_cast<int64_t>(slot_bytes);
  l.total_bytes = l.send_offset + queues * num_slots * static_cast<int64_t>(slot_bytes);
  return l;
}

// ---- kernel arguments (by value; one launch serves ranks [rank_begin, +num_launch_ranks)) ----

struct Common {
  int32_t num_nodes;         // N
  int32_t ranks_per_node;    // L
  int32_t num_channels;      // C of this call (<= layout.num_channels)
  int32_t rank_begin;        // first global rank of this launch
  int32_t num_launch_ranks;  // W in loopback, 1 with NVSHMEM
  int32_t skip_rank;         // loopback tests: this rank's blocks do nothing (-1: none)
  int32_t chunk_tokens;      // K
  int64_t timeout_cycles;    // bound of every wait (clock64 cycles; ns on the CPU backend)
  RdmaLayout layout;
  char* symmetric;                 // NVSHMEM: this PE's buffer (a symmetric address); else null
  char* buffers[kMaxLaunchRanks];  // loopback / CPU: every rank's buffer, by global rank
  ErrorRecord* error;
  ErrorRecord* error_host;
};

// The peer of `rank` on node `node`: the same local index (the rail of stage 1).
MOE_HD int rail_peer(const Common& c, int rank, int node) {
  return node * c.ranks_per_node + rank % c.ranks_per_node;
}

// is_token_in_rank fields mean is_token_in_node [T, N] here; recv_prefix is [N * C + 1].
struct NotifyArgs {
  Common common;
  NotifyRank ranks[kMaxLaunchRanks];
};

// experts_per_node: E / N; received top-k ids are node-local (stage 2's input).
struct DispatchArgs {
  Common common;
  SlotLayout slot;
  int32_t experts_per_node;
  DispatchRank ranks[kMaxLaunchRanks];
};

// y: the node partials [R1, H] on the forwarder (rows as its stage-1 receive); out [T, H].
struct CombineArgs {
  Common common;
  SlotLayout slot;
  CombineRank ranks[kMaxLaunchRanks];
};

}  // namespace internode
}  // namespace moe_dispatch

// Internode (hierarchical) dispatch/combine: protocol, RDMA buffer layout, kernel arguments.
//
// Shared by the CUDA kernels (internode_kernels.cu: the staged pipeline; internode_fused.cu:
// the fused one; both in loopback and NVSHMEM modes) and the CPU backend (internode_cpu.cpp),
// which run the same role code (internode_roles.cuh, internode_fused_roles.cuh). Plain C++17
// outside `#ifdef __CUDA_ARCH__`, like intranode.cuh.
//
// ---------------------------------------------------------------------------------------------
// World: W = N nodes x L ranks, rank r = (node r / L, local r % L). Experts E, rank r owns
// [r E/W, (r+1) E/W), so node n owns [n E/N, (n+1) E/N) ("node-local" ids subtract n E/N).
//
// Stage 1 (RDMA): rank (m, l) sends each of its tokens once to every node n that holds it
// (is_token_in_node [T, N], any over the node's ranks), always to the same local index: the
// forwarder (n, l). So stage 1 is L independent "rails", one per local index, each a world of
// N peers. Per (source node m -> dest node n, channel c) there is one ring of S slots in n's
// buffer, and a staging ring with the same indices in m's (the source of the puts); the
// source's channel c tokens travel in token order, top-k ids node-local (n's), -1 elsewhere.
// Stage 2 (NVLink): inside node n, forwarder (n, l) hands each row to the local ranks that own
// its experts. Rows end ordered by (source rank, source token): the oracle's order.
// Combine runs backwards: the holders return their rows to the forwarder, which pre-reduces each
// row over its holders in ascending local rank in fp32 and rounds once to y's dtype (the node
// partial); stage 1 puts each node partial back once; the source sums a token's partials in
// ascending node order in fp32 (scale 1, exact steps) and rounds once. Fixed orders, no
// atomics: results are deterministic and equal moe_dispatch.reference bit for bit. The order's
// definition: moe_dispatch/semantics/summation.py.
//
// Two pipelines run this design (Config.internode_pipeline):
//
// FUSED (the default): one notify kernel computes everything on the device, then one kernel
// per dispatch or combine runs both stages at once, three blocks per channel:
//   notify    every rank counts, per destination node m, its tokens per channel (the stage-1
//             ring sizes) and per rank of m per channel, and puts both with its header to the
//             rail peer (m, l). The forwarder checks the headers, writes its forward_prefix
//             (stage-1 rows by (channel, source node)) and relays to each local rank d its
//             header, its rail verdicts and the counts of every source (m, l) for d. Each
//             rank's receive prefix over (source rank, channel) then comes from device counts
//             alone: without a budget the host reads R (and the forwarded rows R1) once; with
//             one (num_worst_tokens) it reads nothing.
//   dispatch  RDMA senders: every warp owns chunks q, q + G, ... of its group's rings (no
//             per-chunk barrier), stages each and issues its own put-with-signal, the signal
//             being that chunk's flag (tag: op epoch and chunk), so chunks land and are seen in
//             any order. Forwarders: a warp group per local destination d polls the stage-1
//             rings of its channel, takes whichever chunk has landed, forwards the rows d holds
//             over the NVLink ring (me -> d, c) (or straight into its own outputs when d is
//             itself), and frees stage-1 slots once every group passed them (each group adds
//             its progress to the sender's head). NVLink receivers: a group per forwarder
//             writes each row where its slot says (receive row = prefix[source, channel] + i).
//             Stage 1 and stage 2 overlap; there is no staging copy of the rows and no host
//             synchronisation between them.
//   combine   holders stream their rows to the forwarder over NVLink (rows of sources (m, f),
//             m ascending); the forwarder's workers reduce each forwarded row over its holders
//             (forward_mask, written by the dispatch) straight into the stage-1 staging slots,
//             and each puts the chunks it owns with their flags; the source reduces over nodes.
//   budget    (num_worst_tokens = B) every rank keeps the first B rows of its receive order and
//             drops the rest (they combine as zeros). What travels between a forwarder f and a
//             local rank d (fresh dispatch, cached dispatch and combine alike) is d's rows from
//             f whose ordinal among them, in d's order (source node, channel, token), is below
//             B: at most B per pair, and every row d keeps (its receive row is at least that
//             ordinal). d counts them from recv_prefix, f from relay_prefix (notify: the counts
//             it relayed to d, summed over (source node, channel)). forward_mask then holds,
//             while R1 <= forward_capacity = L B, each forwarded row's holders, and forward_cut
//             the first ring index of each (d, channel, source node) that stays; past that
//             capacity ("listed") it holds per d the ring indices of its B travelling rows
//             (d B + ordinal), which the forwarder searches: the rows that travel always fit,
//             the holders of all R1 rows need not.
// STAGED (kept so one GPU run can time both side by side): node notify, a host read of the
// stage-1 counts, node dispatch into staging rows, a layout of them, one intranode notify per
// source node, a second host read, one intranode dispatch per source node; combine reverses
// it (one intranode combine per source node into node partials, then the node combine). Its
// stage 1 is the ring protocol of ring.cuh with one put-with-signal per chunk from warp 0.
//
// RDMA ring protocol of the fused pipeline (per ring, S % K == 0, Q = S / K chunks):
//   - chunk q = entries [qK, qK + K) (the last may be short) lands with one put whose signal
//     SETs flag[q % Q] = chunk_tag(op epoch, q). Tags grow within an operation and across
//     operations (the epoch is in the high word), so no flag is ever reset;
//   - the receiving side frees entries by adding to the sender's head (fused dispatch: each
//     forwarder group adds the progress every group has passed, via shared_fetch_max; combine:
//     the source's coordinator SETs it); a sender writes chunk q once head >= qK + K - S;
//   - at the end of an operation a sender waits for head == its entry count and resets it:
//     the next operation's first put happens after every slot was consumed.
// The staged pipeline's stage 1 keeps intranode.cuh's tail/head counters (ring.cuh's loops).
//
// Notify double-buffering (both pipelines): messages are put with a signal SET to
// `notify epoch + 1` into the peer's meta[epoch % 2][me]; a peer can write this parity again
// only two notifies later, after it waited for my next notify, which I send after reading this
// one. The fused notify's NVLink relay follows the same rule in the NVLink buffers' relay region.
//
// Headers (header.cuh): notify carries them in its messages; cached dispatch and combine
// exchange header lines in the kernel: one warp of the forwarder block of channel 0 puts this
// rank's line to each rail peer, checks theirs, then writes its NVLink line (with a report of
// its rail verdicts) to each local peer; every other role reads the lines it needs. A rank
// thus learns of every rank's header: directly from its rail and local peers, and from each
// local peer's report about that peer's rail. Cost: one signal round per link (an RDMA round,
// then an NVLink hop), overlapped with the start of the kernel: the RDMA senders begin as soon
// as their rail peer's line is there. The staged pipeline checks its rail pairs in its node
// operations and its local pairs in its intranode ones, without the relay: a refusing rank is
// then learnt of by its rail and local peers only.
//
// Waits: every wait is bounded (ErrorRecord): phase, role, waiting rank, channel, the peer rank
// awaited and the counter.
// ---------------------------------------------------------------------------------------------
#pragma once

#include <cstdint>

#include "kernels/header.cuh"
#include "kernels/intranode.cuh"

namespace moe_dispatch {
namespace internode {

using intranode::align_up;
using intranode::Check;
using intranode::CombineRank;
using intranode::DispatchRank;
using intranode::ErrorRecord;
using intranode::NotifyRank;
using intranode::SlotLayout;

constexpr int kMaxNodes = 64;  // shared-memory arrays of the combine receiver (and 64-bit rail masks)
constexpr int kMaxChannels = intranode::kMaxChannels;
constexpr int kMaxLocal = intranode::kMaxRanks;  // L: warp groups of a 16-warp block, one per local rank
constexpr int kMaxLaunchRanks = 16;              // ranks one launch serves (loopback: all W; NVSHMEM: 1)
constexpr int kNumThreads = intranode::kNumThreads;
constexpr int kNumWarps = intranode::kNumWarps;
constexpr int kNotifyThreads = 1024;
constexpr int kLine = intranode::kLine;

// Stage-1 error phases (intranode uses 1..3 for notify, dispatch, combine).
enum Phase : int32_t { kNodeNotify = 4, kNodeDispatch = 5, kNodeCombine = 6 };

// One rank's RDMA buffer (NVSHMEM: one symmetric allocation, same offsets on every PE).
// N = num_nodes, L = ranks_per_node, C = num_channels, S = num_slots, B = slot_bytes (the
// largest slot of any op; an operation strides its rings by its own slot size, so fp8 rows do
// not move bf16 padding), M = msg_bytes = 128 + align128(4 C (1 + L)):
//
//   byte offset        region
//   0                  control   one line: uint64 notify epoch, uint64 op epoch, int32 done (byte 16)
//   arrive_offset      arrive    uint64 [2][N]        signal: node p's notify message of parity e arrived
//   meta_offset        meta      [2][N] x M           node p's notify message (written by p): its header
//                                                     line, counts int32 [C] of its channel-c tokens for
//                                                     my node, then [L][C] for each of my node's ranks
//   meta_out_offset    meta_out  [2][N] x M           my messages (the source of the puts)
//   header_offset      header    [2][N] lines         rail header lines of node p (exchange operations;
//                                                     the marker is the put's signal)
//   header_out_offset  [N] lines                      my header line for node p (the source of the puts)
//   tail_offset        tail      [N][C] lines         staged: uint64 slots of ring (p -> me, c) written
//   head_offset        head      [N][C] lines         uint64: slots of ring (me -> p, c) consumed
//   flag_offset        flag      uint64 [N][C][S]     fused: chunk flags of ring (p -> me, c)
//   zero_offset        zero      B bytes of zeros     fused combine: the row of a dropped receive
//   recv_offset        recv      [N][C][S] x B        ring (p -> me, c)
//   send_offset        send      [N][C][S] x B        staging of ring (me -> p, c), same slot indices
//   total_bytes
//
// Everything before recv_offset must be zero when the buffer is made.
struct RdmaLayout {
  int32_t num_nodes;
  int32_t ranks_per_node;
  int32_t num_channels;
  int32_t num_slots;
  int32_t slot_bytes;
  int32_t msg_bytes;
  int64_t arrive_offset;
  int64_t meta_offset;
  int64_t meta_out_offset;
  int64_t header_offset;
  int64_t header_out_offset;
  int64_t tail_offset;
  int64_t head_offset;
  int64_t flag_offset;
  int64_t zero_offset;
  int64_t recv_offset;
  int64_t send_offset;
  int64_t total_bytes;

  MOE_HD uint64_t* notify_epoch(char* base) const { return reinterpret_cast<uint64_t*>(base); }
  MOE_HD uint64_t* op_epoch(char* base) const { return reinterpret_cast<uint64_t*>(base) + 1; }
  MOE_HD int32_t* done(char* base) const { return reinterpret_cast<int32_t*>(base + 16); }
  MOE_HD uint64_t* arrive(char* base, int parity, int node) const {
    return reinterpret_cast<uint64_t*>(base + arrive_offset) + parity * num_nodes + node;
  }
  // A notify message: its header line (int64[16]), then int32 counts.
  MOE_HD char* meta(char* base, int parity, int node) const {
    return base + meta_offset + static_cast<int64_t>(parity * num_nodes + node) * msg_bytes;
  }
  MOE_HD char* meta_out(char* base, int parity, int node) const {
    return base + meta_out_offset + static_cast<int64_t>(parity * num_nodes + node) * msg_bytes;
  }
  MOE_HD int64_t* header(char* base, uint64_t epoch, int node) const {
    return reinterpret_cast<int64_t*>(base + header_offset +
                                      (static_cast<int64_t>(epoch & 1u) * num_nodes + node) * kLine);
  }
  MOE_HD int64_t* header_out(char* base, int node) const {
    return reinterpret_cast<int64_t*>(base + header_out_offset + static_cast<int64_t>(node) * kLine);
  }
  MOE_HD uint64_t* tail(char* base, int node, int channel) const {
    return reinterpret_cast<uint64_t*>(base + tail_offset +
                                       static_cast<int64_t>(node * num_channels + channel) * kLine);
  }
  MOE_HD uint64_t* head(char* base, int node, int channel) const {
    return reinterpret_cast<uint64_t*>(base + head_offset +
                                       static_cast<int64_t>(node * num_channels + channel) * kLine);
  }
  MOE_HD uint64_t* flag(char* base, int node, int channel, int64_t chunk_slot) const {
    return reinterpret_cast<uint64_t*>(base + flag_offset) +
           static_cast<int64_t>(node * num_channels + channel) * num_slots + chunk_slot;
  }
  MOE_HD char* zero(char* base) const { return base + zero_offset; }
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

// A notify message's counts: [C] for the destination node, then [L][C] for its ranks.
MOE_HD int32_t* message_counts(char* message) { return reinterpret_cast<int32_t*>(message + kLine); }

MOE_HD RdmaLayout make_rdma_layout(int num_nodes, int ranks_per_node, int num_channels, int num_slots, int slot_bytes) {
  RdmaLayout l{};
  l.num_nodes = num_nodes;
  l.ranks_per_node = ranks_per_node;
  l.num_channels = num_channels;
  l.num_slots = num_slots;
  l.slot_bytes = slot_bytes;
  l.msg_bytes =
      static_cast<int32_t>(kLine + align_up(4 * static_cast<int64_t>(num_channels) * (1 + ranks_per_node), kLine));
  const int64_t queues = static_cast<int64_t>(num_nodes) * num_channels;
  const int64_t messages = 2 * static_cast<int64_t>(num_nodes) * l.msg_bytes;
  l.arrive_offset = kLine;
  l.meta_offset = l.arrive_offset + align_up(16 * static_cast<int64_t>(num_nodes), kLine);
  l.meta_out_offset = l.meta_offset + messages;
  l.header_offset = l.meta_out_offset + messages;
  l.header_out_offset = l.header_offset + 2 * kLine * static_cast<int64_t>(num_nodes);
  l.tail_offset = l.header_out_offset + kLine * static_cast<int64_t>(num_nodes);
  l.head_offset = l.tail_offset + kLine * queues;
  l.flag_offset = l.head_offset + kLine * queues;
  l.zero_offset = l.flag_offset + align_up(8 * queues * num_slots, kLine);
  l.recv_offset = l.zero_offset + align_up(slot_bytes, kLine);
  l.send_offset = l.recv_offset + queues * num_slots * static_cast<int64_t>(slot_bytes);
  l.total_bytes = l.send_offset + queues * num_slots * static_cast<int64_t>(slot_bytes);
  return l;
}

// The flag value of chunk `chunk` of an operation at op epoch `epoch`.
MOE_HD uint64_t chunk_tag(uint64_t epoch, int64_t chunk) { return intranode::entry_tag(epoch, chunk); }

// ---- kernel arguments (by value; one launch serves ranks [rank_begin, +num_launch_ranks)) ----

struct Common {
  int32_t num_nodes;         // N
  int32_t ranks_per_node;    // L
  int32_t num_channels;      // C of this call (<= layout.num_channels)
  int32_t rank_begin;        // first global rank of this launch
  int32_t num_launch_ranks;  // W in loopback, 1 with NVSHMEM
  int32_t skip_rank;         // loopback tests: this rank's blocks do nothing (-1: none)
  int32_t chunk_tokens;      // K
  int32_t l2_discard;        // fused: NVLink receivers discard consumed slots (Config.l2_discard)
  int32_t nvl_first_rank;    // fused: the global rank of nvl_buffers[0] (loopback 0, else my node's first)
  Variant variant;           // the kernel variant (variant.cuh); slot_flags is intranode only (ignored here)
  int64_t timeout_cycles;    // bound of every wait (clock64 cycles; ns on the CPU backend)
  RdmaLayout layout;
  intranode::BufferLayout nvl_layout;  // fused: the NVLink buffers (relay_nodes = N)
  char* symmetric;                     // NVSHMEM: this PE's buffer (a symmetric address); else null
  char* buffers[kMaxLaunchRanks];      // loopback / CPU: every rank's RDMA buffer, by global rank
  char* nvl_buffers[kMaxLaunchRanks];  // fused: NVLink buffers as this process maps them
  ErrorRecord* error;
  ErrorRecord* error_host;
};

// The peer of `rank` on node `node`: the same local index (the rail of stage 1).
MOE_HD int rail_peer(const Common& c, int rank, int node) { return node * c.ranks_per_node + rank % c.ranks_per_node; }

// `rank`'s NVLink buffer (a rank of a node with a launched rank).
MOE_HD char* nvl_buffer(const Common& c, int rank) { return c.nvl_buffers[rank - c.nvl_first_rank]; }

// ---- the staged pipeline's stage 1 ----
// is_token_in_rank fields mean is_token_in_node [T, N] here; recv_prefix is [N * C + 1];
// peer_ok is [N] (the rail verdicts).
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

// ---- the fused pipeline ----
// Verdicts peer_ok [N + L]: 1 where my rail pair with node m (index m) / my NVLink pair with
// local rank l (index N + l) agrees.

struct FusedNotifyRank {
  const bool* is_token_in_rank;  // [T, W]
  const bool* is_token_in_node;  // [T, N]
  int32_t* recv_prefix;          // [W * C + 1] out: rows before (source rank, channel), R last
  int32_t* forward_prefix;       // [C * N + 1] out: stage-1 rows before (channel, source node), R1 last
  int32_t* counts;               // [2] out: R, R1
  int32_t* overflow;             // [1] out: R > budget
  int32_t* peer_ok;              // [N + L] out
  int32_t* relay_prefix;         // [L * (N * C + 1)] out: per local rank d, rows relayed to d before (source node,
                                 // channel), d's total last
  int64_t* recv_topk_idx;        // [budget, K] or null: rows [R, budget) get -1 (budget mode)
  float* recv_topk_weights;      // [budget, K] or null: rows [R, budget) get 0
  int32_t* recv_src_idx;         // [budget] or null: rows [R, budget) get -1
  Check check;
  int32_t num_tokens;        // T
  int32_t budget;            // rows allocated for the receive, -1 = exactly R (host read)
  int32_t forward_capacity;  // rows of forward_mask, -1 = exactly R1 (host read)
};

struct FusedNotifyArgs {
  Common common;
  int32_t num_topk;
  FusedNotifyRank ranks[kMaxLaunchRanks];
};

struct FusedDispatchRank {
  const char* x;                  // [T, x_bytes]
  const float* x_scales;          // [T, H/128] or null
  const int64_t* topk_idx;        // [T, K] global ids, -1 = none
  const float* topk_weights;      // [T, K] or null
  const int32_t* token_ids;       // always null: a row's source token is t
  const bool* is_token_in_node;   // [T, N]
  const int32_t* recv_prefix;     // [W * C + 1]
  const int32_t* forward_prefix;  // [C * N + 1]
  const int32_t* relay_prefix;    // [L * (N * C + 1)]
  int32_t* forward_mask;          // [forward_capacity] out (fresh): holders per forwarded row, or listed (budget)
  int32_t* forward_cut;           // [L * C * N] out (fresh): per (d, channel, source node) the first ring
                                  // index whose row does not travel (INT32_MAX: every one does)
  char* recv_x;                   // [rows, x_bytes]
  float* recv_scales;             // [rows, H/128] or null
  int64_t* recv_topk_idx;         // [rows, K] local ids (null when K = 0)
  float* recv_topk_weights;       // [rows, K] or null
  int32_t* recv_src_idx;          // [rows]
  int64_t* num_recv_per_expert;   // [E / W] zeroed by the caller
  int32_t* overflow;              // [1]
  const int32_t* peer_ok;         // [N + L] notify's verdicts, or null: exchange header lines (cached)
  Check check;
  int32_t num_tokens;
  int32_t num_rows;  // rows allocated (R, or the budget)
  int32_t forward_capacity;
  int32_t budget;  // B, or -1 without one
};

struct FusedDispatchArgs {
  Common common;
  SlotLayout slot;  // the stage-1 and NVLink slots (x, scales, top-k, weights; aux: token, queue, index)
  int32_t experts_per_rank;
  int32_t experts_per_node;
  FusedDispatchRank ranks[kMaxLaunchRanks];
};

struct FusedCombineRank {
  const char* y;                  // [rows, x_bytes] in the dispatch's receive order
  const float* row_scale;         // [rows] or null
  const bool* is_token_in_node;   // [T, N]
  const int32_t* recv_prefix;     // [W * C + 1]
  const int32_t* forward_prefix;  // [C * N + 1]
  const int32_t* relay_prefix;    // [L * (N * C + 1)]
  const int32_t* forward_mask;    // [forward_capacity]
  const int32_t* forward_cut;     // [L * C * N]
  char* out;                      // [T, x_bytes]
  Check check;
  int32_t num_tokens;
  int32_t num_rows;
  int32_t forward_capacity;
  int32_t budget;  // B, or -1 without one
};

struct FusedCombineArgs {
  Common common;
  SlotLayout slot;  // combine slots: y row, row scale
  FusedCombineRank ranks[kMaxLaunchRanks];
};

}  // namespace internode
}  // namespace moe_dispatch

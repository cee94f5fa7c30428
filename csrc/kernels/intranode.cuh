// Intranode dispatch/combine over NVLink: buffer layout, queue protocol, kernel arguments.
//
// Shared by the CUDA kernels (intranode_dispatch.cu, intranode_combine.cu) and by the CPU
// backend (intranode_cpu.cpp), which runs the very same protocol code
// (intranode_roles.cuh) with threads standing in for warps. Everything here is plain C++17
// that g++ compiles too: no CUDA intrinsics outside `#ifdef __CUDA_ARCH__`.
//
// ---------------------------------------------------------------------------------------------
// Roles. A rank's SM budget `num_sms` gives C = num_sms / 2 channels; channel c of a source
// rank owns its tokens [begin(c), begin(c+1)) with begin(c) = floor(T * c / C). Per channel one
// block sends and one block receives (blockIdx.x = 2c sends, 2c + 1 receives).
//
//   dispatch sender  (source s, channel c): one warp group per destination d; the group scans
//       the channel's tokens in order and copies each token that d holds into the ring queue
//       (s -> d, c), which lives in d's buffer; publishes `tail` every chunk.
//   dispatch receiver(dest r, channel c): one warp group per source s; copies queue (s -> r, c)
//       out to rows prefix[s][c] + i of recv_x (prefix over (source, channel) in that order,
//       so rows come out ordered by source rank, then source token); publishes `head`.
//   combine sender   (holder r, channel c): one warp group per source s; the rows r received
//       from (s, c) are contiguous in y, so it streams rows [prefix[s][c], prefix[s][c+1]).
//   combine receiver (source s, channel c): worker warps take the channel's tokens round
//       robin; for token t they add the holders' rows in ascending rank order in fp32 and
//       round once (the summation order, moe_dispatch/semantics/summation.py); a coordinator
//       warp frees queue slots (`head`) behind the slowest worker.
//
// ---------------------------------------------------------------------------------------------
// Queue protocol (per queue q = (src -> dst, channel); S = num_slots, K = chunk_tokens):
//   - tail[q] lives in dst's buffer, is written only by src (st.release) and polled by dst;
//     head[q] lives in src's buffer, is written only by dst (st.release) and polled by src.
//     Everybody polls local memory; every remote access is a store.
//   - Counters count slots since the start of the operation; slot i is ring entry i % S.
//   - The sender writes entries [sent, sent + k) (k <= K) only after head >= sent + K - S,
//     then (after a group barrier) publishes tail = sent + k.
//   - The receiver copies entries [consumed, tail) out, then (after a group barrier) publishes
//     head. Before publishing the final head (= the queue's token count) it resets its tail
//     to 0: no further tail store can come in this operation, and the sender, which waits for
//     that final head before it ends, resets its head to 0. So every operation starts from
//     zeroed counters with no barrier: the next operation's first tail store into dst happens
//     after src saw the final head, which dst published after its reset.
//   - With l2_discard set, a receiver discards every slot it consumed (Ctx::discard) after
//     copying it out and before the head store that frees it: on the GPU the slot's lines leave
//     L2 without a write-back, so a ring hop that stays in L2 costs no HBM traffic; the sender's
//     next write to the slot is ordered after the discard by that head.
//   - With ready flags (Config.slot_flags) no tail moves: the writer of entry i stores
//     entry_tag(op epoch, i) with release into the slot's flag word (BufferLayout::flag_offset)
//     after its fields, each sender warp waits for its own room (head >= i + 1 - S), each
//     receiver warp polls its own entries' flags, and the head grows by atomic adds of what all
//     the group's warps passed (ring.cuh send_flagged / recv_flagged): no group barrier per
//     chunk. The sender still zeroes its head after the final count; flags need no reset (a
//     tag names its operation). A discard (l2_discard) spares the flag's line.
//   - The notify step (dispatch only) exchanges per-(source, channel) token counts through
//     meta[][]: barrier, write meta into every peer, barrier, read own meta. The first barrier
//     keeps a fast rank from overwriting meta a slow rank has not read yet.
//   - Barriers are counting semaphores, so they reset themselves: arriving at rank d adds 1 to
//     d's signal[me]; waiting takes 1 from each own signal[p] once it is >= 1.
//   - Every wait is bounded (Ctx::wait_ge): on expiry a waiter raises the ErrorRecord's flag and
//     records rank, channel, peer and counter; the other waiters see the flag and leave, offering
//     their own record if they had waited half the bound (the better-named cause wins, see
//     timeout_level); the host raises with the record's text.
// ---------------------------------------------------------------------------------------------
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/header.cuh"
#include "kernels/variant.cuh"

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD inline
#endif

namespace moe_dispatch {
namespace intranode {

// Ranks one kernel serves (a warp group per peer in a 16-warp block). The protocol has no
// other limit on W: raising it needs kNumThreads = 32 * kMaxRanks.
constexpr int kMaxRanks = 16;
// num_sms / 2; 64 channels = 128 SMs, all of an H100/H200.
constexpr int kMaxChannels = 64;
constexpr int kNumThreads = 512;  // dispatch and combine blocks
constexpr int kNumWarps = kNumThreads / 32;
constexpr int kNotifyThreads = 1024;  // one notify block per rank; W * C <= kNotifyThreads
constexpr int kLine = 128;            // counters sit on their own 128-byte line
constexpr int kFieldAlign = 16;       // slot fields start on 16 bytes (one vector access)
constexpr int kMaxTopk = 32;

MOE_HD int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// ---- channels ---------------------------------------------------------------------------------

struct TokenRange {
  int begin;
  int end;
};

// Tokens [begin(c), begin(c+1)) of channel c, begin(c) = floor(T * c / C): balanced, and a
// function of (T, C, c) only, so sender, receiver and notify agree without talking.
MOE_HD TokenRange channel_token_range(int num_tokens, int num_channels, int channel) {
  const int64_t t = num_tokens;
  return {static_cast<int>(t * channel / num_channels), static_cast<int>(t * (channel + 1) / num_channels)};
}

// The channel owning token t: the inverse of channel_token_range,
// ceil((t + 1) * C / T) - 1, for 0 <= t < T.
MOE_HD int channel_of_token(int num_tokens, int num_channels, int token) {
  const int64_t c = static_cast<int64_t>(token + 1) * num_channels;
  return static_cast<int>((c + num_tokens - 1) / num_tokens) - 1;
}

// The tag of entry (or chunk) `index` of an operation at op epoch `epoch`: what a ready flag
// holds once the entry landed (Config.slot_flags; the fused RDMA chunks' flags). Tags grow within
// an operation and across operations, so a flag is never reset.
MOE_HD uint64_t entry_tag(uint64_t epoch, int64_t index) {
  return ((epoch + 1) << 32) | static_cast<uint64_t>(index + 1);
}

// ---- slots ------------------------------------------------------------------------------------

// One queue entry. Dispatch:
//   [0, x_bytes)                         x row (any dtype, raw bytes; fp8 e4m3 for fp8)
//   [scale_offset, +scale_bytes)         fp8 scales fp32[H/128] (scale_bytes = 0 otherwise)
//   [topk_idx_offset, +4K)               int32[K]: expert id local to the destination, -1 elsewhere
//   [topk_weights_offset, +4K)           fp32[K]: gate weight, 0 where the id is -1
//   [aux_offset, +4)                     int32 source token index (token_ids[t], or t)
// Combine (num_topk = 0, scale_bytes = 0):
//   [0, x_bytes)                         y row (bf16/fp16/fp32)
//   [aux_offset, +4)                     fp32 row scale (1.0 without weights)
// Each field starts on 16 bytes; slot_bytes is a multiple of 16. With Config.slot_flags
// (intranode only) a slot's ready flag, int64 entry_tag(op epoch, entry) (ring.cuh), sits in the
// last 8 bytes of the buffer's slot stride (flag_offset): no slot layout of any intranode
// operation writes there (a slot that fills the stride leaves the aux field's last 12 bytes
// unused), so the flag holds nothing but tags whichever operations used the slot before.
// (An offset inside one layout would not do: there an earlier operation's slot of another
// layout leaves its own bytes, say top-k ids, which a poll could take for a tag.)
struct SlotLayout {
  int32_t x_bytes;
  int32_t scale_bytes;
  int32_t num_topk;
  int32_t scale_offset;
  int32_t topk_idx_offset;
  int32_t topk_weights_offset;
  int32_t aux_offset;
  int32_t slot_bytes;
};

MOE_HD SlotLayout make_slot_layout(int x_bytes, int scale_bytes, int num_topk) {
  SlotLayout s{};
  s.x_bytes = x_bytes;
  s.scale_bytes = scale_bytes;
  s.num_topk = num_topk;
  s.scale_offset = static_cast<int32_t>(align_up(x_bytes, kFieldAlign));
  s.topk_idx_offset = static_cast<int32_t>(s.scale_offset + align_up(scale_bytes, kFieldAlign));
  s.topk_weights_offset = static_cast<int32_t>(s.topk_idx_offset + align_up(4 * num_topk, kFieldAlign));
  s.aux_offset = static_cast<int32_t>(s.topk_weights_offset + align_up(4 * num_topk, kFieldAlign));
  s.slot_bytes = static_cast<int32_t>(s.aux_offset + kFieldAlign);
  return s;
}

// The whole 128-byte lines inside [p, p + bytes): all a consumed slot may discard, since a
// line it shares with a neighbouring slot can hold that slot's live bytes.
struct LineSpan {
  char* first;
  int32_t count;
};

MOE_HD LineSpan inner_lines(char* p, int bytes) {
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kLine - 1) / kLine * kLine;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) / kLine * kLine;
  return {reinterpret_cast<char*>(begin), end > begin ? static_cast<int32_t>((end - begin) / kLine) : 0};
}

// ---- the communication buffer -------------------------------------------------------------------

// One buffer per rank, allocated once per Buffer (W = num_ranks, C = num_channels, the most
// any call may use, S = num_slots, B = slot_bytes rounded up to 128, so every slot starts on a
// cache line: rows move in whole lines, and a discard (l2_discard) drops the whole slot):
//
//   byte offset                                 region
//   0                                           signal  int32[W]      arrivals of rank p at my barrier
//   meta_offset   = align128(4W)                meta    int32[W][C]   tokens of source p's channel c for me
//   tail_offset   = meta_offset + align128(4WC) tail    [W][C] lines  int32 at byte 0 of each 128-B line:
//                                                                     slots of queue (p -> me, c) written
//   head_offset   = tail_offset + 128 W C       head    [W][C] lines  slots of queue (me -> p, c) freed by p
//   epoch_offset  = head_offset + 128 W C       epoch   one line      uint64 op epoch (dispatch and combine
//                                                                     kernels run), int32 done at byte 8
//   header_offset = epoch_offset + 128          header  [2][W] lines  header lines of peer p (header.cuh)
//   relay_offset  = header_offset + 256 W       relay   internode only (relay_nodes N > 0; else empty):
//                                                 arrive int32 [2][W] (align128), then per (parity, p)
//                                                 relay_bytes = 128 + align128(4NC): p's header line and
//                                                 the counts [N][C] it forwards to me (internode.cuh)
//   queue_offset  = relay_offset + relay size   queue   [W][C][S]     B bytes each: ring (p -> me, c)
//   total_bytes   = queue_offset + W C S B
//
// Everything before queue_offset (the control region) must be zero when the Buffer is made.
// The protocol resets what it uses, except the op epoch, which counts on (every rank runs the
// same operations, so the ranks' epochs agree) and is zeroed with the rest by a reset.
struct BufferLayout {
  int32_t num_ranks;
  int32_t num_channels;
  int32_t num_slots;
  int32_t slot_bytes;
  int32_t relay_nodes;
  int32_t relay_bytes;
  int64_t meta_offset;
  int64_t tail_offset;
  int64_t head_offset;
  int64_t epoch_offset;
  int64_t header_offset;
  int64_t relay_offset;
  int64_t queue_offset;
  int64_t total_bytes;

  MOE_HD int32_t* signal(char* base) const { return reinterpret_cast<int32_t*>(base); }
  MOE_HD int32_t* meta(char* base, int peer, int channel) const {
    return reinterpret_cast<int32_t*>(base + meta_offset) + peer * num_channels + channel;
  }
  MOE_HD int32_t* tail(char* base, int peer, int channel) const {
    return reinterpret_cast<int32_t*>(base + tail_offset + static_cast<int64_t>(peer * num_channels + channel) * kLine);
  }
  MOE_HD int32_t* head(char* base, int peer, int channel) const {
    return reinterpret_cast<int32_t*>(base + head_offset + static_cast<int64_t>(peer * num_channels + channel) * kLine);
  }
  MOE_HD uint64_t* epoch(char* base) const { return reinterpret_cast<uint64_t*>(base + epoch_offset); }
  MOE_HD int32_t* done(char* base) const { return reinterpret_cast<int32_t*>(base + epoch_offset + 8); }
  MOE_HD int64_t* header(char* base, uint64_t epoch, int peer) const {
    return reinterpret_cast<int64_t*>(base + header_offset +
                                      (static_cast<int64_t>(epoch & 1u) * num_ranks + peer) * kLine);
  }
  MOE_HD int32_t* relay_arrive(char* base, int parity, int peer) const {
    return reinterpret_cast<int32_t*>(base + relay_offset) + parity * num_ranks + peer;
  }
  // p's relay message of `parity`: its header line (int64[16]), then int32 counts [N][C].
  MOE_HD int64_t* relay_line(char* base, int parity, int peer) const {
    return reinterpret_cast<int64_t*>(base + relay_offset + align_up(8 * static_cast<int64_t>(num_ranks), kLine) +
                                      static_cast<int64_t>(parity * num_ranks + peer) * relay_bytes);
  }
  MOE_HD int32_t* relay_counts(char* base, int parity, int peer) const {
    return reinterpret_cast<int32_t*>(relay_line(base, parity, peer) + 16);
  }
  MOE_HD char* slot(char* base, int peer, int channel, int64_t index) const {
    const int64_t ring = static_cast<int64_t>(peer * num_channels + channel) * num_slots;
    return base + queue_offset + (ring + index % num_slots) * slot_bytes;
  }
  // Where a slot's ready flag sits (Config.slot_flags; see SlotLayout).
  MOE_HD int32_t flag_offset() const { return slot_bytes - 8; }
};

MOE_HD BufferLayout make_buffer_layout(int num_ranks, int num_channels, int num_slots, int slot_bytes,
                                       int relay_nodes = 0) {
  BufferLayout l{};
  l.num_ranks = num_ranks;
  l.num_channels = num_channels;
  l.num_slots = num_slots;
  l.slot_bytes = static_cast<int32_t>(align_up(slot_bytes, kLine));
  l.relay_nodes = relay_nodes;
  l.relay_bytes =
      relay_nodes > 0
          ? static_cast<int32_t>(kLine + align_up(4 * static_cast<int64_t>(relay_nodes) * num_channels, kLine))
          : 0;
  const int64_t queues = static_cast<int64_t>(num_ranks) * num_channels;
  l.meta_offset = align_up(4 * static_cast<int64_t>(num_ranks), kLine);
  l.tail_offset = l.meta_offset + align_up(4 * queues, kLine);
  l.head_offset = l.tail_offset + kLine * queues;
  l.epoch_offset = l.head_offset + kLine * queues;
  l.header_offset = l.epoch_offset + kLine;
  l.relay_offset = l.header_offset + 2 * kLine * static_cast<int64_t>(num_ranks);
  const int64_t relay = relay_nodes > 0 ? align_up(8 * static_cast<int64_t>(num_ranks), kLine) +
                                              2 * static_cast<int64_t>(num_ranks) * l.relay_bytes
                                        : 0;
  l.queue_offset = l.relay_offset + relay;
  l.total_bytes = l.queue_offset + queues * num_slots * static_cast<int64_t>(l.slot_bytes);
  return l;
}

// ---- errors -----------------------------------------------------------------------------------

enum Phase : int32_t { kNotify = 1, kDispatch = 2, kCombine = 3 };
enum Role : int32_t { kBarrier = 1, kSender = 2, kReceiver = 3, kCoordinator = 4 };
// What a wait polled: a barrier signal, a queue's tail (data to arrive), a queue's head (room),
// a peer's header line (header.cuh); internode also a local peer's relayed header (sent after
// that peer's own rail headers arrived) and the tail of a queue a forwarder fills from other
// nodes (empty while the forwarder waits for its sources): a rank stuck behind a missing rail
// peer is then the better-named cause.
enum Counter : int32_t { kSignal = 1, kTail = 2, kHead = 3, kHeader = 4, kRelayHeader = 5, kForwardTail = 6 };

// Where a wait happened: enough to name it in an error message.
struct WaitSite {
  int32_t phase;
  int32_t role;
  int32_t rank;     // the waiting rank
  int32_t channel;  // -1 for barriers
  int32_t peer;     // the rank whose store was awaited
  int32_t counter;
};

// The timeout of a launch that best names its cause (int32 fields: Python reads int32[16]).
// flag: set by the first wait to time out; every other wait then gives up. The record proper
// (phase .. level, written under `lock`) is replaced by a later offer only with a lower level
// (timeout_level), so the rank that never took part is named, not a rank stalled behind it.
struct ErrorRecord {
  int32_t flag;
  int32_t phase;  // 0 until a record is written
  int32_t role;
  int32_t rank;
  int32_t channel;
  int32_t peer;
  int32_t counter;
  int32_t expected;
  int32_t observed;
  int32_t level;
  int32_t lock;
  int32_t reserved[5];
};
static_assert(sizeof(ErrorRecord) == 64, "ErrorRecord is read as int32[16] by Python");
constexpr int kErrorRecordInts = 16;

// How well a timed-out wait names the cause, lower is better: 0 = the peer never stored to
// this tail, barrier signal or header in this operation (it never started, died, or is stuck
// in an earlier one); 1 = a queue's head never moved (its receiver freed nothing, often
// because it waits on a level-0 peer itself), a relayed header never came, or a forwarded
// queue stayed empty (kForwardTail); 2 = the peer made progress, then stopped. `observed`
// counts this operation's stores (header waits pass 0).
MOE_HD int32_t timeout_level(int32_t counter, int32_t observed) {
  if (counter == kHeader) return 0;
  if (counter == kRelayHeader) return 1;
  if (observed > 0) return 2;
  return (counter == kHead || counter == kForwardTail) ? 1 : 0;
}

// ---- numerics -----------------------------------------------------------------------------------

MOE_HD uint32_t float_bits(float f) {
  union {
    float f;
    uint32_t u;
  } v{f};
  return v.u;
}

MOE_HD float bits_float(uint32_t u) {
  union {
    uint32_t u;
    float f;
  } v{u};
  return v.f;
}

MOE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, NaN stays (quiet) NaN: torch's float -> bfloat16.
MOE_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

MOE_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp != 0) return bits_float(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return bits_float(sign);
  int e = 113;  // subnormal: normalise the mantissa
  uint32_t m = man;
  while ((m & 0x400u) == 0) {
    m <<= 1;
    --e;
  }
  return bits_float(sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3ffu) << 13));
}

// Round to nearest even, overflow to inf, NaN stays NaN: torch's float -> float16.
MOE_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (a >= 0x38800000u) {                                              // normal half
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  // Subnormal half (or zero): the value in units of 2^-24, rounded to nearest even.
  const int shift = 126 - static_cast<int>(a >> 23);  // 14 .. 126
  if (shift > 24) return static_cast<uint16_t>(sign);
  const uint32_t man = (a & 0x7fffffu) | 0x800000u;
  const uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
  return static_cast<uint16_t>(sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u)));
}

// The combine's reduction step: acc + value * scale, each rounded to fp32 (no FMA), as
// torch computes `partial += y.float() * w` in the oracle (moe_dispatch/semantics/summation.py,
// sum_level). scale = 1 is exact.
MOE_HD float combine_step(float acc, float value, float scale) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(acc, __fmul_rn(value, scale));
#else
  volatile float product = value * scale;  // volatile: keep the host compiler from contracting
  return acc + product;
#endif
}

// Element types of the combine (y and out); the dispatch moves raw bytes.
struct Bf16Tag {};
struct F16Tag {};
struct F32Tag {};
enum DType : int32_t { kBf16 = 0, kF16 = 1, kF32 = 2 };

// Host: fn(tag) with the element tag of `dtype` (Bf16Tag{}, F16Tag{} or F32Tag{}).
template <class Fn>
void with_dtype(DType dtype, Fn fn) {
  switch (dtype) {
    case kBf16:
      fn(Bf16Tag{});
      break;
    case kF16:
      fn(F16Tag{});
      break;
    case kF32:
      fn(F32Tag{});
      break;
    default:
      throw std::invalid_argument("combine dtype must be 0 (bf16), 1 (fp16) or 2 (fp32), got " +
                                  std::to_string(static_cast<int>(dtype)));
  }
}

// Global expert id -> the destination's local id, -1 when another rank owns it (or none).
MOE_HD int32_t local_expert(int64_t expert, int rank, int experts_per_rank) {
  const int64_t local = expert - static_cast<int64_t>(rank) * experts_per_rank;
  return (expert >= 0 && local >= 0 && local < experts_per_rank) ? static_cast<int32_t>(local) : -1;
}

// ---- kernel arguments (passed by value; one launch serves ranks [rank_begin, +num_launch_ranks)) ----

struct Common {
  int32_t num_ranks;         // W
  int32_t num_channels;      // C of this call (<= layout.num_channels)
  int32_t rank_begin;        // first rank of this launch (real mode: my rank; loopback: 0)
  int32_t num_launch_ranks;  // 1 in real mode, W in loopback
  int32_t skip_rank;         // loopback tests: this rank's blocks do nothing (-1: none)
  int32_t chunk_tokens;      // K: tokens per published tail
  int32_t l2_discard;        // 1: receivers discard consumed slots (Ctx::discard; Config.l2_discard)
  Variant variant;           // the kernel variant (variant.cuh; Config's variant fields)
  int64_t timeout_cycles;    // bound of every wait (clock64 cycles)
  BufferLayout layout;
  char* buffers[kMaxRanks];  // every rank's buffer as this process addresses it
  ErrorRecord* error;        // device memory, shared by the launch
  ErrorRecord* error_host;   // host-mapped mirror (may be null), readable without a sync
};

// A launched rank's side of the header check (header.cuh).
struct Check {
  Header header;                  // what this rank does; compared with every peer's
  MismatchRecord* mismatch;       // device memory: written when a peer's header differs
  MismatchRecord* mismatch_host;  // host-mapped mirror (may be null), readable without a sync
};

struct NotifyRank {
  const bool* is_token_in_rank;  // [T, W]
  int32_t* recv_prefix;          // [W * C + 1] out: rows before (source, channel), total last
  int32_t* num_recv_tokens;      // [1] out: R
  int32_t* overflow;             // [1] out: 1 when R > budget (budget mode)
  int64_t* recv_topk_idx;        // [budget, K] or null: rows [R, budget) get -1 (budget mode)
  float* recv_topk_weights;      // [budget, K] or null: rows [R, budget) get 0
  int32_t* recv_src_idx;         // [budget] or null: rows [R, budget) get -1
  int32_t* peer_ok;              // [W] out: 1 where this rank's and peer p's headers agree
  Check check;                   // this rank's header and mismatch record
  int32_t num_tokens;            // T of this rank
  int32_t budget;                // rows allocated for the receive, -1 = exactly R (host sync)
};

struct NotifyArgs {
  Common common;
  int32_t num_topk;
  NotifyRank ranks[kMaxRanks];
};

struct DispatchRank {
  const char* x;                 // [T, x_bytes] raw rows
  const float* x_scales;         // [T, H/128] fp32 or null
  const int64_t* topk_idx;       // [T, K] global ids, -1 = none
  const float* topk_weights;     // [T, K] or null
  const bool* is_token_in_rank;  // [T, W]
  const int32_t* token_ids;      // [T] or null: what receivers record as a row's source token (null: t)
  const int32_t* recv_prefix;    // [W * C + 1] from notify
  char* recv_x;                  // [rows, x_bytes]
  float* recv_scales;            // [rows, H/128] or null
  int64_t* recv_topk_idx;        // [rows, K] local ids, -1 elsewhere (null when K = 0)
  float* recv_topk_weights;      // [rows, K] or null
  int32_t* recv_src_idx;         // [rows] source token index
  int64_t* num_recv_per_expert;  // [E / W] zeroed by the caller; counts of stored rows
  int32_t* overflow;             // [1] set when a row falls beyond `rows`
  const int32_t* peer_ok;        // [W] notify's verdicts, or null: exchange headers now (cached dispatch)
  Check check;
  int32_t num_tokens;  // T
  int32_t num_rows;    // rows allocated (R, or the budget)
};

struct DispatchArgs {
  Common common;
  SlotLayout slot;
  int32_t experts_per_rank;
  DispatchRank ranks[kMaxRanks];
};

struct CombineRank {
  const char* y;                 // [rows, x_bytes] rows in dispatch's receive order
  const float* row_scale;        // [rows] fp32 or null (scale 1)
  const bool* is_token_in_rank;  // [T, W] of this rank's own tokens (as dispatched)
  const int32_t* recv_prefix;    // [W * C + 1] of this rank's dispatch receive
  char* out;                     // [T, x_bytes]
  Check check;                   // combine always exchanges headers
  int32_t num_tokens;            // T
  int32_t num_rows;              // rows of y (rows at or beyond it are sent as zeros)
};

struct CombineArgs {
  Common common;
  SlotLayout slot;
  CombineRank ranks[kMaxRanks];
};

}  // namespace intranode
}  // namespace moe_dispatch

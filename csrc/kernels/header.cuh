// The operation header every kernel operation exchanges with its peers, and the mismatch
// record a rank writes when a peer's header differs from its own. Shared by the intranode
// and internode kernels and the CPU backend; plain C++17 outside `#ifdef __CUDA_ARCH__`.
//
// Why: the ranks of a collective must agree on what they do (the same operation, the same
// dispatch's handle, the same row size, dtype, top-k, experts and channels). A host-side
// cross-rank check costs a collective per call and a host sync; this check rides on the
// kernels' own signals instead. Each rank puts its Header to every peer it moves rows with;
// each rank compares each peer's Header with its own. On a difference, or a non-zero status,
// the pair moves no rows in either direction (both sides reach the same verdict, since they
// compare the same two headers), so nobody waits for rows that will not come; the rank
// records the peer, the first differing field and both values, and the host raises at its
// next synchronisation. A rank whose own arguments were bad launches with status != 0 and no
// tokens: its peers finish at once and learn of it.
//
// Header: 9 int64 words (HeaderField order):
//   0 op          kOpDispatch (notify + dispatch), kOpCachedDispatch, kOpCombine
//   1 identity    the dispatch id the handle carries (given by the caller)
//   2 row bytes   bytes of one x / y row
//   3 dtype       element type code (moe_dispatch.transport.cuda.DTYPE_CODES)
//   4 top-k       K moved (0: none travels)
//   5 experts     E
//   6 shape       num_channels | flags << 16 (flag 1: top-k weights travel)
//   7 status      0, or why this rank's own arguments were refused (STATUS_NAMES in Python)
//   8 budget      a fresh dispatch's num_worst_tokens (its static receive size; 0: none), in
//                 its notify; 0 in every other operation
//
// A header line, one 128-byte line in the receiving rank's buffer per (parity, sender):
//   int64 [0, 9)    the sender's Header
//   int64 9         marker: op epoch + 1, stored last with release (or as the RDMA put's signal)
//   int64 [10, 15)  internode relay report (forwarder -> local peers): rail_bad mask (bit m: my
//                   pair with node m's rank of my rail disagreed), then the first such pair's
//                   peer rank, field, my value, its value
// Lines alternate by op-epoch parity: a peer writes parity e % 2 again only at epoch e + 2, and
// every operation in between waits for this rank's header (or a notify's signals), which this
// rank sends only after it finished reading epoch e's.
#pragma once

#include <cstdint>

namespace moe_dispatch {

enum HeaderField : int32_t {
  kHdrOp = 0,
  kHdrIdentity = 1,
  kHdrRowBytes = 2,
  kHdrDtype = 3,
  kHdrTopk = 4,
  kHdrExperts = 5,
  kHdrShape = 6,
  kHdrStatus = 7,
  kHdrBudget = 8,
  kHeaderWords = 9,
};

enum OpCode : int64_t { kOpDispatch = 1, kOpCachedDispatch = 2, kOpCombine = 3 };

constexpr int kHeaderLineWords = 16;  // one 128-byte line
constexpr int kMarkerWord = kHeaderWords;
constexpr int kReportWord = kMarkerWord + 1;  // mask, peer, field, mine, theirs
constexpr int kReportWords = 5;
static_assert(kReportWord + kReportWords <= kHeaderLineWords, "a header line is one 128-byte line");

struct Header {
  int64_t w[kHeaderWords];
};

// kHdrStatus when either side's status is non-zero (a refusal is named as such, whatever else
// differs), else the first field in which `theirs` differs from `mine`, or -1 when the pair may
// move rows. Symmetric in its verdict.
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
    int header_diff(const int64_t* mine, const int64_t* theirs) {
  if (mine[kHdrStatus] != 0 || theirs[kHdrStatus] != 0) return kHdrStatus;
  for (int f = 0; f < kHeaderWords; ++f)
    if (mine[f] != theirs[f]) return f;
  return -1;
}

// kHdrStatus values the kernels act on; the others only name a refusal (STATUS_NAMES in
// Python). kStatusGrow: this rank's call needs larger buffers than the calls before it, so it
// joins with no rows before a (collective) resize. Its peers record it as any refusal; it
// records, unlike other refusing ranks, each peer that is not growing too: a growing rank with
// a clear record knows that every rank grows, and otherwise every rank raises at once.
constexpr int64_t kStatusGrow = 3;

// Whether a rank whose own status is `status` records a verdict on `field` (values mine and
// theirs; relayed: the pair the relaying rank judged): a rank in the operation always, a
// refusing one only when it grows and the pair is not growing on both sides.
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
    bool records_verdict(int64_t status, int field, int64_t mine, int64_t theirs) {
  if (status == 0) return true;
  return status == kStatusGrow && field == kHdrStatus && (mine != kStatusGrow || theirs != kStatusGrow);
}

// Whether a pair's headers both carry kStatusGrow (no rows move; neither side learns anything).
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
    bool both_grow(const int64_t* mine, const int64_t* theirs) {
  return mine[kHdrStatus] == kStatusGrow && theirs[kHdrStatus] == kStatusGrow;
}

// One rank's record of the peers whose header differed (int64[8]; Python reads it). Offers
// are serialised by `lock`; the lowest (peer, relayed) key is kept, so the record names a
// peer deterministically whatever the order the checks ran in.
struct MismatchRecord {
  int64_t flag;    // 1 once a mismatch is recorded
  int64_t rank;    // the rank that recorded it
  int64_t peer;    // the rank whose header differs
  int64_t field;   // HeaderField
  int64_t mine;    // the recording rank's value (relayed: the relaying rank's)
  int64_t theirs;  // the peer's value
  int64_t via;     // -1: compared directly; else the local peer whose rail check reported it
  int64_t lock;
};
static_assert(sizeof(MismatchRecord) == 64, "MismatchRecord is read as int64[8] by Python");
constexpr int kMismatchRecordWords = 8;

}  // namespace moe_dispatch

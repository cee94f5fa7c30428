// Kernel variants (Config's variant fields, moe_dispatch/config.py): alternatives to the current
// kernels, built side by side so that one GPU run can time them all (benchmarks/bench_intranode.py,
// bench_internode.py). The default Variant is the current code; every other choice keeps the
// protocol's results bit for bit (the oracle tests run every variant on the CPU backend).
//
// Two kinds of field:
//   - fields the role code (ring.cuh, *_roles.cuh) reads, so that the CPU backend runs them too:
//     rows_in_flight (the loops hand a warp that many rows at once), slot_flags, combine_warps,
//     coordinator_backoff;
//   - fields of the GPU copy loops and launch bounds only (on the CPU a copy is a memcpy):
//     loads_in_flight, bulk_copy, register_cap. With rows_in_flight they pick a compiled kernel:
//     only the combinations of kCopyVariants are built (with_copy_variant).
//
// Why each should help, from the 2026-11-30 H200 profile (benchmarks/results/2026-11-30-h200-gpu-check):
//   loads_in_flight / rows_in_flight: the intranode dispatch kernel stalls 84% of its cycles on
//     the scoreboard (waiting for loads) with about 2 KB in flight per warp (4 x 16-byte loads per
//     lane over one row); at 2-4 SMs per rank (the per-SM goal) bytes in flight per SM, not HBM,
//     bound the rate (Little's law: 25 GB/s at ~1 us of latency needs ~25 KB in flight per SM).
//     8 or 16 loads per lane, over one or two rows, keep 4-8 KB in flight per warp.
//   register_cap = false: __launch_bounds__(512, 2) caps the kernels at 64 registers; ptxas
//     reports spill stores in every dispatch and combine kernel (268 B in the intranode dispatch
//     kernel today), and ncu found occupancy register-limited to 50% (24% achieved). Without the
//     cap the deeper copies keep their loads in registers; one block per SM is then resident.
//   bulk_copy: TMA (cp.async.bulk global -> shared -> global, sm_90+) moves a row in 2 KB pieces,
//     three in flight per warp (6 KB), with one issuing lane and no registers holding data: the
//     same scoreboard stall without the register cost. Rows that are not 16-byte multiples on
//     16-byte addresses (fp8 scales of H % 512 != 0) and short fields keep the vector copy.
//   slot_flags (intranode only): each dispatch chunk of 8 tokens costs two group barriers and a
//     round trip through warp 0 (it alone waits for room, the others block at bar.sync); the
//     staged node stage, whose loop is the same, spent 67% of its stall cycles at such barriers.
//     With a ready flag in every slot each warp waits for its own room and publishes its own
//     slots, and each receiver warp polls its own slots: no barrier per chunk.
//   combine_warps: a combine worker reduces one token at a time with ~1 KB in flight; with
//     shallow rings (fewer slots than the 15 workers) most workers wait for rows that have not
//     landed, and combine fell to 0.17 of a copy at rings 2x1 against 0.46 at 64x16. Splitting a
//     token's row across 2 or 4 warps (each sums all holders of its columns, in the fixed
//     order: the bits do not change) puts every landed row's bytes in flight at once.
//   coordinator_backoff: the combine coordinator polls every worker's progress in shared memory
//     without pause, stealing issue slots from the 15 workers of its block (62% scoreboard
//     stalls); with __nanosleep backoff (64 ns doubling to 1 us) it issues a handful of
//     instructions per microsecond while nothing moves.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace moe_dispatch {

// Most rows a warp copies together (Config.rows_in_flight).
constexpr int kMaxRowsInFlight = 2;
// Warps that may reduce one token together (Config.combine_warps).
constexpr int kCombineWarps[] = {1, 2, 4};

struct Variant {
  int32_t loads_in_flight;      // 16-byte loads per lane in flight (4: the current copy)
  int32_t rows_in_flight;       // rows a warp copies together (1: the current loops)
  int32_t bulk_copy;            // 1: TMA bulk copies for whole rows (GPU only)
  int32_t register_cap;         // 1: __launch_bounds__(512, 2), the current kernels; 0: (512, 1)
  int32_t slot_flags;           // 1: per-slot ready flags instead of per-chunk tails (intranode)
  int32_t combine_warps;        // warps reducing one token together (1: the current reducer)
  int32_t coordinator_backoff;  // 1: the combine coordinator sleeps while nothing moves
};

constexpr Variant kDefaultVariant{4, 1, 0, 1, 0, 1, 0};

// The GPU copy loops of a kernel (DeviceCtxT): kLoads 16-byte loads per lane in flight over up to
// kRows rows at once, or TMA bulk copies; the combine's reduction keeps kLoads / 2 vectors per
// lane per holder step in flight (2: the current reducer).
template <int Loads, int Rows, bool Bulk>
struct CopyPolicy {
  static constexpr int kLoads = Loads;
  static constexpr int kRows = Rows;
  static constexpr bool kBulk = Bulk;
  static constexpr int kPerRow = Loads / Rows;
  static constexpr int kReduceVecs = Loads / 2;
  // The current copy (4 loads, one row) keeps its remainder loop; deeper ones predicate the tail
  // into the unrolled loop, so a short row still has all its loads in flight.
  static constexpr bool kPredicatedTail = Loads != 4 || Rows != 1;
  static constexpr bool kFlags = false;  // the intranode kernels' ready flags (WithFlags)
  static_assert(Rows >= 1 && Rows <= kMaxRowsInFlight && Loads % Rows == 0 && Loads >= 4, "bad copy policy");
};

// A copy policy whose intranode kernels run the ready-flag loops (Config.slot_flags): compiled
// apart, so that the current kernels carry no code (and no registers) of the flagged loops.
template <class Copy>
struct WithFlags : Copy {
  static constexpr bool kFlags = true;
};

using DefaultCopy = CopyPolicy<4, 1, false>;

// The compiled (loads_in_flight, rows_in_flight, bulk_copy, register_cap) combinations; `fused`:
// also compiled for the fused internode kernels' loopback mode (their NVSHMEM mode runs the
// current copies only: each variant there is another copy of the largest kernels, and one GPU
// can time the loopback mode alone). Mirrored by moe_dispatch.config.COPY_VARIANTS (a test
// compares them).
struct CopyVariant {
  int32_t loads, rows, bulk, cap, fused;
};
constexpr CopyVariant kCopyVariants[] = {
    {4, 1, 0, 1, 1},   // the current kernels
    {8, 1, 0, 1, 0},   // deeper loads under the register cap
    {4, 1, 0, 0, 1},   // the launch bounds alone
    {8, 2, 0, 0, 1},   // 4 loads on each of two rows, no cap
    {16, 2, 0, 0, 0},  // 8 loads on each of two rows, no cap
    {4, 1, 1, 1, 1},   // TMA bulk copies
};
constexpr size_t kNumCopyVariants = sizeof(kCopyVariants) / sizeof(kCopyVariants[0]);

inline std::string copy_variants_text(bool fused) {
  std::ostringstream s;
  const char* sep = "";
  for (const CopyVariant& v : kCopyVariants) {
    if (fused && !v.fused) continue;
    s << sep << "(loads_in_flight=" << v.loads << ", rows_in_flight=" << v.rows << ", bulk_copy=" << v.bulk
      << ", register_cap=" << v.cap << ")";
    sep = ", ";
  }
  return s.str();
}

// Checks the runtime fields (std::invalid_argument naming the field).
inline void check_variant(const Variant& v) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("variant: " + what); };
  if (v.rows_in_flight < 1 || v.rows_in_flight > kMaxRowsInFlight)
    fail("rows_in_flight must be in [1, " + std::to_string(kMaxRowsInFlight) + "], got " +
         std::to_string(v.rows_in_flight));
  bool team = false;
  for (int w : kCombineWarps) team = team || v.combine_warps == w;
  if (!team) fail("combine_warps must be 1, 2 or 4, got " + std::to_string(v.combine_warps));
  if ((v.slot_flags | v.coordinator_backoff | v.bulk_copy | v.register_cap) & ~1)
    fail("slot_flags, coordinator_backoff, bulk_copy and register_cap must be 0 or 1");
}

inline bool is_copy_variant(const Variant& v, const CopyVariant& c) {
  return v.loads_in_flight == c.loads && v.rows_in_flight == c.rows && v.bulk_copy == c.bulk && v.register_cap == c.cap;
}

inline bool is_default_copy(const Variant& v) { return is_copy_variant(v, kCopyVariants[0]); }

// The kernel of kCopyVariants[I]: its copy policy and its launch bounds' blocks per SM.
template <size_t I>
using PolicyOf = CopyPolicy<kCopyVariants[I].loads, kCopyVariants[I].rows, kCopyVariants[I].bulk != 0>;
template <size_t I>
using MinBlocksOf = std::integral_constant<int, kCopyVariants[I].cap ? 2 : 1>;

template <bool kFused, size_t I, class Fn>
bool try_copy_variant(const Variant& v, Fn& fn) {
  if constexpr (kFused && !kCopyVariants[I].fused) {
    return false;
  } else {
    if (!is_copy_variant(v, kCopyVariants[I])) return false;
    fn(PolicyOf<I>{}, MinBlocksOf<I>{});
    return true;
  }
}

template <bool kFused, class Fn, size_t... I>
bool dispatch_copy_variant(const Variant& v, Fn& fn, std::index_sequence<I...>) {
  return (try_copy_variant<kFused, I>(v, fn) || ...);
}

// fn(CopyPolicy<...>{}, std::integral_constant<int, min_blocks>{}) for the compiled kernel of
// `v` (kFused: among those compiled for the fused internode kernels); std::invalid_argument
// naming the compiled set otherwise.
template <bool kFused = false, class Fn>
void with_copy_variant(const Variant& v, Fn fn) {
  check_variant(v);
  if (dispatch_copy_variant<kFused>(v, fn, std::make_index_sequence<kNumCopyVariants>{})) return;
  std::ostringstream s;
  s << "no " << (kFused ? "fused internode " : "") << "kernel is compiled for loads_in_flight=" << v.loads_in_flight
    << ", rows_in_flight=" << v.rows_in_flight << ", bulk_copy=" << v.bulk_copy << ", register_cap=" << v.register_cap
    << "; compiled: " << copy_variants_text(kFused);
  throw std::invalid_argument(s.str());
}

}  // namespace moe_dispatch

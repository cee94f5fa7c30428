// ThreadSanitizer driver of the internode protocol's CPU backend (kernels/internode_cpu.cpp);
// python_tests/test_internode_cuda.py builds it with -fsanitize=thread and runs it:
//   internode_tsan N L CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS [rows=R team=T backoff=B]]
// (the trailing arguments pick a kernel variant, variant.cuh; the internode kernels have no
// ready flags).
// N nodes x L ranks; every simulated rank runs on its own thread ROUNDS (default 3) times, each
// operation a launch of that rank alone (rank_begin = r: the launch shape of the NVSHMEM mode),
// over RDMA and NVLink buffers the rounds reuse:
//   - the fused pipeline: notify, dispatch (the notify's verdicts), a cached dispatch of x
//     alone (header lines exchanged in the kernel, holders from forward_mask), combine;
//   - the staged pipeline's stage 1: node notify, node dispatch, node combine.
// Ranks are not joined between operations, so a fast rank starts the next one while its peers
// finish the last: the case the epoch parities, the chunk tags and the self-resetting counters
// must get right. Routing is random with a fixed seed; rows are small integers (exact in
// bf16). Dispatch is checked against a direct computation (rows ordered by source rank, then
// token; local top-k ids and weights; per-expert counts); combine of the received rows must
// give x times the number of holding ranks (fused) or nodes (stage 1). A last round gives
// rank 0's fused combine another dispatch id: every rank must record a mismatch (directly, or
// relayed by a local peer) and nothing may time out. Prints "ok", or the first failure and
// exits 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/internode_cpu.h"
#include "tests/tsan_world.h"

namespace {

using namespace moe_dispatch;
using namespace moe_dispatch::internode;
using intranode::bf16_to_float;
using intranode::float_to_bf16;
using intranode::local_expert;

struct World : tsan::Routing {
  int N, C, S, x_bytes;
  CpuOptions options;
  Common common;
};

Header header(int64_t op, int64_t identity, const World& w, int num_topk) {
  return Header{{op, identity, w.x_bytes, 0, num_topk, w.E, w.C, 0}};
}

int fail(const char* what, int r, int round) { return std::printf("rank %d round %d: %s\n", r, round, what), 1; }

// The fused pipeline's round on rank r: 0 or prints the failure and returns 1.
int fused_round(const World& w, int r, int round, bool mismatch, MismatchRecord& record) {
  Common common = w.common;
  common.rank_begin = r;
  common.num_launch_ranks = 1;
  const int W = w.W, C = w.C, N = w.N, epr = w.E / W;
  FusedNotifyArgs na{};
  na.common = common;
  na.num_topk = w.K;
  std::vector<int32_t> prefix(W * C + 1, -1), forward(C * N + 1, -1), counts(2, -1), peer_ok(N + w.L, -1);
  std::vector<int32_t> relayed(w.L * (N * C + 1), -1), cut(w.L * C * N, -1);
  int32_t overflow = -1;
  FusedNotifyRank& n = na.ranks[0];
  n.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
  n.is_token_in_node = reinterpret_cast<const bool*>(w.in_node[r].data());
  n.recv_prefix = prefix.data();
  n.forward_prefix = forward.data();
  n.counts = counts.data();
  n.overflow = &overflow;
  n.peer_ok = peer_ok.data();
  n.relay_prefix = relayed.data();
  n.check = {header(kOpDispatch, round, w, w.K), &record, nullptr};
  n.num_tokens = w.T[r];
  n.budget = -1;
  n.forward_capacity = -1;
  run_fused_notify_cpu(na);
  if (w.common.error->flag) return fail("fused notify timed out", r, round);
  if (overflow != 0 || std::count(peer_ok.begin(), peer_ok.end(), 1) != N + w.L)
    return fail("fused notify flagged an overflow or refused a peer", r, round);
  const int R = counts[0], R1 = counts[1];

  FusedDispatchArgs da{};
  da.common = common;
  da.slot = intranode::make_slot_layout(w.x_bytes, 0, w.K);
  da.experts_per_rank = epr;
  da.experts_per_node = epr * w.L;
  tsan::Received got(R, w.H, w.K, epr);
  std::vector<uint16_t> cached_x(got.x.size());
  std::vector<int32_t> mask(R1, -1);
  FusedDispatchRank& d = da.ranks[0];
  tsan::connect(d, w, r, got, &overflow);
  d.is_token_in_node = n.is_token_in_node;
  d.recv_prefix = prefix.data();
  d.forward_prefix = forward.data();
  d.relay_prefix = relayed.data();
  d.forward_mask = mask.data();
  d.forward_cut = cut.data();
  d.peer_ok = peer_ok.data();
  d.check = n.check;
  d.num_rows = R;
  d.forward_capacity = R1;
  d.budget = -1;
  run_fused_dispatch_cpu(da, w.options);
  if (w.common.error->flag) return fail("fused dispatch timed out", r, round);
  std::vector<int64_t> want_per_expert(epr, 0);
  int row = 0;  // expected receive order: by source rank, then source token
  for (int s = 0; s < W; ++s)
    for (int t = 0; t < w.T[s]; ++t) {
      if (!w.in_rank[s][t * W + r]) continue;
      bool good =
          row < R && got.src[row] == t &&
          !std::memcmp(&got.x[static_cast<size_t>(row) * w.H], &w.x[s][static_cast<size_t>(t) * w.H], w.x_bytes);
      for (int k = 0; good && k < w.K; ++k) {
        const int32_t want = local_expert(w.idx[s][t * w.K + k], r, epr);
        good = got.idx[static_cast<size_t>(row) * w.K + k] == want &&
               got.weights[static_cast<size_t>(row) * w.K + k] == (want >= 0 ? w.weights[s][t * w.K + k] : 0.0f);
        if (want >= 0) ++want_per_expert[want];
      }
      if (!good)
        return std::printf("rank %d round %d: fused dispatch row %d (source %d token %d) is wrong\n", r, round, row, s,
                           t),
               1;
      ++row;
    }
  if (row != R || overflow != 0 || got.per_expert != want_per_expert)
    return fail("fused dispatch: wrong row count, overflow or per-expert counts", r, round);

  FusedDispatchArgs cd = da;  // the cached dispatch of x alone
  cd.slot = intranode::make_slot_layout(w.x_bytes, 0, 0);
  FusedDispatchRank& c = cd.ranks[0];
  c.topk_idx = nullptr;
  c.topk_weights = nullptr;
  c.recv_x = reinterpret_cast<char*>(cached_x.data());
  c.recv_topk_idx = nullptr;
  c.recv_topk_weights = nullptr;
  c.peer_ok = nullptr;
  c.check = {header(kOpCachedDispatch, round, w, 0), &record, nullptr};
  run_fused_dispatch_cpu(cd, w.options);
  if (w.common.error->flag) return fail("fused cached dispatch timed out", r, round);
  if (cached_x != got.x) return fail("the fused cached dispatch differs", r, round);

  FusedCombineArgs ca{};
  ca.common = common;
  ca.slot = intranode::make_slot_layout(w.x_bytes, 0, 0);
  std::vector<uint16_t> out(static_cast<size_t>(w.T[r]) * w.H, 0xffff);
  FusedCombineRank& f = ca.ranks[0];
  f.y = reinterpret_cast<const char*>(got.x.data());
  f.is_token_in_node = n.is_token_in_node;
  f.recv_prefix = prefix.data();
  f.forward_prefix = forward.data();
  f.relay_prefix = relayed.data();
  f.forward_mask = mask.data();
  f.forward_cut = cut.data();
  f.out = reinterpret_cast<char*>(out.data());
  f.check = {header(kOpCombine, mismatch && r == 0 ? 1000 : round, w, 0), &record, nullptr};
  f.num_tokens = w.T[r];
  f.num_rows = R;
  f.forward_capacity = R1;
  f.budget = -1;
  run_fused_combine_cpu(ca, intranode::kBf16, w.options);
  if (w.common.error->flag) return fail("fused combine timed out", r, round);
  if (mismatch) {
    // Rank 0 names rank 1 (or its rail peer when L = 1); the others name rank 0, directly or
    // as reported by the local peer of rank 0's rail.
    if (record.flag != 1 || record.rank != r || record.field != kHdrIdentity)
      return std::printf("rank %d: mismatch record flag %lld field %lld, expected field %d\n", r,
                         static_cast<long long>(record.flag), static_cast<long long>(record.field), kHdrIdentity),
             1;
    if (r != 0 && record.peer != 0) return fail("the mismatch record does not name rank 0", r, round);
    return 0;
  }
  if (record.flag != 0) return fail("a mismatch was recorded", r, round);
  for (int t = 0; t < w.T[r]; ++t) {
    int holders = 0;
    for (int q = 0; q < W; ++q) holders += w.in_rank[r][t * W + q];
    for (int h = 0; h < w.H; ++h) {
      const float want = holders * bf16_to_float(w.x[r][t * w.H + h]);
      if (bf16_to_float(out[t * w.H + h]) != want)
        return std::printf("rank %d round %d: fused combine token %d h %d: %g != %g\n", r, round, t, h,
                           bf16_to_float(out[t * w.H + h]), want),
               1;
    }
  }
  return 0;
}

// The staged pipeline's stage 1 on rank r.
int staged_round(const World& w, int r, int round, MismatchRecord& record) {
  Common common = w.common;
  common.rank_begin = r;
  common.num_launch_ranks = 1;
  const int node = r / w.L, local = r % w.L, epn = w.E / w.N;
  const bool* in_node = reinterpret_cast<const bool*>(w.in_node[r].data());
  NotifyArgs na{};
  na.common = common;
  std::vector<int32_t> prefix(w.N * w.C + 1, -1), peer_ok(w.N, -1);
  int32_t num_recv = -1, overflow = -1;
  intranode::NotifyRank& n = na.ranks[0];
  n.is_token_in_rank = in_node;
  n.recv_prefix = prefix.data();
  n.num_recv_tokens = &num_recv;
  n.overflow = &overflow;
  n.peer_ok = peer_ok.data();
  n.check = {header(kOpDispatch, round, w, w.K), &record, nullptr};
  n.num_tokens = w.T[r];
  n.budget = -1;
  run_node_notify_cpu(na);
  if (w.common.error->flag) return fail("node notify timed out", r, round);
  int expected_rows = 0;
  for (int m = 0; m < w.N; ++m) {
    const int s = m * w.L + local;
    for (int t = 0; t < w.T[s]; ++t) expected_rows += w.in_node[s][t * w.N + node];
  }
  if (num_recv != expected_rows || prefix[w.N * w.C] != num_recv || overflow != 0)
    return fail("node notify's counts are wrong", r, round);

  DispatchArgs da{};
  da.common = common;
  da.slot = intranode::make_slot_layout(w.x_bytes, 0, w.K);
  da.experts_per_node = epn;
  tsan::Received got(num_recv, w.H, w.K, epn);
  DispatchRank& d = da.ranks[0];
  tsan::connect(d, w, r, got, &overflow);
  d.is_token_in_rank = in_node;
  d.recv_prefix = prefix.data();
  d.peer_ok = round % 2 ? nullptr : peer_ok.data();  // odd rounds: header lines exchanged (as a cached dispatch)
  d.check = {header(round % 2 ? kOpCachedDispatch : kOpDispatch, round, w, w.K), &record, nullptr};
  d.num_rows = num_recv;
  run_node_dispatch_cpu(da, w.options);
  if (w.common.error->flag) return fail("node dispatch timed out", r, round);
  int row = 0;  // expected receive order: by source node (my rail), then source token
  for (int m = 0; m < w.N; ++m) {
    const int s = m * w.L + local;
    for (int t = 0; t < w.T[s]; ++t) {
      if (!w.in_node[s][t * w.N + node]) continue;
      bool good =
          row < num_recv && got.src[row] == t &&
          !std::memcmp(&got.x[static_cast<size_t>(row) * w.H], &w.x[s][static_cast<size_t>(t) * w.H], w.x_bytes);
      for (int k = 0; good && k < w.K; ++k) {
        const int32_t want = local_expert(w.idx[s][t * w.K + k], node, epn);
        good = got.idx[static_cast<size_t>(row) * w.K + k] == want &&
               got.weights[static_cast<size_t>(row) * w.K + k] == (want >= 0 ? w.weights[s][t * w.K + k] : 0.0f);
      }
      if (!good) return fail("a node dispatch row is wrong", r, round);
      ++row;
    }
  }
  CombineArgs ca{};
  ca.common = common;
  ca.slot = intranode::make_slot_layout(w.x_bytes, 0, 0);
  std::vector<uint16_t> out(static_cast<size_t>(w.T[r]) * w.H, 0xffff);
  CombineRank& c = ca.ranks[0];
  c.y = reinterpret_cast<const char*>(got.x.data());  // node partials: the received rows themselves
  c.is_token_in_rank = in_node;
  c.recv_prefix = prefix.data();
  c.out = reinterpret_cast<char*>(out.data());
  c.check = {header(kOpCombine, round, w, 0), &record, nullptr};
  c.num_tokens = w.T[r];
  c.num_rows = num_recv;
  run_node_combine_cpu(ca, intranode::kBf16, w.options);
  if (w.common.error->flag) return fail("node combine timed out", r, round);
  if (record.flag != 0) return fail("a mismatch was recorded", r, round);
  for (int t = 0; t < w.T[r]; ++t) {
    int holders = 0;
    for (int m = 0; m < w.N; ++m) holders += w.in_node[r][t * w.N + m];
    for (int h = 0; h < w.H; ++h)
      if (bf16_to_float(out[t * w.H + h]) != holders * bf16_to_float(w.x[r][t * w.H + h]))
        return fail("node combine is wrong", r, round);
  }
  return 0;
}

int run_rank(const World& w, int r, int rounds) {
  MismatchRecord record{};
  for (int round = 0; round < rounds; ++round) {
    if (fused_round(w, r, round, false, record) || staged_round(w, r, round, record)) return 1;
  }
  return fused_round(w, r, rounds, true, record);
}

}  // namespace

int main(int argc, char** argv) {
  Variant variant{};
  if (argc < 8 || !tsan::parse_variant(argc, argv, 9, variant)) {
    std::fprintf(stderr, "usage: %s N L CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS [rows=R team=T backoff=B]]\n",
                 argv[0]);
    return 2;
  }
  const int N = std::atoi(argv[1]), L = std::atoi(argv[2]), C = std::atoi(argv[3]), S = std::atoi(argv[4]);
  const int chunk = std::atoi(argv[5]), rounds = argc >= 9 ? std::atoi(argv[8]) : 3;
  if (N < 1 || L < 1 || N * L < 2 || N * L > kMaxLaunchRanks || C < 1 || C > kMaxChannels || chunk < 1 ||
      S % chunk != 0 || rounds < 1) {
    std::fprintf(stderr, "need 2 <= N * L <= %d, 1 <= CHANNELS <= %d, CHUNK dividing SLOTS, ROUNDS >= 1\n",
                 kMaxLaunchRanks, kMaxChannels);
    return 2;
  }
  World w{};
  static_cast<tsan::Routing&>(w) = tsan::make_routing(N * L, L, 32, 3, 4 * N * L, 20, 3, N * 131 + L * 17 + C * 7 + S);
  w.N = N;
  w.C = C;
  w.S = S;
  w.options.group_warps = std::atoi(argv[6]);
  w.options.num_workers = std::atoi(argv[7]);
  w.x_bytes = 2 * w.H;
  const int slot_bytes = intranode::make_slot_layout(w.x_bytes, 0, w.K).slot_bytes;
  const RdmaLayout layout = make_rdma_layout(w.N, w.L, w.C, w.S, slot_bytes);
  const intranode::BufferLayout nvl_layout = intranode::make_buffer_layout(w.L, w.C, w.S, slot_bytes, w.N);
  std::vector<std::vector<int64_t>> rdma(w.W, std::vector<int64_t>(layout.total_bytes / 8 + 16, 0));
  std::vector<std::vector<int64_t>> nvl(w.W, std::vector<int64_t>(nvl_layout.total_bytes / 8 + 16, 0));
  ErrorRecord error{};
  w.common.num_nodes = w.N;
  w.common.ranks_per_node = w.L;
  w.common.num_channels = w.C;
  w.common.skip_rank = -1;
  w.common.chunk_tokens = chunk;
  w.common.variant = variant;
  w.common.nvl_first_rank = 0;
  w.common.timeout_cycles = std::getenv("TSAN_TIMEOUT_NS") ? std::atoll(std::getenv("TSAN_TIMEOUT_NS")) : 20000000000LL;
  w.common.layout = layout;
  w.common.nvl_layout = nvl_layout;
  w.common.symmetric = nullptr;
  for (int r = 0; r < w.W; ++r) {
    w.common.buffers[r] = reinterpret_cast<char*>(rdma[r].data());
    w.common.nvl_buffers[r] = reinterpret_cast<char*>(nvl[r].data());
  }
  w.common.error = &error;
  w.common.error_host = nullptr;

  return tsan::run_ranks(w.W, error, [&w, rounds](int r) { return run_rank(w, r, rounds); });
}

// ThreadSanitizer driver of the intranode protocol's CPU backend (kernels/intranode_cpu.cpp);
// python_tests/test_intranode_cuda.py builds it with -fsanitize=thread and runs it:
//   intranode_tsan W CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS]
// Every simulated rank runs on its own thread ROUNDS (default 3) times: notify, dispatch (the
// notify's verdicts), a cached dispatch (header lines exchanged in the kernel), combine (the
// same), each a launch of that rank alone (rank_begin = r, one launched rank: the launch shape
// of the real multi-GPU mode), over buffers the rounds reuse. Ranks are not joined between
// operations, so a fast rank starts the next one while others finish the last: the case the
// protocol's barrier-free reuse of rings, counters and header lines must get right. Rows are
// small integers (exact in bf16) checked against a direct computation. A last round gives
// rank 0's combine another dispatch id: every rank must record the mismatch (rank 0 naming
// rank 1, the others rank 0) and nothing may time out. Prints "ok", or the first failure and
// exits 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/intranode_cpu.h"
#include "tests/tsan_world.h"

namespace {

using namespace moe_dispatch;
using namespace moe_dispatch::intranode;

struct World : tsan::Routing {
  int C, S, chunk, x_bytes;
  CpuOptions options;
  Common common;
};

Header header(int64_t op, int64_t identity, const World& w, int row_bytes, int num_topk) {
  return Header{{op, identity, row_bytes, 0, num_topk, w.E, w.C, 0}};
}

int fail(const char* what, int r, int round) { return std::printf("rank %d round %d: %s\n", r, round, what), 1; }

// Rank r's rounds; returns 0 or prints the failure and returns 1.
int run_rank(const World& w, int r, int rounds) {
  Common common = w.common;
  common.rank_begin = r;
  common.num_launch_ranks = 1;
  MismatchRecord record{};
  for (int round = 0; round <= rounds; ++round) {
    const bool mismatch_round = round == rounds;
    common.l2_discard = round % 2;  // odd rounds poison consumed slots (HostCtx::discard)
    NotifyArgs na{};
    na.common = common;
    na.num_topk = w.K;
    std::vector<int32_t> prefix(w.W * w.C + 1), peer_ok(w.W, -1);
    int32_t num_recv = 0, overflow = 0;
    NotifyRank& n = na.ranks[0];
    n.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
    n.recv_prefix = prefix.data();
    n.num_recv_tokens = &num_recv;
    n.overflow = &overflow;
    n.peer_ok = peer_ok.data();
    n.check = {header(kOpDispatch, round, w, w.x_bytes, w.K), &record, nullptr};
    n.num_tokens = w.T[r];
    n.budget = -1;
    run_notify_cpu(na);
    if (w.common.error->flag) return fail("notify timed out", r, round);
    if (std::count(peer_ok.begin(), peer_ok.end(), 1) != w.W) return fail("notify refused a peer", r, round);

    DispatchArgs da{};
    da.common = common;
    da.slot = make_slot_layout(w.x_bytes, 0, w.K);
    da.experts_per_rank = w.E / w.W;
    tsan::Received got(num_recv, w.H, w.K, w.E / w.W);
    std::vector<uint16_t> cached_x(got.x.size());
    DispatchRank& d = da.ranks[0];
    tsan::connect(d, w, r, got, &overflow);
    d.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
    d.recv_prefix = prefix.data();
    d.peer_ok = peer_ok.data();
    d.check = n.check;
    d.num_rows = num_recv;
    run_dispatch_cpu(da, w.options);
    int row = 0;  // expected receive order: by source rank, then source token
    for (int s = 0; s < w.W; ++s)
      for (int t = 0; t < w.T[s]; ++t) {
        if (!w.in_rank[s][t * w.W + r]) continue;
        bool ids_ok = row < num_recv;  // the top-k fields too: they sit after x in the slot
        for (int k = 0; k < w.K && ids_ok; ++k) {
          const int32_t want = local_expert(w.idx[s][t * w.K + k], r, w.E / w.W);
          ids_ok = got.idx[static_cast<size_t>(row) * w.K + k] == want &&
                   got.weights[static_cast<size_t>(row) * w.K + k] == (want >= 0 ? w.weights[s][t * w.K + k] : 0.0f);
        }
        if (!ids_ok || got.src[row] != t ||
            std::memcmp(&got.x[static_cast<size_t>(row) * w.H], &w.x[s][static_cast<size_t>(t) * w.H], w.x_bytes))
          return std::printf("rank %d round %d: dispatch row %d (source %d token %d) is wrong\n", r, round, row, s,
                             t), 1;
        ++row;
      }
    if (row != num_recv) return std::printf("rank %d round %d: %d rows, expected %d\n", r, round, num_recv, row), 1;

    // The cached dispatch of x alone: header lines exchanged in the kernel, the same rows.
    DispatchArgs ca_d = da;
    ca_d.slot = make_slot_layout(w.x_bytes, 0, 0);
    DispatchRank& cd = ca_d.ranks[0];
    cd.topk_idx = nullptr;
    cd.recv_x = reinterpret_cast<char*>(cached_x.data());
    cd.recv_topk_idx = nullptr;
    cd.recv_topk_weights = nullptr;
    cd.peer_ok = nullptr;
    cd.check = {header(kOpCachedDispatch, round, w, w.x_bytes, 0), &record, nullptr};
    run_dispatch_cpu(ca_d, w.options);
    if (cached_x != got.x) return fail("the cached dispatch differs", r, round);

    CombineArgs ca{};
    ca.common = common;
    ca.slot = make_slot_layout(w.x_bytes, 0, 0);
    std::vector<uint16_t> out(static_cast<size_t>(w.T[r]) * w.H, 0xffff);
    CombineRank& c = ca.ranks[0];
    c.y = reinterpret_cast<const char*>(got.x.data());
    c.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
    c.recv_prefix = prefix.data();
    c.out = reinterpret_cast<char*>(out.data());
    c.check = {header(kOpCombine, mismatch_round && r == 0 ? 1000 : round, w, w.x_bytes, 0), &record, nullptr};
    c.num_tokens = w.T[r];
    c.num_rows = num_recv;
    run_combine_cpu(ca, kBf16, w.options);
    if (w.common.error->flag) return fail("a wait timed out", r, round);
    if (mismatch_round) {
      const int64_t peer = r == 0 ? 1 : 0;
      if (record.flag != 1 || record.rank != r || record.peer != peer || record.field != kHdrIdentity ||
          record.via != -1)
        return std::printf("rank %d: mismatch record flag %lld peer %lld field %lld, expected peer %lld field %d\n", r,
                           static_cast<long long>(record.flag), static_cast<long long>(record.peer),
                           static_cast<long long>(record.field), static_cast<long long>(peer), kHdrIdentity), 1;
      break;
    }
    if (record.flag != 0) return fail("a mismatch was recorded", r, round);
    for (int t = 0; t < w.T[r]; ++t) {
      int holders = 0;
      for (int q = 0; q < w.W; ++q) holders += w.in_rank[r][t * w.W + q];
      for (int h = 0; h < w.H; ++h) {
        const float want = holders * bf16_to_float(w.x[r][t * w.H + h]);
        if (bf16_to_float(out[t * w.H + h]) != want)
          return std::printf("rank %d round %d: combine token %d h %d: %g != %g\n", r, round, t, h,
                             bf16_to_float(out[t * w.H + h]), want), 1;
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr, "usage: %s W CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS]\n", argv[0]);
    return 2;
  }
  const int W = std::atoi(argv[1]), C = std::atoi(argv[2]), S = std::atoi(argv[3]), chunk = std::atoi(argv[4]);
  const int rounds = argc == 8 ? std::atoi(argv[7]) : 3;
  if (W < 2 || W > kMaxRanks || C < 1 || C > kMaxChannels || chunk < 1 || chunk > S || rounds < 1) {
    std::fprintf(stderr, "need 2 <= W <= %d, 1 <= CHANNELS <= %d, 1 <= CHUNK <= SLOTS, ROUNDS >= 1\n", kMaxRanks,
                 kMaxChannels);
    return 2;
  }
  World w{};
  // H = 128: slots span whole 128-byte lines, so discards poison something
  static_cast<tsan::Routing&>(w) = tsan::make_routing(W, W, 128, 3, 4 * W, 30, 5, W * 131 + C * 7 + S);
  w.C = C;
  w.S = S;
  w.chunk = chunk;
  w.options.group_warps = std::atoi(argv[5]);
  w.options.num_workers = std::atoi(argv[6]);
  w.x_bytes = 2 * w.H;
  const BufferLayout layout = make_buffer_layout(w.W, w.C, w.S, make_slot_layout(w.x_bytes, 0, w.K).slot_bytes);
  std::vector<std::vector<int64_t>> buffers(w.W, std::vector<int64_t>(layout.total_bytes / 8 + 16, 0));
  ErrorRecord error{};
  w.common.num_ranks = w.W;
  w.common.num_channels = w.C;
  w.common.skip_rank = -1;
  w.common.chunk_tokens = w.chunk;
  w.common.timeout_cycles = 20'000'000'000LL;  // ns
  w.common.layout = layout;
  for (int r = 0; r < w.W; ++r) w.common.buffers[r] = reinterpret_cast<char*>(buffers[r].data());
  w.common.error = &error;

  return tsan::run_ranks(w.W, error, [&w, rounds](int r) { return run_rank(w, r, rounds); });
}

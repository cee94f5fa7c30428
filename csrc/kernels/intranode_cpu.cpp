// CPU backend of the intranode protocol: runs the role functions of intranode_roles.cuh - the
// very code the kernels run - with one std::thread per warp (width 1, lane 0), std atomics
// for the counters and steady_clock bounded waits. Buffers are host memory. Used by the
// loopback harness on machines without a GPU, where tests compare its results with
// moe_dispatch.reference; it also builds standalone (-DMOE_INTRANODE_CPU_MAIN) for
// ThreadSanitizer, which checks that the queue protocol orders every slot access.
// Timeouts: Common::timeout_cycles counts nanoseconds here.
#include "kernels/intranode_cpu.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/intranode_host.h"

namespace moe_dispatch {
namespace intranode {
namespace {

void check_cpu(const CpuOptions& o, int num_ranks) {
  check_cpu_options(o);
  if (num_ranks > kMaxRanks) throw std::invalid_argument("num_ranks must be <= " + std::to_string(kMaxRanks));
}

}  // namespace

void run_notify_cpu(const NotifyArgs& args) {
  run_notify_threads<HostCtx, NotifyState>(
      args, [](HostCtx& ctx, const NotifyArgs& a, int rank, NotifyState* st) { notify(ctx, a, rank, st); });
}

// The group-structured blocks have one group per peer rank.
void run_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options) {
  check_cpu(options, args.common.num_ranks);
  run_groups<HostCtx, kMaxRanks>(
      args.common, options, args.common.num_ranks, 2,
      [&args](HostCtx& ctx, int role, int rank, int channel, int peer, int warp, int group_warps, GroupState* gs) {
        if (role == 0) {
          dispatch_send(ctx, args, rank, channel, peer, warp, group_warps, gs);
        } else {
          dispatch_recv(ctx, args, rank, channel, peer, warp, group_warps, gs);
        }
      });
}

void run_combine_cpu(const CombineArgs& args, DType dtype, const CpuOptions& options) {
  const Common& c = args.common;
  check_cpu(options, c.num_ranks);
  if (dtype != kBf16 && dtype != kF32)
    throw std::invalid_argument("the CPU combine supports bf16 (0) and fp32 (2), got dtype " + std::to_string(dtype));
  const int workers = options.num_workers;
  run_combine_threads<HostCtx, CombineRecvState>(
      c, workers,
      [&args, workers](HostCtx& ctx, int rank, int channel, CombineRecvState* st) {
        combine_recv_coordinator(ctx, args, rank, channel, workers, st);
      },
      [&args, workers, dtype](HostCtx& ctx, int rank, int channel, int w, CombineRecvState* st) {
        if (dtype == kBf16) {
          combine_recv_worker<Bf16Tag>(ctx, args, rank, channel, w, workers, st);
        } else {
          combine_recv_worker<F32Tag>(ctx, args, rank, channel, w, workers, st);
        }
      },
      [&]() {
        run_groups<HostCtx, kMaxRanks>(
            c, options, c.num_ranks, 1,
            [&args](HostCtx& ctx, int, int rank, int channel, int peer, int warp, int group_warps, GroupState* gs) {
              combine_send(ctx, args, rank, channel, peer, warp, group_warps, gs);
            });
      });
}

}  // namespace intranode
}  // namespace moe_dispatch

#ifdef MOE_INTRANODE_CPU_MAIN
// Standalone driver for sanitizer builds (see python_tests/test_intranode_cuda.py):
//   intranode_cpu W CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS]
// Every simulated rank runs on its own thread ROUNDS (default 3) times: notify, dispatch,
// combine, each a launch of that rank alone (rank_begin = r, one launched rank: the launch
// shape of the real multi-GPU mode), over buffers the rounds reuse. Ranks are not joined
// between operations, so a fast rank starts the next one while others finish the last: the
// case the protocol's barrier-free reuse of rings and counters must get right. Rows are small
// integers (exact in bf16) checked against a direct computation; prints "ok", or the first
// mismatch and exits non-zero.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace {

using namespace moe_dispatch::intranode;

struct World {
  int W, C, S, chunk, H, K, E, x_bytes;
  CpuOptions options;
  std::vector<int> T;
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<uint8_t>> in_rank;
  Common common;
};

// Rank r's rounds; returns 0 or prints the failure and returns 1.
int run_rank(const World& w, int r, int rounds) {
  Common common = w.common;
  common.rank_begin = r;
  common.num_launch_ranks = 1;
  for (int round = 0; round < rounds; ++round) {
    common.l2_discard = round % 2;  // odd rounds poison consumed slots (HostCtx::discard)
    NotifyArgs na{};
    na.common = common;
    na.num_topk = w.K;
    std::vector<int32_t> prefix(w.W * w.C + 1);
    int32_t num_recv = 0, overflow = 0;
    NotifyRank& n = na.ranks[0];
    n.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
    n.recv_prefix = prefix.data();
    n.num_recv_tokens = &num_recv;
    n.overflow = &overflow;
    n.num_tokens = w.T[r];
    n.budget = -1;
    run_notify_cpu(na);
    if (w.common.error->flag) return std::printf("rank %d round %d: notify timed out\n", r, round), 1;

    DispatchArgs da{};
    da.common = common;
    da.slot = make_slot_layout(w.x_bytes, 0, w.K);
    da.experts_per_rank = w.E / w.W;
    std::vector<uint16_t> recv_x(static_cast<size_t>(num_recv) * w.H);
    std::vector<int64_t> recv_idx(static_cast<size_t>(num_recv) * w.K), per_expert(w.E / w.W, 0);
    std::vector<float> recv_w(static_cast<size_t>(num_recv) * w.K);
    std::vector<int32_t> recv_src(num_recv);
    DispatchRank& d = da.ranks[0];
    d.x = reinterpret_cast<const char*>(w.x[r].data());
    d.topk_idx = w.idx[r].data();
    d.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
    d.recv_prefix = prefix.data();
    d.recv_x = reinterpret_cast<char*>(recv_x.data());
    d.recv_topk_idx = recv_idx.data();
    d.recv_topk_weights = recv_w.data();
    d.recv_src_idx = recv_src.data();
    d.num_recv_per_expert = per_expert.data();
    d.overflow = &overflow;
    d.num_tokens = w.T[r];
    d.num_rows = num_recv;
    run_dispatch_cpu(da, w.options);
    int row = 0;  // expected receive order: by source rank, then source token
    for (int s = 0; s < w.W; ++s)
      for (int t = 0; t < w.T[s]; ++t) {
        if (!w.in_rank[s][t * w.W + r]) continue;
        bool ids_ok = row < num_recv;  // the top-k fields too: they sit after x in the slot
        for (int k = 0; k < w.K && ids_ok; ++k)
          ids_ok = recv_idx[static_cast<size_t>(row) * w.K + k] == local_expert(w.idx[s][t * w.K + k], r, w.E / w.W) &&
                   recv_w[static_cast<size_t>(row) * w.K + k] == 0.0f;
        if (!ids_ok || recv_src[row] != t ||
            std::memcmp(&recv_x[static_cast<size_t>(row) * w.H], &w.x[s][static_cast<size_t>(t) * w.H], w.x_bytes)) {
          return std::printf("rank %d round %d: dispatch row %d (source %d token %d) is wrong\n", r, round, row, s,
                             t), 1;
        }
        ++row;
      }
    if (row != num_recv) return std::printf("rank %d round %d: %d rows, expected %d\n", r, round, num_recv, row), 1;

    CombineArgs ca{};
    ca.common = common;
    ca.slot = make_slot_layout(w.x_bytes, 0, 0);
    std::vector<uint16_t> out(static_cast<size_t>(w.T[r]) * w.H, 0xffff);
    CombineRank& c = ca.ranks[0];
    c.y = reinterpret_cast<const char*>(recv_x.data());
    c.is_token_in_rank = reinterpret_cast<const bool*>(w.in_rank[r].data());
    c.recv_prefix = prefix.data();
    c.out = reinterpret_cast<char*>(out.data());
    c.num_tokens = w.T[r];
    c.num_rows = num_recv;
    run_combine_cpu(ca, kBf16, w.options);
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
    if (w.common.error->flag) return std::printf("rank %d round %d: a wait timed out\n", r, round), 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr, "usage: %s W CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS]\n", argv[0]);
    return 2;
  }
  World w{};
  w.W = std::atoi(argv[1]);
  w.C = std::atoi(argv[2]);
  w.S = std::atoi(argv[3]);
  w.chunk = std::atoi(argv[4]);
  w.options.group_warps = std::atoi(argv[5]);
  w.options.num_workers = std::atoi(argv[6]);
  const int rounds = argc == 8 ? std::atoi(argv[7]) : 3;
  w.H = 128;  // slots span whole 128-byte lines, so discards poison something
  w.K = 3;
  w.E = 4 * w.W;
  w.x_bytes = 2 * w.H;
  std::mt19937 rng(static_cast<unsigned>(w.W * 131 + w.C * 7 + w.S));
  w.T.resize(w.W);
  w.x.resize(w.W);
  w.idx.resize(w.W);
  w.in_rank.resize(w.W);
  for (int r = 0; r < w.W; ++r) {
    w.T[r] = r == 1 ? 0 : 30 + 5 * r;  // rank 1 sends nothing
    w.x[r].resize(static_cast<size_t>(w.T[r]) * w.H);
    for (int t = 0; t < w.T[r]; ++t)
      for (int h = 0; h < w.H; ++h) w.x[r][t * w.H + h] = float_to_bf16(static_cast<float>((t * 7 + h + 3 * r) % 17 - 8));
    w.idx[r].assign(static_cast<size_t>(w.T[r]) * w.K, -1);
    w.in_rank[r].assign(static_cast<size_t>(w.T[r]) * w.W, 0);
    for (int t = 0; t < w.T[r]; ++t) {
      std::vector<int> experts(w.E);
      for (int e = 0; e < w.E; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < w.K; ++k) {
        if (rng() % 5 == 0) continue;
        w.idx[r][t * w.K + k] = experts[k];
        w.in_rank[r][t * w.W + experts[k] / (w.E / w.W)] = 1;
      }
    }
  }
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

  std::vector<int> status(w.W, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < w.W; ++r) ranks.emplace_back([&w, &status, r, rounds]() { status[r] = run_rank(w, r, rounds); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < w.W; ++r) {
    if (status[r] != 0) {
      std::printf("failed (rank %d first); timeout record: flag %d rank %d peer %d counter %d\n", r, error.flag,
                  error.rank, error.peer, error.counter);
      return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}
#endif  // MOE_INTRANODE_CPU_MAIN

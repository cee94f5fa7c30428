// CPU backend of stage 1 of the internode protocol: the role functions of internode_roles.cuh
// (the code the kernels run) with one std::thread per warp. A put-with-signal is a memcpy into
// the peer's buffer followed by a release store of the signal, which is the ordering NVSHMEM
// guarantees (data before signal); waits acquire. Timeouts count nanoseconds.
#include "kernels/internode_cpu.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/internode_roles.cuh"
#include "kernels/intranode_host.h"

namespace moe_dispatch {
namespace internode {
namespace {

struct HostRdmaCtx : intranode::HostCtxT<Common> {
  char* buffer(int rank) const { return common->buffers[rank]; }
  // The address in `peer`'s buffer at the offset `p` has in `rank`'s (symmetric addressing).
  template <class P>
  P* at_peer(int rank, int peer, P* p) const {
    return reinterpret_cast<P*>(common->buffers[peer] + (reinterpret_cast<char*>(p) - common->buffers[rank]));
  }
  uint64_t load_local(const uint64_t* p) const { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  void store_local(uint64_t* p, uint64_t v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  int64_t wait_signal_lane(const uint64_t* sig, int64_t target, const intranode::WaitSite& site) const {
    return bounded_wait([sig]() { return static_cast<int64_t>(__atomic_load_n(sig, __ATOMIC_ACQUIRE)); }, target, site);
  }
  int64_t wait_signal(const uint64_t* sig, int64_t target, const intranode::WaitSite& site) const {
    return wait_signal_lane(sig, target, site);
  }
  void put_signal_lane(int rank, int peer, char* dst, const char* src, int64_t bytes, uint64_t* sig,
                       uint64_t value) const {
    std::memcpy(at_peer(rank, peer, dst), src, static_cast<size_t>(bytes));
    __atomic_store_n(at_peer(rank, peer, sig), value, __ATOMIC_RELEASE);
  }
  void put_signal(int rank, int peer, char* dst, const char* src, int64_t bytes, uint64_t* sig, uint64_t value) const {
    put_signal_lane(rank, peer, dst, src, bytes, sig, value);
  }
  void signal_set(int rank, int peer, uint64_t* sig, uint64_t value) const {
    __atomic_store_n(at_peer(rank, peer, sig), value, __ATOMIC_RELEASE);
  }
  void reset_signal(uint64_t* sig) const { __atomic_store_n(sig, 0, __ATOMIC_RELEASE); }
};

void check_cpu(const Common& c, const CpuOptions& o) {
  intranode::check_cpu_options(o);
  if (c.symmetric != nullptr) throw std::invalid_argument("the CPU backend runs loopback buffers, not NVSHMEM");
}

}  // namespace

void run_node_notify_cpu(const NotifyArgs& args) {
  intranode::run_notify_threads<HostRdmaCtx, NotifyState>(
      args, [](HostRdmaCtx& ctx, const NotifyArgs& a, int rank, NotifyState* st) { node_notify(ctx, a, rank, st); });
}

// The group-structured blocks have one group per node.
void run_node_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options) {
  check_cpu(args.common, options);
  intranode::run_groups<HostRdmaCtx, kMaxNodes>(
      args.common, options, args.common.num_nodes, 2,
      [&args](HostRdmaCtx& ctx, int role, int rank, int channel, int node, int warp, int group_warps, GroupState* gs) {
        if (role == 0) {
          node_dispatch_send(ctx, args, rank, channel, node, warp, group_warps, gs);
        } else {
          node_dispatch_recv(ctx, args, rank, channel, node, warp, group_warps, gs);
        }
      });
}

void run_node_combine_cpu(const CombineArgs& args, intranode::DType dtype, const CpuOptions& options) {
  const Common& c = args.common;
  check_cpu(c, options);
  if (dtype != intranode::kBf16 && dtype != intranode::kF32)
    throw std::invalid_argument("the CPU combine supports bf16 (0) and fp32 (2), got dtype " + std::to_string(dtype));
  const int workers = options.num_workers;
  intranode::run_combine_threads<HostRdmaCtx, CombineRecvState>(
      c, workers,
      [&args, workers](HostRdmaCtx& ctx, int rank, int channel, CombineRecvState* st) {
        node_combine_recv_coordinator(ctx, args, rank, channel, workers, st);
      },
      [&args, workers, dtype](HostRdmaCtx& ctx, int rank, int channel, int w, CombineRecvState* st) {
        if (dtype == intranode::kBf16) {
          node_combine_recv_worker<intranode::Bf16Tag>(ctx, args, rank, channel, w, workers, st);
        } else {
          node_combine_recv_worker<intranode::F32Tag>(ctx, args, rank, channel, w, workers, st);
        }
      },
      [&]() {
        intranode::run_groups<HostRdmaCtx, kMaxNodes>(
            c, options, c.num_nodes, 1,
            [&args](HostRdmaCtx& ctx, int, int rank, int channel, int node, int warp, int group_warps,
                    GroupState* gs) { node_combine_send(ctx, args, rank, channel, node, warp, group_warps, gs); });
      });
}

}  // namespace internode
}  // namespace moe_dispatch

#ifdef MOE_INTERNODE_CPU_MAIN
// Standalone driver for sanitizer builds (see python_tests/test_internode_cuda.py):
//   internode_cpu N L CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS]
// Stage 1 alone, N nodes x L ranks: every simulated rank runs on its own thread ROUNDS
// (default 3) times: node notify, node dispatch, node combine, each a launch of that rank
// alone (rank_begin = r, one launched rank: the launch shape of the NVSHMEM mode), over RDMA
// buffers the rounds reuse. Ranks are not joined between operations, so a fast rank starts the
// next one while its rail peers finish the last: the case the epoch parity of node notify and
// the self-resetting head/tail signals must get right. Routing is random with a fixed seed;
// rows are small integers (exact in bf16). Dispatch is checked against a direct computation
// (rows ordered by source node, then token; node-local top-k ids; per-expert counts); combine
// gets the forwarder's received rows back as its node partials, so each token must come back
// as x times the number of nodes holding it. Prints "ok", or the first mismatch and exits 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

namespace {

using namespace moe_dispatch::internode;
using moe_dispatch::intranode::bf16_to_float;
using moe_dispatch::intranode::float_to_bf16;

struct World {
  int N, L, W, C, S, H, K, E, x_bytes;
  CpuOptions options;
  std::vector<int> T;
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<uint8_t>> in_node;  // [T, N]
  Common common;
};

// Rank r's rounds; returns 0 or prints the failure and returns 1.
int run_rank(const World& w, int r, int rounds) {
  Common common = w.common;
  common.rank_begin = r;
  common.num_launch_ranks = 1;
  const int node = r / w.L, local = r % w.L, experts_per_node = w.E / w.N;
  const bool* in_node = reinterpret_cast<const bool*>(w.in_node[r].data());
  for (int round = 0; round < rounds; ++round) {
    NotifyArgs na{};
    na.common = common;
    std::vector<int32_t> prefix(w.N * w.C + 1, -1);
    int32_t num_recv = -1, overflow = -1;
    moe_dispatch::intranode::NotifyRank& n = na.ranks[0];
    n.is_token_in_rank = in_node;
    n.recv_prefix = prefix.data();
    n.num_recv_tokens = &num_recv;
    n.overflow = &overflow;
    n.num_tokens = w.T[r];
    n.budget = -1;
    run_node_notify_cpu(na);
    if (w.common.error->flag) return std::printf("rank %d round %d: node notify timed out\n", r, round), 1;
    int expected_rows = 0;
    for (int m = 0; m < w.N; ++m) {
      const int s = m * w.L + local;
      for (int t = 0; t < w.T[s]; ++t) expected_rows += w.in_node[s][t * w.N + node];
    }
    if (num_recv != expected_rows || prefix[w.N * w.C] != num_recv || overflow != 0)
      return std::printf("rank %d round %d: notify says %d rows (prefix %d, overflow %d), expected %d\n", r, round,
                         num_recv, prefix[w.N * w.C], overflow, expected_rows), 1;

    DispatchArgs da{};
    da.common = common;
    da.slot = moe_dispatch::intranode::make_slot_layout(w.x_bytes, 0, w.K);
    da.experts_per_node = experts_per_node;
    std::vector<uint16_t> recv_x(static_cast<size_t>(num_recv) * w.H);
    std::vector<int64_t> recv_idx(static_cast<size_t>(num_recv) * w.K), per_expert(experts_per_node, 0);
    std::vector<float> recv_w(static_cast<size_t>(num_recv) * w.K);
    std::vector<int32_t> recv_src(num_recv);
    DispatchRank& d = da.ranks[0];
    d.x = reinterpret_cast<const char*>(w.x[r].data());
    d.topk_idx = w.idx[r].data();
    d.topk_weights = w.weights[r].data();
    d.is_token_in_rank = in_node;
    d.recv_prefix = prefix.data();
    d.recv_x = reinterpret_cast<char*>(recv_x.data());
    d.recv_topk_idx = recv_idx.data();
    d.recv_topk_weights = recv_w.data();
    d.recv_src_idx = recv_src.data();
    d.num_recv_per_expert = per_expert.data();
    d.overflow = &overflow;
    d.num_tokens = w.T[r];
    d.num_rows = num_recv;
    run_node_dispatch_cpu(da, w.options);
    if (w.common.error->flag) return std::printf("rank %d round %d: node dispatch timed out\n", r, round), 1;
    std::vector<int64_t> want_per_expert(experts_per_node, 0);
    int row = 0;  // expected receive order: by source node (my rail), then source token
    for (int m = 0; m < w.N; ++m) {
      const int s = m * w.L + local;
      for (int t = 0; t < w.T[s]; ++t) {
        if (!w.in_node[s][t * w.N + node]) continue;
        bool good = row < num_recv && recv_src[row] == t &&
                    !std::memcmp(&recv_x[static_cast<size_t>(row) * w.H], &w.x[s][static_cast<size_t>(t) * w.H],
                                 w.x_bytes);
        for (int k = 0; good && k < w.K; ++k) {
          const int64_t e = w.idx[s][t * w.K + k];
          const int64_t want = (e >= node * experts_per_node && e < (node + 1) * experts_per_node)
                                   ? e - node * experts_per_node : -1;
          good = recv_idx[static_cast<size_t>(row) * w.K + k] == want &&
                 recv_w[static_cast<size_t>(row) * w.K + k] == (want >= 0 ? w.weights[s][t * w.K + k] : 0.0f);
          if (want >= 0) ++want_per_expert[want];
        }
        if (!good)
          return std::printf("rank %d round %d: dispatch row %d (source rank %d token %d) is wrong\n", r, round, row,
                             s, t), 1;
        ++row;
      }
    }
    if (overflow != 0 || per_expert != want_per_expert)
      return std::printf("rank %d round %d: overflow %d or per-expert counts are wrong\n", r, round, overflow), 1;

    CombineArgs ca{};
    ca.common = common;
    ca.slot = moe_dispatch::intranode::make_slot_layout(w.x_bytes, 0, 0);
    std::vector<uint16_t> out(static_cast<size_t>(w.T[r]) * w.H, 0xffff);
    CombineRank& c = ca.ranks[0];
    c.y = reinterpret_cast<const char*>(recv_x.data());  // node partials: the received rows themselves
    c.is_token_in_rank = in_node;
    c.recv_prefix = prefix.data();
    c.out = reinterpret_cast<char*>(out.data());
    c.num_tokens = w.T[r];
    c.num_rows = num_recv;
    run_node_combine_cpu(ca, moe_dispatch::intranode::kBf16, w.options);
    if (w.common.error->flag) return std::printf("rank %d round %d: node combine timed out\n", r, round), 1;
    for (int t = 0; t < w.T[r]; ++t) {
      int holders = 0;
      for (int m = 0; m < w.N; ++m) holders += w.in_node[r][t * w.N + m];
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
  if (argc != 8 && argc != 9) {
    std::fprintf(stderr, "usage: %s N L CHANNELS SLOTS CHUNK GROUP_WARPS WORKERS [ROUNDS]\n", argv[0]);
    return 2;
  }
  World w{};
  w.N = std::atoi(argv[1]);
  w.L = std::atoi(argv[2]);
  w.C = std::atoi(argv[3]);
  w.S = std::atoi(argv[4]);
  const int chunk = std::atoi(argv[5]);
  w.options.group_warps = std::atoi(argv[6]);
  w.options.num_workers = std::atoi(argv[7]);
  const int rounds = argc == 9 ? std::atoi(argv[8]) : 3;
  w.W = w.N * w.L;
  if (w.N < 1 || w.L < 1 || w.W > kMaxLaunchRanks || w.C < 1 || w.C > kMaxChannels || chunk < 1 || w.S % chunk != 0 ||
      rounds < 1) {
    std::fprintf(stderr, "need 1 <= N * L <= %d, 1 <= CHANNELS <= %d, CHUNK dividing SLOTS, ROUNDS >= 1\n",
                 kMaxLaunchRanks, kMaxChannels);
    return 2;
  }
  w.H = 32;
  w.K = 3;
  w.E = 4 * w.N;
  w.x_bytes = 2 * w.H;
  const int experts_per_node = w.E / w.N;
  std::mt19937 rng(static_cast<unsigned>(w.N * 131 + w.L * 17 + w.C * 7 + w.S));
  w.T.resize(w.W);
  w.x.resize(w.W);
  w.idx.resize(w.W);
  w.weights.resize(w.W);
  w.in_node.resize(w.W);
  for (int r = 0; r < w.W; ++r) {
    w.T[r] = r == 1 ? 0 : 20 + 3 * r;  // rank 1 sends nothing
    w.x[r].resize(static_cast<size_t>(w.T[r]) * w.H);
    for (int t = 0; t < w.T[r]; ++t)
      for (int h = 0; h < w.H; ++h) w.x[r][t * w.H + h] = float_to_bf16(static_cast<float>((t * 7 + h + 3 * r) % 17 - 8));
    w.idx[r].assign(static_cast<size_t>(w.T[r]) * w.K, -1);
    w.weights[r].assign(static_cast<size_t>(w.T[r]) * w.K, 0.0f);
    w.in_node[r].assign(static_cast<size_t>(w.T[r]) * w.N, 0);
    for (int t = 0; t < w.T[r]; ++t) {
      std::vector<int> experts(w.E);
      for (int e = 0; e < w.E; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < w.K; ++k) {
        if (rng() % 5 == 0) continue;
        w.idx[r][t * w.K + k] = experts[k];
        w.weights[r][t * w.K + k] = 0.25f * static_cast<float>(1 + rng() % 4);
        w.in_node[r][t * w.N + experts[k] / experts_per_node] = 1;
      }
    }
  }
  const int slot_bytes = moe_dispatch::intranode::make_slot_layout(w.x_bytes, 0, w.K).slot_bytes;
  const RdmaLayout layout = make_rdma_layout(w.N, w.C, w.S, slot_bytes);
  std::vector<std::vector<int64_t>> buffers(w.W, std::vector<int64_t>(layout.total_bytes / 8 + 16, 0));
  ErrorRecord error{};
  w.common.num_nodes = w.N;
  w.common.ranks_per_node = w.L;
  w.common.num_channels = w.C;
  w.common.skip_rank = -1;
  w.common.chunk_tokens = chunk;
  w.common.timeout_cycles = 20'000'000'000LL;  // ns
  w.common.layout = layout;
  w.common.symmetric = nullptr;
  for (int r = 0; r < w.W; ++r) w.common.buffers[r] = reinterpret_cast<char*>(buffers[r].data());
  w.common.error = &error;
  w.common.error_host = nullptr;

  std::vector<int> status(w.W, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < w.W; ++r) ranks.emplace_back([&w, &status, r, rounds]() { status[r] = run_rank(w, r, rounds); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < w.W; ++r) {
    if (status[r] != 0) {
      std::printf("failed (rank %d first); timeout record: flag %d phase %d rank %d peer %d counter %d\n", r,
                  error.flag, error.phase, error.rank, error.peer, error.counter);
      return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}
#endif  // MOE_INTERNODE_CPU_MAIN

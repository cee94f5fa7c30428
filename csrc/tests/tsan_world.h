// What the ThreadSanitizer drivers (intranode_tsan.cpp, internode_tsan.cpp) share: a world's
// random routing with rows of small integers (exact in bf16), and running every simulated
// rank on its own thread.
#pragma once

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "kernels/intranode.cuh"

namespace tsan {

// Per rank: T tokens of H bf16 values, K top-k ids (global, -1 = none) with weights, and which
// ranks and nodes (of L ranks) hold each token. Rank 1 sends nothing.
struct Routing {
  int W, L, H, K, E;
  std::vector<int> T;
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<uint8_t>> in_rank;  // [T, W]
  std::vector<std::vector<uint8_t>> in_node;  // [T, W / L]
};

inline Routing make_routing(int W, int L, int H, int K, int E, int base_tokens, int tokens_per_rank, unsigned seed) {
  Routing w{W, L, H, K, E, {}, {}, {}, {}, {}, {}};
  const int epr = E / W, N = W / L;
  std::mt19937 rng(seed);
  for (int r = 0; r < W; ++r) {
    const int T = r == 1 ? 0 : base_tokens + tokens_per_rank * r;
    w.T.push_back(T);
    w.x.emplace_back(static_cast<size_t>(T) * H);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        w.x[r][t * H + h] = moe_dispatch::intranode::float_to_bf16(static_cast<float>((t * 7 + h + 3 * r) % 17 - 8));
    w.idx.emplace_back(static_cast<size_t>(T) * K, -1);
    w.weights.emplace_back(static_cast<size_t>(T) * K, 0.0f);
    w.in_rank.emplace_back(static_cast<size_t>(T) * W, 0);
    w.in_node.emplace_back(static_cast<size_t>(T) * N, 0);
    for (int t = 0; t < T; ++t) {
      std::vector<int> experts(E);
      for (int e = 0; e < E; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < K; ++k) {
        if (rng() % 5 == 0) continue;
        const int dest = experts[k] / epr;
        w.idx[r][t * K + k] = experts[k];
        w.weights[r][t * K + k] = 0.25f * static_cast<float>(1 + rng() % 4);
        w.in_rank[r][t * W + dest] = 1;
        w.in_node[r][t * N + dest / L] = 1;
      }
    }
  }
  return w;
}

// The receive side of a dispatch: outputs for `rows` rows of H bf16, K top-k, E / W experts.
struct Received {
  std::vector<uint16_t> x;
  std::vector<int64_t> idx;
  std::vector<float> weights;
  std::vector<int32_t> src;
  std::vector<int64_t> per_expert;
  Received(int rows, int H, int K, int experts)
      : x(static_cast<size_t>(rows) * H), idx(static_cast<size_t>(rows) * K), weights(static_cast<size_t>(rows) * K),
        src(rows), per_expert(experts, 0) {}
};

// A dispatch rank's inputs (rank r of `w`) and outputs (`out`, `overflow`); any of the rank
// structs of intranode.cuh / internode.cuh.
template <class Rank>
void connect(Rank& d, const Routing& w, int r, Received& out, int32_t* overflow) {
  d.x = reinterpret_cast<const char*>(w.x[r].data());
  d.topk_idx = w.idx[r].data();
  d.topk_weights = w.weights[r].data();
  d.recv_x = reinterpret_cast<char*>(out.x.data());
  d.recv_topk_idx = out.idx.data();
  d.recv_topk_weights = out.weights.data();
  d.recv_src_idx = out.src.data();
  d.num_recv_per_expert = out.per_expert.data();
  d.overflow = overflow;
  d.num_tokens = w.T[r];
}

// Runs rank(r) (0 or 1) for every r on its own thread; prints "ok", or the first failing rank
// and the timeout record, and returns the exit code.
inline int run_ranks(int W, const moe_dispatch::intranode::ErrorRecord& error, const std::function<int(int)>& rank) {
  std::vector<int> status(W, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < W; ++r) ranks.emplace_back([&status, &rank, r]() { status[r] = rank(r); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < W; ++r) {
    if (status[r] != 0) {
      std::printf("failed (rank %d first); timeout record: flag %d phase %d role %d rank %d channel %d peer %d "
                  "counter %d expected %d observed %d\n", r, error.flag, error.phase, error.role, error.rank,
                  error.channel, error.peer, error.counter, error.expected, error.observed);
      return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}

}  // namespace tsan

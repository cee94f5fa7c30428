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

using intranode::ThreadBarrier;
using intranode::Threads;

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
  if (o.group_warps < 1 || o.group_warps > 8)
    throw std::invalid_argument("cpu group_warps must be in [1, 8], got " + std::to_string(o.group_warps));
  if (o.num_workers < 1 || o.num_workers > kNumWarps - 1)
    throw std::invalid_argument("cpu num_workers must be in [1, " + std::to_string(kNumWarps - 1) + "], got " +
                                std::to_string(o.num_workers));
  if (c.symmetric != nullptr) throw std::invalid_argument("the CPU backend runs loopback buffers, not NVSHMEM");
}

// Threads of group-structured blocks: per (launched rank, channel, role) one group of
// group_warps threads per node.
template <class Role>
void run_groups(const Common& c, const CpuOptions& o, int num_roles, Role role) {
  struct Block {
    GroupState groups[kMaxNodes];
    std::vector<std::unique_ptr<ThreadBarrier>> barriers;
  };
  std::vector<std::unique_ptr<Block>> blocks;
  Threads threads;
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const int rank = c.rank_begin + i;
    if (rank == c.skip_rank) continue;
    for (int channel = 0; channel < c.num_channels; ++channel) {
      for (int r = 0; r < num_roles; ++r) {
        blocks.push_back(std::make_unique<Block>());
        Block* block = blocks.back().get();
        std::memset(block->groups, 0, sizeof(block->groups));
        for (int node = 0; node < c.num_nodes; ++node) {
          block->barriers.push_back(o.group_warps > 1 ? std::make_unique<ThreadBarrier>(o.group_warps) : nullptr);
          ThreadBarrier* barrier = block->barriers.back().get();
          for (int w = 0; w < o.group_warps; ++w) {
            threads.spawn([&c, &o, role, rank, channel, r, node, w, block, barrier]() {
              HostRdmaCtx ctx{{&c, barrier}};
              role(ctx, r, rank, channel, node, w, o.group_warps, &block->groups[node]);
            });
          }
        }
      }
    }
  }
  threads.join();
}

}  // namespace

void run_node_notify_cpu(const NotifyArgs& args) {
  const Common& c = args.common;
  std::vector<std::unique_ptr<NotifyState>> states;
  Threads threads;
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const int rank = c.rank_begin + i;
    if (rank == c.skip_rank) continue;
    states.push_back(std::make_unique<NotifyState>());
    NotifyState* st = states.back().get();
    threads.spawn([&args, rank, st]() {
      HostRdmaCtx ctx{{&args.common, nullptr}};
      node_notify(ctx, args, rank, st);
    });
  }
  threads.join();
}

void run_node_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options) {
  check_cpu(args.common, options);
  run_groups(args.common, options, 2,
             [&args](HostRdmaCtx& ctx, int role, int rank, int channel, int node, int warp, int group_warps,
                     GroupState* gs) {
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
  std::vector<std::unique_ptr<CombineRecvState>> states;
  Threads receivers;
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const int rank = c.rank_begin + i;
    if (rank == c.skip_rank) continue;
    for (int channel = 0; channel < c.num_channels; ++channel) {
      states.push_back(std::make_unique<CombineRecvState>());
      CombineRecvState* st = states.back().get();
      std::memset(st, 0, sizeof(*st));
      receivers.spawn([&args, &options, rank, channel, st]() {
        HostRdmaCtx ctx{{&args.common, nullptr}};
        node_combine_recv_coordinator(ctx, args, rank, channel, options.num_workers, st);
      });
      for (int w = 0; w < options.num_workers; ++w) {
        receivers.spawn([&args, &options, dtype, rank, channel, w, st]() {
          HostRdmaCtx ctx{{&args.common, nullptr}};
          if (dtype == intranode::kBf16) {
            node_combine_recv_worker<intranode::Bf16Tag>(ctx, args, rank, channel, w, options.num_workers, st);
          } else {
            node_combine_recv_worker<intranode::F32Tag>(ctx, args, rank, channel, w, options.num_workers, st);
          }
        });
      }
    }
  }
  std::exception_ptr send_error;
  try {
    run_groups(c, options, 1,
               [&args](HostRdmaCtx& ctx, int, int rank, int channel, int node, int warp, int group_warps,
                       GroupState* gs) { node_combine_send(ctx, args, rank, channel, node, warp, group_warps, gs); });
  } catch (...) {
    send_error = std::current_exception();
  }
  receivers.join();
  if (send_error) std::rethrow_exception(send_error);
}

}  // namespace internode
}  // namespace moe_dispatch

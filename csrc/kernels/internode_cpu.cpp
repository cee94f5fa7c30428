// CPU backend of the internode protocol: the role functions of internode_roles.cuh and
// internode_fused_roles.cuh (the code the kernels run) with one std::thread per warp. A
// put-with-signal is a memcpy into the peer's buffer followed by a release store of the
// signal, which is the ordering NVSHMEM guarantees (data before signal); waits acquire.
// Timeouts count nanoseconds. The ThreadSanitizer driver csrc/tests/internode_tsan.cpp runs it.
#include "kernels/internode_cpu.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/internode_fused_roles.cuh"
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
  bool signal_reached(const uint64_t* sig, uint64_t value) const { return __atomic_load_n(sig, __ATOMIC_ACQUIRE) >= value; }
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
  void signal_add_at(int rank, int peer, uint64_t* sig, uint64_t value) const {
    __atomic_fetch_add(at_peer(rank, peer, sig), value, __ATOMIC_RELEASE);
  }
  void reset_signal(uint64_t* sig) const { __atomic_store_n(sig, 0, __ATOMIC_RELEASE); }
};

void check_cpu(const Common& c, const CpuOptions& o) {
  intranode::check_cpu_options(o);
  if (c.symmetric != nullptr) throw std::invalid_argument("the CPU backend runs loopback buffers, not NVSHMEM");
}

template <class Args>
auto rdma_epochs(const Args& args) {
  return intranode::op_epochs(args.common,
                              [&args](int rank) { return args.common.layout.op_epoch(args.common.buffers[rank]); });
}

// One block's warp groups on threads: num_groups groups of group_warps threads, each group
// with its GroupState (in `states`) and, when it has several threads, its barrier; role(ctx,
// group, warp, state).
template <class Role>
void spawn_groups(Threads& threads, std::vector<std::unique_ptr<ThreadBarrier>>& barriers, const Common& c,
                  int num_groups, int group_warps, GroupState* states, Role role) {
  for (int g = 0; g < num_groups; ++g) {
    barriers.push_back(group_warps > 1 ? std::make_unique<ThreadBarrier>(group_warps) : nullptr);
    ThreadBarrier* barrier = barriers.back().get();
    for (int w = 0; w < group_warps; ++w)
      threads.spawn([&c, role, g, w, barrier, states]() {
        HostRdmaCtx ctx{{&c, barrier}};
        role(ctx, g, w, &states[g]);
      });
  }
}

// One reducer block on threads: a coordinator and `workers` workers sharing `state`.
template <class State, class Coordinator, class Worker>
void spawn_reducer(Threads& threads, const Common& c, int workers, State* state, Coordinator coordinator, Worker worker) {
  threads.spawn([&c, coordinator, state]() {
    HostRdmaCtx ctx{{&c, nullptr}};
    coordinator(ctx, state);
  });
  for (int w = 0; w < workers; ++w)
    threads.spawn([&c, worker, w, state]() {
      HostRdmaCtx ctx{{&c, nullptr}};
      worker(ctx, w, state);
    });
}

// Per (launched rank, channel, role) one block(rank, channel, role, block_state, threads).
template <class Block, class Spawn>
void run_blocks(const Common& c, int num_roles, Spawn spawn) {
  std::vector<std::unique_ptr<Block>> blocks;
  Threads threads;
  std::exception_ptr error;
  try {
    intranode::for_each_launched_rank(c, [&](int rank) {
      for (int channel = 0; channel < c.num_channels; ++channel)
        for (int role = 0; role < num_roles; ++role) {
          blocks.push_back(std::make_unique<Block>());
          spawn(rank, channel, role, blocks.back().get(), threads);
        }
    });
  } catch (...) {
    error = std::current_exception();  // join what started before rethrowing
  }
  threads.join();
  if (error) std::rethrow_exception(error);
}

// The source reducers of the two pipelines (internode_roles.cuh SourceReduce).
SourceReduce node_source(HostRdmaCtx& ctx, const CombineArgs& a, int rank, int channel, uint64_t epoch,
                         bool coordinator) {
  const CombineRank& me = a.ranks[rank - a.common.rank_begin];
  return source_reduce(ctx, a.common, me.check, me.is_token_in_rank, me.out, me.num_tokens, a.slot, rank, channel,
                       epoch, false, coordinator, coordinator && channel == 0);
}

SourceReduce fused_source(HostRdmaCtx& ctx, const FusedCombineArgs& a, int rank, int channel, uint64_t epoch,
                          bool coordinator) {
  const FusedCombineRank& me = a.ranks[rank - a.common.rank_begin];
  return source_reduce(ctx, a.common, me.check, me.is_token_in_node, me.out, me.num_tokens, a.slot, rank, channel,
                       epoch, true, coordinator, false);
}

}  // namespace

// ---- staged pipeline ----------------------------------------------------------------------------

void run_node_notify_cpu(const NotifyArgs& args) {
  intranode::run_notify_threads<HostRdmaCtx, NotifyState>(
      args, [](HostRdmaCtx& ctx, const NotifyArgs& a, int rank, NotifyState* st) { node_notify(ctx, a, rank, st); });
}

// The group-structured blocks have one group per node.
void run_node_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options) {
  check_cpu(args.common, options);
  const auto epochs = rdma_epochs(args);
  intranode::run_groups<HostRdmaCtx, kMaxNodes>(
      args.common, options, args.common.num_nodes, 2,
      [&](HostRdmaCtx& ctx, int role, int rank, int channel, int node, int warp, int group_warps, GroupState* gs) {
        if (role == 0) {
          node_dispatch_send(ctx, args, rank, channel, node, warp, group_warps, epochs(rank), gs);
        } else {
          node_dispatch_recv(ctx, args, rank, channel, node, warp, group_warps, epochs(rank), gs);
        }
      });
  epochs.advance();
}

template <class T>
void run_node_combine_typed(const CombineArgs& args, const CpuOptions& options) {
  const Common& c = args.common;
  const int workers = options.num_workers;
  const auto epochs = rdma_epochs(args);
  intranode::run_combine_threads<HostRdmaCtx, CombineRecvState>(
      c, workers,
      [&](HostRdmaCtx& ctx, int rank, int channel, CombineRecvState* st) {
        ring::reduce_coordinator(ctx, node_source(ctx, args, rank, channel, epochs(rank), true), workers, st);
      },
      [&](HostRdmaCtx& ctx, int rank, int channel, int w, CombineRecvState* st) {
        ring::reduce_worker<T>(ctx, node_source(ctx, args, rank, channel, epochs(rank), false), args.slot.x_bytes, w,
                               workers, st);
      },
      [&]() {
        intranode::run_groups<HostRdmaCtx, kMaxNodes>(
            c, options, c.num_nodes, 1,
            [&](HostRdmaCtx& ctx, int, int rank, int channel, int node, int warp, int group_warps, GroupState* gs) {
              node_combine_send(ctx, args, rank, channel, node, warp, group_warps, epochs(rank), gs);
            });
      });
  epochs.advance();
}

void run_node_combine_cpu(const CombineArgs& args, intranode::DType dtype, const CpuOptions& options) {
  check_cpu(args.common, options);
  intranode::with_dtype(dtype, [&](auto tag) { run_node_combine_typed<decltype(tag)>(args, options); });
}

// ---- fused pipeline -------------------------------------------------------------------------------

void run_fused_notify_cpu(const FusedNotifyArgs& args) {
  intranode::run_notify_threads<HostRdmaCtx, FusedNotifyState>(
      args, [](HostRdmaCtx& ctx, const FusedNotifyArgs& a, int rank, FusedNotifyState* st) {
        fused_notify(ctx, a, rank, st);
      });
}

// Blocks as on the GPU (internode_fused.cu): RDMA senders with a group per node, forwarders and
// NVLink receivers with a group per local rank; the forwarder group 0 of channel 0 runs a cached
// dispatch's header round first.
void run_fused_dispatch_cpu(const FusedDispatchArgs& args, const CpuOptions& options) {
  const Common& c = args.common;
  check_cpu(c, options);
  const auto epochs = rdma_epochs(args);
  struct Block {
    GroupState groups[kMaxNodes] = {};
    ForwardState forward = {};
    std::vector<std::unique_ptr<ThreadBarrier>> barriers;
  };
  const int gw = options.group_warps;
  run_blocks<Block>(c, 3, [&](int rank, int channel, int role, Block* b, Threads& threads) {
    const uint64_t epoch = epochs(rank);
    const bool handshake = args.ranks[rank - c.rank_begin].peer_ok == nullptr && channel == 0;
    if (role == 0) {
      spawn_groups(threads, b->barriers, c, c.num_nodes, gw, b->groups, [&args, rank, channel, epoch, gw](
                                                                             HostRdmaCtx& ctx, int g, int w, GroupState* gs) {
        fused_rdma_send(ctx, args, rank, channel, g, args.common.num_nodes, w, gw, epoch, gs);
      });
    } else if (role == 1) {
      ForwardState* fs = &b->forward;
      spawn_groups(threads, b->barriers, c, c.ranks_per_node, gw, b->groups,
                   [&args, rank, channel, epoch, gw, handshake, fs](HostRdmaCtx& ctx, int g, int w, GroupState* gs) {
                     const FusedDispatchRank& me = args.ranks[rank - args.common.rank_begin];
                     if (handshake && g == 0 && w == 0) fused_handshake(ctx, args.common, me.check, rank, epoch, kNodeDispatch);
                     fused_forward(ctx, args, rank, channel, g, w, gw, epoch, fs, gs);
                   });
    } else {
      spawn_groups(threads, b->barriers, c, c.ranks_per_node, gw, b->groups, [&args, rank, channel, epoch, gw](
                                                                                 HostRdmaCtx& ctx, int g, int w, GroupState* gs) {
        fused_nvl_recv(ctx, args, rank, channel, g, w, gw, epoch, gs);
      });
    }
  });
  epochs.advance();
}

// Blocks as on the GPU: holder senders (a group per local rank), the forwarder reducer (its
// coordinator of channel 0 runs the header round first) and the source reducer.
template <class T>
void run_fused_combine_typed(const FusedCombineArgs& args, const CpuOptions& options) {
  const Common& c = args.common;
  const auto epochs = rdma_epochs(args);
  struct Block {
    GroupState groups[kMaxLocal] = {};
    ring::ReduceState<kMaxLocal> forward = {};
    CombineRecvState source = {};
    std::vector<std::unique_ptr<ThreadBarrier>> barriers;
  };
  const int gw = options.group_warps, workers = options.num_workers;
  run_blocks<Block>(c, 3, [&](int rank, int channel, int role, Block* b, Threads& threads) {
    const uint64_t epoch = epochs(rank);
    const FusedCombineRank* me = &args.ranks[rank - c.rank_begin];
    if (role == 0) {
      spawn_groups(threads, b->barriers, c, c.ranks_per_node, gw, b->groups,
                   [&args, rank, channel, epoch, gw](HostRdmaCtx& ctx, int g, int w, GroupState* gs) {
                     fused_holder_send(ctx, args, rank, channel, g, w, gw, epoch, gs);
                   });
    } else if (role == 1) {
      // Each thread builds its own tables (the GPU shares one copy per block).
      auto source = [&args, rank, channel, epoch, me](HostRdmaCtx& ctx, ForwardTables* t) {
        forward_tables(ctx, args, rank, channel, epoch, t);
        return ForwardCombineSource{&args.common, &args, me, t, ctx.buffer(rank), nvl_buffer(args.common, rank), rank,
                                    channel, epoch};
      };
      spawn_reducer(
          threads, c, workers, &b->forward,
          [&args, source, rank, channel, epoch, workers, me](HostRdmaCtx& ctx, ring::ReduceState<kMaxLocal>* st) {
            if (channel == 0) fused_handshake(ctx, args.common, me->check, rank, epoch, kNodeCombine);
            ForwardTables t;
            const ForwardCombineSource src = source(ctx, &t);
            ring::reduce_coordinator(ctx, src, workers, st);
            forward_combine_finish(ctx, src);
          },
          [&args, source, workers](HostRdmaCtx& ctx, int w, ring::ReduceState<kMaxLocal>* st) {
            ForwardTables t;
            ring::reduce_worker<T>(ctx, source(ctx, &t), args.slot.x_bytes, w, workers, st);
          });
    } else {
      spawn_reducer(
          threads, c, workers, &b->source,
          [&args, rank, channel, epoch, workers](HostRdmaCtx& ctx, CombineRecvState* st) {
            ring::reduce_coordinator(ctx, fused_source(ctx, args, rank, channel, epoch, true), workers, st);
          },
          [&args, rank, channel, epoch, workers](HostRdmaCtx& ctx, int w, CombineRecvState* st) {
            ring::reduce_worker<T>(ctx, fused_source(ctx, args, rank, channel, epoch, false), args.slot.x_bytes, w,
                                   workers, st);
          });
    }
  });
  epochs.advance();
}

void run_fused_combine_cpu(const FusedCombineArgs& args, intranode::DType dtype, const CpuOptions& options) {
  check_cpu(args.common, options);
  intranode::with_dtype(dtype, [&](auto tag) { run_fused_combine_typed<decltype(tag)>(args, options); });
}

}  // namespace internode
}  // namespace moe_dispatch

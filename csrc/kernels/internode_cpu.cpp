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

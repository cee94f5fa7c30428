// CPU backend of the intranode protocol: runs the role functions of intranode_roles.cuh - the
// very code the kernels run - with one std::thread per warp (width 1, lane 0), std atomics
// for the counters and steady_clock bounded waits. Buffers are host memory. Used by the
// loopback harness on machines without a GPU, where tests compare its results with
// moe_dispatch.reference, and by the ThreadSanitizer driver csrc/tests/intranode_tsan.cpp.
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

uint64_t* epoch_word(const Common& c, int rank) { return c.layout.epoch(c.buffers[rank]); }

}  // namespace

void run_notify_cpu(const NotifyArgs& args) {
  const auto epochs = op_epochs(args.common, [&](int rank) { return epoch_word(args.common, rank); });
  run_notify_threads<HostCtx, NotifyState>(args, [&epochs](HostCtx& ctx, const NotifyArgs& a, int rank,
                                                           NotifyState* st) { notify(ctx, a, rank, epochs(rank), st); });
}

// The group-structured blocks have one group per peer rank.
void run_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options) {
  check_cpu(options, args.common.num_ranks);
  const auto epochs = op_epochs(args.common, [&](int rank) { return epoch_word(args.common, rank); });
  run_groups<HostCtx, kMaxRanks>(
      args.common, options, args.common.num_ranks, 2,
      [&](HostCtx& ctx, int role, int rank, int channel, int peer, int warp, int group_warps, GroupState* gs) {
        if (role == 0) {
          dispatch_send(ctx, args, rank, channel, peer, warp, group_warps, epochs(rank), gs);
        } else {
          dispatch_recv(ctx, args, rank, channel, peer, warp, group_warps, epochs(rank), gs);
        }
      });
  epochs.advance();
}

template <class T>
void run_combine_typed(const CombineArgs& args, const CpuOptions& options) {
  const Common& c = args.common;
  const int workers = options.num_workers;
  const auto epochs = op_epochs(c, [&](int rank) { return epoch_word(c, rank); });
  run_combine_threads<HostCtx, CombineRecvState>(
      c, workers,
      [&](HostCtx& ctx, int rank, int channel, CombineRecvState* st) {
        const CombineSource src = combine_source(ctx, args, rank, channel, epochs(rank), true);
        ring::reduce_coordinator(ctx, src, workers, st);
      },
      [&](HostCtx& ctx, int rank, int channel, int w, CombineRecvState* st) {
        const CombineSource src = combine_source(ctx, args, rank, channel, epochs(rank), false);
        ring::reduce_worker<T>(ctx, src, args.slot.x_bytes, w, workers, st);
      },
      [&]() {
        run_groups<HostCtx, kMaxRanks>(
            c, options, c.num_ranks, 1,
            [&](HostCtx& ctx, int, int rank, int channel, int peer, int warp, int group_warps, GroupState* gs) {
              combine_send(ctx, args, rank, channel, peer, warp, group_warps, epochs(rank), gs);
            });
      });
  epochs.advance();
}

void run_combine_cpu(const CombineArgs& args, DType dtype, const CpuOptions& options) {
  check_cpu(options, args.common.num_ranks);
  with_dtype(dtype, [&](auto tag) { run_combine_typed<decltype(tag)>(args, options); });
}

}  // namespace intranode
}  // namespace moe_dispatch


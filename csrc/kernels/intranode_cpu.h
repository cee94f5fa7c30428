// CPU backend of the intranode protocol (intranode_cpu.cpp): the kernels' role code on
// threads, over host-memory buffers. Synchronous: returns when every simulated rank is done
// (or has given up after a timeout, recorded in common.error like the kernels do).
#pragma once

#include "kernels/intranode.cuh"

namespace moe_dispatch {
namespace intranode {

// Threads standing in for warps; the GPU uses kNumWarps / W warps per group and
// kNumWarps - 1 combine workers.
struct CpuOptions {
  int group_warps = 2;  // warps per peer group (dispatch send/recv, combine send)
  int num_workers = 3;  // combine receiver workers per channel
};

void run_notify_cpu(const NotifyArgs& args);
void run_dispatch_cpu(const DispatchArgs& args, const CpuOptions& options);
void run_combine_cpu(const CombineArgs& args, DType dtype, const CpuOptions& options);

}  // namespace intranode
}  // namespace moe_dispatch
